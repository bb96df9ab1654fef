"""Start prefill and decode workers as real processes (for `serve --disaggregated` and the tests).

Workers are given by name (`keys.worker_names`: `prefill`, or `prefill-0`, `decode-1`... when a role has
several); the name picks the role, the bind address and the keys of that worker.

`--kv-transport` picks how pages move (`KvPlane`): `nixl` (sealed one-sided NIXL WRITEs through a landing
process, kvfence/disagg/landing.py), `zmq` (page frames on the CURVE channel), `auto` nixl where it can run
as it must, else zmq. NIXL runs only where every condition of its separation holds: NIXL installed, the
pool in host memory, this process root (the landing process gets a uid of its own), and UCX on one named
interface (the bind address's, or `--kv-interface`; a wildcard bind names none). `nixl` is refused,
saying which does not hold; `auto` says it and takes zmq. Either way every control message stays on the
authenticated channel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvfence.config import EngineConfig
from kvfence.disagg.connector import ZmqConnector
from kvfence.disagg.decode import DecodeWorker
from kvfence.disagg.handoff import HandoffEngine
from kvfence.disagg.keys import TransportKeys, role_of
from kvfence.disagg.landing import LandingAgent, interface_of
from kvfence.disagg.landing_identity import separation_refusal
from kvfence.disagg.nixl_transport import area_shape, nixl_available
from kvfence.disagg.plane import KvPlane
from kvfence.disagg.prefill import PrefillWorker
from kvfence.disagg.worker import Worker
from kvfence.lifetime import Restarts, watch_parent

# An annotation only: the pipe carries bytes (send_bytes, a bounded recv_bytes), never a pickle.
if TYPE_CHECKING:
    from multiprocessing.connection import Connection

WORKERS: dict[str, type[Worker]] = {"prefill": PrefillWorker, "decode": DecodeWorker}
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0  # how long a worker may take to stop after SIGTERM before it is killed
RESTART_LIMIT = 5  # a worker that died this many times in a row (without serving a minute) is not restarted
LOOPBACK_ANY_PORT = "tcp://127.0.0.1:0"
MAX_ADDRESS_BYTES = 256  # a worker's bound address, as it announces it
DEFAULT_PLANE = KvPlane()
# Builds a worker's engine in the worker process: a module-level function (spawn pickles it by name).
EngineFactory = Callable[[EngineConfig], HandoffEngine]


def nixl_refusal(engine: HandoffEngine, plane: KvPlane, bind: str) -> tuple[str | None, str | None]:
    """(why NIXL cannot run here as it must, or None; the interface UCX would listen on)."""
    host = bind.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    interface = plane.interface or interface_of(host)
    if not nixl_available():
        return "NIXL is not installed (pip install nixl-cu12)", interface
    if engine.pool.kv.device.type != "cpu":
        return "it stages pages in host memory; use --device cpu", interface
    if plane.interface is not None and plane.interface not in dict(socket.if_nameindex()).values():
        return f"--kv-interface {plane.interface}: no such interface", interface
    if interface is None:
        return (
            f"{bind} is a wildcard or held by no interface, and UCX would listen on every interface: "
            "name one with --kv-interface"
        ), interface
    return separation_refusal(), interface


def kv_agent(name: str, engine: HandoffEngine, plane: KvPlane, bind: str) -> LandingAgent | None:
    """This worker's one-sided transport: a landing process over its sealed area (never the pool), its UCX
    listening on one interface; or None for ZeroMQ pages. `nixl` where it cannot run as it must: refused
    (RuntimeError saying why); `auto`: None, and why is printed."""
    if plane.transport == "zmq":
        return None
    refusal, interface = nixl_refusal(engine, plane, bind)
    if refusal is not None and plane.transport == "nixl":
        raise RuntimeError(f"--kv-transport nixl: {refusal}")
    if refusal is not None:
        print(f"[{name}] KV pages go as ZeroMQ frames, not NIXL: {refusal}", flush=True)
        return None
    name = f"kvfence-{role_of(name)}-{os.getpid()}"
    return LandingAgent(name, *area_shape(engine.pool), interface, plane.landing_uid, cma=plane.landing_cma)


def run_worker(
    name: str,
    config: EngineConfig,
    bind: str,
    ready: Connection | None = None,
    keys: TransportKeys | None = None,
    plane: KvPlane = DEFAULT_PLANE,
    build: EngineFactory | None = None,
    parent: int | None = None,
) -> None:
    """Load the engine of worker `name` (its role, or a name `worker_names` made; `build` instead of the
    config's GGUF: tests' tiny models), bind, announce the bound address on `ready`, then serve until
    killed. A worker started by a parent (its pid given) exits when that parent is gone, so it can
    never outlive it."""
    from kvfence.engine.engine import load_engine

    role = role_of(name)
    if role == "prefill":  # it samples one token a request: a drafter (a draft model's weights) would idle
        config = dataclasses.replace(config, speculative=None)
    if parent is not None:
        watch_parent(parent)
    log = lambda line: print(f"[{name}] {line}", flush=True)  # noqa: E731
    engine = build(config) if build else load_engine(config, log=log, engine_cls=HandoffEngine)
    agent = kv_agent(name, engine, plane, bind)
    worker = WORKERS[role](engine, ZmqConnector(bind, keys), agent=agent)  # type: ignore[call-arg]
    security = "CURVE, allow-listed peers" if keys else "INSECURE (no keys: any local process may send)"
    pages = f"sealed one-sided NIXL writes ({agent.describe()})" if agent else "ZeroMQ frames"
    print(f"[{name}] listening on {worker.connector.address} ({security}); KV pages: {pages}", flush=True)
    if ready is not None:
        ready.send_bytes(worker.connector.address.encode())
        ready.close()
    worker.serve_forever()


def spawn_workers(
    specs: list[tuple[str, EngineConfig]],
    bind: str | dict[str, str] = LOOPBACK_ANY_PORT,
    keys: dict[str, TransportKeys] | None = None,
    plane: KvPlane = DEFAULT_PLANE,
    build: EngineFactory | None = None,
) -> list[tuple[mp.Process, str]]:
    """Workers (name, config) in fresh processes (spawned: nothing inherited from this one), loading in
    parallel; returns each process with its bound address. `bind` and `keys` may be given per name."""
    context = mp.get_context("spawn")
    started = []
    for name, config in specs:
        address = bind[name] if isinstance(bind, dict) else bind
        own_keys = keys[name] if keys else None
        receiver, sender = context.Pipe(duplex=False)
        process = context.Process(
            target=run_worker,
            args=(name, config, address, sender, own_keys, plane, build, os.getpid()),
            name=f"kvfence-{name}",
            daemon=True,
        )
        process.start()
        sender.close()
        started.append((process, receiver, name))
    workers = []
    for process, receiver, name in started:
        if not receiver.poll(START_TIMEOUT_S):
            process.kill()
            raise RuntimeError(f"the {name} worker did not start within {START_TIMEOUT_S:.0f}s")
        try:
            # Bytes, never a pickle: the worker's process is reachable from the fabric.
            workers.append((process, receiver.recv_bytes(MAX_ADDRESS_BYTES).decode()))
        except EOFError:
            raise RuntimeError(f"the {name} worker exited while starting (see its output)") from None
        except (OSError, UnicodeDecodeError):  # longer than an address, or not text
            process.kill()
            raise RuntimeError(f"the {name} worker announced no address") from None
    return workers


class LocalWorkers:
    """The worker processes of `serve --disaggregated`, by name: spawned together, a dead one respawned on
    the same address with the same keys (the router re-learns it when its link comes back up, the other
    workers serving meanwhile) after a backoff (`lifetime.Restarts`), or not again once it failed
    RESTART_LIMIT times in a row (`given_up`: said in the log; the router sees it down), and every one
    stopped when the block ends, however it ends."""

    def __init__(
        self,
        specs: list[tuple[str, EngineConfig]],
        binds: dict[str, str],
        keys: dict[str, TransportKeys] | None,
        poll_s: float = 1.0,
        plane: KvPlane = DEFAULT_PLANE,
    ) -> None:
        self.specs, self.binds, self.keys, self.poll_s = dict(specs), binds, keys, poll_s
        self.plane = plane
        self.processes: dict[str, mp.Process] = {}
        self.backoff = {name: Restarts(limit=RESTART_LIMIT) for name in self.specs}
        self.started: dict[str, float] = {}  # when each worker's current process announced its address
        self.due: dict[str, float] = {}  # a dead worker's restart, after its backoff
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="kvfence-supervisor", daemon=True)

    @property
    def restarts(self) -> int:
        return sum(backoff.total for backoff in self.backoff.values())

    @property
    def given_up(self) -> set[str]:
        return {name for name, backoff in self.backoff.items() if backoff.given_up}

    def __enter__(self) -> LocalWorkers:
        for (name, _), (process, _) in zip(self.specs.items(), self._spawn(list(self.specs)), strict=True):
            self.processes[name], self.started[name] = process, time.monotonic()
        self._watcher.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopping.set()
        self._watcher.join(timeout=START_TIMEOUT_S)
        for process in self.processes.values():
            process.terminate()
        for process in self.processes.values():
            process.join(timeout=STOP_TIMEOUT_S)
            if process.is_alive():
                process.kill()

    def _spawn(self, names: list[str]) -> list[tuple[mp.Process, str]]:
        keys = {name: self.keys[name] for name in names} if self.keys else None
        specs = [(name, self.specs[name]) for name in names]
        return spawn_workers(specs, self.binds, keys, self.plane)

    def _watch(self) -> None:
        while not self._stopping.wait(self.poll_s):
            for name, process in list(self.processes.items()):
                if not (process.is_alive() or self._stopping.is_set() or name in self.given_up):
                    self._restart(name, process.exitcode)

    def _restart(self, name: str, code: int | None) -> None:
        """A dead worker: its next start is scheduled after the backoff, or started when that is over."""
        now = time.monotonic()
        if name not in self.due:
            delay = self.backoff[name].failed(now, self.started.get(name))
            if delay is None:
                times = self.backoff[name].in_a_row
                print(f"[{name}] worker exited (code {code}) {times} times in a row: given up", flush=True)
                return
            print(f"[{name}] worker exited (code {code}); restarting it in {delay:.1f} s", flush=True)
            self.due[name] = now + delay
            self.started.pop(name, None)  # it is not serving: a failure to restart adds to the same run
        if now < self.due[name]:
            return
        del self.due[name]
        try:
            ((self.processes[name], _),) = self._spawn([name])
            self.started[name] = time.monotonic()
        except RuntimeError as exc:  # it failed to start: a failure like any other
            print(f"[{name}] restart failed: {exc}", flush=True)


# Ports for workers to bind later, chosen below Linux's ephemeral range (32768-60999 by default): a port
# the kernel handed out for port 0 was free when chosen, but any outgoing connection (ZeroMQ's, UCX's) could
# be given it before the worker bound it ("Address already in use", seen in a disaggregated test). Ports
# here are only ever taken by an explicit bind.
_CHOSEN_PORTS = range(20000, 32768)


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct TCP ports free on `host` right now (held together while chosen), at random from
    `_CHOSEN_PORTS`."""
    chooser = random.SystemRandom()
    with contextlib.ExitStack() as stack:
        found: list[int] = []
        for port in chooser.sample(_CHOSEN_PORTS, len(_CHOSEN_PORTS)):
            if len(found) == count:
                break
            held = stack.enter_context(socket.socket())
            try:
                held.bind((host, port))
            except OSError:  # taken: try the next
                continue
            found.append(port)
        if len(found) < count:
            raise OSError(f"fewer than {count} free ports in {_CHOSEN_PORTS} on {host}")
        return found
