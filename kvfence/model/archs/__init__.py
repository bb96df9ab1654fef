"""The architectures kvfence serves, one small file each, found by the GGUF's `general.architecture`."""

from __future__ import annotations

from kvfence.model.archs.base import Architecture
from kvfence.model.archs.gemma3 import Gemma3
from kvfence.model.archs.llama import Llama
from kvfence.model.archs.qwen import Qwen2, Qwen3

ARCHITECTURES: dict[str, Architecture] = {arch.name: arch for arch in (Llama(), Qwen2(), Qwen3(), Gemma3())}


def architecture(name: object) -> Architecture:
    """The architecture named `name`; a one-line refusal naming the supported ones otherwise."""
    if name not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {name!r}: kvfence serves {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[str(name)]
