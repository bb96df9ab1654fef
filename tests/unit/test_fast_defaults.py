"""Serving's defaults are the fast path where it runs: a block-quantized model on CPU multiplies int8 rows
and keeps a float16 pool (what llama.cpp computes); `activation_dtype="float32"` alone gives the exact
path; weights not stored in blocks stay exact. The start-up log says which, and the check made before the
weights load sizes the pool as the engine will."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from kvfence.cli_checks import check_engine
from kvfence.config import EngineConfig
from kvfence.engine.builder import accuracy_line, pool_dtype
from kvfence.engine.engine import LLMEngine
from kvfence.model.transformer import Transformer
from kvfence.startup import StartupError


def _started(model: Transformer, **overrides: object) -> tuple[torch.dtype, list[str]]:
    """The pool's dtype and the start-up log of an engine over `model`."""
    heard: list[str] = []
    config = EngineConfig(**{"num_pages": 64, "page_size": 4, "max_model_len": 48, **overrides})  # type: ignore[arg-type]
    engine = LLMEngine(config, model, log=heard.append)
    return engine.pool.kv.dtype, heard


@pytest.mark.parametrize(
    ("activation", "expected"),
    [
        (
            "auto",
            (
                "int8",
                torch.float16,
                "numerics: fast (int8 activations, float16 KV cache; "
                "--activation-dtype float32 for the exact float32 path)",
            ),
        ),
        ("float32", ("float32", torch.float32, "numerics: float32 activations, float32 KV cache")),
    ],
)
def test_a_quantized_model_serves_the_fast_path_unless_told_exact(activation: str, expected: tuple) -> None:
    model = tiny_model(decode_matmul="auto", activation_dtype=activation)
    dtype, heard = _started(model, activation_dtype=activation)
    assert (model.activation_dtype, dtype) == expected[:2] and expected[2] in heard
    config = EngineConfig(activation_dtype=activation)
    assert pool_dtype(config, model) == dtype
    assert config.expected_kv_dtype(block_quantized=True) == str(dtype).removeprefix("torch.")


def test_weights_not_in_blocks_stay_exact() -> None:
    model = tiny_model()  # float32 tensors, no codes: nothing for the int8 kernel to multiply
    dtype, heard = _started(model)
    assert (model.activation_dtype, dtype) == ("float32", torch.float32)
    assert "numerics: float32 activations, float32 KV cache" in heard
    assert EngineConfig().expected_kv_dtype(block_quantized=False) == "float32"


def test_the_check_before_loading_sizes_the_pool_as_the_fast_path_holds_it() -> None:
    """SmolLM2 (block-quantized) with a 256 MiB pool: 5,824 float32 tokens (whole pages) do not hold its 8,192
    window, 11,648 float16 ones do. The default starts; the exact path is refused before any weight loads."""
    memory = 256 * 2**20
    check_engine(EngineConfig(kv_cache_memory=memory))
    with pytest.raises(StartupError, match="--max-model-len 5824 "):
        check_engine(EngineConfig(kv_cache_memory=memory, activation_dtype="float32"))


def test_start_up_says_where_the_fast_path_misses_its_accuracy_goal(tmp_path: Path) -> None:
    """bench/accuracy.py measured the fast path below its top-1 goal on the packaged SmolLM2: serving that
    file fast says so and names the exact path's flag; the exact path, or another file, says nothing."""
    smollm2 = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    fast, exact = (
        tiny_model(decode_matmul="auto", activation_dtype="auto"),
        tiny_model(decode_matmul="auto", activation_dtype="float32"),
    )
    warning = accuracy_line(fast, smollm2)
    assert warning is not None and "96.96%" in warning and warning.endswith("--activation-dtype float32")
    assert accuracy_line(exact, smollm2) is None and accuracy_line(fast, tmp_path / "other.gguf") is None
    heard: list[str] = []
    LLMEngine(
        EngineConfig(num_pages=64, page_size=4, max_model_len=48), fast, log=heard.append, model_file=smollm2
    )
    assert warning in heard
