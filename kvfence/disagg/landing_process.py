"""The landing process itself: maps the worker's area, gives up every privilege, then serves the wire.

Started by `landing.LandingAgent` as `python -m kvfence.disagg.landing_process FD SOCK SLOTS SLOT_BYTES
UID CMA`, as root and with the allow-listed environment (`landing_identity.landing_env`). In this order:
1. import NIXL and map the area (a sealed memfd: it can be written, never grown or shrunk);
2. drop to its own uid, no groups, not dumpable (with CMA 1: dumpable to that uid), no core files
   (`landing_identity.drop_privileges`), then arm SIGKILL for when its worker ends (a credentials change
   clears a parent-death signal armed before it);
3. read the worker's START call (its agent's name travels there, never in argv) and only then create the
   NIXL agent and register the area;
4. answer calls until CLOSE or until the worker's end of the socket closes.
A request that does not parse ends the process: the worker restarts it. Finished WRITE handles are
released as soon as their state is read, so a long run holds only the WRITEs in flight.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
import sys
from collections.abc import Callable

import numpy as np

from kvfence.disagg import landing_wire as wire
from kvfence.disagg.landing_identity import drop_privileges
from kvfence.disagg.landing_wire import Op, WireError
from kvfence.disagg.nixl_transport import AreaLayout, NixlAgent, Write, load_api
from kvfence.lifetime import exit_with_parent


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return bytes(data)


def read_call(sock: socket.socket) -> tuple[int, Op, bytes]:
    seq, op, status, length = wire.HEADER.unpack(recv_exact(sock, wire.HEADER.size))
    if op not in Op.__members__.values() or status or length > wire.MAX_REQUEST:
        raise WireError(f"call {op} of {length} bytes")
    return seq, Op(op), recv_exact(sock, length)


class Landing:
    """The agent and its WRITEs in flight, answering one call at a time."""

    def __init__(self, agent: NixlAgent) -> None:
        self.agent = agent
        self.writes: dict[int, Write] = {}
        self.next_handle = 0
        self.calls: dict[Op, Callable[[bytes], bytes]] = {
            Op.METADATA: lambda _: self.agent.metadata(),
            Op.ADD_PEER: lambda body: self.agent.add_peer(body).encode(),
            Op.REMOVE_PEER: self.remove_peer,
            Op.WRITE: self.write,
            Op.POLL: self.poll,
            Op.NOTIFIED: lambda _: wire.notified_reply(self.agent.notified()),
        }

    def remove_peer(self, body: bytes) -> bytes:
        self.agent.remove_peer(wire.name(body))
        return b""

    def write(self, body: bytes) -> bytes:
        call = wire.parse_write(body)
        write = self.agent.write(call.peer, AreaLayout(*call.remote), call.pairs, call.request_id)
        self.next_handle = (self.next_handle + 1) & 0xFFFFFFFF
        self.writes[self.next_handle] = write
        return struct.pack(">I", self.next_handle)

    def poll(self, body: bytes) -> bytes:
        handle = wire.parse_handle(body)
        write = self.writes.get(handle)
        state = self.agent.poll(write) if write is not None else "ERR"
        if state != "PROC":
            self.writes.pop(handle, None)
        return bytes([wire.STATES.index(state)])

    def answer(self, op: Op, body: bytes) -> tuple[int, bytes]:
        try:
            return 0, self.calls[op](body)
        except Exception as exc:  # NIXL refused (a bad descriptor, an unknown peer): that call fails
            return 1, f"{type(exc).__name__}: {exc}".encode()[: wire.MAX_ERROR]


def main(fd: int, sock_fd: int, slots: int, slot_bytes: int, uid: int, cma: int) -> None:
    worker = os.getppid()
    load_api()  # imported while the interpreter can still read every path it needs
    area = np.frombuffer(mmap.mmap(fd, slots * slot_bytes), dtype=np.uint8).reshape(slots, slot_bytes)
    drop_privileges(uid, dumpable=cma == 1)
    exit_with_parent(worker)
    sock = socket.socket(fileno=sock_fd)
    seq, op, body = read_call(sock)
    if op is not Op.START:
        raise WireError(f"the first call is {op.name}")
    landing = Landing(NixlAgent(wire.name(body), area))
    layout = landing.agent.layout
    sock.sendall(wire.frame(seq, op, wire.layout_reply(layout.base, layout.slots, layout.slot_bytes)))
    try:
        while (call := read_call(sock))[1] is not Op.CLOSE:
            seq, op, body = call
            status, reply = landing.answer(op, body)
            sock.sendall(wire.frame(seq, op, reply, status))
        sock.sendall(wire.frame(call[0], Op.CLOSE))
    except (EOFError, OSError):
        pass  # the worker is gone
    landing.agent.close()


if __name__ == "__main__":
    main(*(int(arg) for arg in sys.argv[1:7]))
