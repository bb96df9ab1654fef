"""From sampled tokens to what a client sees: detokenised text, stop strings, the reason a request ends,
and the immutable snapshots (`RequestOutput`) handed to other threads.

The engine calls `append` once per sampled token and finishes the request when it answers a reason; this
module never finishes anything itself (the one finish stays with the scheduler).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvfence.model.tokenizer import IncrementalDecoder, Tokenizer
from kvfence.request import Request, Status
from kvfence.sampling import TokenLogprobs


@dataclass(frozen=True)
class RequestOutput:
    """An immutable snapshot of what one step changed for one request (safe to hand to other threads)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    status: Status
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    # One entry per new token when the request asked for logprobs (SamplingParams.logprobs), else None.
    logprobs: list[TokenLogprobs] | None = None
    index: int = 0  # the choice (n > 1: which fork; the parent's own outputs, aborts only, say 0)
    # With the first token of a request that asked for them: every prompt token's logprobs, the first
    # token's None (nothing precedes it).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # With the last output of a request that finished normally: seconds queued (arrival to first
    # scheduled), in prefill (to the first token) and in decode (to the last), by the engine's clock.
    phases: tuple[float, float, float] | None = None

    @classmethod
    def of(
        cls,
        request: Request,
        tokens: list[int] | None = None,
        text: str = "",
        logprobs: list[TokenLogprobs] | None = None,
    ) -> RequestOutput:
        first = len(request.output_token_ids) == len(tokens or []) > 0
        prompt = None
        if first and request.params.prompt_logprobs is not None:
            prompt = [request.prompt_logprobs.get(p) for p in range(len(request.prompt_token_ids))]
        return cls(
            request.request_id,
            tokens or [],
            text,
            request.is_finished,
            request.status,
            request.finish_reason,
            len(request.prompt_token_ids),
            len(request.output_token_ids),
            logprobs,
            request.index,
            prompt,
            _phases(request),
        )


def _phases(request: Request) -> tuple[float, float, float] | None:
    times = (request.arrival_time, request.scheduled_time, request.first_token_time, request.finish_time)
    if request.status is not Status.FINISHED or None in times:
        return None
    arrived, scheduled, first, last = times  # type: ignore[misc]
    return scheduled - arrived, first - scheduled, last - first


class OutputProcessor:
    """Per-request incremental decoders, and the stop rules: EOS, `max_tokens`, the window, stop strings
    and stop token ids.
    Without a tokenizer (tests on a tiny model) there is no text and no EOS, only token ids."""

    def __init__(self, tokenizer: Tokenizer | None, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.stop_token_ids = tokenizer.stop_token_ids if tokenizer else set()
        self._decoders: dict[str, IncrementalDecoder] = {}

    def start(self, request: Request) -> None:
        if self.tokenizer is not None:
            self._decoders[request.request_id] = IncrementalDecoder(
                self.tokenizer, request.params.skip_special_tokens
            )

    def forget(self, request_id: str) -> None:
        self._decoders.pop(request_id, None)

    def append(self, request: Request, token: int, last: bool = True) -> str | None:
        """Append a sampled token and its text; returns why the request must now finish, or None. `last`:
        no more tokens of this step follow (a verified step appends its accepted drafts first, and its
        grammar's matcher has consumed them all: its state speaks for the step's last token only)."""
        request.output_token_ids.append(token)
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        ending = self._ending(request, token, last)
        decoder = self._decoders.get(request.request_id)
        text = decoder.step(token, final=ending is not None) if decoder else ""
        if self._is_end(request, token) and not request.params.include_stop_str_in_output:
            text = self._without_end(text, token, request)
        request.output_text += text
        return self._stop_string(request) or ending

    @staticmethod
    def new_text(request: Request) -> str:
        """Text not yet streamed. While running, the last len(longest stop)-1 characters are held back:
        they may be the start of a stop string, which must never reach the client."""
        end = len(request.output_text)
        if not request.is_finished and request.params.stop:
            end -= max(len(s) for s in request.params.stop) - 1
        if end <= request.num_streamed_chars:
            return ""
        text = request.output_text[request.num_streamed_chars : end]
        request.num_streamed_chars = end
        return text

    def _without_end(self, text: str, token: int, request: Request) -> str:
        """vLLM: an end token's text is not part of the answer unless asked for. A stop token's piece goes
        whole; EOS's own text goes (it is "" unless `skip_special_tokens` is false), what it flushed stays."""
        if token in request.params.stop_token_ids or self.tokenizer is None:
            return ""
        return text.removesuffix(self.tokenizer.decode([token], skip_special_tokens=False))

    def _is_end(self, request: Request, token: int) -> bool:
        """Whether `token` ends the request as an end token: EOS (unless ignored) or a stop token id."""
        eos = token in self.stop_token_ids and not request.params.ignore_eos
        return eos or token in request.params.stop_token_ids

    def _ending(self, request: Request, token: int, last: bool) -> str | None:
        """Why `token`, just appended, is the request's last (EOS or a complete grammar: "stop", budget or
        window: "length"), or None. Known before the token is decoded, so that the decoder can give out what
        it holds back."""
        if self._is_end(request, token):
            return "stop"
        if last and request.grammar is not None and request.grammar.is_done:
            return "stop"  # structured output complete: only EOS could follow
        if (
            len(request.output_token_ids) >= request.params.max_tokens
            or request.num_tokens >= self.max_model_len
        ):
            return "length"
        return None

    @staticmethod
    def _stop_string(request: Request) -> str | None:
        """A stop string appeared: the text is cut where it starts (after it, with
        `include_stop_str_in_output`) and the reason is "stop"."""
        for stop in request.params.stop:
            # A stop string can only start in text not yet streamed (see new_text).
            cut = request.output_text.find(stop, request.num_streamed_chars)
            if cut != -1:
                kept = cut + len(stop) if request.params.include_stop_str_in_output else cut
                request.output_text = request.output_text[:kept]
                return "stop"
        return None
