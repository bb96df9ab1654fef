"""Sealed KV tiers below the pool (`--kv-tier`): a tenant's full prefix pages stored by one engine are
restored by another (a restart, another server) into fresh pages through the fence, for that tenant only;
whatever a store operator does to an entry (a flipped byte, a cut, a swap, another tenant's entry under
this one's name, another model's) is a miss, and the answer stays the cold one; a store that is down is a
miss too. A page reallocated between its offer and the writer's copy is never stored under the offerer's
name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import make_engine, tiny_model

from kvfence.cache.prefix import extend_chain
from kvfence.cache.tier_seal import DOES_NOT_OPEN, TOO_SHORT, Layout, TierSeal
from kvfence.cache.tier_stores import DOWN_S, DiskTier, MemoryTier, RedisTier, TierStore, Value, make_store
from kvfence.cache.tiers import KVTiers
from kvfence.config import EngineConfig
from kvfence.engine.builder import read_tier_key
from kvfence.engine.engine import LLMEngine
from kvfence.engine.stats import EngineStats
from kvfence.harness.redis_server import redis_server
from kvfence.model.transformer import Transformer
from kvfence.sampling import SamplingParams
from kvfence.startup import StartupError

KEY = bytes(range(32))
MODEL_SHA = "ab" * 32
PROMPT = [(7 * i + 3) % 200 + 1 for i in range(41)]  # 10 full pages of 4, and one token more
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model() -> Transformer:
    return tiny_model()


def tiers_over(store: TierStore, engine: LLMEngine, model_sha: str = MODEL_SHA) -> KVTiers:
    config, pool = engine.model.config, engine.pool
    layout = Layout(pool.page_size, "float32", config.num_layers, config.num_kv_heads, config.head_dim)
    return KVTiers([store], TierSeal(KEY, model_sha, layout))


def engine_with(model: Transformer, store: TierStore, model_sha: str = MODEL_SHA) -> LLMEngine:
    engine = make_engine(model, max_model_len=64)
    engine.kv_cache.tiers = tiers_over(store, engine, model_sha)
    return engine


def answer(engine: LLMEngine, tenant: str) -> tuple[list[int], list[int]]:
    """The greedy tokens of PROMPT for `tenant`, and the pages restored from a tier for it."""
    request = engine.add_request(PROMPT, PARAMS, tenant=tenant)
    while not request.is_finished:
        engine.step()
    events = engine.events.for_request(request.request_id)
    return request.output_token_ids, [p for e in events if e["kind"] == "tier_restored" for p in e["pages"]]


def stored(model: Transformer, store: TierStore, tenant: str = "a") -> list[int]:
    """PROMPT answered cold for `tenant` by an engine over `store`, its pages written to the store."""
    engine = engine_with(model, store)
    tokens, restored = answer(engine, tenant)
    assert not restored
    engine.kv_cache.tiers.flush()  # type: ignore[union-attr]
    return tokens


def test_a_prefix_stored_by_one_engine_is_restored_by_another_for_its_tenant_only(
    model: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = MemoryTier("memory:1MiB", 2**20)
    cold = stored(model, store)
    engine = engine_with(model, store)
    tiers = engine.kv_cache.tiers
    assert tiers is not None
    offered: list[int] = []
    monkeypatch.setattr(tiers, "offer", lambda *args: offered.append(args[2]))
    tokens, restored = answer(engine, "a")
    assert tokens == cold and len(restored) == 10  # every full page of the prompt, the last token computed
    # The restored pages are published to the prefix cache, not copied to be stored again: only page 10,
    # which this request's prompt and answer filled, is offered.
    assert offered == [10]
    totals = engine.kv_cache.tiers.totals()  # type: ignore[union-attr]
    assert totals["hits"] == {"memory": 10}
    stats = EngineStats.read(engine)  # vLLM's external prefix-cache series count tokens
    assert (stats.tier_query_tokens, stats.tier_hit_tokens) == (40, 40) and stats.prefix_hit_tokens == 0
    other, restored = answer(engine_with(model, store), "b")
    assert other == cold and not restored  # the same prompt under another tenant: its names differ
    engine.check_integrity()


def test_restored_pages_are_the_requests_own_fresh_pages_written_through_the_fence(
    model: Transformer,
) -> None:
    store = MemoryTier("memory:1MiB", 2**20)
    stored(model, store)
    engine = engine_with(model, store)
    request = engine.add_request(PROMPT, PARAMS, tenant="a")
    engine.step()
    kinds = [e["kind"] for e in engine.events.for_request(request.request_id)]
    assert kinds.index("pages_allocated") < kinds.index("tier_restored")  # allocated, then written
    pool, record = engine.pool, request.record
    for page, generation in zip(record.pages[:10], record.generations[:10], strict=True):
        assert pool.owner[page] == record.tenant and pool.generation[page] == generation
        assert pool.written[page] == pool.page_size


def _flip(stored: bytes | memoryview) -> bytes:
    value = bytes(stored)
    return value[:40] + bytes([value[40] ^ 1]) + value[41:]


@pytest.mark.parametrize(
    ("tamper", "rejected"),
    [
        ("flip a byte", {DOES_NOT_OPEN: 1}),
        ("truncate", {DOES_NOT_OPEN: 1}),
        ("cut to nothing", {TOO_SHORT: 1}),
        ("swap two entries", {DOES_NOT_OPEN: 2}),  # pages 2 and 3, each under the other's name
        ("another tenant's entry", {DOES_NOT_OPEN: 1}),
    ],
)
def test_an_entry_a_store_operator_changed_is_a_miss_and_the_answer_stays_cold(
    model: Transformer, tamper: str, rejected: dict[str, int]
) -> None:
    store = MemoryTier("memory:4MiB", 4 * 2**20)
    cold = stored(model, store, "a")
    stored(model, store, "b")
    engine = engine_with(model, store)
    seal = engine.kv_cache.tiers.seal  # type: ignore[union-attr]
    chain = _chain("a", engine)
    third, fourth = seal.name("a", chain[2]), seal.name("a", chain[3])
    entries = store._entries
    if tamper == "flip a byte":
        entries[third] = _flip(entries[third])
    elif tamper == "truncate":
        entries[third] = entries[third][:-1]
    elif tamper == "cut to nothing":
        entries[third] = b""
    elif tamper == "swap two entries":
        entries[third], entries[fourth] = entries[fourth], entries[third]
    else:
        entries[third] = entries[seal.name("b", _chain("b", engine)[2])]
    tokens, restored = answer(engine, "a")
    assert tokens == cold and len(restored) == 2  # pages 0 and 1 restored, page 2 a miss, the rest computed
    assert engine.kv_cache.tiers.totals()["rejected"] == rejected  # type: ignore[union-attr]


def _chain(tenant: str, engine: LLMEngine) -> list[int]:
    hashes: list[int] = []
    extend_chain(tenant, hashes, PROMPT, engine.pool.page_size)
    return hashes


def test_another_models_entries_never_open(model: Transformer) -> None:
    store = MemoryTier("memory:1MiB", 2**20)
    cold = stored(model, store)
    other = engine_with(model, store, model_sha="cd" * 32)
    tokens, restored = answer(other, "a")
    assert tokens == cold and not restored  # another model's names: nothing found under them
    seal_a = engine_with(model, store).kv_cache.tiers.seal  # type: ignore[union-attr]
    seal_b = other.kv_cache.tiers.seal  # type: ignore[union-attr]
    first = _chain("a", other)[0]
    copied = MemoryTier("memory:1MiB", 2**20)  # the first entry of model ab under model cd's name
    copied.put(seal_b.name("a", first), store.get(seal_a.name("a", first)))  # type: ignore[arg-type]
    engine = engine_with(model, copied, model_sha="cd" * 32)
    tokens, restored = answer(engine, "a")
    assert tokens == cold and not restored
    assert engine.kv_cache.tiers.totals()["rejected"] == {DOES_NOT_OPEN: 1}  # type: ignore[union-attr]


def test_a_disk_tier_outlives_the_process_and_stays_within_its_size(
    model: Transformer, tmp_path: Path
) -> None:
    directory = tmp_path / "tier"
    cold = stored(model, DiskTier(f"disk:{directory}:1MiB", directory, 2**20))
    (directory / "leftover.123.tmp").write_bytes(b"half a page")  # a crash mid-write
    restarted = DiskTier(f"disk:{directory}:1MiB", directory, 2**20)
    assert not list(directory.glob("*.tmp"))
    engine = engine_with(model, restarted)
    tokens, restored = answer(engine, "a")
    assert tokens == cold and len(restored) == 10
    engine.kv_cache.tiers.flush()  # type: ignore[union-attr]  # its output's full page, written last
    files = list(directory.iterdir())
    value = files[0].read_bytes()
    small = DiskTier(f"disk:{directory}:3 pages", directory, 3 * len(value))
    small.put(b"\x01" * 32, value)  # the oldest files go until three entries' bytes remain
    assert small.evictions == len(files) + 1 - 3 and small.held_bytes() == 3 * len(value)
    assert len(list(directory.iterdir())) == 3


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Redis server on loopback (kvfence.harness.redis_server), stopped after the module; patient:
    these tests assert which pages come back, and a busy machine's Redis may miss the tier's 0.5 s."""
    with redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server.patient()


