"""Fairness between tenants: who waits, who is admitted next, and whose work a step does first.

Waiting requests sit in one FIFO per tenant. Tenants are served in weighted-fair order on tokens (the
tenant with the fewest tokens computed goes next), so a tenant's share of the engine does not grow with
the number of requests it queues: a tenant flooding the server delays its own requests, not another's.
A tenant that comes back after being idle starts just below the least-served tenant waiting, so it can
neither hoard credit while idle nor be starved for having been busy long ago, and goes next. With `fair`
False the order is the arrival order across tenants (FIFO): only for comparisons.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from kvfence.request import Request


class TenantQueues:
    def __init__(self, fair: bool = True) -> None:
        self.fair = fair
        self._queues: dict[str, deque[Request]] = {}
        self.served: dict[str, int] = {}  # tokens computed per tenant (the fair clock)

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request, oldest first."""
        return iter(sorted((r for q in self._queues.values() for r in q), key=lambda r: r.arrival_time))

    def __contains__(self, request: object) -> bool:
        return isinstance(request, Request) and request in self._queues.get(request.tenant, ())

    def queued(self, tenant: str) -> int:
        return len(self._queues.get(tenant, ()))

    def push(self, request: Request, front: bool = False, active: bool = False) -> None:
        """Queue a request (`front`: a preempted or resumed one, which keeps its place). `active`: the
        tenant has requests running, so it is not back from idle and keeps its count."""
        queue = self._queues.setdefault(request.tenant, deque())
        if not queue and not active and not front:  # back from idle: just below the least-served waiting
            waiting = [self.served.get(t, 0) for t, q in self._queues.items() if q and t != request.tenant]
            floor = min(waiting, default=1) - 1
            self.served[request.tenant] = max(self.served.get(request.tenant, 0), floor)
        if front:
            queue.appendleft(request)
        else:
            queue.append(request)

    def remove(self, request: Request) -> None:
        queue = self._queues.get(request.tenant)
        if queue is not None and request in queue:
            queue.remove(request)

    def heads(self) -> list[Request]:
        """Each tenant's next request."""
        return [q[0] for q in self._queues.values() if q]

    def next(self, eligible: set[str] | None = None) -> Request | None:
        """The request to admit next: the head of the least-served tenant's queue (FIFO: the oldest head),
        among tenants in `eligible` (None: all)."""
        heads = [h for h in self.heads() if eligible is None or h.tenant in eligible]
        if not heads:
            return None
        return min(heads, key=self.rank)

    def charge(self, tenant: str, tokens: int) -> None:
        self.served[tenant] = self.served.get(tenant, 0) + tokens

    def rank(self, request: Request) -> tuple[int, float]:
        """Who goes first: the least-served tenant (FIFO: nobody), then the oldest request."""
        return (self.served.get(request.tenant, 0) if self.fair else 0, request.arrival_time)
