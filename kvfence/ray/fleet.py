"""The replicas of one kvfence application as a fleet: a small Ray actor (`FleetRegistry`, one per
application, named after it) through which a replica asks every other live replica an admin GET
(kvfence.ray.fleet_views), and each replica's side of it (`FleetMember`).

Contracts:
- A replica joins by polling the registry for queries addressed to it (`next_query`), so a registry that
  restarts is rejoined at the next poll; it answers each query from its own app (`FleetViews.local`).
- Only paths and answers cross the registry: strings, never a key, never an object a peer built (Ray
  carries them; kvfence reads them as JSON or Prometheus text, fleet_views checks them).
- Which replicas are live is Ray's word, not a clock's: before a question goes out, each member is pinged
  through its own actor handle, and one whose actor Ray reports dead (RayActorError) is dropped. A live
  member that has not answered within ASK_TIMEOUT_S (a hang guard) is reported as silent (None), which
  fleet_views turns into a 503: an incomplete fleet is never passed off as the whole.
- The registry is detached (a replica killed must not take it down) and holds no CPU; `kvfence serve
  --ray-replicas` kills it when it deletes the application (kvfence.ray.local).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sys
from dataclasses import dataclass, field

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError

from kvfence.ray.fleet_views import Answer, FleetViews

NAMESPACE = "kvfence"
POLL_S = 10.0  # a member's long poll: how long one `next_query` waits for a question before returning
ASK_TIMEOUT_S = 60.0  # a hang guard on a live member's answer, not a speed check
PING_TIMEOUT_S = 30.0  # the same, for Ray's liveness ping
REJOIN_S = 1.0  # a member's pause before polling a registry it could not reach


def registry_name(app_name: str) -> str:
    return f"kvfence-fleet:{app_name}"


@dataclass
class _Member:
    handle: ActorHandle
    questions: asyncio.Queue[tuple[int, str]] = field(default_factory=asyncio.Queue)


@ray.remote(num_cpus=0)
class FleetRegistry:
    """Questions to replicas and their answers; a member is known from its first poll until Ray says its
    actor is dead."""

    def __init__(self) -> None:
        self._members: dict[str, _Member] = {}
        self._waiting: dict[int, asyncio.Future[tuple[int, str]]] = {}
        self._ids = itertools.count()

    async def next_query(self, replica: str, handle: ActorHandle, wait_s: float) -> tuple[int, str] | None:
        """The next question for `replica` (query id, path), or None after `wait_s` without one."""
        member = self._members.setdefault(replica, _Member(handle))
        member.handle = handle
        try:
            return await asyncio.wait_for(member.questions.get(), wait_s)
        except TimeoutError:
            return None

    async def answer(self, query: int, status: int, body: str) -> None:
        waiting = self._waiting.get(query)
        if waiting is not None and not waiting.done() and isinstance(status, int) and isinstance(body, str):
            waiting.set_result((status, body))

    async def members(self) -> list[str]:
        """The live members, by replica id."""
        await self._prune()
        return sorted(self._members)

    async def ask(self, asker: str, path: str, timeout_s: float = ASK_TIMEOUT_S) -> dict[str, Answer]:
        """Every live member but `asker`'s answer to GET `path` (None: it did not answer in time)."""
        await self._prune()
        loop = asyncio.get_running_loop()
        pending: dict[str, asyncio.Future[tuple[int, str]]] = {}
        for replica, member in self._members.items():
            if replica != asker:
                query = next(self._ids)
                pending[replica] = self._waiting[query] = loop.create_future()
                member.questions.put_nowait((query, path))
        try:
            if pending:
                await asyncio.wait(pending.values(), timeout=timeout_s)
            return {r: (f.result() if f.done() else None) for r, f in pending.items()}
        finally:
            for query in [q for q, f in self._waiting.items() if f in pending.values()]:
                del self._waiting[query]

    async def _prune(self) -> None:
        names = list(self._members)
        pings = [self._members[name].handle.__ray_ready__.remote() for name in names]
        results = await asyncio.gather(
            *(asyncio.wait_for(ping, PING_TIMEOUT_S) for ping in pings), return_exceptions=True
        )
        for name, result in zip(names, results, strict=True):
            if isinstance(result, RayActorError):  # Ray's word: the actor is gone (a slow one stays)
                self._members.pop(name, None)


class FleetMember:
    """One replica's side: answers its questions from `views`, and asks the others for `views`."""

    def __init__(self, app_name: str, replica: str, views: FleetViews) -> None:
        self.app_name, self.replica, self.views = app_name, replica, views
        self.handle = ray.get_runtime_context().current_actor
        self.registry = self._registry()
        self._tasks: set[asyncio.Task[None]] = set()

    def _registry(self) -> ActorHandle:
        return FleetRegistry.options(
            name=registry_name(self.app_name), namespace=NAMESPACE, get_if_exists=True, lifetime="detached"
        ).remote()

    async def ask(self, path: str) -> dict[str, Answer]:
        answers: dict[str, Answer] = await self.registry.ask.remote(self.replica, path)
        return answers

    async def serve(self) -> None:
        """Poll for questions and answer each (forever: the task ends with the replica)."""
        while True:
            try:
                question = await self.registry.next_query.remote(self.replica, self.handle, POLL_S)
            except RayActorError:  # the registry died: get it (or a new one) by name, then poll again
                await asyncio.sleep(REJOIN_S)
                self.registry = self._registry()
                continue
            if question is not None:
                task = asyncio.create_task(self._answer(*question))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _answer(self, query: int, path: str) -> None:
        try:
            status, body = await self.views.local(str(path))
        except Exception as exc:  # the replica's own app failed: the asker gets a 500 from it, not silence
            print(f"fleet: answering {path}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            status, body = 500, ""
        with contextlib.suppress(RayActorError):
            await self.registry.answer.remote(query, status, body)


def join(views: FleetViews, app_name: str, replica: str) -> asyncio.Task[None]:
    """Make `views` the fleet's: its peers are the application's other replicas from now on; the task
    that answers them runs on the calling event loop (the replica's)."""
    member = FleetMember(app_name, replica, views)
    views.peers = member
    return asyncio.get_running_loop().create_task(member.serve())


def kill_registry(app_name: str) -> None:
    """Kill the application's registry, where there is one (its application is gone)."""
    with contextlib.suppress(ValueError, RayActorError):
        ray.kill(ray.get_actor(registry_name(app_name), namespace=NAMESPACE))
