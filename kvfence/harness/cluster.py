"""The one way to start and stop a serving cluster: a single node, or a router in front of prefill and
decode workers (one of each, or N x M), in this process or as OS processes.

    with cluster(engine) as c: ...                                   single node here (AsyncEngine + HTTP)
    with cluster(serve_args=["--disaggregated"]) as c: ...           `kvfence serve --port P ...` process
    with cluster(prefill=Spawned(cfg), decode=Spawned(cfg)) as c:    workers spawned by kvfence.disagg.launch,
                                                                     the router and HTTP server here
    with cluster(prefill=InThread(e1), decode=InThread(e2), http=False) as c:   workers on threads over the
                                                                     given engines, the router here (no HTTP)
    with cluster(prefill=[Spawned(cfg)] * 2, decode=[Spawned(cfg)] * 2) as c:   2 x 2 workers, named
                                                                     prefill-0, prefill-1, decode-0, decode-1
    with cluster(prefill=Command(args), decode=Command(args), router_process=True) as c:
                                                                     `kvfence serve --role ...` workers (after
                                                                     an optional prefix such as `ip netns exec
                                                                     NS`) and a `kvfence router` process

Workers are named as `kvfence.disagg.keys.worker_names` names them (`prefill` and `decode` for one of each);
`Cluster.workers` and `worker_stats` take those names. Contracts: every wait is bounded; whatever fails while
starting, everything already started is stopped before the error propagates; `Cluster.stop()` (run on leaving
the block) is idempotent and stops in reverse start order: the HTTP server, the router, the workers (OS
processes with their descendants, by pid). A worker can be killed (SIGKILL, or its thread stopped) and
restarted on the SAME address, which is how the crash tests exercise reconnection. `isolation` is the front's
(the router's admission, or `--isolation off` of a server or router command); workers carry their own in their
config or arguments. A disaggregated cluster speaks CURVE with keys made for it (in memory for this process
and its spawned children, a temporary key directory for command workers and a router command), as `kvfence
serve --disaggregated` does, unless `secure` is False.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvfence.disagg.keys import role_of, worker_names
from kvfence.disagg.launch import free_ports, spawn_workers
from kvfence.disagg.router import ROUTER_TIMEOUT_S, Router
from kvfence.engine.async_engine import AsyncEngine
from kvfence.engine.engine import LLMEngine
from kvfence.engine.stats import EngineStats
from kvfence.harness.procs import START_TIMEOUT_S, Proc, launch, stop
from kvfence.harness.server import LOOPBACK, ServerThread, audit_trail, serve
from kvfence.harness.workers import (
    ANY_PORT,
    Command,
    CommandWorker,
    InThread,
    Spawned,
    SpawnedWorker,
    ThreadWorker,
    Transport,
    WorkerHandle,
    WorkerSpec,
)
from kvfence.model.gguf import read_header
from kvfence.model.tokenizer import Tokenizer
from kvfence.pins import default_model_path
from kvfence.trail.faults import FaultInjector

T = TypeVar("T")

# ---- the cluster -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Front:
    """What clients talk to: keys, the model's name, the router's settings."""

    api_keys: dict[str, str] | None = None  # key -> tenant; None: auth off
    admin_key: str | None = None
    model_name: str | None = None  # None: the GGUF file's stem, as `kvfence serve` names it
    isolation: bool = True
    http: bool = True
    router_process: bool = False
    router_timeout_s: float = ROUTER_TIMEOUT_S
    router_listen: str = ANY_PORT
    router_faults: FaultInjector | None = None
    start_timeout_s: float = START_TIMEOUT_S
    secure: bool = True  # CURVE between router and workers, with keys made for this cluster
    app_options: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.model_name or default_model_path().stem

    def flags(self) -> list[str]:
        """The front's settings as `kvfence serve` / `kvfence router` options (no key: see `env`)."""
        flags = [] if self.isolation else ["--isolation", "off"]
        return flags + (["--served-model-name", self.model_name] if self.model_name else [])

    def env(self) -> dict[str, str] | None:
        """The keys, for the front process's environment: every local user can read a command line, only
        the process's own user its environment."""
        keys = self.api_keys and "; ".join(f"{key} {tenant}" for key, tenant in self.api_keys.items())
        env = {"KVFENCE_API_KEYS": keys} if keys else {}
        env |= {"KVFENCE_ADMIN_KEY": self.admin_key} if self.admin_key else {}
        return env or None


