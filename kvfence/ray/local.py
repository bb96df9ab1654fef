"""`kvfence serve --ray-replicas N`: the server on Ray Serve, from one command.

It checks what `kvfence serve` checks before anything starts (the model's header, the pool against the
window, the key files, the port), then starts a local Ray cluster with token authentication, or joins
`--ray-address`, runs Serve's HTTP proxy on --host/--port, deploys N replicas of kvfence.ray:app with the
command's own arguments (less --host, --port and the Ray options) and blocks until SIGINT or SIGTERM; then it
deletes the application and its fleet registry (and, on a cluster it started, shuts Serve and Ray down).

Contracts: a cluster kvfence starts has RAY_AUTH_MODE=token, its token a random 256-bit value written to
a new owner-only file (0600, in a 0700 directory removed on exit) whose path alone is in the Ray processes'
environment (RAY_AUTH_TOKEN_PATH: never the token, never a command line), and its workers (the replicas)
run at niceness 0 unless RAY_worker_niceness says otherwise (Ray's default: 15); joining a cluster is
refused unless its dashboard reports authentication mode `token`, or --insecure-ray says so. Keys never
come from the environment here ($KVFENCE_API_KEYS and the like are refused): every replica reads its key
files itself, so no key is in Ray's actor arguments, runtime_env or GCS. A failed check, a refused cluster, a
cluster that does not start or join, and an application that does not deploy are each one line, exit
code 2 (the port is checked free before Ray starts; something may still take it before Serve's proxy).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from kvfence.cli_checks import (
    StartupError,
    bind_http,
    check_engine,
    check_http_options,
    check_ray_environment,
    protection_lines,
)
from kvfence.cli_options import engine_config, served_model
from kvfence.ray.app import AppOptions, app
from kvfence.ray.replica import parse_replica_args
from kvfence.startup import reason

APP_NAME = "kvfence"
OBJECT_STORE_BYTES = 256 * 2**20  # replicas pass no objects: Ray's default (30% of RAM) would reserve GBs
DASHBOARD_TIMEOUT_S = 60.0  # a busy machine's dashboard answers late; a hang guard, not a speed check
SERVE_STARTUP_PATIENCE_S = 60.0  # Serve's proxy readiness and health-check timeouts (Ray's: 5 and 10 s)
WORKER_NICENESS = "RAY_worker_niceness"  # the raylet's setting for the workers it starts (Ray's default: 15)
# `serve` options that are this command's, not a replica's: (option, takes a value)
OWN_OPTIONS = {
    "--host": True,
    "--port": True,
    "--ray-replicas": True,
    "--ray-address": True,
    "--ray-replica-cpus": True,
    "--ray-temp-dir": True,
    "--ray-router": True,
    "--insecure-ray": False,
}


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def replica_argv(argv: Sequence[str]) -> list[str]:
    """`kvfence serve` ARGV (starting with `serve`) without `serve` and this command's own options."""
    words, kept = list(argv[1:]), []
    while words:
        word = words.pop(0)
        option, inline, _ = word.partition("=")
        if option in OWN_OPTIONS:
            if OWN_OPTIONS[option] and not inline and words:
                words.pop(0)
            continue
        kept.append(word)
    return kept


def run(args: Any, argv: Sequence[str]) -> int:
    """Check, start or join Ray, deploy, serve until interrupted; 0 on a clean stop, 2 on a bad start."""
    serve_args = replica_argv(argv)
    replica = parse_replica_args(serve_args)  # the refusals, and the replicas' own parse
    check_ray_environment()
    check_engine(engine_config(replica))
    api_keys, admin_key, _ = check_http_options(replica)  # read here to check them; never sent anywhere
    bind_http(args.host, args.port).close()  # the port is free now; Ray's proxy binds it
    for line in protection_lines(replica.isolation == "on", replica.inject_fault, None):
        _log(line)
    _log(f"auth: {'on' if api_keys else 'WARNING: off (no --api-keys)'}; each replica reads its key files")
    del api_keys, admin_key
    options = AppOptions(tuple(serve_args), args.ray_replicas, args.ray_replica_cpus, args.ray_router)
    with ray_token(args) as token_path:
        return _serve_on_ray(args, options, served_model(replica), token_path)


