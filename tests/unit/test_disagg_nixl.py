"""The one-sided (NIXL) handoff, in process: real NIXL agents over UCX, control messages in memory.

The decode worker announces its landing area (never its pool) to prefill over the (authenticated) control
channel with a seal key per request; prefill seals the granted pages into its send area, WRITEs them into
decode's landing slots and sends `complete`; decode opens each page and copies it in as a fenced write.
Every transfer fault runs twice: isolation off shows the leak (the answer changes, pages holding another
tenant's KV are read), isolation on aborts exactly the affected request. A write at any other time, from
anyone, reaches a landing slot and never the pool. Skipped, with the reason, where NIXL is not installed.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from test_disagg_protocol import (
    DECODE,
    PREFILL,
    PROMPTS,
    Pipeline,
    Result,
    assert_tokens_equal_single_node,
    fill_decode_pool_with_a_secret,
    lifecycle,
    solo,
    targets,
)

from kvfence.cache.pool import PageState
from kvfence.disagg.connector import LinkEvent, Received
from kvfence.disagg.handoff import HandoffEngine
from kvfence.disagg.messages import (
    KV_UNAVAILABLE,
    MAX_AGENT_BYTES,
    BadMessage,
    Bounds,
    KvAgent,
    Prefill,
    Rejected,
    accept,
    encode,
)
from kvfence.disagg.nixl_transport import (
    AreaLayout,
    NixlAgent,
    area_shape,
    contiguous_runs,
    new_area,
    nixl_available,
)
from kvfence.engine.stats import EngineStats
from kvfence.model.transformer import Transformer
from kvfence.trail.reasons import CHECKSUM_MISMATCH, INCOMPLETE_HANDOFF

pytestmark = pytest.mark.skipif(
    not nixl_available(),
    reason="NIXL is not installed (pip install nixl-cu12==1.5.1): one-sided path untested",
)
_names = itertools.count()
WAIT_S = 10.0


class NixlPipeline(Pipeline):
    """A Pipeline whose workers move KV with one-sided NIXL writes."""

    def __init__(self, model: Transformer, **kwargs: object) -> None:
        tag = f"{os.getpid()}-{next(_names)}"

        def agent(role: str, engine: HandoffEngine) -> NixlAgent:
            return NixlAgent(f"{role}-{tag}", new_area(*area_shape(engine.pool)))

        super().__init__(model, agent=agent, **kwargs)  # type: ignore[arg-type]

    def run(self) -> None:
        """Until quiet, WRITEs in flight and awaited notifications included."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            super().run()
            landing = any(i.complete is not None for i in self.decode.inbound.values())
            if not (self.prefill.posted or self.prefill.awaiting_key or landing):
                return
            self.prefill.run_once()
            self.decode.run_once()
        raise AssertionError("the one-sided transfers did not settle")

    def wait(self, done: Callable[[], bool]) -> None:
        deadline = time.monotonic() + WAIT_S
        while not done():
            assert time.monotonic() < deadline, "timed out"
            self.prefill.run_once()  # decode only polls: its requests must not step meanwhile
            self.decode.tick(time.monotonic())
            time.sleep(0.001)

    def close(self) -> None:
        for worker in (self.prefill, self.decode):
            if worker.agent is not None:
                worker.agent.close()


@pytest.fixture
def pipes() -> Iterator[Callable[..., NixlPipeline]]:
    made: list[NixlPipeline] = []

    def make(model: Transformer, **kwargs: object) -> NixlPipeline:
        made.append(NixlPipeline(model, **kwargs))
        return made[-1]

    yield make
    for pipe in made:
        pipe.close()