@dataclass
class Cluster:
    """A running cluster. `url`, `router` and `engine` raise when this cluster has no such part."""

    front: Front
    workers: dict[str, WorkerHandle] = field(default_factory=dict)  # by name: prefill, decode-1...
    process: Proc | None = None  # the front as an OS process: a `kvfence serve` or `kvfence router`
    server: ServerThread | None = None  # the HTTP server in this process
    transport: Transport | None = None  # the workers' and router's addresses and keys (disaggregated)
    _url: str | None = None
    _router: Router | None = None
    _engine: AsyncEngine | None = None
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    @property
    def url(self) -> str:
        return _present(self._url, "HTTP front")

    @property
    def router(self) -> Router:
        return _present(self._router, "router in this process")

    @property
    def engine(self) -> AsyncEngine:
        return _present(self._engine, "engine in this process")

    @property
    def processes(self) -> list[Proc]:
        """Every OS process started from a command, in start order (workers, then the front)."""
        procs = [w.proc for w in self.workers.values() if isinstance(w, CommandWorker)]
        return procs + ([self.process] if self.process else [])

    def worker_stats(self, name: str) -> EngineStats:
        """One worker's pool counters, asked by the router (blocking, at most its stats timeout)."""
        return self.router.worker_stats(name)

    def audit(self, request_id: str) -> list[dict[str, Any]]:
        """The request's trail from the admin endpoint ([] when there is none)."""
        assert self.front.admin_key, "the audit endpoint needs the admin key"
        return audit_trail(self.url, self.front.admin_key, request_id)

    def stop(self) -> None:
        """Stop everything, last started first (idempotent)."""
        self._stack.close()


def _present(part: T | None, what: str) -> T:
    if part is None:
        raise RuntimeError(f"this cluster has no {what}")
    return part


@contextlib.contextmanager
def cluster(
    engine: LLMEngine | AsyncEngine | None = None,
    *,
    serve_args: Sequence[str] | None = None,
    prefill: WorkerSpec | Sequence[WorkerSpec] | None = None,
    decode: WorkerSpec | Sequence[WorkerSpec] | None = None,
    api_keys: dict[str, str] | None = None,
    admin_key: str | None = None,
    model_name: str | None = None,
    isolation: bool = True,
    http: bool = True,
    router_process: bool = False,
    router_timeout_s: float = ROUTER_TIMEOUT_S,
    router_listen: str = ANY_PORT,
    router_faults: FaultInjector | None = None,
    start_timeout_s: float = START_TIMEOUT_S,
    secure: bool = True,
    **app_options: Any,
) -> Iterator[Cluster]:
    """Start exactly one of: a single node over `engine`, here; `kvfence serve --port P [front flags]
    SERVE_ARGS` as a process; or the `prefill` and `decode` workers (a spec, or a list of them) behind a
    router (here, with an HTTP server unless `http` is False; or a `kvfence router` process with
    `router_process`). `app_options` go to build_app. Yields the running Cluster; stops it on leaving
    the block."""
    front = Front(
        api_keys=api_keys,
        admin_key=admin_key,
        model_name=model_name,
        isolation=isolation,
        http=http,
        router_process=router_process,
        router_timeout_s=router_timeout_s,
        router_listen=router_listen,
        router_faults=router_faults,
        start_timeout_s=start_timeout_s,
        secure=secure,
        app_options=app_options,
    )
    running = _start(engine, serve_args, prefill, decode, front)
    try:
        yield running
    finally:
        running.stop()


def _start(
    engine: LLMEngine | AsyncEngine | None,
    serve_args: Sequence[str] | None,
    prefill: WorkerSpec | Sequence[WorkerSpec] | None,
    decode: WorkerSpec | Sequence[WorkerSpec] | None,
    front: Front,
) -> Cluster:
    """Start the parts in order; on any failure stop what was started, then re-raise."""
    if (prefill is None) != (decode is None):
        raise ValueError("a disaggregated cluster needs both a prefill and a decode worker")
    if sum((engine is not None, serve_args is not None, prefill is not None)) != 1:
        raise ValueError("start exactly one of: engine, serve_args, or prefill and decode")
    if prefill is None and (front.router_process or not front.http):
        raise ValueError("router_process and http=False need prefill and decode workers")
    running = Cluster(front)
    try:
        if engine is not None:
            _start_single_node(running, engine)
        elif serve_args is not None:
            _start_front_process(running, ["serve"], serve_args)
        else:
            assert prefill is not None and decode is not None
            specs = _named("prefill", prefill) | _named("decode", decode)
            running.transport = Transport.plan(specs, front.router_listen, front.secure, running._stack)
            _start_workers(running, specs)
            _start_router(running, specs)
    except BaseException:
        running.stop()
        raise
    return running


def _named(role: str, specs: WorkerSpec | Sequence[WorkerSpec]) -> dict[str, WorkerSpec]:
    """The workers of `role` by name: `role` for one, `role-0`, `role-1`... for several."""
    group = list(specs) if isinstance(specs, Sequence) else [specs]
    return dict(zip(worker_names(role, len(group)), group, strict=True))


def _start_single_node(running: Cluster, engine: LLMEngine | AsyncEngine) -> None:
    client = engine if isinstance(engine, AsyncEngine) else AsyncEngine(engine)
    running._engine = client
    _start_http(running, client)


