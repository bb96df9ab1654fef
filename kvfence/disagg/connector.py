"""KV transfer transport: a mailbox per node, point-to-point, ordered per sender, authenticated.

Every node (router, prefill worker, decode worker) owns one address. `send(peer, message)` queues a
message for the peer's mailbox and never blocks: it returns False when the message could not be queued
(the peer has not taken `send_hwm` messages: slow, stopped or gone), which is then dropped whole and
counted (`rejected["send_blocked"]`), so that one stalled peer cannot stop a node's only thread; the
caller fails closed what the message was for. `recv()` returns what arrived, or a `LinkEvent`. Messages
from one sender to one receiver that are queued arrive in the order sent — the handoff protocol relies
on it: an abort-ack sent after the last page proves that no page of that request is still on the way.

Trust nothing that arrives:
- With keys (`TransportKeys`), every socket runs CURVE (encrypted, and the peer's key checked against the
  allow-list by a ZAP handler before any byte is delivered). A frame's sender is the allow-listed peer
  whose key the handshake proved (ZAP User-Id) — its configured address and role — never anything the
  frame says. A node dials only configured addresses.
- Without keys (insecure, loopback or `--insecure-transport` only), the sender is the routing identity
  the peer chose and its role is unknown: that is what "insecure" means, and it is reported as such.
- `LinkEvent`s come only from this node's own socket monitors; no frame can produce one.
- A frame is returned raw (`Received`): the receiver parses it with `messages.decode` inside its guarded
  handler. Frames that are not even a header and a payload are dropped and counted here.

Two backends: `ZmqConnector` (pyzmq over TCP, for real processes and hosts) and `MemoryConnector`
(in-process, deterministic, for tests that need exact message interleavings).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.utils.monitor
from zmq.auth.thread import ThreadAuthenticator

from kvfence.disagg.keys import TransportKeys
from kvfence.disagg.messages import Msg, encode

log = logging.getLogger("kvfence.disagg")
MAX_FRAME_BYTES = 64 << 20  # larger than any page of any model served here; bigger frames are cut off
# Messages queued for one peer before a send is refused (a count, not bytes: libzmq bounds nothing else).
# A transfer of 8192 pages (a 128k-token window in 16-token pages) queues whole while the receiver is
# mid-step; a peer that has left that many, and its own receive queue, untaken is stalled.
SEND_HWM = 8192


@dataclass(frozen=True)
class Received:
    """A frame pair from a peer. `role` is the authenticated sender's role, None on an insecure transport."""

    sender: str
    role: str | None
    header: bytes
    payload: bytes


@dataclass(frozen=True)
class LinkEvent:
    """This node's own connection to `peer` came up or went down (from a local socket monitor)."""

    peer: str
    up: bool


class UnknownPeer(ValueError):
    """A send to an address that is not a configured peer: refused, never dialled."""


class Connector(ABC):
    address: str
    secure: bool = False

    def __init__(self) -> None:
        # Frames dropped by reason: received ones before parsing, and sends not queued (`send_blocked`).
        self.rejected: Counter[str] = Counter()

    @abstractmethod
    def send(self, peer: str, message: Msg) -> bool:
        """Queue `message` for `peer` without blocking: True once it is queued whole, False when it was
        dropped whole (counted as `send_blocked`)."""

    @abstractmethod
    def recv(self, timeout_s: float) -> Received | LinkEvent | None:
        """The next frame or link event, or None after `timeout_s` seconds without one."""

    def connect(self, peer: str) -> None:  # noqa: B027 - a no-op where there is no connection to open
        """Open (once) the outgoing connection to `peer`, so that its loss is noticed."""

    def wake(self) -> None:  # noqa: B027 - a no-op where `recv` never waits
        """Make a `recv` waiting in another thread return None now (something else needs the thread).
        Safe to call from any thread."""

    @abstractmethod
    def role_of(self, peer: str) -> str | None:
        """The configured role of the peer at `peer`; None when unknown (or on an insecure transport)."""

    def close(self) -> None:
        return None