def test_a_worker_whose_agent_gave_up_takes_no_kv(
    tiny: Transformer, pipes: Callable[..., NixlPipeline]
) -> None:
    """Past its restart limit a landing process is not started again: decode refuses every reservation and
    prefill every prefill (503, kv_unavailable) before a page is reserved, instead of moving KV without
    it; the same workers serve again once their agents do."""
    pipe = pipes(tiny)
    free = pipe.decode.engine.allocator.num_free_pages
    pipe.decode.agent.given_up = True  # type: ignore[union-attr]
    refused = pipe.reserve("r1", "A", PROMPTS[13])
    assert isinstance(refused, Rejected) and (refused.code, refused.status) == (KV_UNAVAILABLE, 503)
    assert pipe.decode.engine.allocator.num_free_pages == free and "r1" not in pipe.decode.inbound
    pipe.decode.agent.given_up = False  # type: ignore[union-attr]
    reserved = pipe.reserve("r2", "A", PROMPTS[13])
    pipe.prefill.agent.given_up = True  # type: ignore[union-attr]
    refused = pipe.start_prefill("r2", "A", PROMPTS[13], targets(reserved))
    assert isinstance(refused, Rejected) and (refused.code, refused.status) == (KV_UNAVAILABLE, 503)
    assert "r2" not in pipe.prefill.transfers


def test_one_sided_tokens_equal_single_node(tiny: Transformer, pipes: Callable[..., NixlPipeline]) -> None:
    pipe = pipes(tiny)
    assert_tokens_equal_single_node(pipe, tiny)
    started = [e for e in pipe.prefill.engine.events.for_request("r3") if e["kind"] == "transfer_started"]
    assert started[0]["transport"] == "nixl"


# Decode's abort reason per fault. A dropped page is seen by its checksum here: decode hashes the bytes in
# its own pool, which are whatever the page held before.
ONE_SIDED_FAULTS = {
    "placeholder_transfer": (INCOMPLETE_HANDOFF, 8),
    "partial_transfer": (INCOMPLETE_HANDOFF, 64),
    "transfer_failure_ack_mismatch": (CHECKSUM_MISMATCH, 64),
    "corrupt_page": (CHECKSUM_MISMATCH, 64),
}


def run_fault(
    model: Transformer, make: Callable[..., NixlPipeline], name: str, isolation: bool
) -> NixlPipeline:
    pipe = make(model, isolation=isolation, prefill_pages=ONE_SIDED_FAULTS[name][1], decode_pages=12)
    fill_decode_pool_with_a_secret(pipe)
    pipe.prefill.engine.faults.arm(name, times=1)
    pipe.submit("b", "B", PROMPTS[40])
    pipe.run()
    assert pipe.prefill.engine.faults.fired == {name: 1}
    return pipe


@pytest.mark.parametrize("name", sorted(ONE_SIDED_FAULTS))
def test_one_sided_fault_leaks_with_isolation_off(
    tiny: Transformer, pipes: Callable[..., NixlPipeline], name: str
) -> None:
    pipe = run_fault(tiny, pipes, name, isolation=False)
    b = pipe.results["b"]
    assert b.status == "finished", "without the fence decode answers as if nothing happened"
    assert b.tokens != solo(tiny, PROMPTS[40])
    if name != "corrupt_page":  # pages never written for B, some holding tenant A's KV
        tenant_a = pipe.decode.engine.allocator.tenant_id("A")
        assert tenant_a in {access.last_writer for access in pipe.trace.foreign_reads("b")}


@pytest.mark.parametrize("name", sorted(ONE_SIDED_FAULTS))
def test_one_sided_fault_is_caught_with_isolation_on(
    tiny: Transformer, pipes: Callable[..., NixlPipeline], name: str
) -> None:
    reason = ONE_SIDED_FAULTS[name][0]
    pipe = run_fault(tiny, pipes, name, isolation=True)
    assert pipe.results["b"] == Result([], "aborted", reason)
    assert EngineStats.read(pipe.decode.engine).integrity_aborts[reason] == 1
    assert "step" not in pipe.decode.engine.events.kinds("b")
    assert lifecycle(pipe, "b")[-4:] == ["aborted", "quarantined", "drained", "released"]
    pipe.submit("c", "C", PROMPTS[13])
    pipe.run()
    assert pipe.results["c"] == Result(solo(tiny, PROMPTS[13]), "finished", "length")
    pipe.decode.engine.check_integrity()
    assert pipe.decode.engine.allocator.num_free_pages == pipe.decode.engine.pool.num_pages


