"""The one way to start and stop a serving cluster: a single node, or a router in front of a prefill and a
decode worker, in this process or as OS processes.

    with cluster(engine) as c: ...                                   single node here (AsyncEngine + HTTP)
    with cluster(serve_args=["--disaggregated"]) as c: ...           `kvfence serve --port P ...` process
    with cluster(prefill=Spawned(cfg), decode=Spawned(cfg)) as c:    workers spawned by kvfence.disagg.launch,
                                                                     the router and HTTP server here
    with cluster(prefill=InThread(e1), decode=InThread(e2), http=False) as c:   workers on threads over the
                                                                     given engines, the router here (no HTTP)
    with cluster(prefill=Command(args), decode=Command(args), router_process=True) as c:
                                                                     `kvfence serve --role ...` workers (after
                                                                     an optional prefix such as `ip netns exec
                                                                     NS`) and a `kvfence router` process

Contracts: every wait is bounded; whatever fails while starting, everything already started is stopped
before the error propagates; `Cluster.stop()` (run on leaving the block) is idempotent and stops in
reverse start order: the HTTP server, the router, the workers (OS processes with their descendants, by
pid). A worker can be killed (SIGKILL, or its thread stopped) and restarted on the SAME address, which is
how the crash tests exercise reconnection. `isolation` is the front's (the router's admission, or
`--isolation off` of a server or router command); workers carry their own in their config or arguments.
A disaggregated cluster speaks CURVE with keys made for it (in memory for this process and its spawned
children, a temporary key directory for command workers and a router command), as `kvfence serve
--disaggregated` does, unless `secure` is False.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing import Process
from pathlib import Path
from typing import Any, TypeVar

from kvfence.config import EngineConfig
from kvfence.disagg.connector import ZmqConnector
from kvfence.disagg.handoff import HandoffEngine
from kvfence.disagg.keys import TransportKeys, generate, load
from kvfence.disagg.launch import WORKERS, free_ports, spawn_workers
from kvfence.disagg.router import ROUTER_TIMEOUT_S, Router
from kvfence.disagg.worker import Worker
from kvfence.engine.async_engine import AsyncEngine
from kvfence.engine.engine import LLMEngine
from kvfence.engine.stats import EngineStats
from kvfence.harness.procs import START_TIMEOUT_S, Proc, launch, stop
from kvfence.harness.server import LOOPBACK, ServerThread, audit_trail, serve
from kvfence.model.gguf import read_header
from kvfence.model.tokenizer import Tokenizer
from kvfence.pins import default_model_path
from kvfence.trail.faults import FaultInjector

T = TypeVar("T")
ANY_PORT = f"tcp://{LOOPBACK}:0"
LISTENING = "listening on"  # what a worker prints once its model is loaded and its socket bound

# ---- how a worker runs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class InThread:
    """The worker on a thread of this process, over `engine` (which stays inspectable: the lab)."""

    engine: HandoffEngine
    listen: str = ANY_PORT


@dataclass(frozen=True)
class Spawned:
    """The worker in a fresh process started by kvfence.disagg.launch.spawn_workers, on a loopback port."""

    config: EngineConfig


@dataclass(frozen=True)
class Command:
    """`[prefix] kvfence serve --role ROLE --listen LISTEN ARGS` as an OS process. `listen` None: a free
    loopback port. `prefix` must exec the command (`ip netns exec NS` does)."""

    args: Sequence[str] = ()
    listen: str | None = None
    prefix: Sequence[str] = ()


WorkerSpec = InThread | Spawned | Command


class WorkerHandle(ABC):
    """A running worker: its role, its bound address, and how to crash, restart and stop it."""

    role: str
    address: str

    @property
    @abstractmethod
    def pid(self) -> int | None:
        """The worker's process id; None for a worker on a thread of this process."""

    @abstractmethod
    def kill(self) -> None:
        """Crash it now (SIGKILL, or its thread stopped) and wait, bounded, until it is gone."""

    @abstractmethod
    def restart(self) -> None:
        """Kill it, then a fresh one of the same role and settings bound to the SAME address."""

    def stop(self) -> None:
        """End it for good (idempotent)."""
        self.kill()


@dataclass
class SpawnedWorker(WorkerHandle):
    role: str
    config: EngineConfig  # what `restart` uses: a test may change it first
    address: str
    process: Process
    keys: TransportKeys | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def kill(self, timeout_s: float = 10.0) -> None:
        if self.process.is_alive() and self.process.pid is not None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(timeout=timeout_s)

    def restart(self) -> None:
        self.kill()
        keys = {self.role: self.keys} if self.keys else None
        ((self.process, address),) = spawn_workers([(self.role, self.config)], bind=self.address, keys=keys)
        assert address == self.address, f"restarted on {address}, not {self.address}"


@dataclass
class CommandWorker(WorkerHandle):
    role: str
    spec: Command
    address: str
    proc: Proc
    start_timeout_s: float = START_TIMEOUT_S

    key_flags: Sequence[str] = ()

    @classmethod
    def launch(
        cls, role: str, spec: Command, address: str, start_timeout_s: float, key_flags: Sequence[str] = ()
    ) -> CommandWorker:
        args = ["serve", "--role", role, "--listen", address, *key_flags, *spec.args]
        return cls(role, spec, address, launch(role, args, prefix=spec.prefix), start_timeout_s, key_flags)

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def wait_ready(self) -> None:
        self.proc.wait_for_line(LISTENING, self.start_timeout_s)

    def kill(self) -> None:
        self.proc.kill()

    def restart(self) -> None:
        self.kill()
        fresh = CommandWorker.launch(self.role, self.spec, self.address, self.start_timeout_s, self.key_flags)
        self.proc = fresh.proc
        self.wait_ready()

    def stop(self) -> None:
        stop([self.proc])


