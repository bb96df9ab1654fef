"""The Ray Serve deployment of kvfence's servers: kvfence's own ASGI app (kvfence.api.server through
kvfence.ray.replica) in each replica, answering the requests kvfence's front (kvfence.ray.front, the
application's one ingress: Ray allows one ASGI deployment per application) hands it.

Contracts: the actor's one argument is the list of `kvfence serve` arguments (paths and settings, never a
key); the app, its engine and its keys are built inside the replica as Ray initialises it (on a worker
thread, so that the replica's event loop keeps answering while the model loads), then the app's lifespan
is entered, which starts the engine thread; it is left, stopping the engine, when Ray shuts the replica
down. `serve_http` is the front's call: one request in, its ASGI messages streamed back as the app sends
them (SSE included); the call cancelled (the client gone) cancels the app's handling of it. Once built,
the replica joins its application's fleet (kvfence.ray.fleet; servers only, the front never joins): what
`serve_http` answers is the app wrapped in kvfence.ray.fleet_views, whose admin reads answer for every
server, and its series go to Ray's metrics too (kvfence.ray.export).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from ray import serve
from starlette.types import Message

from kvfence.ray.export import RayExport
from kvfence.ray.fleet import join
from kvfence.ray.fleet_views import FleetViews
from kvfence.ray.forward import ForwardedRequest
from kvfence.ray.replica import replica_app

DEPLOYMENT_NAME = "kvfence"


@serve.deployment(name=DEPLOYMENT_NAME)
class KvfenceServer:
    """One replica: a whole kvfence server (engine, fenced pool, auth) behind kvfence's front."""

    async def __init__(self, serve_args: list[str]) -> None:
        self._lifespan = contextlib.AsyncExitStack()  # first: Ray calls __del__ after a failed start too
        self.tasks: list[asyncio.Task[None]] = []  # held: the loop keeps only a weak reference
        context = serve.get_replica_context()
        replica = context.replica_id.unique_id
        server = await asyncio.to_thread(replica_app, [str(word) for word in serve_args], replica)
        await self._lifespan.enter_async_context(server.app.router.lifespan_context(server.app))
        self.app = FleetViews(server.app, replica, server.admin_key)
        self.tasks = [
            join(self.app, context.app_name, replica),
            asyncio.create_task(RayExport(self.app).run()),
        ]

    async def __del__(self) -> None:
        for task in self.tasks:
            task.cancel()
        await self._lifespan.aclose()

    async def serve_http(self, request: ForwardedRequest) -> AsyncIterator[Message]:
        """The app's answer to one request the front forwarded, message by message."""
        messages: asyncio.Queue[Message | None] = asyncio.Queue()
        body: list[Message] = [{"type": "http.request", "body": request.body, "more_body": False}]

        async def receive() -> Message:
            if body:
                return body.pop()
            never: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
            return await never  # no disconnect to report: a client gone cancels this call

        async def send(message: Message) -> None:
            await messages.put(message)

        task = asyncio.create_task(self.app(dict(request.scope), receive, send))
        task.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            while (message := await messages.get()) is not None:
                yield message
            task.result()  # the app's own failure, if it raised past its error handlers
        finally:
            task.cancel()