def r1_acked_and_r2_in_its_pages(
    pipe: NixlPipeline, r2_prompt: int = 22, r2_tokens: int = 2
) -> Received | LinkEvent:
    """r1 is aborted and acked before prefill wrote it (the fault: the ack goes out, the work goes on); r2
    gets r1's pages, is written and verified. Returns r1's `prefill`, held up in the network."""
    reserved = pipe.reserve("r1", "A", PROMPTS[22][::-1], max_tokens=2)
    pipe.router.send(PREFILL, Prefill("r1", "A", PROMPTS[22][::-1], DECODE, targets(reserved)))
    held = pipe.hub.mailboxes[PREFILL].pop()
    pipe.prefill.engine.faults.arm("late_write_after_cancel", times=1)
    pipe.abort("r1")
    pipe.deliver(DECODE)
    pipe.deliver(PREFILL)  # the seal key, then the buggy ack
    pipe.deliver(DECODE)  # the quarantine drains now
    pipe.submit("r2", "B", PROMPTS[22][:r2_prompt], max_tokens=r2_tokens)
    pipe.wait(lambda: "r2" not in pipe.prefill.transfers and not pipe.prefill.posted)
    pipe.deliver(DECODE)  # r2's complete: opened, copied in, resumed
    return held


def late_one_sided_write(pipe: NixlPipeline) -> None:
    """Then r1's `prefill` arrives: r1 is computed and its WRITE lands in the landing slots of the pages
    r2 now holds."""
    pipe.hub.mailboxes[PREFILL].append(r1_acked_and_r2_in_its_pages(pipe))
    pipe.deliver(PREFILL)
    pipe.prefill.run_once()
    pipe.wait(lambda: not pipe.prefill.posted)
    pipe.run()


@pytest.mark.parametrize("isolation", [True, False], ids=["isolation on", "isolation off"])
def test_a_late_one_sided_write_reaches_no_pool_byte(
    tiny: Transformer, pipes: Callable[..., NixlPipeline], isolation: bool
) -> None:
    """The pool is not registered with NIXL, so even with the fence off a late WRITE only fills landing
    slots: r2 answers as alone. (Until the pool stopped being registered, this WRITE rewrote r2's pages:
    with isolation off r2 answered from r1's bytes, with it on r2 was aborted stale_write.)"""
    pipe = pipes(tiny, isolation=isolation, decode_pages=6)
    late_one_sided_write(pipe)
    assert pipe.prefill.engine.faults.fired == {"late_write_after_cancel": 1}
    assert pipe.results["r2"] == Result(solo(tiny, PROMPTS[22], max_tokens=2), "finished", "length")
    landing = pipe.decode.agent.area if pipe.decode.agent is not None else None
    assert landing is not None and landing.any(), "r1's late WRITE landed (in landing slots only)"
    assert pipe.decode.engine.allocator.num_free_pages == pipe.decode.engine.pool.num_pages


def rogue_write(pipe: NixlPipeline, pages: list[int], fill: int) -> None:
    """A third agent that got decode's metadata (a stolen prefill key, or UCX's open listener) WRITEs
    `fill` bytes into the landing slots of `pages`."""
    assert pipe.decode.agent is not None
    rogue = NixlAgent(f"rogue-{os.getpid()}-{next(_names)}", new_area(*area_shape(pipe.prefill.engine.pool)))
    try:
        rogue.area[:] = fill
        write = rogue.write(
            rogue.add_peer(pipe.decode.agent.metadata()),
            pipe.decode.agent.layout,
            [(i, page) for i, page in enumerate(pages)],
            "forged",
        )
        deadline = time.monotonic() + WAIT_S
        while rogue.poll(write) == "PROC":
            pipe.decode.agent.notified()
            assert time.monotonic() < deadline, "the rogue WRITE did not finish"
    finally:
        rogue.close()