def test_a_shared_redis_tier_serves_another_engine_and_a_dead_one_is_a_miss(
    model: Transformer, redis_url: str
) -> None:
    cold = stored(model, RedisTier(redis_url))
    tokens, restored = answer(engine_with(model, RedisTier(redis_url)), "a")
    assert tokens == cold and len(restored) == 10
    down = RedisTier("redis://127.0.0.1:1/0")  # nothing listens there: every get is a miss
    engine = engine_with(model, down)
    tokens, restored = answer(engine, "a")
    assert tokens == cold and not restored and down.errors > 0


def test_a_wedged_redis_costs_one_timeout_then_is_skipped_until_it_is_asked_again(
    model: Transformer, tmp_path: Path
) -> None:
    now = [0.0]
    with redis_server(tmp_path) as server:
        store = RedisTier(server.patient(5.0), clock=lambda: now[0])  # the one timeout: 5 s, not 0.5
        cold = stored(model, store)
        os.kill(server.process.pid, signal.SIGSTOP)  # accepts connections, answers nothing
        try:
            engine = engine_with(model, store)
            tokens, restored = answer(engine, "a")
            assert engine.kv_cache.tiers is not None
            engine.kv_cache.tiers.flush()  # the writer's puts of the answer's pages: skipped too
            assert tokens == cold and not restored
            assert store.errors == 1 and store.skipped >= 9  # one timeout; the other pages not asked
            skipped = store.skipped
            assert not store.put(b"\x01" * 32, b"value") and store.skipped == skipped + 1
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        now[0] += DOWN_S  # the window has passed: the store is asked again, and answers
        tokens, restored = answer(engine_with(model, store), "a")
        assert tokens == cold and len(restored) == 10 and store.errors == 1


