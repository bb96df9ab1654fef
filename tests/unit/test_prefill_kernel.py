"""The C prefill-attention kernel (`PagedDecodeKernel.prefill`): a chunk's queries over its pages against
attention worked out in float64, on every float32 build to float32's rounding and on the bf16 build
(AVX512-BF16) within a bound that follows from bf16's; a row's bits the same however the prompt is chunked,
on both; the pages before a window never read; a bad table refused before anything is read."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import tiny_model
from test_attention_prefill import HEADS, KV_HEADS, PAGE, reference

from kvfence.model import native, paged_kernel
from kvfence.model.attention import LayerAttention

CTX, PAGES = 150, 16
BUILDS = {
    "this CPU": {"bf16": False},
    "portable": {"portable": True},
    "avx2": {"avx512": False},
    "bf16": {"bf16": True},
}
HAS_BF16 = "-mavx512bf16" in native.isa_flags()
needs_bf16 = pytest.mark.skipif(not HAS_BF16, reason="this CPU does not report avx512_bf16")


def kernel(build: str = "this CPU") -> paged_kernel.PagedDecodeKernel:
    loaded, why = paged_kernel.load(**BUILDS[build])
    assert loaded is not None, why  # CI has a C compiler: a silent fallback would leave the kernel untested
    return loaded


def pool(head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pages out of order (as a pool hands them out) holding CTX positions of random K and V."""
    gen = torch.Generator().manual_seed(0)
    table = torch.randperm(PAGES, generator=gen)[: -(-CTX // PAGE)].contiguous()
    k_cache, v_cache = torch.randn(2, PAGES, PAGE, KV_HEADS, head_dim, generator=gen).to(dtype).unbind(0)
    return table, k_cache.contiguous(), v_cache.contiguous()


def stored(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return cache[table].flatten(0, 1)[:CTX].float()


@pytest.mark.parametrize("build", list(BUILDS)[:3])
@pytest.mark.parametrize("head_dim", [8, 64])  # below and at a whole register pass of p . v
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("window", [0, 40])
def test_a_chunk_is_attention_over_its_visible_positions(
    build: str, head_dim: int, dtype: torch.dtype, window: int
) -> None:
    table, k_cache, v_cache = pool(head_dim, dtype)
    keys, values = stored(k_cache, table), stored(v_cache, table)
    n_new = 37
    if window:  # every page wholly before the first query's window: poison (NaN) that must not be read
        for index in range((CTX - n_new - window + 1) // PAGE):
            k_cache[table[index]], v_cache[table[index]] = float("nan"), float("nan")
    q = torch.randn(n_new, HEADS, head_dim, generator=torch.Generator().manual_seed(1))
    spec = LayerAttention(scale=head_dim**-0.5, window=window)
    out = kernel(build).prefill(q, k_cache, v_cache, table, CTX - n_new, spec.scale, window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference(q, keys, values, spec), rtol=1e-5, atol=1e-5)


def bf16_bound(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, spec: LayerAttention
) -> torch.Tensor:
    """How far the bf16 build may be from `reference`, from bf16's unit roundoff u = 2^-8 alone: a score
    q . k * scale moves by at most e = 2u * scale * sum |q| |k| (q and k each rounded), so a softmax weight
    by a factor within exp(+-2 max e) over the row's keys; the weight and v are rounded (u each). So
    |out - reference| <= (exp(2 max e) (1 + u)^2 - 1) sum p |v|; the float32 sums add 1e-6 at most here."""
    u, group, n, ctx = 2.0**-8, HEADS // KV_HEADS, q.shape[0], keys.shape[0]
    k = keys.double().abs().repeat_interleave(group, 1)
    error = torch.einsum("qhd,khd->hqk", q.double().abs(), k) * spec.scale * 2 * u
    p, j = torch.arange(ctx - n, ctx)[:, None], torch.arange(ctx)[None, :]
    visible = (j <= p) & ((p - j < spec.window) if spec.window else True)
    worst = error.masked_fill(~visible, 0.0).amax(-1).transpose(0, 1)[..., None]  # [n, heads, 1]
    return (torch.exp(2 * worst) * (1 + u) ** 2 - 1) * reference(q, keys, values.abs(), spec) + 1e-6


@needs_bf16
@pytest.mark.parametrize("head_dim", [7, 64, 72])  # odd (a zero dim pads q and k), a register pass, a tail
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("n_new", [37, 38])  # the chunk's first key odd and even: a lone key, or none
def test_the_bf16_build_is_attention_within_bf16_rounding(
    head_dim: int, dtype: torch.dtype, window: int, n_new: int
) -> None:
    table, k_cache, v_cache = pool(head_dim, dtype)
    keys, values = stored(k_cache, table), stored(v_cache, table)
    for index in range((CTX - n_new - window + 1) // PAGE if window else 0):  # unread pages: NaN
        k_cache[table[index]], v_cache[table[index]] = float("nan"), float("nan")
    q = torch.randn(n_new, HEADS, head_dim, generator=torch.Generator().manual_seed(1))
    spec = LayerAttention(scale=head_dim**-0.5, window=window)
    out = kernel("bf16").prefill(q, k_cache, v_cache, table, CTX - n_new, spec.scale, window).double()
    expected = reference(q, keys, values, spec)
    error, bound = (out - expected).abs(), bf16_bound(q, keys, values, spec)
    assert (error <= bound).all(), f"{(error - bound).max().item()} past the bound"
    assert error.max().item() > 1e-4  # not float32's result (~1e-7 off): the bf16 products did run


@pytest.mark.parametrize("build", ["this CPU", pytest.param("bf16", marks=needs_bf16)])
@pytest.mark.parametrize("window", [0, 40])
def test_a_row_has_the_same_bits_however_the_prompt_is_chunked(build: str, window: int) -> None:
    table, k_cache, v_cache = pool(64, torch.float16)
    q = torch.randn(CTX, HEADS, 64, generator=torch.Generator().manual_seed(2))
    prefill = kernel(build).prefill
    whole = prefill(q, k_cache, v_cache, table, 0, 0.125, window)
    for bounds in ([0, 7, 93, CTX], [0, 64, 128, CTX], [0, 1, 2, 100, CTX]):
        chunks = [
            prefill(q[a:b], k_cache, v_cache, table, a, 0.125, window) for a, b in itertools.pairwise(bounds)
        ]
        assert torch.equal(torch.cat(chunks), whole), bounds


@pytest.mark.parametrize("build", ["this CPU", pytest.param("bf16", marks=needs_bf16)])
@pytest.mark.parametrize("page, pages", [(PAGES, None), (-1, None), (0, 2)])
def test_a_bad_table_is_refused(build: str, page: int, pages: int | None) -> None:
    table, k_cache, v_cache = pool(8, torch.float32)
    table = table[:pages].clone() if pages else table.clone()
    table[0] = page
    q = torch.randn(CTX, HEADS, 8)
    with pytest.raises(paged_kernel.PagedAttentionError, match="outside the pool"):
        kernel(build).prefill(q, k_cache, v_cache, table, 0, 0.125)


@needs_bf16
def test_bf16_comes_with_int8_activations_and_the_variable_turns_it_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fast path (int8 activations) gets the bf16 build, the exact float32 path keeps float32, and
    KVFENCE_PREFILL_F32=1 (the documented fallback) gives float32 to both."""
    monkeypatch.delenv(paged_kernel.PREFILL_F32_ENV, raising=False)
    assert paged_kernel.bf16_prefill()
    assert tiny_model(decode_matmul="kernel", activation_dtype="int8")._kernel is kernel("bf16")
    assert tiny_model(decode_matmul="kernel", activation_dtype="float32")._kernel is kernel("this CPU")
    monkeypatch.setenv(paged_kernel.PREFILL_F32_ENV, "1")
    assert not paged_kernel.bf16_prefill()
    assert tiny_model(decode_matmul="kernel", activation_dtype="int8")._kernel is kernel("this CPU")
    assert kernel("bf16") is not kernel("this CPU")