def test_a_rogue_write_during_decoding_changes_no_token(
    tiny: Transformer, pipes: Callable[..., NixlPipeline]
) -> None:
    """Bytes written into r2's landing slots after its pages were opened never reach its pool pages: r2
    decodes on to its solo answer while the slots hold the rogue's bytes."""
    pipe = pipes(tiny, isolation=True, decode_pages=6)
    pipe.submit("r2", "B", PROMPTS[22][:20], max_tokens=4)
    pipe.wait(lambda: "r2" not in pipe.prefill.transfers and not pipe.prefill.posted)
    pipe.deliver(DECODE)
    pages = list(pipe.decode.engine.requests["r2"].record.pages)
    pipe.decode.run_once()
    before = pipe.decode.engine.pool.kv[:, :, pages].clone()
    rogue_write(pipe, pages, fill=0x41)
    assert pipe.decode.agent is not None and (pipe.decode.agent.area[pages] == 0x41).all()
    written_before = pipe.decode.engine.pool.written[pages].copy()
    pipe.run()
    assert pipe.results["r2"] == Result(solo(tiny, PROMPTS[22][:20], max_tokens=4), "finished", "length")
    kv = pipe.decode.engine.pool.kv[:, :, pages]
    for i, slots in enumerate(written_before.tolist()):  # the slots written before the rogue's WRITE
        assert torch.equal(kv[:, :, i, :slots], before[:, :, i, :slots])


def test_a_rogue_write_before_complete_aborts_the_request(
    tiny: Transformer, pipes: Callable[..., NixlPipeline]
) -> None:
    """A write into a live grant's landing slots, after the honest WRITE and before `complete` is handled:
    the page no longer opens under the request's key, so it is aborted and no byte of it is copied in."""
    pipe = pipes(tiny, isolation=True, decode_pages=6)
    pipe.submit("r2", "B", PROMPTS[22], max_tokens=2)
    pipe.wait(lambda: "r2" not in pipe.prefill.transfers and not pipe.prefill.posted)
    request = pipe.decode.engine.requests["r2"]
    rogue_write(pipe, request.record.pages[:1], fill=0x42)
    pipe.run()
    assert pipe.results["r2"] == Result([], "aborted", CHECKSUM_MISMATCH)
    refused = [e for e in pipe.decode.engine.events.for_request("r2") if e["kind"] == "write_refused"]
    assert refused and refused[0]["why"] in ("does not open", "torn or lost in transport")


def test_no_pool_is_registered(tiny: Transformer, pipes: Callable[..., NixlPipeline]) -> None:
    """What NIXL can address is the area alone, on either side: no byte of either pool lies in it."""
    pipe = pipes(tiny)
    for worker in (pipe.prefill, pipe.decode):
        assert worker.agent is not None
        kv, area = worker.engine.pool.kv, worker.agent.layout
        pool_start, pool_end = kv.data_ptr(), kv.data_ptr() + kv.numel() * kv.element_size()
        assert area.base + area.slots * area.slot_bytes <= pool_start or area.base >= pool_end


def test_a_prefill_after_its_abort_is_refused(tiny: Transformer, pipes: Callable[..., NixlPipeline]) -> None:
    """No order between router and decode: decode's abort may reach prefill before the router's `prefill`;
    a correct prefill then never writes into the grant."""
    pipe = pipes(tiny, isolation=True, decode_pages=6)
    reserved = pipe.reserve("r1", "A", PROMPTS[22], max_tokens=2)
    pipe.abort("r1")
    pipe.deliver(DECODE)
    pipe.deliver(PREFILL)
    pipe.deliver(DECODE)
    refused = pipe.start_prefill("r1", "A", PROMPTS[22], targets(reserved))
    assert refused.KIND == "rejected" and getattr(refused, "code") == "cancelled"  # noqa: B009
    assert not pipe.prefill.posted and "r1" not in pipe.prefill.transfers


