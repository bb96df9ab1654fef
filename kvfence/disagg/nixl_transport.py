"""One-sided KV page writes with NIXL (UCX underneath: TCP or shared memory on a CPU host, RDMA/NVLink on
a GPU fleet): the data plane of `--kv-transport nixl`.

Contract:
- A worker's `NixlAgent` registers its whole KV pool (`KVPool.kv`, one contiguous host tensor) once.
- `metadata()`/`layout()` are what a decode worker announces to a prefill worker, and only over the
  authenticated control channel (a `kv_agent` message on CURVE); nothing here listens on a side channel
  (NIXL's own metadata listener stays off).
- `write` posts one WRITE of whole pages (every layer's K and V) from this pool into the peer's, with a
  notification naming the request; `poll` says PROC, DONE or ERR. DONE means the bytes are in the
  peer's memory, so the caller may then free its source pages and tell the peer.
- The agent has no progress thread: transfers, the first connection to a peer and notifications advance
  only inside `poll` and `notified`, on both sides, so a worker expecting a WRITE keeps calling
  `notified` (decode: `DecodeWorker.wait_s`).
- Nothing here decides whether a write is allowed or complete: the decode worker grants (page,
  generation) targets and verifies every page's checksum over the control channel before it believes
  a byte (`decode.py`, `disagg/README.md`). A notification is never trusted for anything but raising
  an alarm (a write that landed after its grant was given up).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch

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
class PoolLayout:
    """Where a pool's pages lie: `kv[layer, k_or_v, page]` is one block of `block_bytes` at
    `base + ((layer * 2 + k_or_v) * pages + page) * block_bytes` (a contiguous [L, 2, P, ...] tensor)."""

    base: int
    layers: int
    pages: int
    block_bytes: int

    @classmethod
    def of(cls, kv: torch.Tensor) -> PoolLayout:
        assert kv.is_contiguous() and kv.device.type == "cpu", "NIXL registers the host pool as one region"
        layers, _, pages = kv.shape[:3]
        return cls(kv.data_ptr(), layers, pages, kv[0, 0, 0].numel() * kv.element_size())

    def compatible(self, other: PoolLayout) -> bool:
        """Pages of `other` can be written into pages of this pool (same model, page size and dtype)."""
        return (self.layers, self.block_bytes) == (other.layers, other.block_bytes)

    def blocks(self, runs: list[tuple[int, int]]) -> np.ndarray:
        """NIXL descriptors (address, length, device 0) for runs of consecutive pages, `runs` =
        [(first page, count)]: one per run and (layer, K|V), run-major. A run is one descriptor per block
        because the pool keeps a block's pages next to each other."""
        first = np.asarray([page for page, _ in runs], dtype=np.uint64)[:, None]
        count = np.asarray([n for _, n in runs], dtype=np.uint64)[:, None]
        block = np.arange(self.layers * 2, dtype=np.uint64)[None, :]
        rows = np.zeros((len(runs) * self.layers * 2, 3), dtype=np.uint64)
        rows[:, 0] = (self.base + (block * self.pages + first) * self.block_bytes).ravel()
        rows[:, 1] = np.broadcast_to(count * self.block_bytes, (len(runs), self.layers * 2)).ravel()
        return rows


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


class NixlAgent:
    """This process's NIXL agent with its KV pool registered."""

    def __init__(self, name: str, kv: torch.Tensor) -> None:
        api = load_api()
        if api is None:
            raise RuntimeError("NIXL is not installed (pip install nixl-cu12); use --kv-transport zmq")
        self.name = name
        self.layout = PoolLayout.of(kv)
        self._kv = kv  # kept alive: NIXL holds raw addresses into it
        # No progress thread: NIXL's spins a whole core even when nothing moves (measured: 3.0 s of CPU in
        # 3 s idle; two idle workers took both cores of this machine). Progress happens in our own calls
        # (`poll`, `notified`), which the workers make every loop and more often while a transfer is live.
        config = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self._agent = api.nixl_agent(name, config)
        region = [(kv.data_ptr(), kv.numel() * kv.element_size(), 0, "")]
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

    def write(self, peer: str, remote: PoolLayout, pairs: list[tuple[int, int]], request_id: str) -> Write:
        """Post a WRITE of local pages into the peer's pages, `pairs` = [(source, target)]."""
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

    def notified(self) -> list[str]:
        """Request ids named by WRITE notifications that arrived since the last call (untrusted)."""
        ids = []
        for messages in self._agent.get_new_notifs().values():
            for message in messages:
                if message.startswith(NOTIFY_PREFIX):
                    ids.append(message[len(NOTIFY_PREFIX) :].decode("utf-8", "replace"))
        return ids

    def close(self) -> None:
        """Release in order (handles, then the registration) so nothing is torn down under UCX at exit."""
        for write in list(self._writes):
            self._agent.release_xfer_handle(write.handle)
        self._writes.clear()
        self._agent.deregister_memory(self._registered)
