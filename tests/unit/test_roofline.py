"""kvfence.harness.roofline's counts on the packaged models' headers, against the formulas worked by hand."""

from __future__ import annotations

from kvfence.harness.roofline import achieved, model_work
from kvfence.harness.synthetic import benchmark_file


def test_smollm2_counts_match_its_shape() -> None:
    work = model_work(benchmark_file("smollm2"))
    c = work.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size) == (30, 9, 3, 64, 576)
    per_layer = 576 * (9 * 64 + 2 * 3 * 64) + 9 * 64 * 576 + 3 * 576 * c.intermediate_size
    assert work.matmul_params == 30 * per_layer  # the tied embedding (a lookup here) is left out
    prompt = 2000
    assert work.prefill_flops(prompt) == 2 * work.matmul_params * prompt + 30 * 4 * 9 * 64 * prompt**2 / 2
    kv = 30 * 2 * 3 * 64 * 2 * 6000  # every layer's float16 K and V at 6,000 tokens
    assert work.decode_bytes(6000) == work.weight_bytes + kv
    assert 0.9 * 92 * 2**20 < work.weight_bytes < benchmark_file("smollm2").stat().st_size


def test_gemma_windowed_layers_count_at_most_their_window() -> None:
    work = model_work(benchmark_file("gemma3-270m"))
    c = work.config
    local, window = len(c.local_layers), c.sliding_window
    assert 0 < local < c.num_layers and window == 512
    full = c.num_layers - local
    kv_token = 2 * c.num_kv_heads * c.head_dim * 2
    assert work.decode_bytes(8000) == work.weight_bytes + (full * 8000 + local * window) * kv_token
    pairs = full * 8000**2 / 2 + local * (8000 * window - window**2 / 2)
    assert work.prefill_flops(8000) == 2 * work.matmul_params * 8000 + 4 * c.num_heads * c.head_dim * pairs
    assert work.decode_bytes(100) == work.weight_bytes + c.num_layers * 100 * kv_token  # all within window


def test_achieved_is_work_over_time() -> None:
    assert achieved(3e9, 1.5) == 2.0
    assert achieved(3e9, 0.0) == 0.0