@dataclass
class ThreadWorker(WorkerHandle):
    role: str
    engine: HandoffEngine
    address: str
    worker: Worker
    thread: threading.Thread
    keys: TransportKeys | None = None

    @classmethod
    def start(
        cls, role: str, engine: HandoffEngine, listen: str, keys: TransportKeys | None = None
    ) -> ThreadWorker:
        worker = WORKERS[role](engine, ZmqConnector(listen, keys))
        thread = threading.Thread(target=worker.serve_forever, name=f"kvfence-{role}", daemon=True)
        thread.start()
        return cls(role, engine, worker.connector.address, worker, thread, keys)

    @property
    def pid(self) -> int | None:
        return None

    def kill(self, timeout_s: float = 10.0) -> None:
        if self.worker.stopped.is_set():
            return
        self.worker.stopped.set()
        self.thread.join(timeout=timeout_s)
        self.worker.connector.close()

    def restart(self) -> None:
        self.kill()
        fresh = ThreadWorker.start(self.role, self.engine, self.address, self.keys)
        self.worker, self.thread = fresh.worker, fresh.thread


# ---- the transport ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Transport:
    """Where the router and each worker listen, and (secure) their keys: in memory for this process and
    its spawned children, and as a key directory for processes started from a command."""

    addresses: dict[str, str]  # by role: prefill, decode, router
    keys: dict[str, TransportKeys] | None = None
    key_dir: str | None = None

    @classmethod
    def plan(cls, specs: dict[str, WorkerSpec], front: Front, stack: contextlib.ExitStack) -> Transport:
        chosen = {role: _listen_of(spec) for role, spec in specs.items()}
        chosen["router"] = front.router_listen
        addresses = {role: _concrete(address or ANY_PORT) for role, address in chosen.items()}
        if not front.secure:
            return cls(addresses)
        key_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvfence-keys-"))
        generate(Path(key_dir), [(role, role, address) for role, address in addresses.items()])
        return cls(addresses, {role: load(Path(key_dir), role) for role in addresses}, key_dir)

    def key_flags(self, role: str) -> list[str]:
        """What a `kvfence serve --role` or `kvfence router` command needs to load its keys."""
        return ["--keys", self.key_dir, "--key-name", role] if self.key_dir else ["--insecure-transport"]

    def keys_of(self, role: str) -> TransportKeys | None:
        return self.keys[role] if self.keys else None


def _concrete(address: str) -> str:
    """`tcp://HOST:0` as a port free on HOST now: every address goes into the allow-list before binding."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return address if port != "0" else f"tcp://{host}:{free_ports(1, host)[0]}"


def _listen_of(spec: WorkerSpec) -> str | None:
    """The address a worker spec asks for; None: any free loopback port."""
    listen = spec.listen if isinstance(spec, InThread | Command) else None
    return None if listen in (None, ANY_PORT) else listen


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
        """The front's settings as `kvfence serve` / `kvfence router` options."""
        flags = ["--admin-key", self.admin_key] if self.admin_key else []
        flags += [] if self.isolation else ["--isolation", "off"]
        return flags + (["--served-model-name", self.model_name] if self.model_name else [])

    def env(self) -> dict[str, str] | None:
        keys = self.api_keys and "; ".join(f"{key} {tenant}" for key, tenant in self.api_keys.items())
        return {"KVFENCE_API_KEYS": keys} if keys else None


@dataclass
class Cluster:
    """A running cluster. `url`, `router` and `engine` raise when this cluster has no such part."""

    front: Front
    workers: dict[str, WorkerHandle] = field(default_factory=dict)  # by role: prefill, decode
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

    def worker_stats(self, role: str) -> EngineStats:
        """One worker's pool counters, asked by the router (blocking, at most its stats timeout)."""
        return self.router.worker_stats(role)

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
    prefill: WorkerSpec | None = None,
    decode: WorkerSpec | None = None,
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
    SERVE_ARGS` as a process; or the `prefill` and `decode` workers behind a router (here, with an HTTP
    server unless `http` is False; or a `kvfence router` process with `router_process`). `app_options`
    go to build_app. Yields the running Cluster; stops it on leaving the block."""
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
    prefill: WorkerSpec | None,
    decode: WorkerSpec | None,
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
            specs = {"prefill": prefill, "decode": decode}
            running.transport = Transport.plan(specs, front, running._stack)
            _start_workers(running, specs)
            _start_router(running, specs)
    except BaseException:
        running.stop()
        raise
    return running


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
    spawned = [(role, spec.config) for role, spec in specs.items() if isinstance(spec, Spawned)]
    if spawned:
        roles = [role for role, _ in spawned]
        binds, keys = {r: transport.addresses[r] for r in roles}, transport.keys
        for (role, config), (process, address) in zip(
            spawned, spawn_workers(spawned, binds, keys), strict=True
        ):
            started[role] = SpawnedWorker(role, config, address, process, transport.keys_of(role))
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
    prefill, decode = running.workers["prefill"].address, running.workers["decode"].address
    if front.router_process:
        listen = ["--listen", transport.addresses["router"], *transport.key_flags("router")]
        _start_front_process(running, ["router", "--prefill", prefill, "--decode", decode], listen)
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
    """The router's tokenizer and vocabulary size: an in-thread worker's model's, else the packaged
    model's (what `kvfence router` reads by default)."""
    for spec in specs.values():
        if isinstance(spec, InThread) and spec.engine.tokenizer is not None:
            return spec.engine.tokenizer, spec.engine.model.config.vocab_size
    config, metadata = read_header(default_model_path())
    return Tokenizer(metadata), config.vocab_size
