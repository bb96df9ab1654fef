"""A request and its lifecycle state machine.

`Request.finish` is the ONLY place a request becomes FINISHED, ABORTED or REJECTED, and `is_finished` is
the one predicate every stage asks (invariant 5). There is no second flag that could disagree with it.
A request with n > 1 is a parent that forks into n requests once its prompt is computed, then finishes
("forked"); each fork has its own lifecycle and its own one finish.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from kvfence.cache.fence import MappingRecord
from kvfence.grammar.compiler import RequestGrammar
from kvfence.sampling import SamplingParams, TokenLogprobs


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    TRANSFERRING = "transferring"  # pages held while KV moves between prefill and decode workers
    FINISHED = "finished"
    ABORTED = "aborted"
    REJECTED = "rejected"


TERMINAL = frozenset({Status.FINISHED, Status.ABORTED, Status.REJECTED})
_ALLOWED = {
    # WAITING -> TRANSFERRING: a decode worker reserved pages and awaits the prompt's KV.
    Status.WAITING: {Status.RUNNING, Status.TRANSFERRING, Status.ABORTED, Status.REJECTED},
    # RUNNING -> WAITING: preemption. RUNNING -> TRANSFERRING: a prefill worker computed the prompt's KV.
    Status.RUNNING: {Status.WAITING, Status.TRANSFERRING, Status.FINISHED, Status.ABORTED},
    # TRANSFERRING -> WAITING: the decode side holds the whole prompt; FINISHED: the prefill side sent it.
    Status.TRANSFERRING: {Status.WAITING, Status.FINISHED, Status.ABORTED},
}


@dataclass(eq=False)  # one request is one object: equal and hashed by identity, so it can live in a set
class Request:
    request_id: str
    tenant: str
    prompt_token_ids: list[int]
    params: SamplingParams
    record: MappingRecord
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop"/"length" when FINISHED, the reason when ABORTED/REJECTED
    # Tokens whose KV this request believes is in its pages (the fence checks the belief against `written`).
    num_computed_tokens: int = 0
    output_text: str = ""
    num_streamed_chars: int = 0  # prefix of output_text already handed out
    generator: torch.Generator | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None  # first moved to RUNNING: the end of its queueing
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    page_hashes: list[int] = field(default_factory=list)  # prefix-cache chain over full pages of all tokens
    num_published_pages: int = 0  # logical pages already offered to the prefix cache
    prefill_only: bool = False  # a prefill worker's request: compute the prompt's KV, sample nothing
    grammar: RequestGrammar | None = None  # structured output: masks every sampled token (grammar/)
    # Parallel sampling (n > 1): the parent computes the prompt once; at its end its `forks` each sample
    # the parent's last logits with their own generator and go on as requests of their own on its pages.
    forks: list[Request] = field(default_factory=list)
    index: int = 0  # the choice this sequence answers: its place among its parent's forks, else 0
    parent_id: str | None = None  # a fork's parent (its id stays in use while the fork runs)
    # Speculative decoding: the tokens this step verifies after its last one (the scheduler's proposal, empty
    # when it drafts none), and how many slots past its accepted tokens its last verification wrote and took
    # back (they hold rejected drafts' KV until overwritten: nothing may read them).
    draft_token_ids: list[int] = field(default_factory=list)
    draft_tail: int = 0
    # Prompt position -> that prompt token's logprobs (SamplingParams.prompt_logprobs), as steps compute them.
    prompt_logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)

    def constrain(self, grammar: RequestGrammar | None) -> None:
        """Put the request under `grammar` (structured output). With forks (n > 1) each fork gets its own
        copy of the matcher: a matcher is one sequence's state, and the forks sample the parent's last
        logits (the parent samples nothing of its own)."""
        self.grammar = grammar
        for fork in self.forks:
            fork.grammar = None if grammar is None else grammar.fork()

    @property
    def prefix_namespace(self) -> str:
        """Whose cached KV this request may share: its tenant's, and within it its `cache_salt`'s."""
        salt = self.params.cache_salt
        return self.tenant if salt is None else f"{self.tenant}\x00cache_salt:{salt}"

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status in TERMINAL

    def move_to(self, status: Status) -> None:
        """Non-terminal transitions: scheduling and preemption (WAITING <-> RUNNING), and parking for a KV
        transfer and back (TRANSFERRING)."""
        assert status not in TERMINAL, "use finish() to end a request"
        self._check_transition(status)
        self.status = status
        if status is Status.RUNNING and self.scheduled_time is None:
            self.scheduled_time = time.monotonic()

    def finish(self, status: Status, reason: str) -> None:
        """The single terminal transition. Finishing twice is a bug and raises."""
        assert status in TERMINAL
        self._check_transition(status)
        self.status = status
        self.finish_reason = reason
        self.finish_time = time.monotonic()

    def _check_transition(self, status: Status) -> None:
        allowed = _ALLOWED.get(self.status, set())
        if status not in allowed:
            raise RuntimeError(f"request {self.request_id}: illegal transition {self.status} -> {status}")


def fork_id(parent_id: str, index: int) -> str:
    """The request id of a parent's fork number `index` (its audit trail's key)."""
    return f"{parent_id}.{index}"
