"""KV transfer transport: a mailbox per node, point-to-point, ordered per sender.

Every node (router, prefill worker, decode worker) owns one address. `send(peer, message)` delivers to the
peer's mailbox; `recv()` returns (sender address, message). Messages from one sender to one receiver
arrive in the order sent — the handoff protocol relies on it: an abort-ack sent after the last page
proves that no page of that request is still on the way.

Two backends: `ZmqConnector` (pyzmq over TCP, for real processes and hosts) and `MemoryConnector`
(in-process, deterministic, for tests that need exact message interleavings). A message is a JSON header
plus an optional binary payload (page bytes); nothing received is ever unpickled.
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.utils.monitor

PEER_DOWN = "peer_down"  # synthetic message: the connection to `fields["peer"]` was lost
PEER_UP = "peer_up"  # synthetic message: the connection to `fields["peer"]` is (re)established


@dataclass
class Message:
    kind: str
    fields: dict[str, Any] = field(default_factory=dict)
    payload: bytes = b""


class Connector(ABC):
    address: str

    @abstractmethod
    def send(self, peer: str, message: Message) -> None: ...

    @abstractmethod
    def recv(self, timeout_s: float) -> tuple[str, Message] | None:
        """The next message, or None after `timeout_s` seconds without one."""

    def close(self) -> None:
        return None


class ZmqConnector(Connector):
    """A bound ROUTER socket receives; one DEALER per peer sends, its identity being our own address so the
    receiver knows the sender. A monitor on each DEALER reports the TCP connection as PEER_UP / PEER_DOWN
    (a DEALER reconnects by itself, so a restarted peer comes back as PEER_UP)."""

    def __init__(self, bind: str, context: zmq.Context[Any] | None = None) -> None:
        self._context = context or zmq.Context.instance()
        self._inbox = self._context.socket(zmq.ROUTER)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.bind(bind)
        self.address = self._inbox.getsockopt_string(zmq.LAST_ENDPOINT)
        self._peers: dict[str, zmq.Socket[Any]] = {}
        self._monitors: dict[zmq.Socket[Any], str] = {}
        self._poller = zmq.Poller()
        self._poller.register(self._inbox, zmq.POLLIN)

    def connect(self, peer: str) -> None:
        """Open (once) the outgoing connection to `peer`; its loss is reported as PEER_DOWN."""
        if peer in self._peers:
            return
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt_string(zmq.IDENTITY, self.address)
        monitor = socket.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        socket.connect(peer)
        self._peers[peer] = socket
        self._monitors[monitor] = peer
        self._poller.register(monitor, zmq.POLLIN)

    def send(self, peer: str, message: Message) -> None:
        self.connect(peer)
        header = json.dumps({"kind": message.kind, **message.fields}).encode()
        self._peers[peer].send_multipart([header, message.payload], copy=False)

    def recv(self, timeout_s: float) -> tuple[str, Message] | None:
        deadline = time.monotonic() + timeout_s
        while True:
            remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
            ready = dict(self._poller.poll(remaining_ms))
            if self._inbox in ready:
                sender, header, payload = self._inbox.recv_multipart()
                fields = json.loads(header)
                return sender.decode(), Message(fields.pop("kind"), fields, payload)
            for monitor, peer in self._monitors.items():
                if monitor in ready:
                    event = zmq.utils.monitor.recv_monitor_message(monitor)["event"]
                    kind = PEER_DOWN if event == zmq.EVENT_DISCONNECTED else PEER_UP
                    return peer, Message(kind, {"peer": peer})
            if not ready and time.monotonic() >= deadline:
                return None

    def close(self) -> None:
        for socket in self._peers.values():
            socket.disable_monitor()
            socket.close()
        for monitor in self._monitors:
            monitor.close()
        self._inbox.close()


class MemoryHub:
    """The in-process network: one FIFO mailbox per address."""

    def __init__(self) -> None:
        self.mailboxes: dict[str, deque[tuple[str, Message]]] = {}

    def connector(self, address: str) -> MemoryConnector:
        self.mailboxes[address] = deque()
        return MemoryConnector(self, address)


class MemoryConnector(Connector):
    def __init__(self, hub: MemoryHub, address: str) -> None:
        self.hub = hub
        self.address = address

    def send(self, peer: str, message: Message) -> None:
        self.hub.mailboxes[peer].append((self.address, message))

    def recv(self, timeout_s: float) -> tuple[str, Message] | None:
        mailbox = self.hub.mailboxes[self.address]
        return mailbox.popleft() if mailbox else None
