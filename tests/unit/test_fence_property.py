"""Stateful property test of the real engine's bookkeeping, with faults armed at random.

Hypothesis drives an `LLMEngine` on the tiny model (its scheduler, its KV cache manager with the prefix
cache, its runner and fence) through admissions (some forking into n > 1 sequences), steps and
cancellations on a pool small enough that prefix hits, chunked prefill, forks and preemption happen all the
time. A plain-Python oracle says, entry by
entry, whether a live request may still read a page; at every point the vectorised fence must flag
exactly the requests the oracle condemns, and the pool's invariants must hold.
"""

from __future__ import annotations

import contextlib

import numpy as np
from conftest import make_engine, tiny_model
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfence.cache.fence import StepLayout
from kvfence.cache.pool import NO_OWNER, PageState
from kvfence.engine.engine import AdmissionError
from kvfence.request import Request
from kvfence.sampling import SamplingParams

PAGE = 2
TENANTS = ["a", "b", "c"]
# Bookkeeping bugs the allocator, the prefix cache and the scheduler can be made to commit.
FAULTS = ["stale_mapping", "double_allocation", "cross_tenant_prefix_hit", "read_beyond_written"]
MODEL = tiny_model()


class FenceMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.engine = make_engine(
            MODEL, num_pages=12, page_size=PAGE, max_model_len=24, max_num_batched_tokens=8, max_num_seqs=4
        )
        self.pool = self.engine.pool
        self.faults = self.engine.faults
        self.generations = self.pool.generation.copy()

    @property
    def live(self) -> list[Request]:
        return list(self.engine.requests.values())

    # ---- actions ---------------------------------------------------------------------------------------

    @rule(
        tenant=st.sampled_from(TENANTS),
        tokens=st.lists(st.integers(0, 3), min_size=1, max_size=10),  # few values: many shared prefixes
        max_tokens=st.integers(1, 4),
        n=st.sampled_from([1, 1, 2, 3]),  # parallel sampling: forks share the prompt's pages
    )
    def start(self, tenant: str, tokens: list[int], max_tokens: int, n: int) -> None:
        # Over the window or the pool: refused before any page moved (tested elsewhere).
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        with contextlib.suppress(AdmissionError):
            self.engine.add_request(tokens, params, tenant, n=n)

    @rule()
    def step(self) -> None:
        """One real step: schedule (prefix hits, allocation, preemption), fence, model, publish."""
        self.engine.step()

    @precondition(lambda self: self.engine.requests)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.live))
        assert self.engine.abort(request.request_id) is not None

    @rule(fault=st.sampled_from(FAULTS))
    def arm(self, fault: str) -> None:
        self.faults.arm(fault, times=1)

    # ---- checks ----------------------------------------------------------------------------------------

    def _entry_ok(self, request: Request, logical: int) -> bool:
        """The oracle, one entry at a time: current generation, the tenant's, owned, written far enough
        for what the request believes is cached."""
        record = request.record
        page, generation = record.pages[logical], record.generations[logical]
        required = min(PAGE, max(0, request.num_computed_tokens - logical * PAGE))
        return bool(
            self.pool.generation[page] == generation
            and self.pool.owner[page] == record.tenant
            and self.pool.state[page] == PageState.OWNED
            and self.pool.written[page] >= required
        )

    def _current(self, request: Request, logical: int) -> bool:
        """The entry still names its page's present life, for the request's tenant."""
        page = request.record.pages[logical]
        return bool(
            self.pool.generation[page] == request.record.generations[logical]
            and self.pool.state[page] == PageState.OWNED
            and self.pool.owner[page] == request.record.tenant
        )

    def _condemned(self, request: Request) -> bool:
        return not all(self._entry_ok(request, i) for i in range(len(request.record.pages)))

    @invariant()
    def fence_flags_exactly_the_condemned(self) -> None:
        live = self.live
        if not live:
            return
        layout = StepLayout.reads_only([r.record for r in live], [r.num_computed_tokens for r in live])
        flagged = set(self.engine.fence.validate_step(layout))
        assert flagged == {i for i, r in enumerate(live) if self._condemned(r)}

    @invariant()
    def no_page_readable_by_two_tenants(self) -> None:
        readers: dict[int, set[int]] = {}
        for request in self.live:
            for i, page in enumerate(request.record.pages):
                if self._entry_ok(request, i):
                    readers.setdefault(page, set()).add(request.record.tenant)
        assert all(len(tenants) == 1 for tenants in readers.values())

    @invariant()
    def no_page_is_written_by_one_request_and_mapped_by_another(self) -> None:
        """Copy on write: a page a live request will still write (from its first uncomputed token on) is
        current in no other live record; what is shared (prefix hits, a fork's prompt) is full and final."""
        mappers: dict[int, set[str]] = {}
        for request in self.live:
            for i, page in enumerate(request.record.pages):
                if self._current(request, i):
                    mappers.setdefault(page, set()).add(request.request_id)
        for request in self.live:
            for i in range(request.num_computed_tokens // PAGE, len(request.record.pages)):
                if self._current(request, i):
                    assert mappers[request.record.pages[i]] == {request.request_id}

    @invariant()
    def a_fork_maps_what_its_forked_event_names(self) -> None:
        """Until preempted (then it starts over as a request of its own), a fork's record begins with
        exactly the pages and generations its `forked` event names: the parent's full pages, then its copy."""
        for request in self.live:
            trail = self.engine.events.for_request(request.request_id)
            if trail[0]["kind"] != "forked" or any(e["kind"] == "preempted" for e in trail):
                continue
            forked, record = trail[0], request.record
            count = len(forked["pages"])
            assert forked["pages"] == forked["shared"] + forked["copied"]
            assert list(record.pages[:count]) == forked["pages"]
            assert list(record.generations[:count]) == forked["generations"]

    @invariant()
    def generations_never_decrease(self) -> None:
        assert (self.pool.generation >= self.generations).all()
        self.generations = self.pool.generation.copy()

    @invariant()
    def free_pages_have_no_owner_and_no_references(self) -> None:
        free = self.pool.state == PageState.FREE
        assert (self.pool.owner[free] == NO_OWNER).all() and (self.engine.allocator.refcount[free] == 0).all()

    @invariant()
    def owned_pages_are_referenced_by_exactly_their_current_entries(self) -> None:
        """Bookkeeping holds while no fault has fired; a fired fault breaks it on purpose (it *is* a
        refcount bug), and then the safety invariants above are what must still hold."""
        if self.faults.fired:
            return
        current = np.zeros(self.pool.num_pages, dtype=np.int64)
        for request in self.live:
            for page, generation in zip(request.record.pages, request.record.generations, strict=True):
                if self.pool.generation[page] == generation and self.pool.state[page] == PageState.OWNED:
                    current[page] += 1
        owned = self.pool.state == PageState.OWNED
        assert (current[owned] == self.engine.allocator.refcount[owned]).all()

    @invariant()
    def engine_is_consistent(self) -> None:
        self.engine.check_integrity()


FenceMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_fence_state_machine = FenceMachine.TestCase
