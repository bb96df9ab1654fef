"""vLLM's offline output shapes (`RequestOutput`, `CompletionOutput`, `Logprob`), built from the engine's
per-step snapshots (kvfence.engine.output.RequestOutput).

Contracts:
- A choice's `text`, `token_ids` and `logprobs` are the concatenation of its snapshots, in step order.
- A choice the engine aborted (the fence found its KV not its own, or a step failed) keeps no content:
  `text` "", `token_ids` [], `finish_reason` "abort" (vLLM's word); the engine's reason goes to the log.
  So an aborted request never reads as an answer (invariant 8).
- `cumulative_logprob` is the sum of the sampled tokens' logprobs when the request asked for logprobs,
  else None (vLLM's rule).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvfence.engine.output import RequestOutput as Snapshot
from kvfence.model.tokenizer import Tokenizer
from kvfence.request import Status, fork_id
from kvfence.sampling import TokenLogprobs

log = logging.getLogger("kvfence.offline")
ABORT = "abort"


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1: the likeliest token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool = True


@dataclass
class _Choice:
    """One choice's snapshots so far."""

    index: int
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    aborted: bool = False

    def add(self, snapshot: Snapshot) -> None:
        self.texts.append(snapshot.new_text)
        self.token_ids += snapshot.new_token_ids
        if snapshot.logprobs is not None:
            self.logprobs = (self.logprobs or []) + snapshot.logprobs
        if snapshot.finished:
            self.finish_reason = snapshot.finish_reason
            self.aborted = snapshot.status is not Status.FINISHED


class Collector:
    """The snapshots of one prompt's request: its choices (n > 1: its forks', `index` tells them apart) until
    each finished, or the parent itself, aborted before it forked."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], n: int) -> None:
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.choices = [_Choice(index) for index in range(n)]
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        self.parent_aborted: str | None = None

    def add(self, snapshot: Snapshot) -> None:
        if snapshot.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = snapshot.prompt_logprobs
        if snapshot.request_id != self.request_id or len(self.choices) == 1:
            self.choices[snapshot.index].add(snapshot)
        elif snapshot.finished:  # the parent of forks speaks only when it ends before forking: aborted
            self.parent_aborted = snapshot.finish_reason or ABORT

    @property
    def engine_ids(self) -> list[str]:
        """The engine request ids whose snapshots are this prompt's: its own and, n > 1, its forks'."""
        forks = [fork_id(self.request_id, c.index) for c in self.choices] if len(self.choices) > 1 else []
        return [self.request_id, *forks]

    @property
    def done(self) -> bool:
        return self.parent_aborted is not None or all(c.finish_reason is not None for c in self.choices)

    def output(self, tokenizer: Tokenizer | None, with_logprobs: bool) -> RequestOutput:
        outputs = [self._completion(choice, tokenizer, with_logprobs) for choice in self.choices]
        prompt = (
            None if self.prompt_logprobs is None else [_entry(e, tokenizer) for e in self.prompt_logprobs]
        )
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, prompt, outputs)

    def _completion(
        self, choice: _Choice, tokenizer: Tokenizer | None, with_logprobs: bool
    ) -> CompletionOutput:
        reason = self.parent_aborted if choice.finish_reason is None else choice.finish_reason
        if self.parent_aborted is not None or choice.aborted:
            log.warning("request %s choice %d aborted: %s", self.request_id, choice.index, reason)
            return CompletionOutput(choice.index, "", [], None, None, ABORT)
        entries = choice.logprobs or []
        logprobs = [_entry(e, tokenizer) for e in entries] if with_logprobs else None
        total = sum(e.logprob for e in entries) if with_logprobs else None
        return CompletionOutput(
            choice.index, "".join(choice.texts), choice.token_ids, total, logprobs, reason
        )


def _entry(entry: TokenLogprobs | None, tokenizer: Tokenizer | None) -> dict[int, Logprob] | None:
    """vLLM's shape of one position: the sampled token's and the top tokens', by token id."""
    if entry is None:
        return None

    def text(token: int) -> str | None:
        return None if tokenizer is None else tokenizer.decode([token], skip_special_tokens=False)

    found = {token: Logprob(logprob, rank, text(token)) for rank, (token, logprob) in enumerate(entry.top, 1)}
    found.setdefault(entry.token, Logprob(entry.logprob, entry.rank, text(entry.token)))
    return found
