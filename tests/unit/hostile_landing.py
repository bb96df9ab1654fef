"""A hostile landing process for tests/unit/test_landing.py: it answers START as the real one does, then
answers every later call in the way its MODE names (argv: MODE FD SOCK SLOTS SLOT_BYTES UID)."""

from __future__ import annotations

import os
import pickle
import socket
import struct
import sys
import time

from kvfence.disagg import landing_wire as wire
from kvfence.disagg.landing_process import read_call

MARKER_ENV = "UCX_TEST_MARKER"  # the allow-list passes UCX_*: where the pickle would leave its mark


class Payload:
    """Unpickling this runs `os.system`: what a worker that unpickles its landing's replies would do."""

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {os.environ.get(MARKER_ENV, '/tmp/kvfence-pwned')}",))


def reply(mode: str, seq: int, op: wire.Op) -> bytes:
    """What this mode sends for call (seq, op)."""
    honest = {wire.Op.WRITE: struct.pack(">I", 1), wire.Op.POLL: b"\x01", wire.Op.NOTIFIED: b"\x00\x00"}
    body = honest.get(op, b"")
    if mode == "pickle":
        return pickle.dumps(Payload())
    if mode == "wrong_seq":
        return wire.frame(seq + 1, op, body)
    if mode == "oversized":
        return wire.HEADER.pack(seq, op, 0, 1 << 30)
    if mode == "trailing":
        return wire.frame(seq, op, body + b"extra")
    if mode == "bad_state":
        return wire.frame(seq, op, b"\x07" if op is wire.Op.POLL else body)
    if mode == "bad_notification":  # an agent name that is not printable ASCII
        note = struct.pack(">H", 1) + wire.short(b"agent\x00") + wire.short(b"r1")
        return wire.frame(seq, op, note if op is wire.Op.NOTIFIED else body)
    raise ValueError(mode)


def main(mode: str, sock_fd: int, slots: int, slot_bytes: int) -> None:
    sock = socket.socket(fileno=sock_fd)
    seq, op, _ = read_call(sock)
    sock.sendall(wire.frame(seq, op, wire.layout_reply(0x10000, slots, slot_bytes)))
    while True:
        seq, op, _ = read_call(sock)
        if mode == "silent":
            time.sleep(3600)
        while mode == "spin":  # busy, never answering: a deadline on waiting for a CPU alone never ends it
            pass
        sock.sendall(reply(mode, seq, op))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
