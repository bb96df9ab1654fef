"""How a worker moves KV pages, as its command line says (`--kv-transport`, `--kv-interface`,
`--landing-uid`, `--landing-cma`): read by kvfence/disagg/launch.py, which decides what can run (nothing
here is checked)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KvPlane:
    transport: str = "auto"  # auto, nixl or zmq
    interface: str | None = None  # UCX's one interface; None: the one holding the bind address
    landing_uid: int | None = None  # None: a uid of its own per worker (landing_identity.landing_uid)
    landing_cma: bool = False  # landing processes share landing_uid, dumpable to it (landing_identity.py)