def test_quarantine_holds_until_nixl_reports_the_write_done(
    tiny: Transformer, pipes: Callable[..., NixlPipeline], monkeypatch: pytest.MonkeyPatch
) -> None:
    pipe = pipes(tiny, isolation=True, decode_pages=6)
    reserved = pipe.reserve("r1", "A", PROMPTS[22], max_tokens=2)
    pages = [p for p, _ in targets(reserved)]
    agent = pipe.prefill.agent
    assert agent is not None
    real_poll = agent.poll
    monkeypatch.setattr(agent, "poll", lambda write: "PROC")  # the WRITE stays in flight
    pipe.start_prefill("r1", "A", PROMPTS[22], targets(reserved))
    pipe.prefill.run_once()
    assert "r1" in pipe.prefill.posted
    pipe.abort("r1")
    pipe.deliver(DECODE)
    pipe.deliver(PREFILL)
    for _ in range(50):  # however long it takes: no ack while NIXL says in progress
        pipe.prefill.tick(time.monotonic())
        pipe.decode.run_once()
    assert not pipe.hub.mailboxes[DECODE]
    assert (pipe.decode.engine.pool.state[pages] == PageState.QUARANTINED).all()
    monkeypatch.setattr(agent, "poll", real_poll)
    pipe.run()
    drained = [e for e in pipe.decode.engine.events.for_request("r1") if e["kind"] == "drained"]
    assert drained and drained[0]["how"] == "abort_ack"
    assert (pipe.decode.engine.pool.state[pages] == PageState.FREE).all()


def test_a_failed_write_aborts_the_request(
    tiny: Transformer, pipes: Callable[..., NixlPipeline], monkeypatch: pytest.MonkeyPatch
) -> None:
    pipe = pipes(tiny, isolation=True)
    assert pipe.prefill.agent is not None
    monkeypatch.setattr(pipe.prefill.agent, "poll", lambda write: "ERR")
    pipe.submit("r1", "A", PROMPTS[22])
    pipe.run()
    assert pipe.results["r1"] == Result([], "aborted", "transfer_failed")
    assert pipe.decode.engine.allocator.num_free_pages == pipe.decode.engine.pool.num_pages


def test_contiguous_runs_merge_only_where_both_sides_step_by_one() -> None:
    assert contiguous_runs([(3, 10), (4, 11), (5, 12)]) == [(3, 10, 3)]
    assert contiguous_runs([(5, 12), (4, 11), (3, 10)]) == [(3, 10, 3)]  # a queue freed tail first
    assert contiguous_runs([(3, 10), (4, 12), (5, 13), (9, 14)]) == [(3, 10, 1), (4, 12, 2), (9, 14, 1)]
    assert contiguous_runs([(3, 11), (4, 10)]) == [(3, 11, 1), (4, 10, 1)]  # targets step backwards
    assert contiguous_runs([]) == []


@pytest.mark.parametrize(
    "pairs",
    [[(p, p + 8) for p in range(8)], [(7 - p, 8 + p) for p in range(8)], [(1, 30), (0, 9), (6, 10), (5, 20)]],
    ids=["one run", "reversed", "scattered"],
)
def test_a_write_lands_exactly_on_its_target_slots(pairs: list[tuple[int, int]]) -> None:
    """Byte for byte, whatever the runs: each target slot holds its source slot, every other is untouched."""
    source, target = new_area(32, 96), new_area(32, 96)
    source[:] = np.random.default_rng(0).integers(0, 256, source.shape, dtype=np.uint8)
    target[:] = 7
    tag = f"{os.getpid()}-{next(_names)}"
    src, dst = NixlAgent(f"src-{tag}", source), NixlAgent(f"dst-{tag}", target)
    try:
        write = src.write(src.add_peer(dst.metadata()), dst.layout, pairs, "r")
        deadline = time.monotonic() + WAIT_S
        while src.poll(write) == "PROC":
            dst.notified()  # no progress thread: the target side advances only when polled
            assert time.monotonic() < deadline, "the WRITE did not finish"
        assert write.state == "DONE"
    finally:
        src.close()
        dst.close()
    for s, t in pairs:
        assert np.array_equal(target[t], source[s])
    untouched = sorted(set(range(32)) - {t for _, t in pairs})
    assert (target[untouched] == 7).all()


