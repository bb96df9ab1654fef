"""kvfence: an LLM serving engine whose KV cache is a security boundary (README.md).

The package's own names are vLLM's offline API (kvfence.offline), loaded on first use, so that importing
a light module (kvfence.trail, kvfence.pins) never loads torch.
"""

from __future__ import annotations

from typing import Any

_OFFLINE = frozenset({"LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"})


def __getattr__(name: str) -> Any:
    if name in _OFFLINE:
        from kvfence import offline

        return getattr(offline, name)
    raise AttributeError(f"module 'kvfence' has no attribute {name!r}")
