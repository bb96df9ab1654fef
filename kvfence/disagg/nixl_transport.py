"""One-sided KV page writes with NIXL (UCX underneath: TCP or shared memory on a CPU host, RDMA/NVLink on
a GPU fleet): the data plane of `--kv-transport nixl`.

Contract:
- An agent registers one `SealedArea`, never a KV pool: decode's landing area (one slot per pool page,
  where prefill's WRITEs land) or prefill's send area (one slot per pool page, where it stages what it
  sends). UCX checks neither who asks nor that an address lies in registered memory, so whatever the
  agent's process holds is exposed to any process that reaches its listener: that process is the landing
  process (`kvfence/disagg/landing.py`), which shares only its area with the worker.
- A slot holds one sealed page (`kvfence/disagg/seal.py`): the page's written slots, AES-GCM under a key
  that never crosses the fabric; the rest of the slot is zeros.
- `metadata()`/`layout()` are what a decode worker announces to a prefill worker, and only over the
  authenticated control channel (a `kv_agent` message on CURVE); NIXL's own metadata listener stays off.
- `write` posts one WRITE of whole slots from this area into the peer's, one descriptor per run of
  consecutive slots on both sides; `poll` says PROC, DONE or ERR. After DONE the caller tells the peer
  (`complete`), which opens the pages before any byte enters its pool.
- The agent has no progress thread: transfers, the first connection to a peer and notifications advance
  only inside `poll` and `notified`, on both sides. DONE at the writer does not mean landed at the
  target (over TCP): the target opens a page only after the WRITE's notification has come.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from kvfence.cache.pool import KVPool
from kvfence.disagg.landing_wire import Notification
from kvfence.disagg.seal import SEAL, TAG_BYTES

NOTIFY_PREFIX = b"kvf:"  # a WRITE's notification: the prefix, then the request id
_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")  # the meta package, else a backend wheel


def load_api() -> ModuleType | None:
    """The NIXL Python API, or None when no NIXL wheel is installed (the zmq transport is then used)."""
    for name in _MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def nixl_available() -> bool:
    return load_api() is not None


@dataclass(frozen=True)
class AreaLayout:
    """Where an area's slots lie: slot `i` is `slot_bytes` at `base + i * slot_bytes`."""

    base: int
    slots: int
    slot_bytes: int

    def compatible(self, other: AreaLayout) -> bool:
        """Slots of `other` can be written into slots of this area (same model, page size and dtype)."""
        return self.slot_bytes == other.slot_bytes

    def blocks(self, runs: list[tuple[int, int]]) -> np.ndarray:
        """NIXL descriptors (address, length, device 0) for runs of consecutive slots, `runs` =
        [(first slot, count)], one per run; a run past the area is refused here, not left to UCX."""
        if any(first < 0 or count < 1 or first + count > self.slots for first, count in runs):
            raise ValueError("a run of slots outside the area")
        rows = np.zeros((len(runs), 3), dtype=np.uint64)
        rows[:, 0] = [self.base + first * self.slot_bytes for first, _ in runs]
        rows[:, 1] = [count * self.slot_bytes for _, count in runs]
        return rows


def area_shape(pool: KVPool) -> tuple[int, int]:
    """(slots, slot_bytes) of the landing or send area for `pool`: a slot per page, each a whole sealed
    page (every slot written, plus the tag)."""
    return pool.num_pages, pool.page_size * pool.token_bytes + TAG_BYTES


def new_area(slots: int, slot_bytes: int) -> np.ndarray:
    """A zeroed [slots, slot_bytes] byte area in this process (the landing process maps its own)."""
    return np.zeros((slots, slot_bytes), dtype=np.uint8)


def contiguous_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """[(source, target, count)]: the (source page, target page) pairs in source order, merged where both
    sides step by one page. UCX pays per descriptor (bench/kv_transport.py: page runs move about 1.5x
    faster than scattered pages). Fresh pools hand pages out in runs; under churn the two pools' free
    queues rarely line up, and a request is then one descriptor per page and block."""
    runs: list[tuple[int, int, int]] = []
    for source, target in sorted(pairs):
        if runs and (source, target) == (runs[-1][0] + runs[-1][2], runs[-1][1] + runs[-1][2]):
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((source, target, 1))
    return runs


@dataclass
class Write:
    """One posted WRITE; `handle` is NIXL's."""

    peer: str
    handle: Any
    state: str = "PROC"


