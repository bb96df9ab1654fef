"""The Ray Serve deployment: kvfence's own ASGI app (kvfence.api.server through kvfence.ray.replica) served
by Ray Serve's documented late-bound ingress, `@serve.ingress()` with `__serve_build_asgi_app__`.

Contracts: the actor's one argument is the list of `kvfence serve` arguments (paths and settings, never a
key); the app, its engine and its keys are built inside the replica when Ray initialises it (on a worker
thread, so that the replica's event loop keeps answering while the model loads), and Ray runs the app's
ASGI lifespan, which starts the engine thread and stops it when the replica shuts down. Streaming
responses (SSE) pass through Ray's proxy as the app writes them. Once built, the replica joins its
application's fleet (kvfence.ray.fleet): the admin reads answer for every replica (kvfence.ray.fleet_views),
and its series go to Ray's metrics too (kvfence.ray.export).
"""

from __future__ import annotations

import asyncio

from ray import serve

from kvfence.ray.export import RayExport
from kvfence.ray.fleet import join
from kvfence.ray.fleet_views import FleetViews
from kvfence.ray.replica import replica_app

DEPLOYMENT_NAME = "kvfence"


@serve.deployment(name=DEPLOYMENT_NAME)
@serve.ingress()
class KvfenceServer:
    """One replica: a whole kvfence server (engine, fenced pool, auth) behind Ray Serve's proxy."""

    def __init__(self, serve_args: list[str]) -> None:
        self.serve_args = [str(word) for word in serve_args]
        self.tasks: list[asyncio.Task[None]] = []  # held: the loop keeps only a weak reference

    async def __serve_build_asgi_app__(self) -> FleetViews:
        context = serve.get_replica_context()
        replica = context.replica_id.unique_id
        server = await asyncio.to_thread(replica_app, self.serve_args, replica)
        views = FleetViews(server.app, replica, server.admin_key)
        self.tasks = [join(views, context.app_name, replica), asyncio.create_task(RayExport(views).run())]
        return views
