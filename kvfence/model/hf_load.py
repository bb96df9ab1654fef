"""Load a Hugging Face model directory (hf_dir.py) into the GGUF-named tensors the rest of kvfence reads,
as `load_gguf` loads a GGUF file: the same `GGUFModel`, so the model, the engine and the tokenizer's
caller need not know which they were given (`load_model` takes either).

Contract: every tensor is read from the directory's safetensors under its GGUF name, in torch Linear layout
([out_features, in_features], HF's own: llama's Q/K rows are already in the rotate-half order the forward
uses). What differs from a GGUF file is undone here: Gemma 3's norms are stored as w and multiply by
(1 + w), so 1 is added (in float32, as HF computes it); Llama 3's RoPE scaling becomes the
`rope_freqs.weight` divisors llama.cpp's converter writes. Norms and biases are converted to `dtype`; a
16-bit (BF16 or F16) weight under a float32 model stays 16-bit, the only copy of it (the forward multiplies
float32 rows by it: model/half_matmul.py), any other weight is converted to `dtype`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from kvfence.model.gguf import GGUFModel, load_gguf
from kvfence.model.half_matmul import HALF_DTYPES
from kvfence.model.hf_dir import HFDir, StoredTensor, is_hf_dir, read_dir

_PROGRESS_REPORTS = 4


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    progress: Callable[[str], None] | None = None,
) -> GGUFModel:
    """A GGUF file (`load_gguf`) or a Hugging Face directory (`load_hf_dir`), whichever `path` is."""
    load = load_hf_dir if is_hf_dir(Path(path)) else load_gguf
    return load(path, dtype=dtype, device=device, progress=progress)


def load_hf_dir(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    progress: Callable[[str], None] | None = None,
) -> GGUFModel:
    """Read the directory's weights (ValueError, one line, for a directory kvfence cannot serve)."""
    path = Path(path)
    report = progress or (lambda _message: None)
    start = time.perf_counter()
    hf = read_dir(path)
    report(
        f"{path.name}: {len(hf.tensors)} tensors, {hf.config.num_layers} layers ({hf.config.architecture})"
    )
    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[tuple[str, StoredTensor]]] = {}
    for name, stored in hf.tensors.items():
        by_file.setdefault(stored.file, []).append((name, stored))
    every = max(1, len(hf.tensors) // _PROGRESS_REPORTS)
    for file, entries in sorted(by_file.items()):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name, stored in entries:
                tensors[name] = _as_model(hf, name, f.get_tensor(stored.hf_name), dtype).to(device)
                if len(tensors) % every == 0 or len(tensors) == len(hf.tensors):
                    took = time.perf_counter() - start
                    report(f"{path.name}: {len(tensors)}/{len(hf.tensors)} tensors ({took:.1f}s)")
    if hf.rope_freqs is not None:
        tensors["rope_freqs.weight"] = torch.tensor(hf.rope_freqs, dtype=dtype, device=device)
    kinds = Counter(stored.dtype for stored in hf.tensors.values())
    return GGUFModel(hf.config, tensors, hf.metadata, path, {}, dict(sorted(kinds.items())))


def _as_model(hf: HFDir, name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A stored tensor as the forward reads it under its GGUF name."""
    if tensor.dim() == 2 and tensor.dtype in HALF_DTYPES and dtype == torch.float32:
        return tensor
    if hf.config.architecture == "gemma3" and name.endswith("norm.weight"):
        return (tensor.float() + 1.0).to(dtype)  # Gemma's RMSNorm multiplies by (1 + w)
    return tensor.to(dtype)
