"""The wire between a worker and its landing process: fixed, length-bounded binary frames, nothing else.

The landing process is reachable from the fabric (UCX), so whatever it sends is hostile: no pickle,
marshal, eval or `multiprocessing.Connection` object is on either side of this pipe.

Contract:
- A frame is a 12-byte header `(seq u32, op u8, status u8, 2 zero bytes, length u32)`, big-endian, then
  `length` bytes of body. A call is one request frame and exactly one reply frame carrying the same
  `seq` and `op`; status 0 is an answer, 1 an error whose body is a short UTF-8 text.
- Every op has its own body layout and bound (`MAX_BODY`); `parse_reply` accepts a reply only when its
  header matches the call, its length is within the op's bound and its body parses exactly (no trailing
  bytes) into typed, range-checked values: anything else raises `WireError`, and the caller must treat
  the landing process as lost.
- Names (NIXL agent names) are printable ASCII of at most `MAX_NAME` bytes; request ids valid UTF-8 of at
  most `MAX_NAME` bytes; a reply lists at most `MAX_NOTIFS` notifications.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

HEADER = struct.Struct(">IBBxxI")
MAX_NAME = 256
MAX_METADATA = 64 * 1024  # a NIXL agent's metadata: ~450 bytes for one UCX backend
MAX_NOTIFS = 1024
MAX_ERROR = 512
MAX_REQUEST = 8 * 1024 * 1024  # what the landing process reads of one call (a WRITE lists every pair)
STATES = ("PROC", "DONE", "ERR")


class Op(IntEnum):
    START = 1  # request: the agent's name; reply: the area's layout in the landing process
    METADATA = 2
    ADD_PEER = 3
    REMOVE_PEER = 4
    WRITE = 5
    POLL = 6
    NOTIFIED = 7
    CLOSE = 8


class WireError(ValueError):
    """A frame that does not parse as its op's reply (or request): the sender is not to be believed."""


# The largest reply body each op may have; a header announcing more is refused before a byte is read.
MAX_BODY = {
    Op.START: 16,
    Op.METADATA: MAX_METADATA,
    Op.ADD_PEER: MAX_NAME,
    Op.REMOVE_PEER: 0,
    Op.WRITE: 4,
    Op.POLL: 1,
    Op.NOTIFIED: 2 + MAX_NOTIFS * 2 * (1 + MAX_NAME),
    Op.CLOSE: 0,
}


@dataclass(frozen=True)
class Notification:
    """A WRITE's notification as the landing process reports it: the sending agent and the request id."""

    agent: str
    request_id: str


def frame(seq: int, op: Op, body: bytes = b"", status: int = 0) -> bytes:
    return HEADER.pack(seq, op, status, len(body)) + body


def parse_header(data: bytes, seq: int, op: Op) -> tuple[int, int]:
    """(status, body length) of a reply header to call (`seq`, `op`); WireError otherwise."""
    got_seq, got_op, status, length = HEADER.unpack(data)
    if (got_seq, got_op) != (seq, op):
        raise WireError(f"reply ({got_seq}, {got_op}) to call ({seq}, {op.name})")
    if status not in (0, 1):
        raise WireError(f"status {status}")
    if length > (MAX_BODY[op] if status == 0 else MAX_ERROR):
        raise WireError(f"{op.name} reply of {length} bytes")
    return status, length


class Reader:
    """Consumes a body front to back; every read is bounded by what is left."""

    def __init__(self, body: bytes) -> None:
        self.body, self.at = body, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.at + n > len(self.body):
            raise WireError("body too short")
        self.at += n
        return self.body[self.at - n : self.at]

    def unpack(self, fmt: str) -> tuple[int, ...]:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def short(self, width: str = ">B") -> bytes:
        """A string prefixed by its length (`width`), at most MAX_NAME bytes."""
        (n,) = self.unpack(width)
        if n > MAX_NAME:
            raise WireError(f"a string of {n} bytes")
        return self.take(n)

    def end(self) -> None:
        if self.at != len(self.body):
            raise WireError(f"{len(self.body) - self.at} trailing bytes")