class _Curve:
    """The CURVE side of a ZmqConnector: a private context whose ZAP handler admits allow-listed keys."""

    def __init__(self, keys: TransportKeys, rejected: Counter[str]) -> None:
        self.keys = keys
        self.rejected = rejected
        self.context: zmq.Context[Any] = zmq.Context()
        self.auth = ThreadAuthenticator(self.context, log=logging.getLogger("kvfence.zap"))
        self.auth.start()
        self.auth.configure_curve_callback(domain="*", credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP: admit a connection only from a public key in the allow-list (refusals are counted)."""
        known = key.decode("ascii", "replace") in self.keys.book.by_key
        if not known:
            self.rejected["unknown_key"] += 1
        return known

    def server(self, socket: zmq.Socket[Any]) -> None:
        socket.curve_server = True
        socket.curve_secretkey = self.keys.identity.secret_key.encode()
        socket.curve_publickey = self.keys.identity.public_key.encode()

    def client(self, socket: zmq.Socket[Any], peer: str) -> None:
        known = self.keys.book.by_address.get(peer)
        if known is None:
            raise UnknownPeer(f"{peer} is not a configured peer")
        socket.curve_secretkey = self.keys.identity.secret_key.encode()
        socket.curve_publickey = self.keys.identity.public_key.encode()
        socket.curve_serverkey = known.public_key.encode()

    def sender(self, user_id: str | None) -> tuple[str, str] | None:
        peer = self.keys.book.by_key.get(user_id or "")
        return None if peer is None else (peer.address or peer.name, peer.role)

    def close(self) -> None:
        self.auth.stop()
        self.context.term()


class ZmqConnector(Connector):
    """A bound ROUTER socket receives; one DEALER per peer sends, queuing at most `send_hwm` messages for
    it (SNDHWM). A monitor on each DEALER reports the TCP connection as a LinkEvent (a DEALER reconnects by
    itself, so a restarted peer comes back up)."""

    def __init__(self, bind: str, keys: TransportKeys | None = None, send_hwm: int = SEND_HWM) -> None:
        super().__init__()
        self._send_hwm = send_hwm
        self._dropped: Counter[str] = Counter()  # sends dropped, by peer (logged at 1, 2, 4, 8...)
        self._curve = _Curve(keys, self.rejected) if keys else None
        self.secure = keys is not None
        self._context = self._curve.context if self._curve else zmq.Context.instance()
        self._inbox = self._context.socket(zmq.ROUTER)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        if self._curve:
            self._curve.server(self._inbox)
        self._inbox.bind(bind)
        self.address = self._inbox.getsockopt_string(zmq.LAST_ENDPOINT)
        self._peers: dict[str, zmq.Socket[Any]] = {}
        self._monitors: dict[zmq.Socket[Any], str] = {}
        self._poller = zmq.Poller()
        self._poller.register(self._inbox, zmq.POLLIN)
        # `wake` writes a byte here; a pipe, because a ZeroMQ socket may not be shared between threads.
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)
        self._poller.register(self._wake_read, zmq.POLLIN)
        self._wake_lock = threading.Lock()  # no wake-up may write into the pipe's fd once it is closed
        self._closed = False

    def connect(self, peer: str) -> None:
        if peer in self._peers:
            return
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, self._send_hwm)
        socket.setsockopt_string(zmq.IDENTITY, self.address)
        if self._curve:
            self._curve.client(socket, peer)  # raises UnknownPeer before anything is dialled
        monitor = socket.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        socket.connect(peer)
        self._peers[peer] = socket
        self._monitors[monitor] = peer
        self._poller.register(monitor, zmq.POLLIN)

    def send(self, peer: str, message: Msg) -> bool:
        """NOBLOCK: a full queue (SNDHWM reached) refuses the message's first frame with EAGAIN, and then
        nothing of it is queued. Once the first frame is in, libzmq takes the last one too (the mark counts
        whole messages), unless the pipe is torn down in between, and then it drops the whole message and
        refuses that frame: no peer ever receives half a message."""
        self.connect(peer)
        try:
            self._peers[peer].send_multipart(encode(message), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.rejected["send_blocked"] += 1
            self._dropped[peer] += 1
            dropped = self._dropped[peer]
            if dropped & (dropped - 1) == 0:  # a stalled peer costs a log line per doubling, not per frame
                log.warning("%s is not taking its messages: %d dropped (send_blocked)", peer, dropped)
            return False
        return True

    def role_of(self, peer: str) -> str | None:
        known = self._curve.keys.book.by_address.get(peer) if self._curve else None
        return None if known is None else known.role

    def recv(self, timeout_s: float) -> Received | LinkEvent | None:
        deadline = time.monotonic() + timeout_s
        while True:
            # Rounded up: truncated, the last fraction of a millisecond became poll(0) in a loop, a spin
            # that cost an idle router a fifth of a core (5 ms waits, 1 ms of each spent spinning).
            remaining_ms = max(0, math.ceil((deadline - time.monotonic()) * 1000))
            ready = dict(self._poller.poll(remaining_ms))
            if self._wake_read in ready:
                os.read(self._wake_read, 4096)  # every wake-up so far is answered by this return
                return None
            if self._inbox in ready:
                received = self._receive()
                if received is not None:
                    return received
                continue
            for monitor, peer in self._monitors.items():
                if monitor in ready:
                    event = zmq.utils.monitor.recv_monitor_message(monitor)["event"]
                    return LinkEvent(peer, up=event != zmq.EVENT_DISCONNECTED)
            if time.monotonic() >= deadline:
                return None

    def _receive(self) -> Received | None:
        frames = self._inbox.recv_multipart(copy=False)
        if len(frames) != 3:
            self.rejected["frame_count"] += 1
            return None
        identity, header, payload = frames
        if self._curve is None:
            sender, role = identity.bytes.decode("utf-8", "replace"), None
        else:
            known = self._curve.sender(header.get("User-Id"))
            if known is None:  # the ZAP handler admits only allow-listed keys: this cannot happen
                self.rejected["unknown_sender"] += 1
                return None
            sender, role = known
        return Received(sender, role, header.bytes, payload.bytes)

    def wake(self) -> None:
        with self._wake_lock, contextlib.suppress(BlockingIOError):  # full: a wake-up is pending already
            if not self._closed:
                os.write(self._wake_write, b"\0")

    def close(self) -> None:
        with self._wake_lock:
            self._closed = True
            os.close(self._wake_read)
            os.close(self._wake_write)
        for socket in self._peers.values():
            socket.disable_monitor()
            socket.close()
        for monitor in self._monitors:
            monitor.close()
        self._inbox.close()
        if self._curve:
            self._curve.close()


class MemoryHub:
    """The in-process network: one FIFO mailbox per address; each address has the role it was given, as
    if a key had proven it."""

    def __init__(self) -> None:
        self.mailboxes: dict[str, deque[Received]] = {}
        self.roles: dict[str, str | None] = {}

    def connector(self, address: str, role: str | None = None) -> MemoryConnector:
        self.mailboxes[address] = deque()
        self.roles[address] = role
        return MemoryConnector(self, address)


class MemoryConnector(Connector):
    def __init__(self, hub: MemoryHub, address: str) -> None:
        super().__init__()
        self.hub = hub
        self.address = address
        self.secure = hub.roles[address] is not None

    def role_of(self, peer: str) -> str | None:
        return self.hub.roles.get(peer)

    def send(self, peer: str, message: Msg) -> bool:
        """An in-process mailbox has no bound: always queued."""
        header, payload = encode(message)
        self.hub.mailboxes[peer].append(Received(self.address, self.hub.roles[self.address], header, payload))
        return True

    def inject(self, peer: str, header: bytes, payload: bytes = b"") -> None:
        """Put raw frames in a peer's mailbox as this node (tests: malformed or forged messages)."""
        self.hub.mailboxes[peer].append(Received(self.address, self.hub.roles[self.address], header, payload))

    def recv(self, timeout_s: float) -> Received | LinkEvent | None:
        mailbox = self.hub.mailboxes[self.address]
        return mailbox.popleft() if mailbox else None
