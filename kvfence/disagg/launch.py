"""Start prefill and decode workers as real processes (for `serve --disaggregated` and the tests)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import threading
import time
from multiprocessing.connection import Connection

from kvfence.config import EngineConfig
from kvfence.disagg.connector import ZmqConnector
from kvfence.disagg.decode import DecodeWorker
from kvfence.disagg.handoff import HandoffEngine
from kvfence.disagg.keys import TransportKeys
from kvfence.disagg.prefill import PrefillWorker
from kvfence.disagg.worker import Worker

WORKERS: dict[str, type[Worker]] = {"prefill": PrefillWorker, "decode": DecodeWorker}
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0  # how long a worker may take to stop after SIGTERM before it is killed
LOOPBACK_ANY_PORT = "tcp://127.0.0.1:0"


def run_worker(
    role: str,
    config: EngineConfig,
    bind: str,
    ready: Connection | None = None,
    keys: TransportKeys | None = None,
) -> None:
    """Load the engine, bind, announce the bound address on `ready`, then serve until killed. A worker
    started by a parent (`ready` given) ends when that parent is gone, so it can never outlive it."""
    from kvfence.engine.engine import load_engine

    if ready is not None:
        _exit_with_parent()
    engine = load_engine(
        config, log=lambda line: print(f"[{role}] {line}", flush=True), engine_cls=HandoffEngine
    )
    worker = WORKERS[role](engine, ZmqConnector(bind, keys))
    security = "CURVE, allow-listed peers" if keys else "INSECURE (no keys: any local process may send)"
    print(f"[{role}] listening on {worker.connector.address} ({security})", flush=True)
    if ready is not None:
        ready.send(worker.connector.address)
        ready.close()
    worker.serve_forever()


def _exit_with_parent(every_s: float = 0.5) -> None:
    """A watcher thread: when the parent process is gone (we were re-parented), exit at once."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(0)

    threading.Thread(target=watch, name="kvfence-parent-watch", daemon=True).start()


def spawn_workers(
    specs: list[tuple[str, EngineConfig]],
    bind: str | dict[str, str] = LOOPBACK_ANY_PORT,
    keys: dict[str, TransportKeys] | None = None,
) -> list[tuple[mp.Process, str]]:
    """Workers in fresh processes (spawned: nothing inherited from this one), loading in parallel; returns
    each process with its bound address. `bind` and `keys` may be given per role."""
    context = mp.get_context("spawn")
    started = []
    for role, config in specs:
        address = bind[role] if isinstance(bind, dict) else bind
        own_keys = keys[role] if keys else None
        receiver, sender = context.Pipe(duplex=False)
        process = context.Process(
            target=run_worker,
            args=(role, config, address, sender, own_keys),
            name=f"kvfence-{role}",
            daemon=True,
        )
        process.start()
        sender.close()
        started.append((process, receiver, role))
    workers = []
    for process, receiver, role in started:
        if not receiver.poll(START_TIMEOUT_S):
            process.kill()
            raise RuntimeError(f"the {role} worker did not start within {START_TIMEOUT_S:.0f}s")
        try:
            workers.append((process, receiver.recv()))
        except EOFError:
            raise RuntimeError(f"the {role} worker exited while starting (see its output)") from None
    return workers


class LocalWorkers:
    """The prefill and decode worker processes of `serve --disaggregated`: spawned together, a dead one
    respawned on the same address with the same keys (the router re-learns it when its link comes back
    up), and every one stopped when the block ends, however it ends."""

    def __init__(
        self,
        specs: list[tuple[str, EngineConfig]],
        binds: dict[str, str],
        keys: dict[str, TransportKeys] | None,
        poll_s: float = 1.0,
    ) -> None:
        self.specs, self.binds, self.keys, self.poll_s = dict(specs), binds, keys, poll_s
        self.processes: dict[str, mp.Process] = {}
        self.restarts = 0
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="kvfence-supervisor", daemon=True)

    def __enter__(self) -> LocalWorkers:
        for (role, _), (process, _) in zip(self.specs.items(), self._spawn(list(self.specs)), strict=True):
            self.processes[role] = process
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

    def _spawn(self, roles: list[str]) -> list[tuple[mp.Process, str]]:
        keys = {role: self.keys[role] for role in roles} if self.keys else None
        return spawn_workers([(role, self.specs[role]) for role in roles], self.binds, keys)

    def _watch(self) -> None:
        while not self._stopping.wait(self.poll_s):
            for role, process in list(self.processes.items()):
                if process.is_alive() or self._stopping.is_set():
                    continue
                print(f"[{role}] worker exited (code {process.exitcode}); restarting it", flush=True)
                try:
                    ((self.processes[role], _),) = self._spawn([role])
                    self.restarts += 1
                except RuntimeError as exc:  # it failed to start: try again on the next round
                    print(f"[{role}] restart failed: {exc}", flush=True)


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct TCP ports free on `host` right now (held together while chosen)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in sockets]