def test_a_run_outside_the_area_is_refused_before_ucx() -> None:
    """UCX would write wherever an address points: a run past the peer's slots never becomes a descriptor."""
    area = AreaLayout(base=4096, slots=8, slot_bytes=64)
    assert area.blocks([(6, 2)]).tolist() == [[4096 + 6 * 64, 128, 0]]
    for runs in ([(7, 2)], [(-1, 1)], [(0, 0)]):
        with pytest.raises(ValueError, match="outside the area"):
            area.blocks(runs)


def test_an_idle_agent_burns_no_cpu() -> None:
    """NIXL's progress thread spins a core even with nothing to move (two idle workers took both cores of
    this machine): the agent runs without it, progress made in `poll` and `notified`."""
    agent = NixlAgent(f"idle-{os.getpid()}-{next(_names)}", new_area(8, 64))
    try:
        cpu = time.process_time()
        time.sleep(0.3)
        cpu = time.process_time() - cpu
    finally:
        agent.close()
    assert cpu < 0.05, f"{cpu:.3f} s of CPU in 0.3 s of idling"


EXIT_SCRIPT = """
from kvfence.disagg.nixl_transport import NixlAgent, new_area
src, dst = NixlAgent("exit-src", new_area(8, 64)), NixlAgent("exit-dst", new_area(8, 64))
write = src.write(src.add_peer(dst.metadata()), dst.layout, [(0, 1)], "r")
while src.poll(write) == "PROC":
    dst.notified()
src.close()
dst.close()
print("wrote", write.state)
"""


def test_a_process_that_wrote_with_nixl_exits_cleanly() -> None:
    """NIXL has been seen to segfault at interpreter exit (with Debian's ibverbs-providers installed): a
    worker that crashes on its way out loses its exit status and its logs' last lines. Exit as a worker
    does, after `close`, and demand status 0."""
    done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout.splitlines()[-1:]) == (0, ["wrote DONE"]), done.stderr[-2000:]


def test_kv_agent_is_bounded_and_only_from_decode() -> None:
    bounds = Bounds(48, 256)
    header, payload = encode(KvAgent(0, 8, 64, b"x" * 10))
    assert accept(header, payload, "decode", "prefill", bounds).KIND == "kv_agent"
    with pytest.raises(BadMessage, match="wrong_role"):
        accept(header, payload, "router", "prefill", bounds)
    with pytest.raises(BadMessage, match="payload"):
        accept(header, b"x" * (MAX_AGENT_BYTES + 1), "decode", "prefill", bounds)


def test_what_a_landing_slot_holds_is_ciphertext(
    tiny: Transformer, pipes: Callable[..., NixlPipeline]
) -> None:
    """Between the WRITE and decode's copy-in, a reader of decode's landing area (UCX lets anyone who
    reaches it read it) finds each page sealed: the plaintext KV the prefill pool holds is not there."""
    pipe = pipes(tiny, isolation=True, decode_pages=6)
    pipe.submit("r2", "B", PROMPTS[22], max_tokens=2)
    sources = list(pipe.prefill.engine.requests["r2"].record.pages)
    pipe.wait(lambda: "r2" not in pipe.prefill.transfers and not pipe.prefill.posted)
    assert pipe.decode.agent is not None
    targets = pipe.decode.engine.requests["r2"].record.pages
    for logical, (source, target) in enumerate(zip(sources, targets, strict=False)):
        plain = pipe.prefill.engine.pool.page_bytes(source, pipe.prefill.engine.page_slots(21, logical))
        landed = pipe.decode.agent.area[target].tobytes()
        assert landed.strip(b"\0"), "nothing landed"
        assert plain[:64] not in landed and landed[: len(plain)] != plain
    pipe.run()
    assert pipe.results["r2"] == Result(solo(tiny, PROMPTS[22], max_tokens=2), "finished", "length")
