"""The engine as a prefill or decode worker drives it: the single-node engine plus the handoff.

Prefill side: `add_prefill` computes a prompt's KV and parks the request with its pages until they are
sent (`finish_transfer`). Decode side: `reserve` admits a request and holds pages for the KV to come,
`resume` schedules it once the KV is verified, and `drain` releases a quarantined request's pages once
nothing more can land in them. No transport writes into the pool: one-sided writes land in a separate
area and enter the pool only through the decode worker's opened, fenced copy-in. Every terminal
transition still goes through the scheduler's one finish.
"""

from __future__ import annotations

from kvfence.engine.engine import LLMEngine
from kvfence.engine.output import RequestOutput
from kvfence.request import Request, Status
from kvfence.sampling import SamplingParams


class HandoffEngine(LLMEngine):
    def page_slots(self, tokens: int, logical: int) -> int:
        """Slots of logical page `logical` that `tokens` tokens fill: what a transfer carries of that page,
        derived alike by prefill and decode (never taken from the sender)."""
        ps = self.pool.page_size
        return max(0, min(ps, tokens - logical * ps))

    def add_prefill(self, prompt_token_ids: list[int], tenant: str, request_id: str) -> Request:
        """A prefill worker's request: compute the prompt's KV, sample nothing, then park it with its pages
        for the transfer. Refused (AdmissionError) before any page is reserved, like any request (an id
        a live request holds included: that request is left as it was)."""
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
        """The prefill side sent every page: its copy of the KV is no longer needed (a request that ended
        meanwhile, e.g. a send of it dropped, is gone already)."""
        if (request := self.requests.get(request_id)) is not None:
            self._finish(request, Status.FINISHED, "transferred")

    def reserve(
        self, prompt_token_ids: list[int], params: SamplingParams, tenant: str, request_id: str, n: int = 1
    ) -> Request | None:
        """A decode worker's request: admit it and reserve pages for the KV of every prompt token but the
        last (the decode side computes that one and samples from it), then park it until the KV arrives.
        None when the pages are not free right now (nothing is then held). Refused (AdmissionError) as
        `add_request` refuses, an id a live request holds included. `n` > 1: forked once its prompt is
        computed, as `add_request` forks."""
        request = self._admit(prompt_token_ids, params, tenant, request_id, n)
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
