"""How a worker of a harness cluster runs (on a thread here, spawned, or as a `kvfence serve --role`
command), the handle that crashes, restarts and stops it, and the cluster's transport plan: every
address chosen before anything binds, and (secure) keys made for the cluster, in memory for this process
and its spawned children and as a key directory for command workers.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import Process
from pathlib import Path

from kvfence.config import EngineConfig
from kvfence.disagg.connector import ZmqConnector
from kvfence.disagg.handoff import HandoffEngine
from kvfence.disagg.keys import TransportKeys, generate, load, role_of
from kvfence.disagg.launch import WORKERS, EngineFactory, free_ports, spawn_workers
from kvfence.disagg.worker import Worker
from kvfence.harness.procs import START_TIMEOUT_S, Proc, launch, stop
from kvfence.harness.server import LOOPBACK

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
    """The worker in a fresh process started by kvfence.disagg.launch.spawn_workers, on a loopback port;
    its engine from `build` (a module-level function) where given, else from the config's GGUF."""

    config: EngineConfig
    build: EngineFactory | None = None


@dataclass(frozen=True)
class Command:
    """`[prefix] kvfence serve --role ROLE --listen LISTEN ARGS` as an OS process. `listen` None: a free
    loopback port. `prefix` must exec the command (`ip netns exec NS` does)."""

    args: Sequence[str] = ()
    listen: str | None = None
    prefix: Sequence[str] = ()


WorkerSpec = InThread | Spawned | Command


class WorkerHandle(ABC):
    """A running worker: its name (`prefill`, `decode-1`...: `role` names the worker, its role is
    `keys.role_of(role)`), its bound address, and how to crash, restart and stop it."""

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
    build: EngineFactory | None = None

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
        ((self.process, address),) = spawn_workers(
            [(self.role, self.config)], bind=self.address, keys=keys, build=self.build
        )
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
        args = ["serve", "--role", role_of(role), "--listen", address, *key_flags, *spec.args]
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
        worker = WORKERS[role_of(role)](engine, ZmqConnector(listen, keys))
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

    addresses: dict[str, str]  # by name: prefill (or prefill-0, prefill-1...), decode..., router
    keys: dict[str, TransportKeys] | None = None
    key_dir: str | None = None

    @classmethod
    def plan(
        cls, specs: dict[str, WorkerSpec], router_listen: str, secure: bool, stack: contextlib.ExitStack
    ) -> Transport:
        chosen = {role: _listen_of(spec) for role, spec in specs.items()}
        chosen["router"] = router_listen
        addresses = {role: _concrete(address or ANY_PORT) for role, address in chosen.items()}
        if not secure:
            return cls(addresses)
        key_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvfence-keys-"))
        generate(Path(key_dir), [(name, role_of(name), address) for name, address in addresses.items()])
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
