"""The C decode-attention kernel against a dense reference over a float32 or a float16 pool, its bounds
checks, the engine on both paths."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY, make_engine, tiny_model, tiny_tensors

from kvfence.model import native, paged_kernel
from kvfence.model.transformer import Transformer
from kvfence.sampling import SamplingParams
from kvfence.units import cdiv

PAGES, PAGE_SIZE, HEADS, KV_HEADS, HEAD_DIM = 40, 4, 6, 2, 16
SCALE = HEAD_DIM**-0.5


@pytest.fixture(scope="module")
def kernel() -> paged_kernel.PagedDecodeKernel:
    kernel, why = paged_kernel.load()
    assert kernel is not None, why  # CI has a C compiler: a silent fallback would leave the kernel untested
    return kernel


def paged_case(
    lengths: list[int], seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, ...]:
    """A random pool of `dtype`, rows of one query with the given context lengths on shuffled pages, padded
    tables."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v_cache = torch.randn(PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    q = torch.randn(len(lengths), HEADS, HEAD_DIM, generator=gen)
    width = max(cdiv(n, PAGE_SIZE) for n in lengths)
    order = torch.randperm(PAGES, generator=gen)
    tables = torch.zeros(len(lengths), width, dtype=torch.long)
    used = 0
    for row, n in enumerate(lengths):
        pages = cdiv(n, PAGE_SIZE)
        tables[row, :pages] = order[used : used + pages]
        used += pages
    return q, k_cache, v_cache, tables, torch.tensor(lengths, dtype=torch.long)


def dense_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    window: int = 0,
) -> torch.Tensor:
    """float64 softmax attention (q.k x SCALE) over each row's tokens (its last `window` ones if set), read
    page by page; query head h uses KV head h // (heads / kv_heads)."""
    out, head_dim = [], q.shape[-1]
    for row, n in enumerate(lengths.tolist()):
        first = max(0, n - window) if window else 0
        keys = k_cache[tables[row]].reshape(-1, KV_HEADS, head_dim)[first:n].double()
        values = v_cache[tables[row]].reshape(-1, KV_HEADS, head_dim)[first:n].double()
        kv_of_head = torch.arange(HEADS) // (HEADS // KV_HEADS)
        scores = torch.einsum("hd,thd->ht", q[row].double(), keys[:, kv_of_head]) * SCALE
        out.append(torch.einsum("ht,thd->hd", scores.softmax(-1), values[:, kv_of_head]))
    return torch.stack(out).float()


POOL_DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", POOL_DTYPES, ids=str)
def test_kernel_matches_dense_attention(kernel: paged_kernel.PagedDecodeKernel, dtype: torch.dtype) -> None:
    """Over a float16 pool the reference reads the same float16 values (widened exactly): the kernel's
    error is its float32 arithmetic alone, as over a float32 pool."""
    # Lengths on and around page boundaries, a one-token context and a long one.
    case = paged_case([1, 3, 4, 5, 16, 37], dtype=dtype)
    got = kernel(*case, SCALE)
    assert got.dtype == torch.float32 and (got - dense_reference(*case)).abs().max() < 1e-5


@pytest.mark.parametrize("build", ["this CPU", "portable", "avx2"])
def test_every_build_matches_dense_attention_over_a_float16_pool(build: str) -> None:
    """The vector paths widen float16 16 or 8 at a time (AVX-512, AVX2 with F16C), the plain C one by one:
    each sums in its own order, each within float32 rounding of the reference. Head dims of 16 and 20
    (a tail past the vector width)."""
    if build == "avx2" and not {"avx2", "fma", "f16c"} <= native.cpu_flags():
        pytest.skip("no AVX2 with FMA and F16C here")
    other, why = paged_kernel.load(portable=build == "portable", avx512=build != "avx2")
    assert other is not None, why
    case = paged_case([1, 5, 16, 37], seed=7, dtype=torch.float16)
    assert (other(*case, SCALE) - dense_reference(*case)).abs().max() < 1e-5
    q, k_cache, v_cache, tables, lengths = case
    wider = [torch.cat([t, t[..., :4]], dim=-1) for t in (q, k_cache, v_cache)]  # head_dim 20
    got = other(*wider, tables, lengths, SCALE)
    assert (got - dense_reference(*wider, tables, lengths)).abs().max() < 1e-5


@pytest.mark.parametrize("build", ["this CPU", "portable", "avx2"])
def test_every_build_rounds_to_float16_as_torch_does(build: str) -> None:
    """What the C layer writes into a float16 pool: ties to even, subnormals, overflow to infinity, NaN,
    and a length that leaves a tail past the vector width."""
    if build == "avx2" and not {"avx2", "fma", "f16c"} <= native.cpu_flags():
        pytest.skip("no AVX2 with FMA and F16C here")
    kernel, why = paged_kernel.load(portable=build == "portable", avx512=build != "avx2")
    assert kernel is not None, why
    gen = torch.Generator().manual_seed(8)
    ties = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 2**-25, 3 * 2**-25, 65520.0, -70000.0, 2**-30])
    values = torch.cat([torch.randn(1000, generator=gen) * 1e3, torch.randn(37, generator=gen) * 1e-6, ties])
    values = torch.cat([values, torch.tensor([float("nan"), float("inf")])])
    rounded = kernel.round_half(values)
    assert torch.equal(rounded[:-2], values[:-2].half()) and rounded[-2].isnan() and rounded[-1].isinf()


