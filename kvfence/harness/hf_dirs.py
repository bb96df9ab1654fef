"""Hugging Face directories of the packaged GGUFs, as a user converting one with transformers gets them.

Contract: `bf16_dir_from_gguf` loads `gguf` with transformers (dequantized on load: nothing of the GGUF's
quantization is left to save), writes it with `save_pretrained` in bfloat16 beside transformers' own
tokenizer files, and returns `target`. transformers is a test and benchmark dependency, imported here
only when called.
"""

from __future__ import annotations

from pathlib import Path

import torch


def bf16_dir_from_gguf(gguf: Path, target: Path) -> Path:
    import transformers  # not a serving dependency: imported when called

    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model.hf_quantizer = None
    del model.config.quantization_config
    model.to(torch.bfloat16).save_pretrained(target)
    transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(target)
    return target