@contextlib.contextmanager
def ray_token(args: Any) -> Iterator[Path | None]:
    """Token authentication in this process's environment, which the Ray processes it starts inherit: a
    new token in an owner-only file for a cluster started here (removed on exit), or Ray's own token
    sources for one joined (None)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing leaves the machine
    # Serve's controller kills a proxy not ready within 5 s (health checks 10 s): on a busy machine its
    # fresh interpreter takes longer, the proxy is killed before it ran and `serve.start` fails (seen in
    # the suite beside busy loops). A minute each, unless the operator set them.
    for name in ("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S"):
        os.environ.setdefault(name, str(SERVE_STARTUP_PATIENCE_S))
    if args.ray_address is not None:
        if not args.insecure_ray:
            os.environ["RAY_AUTH_MODE"] = "token"
        yield None
        return
    # A cluster started here. Ray starts its workers at niceness 15 (the raylet ahead of tasks), but a
    # replica is the server: at 15 it gets a few percent of a core beside any process of normal priority
    # (beside the suite's busy loops a replica took minutes to start; autoscaling's second never came up).
    os.environ.setdefault(WORKER_NICENESS, "0")
    directory = Path(tempfile.mkdtemp(prefix="kvfence-ray-"))  # mode 0700
    path = directory / "auth_token"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as file:
            file.write(secrets.token_hex(32))
        os.environ.pop("RAY_AUTH_TOKEN", None)  # it would win over the file
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(path))
        yield path
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _serve_on_ray(args: Any, options: AppOptions, name: str, token_path: Path | None) -> int:
    # Ray loads only now, the token's environment set: it reads its authentication mode as it loads.
    from ray import serve

    from kvfence.ray.fleet import kill_registry

    settings = {"num_replicas": options.num_replicas, "num_cpus": options.num_cpus, "router": options.router}
    application = app({"serve_args": list(options.serve_args), **settings})
    with ray_cluster(args, token_path, "--ray-replicas") as started:
        option = "--ray-replicas" if started else f"--ray-address {args.ray_address}"
        deployed = False
        try:
            if not started and APP_NAME in serve.status().applications:
                raise StartupError(
                    f"{option}: an application named {APP_NAME!r} already runs there; delete it first"
                )
            serve.start(http_options={"host": args.host, "port": args.port})
            deployed = True  # from here on the name is ours: a failed run may have half-deployed it
            try:
                serve.run(application, name=APP_NAME, route_prefix="/")
            except RuntimeError as exc:
                raise StartupError(f"--ray-replicas: the application did not start ({reason(exc)})") from exc
            _log(f"ray: {args.ray_replicas} replica{'s' if args.ray_replicas > 1 else ''} ready")
            _log(f"serving '{name}' on http://{args.host}:{args.port}/v1")
            if not started:  # Ray's rule: a Serve already running on the cluster keeps its own http_options
                _log("ray: through the cluster's Serve proxies, at the address its Serve was started with")
            _wait_for_signal()
            return 0
        finally:
            with contextlib.suppress(Exception):  # stopping: what fails to stop is Ray's to report
                if started:
                    serve.shutdown()
                elif deployed:
                    serve.delete(APP_NAME)  # a cluster joined keeps its other applications
                    kill_registry(APP_NAME)  # detached: it would outlive the application


@contextlib.contextmanager
def ray_cluster(args: Any, token_path: Path | None, flag: str) -> Iterator[bool]:
    """A local Ray cluster started (True) or --ray-address joined (False), for the command whose Ray
    option is `flag`; refused (StartupError) unless it reports token authentication or --insecure-ray
    says so; disconnected (a cluster started here: stopped) when the block ends, however it ends."""
    import ray

    started = args.ray_address is None
    try:
        context = ray.init(address=args.ray_address, **(_local_cluster(args) if started else {}))
    except Exception as exc:  # Ray's errors have no common base: one line, whatever it was
        if started:
            raise StartupError(f"{flag}: the local Ray cluster did not start ({reason(exc)})") from exc
        raise StartupError(f"--ray-address {args.ray_address}: cannot join it ({reason(exc)})") from exc
    try:
        mode = _authentication_mode(context.dashboard_url)
        what = "started a local cluster" if started else "joined"
        gcs, dashboard = context.address_info["gcs_address"], context.dashboard_url or "none"
        _log(f"ray: {what} at {gcs} (authentication mode: {mode}; dashboard {dashboard})")
        if token_path is not None:
            _log(f"ray: token in {token_path} (mode 0600, removed on exit)")
        if mode != "token" and args.insecure_ray:
            _log(f"WARNING: ray: authentication mode {mode} (--insecure-ray): whoever reaches it runs code")
        option = flag if started else f"--ray-address {args.ray_address}"
        if mode != "token" and not args.insecure_ray:
            raise StartupError(
                f"{option}: the cluster reports authentication mode {mode!r}, not 'token': start it with "
                "RAY_AUTH_MODE=token, or pass --insecure-ray"
            )
        yield started
    finally:
        with contextlib.suppress(Exception):  # stopping: what fails to stop is Ray's to report
            ray.shutdown()


def _local_cluster(args: Any) -> dict[str, Any]:
    options: dict[str, Any] = {"object_store_memory": OBJECT_STORE_BYTES, "include_dashboard": True}
    if args.ray_temp_dir is not None:
        options["_temp_dir"] = str(args.ray_temp_dir.resolve())
    return options


def _authentication_mode(dashboard_url: str | None) -> str:
    """The cluster's own word on its authentication (the dashboard's /api/authentication_mode, which Ray
    answers unauthenticated); 'unknown' without a dashboard or an answer."""
    if not dashboard_url:
        return "unknown"
    try:
        response = httpx.get(f"http://{dashboard_url}/api/authentication_mode", timeout=DASHBOARD_TIMEOUT_S)
        return str(response.json().get("authentication_mode", "unknown"))
    except (httpx.HTTPError, ValueError, AttributeError):
        return "unknown"


def _wait_for_signal() -> None:
    """Block until SIGINT or SIGTERM (either ends the command like Ctrl-C, so `finally` blocks run)."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(1.0):  # a bounded wait: the handler runs between waits on every Python
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