def test_the_key_file_is_64_hex_digits_only_its_owner_reads(tmp_path: Path) -> None:
    path = tmp_path / "tier.key"
    path.write_text(KEY.hex() + "\n")
    os.chmod(path, 0o600)
    assert read_tier_key(path) == KEY
    os.chmod(path, 0o644)
    with pytest.raises(StartupError, match="chmod 600"):
        read_tier_key(path)
    path.write_text("ab" * 16)
    os.chmod(path, 0o600)
    with pytest.raises(StartupError, match="16 bytes"):
        read_tier_key(path)


def test_a_tier_spec_is_checked_and_a_tier_without_a_key_refused(model: Transformer) -> None:
    assert isinstance(make_store("memory:2MiB"), MemoryTier)
    for bad in ("memory:lots", "disk:/tmp", "ftp://x", "memory:0"):
        with pytest.raises(ValueError):
            make_store(bad)
    with pytest.raises(ValueError, match="--kv-tier-key-file"):
        LLMEngine(EngineConfig(num_pages=64, max_model_len=48, kv_tiers=("memory:1MiB",)), model, log=print)


@pytest.mark.parametrize("isolation", [False, True], ids=["fence off: leak", "fence on: abort"])
def test_a_restore_written_into_another_requests_page(model: Transformer, isolation: bool) -> None:
    """Fault `tier_foreign_write`: tenant a's restore targets tenant b's running request's page. Fence off,
    the write lands and b's answer changes; fence on, it is refused (`write_refused` on a's trail, counted)
    and a is aborted for integrity (`stale_write`) before any of its rows runs: b's answer is its own."""
    store = MemoryTier("memory:1MiB", 2**20)
    stored(model, store)  # the tier holds PROMPT's pages: a's admission restores them
    victim_prompt = [(5 * i + 11) % 200 + 1 for i in range(17)]
    [alone] = [
        r.output_token_ids for r in make_engine(model, max_model_len=64).generate([victim_prompt], PARAMS)
    ]
    engine = make_engine(model, max_model_len=64, isolation=isolation)
    engine.kv_cache.tiers = tiers_over(store, engine)
    victim = engine.add_request(victim_prompt, PARAMS, tenant="b")
    engine.step()  # b's prompt is in its pages
    engine.faults.arm("tier_foreign_write", 1.0, times=1)
    restorer = engine.add_request(PROMPT, PARAMS, tenant="a")
    while engine.has_unfinished():
        engine.step()
    assert [e.fault for e in engine.faults.effects] == ["tier_foreign_write"]
    refused = [e for e in engine.events.for_request(restorer.request_id) if e["kind"] == "write_refused"]
    kinds = [e["kind"] for e in engine.events.for_request(restorer.request_id)]
    if isolation:
        assert victim.output_token_ids == alone and restorer.output_token_ids == []
        assert refused and engine.pool.refused_writes >= engine.pool.page_size
        assert restorer.finish_reason == "stale_write" and engine.integrity_aborts["stale_write"] == 1
        assert "step" not in kinds and kinds.index("write_refused") < kinds.index("aborted")
    else:
        assert victim.output_token_ids != alone and not refused and restorer.output_token_ids