class OneSidedAgent(Protocol):
    """What a worker asks of its one-sided transport: `NixlAgent` in this process (tests), or
    `landing.LandingAgent`, the same calls answered by a separate landing process."""

    area: np.ndarray  # [slots, slot_bytes]: landing (decode) or send (prefill) slots, one per pool page
    layout: AreaLayout
    incarnation: int  # changes when the agent is replaced (a restarted landing process): announce again
    agent_name: str  # what its WRITEs' notifications name as their sender

    def metadata(self) -> bytes: ...
    def add_peer(self, metadata: bytes) -> str: ...
    def remove_peer(self, name: str) -> None: ...
    def write(
        self, peer: str, remote: AreaLayout, pairs: list[tuple[int, int]], request_id: str
    ) -> Write: ...
    def poll(self, write: Write) -> str: ...
    def notified(self) -> list[Notification]: ...
    def check(self) -> None: ...
    @property
    def serving(self) -> bool: ...
    @property
    def given_up(self) -> bool: ...  # past its restart limit: it will never serve again
    def close(self) -> None: ...
    def describe(self) -> dict[str, Any]: ...


class NixlAgent:
    """This process's NIXL agent with one area registered (see the module doc: never a pool)."""

    def __init__(self, name: str, area: np.ndarray) -> None:
        api = load_api()
        if api is None:
            raise RuntimeError("NIXL is not installed (pip install nixl-cu12); use --kv-transport zmq")
        assert area.ndim == 2 and area.dtype == np.uint8 and area.flags.c_contiguous
        self.name = self.agent_name = name
        self.incarnation = 0
        self.given_up = False  # nothing here is restarted
        self.area = area  # kept alive: NIXL holds raw addresses into it
        self.layout = AreaLayout(area.ctypes.data, area.shape[0], area.shape[1])
        # No progress thread: NIXL's spins a whole core even when nothing moves (measured: 3.0 s of CPU in
        # 3 s idle; two idle workers took both cores of this machine). Progress happens in our own calls
        # (`poll`, `notified`), which the workers make every loop and more often while a transfer is live.
        config = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self._agent = api.nixl_agent(name, config)
        region = [(self.layout.base, area.nbytes, 0, "")]
        self._registered = self._agent.register_memory(region, "DRAM")
        self._writes: list[Write] = []

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata (it came over the authenticated channel); returns the peer's agent name."""
        name = self._agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_peer(self, name: str) -> None:
        self._agent.remove_remote_agent(name)

    def write(self, peer: str, remote: AreaLayout, pairs: list[tuple[int, int]], request_id: str) -> Write:
        """Post a WRITE of local slots into the peer's slots, `pairs` = [(source, target)]."""
        runs = contiguous_runs(pairs)
        local = self._agent.get_xfer_descs(self.layout.blocks([(s, n) for s, _, n in runs]), "DRAM")
        targets = self._agent.get_xfer_descs(remote.blocks([(t, n) for _, t, n in runs]), "DRAM")
        notify = NOTIFY_PREFIX + request_id.encode()
        handle = self._agent.initialize_xfer("WRITE", local, targets, peer, notify)
        write = Write(peer, handle, self._agent.transfer(handle))
        self._writes.append(write)
        return write

    def poll(self, write: Write) -> str:
        """PROC, DONE or ERR; a finished write's handle is released."""
        if write.state == "PROC":
            write.state = self._agent.check_xfer_state(write.handle)
        if write.state != "PROC" and write in self._writes:
            self._writes.remove(write)
            self._agent.release_xfer_handle(write.handle)
        return write.state

    def describe(self) -> dict[str, Any]:
        return {"agent": "in process", "pool_registered": False, "seal": SEAL}

    def notified(self) -> list[Notification]:
        """Advance UCX (over TCP a peer's WRITE lands only while this side polls) and return the
        notifications that came, each with the agent that claims to have sent it. A notification follows
        its WRITE's bytes on the same connection, so it says when they have landed; nothing else is
        believed of it (UCX authenticates no agent: a forged one makes a page be opened early, and it does
        not open)."""
        notes = []
        for agent, messages in self._agent.get_new_notifs().items():
            sender = agent.decode("ascii", "replace") if isinstance(agent, bytes) else str(agent)
            for message in messages:
                if message.startswith(NOTIFY_PREFIX):
                    rid = message[len(NOTIFY_PREFIX) :].decode("utf-8", "replace")
                    notes.append(Notification(sender, rid))
        return notes

    def check(self) -> None:
        """Nothing to watch: the agent lives in this process."""

    @property
    def serving(self) -> bool:
        return True

    def close(self) -> None:
        """Release in order (handles, then the registration) so nothing is torn down under UCX at exit."""
        for write in list(self._writes):
            self._agent.release_xfer_handle(write.handle)
        self._writes.clear()
        self._agent.deregister_memory(self._registered)
