"""bench/hf_prefill.py's harness (kvfence/harness/hf_prefill.py): the 16-bit copy of a float32 directory
holds the same weights rounded, the layer weights and their FLOP count are every projection's, and the
interleaved rounds call every run once in turn, a warm-up round first."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from test_archs import hf_model
from test_hf_dir import write_dir

from kvfence.harness.hf_prefill import interleaved_best, layer_weights, prefill_flops, sixteen_bit_dir
from kvfence.model.hf_dir import WEIGHTS


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(directory / WEIGHTS), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def test_the_copy_and_its_work(tmp_path: Path) -> None:
    source = write_dir(tmp_path / "float32", hf_model("llama"), dtype=torch.float32)
    copy = sixteen_bit_dir(source, tmp_path / "bf16", torch.bfloat16)
    assert sorted(p.name for p in copy.iterdir()) == sorted(p.name for p in source.iterdir())
    wide, narrow = tensors(source), tensors(copy)
    assert wide.keys() == narrow.keys()
    assert all(narrow[n].dtype == torch.bfloat16 and torch.equal(narrow[n], wide[n].bfloat16()) for n in wide)
    weights = layer_weights(source)
    projections = [n for n in wide if n.endswith("_proj.weight")]
    assert len(weights) == len(projections) and all(w.dtype == torch.float32 for w in weights)
    assert prefill_flops(weights, 3) == 6 * sum(wide[n].numel() for n in projections)


def test_rounds_call_every_run_in_turn() -> None:
    calls: list[str] = []
    best = interleaved_best({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=2)
    assert calls == ["a", "b"] * 3 and best.keys() == {"a", "b"}
    assert all(seconds >= 0 for seconds in best.values())  # a monotonic clock's differences
