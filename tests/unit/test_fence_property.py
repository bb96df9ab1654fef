"""Stateful property test over allocator + prefix cache + fence, with faults armed at random.

A plain-Python oracle says, entry by entry, whether a record may still read a page; after every step the
vectorised fence must flag exactly the records the oracle condemns, and the pool's invariants must hold.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfence.cache.allocator import PageAllocator
from kvfence.cache.fence import Fence, MappingRecord, StepLayout
from kvfence.cache.pool import NO_OWNER, KVPool, PageState
from kvfence.cache.prefix import PrefixCache, extend_chain
from kvfence.trail.faults import FaultInjector
from kvfence.units import cdiv

PAGE = 2
TENANTS = ["a", "b", "c"]
ALLOCATOR_FAULTS = ["stale_mapping", "double_allocation", "cross_tenant_prefix_hit"]


class Holder:
    """One live request as the test sees it: its record, its tokens, how many are written."""

    def __init__(self, tenant: str, tenant_id: int, tokens: list[int]) -> None:
        self.tenant = tenant
        self.record = MappingRecord(tenant_id)
        self.tokens = tokens
        self.written = 0
        self.hashes: list[int] = []


class FenceMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = KVPool(1, 12, PAGE, 1, 2, torch.float32, "cpu")
        self.faults = FaultInjector(seed=1)
        self.prefix = PrefixCache(self.pool, self.faults)
        self.allocator = PageAllocator(self.pool, self.prefix, self.faults)
        self.fence = Fence(self.pool)
        self.holders: list[Holder] = []
        self.generations = self.pool.generation.copy()

    # ---- actions ---------------------------------------------------------------------------------------

    @rule(tenant=st.sampled_from(TENANTS), tokens=st.lists(st.integers(0, 3), min_size=1, max_size=8))
    def start(self, tenant: str, tokens: list[int]) -> None:
        """A new request: prefix hit where possible, then fresh pages for the rest (if they fit)."""
        holder = Holder(tenant, self.allocator.tenant_id(tenant), tokens)
        extend_chain(tenant, holder.hashes, tokens, PAGE)
        hit = self.prefix.lookup(holder.record.tenant, holder.hashes[: (len(tokens) - 1) // PAGE])
        self.allocator.share(holder.record, hit)
        holder.written = len(hit) * PAGE
        need = cdiv(len(tokens), PAGE) - len(hit)
        if need > self.allocator.num_free_pages:
            self.allocator.release(holder.record)
            return
        self.allocator.allocate(holder.record, need)
        self.holders.append(holder)

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def write(self, data: st.DataObject) -> None:
        """The model writes a holder's next tokens (only where the fence would allow it), then publishes
        full pages to the prefix cache."""
        holder = data.draw(st.sampled_from(self.holders))
        if self._condemned(holder) or holder.written == len(holder.tokens):
            return
        n = data.draw(st.integers(1, len(holder.tokens) - holder.written))
        positions = np.arange(holder.written, holder.written + n)
        pages = np.array(holder.record.pages)[positions // PAGE]
        self.pool.commit_writes(pages, positions % PAGE)
        holder.written += n
        for logical in range(holder.written // PAGE):
            page = holder.record.pages[logical]
            if not self.prefix.is_cached(page):
                self.prefix.insert(page, holder.hashes[logical])

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        """Finish, cancel or preempt: all three release the record."""
        holder = data.draw(st.sampled_from(self.holders))
        self.holders.remove(holder)
        self.allocator.release(holder.record)

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def overclaim(self, data: st.DataObject) -> None:
        """Fault `read_beyond_written`, as in the incident: a request believes all its tokens are cached
        although nobody wrote them."""
        holder = data.draw(st.sampled_from(self.holders))
        holder.written = len(holder.tokens)

    @rule(fault=st.sampled_from(ALLOCATOR_FAULTS))
    def arm(self, fault: str) -> None:
        self.faults.arm(fault, times=1)

    # ---- checks ----------------------------------------------------------------------------------------

    def _entry_ok(self, holder: Holder, logical: int) -> bool:
        """The oracle, one entry at a time."""
        page, generation = holder.record.pages[logical], holder.record.generations[logical]
        required = min(PAGE, max(0, holder.written - logical * PAGE))
        return bool(
            self.pool.generation[page] == generation
            and self.pool.owner[page] == holder.record.tenant
            and self.pool.state[page] == PageState.OWNED
            and self.pool.written[page] >= required
        )

    def _condemned(self, holder: Holder) -> bool:
        return not all(self._entry_ok(holder, i) for i in range(len(holder.record.pages)))

    @invariant()
    def fence_flags_exactly_the_condemned(self) -> None:
        if not self.holders:
            return
        layout = StepLayout.reads_only([h.record for h in self.holders], [h.written for h in self.holders])
        flagged = set(self.fence.validate_step(layout))
        assert flagged == {i for i, h in enumerate(self.holders) if self._condemned(h)}

    @invariant()
    def no_page_readable_by_two_tenants(self) -> None:
        readers: dict[int, set[int]] = {}
        for holder in self.holders:
            for i, page in enumerate(holder.record.pages):
                if self._entry_ok(holder, i):
                    readers.setdefault(page, set()).add(holder.record.tenant)
        assert all(len(tenants) == 1 for tenants in readers.values())

    @invariant()
    def generations_never_decrease(self) -> None:
        assert (self.pool.generation >= self.generations).all()
        self.generations = self.pool.generation.copy()

    @invariant()
    def free_pages_have_no_owner_and_no_references(self) -> None:
        free = self.pool.state == PageState.FREE
        assert (self.pool.owner[free] == NO_OWNER).all() and (self.allocator.refcount[free] == 0).all()

    @invariant()
    def owned_pages_are_referenced_by_exactly_their_current_entries(self) -> None:
        """Bookkeeping holds while no fault has fired; a fired fault breaks it on purpose (it *is* a
        refcount bug), and then the safety invariants above are what must still hold."""
        if self.faults.fired:
            return
        current = np.zeros(self.pool.num_pages, dtype=np.int64)
        for holder in self.holders:
            for page, generation in zip(holder.record.pages, holder.record.generations, strict=True):
                if self.pool.generation[page] == generation and self.pool.state[page] == PageState.OWNED:
                    current[page] += 1
        owned = self.pool.state == PageState.OWNED
        assert (current[owned] == self.allocator.refcount[owned]).all()

    @invariant()
    def allocator_is_consistent(self) -> None:
        self.allocator.check_integrity()


FenceMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_fence_state_machine = FenceMachine.TestCase
