"""Start prefill and decode workers as real processes (for `serve --disaggregated` and the tests)."""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.connection import Connection

from kvfence.config import EngineConfig
from kvfence.disagg.connector import ZmqConnector
from kvfence.disagg.decode import DecodeWorker
from kvfence.disagg.handoff import HandoffEngine
from kvfence.disagg.prefill import PrefillWorker
from kvfence.disagg.worker import Worker

WORKERS: dict[str, type[Worker]] = {"prefill": PrefillWorker, "decode": DecodeWorker}
START_TIMEOUT_S = 120.0


def run_worker(role: str, config: EngineConfig, bind: str, ready: Connection | None = None) -> None:
    """Load the engine, bind, announce the bound address on `ready`, then serve until killed."""
    from kvfence.engine.engine import load_engine

    engine = load_engine(
        config, log=lambda line: print(f"[{role}] {line}", flush=True), engine_cls=HandoffEngine
    )
    worker = WORKERS[role](engine, ZmqConnector(bind))
    print(f"[{role}] listening on {worker.connector.address}", flush=True)
    if ready is not None:
        ready.send(worker.connector.address)
        ready.close()
    worker.serve_forever()


def spawn_workers(
    specs: list[tuple[str, EngineConfig]], bind: str = "tcp://127.0.0.1:0"
) -> list[tuple[mp.Process, str]]:
    """Workers in fresh processes (spawned: nothing inherited from this one), loading in parallel; returns
    each process with its bound address."""
    context = mp.get_context("spawn")
    started = []
    for role, config in specs:
        receiver, sender = context.Pipe(duplex=False)
        process = context.Process(
            target=run_worker, args=(role, config, bind, sender), name=f"kvfence-{role}", daemon=True
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
