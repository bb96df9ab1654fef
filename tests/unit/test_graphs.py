"""The decode graph runner on CPU, with a fake capture: buckets, padding, buffer reuse, and logits equal to
the eager forward. The real capture (torch.cuda.CUDAGraph) runs in bench/gpu.py on a GPU machine."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import TINY, FakeGraphs, make_engine, tiny_model

from kvfence.cache.pool import KVPool
from kvfence.cli import build_parser
from kvfence.cli_options import engine_config
from kvfence.engine.graphs import DecodeBatch, DecodeGraphRunner, batch_buckets, bucket_for
from kvfence.model.transformer import StepInputs, Transformer
from kvfence.sampling import SamplingParams

PAGE_SIZE, NUM_PAGES, WIDTH = 4, 24, 6


def new_pool(seed: int = 0) -> KVPool:
    pool = KVPool(
        TINY.num_layers, NUM_PAGES, PAGE_SIZE, TINY.num_kv_heads, TINY.head_dim, torch.float32, "cpu", True
    )
    pages = pool.kv[:, :, : pool.zero_page]  # every page but the zero page holds someone's old KV
    pages.copy_(torch.randn(pages.shape, generator=torch.Generator().manual_seed(seed)))
    return pool


def decode_batch(lengths: list[int], pages: list[list[int]]) -> DecodeBatch:
    """Rows that feed token (7 * row + 1) at position `lengths[row]`, written into their own pages."""
    positions = np.array(lengths, dtype=np.int64)
    slots = np.array(
        [p[n // PAGE_SIZE] * PAGE_SIZE + n % PAGE_SIZE for p, n in zip(pages, lengths, strict=True)]
    )
    starts = np.concatenate([[0], np.cumsum([len(p) for p in pages])]).astype(np.int64)
    token_ids = np.arange(len(lengths), dtype=np.int64) * 7 + 1
    return DecodeBatch(token_ids, positions, slots, np.concatenate(pages).astype(np.int64), starts)


def eager(model: Transformer, pool: KVPool, batch: DecodeBatch) -> torch.Tensor:
    """The same step through the eager forward, exactly as the runner builds decode inputs."""
    tables = torch.from_numpy(batch.padded_tables(int(np.diff(batch.starts).max()), pool.zero_page))
    rows = torch.arange(batch.rows)
    inputs = StepInputs(
        input_ids=torch.from_numpy(batch.token_ids),
        positions=torch.from_numpy(batch.positions),
        slot_mapping=torch.from_numpy(batch.slots),
        decode_rows=rows,
        decode_block_tables=tables,
        decode_context_lens=torch.from_numpy(batch.positions + 1),
        prefills=[],
        logits_rows=rows,
        zero_page=pool.zero_page,
    )
    return model.forward(inputs, pool.kv)


def runner(model: Transformer, pool: KVPool, graphs: FakeGraphs) -> DecodeGraphRunner:
    return DecodeGraphRunner(model, pool, max_num_seqs=12, max_pages_per_seq=WIDTH, backend=graphs)


BATCH = ([5, 12, 1], [[3, 9], [0, 1, 2, 20], [7]])  # a partial page, a full last page plus one, one token


def test_buckets() -> None:
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert batch_buckets(1) == [1]
    assert [bucket_for(n, batch_buckets(48)) for n in (1, 3, 4, 33, 48, 49)] == [1, 4, 4, 48, 48, None]


@pytest.mark.parametrize("attention", ["kernel", "sdpa"])
def test_real_rows_equal_the_eager_forward_and_padding_touches_only_scratch(attention: str) -> None:
    model = tiny_model(decode_attention=attention)
    ours, theirs = new_pool(), new_pool()
    graphs = runner(model, ours, FakeGraphs())
    batch = decode_batch(*BATCH)
    logits = graphs.run(batch)
    expected = eager(model, theirs, batch)
    assert logits is not None and logits.shape == expected.shape == (3, TINY.vocab_size)
    # BLAS rounds by row count (1.5e-5 seen on an AVX-512 EPYC): close, and the same greedy tokens
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    # Every slot the step did not write holds exactly what it held (the padding row wrote only into the
    # scratch page, past the pool's pages); the slots the real rows wrote hold the eager step's K/V up to
    # BLAS rounding: the projections of a 4-row and a 3-row batch round differently on some CPUs (2.6e-6
    # seen on an AVX-512 EPYC). Only the decode kernels pin batch invariance, not these GEMMs.
    assert ours.kv.shape[2] == NUM_PAGES + 2 and graphs.scratch_page == NUM_PAGES
    assert ours.zero_page == NUM_PAGES + 1 and not ours.kv[:, :, ours.zero_page].any()
    mine, eager_kv = ours.kv[:, :, :NUM_PAGES].flatten(2, 3), theirs.kv[:, :, :NUM_PAGES].flatten(2, 3)
    written = torch.from_numpy(batch.slots)
    untouched = torch.ones(NUM_PAGES * PAGE_SIZE, dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(mine[:, :, untouched], eager_kv[:, :, untouched])
    torch.testing.assert_close(mine[:, :, written], eager_kv[:, :, written], atol=1e-5, rtol=1e-5)
    assert not torch.equal(mine[:, :, written], new_pool().kv[:, :, :NUM_PAGES].flatten(2, 3)[:, :, written])
    assert not torch.equal(ours.kv[:, :, NUM_PAGES, 0], torch.zeros_like(ours.kv[:, :, NUM_PAGES, 0]))


def test_padding_rows_name_only_the_scratch_page(tiny: Transformer) -> None:
    graphs = runner(tiny, new_pool(), FakeGraphs())
    graphs.run(decode_batch(*BATCH))  # 3 rows in bucket 4
    scratch = graphs.scratch_page
    ids, positions, slots, lens = graphs.packed[:, 3].tolist()
    assert (ids, positions, slots, lens) == (0, 0, scratch * PAGE_SIZE, 1)
    assert (graphs.tables[3] == scratch).all()
    assert graphs.tables[0].tolist() == [3, 9] + [scratch] * (WIDTH - 2)  # past its pages: scratch too
    assert graphs.packed[3, :3].tolist() == [6, 13, 2]


def test_buffers_are_reused_and_only_changed_table_rows_copied(tiny: Transformer) -> None:
    fake = FakeGraphs()
    graphs = runner(tiny, new_pool(), fake)
    packed, tables = graphs.packed, graphs.tables
    lengths, pages = BATCH
    graphs.run(decode_batch(lengths, pages))
    assert graphs.table_rows_copied == 3  # the real rows; the padding row named the scratch page already
    graphs.run(decode_batch([n + 1 for n in lengths], pages))  # a steady step: same pages
    assert graphs.table_rows_copied == 0
    grown = [pages[0], pages[1], [7, 8]]  # the third row's first page is full: a page was added
    graphs.run(decode_batch([6, 14, 4], grown))
    assert graphs.table_rows_copied == 1 and graphs.tables[2, :2].tolist() == [7, 8]
    assert len(fake.captured) == 1 and fake.replays == 3  # one graph for bucket 4, replayed each step
    graphs.run(decode_batch([1] * 5, [[p] for p in (10, 11, 12, 13, 14)]))  # bucket 8: a second graph
    assert len(fake.captured) == 2
    assert graphs.packed is packed and graphs.tables is tables  # the same buffers throughout
    assert graphs.packed.data_ptr() == packed.data_ptr() and graphs.tables.data_ptr() == tables.data_ptr()


def test_a_captured_forward_reads_only_the_static_buffers(tiny: Transformer) -> None:
    """A graph replays the addresses it captured: an input tensor made for one capture and then freed would
    be read, at every later replay, in whatever the allocator put there next."""
    graphs = runner(tiny, new_pool(), FakeGraphs())
    static = {t.untyped_storage().data_ptr() for t in (graphs.packed, graphs.tables, graphs.rows)}
    for bucket in graphs.buckets:
        inputs = graphs.static_inputs(bucket)
        tensors = [getattr(inputs, f.name) for f in dataclasses.fields(inputs)]
        tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
        assert len(tensors) == 7 and not inputs.prefills
        assert {t.untyped_storage().data_ptr() for t in tensors} <= static
        assert inputs.logits_rows.tolist() == list(range(bucket))


def test_a_batch_no_bucket_holds_runs_eagerly(tiny: Transformer) -> None:
    fake = FakeGraphs()
    graphs = runner(tiny, new_pool(), fake)
    assert graphs.run(decode_batch([1] * 13, [[p] for p in range(13)])) is None  # beyond max_num_seqs
    assert graphs.run(decode_batch([27], [list(range(WIDTH + 1))])) is None  # beyond the table width
    assert not fake.captured


def test_an_engine_replays_its_decode_steps_and_runs_the_rest_eagerly(tiny: Transformer) -> None:
    """The runner wired to graphs: each pure decode step is one replay over the layout the fence validated
    (an aborted row is not in it), a step with a prompt in it runs eagerly, and the tokens are the eager
    engine's."""
    prompts = [[5, 9, 2, 7, 1], [3] * 11, [8, 4]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    expected = [r.output_token_ids for r in make_engine(tiny, decode_graphs=True).generate(prompts, params)]
    engine = make_engine(tiny, decode_graphs=True, max_num_seqs=4)
    fake = FakeGraphs()
    engine.runner.graphs = DecodeGraphRunner(tiny, engine.pool, 4, max_pages_per_seq=12, backend=fake)
    steps: list[tuple[int, list[int]]] = []  # (replays so far, each row's new tokens) per step
    engine.runner.observer = lambda requests, layout: steps.append(
        (fake.replays, np.diff(layout.write_rows.searchsorted(np.arange(len(requests) + 1))).tolist())
    )
    finished = engine.generate(prompts, params)
    assert [r.output_token_ids for r in finished] == expected
    assert steps[0] == (0, [5, 11, 2])  # the prompts: eager
    assert [rows for _, rows in steps[1:]] == [[1, 1, 1]] * 5  # then five decode steps of three rows
    assert [replays for replays, _ in steps[1:]] == [0, 1, 2, 3, 4] and fake.replays == 5
    assert len(fake.captured) == 1 and engine.runner.graphs.packed[1, 3] == 0  # bucket 4: a padding row


def test_serve_asks_for_graphs_unless_eager_and_only_cuda_builds_them(tiny: Transformer) -> None:
    assert engine_config(build_parser().parse_args(["serve"])).decode_graphs
    assert not engine_config(build_parser().parse_args(["serve", "--enforce-eager"])).decode_graphs
    engine = make_engine(tiny, decode_graphs=True)  # on CPU: the scratch page, no capture
    assert engine.runner.graphs is None and engine.pool.scratch_page == engine.pool.num_pages