def name(raw: bytes) -> str:
    if not raw or not all(0x21 <= b < 0x7F for b in raw):
        raise WireError("an agent name that is not printable ASCII")
    return raw.decode("ascii")


def request_id(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise WireError("a request id that is not UTF-8") from None


def short(raw: bytes, width: str = ">B") -> bytes:
    if len(raw) > MAX_NAME:
        raise WireError(f"a string of {len(raw)} bytes")
    return struct.pack(width, len(raw)) + raw


# ---- replies: encoded by the landing process, parsed (never trusted) by the worker -----------------------


def layout_reply(base: int, slots: int, slot_bytes: int) -> bytes:
    return struct.pack(">QII", base, slots, slot_bytes)


def parse_layout(body: bytes, slots: int, slot_bytes: int) -> int:
    """The area's base address in the landing process; its shape must be the one the worker made."""
    reader = Reader(body)
    base, got_slots, got_bytes = reader.unpack(">QII")
    reader.end()
    if (got_slots, got_bytes) != (slots, slot_bytes) or base == 0:
        raise WireError(f"layout ({base:#x}, {got_slots}, {got_bytes}) is not the area's")
    return base


def parse_name(body: bytes) -> str:
    return name(body)


def parse_empty(body: bytes) -> None:
    Reader(body).end()


def parse_handle(body: bytes) -> int:
    reader = Reader(body)
    (handle,) = reader.unpack(">I")
    reader.end()
    return handle


def parse_state(body: bytes) -> str:
    reader = Reader(body)
    (state,) = reader.unpack(">B")
    reader.end()
    if state >= len(STATES):
        raise WireError(f"transfer state {state}")
    return STATES[state]


def sendable(note: Notification) -> bool:
    """Whether a notification fits the wire (a rogue agent may send any name or message: not passed on)."""
    agent, rid = note.agent.encode("ascii", "replace"), note.request_id.encode()
    return 0 < len(agent) <= MAX_NAME and len(rid) <= MAX_NAME and all(0x21 <= b < 0x7F for b in agent)


def notified_reply(notes: list[Notification]) -> bytes:
    notes = [note for note in notes if sendable(note)][:MAX_NOTIFS]
    body = struct.pack(">H", len(notes))
    return body + b"".join(short(n.agent.encode()) + short(n.request_id.encode()) for n in notes)


def parse_notified(body: bytes) -> list[Notification]:
    reader = Reader(body)
    (count,) = reader.unpack(">H")
    if count > MAX_NOTIFS:
        raise WireError(f"{count} notifications")
    notes = [Notification(name(reader.short()), request_id(reader.short())) for _ in range(count)]
    reader.end()
    return notes


def parse_error(body: bytes) -> str:
    return body.decode("utf-8", "replace")[:MAX_ERROR]


# ---- requests: encoded by the worker, parsed (bounded, typed) by the landing process ---------------------


@dataclass(frozen=True)
class WriteCall:
    peer: str
    remote: tuple[int, int, int]  # the peer area's (base, slots, slot_bytes)
    pairs: list[tuple[int, int]]  # (local slot, remote slot)
    request_id: str


def write_request(call: WriteCall) -> bytes:
    head = struct.pack(">QII", *call.remote) + short(call.peer.encode()) + short(call.request_id.encode())
    pairs = b"".join(struct.pack(">II", s, t) for s, t in call.pairs)
    return head + struct.pack(">I", len(call.pairs)) + pairs


def parse_write(body: bytes) -> WriteCall:
    reader = Reader(body)
    remote = reader.unpack(">QII")
    peer, rid = name(reader.short()), request_id(reader.short())
    (count,) = reader.unpack(">I")
    pairs = [reader.unpack(">II") for _ in range(count)]
    reader.end()
    return WriteCall(peer, remote, pairs, rid)  # type: ignore[arg-type]
