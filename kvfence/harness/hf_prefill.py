"""Prefill of a Hugging Face directory against BLAS over the same weights: 16-bit copies of a float32
directory, kvfence's TTFT over each, and torch's matmuls (F.linear) over the same layer weights.

Contracts: `sixteen_bit_dir` writes `source`'s tensors in `dtype` (every other file copied as it is);
`layer_weights` are the float32 [out, in] weights of every layer's projections, in the forward's order,
with the width of the rows each multiplies; `prefill_flops` counts 2 x those weights x tokens (attention
and the LM head left out: the same count for every row compared); `ttft_run` runs one request with one
output token over a fresh prompt each call (no prefix-cache hit); `linear_run` F.linear over every weight
at `rows` rows, the rows and weights in `dtype`; `interleaved_best` is each run's best wall time over
rounds that call every run once in turn (on a shared machine, each then sees the same load).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from kvfence.config import EngineConfig
from kvfence.engine.engine import LLMEngine
from kvfence.harness.offline_engine import make_prompts
from kvfence.model.hf_dir import WEIGHTS, read_dir
from kvfence.model.hf_load import load_hf_dir
from kvfence.model.tokenizer import Tokenizer
from kvfence.model.transformer import Transformer
from kvfence.sampling import SamplingParams

_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def sixteen_bit_dir(source: Path, target: Path, dtype: torch.dtype) -> Path:
    """`source` (one model.safetensors) with every tensor in `dtype`, written to `target`."""
    target.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.is_file() and file.name != WEIGHTS:
            shutil.copyfile(file, target / file.name)
    with safe_open(str(source / WEIGHTS), framework="pt") as f:
        tensors = {name: f.get_tensor(name).to(dtype).contiguous() for name in f.keys()}  # noqa: SIM118
    save_file(tensors, str(target / WEIGHTS), metadata={"format": "pt"})
    return target


def layer_weights(directory: Path) -> list[torch.Tensor]:
    """Every layer's projection weights, float32 [out, in], in the forward's order."""
    hf = read_dir(directory)
    weights = []
    for i in range(hf.config.num_layers):
        for name in _PROJECTIONS:
            stored = hf.tensors[f"blk.{i}.{name}.weight"]
            with safe_open(str(stored.file), framework="pt") as f:
                weights.append(f.get_tensor(stored.hf_name).float())
    return weights


def prefill_flops(weights: list[torch.Tensor], tokens: int) -> float:
    return 2.0 * sum(w.numel() for w in weights) * tokens


def linear_run(weights: list[torch.Tensor], rows: int, dtype: torch.dtype) -> Callable[[], None]:
    """F.linear over every weight at `rows` rows, rows and weights in `dtype`."""
    cast = [w.to(dtype) for w in weights]
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]).to(dtype) for w in cast}

    @torch.inference_mode()
    def run() -> None:
        for w in cast:
            F.linear(inputs[w.shape[1]], w)

    return run


def engine_for(directory: Path, **model_options: str) -> LLMEngine:
    """An engine over the directory with kvfence's defaults (or `model_options`), no prefix caching."""
    model = Transformer.from_gguf(load_hf_dir(directory), **model_options)
    config = EngineConfig(num_pages=512, max_model_len=2048, enable_prefix_caching=False)
    return LLMEngine(config, model, Tokenizer.from_hf_dir(directory), log=lambda _: None)


def ttft_run(engine: LLMEngine, tokens: int, calls: int) -> Callable[[], None]:
    """One request of `tokens` prompt tokens and one output token, a fresh prompt for each of `calls`."""
    assert engine.tokenizer is not None
    prompts = iter(make_prompts(engine.tokenizer, calls, tokens, salt=tokens))
    params = SamplingParams(max_tokens=1, ignore_eos=True)

    def run() -> None:
        engine.generate([next(prompts)], params)

    return run


def interleaved_best(runs: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Each run's best wall time over `repeats` rounds, after one warm-up round (oneDNN's kernels, the
    C kernels' builds); every round calls each run once, in turn."""
    best = dict.fromkeys(runs, float("inf"))
    for round_ in range(repeats + 1):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            if round_:
                best[name] = min(best[name], time.perf_counter() - started)
    return best
