"""One Ray Serve replica's server: `kvfence serve`'s own parser, start-up checks, engine and HTTP app, built
inside the replica from the `kvfence serve` arguments the application was given (no Ray import here).

Contracts: the arguments are parsed by the parser `kvfence serve` uses (cli_options.add_serve_options),
so a replica takes the same options with the same meaning; an option Ray cannot honour is refused, one
line naming it (cli_checks.check_replica_args); a parse error raises StartupError, never exits the
replica's process. Keys come only from the files the arguments name, read here by the replica
(read_secret_file: owner-only files), never from the environment Ray gives it (check_ray_environment).
The engine loads here, in the replica's process: nothing of it crosses Ray. Every response carries
`x-kvfence-replica`, the replica's Serve id (not a secret), so that a client sees which replica answered.
The replica's admin key stays in its process (`Replica.admin_key`: its fleet views read its own trails
with it, kvfence.ray.fleet_views).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

from starlette.applications import Starlette
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvfence.cli_checks import (
    OneLineParser,
    StartupError,
    check_engine,
    check_http_options,
    check_ray_environment,
    check_replica_args,
)
from kvfence.cli_options import add_serve_options, engine_config, http_app, resolve_model_arg
from kvfence.config import CapacityError

REPLICA_HEADER = "x-kvfence-replica"


class _RaisingParser(OneLineParser):
    """`kvfence serve`'s parser whose errors raise StartupError (one line) instead of exiting: in a replica
    or an application builder an exit would take Ray's process down with a bare status."""

    def error(self, message: str) -> NoReturn:
        raise StartupError(message)


def parse_replica_args(serve_args: Sequence[str]) -> argparse.Namespace:
    """`kvfence serve SERVE_ARGS` parsed and refused where Ray cannot honour an option (StartupError). Reads
    no key file: the model named is resolved (a packaged name to its path), nothing else is opened."""
    words = [str(word) for word in serve_args]
    check_replica_args(words)
    parser = _RaisingParser(prog="kvfence serve", add_help=False)
    add_serve_options(parser)
    args = parser.parse_args(words)
    resolve_model_arg(args)
    return args


@dataclass(frozen=True)
class Replica:
    """One replica's server: its app, and the admin key it read (None: the audit endpoints refuse all)."""

    app: Starlette
    admin_key: str | None


def replica_app(serve_args: Sequence[str], replica: str) -> Replica:
    """The server of one replica: the checks `kvfence serve` runs (the model's header, the pool against the
    window, the key files), then the engine and the OpenAI app over it, as `kvfence serve` builds them."""
    args = parse_replica_args(serve_args)
    check_ray_environment()
    config = engine_config(args)
    check_engine(config)
    api_keys, admin_key, sampling = check_http_options(args)
    from kvfence.engine.async_engine import AsyncEngine  # torch: only once every check has passed
    from kvfence.engine.engine import load_engine

    try:
        engine = load_engine(config, None, log=_log, chat_template=args.chat_template)
    except CapacityError as exc:
        raise StartupError(str(exc)) from exc
    from kvfence.api.stats_log import log_to_stderr

    log_to_stderr()
    app = http_app(args, AsyncEngine(engine), api_keys, admin_key, sampling)
    app.add_middleware(ReplicaHeader, replica=replica)
    return Replica(app, admin_key)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class ReplicaHeader:
    """ASGI middleware: every HTTP response head gets `x-kvfence-replica: REPLICA` (streams included: only
    the head is touched, the body passes as it comes)."""

    def __init__(self, app: ASGIApp, replica: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_header)