@pytest.mark.parametrize("window", [1, 3, 4, 6, 40])
def test_a_sliding_window_attends_over_the_last_positions_and_reads_no_page_before_them(
    kernel: paged_kernel.PagedDecodeKernel, window: int
) -> None:
    """A window within a page, on a page boundary, across pages, and wider than every context. The pages
    wholly before a row's window are filled with NaN: one read would turn the row's output NaN."""
    q, k_cache, v_cache, tables, lengths = paged_case([1, 3, 4, 5, 16, 37], seed=4)
    expected = dense_reference(q, k_cache, v_cache, tables, lengths, window)
    for row, n in enumerate(lengths.tolist()):
        before = tables[row, : max(0, n - window) // PAGE_SIZE]
        k_cache[before], v_cache[before] = float("nan"), float("nan")
    got = kernel(q, k_cache, v_cache, tables, lengths, SCALE, window)
    assert (got - expected).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", POOL_DTYPES, ids=str)
def test_a_row_is_computed_the_same_alone_and_in_a_batch(
    kernel: paged_kernel.PagedDecodeKernel, dtype: torch.dtype
) -> None:
    q, k_cache, v_cache, tables, lengths = paged_case([9, 30, 2, 17], seed=1, dtype=dtype)
    batched = kernel(q, k_cache, v_cache, tables, lengths, SCALE)
    for row in range(len(lengths)):
        alone = kernel(
            q[row : row + 1], k_cache, v_cache, tables[row : row + 1], lengths[row : row + 1], SCALE
        )
        assert torch.equal(alone[0], batched[row])


def test_query_rows_may_be_a_strided_view(kernel: paged_kernel.PagedDecodeKernel) -> None:
    """The model passes Q as a slice of its fused QKV rows: the row stride is not heads * head_dim."""
    q, k_cache, v_cache, tables, lengths = paged_case([7, 12], seed=2)
    qkv = torch.cat([q, torch.randn(2, 2 * KV_HEADS, HEAD_DIM)], dim=1)
    strided = kernel(qkv[:, :HEADS], k_cache, v_cache, tables, lengths, SCALE)
    assert torch.equal(strided, kernel(q, k_cache, v_cache, tables, lengths, SCALE))


@pytest.mark.parametrize(
    ("page", "length"),
    [(PAGES, 5), (-1, 5), (0, 3 * PAGE_SIZE + 1)],
    ids=["page past the pool", "negative page", "length past its pages"],
)
def test_a_bad_block_table_is_refused(kernel: paged_kernel.PagedDecodeKernel, page: int, length: int) -> None:
    """Checked before anything is read: a bookkeeping error fails closed, never reads outside the pool."""
    q, k_cache, v_cache, tables, lengths = paged_case([5, 12], seed=3)
    tables[1, 0], lengths[1] = page, length
    with pytest.raises(paged_kernel.PagedAttentionError, match="outside the pool"):
        kernel(q, k_cache, v_cache, tables, lengths, SCALE)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float16"])
def test_engine_gives_the_same_tokens_with_the_kernel_and_with_sdpa(kv_cache_dtype: str) -> None:
    """Mixed steps (prefill chunks beside decode rows) and pure decode steps, on both decode paths, over a
    float32 pool and over a float16 one (the torch path widens what it gathers)."""
    models = {name: tiny_model(decode_attention=name) for name in ("kernel", "sdpa")}
    assert [m.decode_attention for m in models.values()] == ["kernel", "sdpa"]
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, TINY.vocab_size, (n,), generator=gen).tolist() for n in (5, 13, 22, 8, 17)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    engines = {name: make_engine(model, kv_cache_dtype=kv_cache_dtype) for name, model in models.items()}
    pool = {"auto": torch.float32, "float16": torch.float16}[kv_cache_dtype]
    assert all(engine.pool.kv.dtype == pool for engine in engines.values())
    outputs = {
        name: [r.output_token_ids for r in engine.generate(prompts, params)]
        for name, engine in engines.items()
    }
    assert outputs["kernel"] == outputs["sdpa"]
    assert all(len(tokens) == 12 for tokens in outputs["kernel"])


def test_kernel_is_used_only_where_it_can_run() -> None:
    assert tiny_model().decode_attention == "kernel"  # float32 on CPU: the default path
    bf16 = {name: t.to(torch.bfloat16) for name, t in tiny_tensors().items()}
    auto = Transformer(TINY, bf16)
    assert auto.decode_attention == "sdpa" and "float32" in auto.decode_attention_note
    with pytest.raises(ValueError, match="unavailable"):
        Transformer(TINY, bf16, decode_attention="kernel")