class HeldTier(MemoryTier):
    """A memory tier whose first put waits until the test lets it go: the writer is held mid-page, and the
    offers after that one wait in its queue, their pages not yet copied."""

    def __init__(self) -> None:
        super().__init__("memory:4MiB", 4 * 2**20)
        self.holding, self.go = threading.Event(), threading.Event()

    def put(self, name: bytes, value: Value) -> bool:
        if not self.holding.is_set():
            self.holding.set()
            self.go.wait(HOLD_S)
        return super().put(name, value)


HOLD_S = 120.0  # a bound on waiting for a state, so a broken writer fails the test instead of hanging it


@pytest.mark.parametrize("isolation", [False, True], ids=["fence off: leak", "fence on: dropped"])
def test_a_page_reallocated_before_the_writer_copies_it_is_never_stored_as_the_offerers(
    model: Transformer, isolation: bool
) -> None:
    """The writer copies an offered page later, off the step. Tenant a's pages wait in its queue while b's
    request takes them over (a small pool evicts a's cached pages). Fence off, the writer stores b's KV under
    a's names; fence on, it sees their generation moved on and drops them (`stale`): a's entries are a's."""
    store = HeldTier()
    engine = make_engine(model, num_pages=16, max_model_len=48, isolation=isolation)
    tiers = engine.kv_cache.tiers = tiers_over(store, engine)
    try:
        a = engine.add_request(PROMPT, PARAMS, tenant="a")
        while not a.is_finished:
            engine.step()
        assert store.holding.wait(HOLD_S)  # the writer holds a's first page; the other ten wait, uncopied
        events = engine.events.for_request(a.request_id)
        allocated = [e for e in events if e["kind"] == "pages_allocated"]
        pages = [(p, g) for e in allocated for p, g in zip(e["pages"], e["generations"], strict=True)]
        full = pages[: (len(PROMPT) + len(a.output_token_ids)) // engine.pool.page_size]
        offered = {logical: engine.pool.page_bytes(page) for logical, (page, _) in enumerate(full)}
        b_prompt = [(5 * i + 11) % 200 + 1 for i in range(41)]
        b = engine.add_request(b_prompt, PARAMS, tenant="b")
        while not b.is_finished:
            engine.step()
    finally:
        store.go.set()
    tiers.flush()
    chain: list[int] = []
    extend_chain("a", chain, PROMPT + a.output_token_ids, engine.pool.page_size)
    reused = [logical for logical, (page, g) in enumerate(full) if engine.pool.generation[page] != g]
    assert len(reused) == 7  # 5 pages free after a: b's 12 take 7 of a's, the deepest first
    b_id = engine.allocator.tenant_id("b")
    for logical, (page, _) in enumerate(full):
        value = store.get(tiers.seal.name("a", chain[logical]))
        opened = bytearray(len(offered[logical]))
        if logical in reused and isolation:
            assert value is None
            continue
        assert value is not None
        assert tiers.seal.open_into("a", chain[logical], logical, 4, value, memoryview(opened)) is None
        if logical in reused:  # fence off: under a's name, the bytes of b's page
            assert engine.pool.last_writer[page] == b_id
            assert opened == engine.pool.page_bytes(page) and opened != offered[logical]
        else:
            assert opened == offered[logical]
    assert tiers.stale == (len(reused) if isolation else 0)
    assert tiers.totals()["stale"] == {"memory": tiers.stale}


def test_a_cache_salt_splits_a_tenants_cached_kv_and_never_joins_two_tenants(model: Transformer) -> None:
    """vLLM's `cache_salt`: requests share cached KV, in the pool and in the tiers, only when tenant and salt
    are both equal; the answer is the same either way."""
    store = MemoryTier("memory:1MiB", 2**20)
    engine = engine_with(model, store)

    def run(tenant: str, salt: str | None) -> tuple[list[int], list[str]]:
        params = SamplingParams(max_tokens=6, ignore_eos=True, cache_salt=salt)
        request = engine.add_request(PROMPT, params, tenant=tenant)
        while not request.is_finished:
            engine.step()
        events = engine.events.for_request(request.request_id)
        return request.output_token_ids, [
            e["kind"] for e in events if e["kind"] in ("prefix_hit", "tier_restored")
        ]

    cold, hits = run("a", "project-x")
    assert not hits
    assert run("a", "project-x") == (cold, ["prefix_hit"])  # the same tenant and salt: the pool's pages
    assert run("a", "project-y") == (cold, [])  # another salt: computed
    assert run("a", None) == (cold, [])  # no salt is a namespace of its own too
    assert run("b", "project-x") == (cold, [])  # the same salt under another tenant: never shared
    engine.kv_cache.tiers.flush()  # type: ignore[union-attr]
    restored, hits = answer_salted(model, store, "a", "project-x")
    assert restored == cold and hits == ["tier_restored"]  # and in the tier, under the same salt only
    assert answer_salted(model, store, "c", "project-x") == (cold, [])  # a and b stored it: not c's


def answer_salted(
    model: Transformer, store: TierStore, tenant: str, salt: str
) -> tuple[list[int], list[str]]:
    engine = engine_with(model, store)
    request = engine.add_request(
        PROMPT, SamplingParams(max_tokens=6, ignore_eos=True, cache_salt=salt), tenant=tenant
    )
    while not request.is_finished:
        engine.step()
    kinds = [e["kind"] for e in engine.events.for_request(request.request_id)]
    return request.output_token_ids, [k for k in kinds if k in ("prefix_hit", "tier_restored")]


def test_a_server_without_tiers_loads_no_cipher_library() -> None:
    """cryptography (~6 MiB resident) loads with the first tier named, not with the server or an engine
    built without one: the 1B file's server must fit 1.5 x file + pool."""
    code = (
        "import sys, kvfence.cli, kvfence.api.server\n"
        "from kvfence.engine.builder import build_tiers\n"
        "from kvfence.config import EngineConfig\n"
        "assert build_tiers(EngineConfig(), None, None, None) is None\n"
        "print('cryptography' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.split()[-1] == "False", run.stderr[-2000:]
