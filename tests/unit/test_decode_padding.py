"""The torch (SDPA) decode path reads no slot past a row's context: not a padded table's page, which may be
another request's, nor the unwritten slots of the row's own last page, which hold a previous owner's KV.
A mask is not enough: SDPA gives a masked slot weight 0, and 0 * NaN is NaN, so a previous owner's
non-finite KV (a request aborted for non-finite logits leaves it in its pages) would poison the row. Every
slot past a context comes from the pool's zero page instead.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import TINY, make_engine, tiny_model, with_fake_graphs

from kvfence.cache.pool import KVPool
from kvfence.model import attention
from kvfence.model.attention import LayerAttention
from kvfence.request import Status
from kvfence.sampling import SamplingParams

PAGE_SIZE, NUM_PAGES = 4, 12
SPEC = LayerAttention(scale=TINY.head_dim**-0.5, window=0)


def pool_of(fill: float) -> KVPool:
    """Every page but the zero page holds `fill`, as a previous owner left it."""
    pool = KVPool(1, NUM_PAGES, PAGE_SIZE, TINY.num_kv_heads, TINY.head_dim, torch.float32, "cpu")
    pool.kv[:, :, : pool.zero_page] = fill
    return pool


def write(pool: KVPool, page: int, slots: int, seed: int) -> None:
    """The first `slots` slots of `page`, K and V, as its current owner wrote them."""
    values = torch.randn(pool.kv[:, :, page, :slots].shape, generator=torch.Generator().manual_seed(seed))
    pool.kv[:, :, page, :slots] = values


def decode(pool: KVPool, q: torch.Tensor, tables: list[list[int]], lengths: list[int]) -> torch.Tensor:
    """The torch decode path over `pool`, its tables padded with page 0 (as the runner padded them before
    the zero page existed: whatever a table holds past a row's context must not matter)."""
    width = max(len(t) for t in tables)
    padded, lens = torch.tensor([t + [0] * (width - len(t)) for t in tables]), torch.tensor(lengths)
    slots = attention.context_slots(padded, lens, PAGE_SIZE, pool.zero_page)
    k_cache, v_cache = pool.layer_kv(0)
    return attention.decode(None, q, k_cache, v_cache, padded, lens, SPEC, slots)


@pytest.mark.parametrize("length", [8, 6], ids=["full-pages", "partial-page"])
@pytest.mark.parametrize("foreign", [float("nan"), float("inf"), -float("inf")])
def test_a_row_reads_neither_its_padding_nor_its_unwritten_slots(foreign: float, length: int) -> None:
    """Row 0 (10 tokens over pages 1, 2, 0: page 0's last 2 slots unwritten) is batched with row 1
    (`length` tokens over pages 3 and 5), whose table is padded to 3 pages with page 0: row 0's. Every
    unwritten slot of every page holds `foreign`, a previous owner's value. Both rows' outputs are
    bit-identical to theirs over a pool where those slots hold zeros. With the old gather (whole pages,
    the padding and the slots past the context masked) row 1 read page 0's unwritten slots as padding
    (both cases) and, at 6 tokens, its own page 5's (the partial page), and a NaN or inf there made its
    output NaN."""
    q = torch.randn(2, TINY.num_heads, TINY.head_dim, generator=torch.Generator().manual_seed(1))
    tables, lengths = [[1, 2, 0], [3, 5]], [10, length]
    outputs = []
    for fill in (foreign, 0.0):
        pool = pool_of(fill)
        for page, slots in ((1, 4), (2, 4), (0, 2), (3, 4), (5, length - 4)):
            write(pool, page, slots, seed=page)
        outputs.append(decode(pool, q, tables, lengths))
    poisoned, clean = outputs
    assert poisoned.isfinite().all()
    assert torch.equal(poisoned, clean)
    # Row 1 alone over the clean pool: the same up to rounding (equal bits on the CPUs seen, but SDPA's
    # reductions over a wider batch are free to round differently elsewhere).
    alone = decode(pool, q[1:], tables[1:], lengths[1:])
    torch.testing.assert_close(poisoned[1:], alone, rtol=1e-6, atol=1e-6)


def test_the_zero_page_is_past_every_page_and_a_fenced_write_into_it_is_refused() -> None:
    pool = KVPool(1, NUM_PAGES, PAGE_SIZE, 1, 2, torch.float32, "cpu", scratch_page=True)
    assert (pool.scratch_page, pool.zero_page, pool.kv.shape[2]) == (NUM_PAGES, NUM_PAGES + 1, NUM_PAGES + 2)
    assert pool.generation.size == NUM_PAGES and not pool.kv[:, :, pool.zero_page].any()
    one = np.array([pool.zero_page])
    assert not pool.authorize_writes(one, one * 0, one * 0, one * 0)[0]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_non_finite_kv_of_previous_owners_changes_no_token(graphs: bool) -> None:
    """Every page of the pool holds NaN, as pages a request with non-finite KV left behind: three
    tenants' requests of different lengths, batched (their tables padded to the widest), decode over SDPA
    and each gives the tokens it gives alone on a clean pool, none aborted. Before the zero page every
    decode row gathered its last page's unwritten slots (NaN) and every row was aborted for non-finite
    logits."""
    model = tiny_model(decode_attention="sdpa")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = {"a": [5, 9, 2, 7, 1, 4, 4, 8, 3], "b": [3] * 14, "c": [8, 4]}
    alone = {
        tenant: make_engine(model).generate([prompt], params, tenant)[0].output_token_ids
        for tenant, prompt in prompts.items()
    }
    engine = make_engine(model, decode_graphs=graphs)
    fake = with_fake_graphs(engine) if graphs else None
    pool = engine.pool
    pool.kv[:, :, : pool.zero_page] = float("nan")  # the scratch page too: the graphs' padding rows
    requests = {t: engine.add_request(p, params, t) for t, p in prompts.items()}
    while not all(r.is_finished for r in requests.values()):
        engine.step()
    assert fake is None or fake.replays, "no decode step went through the graph runner"
    for tenant, request in requests.items():
        assert request.status is Status.FINISHED, (tenant, request.finish_reason)
        assert request.output_token_ids == alone[tenant], tenant
    assert not pool.kv[:, :, pool.zero_page].any()
