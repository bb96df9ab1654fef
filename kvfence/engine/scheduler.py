"""Continuous batching with chunked prefill, recompute preemption and fairness between tenants.

Each step: running requests go first (a decode token each, then prefill chunks, least-served tenant
first), then waiting requests join in weighted-fair order across tenants (fairness.py) while the token
budget, the sequence limit, the free pages and the tenant's own limits (running requests, pages held)
allow. The budget is `max_num_batched_tokens`, or `alone_tokens` when the only request in all (running or
waiting) has a prompt to prefill (`step_budget`). When a running request needs a page and none is free,
a running request of the tenant holding the most pages is preempted (its most recently admitted one): its
pages are released and it restarts from its tokens later (recompute), so the pool running dry is never a
crash, and the tenant over its share pays for it.

With a drafter (speculative decoding), a decode row also carries the draft tokens it verifies this step
(`Request.draft_token_ids`): as many as its adaptive draft length (draft_lengths.py: from its own
acceptance so far), the step's draft rows (`draft_rows`), the step's token
budget, the request's output budget and the pages it holds plus the free ones allow (a guess never
preempts anyone).

`finish` is the one way a request leaves: it makes the terminal transition and releases the pages.
`fork` turns a parent whose prompt is computed into its n running forks (parallel sampling).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container
from dataclasses import dataclass

from kvfence.cache.manager import KVCacheManager
from kvfence.engine.draft_lengths import DraftLengths
from kvfence.engine.drafter import Drafter
from kvfence.engine.fairness import TenantQueues
from kvfence.request import Request, Status
from kvfence.trail.events import EventLog
from kvfence.trail.faults import FaultInjector

# Rows a step's decode rows and drafts may come to before no more drafts are added: past it a step is
# compute-bound on CPU (more rows cost more time, where a few rows cost about what one does, the weights
# read once for a tile of them), so drafts that may be rejected would slow every stream. SmolLM2, 16
# streams on 2 cores: 4 drafts each took 0.95-1.03x the tokens/s of none. Letting drafts grow past it (one
# per decode row, adaptive lengths) at 16 streams on copy tasks cut steps 68 -> 61 for rows 1008 -> 1125
# (481 of 598 drafts kept, in process): about 0.94x if a step costs a fixed ~4.65 rows' worth plus one a
# row (the estimate the 4-draft measurement gives), so it stays the cap.
DRAFT_ROWS = 16


def draft_rows(decode_rows: int) -> int:
    """Draft rows a step with `decode_rows` decode rows may add: up to DRAFT_ROWS rows in all."""
    return max(0, DRAFT_ROWS - decode_rows)


@dataclass
class Batch:
    requests: list[Request]
    num_new_tokens: list[int]

    def drop(self, request_ids: Container[str]) -> None:
        """Take the rows of `request_ids` out of the step (they end before running)."""
        kept = [
            (r, n)
            for r, n in zip(self.requests, self.num_new_tokens, strict=True)
            if r.request_id not in request_ids
        ]
        self.requests[:] = [r for r, _ in kept]
        self.num_new_tokens[:] = [n for _, n in kept]


@dataclass(frozen=True)
class TenantLimits:
    """What one tenant may hold at once; None: no limit of its own (the engine's limits apply)."""

    max_running: int | None = None
    max_waiting: int | None = None
    max_pages: int | None = None
    fair: bool = True  # weighted-fair order across tenants; False: arrival order (comparisons only)


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        events: EventLog,
        faults: FaultInjector,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        limits: TenantLimits = TenantLimits(),
        drafter: Drafter | None = None,
        num_speculative_tokens: int = 0,
        alone_tokens: int | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.drafter = drafter  # speculative decoding: None, one token per decode row
        self.num_speculative_tokens = num_speculative_tokens
        self.draft_lengths = DraftLengths(max(1, num_speculative_tokens))
        self.full_drafts = True  # this step's rows all draft up to num_speculative_tokens (see `schedule`)
        self.events = events
        self.faults = faults
        self.page_size = kv_cache.page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.alone_tokens = max(alone_tokens or 0, max_num_batched_tokens)  # see `step_budget`
        self.limits = limits
        self.waiting = TenantQueues(limits.fair)
        self.running: list[Request] = []
        self.admitting: Request | None = None  # the request `_admit` works on (fault ledgers read it)
        self.transferring: dict[str, Request] = {}  # pages held, not scheduled: KV is moving in or out
        self.quarantined: dict[str, Request] = {}  # aborted mid-transfer: pages held until the drain
        self.num_preemptions = 0  # since start, for vLLM's `vllm:num_preemptions`

    def add(self, request: Request) -> None:
        self.waiting.push(request, active=any(r.tenant == request.tenant for r in self.running))

    def has_work(self) -> bool:
        """Whether a step would compute anything (transferring requests wait for messages, not steps)."""
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        batch = Batch([], [])
        budget = self.step_budget()
        decode = [r for r in self.running if r.num_tokens - r.num_computed_tokens <= 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        preempted = False
        spare = draft_rows(len(decode))  # verification rows the step may add
        # Where every row's full K drafts fit the floor they cost about nothing: no row is held back.
        self.full_drafts = len(decode) * (1 + self.num_speculative_tokens) <= DRAFT_ROWS
        if self.drafter is not None:
            self.drafter.prepare(self._draft_wants(decode, budget, spare))
        for request in decode:  # one token each, as admitted: they keep streams moving
            if budget == 0:
                break
            if request.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            n = 1 + self._propose(request, min(budget - 1, spare))
            spare -= n - 1
            if not self._reserve(request, n, batch.requests):
                preempted = True
                continue
            budget -= self._add(batch, request, n)
        admitting = not preempted
        while budget > 0:  # prefill work, running chunks and admissions alike: least-served tenant first
            running = min(
                (r for r in prefilling if r.status is Status.RUNNING), key=self.waiting.rank, default=None
            )
            waiting = self._next_admission() if admitting else None
            if running is None and waiting is None:
                break
            if waiting is not None and (
                running is None or self.waiting.rank(waiting) < self.waiting.rank(running)
            ):
                n = self._admit(waiting, budget)
                if n == 0:  # not enough free pages for it now: the running chunks still go
                    admitting = False
                    continue
                self.waiting.remove(waiting)
                waiting.move_to(Status.RUNNING)
                self.running.append(waiting)
                budget -= self._add(batch, waiting, n)
                continue
            assert running is not None
            prefilling.remove(running)
            n = min(running.num_tokens - running.num_computed_tokens, budget)
            if not self._reserve(running, n, batch.requests):
                admitting = False  # pages ran out: nothing new starts this step
                continue
            budget -= self._add(batch, running, n)
        return batch

    def step_budget(self) -> int:
        """The step's token budget: `alone_tokens` when its only work is one prompt's prefill (one request
        in all, running or waiting, with more than its next token to compute), else
        `max_num_batched_tokens`. Alone, a longer chunk delays nobody scheduled; a request arriving during
        it waits for that step to end."""
        if len(self.running) + len(self.waiting) != 1:
            return self.max_num_batched_tokens
        (request,) = self.running or self.waiting.heads()
        return (
            self.alone_tokens
            if request.num_tokens - request.num_computed_tokens > 1
            else self.max_num_batched_tokens
        )

    def _draft_wants(self, decode: list[Request], budget: int, spare: int) -> list[tuple[Request, int]]:
        """The drafts each decode row will ask for this step if the drafter has them: the loop in `schedule`
        asked in advance, so that a drafter that computes them does so for every row at once."""
        wants = []
        for request in decode:
            k = self._draft_room(request, min(budget - 1, spare))
            if k > 0:
                wants.append((request, k))
            spare, budget = spare - k, budget - 1 - k
        return wants

    def _propose(self, request: Request, budget: int) -> int:
        """Draft tokens for a decode row to verify this step (`request.draft_token_ids`), as many as
        `_draft_room` allows and the drafter has."""
        k = self._draft_room(request, budget)
        request.draft_token_ids = self.drafter.propose(request, k) if self.drafter and k > 0 else []
        return len(request.draft_token_ids)

    def _draft_room(self, request: Request, budget: int) -> int:
        """Drafts a decode row may verify: at most its draft length (num_speculative_tokens while the step's
        rows fit DRAFT_ROWS with every row's), the step's `budget` and its output
        budget less the one token it always produces, and no more than its own pages and the free ones hold
        (a guess never preempts anyone). 0 for a request whose every token must be sampled alone: one
        with logprobs or forks to start."""
        if self.drafter is None or request.forks or request.prefill_only:
            return 0
        if request.params.logprobs is not None or budget <= 0:
            return 0
        held = (len(request.record) + self.kv_cache.num_free_pages) * self.page_size
        return max(
            0,
            min(
                self.num_speculative_tokens
                if self.full_drafts
                else self.draft_lengths.length(request.request_id, len(request.output_token_ids)),
                budget,
                request.params.max_tokens - len(request.output_token_ids) - 1,
                held - request.num_computed_tokens - 1,
            ),
        )

    def _next_admission(self) -> Request | None:
        if not len(self.waiting):
            return None
        return self.waiting.next(self._may_start())

    def _add(self, batch: Batch, request: Request, n: int) -> int:
        batch.requests.append(request)
        batch.num_new_tokens.append(n)
        self.waiting.charge(request.tenant, n)
        return n

    def _may_start(self) -> set[str]:
        """Tenants whose next request fits max_num_seqs and their own limits on running requests and pages
        held. A parent counts as its n forks (n > 1): they all run once its prompt is computed."""
        limits = self.limits
        running = Counter[str]()
        for r in self.running:
            running[r.tenant] += _width(r)
        rows = sum(running.values())
        pages = self._held() if limits.max_pages is not None else None
        return {
            r.tenant
            for r in self.waiting.heads()
            if rows + _width(r) <= self.max_num_seqs
            and running[r.tenant] + _width(r) <= (limits.max_running or self.max_num_seqs)
            and (pages is None or pages[r.tenant] < limits.max_pages)
        }

    def _held(self) -> Counter[str]:
        """Pages held by running requests, by tenant."""
        held: Counter[str] = Counter()
        for request in self.running:
            held[request.tenant] += len(request.record)
        return held

    def _victim(self, scheduled: list[Request]) -> Request:
        """Whom to preempt when pages run out: among running requests not already in this step's batch,
        the most recently admitted one of the tenant holding the most pages."""
        held, taken = self._held(), set(scheduled)
        candidates = [r for r in self.running if r not in taken]
        heaviest = max({r.tenant for r in candidates}, key=lambda t: held[t])
        return next(r for r in reversed(candidates) if r.tenant == heaviest)

    def _reserve(self, request: Request, n: int, scheduled: list[Request]) -> bool:
        """Pages for `request`'s next n tokens, preempting others not yet `scheduled` this step as needed.
        False when `request` itself had to be preempted."""
        total = request.num_computed_tokens + n
        while self.kv_cache.pages_needed(request, total) > self.kv_cache.num_free_pages:
            victim = self._victim(scheduled)
            self.preempt(victim)
            if victim is request:
                return False
        return self.kv_cache.allocate(request, total)

    def _admit(self, request: Request, budget: int) -> int:
        """Prefix lookup and pages for the first chunk; returns the chunk size, 0 when it cannot start yet."""
        self.admitting = request
        try:
            return self._first_chunk(request, budget)
        finally:
            self.admitting = None

    def _first_chunk(self, request: Request, budget: int) -> int:
        if not len(request.record) and request.params.prompt_logprobs is None:
            # At least one token must be computed to produce logits, so never take the last from cache; a
            # request for its prompt's logprobs computes every prompt token (a cached page has no logits).
            request.num_computed_tokens = self.kv_cache.share_cached_prefix(request, request.num_tokens - 1)
        n = min(request.num_tokens - request.num_computed_tokens, budget)
        if not self.kv_cache.allocate(request, request.num_computed_tokens + n):
            self.kv_cache.release(request)  # give back prefix pages too: a waiting request holds nothing
            request.num_computed_tokens = 0
            return 0
        if request.num_computed_tokens == 0 and self.faults.fire("read_beyond_written"):
            n = self._believe_unwritten_prefix(request, n)
        return n

    def _believe_unwritten_prefix(self, request: Request, n: int) -> int:
        """Fault `read_beyond_written`: the request believes its first full pages already hold its prompt
        (as decode did in the incident) and computes only the rest, reading pages nobody wrote for it."""
        full = (request.num_computed_tokens + n - 1) // self.page_size * self.page_size
        if full == 0:
            return n
        self.events.emit(request.request_id, "fault_injected", fault="read_beyond_written", tokens=full)
        self.faults.record("read_beyond_written", request_id=request.request_id, tokens=full)
        request.num_computed_tokens = full
        return n - full

    def preempt(self, request: Request) -> None:
        """Release every page; the request restarts later from its tokens (prompt + output so far)."""
        self.running.remove(request)
        self.kv_cache.release(request)
        if self.drafter is not None:
            self.drafter.forget(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.move_to(Status.WAITING)
        self.waiting.push(request, front=True)
        self.events.emit(request.request_id, "preempted")

    def fork(self, parent: Request) -> None:
        """Hand a parent's computed prompt to its forks, which run from the next step on its pages (full
        pages shared, the partial one copied) as requests of their own. The copies' pages are freed first
        by preempting other running requests as needed, never the parent: admission checked that the
        parent and its copies fit the pool. The parent's own finish is the caller's."""
        tokens = parent.num_computed_tokens
        while self.kv_cache.fork_pages_needed(tokens, len(parent.forks)) > self.kv_cache.num_free_pages:
            self.preempt(self._victim([parent]))
        self.kv_cache.fork(parent, parent.forks, tokens)
        for child in parent.forks:
            child.num_computed_tokens = tokens
            child.move_to(Status.RUNNING)
            self.running.append(child)

    def reserve(self, request: Request, tokens: int) -> bool:
        """Allocate pages for the request's first `tokens` tokens now, or nothing."""
        return self.kv_cache.allocate(request, tokens)

    def park(self, request: Request) -> None:
        """Hold the request's pages without scheduling it while its KV is transferred."""
        if request in self.running:
            self.running.remove(request)
        request.move_to(Status.TRANSFERRING)
        self.transferring[request.request_id] = request

    def resume(self, request: Request) -> None:
        """The KV has arrived: schedule the request next, with the pages it already holds."""
        del self.transferring[request.request_id]
        request.move_to(Status.WAITING)
        self.waiting.push(request, front=True)

    def finish(self, request: Request, status: Status, reason: str, quarantine: bool = False) -> None:
        """The single exit: terminal transition, request out of every queue, pages released — or, with
        `quarantine`, blocked and kept until `drain` confirms no transfer into them is in flight."""
        request.finish(status, reason)
        if self.drafter is not None:
            self.drafter.forget(request.request_id)
            self.draft_lengths.forget(request.request_id)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.transferring.pop(request.request_id, None)
        if status is Status.FINISHED:
            self.kv_cache.release(request)
            self.events.emit(
                request.request_id, "finished", reason=reason, output_tokens=len(request.output_token_ids)
            )
            return
        # The verdict goes on the record before anything else happens to the pages.
        if status is Status.REJECTED:  # never admitted: the tenant goes on the record here
            self.events.emit(request.request_id, "rejected", reason=reason, tenant=request.tenant)
        else:
            self.events.emit(request.request_id, "aborted", reason=reason)
        if quarantine and len(request.record):
            self.kv_cache.quarantine(request)
            self.quarantined[request.request_id] = request
        else:
            self.kv_cache.release(request)

    def drain(self, request_id: str, how: str) -> bool:
        """Release a quarantined request's pages: `how` says what proves nothing more can land in them
        (the sender's abort-ack, or the sender's death fenced by the generation bump of reallocation)."""
        request = self.quarantined.pop(request_id, None)
        if request is None:
            return False
        self.events.emit(request_id, "drained", how=how)
        self.kv_cache.release(request)
        return True


def _width(request: Request) -> int:
    """The sequences a running or waiting request stands for: its n forks (n > 1), else itself."""
    return max(1, len(request.forks))
