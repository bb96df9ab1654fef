"""The engine as a prefill or decode worker drives it: the single-node engine plus the handoff.

Prefill side: `add_prefill` computes a prompt's KV and parks the request with its pages until they are
sent (`finish_transfer`). Decode side: `reserve` admits a request and holds pages for the KV to come,
`resume` schedules it once the KV is verified, and `drain` releases a quarantined request's pages once
nothing more can land in them; with one-sided transfers, `late_write_victims` is asked after each
forward, before its tokens are taken, which rows a write that should not have happened changed under them.
Every terminal transition still goes through the scheduler's one finish.
"""

from __future__ import annotations

from collections.abc import Callable

from kvfence.engine.engine import LLMEngine
from kvfence.engine.output import RequestOutput
from kvfence.engine.runner import StepResult
from kvfence.engine.scheduler import Batch
from kvfence.request import Request, Status
from kvfence.sampling import SamplingParams
from kvfence.trail.reasons import STALE_WRITE


class HandoffEngine(LLMEngine):
    # Set by a decode worker that takes one-sided writes: the live requests whose pages a late WRITE has
    # changed, found now (DecodeWorker.late_write_victims).
    late_write_victims: Callable[[], list[str]] | None = None

    def _apply(self, batch: Batch, result: StepResult) -> list[RequestOutput]:
        """A row that read bytes a late WRITE put in its pages is aborted before a token of its is taken:
        asked after the forward, so bytes that landed before or while the step read them are covered
        (a request finishing in this very step included)."""
        if self.late_write_victims is not None:
            for request_id in self.late_write_victims():
                result.aborted.setdefault(request_id, STALE_WRITE)
        return super()._apply(batch, result)

    def add_prefill(self, prompt_token_ids: list[int], tenant: str, request_id: str) -> Request:
        """A prefill worker's request: compute the prompt's KV, sample nothing, then park it with its pages
        for the transfer. Refused (AdmissionError) before any page is reserved, like any request."""
        request = self._admit(prompt_token_ids, SamplingParams(max_tokens=1), tenant, request_id)
        request.prefill_only = True
        self.scheduler.add(request)
        return request

    def _after_compute(self, request: Request) -> list[RequestOutput]:
        if request.prefill_only and request.num_computed_tokens == request.num_tokens:
            self.scheduler.park(request)
            return [RequestOutput.of(request)]
        return []

    def finish_transfer(self, request_id: str) -> None:
        """The prefill side sent every page: its copy of the KV is no longer needed."""
        self._finish(self.requests[request_id], Status.FINISHED, "transferred")

    def reserve(
        self, prompt_token_ids: list[int], params: SamplingParams, tenant: str, request_id: str
    ) -> Request | None:
        """A decode worker's request: admit it and reserve pages for the KV of every prompt token but the
        last (the decode side computes that one and samples from it), then park it until the KV arrives.
        None when the pages are not free right now (nothing is then held)."""
        request = self._admit(prompt_token_ids, params, tenant, request_id)
        if not self.scheduler.reserve(request, len(prompt_token_ids) - 1):
            self._finish(request, Status.ABORTED, "no_free_pages")
            return None
        self.scheduler.park(request)
        return request

    def resume(self, request_id: str) -> None:
        """The decode side verified the transferred KV: the request believes its prompt but the last token
        is cached, and is scheduled next."""
        request = self.requests[request_id]
        request.num_computed_tokens = request.num_tokens - 1
        self.scheduler.resume(request)

    def drain(self, request_id: str, how: str) -> bool:
        """Release a quarantined request's pages; `how` names what proves nothing more can land in them."""
        return self.scheduler.drain(request_id, how)