def _start_http(running: Cluster, client: AsyncEngine | Router) -> None:
    """The OpenAI app over `client` on a loopback port here; its lifespan starts and stops `client`."""
    from kvfence.api.server import build_app

    front = running.front
    app = build_app(client, front.name, front.api_keys, front.admin_key, **front.app_options)
    running.server = serve(app, front.start_timeout_s)
    running._stack.callback(running.server.stop)
    running._url = running.server.url


def _start_front_process(running: Cluster, head: list[str], tail: Sequence[str] = ()) -> None:
    """`kvfence HEAD --port P [front flags] TAIL` (keys in its environment), ready once /health answers."""
    (port,) = free_ports(1)
    front, url = running.front, f"http://{LOOPBACK}:{port}"
    proc = launch(head[0], [*head, "--port", str(port), *front.flags(), *tail], env=front.env())
    running.process, running._url = proc, url
    running._stack.callback(stop, [proc])
    proc.wait_for_http(url, front.start_timeout_s)


def _start_workers(running: Cluster, specs: dict[str, WorkerSpec]) -> None:
    """Command workers first (they load while the rest starts), then spawned ones (loading in parallel),
    then those on threads; returns once every worker listens at its planned address."""
    timeout_s, stack, transport = running.front.start_timeout_s, running._stack, _transport(running)
    started: dict[str, WorkerHandle] = {}
    for role, spec in specs.items():
        if isinstance(spec, Command):
            address, flags = transport.addresses[role], transport.key_flags(role)
            started[role] = CommandWorker.launch(role, spec, address, timeout_s, flags)
            stack.callback(started[role].stop)
    by_build: dict[Any, list[tuple[str, Spawned]]] = {}  # one spawn_workers call per engine factory
    for role, spec in specs.items():
        if isinstance(spec, Spawned):
            by_build.setdefault(spec.build, []).append((role, spec))
    for build, group in by_build.items():
        spawned = [(role, spec.config) for role, spec in group]
        binds, keys = {r: transport.addresses[r] for r, _ in spawned}, transport.keys
        workers = spawn_workers(spawned, binds, keys, build=build)
        for (role, config), (process, address) in zip(spawned, workers, strict=True):
            started[role] = SpawnedWorker(role, config, address, process, transport.keys_of(role), build)
            stack.callback(started[role].stop)
    for role, spec in specs.items():
        if isinstance(spec, InThread):
            keys = transport.keys_of(role)
            started[role] = ThreadWorker.start(role, spec.engine, transport.addresses[role], keys)
            stack.callback(started[role].stop)
    for worker in started.values():
        if isinstance(worker, CommandWorker):
            worker.wait_ready()
    running.workers = {role: started[role] for role in specs}


def _transport(running: Cluster) -> Transport:
    return _present(running.transport, "transport")


def _start_router(running: Cluster, specs: dict[str, WorkerSpec]) -> None:
    """The router in front of the workers: here (with or without HTTP), or as a `kvfence router`."""
    front, transport = running.front, _transport(running)
    prefill, decode = (
        [w.address for name, w in running.workers.items() if role_of(name) == role]
        for role in ("prefill", "decode")
    )
    if front.router_process:
        listen = ["--listen", transport.addresses["router"], *transport.key_flags("router")]
        head = ["router", "--prefill", ",".join(prefill), "--decode", ",".join(decode)]
        _start_front_process(running, head, listen)
        return
    tokenizer, vocab_size = _vocabulary(specs)
    router = Router(
        prefill,
        decode,
        tokenizer,
        vocab_size,
        isolation=front.isolation,
        listen=transport.addresses["router"],
        faults=front.router_faults,
        timeout_s=front.router_timeout_s,
        keys=transport.keys_of("router"),
    )
    running._router = router
    running._stack.callback(_shut_down, router)  # after the HTTP server, whose lifespan shuts it too
    if front.http:
        _start_http(running, router)
    else:
        router.start()


def _shut_down(router: Router) -> None:
    with contextlib.suppress(RuntimeError):  # its thread never started: nothing to stop
        router.shutdown()


def _vocabulary(specs: dict[str, WorkerSpec]) -> tuple[Tokenizer, int]:
    """The router's tokenizer and vocabulary size: an in-thread worker's model's, a spawned worker's own
    engine's (built once here), else the packaged model's (what `kvfence router` reads by default). A
    test's small model has no tokenizer (None): its clients send token ids."""
    for spec in specs.values():
        engine = spec.engine if isinstance(spec, InThread) else None
        if isinstance(spec, Spawned) and spec.build is not None:
            engine = spec.build(spec.config)
        if engine is not None:
            return engine.tokenizer, engine.model.config.vocab_size  # type: ignore[return-value]
    config, metadata = read_header(default_model_path())
    return Tokenizer(metadata), config.vocab_size
