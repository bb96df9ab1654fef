"""kvfence's Ray Serve request router: a tenant's repeated prefix goes to the replica whose pool holds it.

It routes the calls kvfence's front makes to the server replicas (kvfence.ray.front): each call's one
argument is a ForwardedRequest (kvfence.ray.forward), whose tenant and prompt text the router reads. A request
from a known tenant with text is steered by kvfence.ray.affinity (keyed MACs over tenant and prefix, an LRU
table, an imbalance threshold); anything else, and a steered request whose replica is full, is placed as Ray's
default router places it (power of two choices among the candidates, locality first).

Contracts: the MAC key is 32 random bytes made by each router instance as Serve initialises it (one per
front replica, in that process's memory only: never in an argument, the runtime_env or the GCS), so
affinity keys mean nothing outside that router; the table learns a placement when Ray reports the request
routed, and forgets a replica when Ray reports its actor dead. Queue lengths come from Ray's queue-length
cache, a replica missing there is probed; one that does not answer is not steered to.
"""

from __future__ import annotations

import secrets

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from kvfence.ray.affinity import (
    DEFAULT_CAPACITY,
    DEFAULT_IMBALANCE_THRESHOLD,
    MAC_KEY_BYTES,
    AffinityTable,
    prefix_keys,
    steer,
)
from kvfence.ray.forward import ForwardedRequest

ROUTER_CLASS = "kvfence.ray.router:TenantPrefixRouter"


class TenantPrefixRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Tenant-scoped prefix affinity over Ray's power-of-two placement."""

    def initialize_state(
        self, imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD, capacity: int = DEFAULT_CAPACITY
    ) -> None:
        self._mac_key = secrets.token_bytes(MAC_KEY_BYTES)
        self._table = AffinityTable(int(capacity))
        self._imbalance_threshold = int(imbalance_threshold)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        fallback = await PowerOfTwoChoicesRequestRouter.choose_replicas(
            self, candidate_replicas=candidate_replicas, pending_request=pending_request
        )
        keys = self._keys(pending_request)
        if not keys or not fallback:
            return fallback
        by_id = {replica.replica_id.to_full_id_str(): replica for replica in candidate_replicas}
        owner = steer(self._table, keys, await self._queue_lens(by_id), self._imbalance_threshold)
        if owner is None:
            return fallback
        return [[by_id[owner]], *fallback]  # the owner full: Ray tries the next rank

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        keys = self._keys(pending_request)
        if keys:
            self._table.record(keys, replica_id.to_full_id_str())

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._table.forget(replica_id.to_full_id_str())

    def _keys(self, pending_request: PendingRequest | None) -> list[bytes]:
        if pending_request is None or len(pending_request.args) != 1:
            return []
        request = pending_request.args[0]
        if not isinstance(request, ForwardedRequest) or request.tenant is None:
            return []
        return prefix_keys(self._mac_key, request.tenant, request.prompt)

    async def _queue_lens(self, by_id: dict[str, RunningReplica]) -> dict[str, int]:
        """Each candidate's queue length: Ray's cached value, else a probe; no answer, no entry."""
        lens, unknown = {}, []
        for name, replica in by_id.items():
            cached = (
                self._replica_queue_len_cache.get(replica.replica_id)
                if self._use_replica_queue_len_cache
                else None
            )
            if cached is None:
                unknown.append(replica)
            else:
                lens[name] = cached
        for replica, queue_len in await self._probe_queue_lens(unknown, 0) if unknown else []:
            if queue_len is not None:
                lens[replica.replica_id.to_full_id_str()] = queue_len
        return lens
