"""Ray Serve LLM's PrefixCacheAffinityRouter as bench/ray_serve.py compares it (kvfence.ray.bench): only
on the calls it is made for. In Ray Serve LLM its handle carries chat and completion requests alone; behind
kvfence's front the same handle also carries /metrics and the like, whose empty text it cannot take (its
match rate divides by the text's length), so those are placed by Ray's power-of-two choice, as kvfence's
own router places them. Benchmark only, never a kvfence option: it keeps every tenant's raw prompt text in
one shared prefix-tree actor, and steers a tenant by another's prompts.
"""

from __future__ import annotations

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter,
)
from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RunningReplica

from kvfence.ray.forward import ForwardedRequest


class PrefixCacheOnPrompts(PrefixCacheAffinityRouter):
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if _has_text(pending_request):
            return await super().choose_replicas(candidate_replicas, pending_request)
        return await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        if _has_text(pending_request):
            super().on_request_routed(pending_request, replica_id, result)


def _has_text(pending_request: PendingRequest | None) -> bool:
    args = pending_request.args if pending_request is not None else []
    return len(args) == 1 and isinstance(args[0], ForwardedRequest) and bool(args[0].prompt)
