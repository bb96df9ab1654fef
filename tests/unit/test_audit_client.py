"""The audit client against a server that closes a connection without answering (what a kept-alive
connection meets when the server's keep-alive timer fires as a request goes out): one retry on a fresh
connection, for whole answers and for streams dropped after their first event; a second failure stays a
transport error."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from kvfence.audit.client import ProbeClient, Target

_EVENT = b'data: {"id": "cmpl-1", "choices": [{"index": 0, "text": "hi", "finish_reason": null}]}\n\n'
_STREAM = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nx-request-id: r-1\r\n"
    b"transfer-encoding: chunked\r\n\r\n" + b"%x\r\n" % len(_EVENT) + _EVENT + b"\r\n0\r\n\r\n"
)
_BODY = b'{"id": "cmpl-1", "choices": [{"index": 0, "text": "hi", "finish_reason": "stop"}]}'
_ANSWER = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(_BODY) + _BODY
)


class DroppingServer:
    """Answers each HTTP request on loopback with `answer`, one per connection; the first `drops`
    connections are closed after the request arrives, with no byte sent back."""

    def __init__(self, drops: int, answer: bytes) -> None:
        self.drops = drops
        self.answer = answer
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                self.connections += 1
                if self.connections > self.drops:
                    conn.sendall(self.answer)


@pytest.fixture
def dropping(request: pytest.FixtureRequest) -> Iterator[tuple[DroppingServer, ProbeClient]]:
    server = DroppingServer(*request.param)
    client = ProbeClient(Target(server.url, ("k",), "m", timeout_s=10.0))
    yield server, client
    client.close()
    server.sock.close()


@pytest.mark.parametrize("dropping", [(1, _ANSWER)], indirect=True)
def test_an_unanswered_connection_is_retried_once_for_a_whole_answer(dropping) -> None:
    server, client = dropping
    exchange = client.send("t", 0, "completions", "hello", 4)
    assert (exchange.status, exchange.text, exchange.finish_reason) == (200, "hi", "stop")
    assert exchange.transport_error is None and exchange.problems() == []
    assert server.connections == 2


@pytest.mark.parametrize("dropping", [(1, _STREAM)], indirect=True)
def test_an_unanswered_connection_is_retried_once_for_a_dropped_stream(dropping) -> None:
    server, client = dropping
    exchange = client.stream_and_drop("t", 0, "completions", "hello", 4)
    assert (exchange.status, exchange.request_id, exchange.text) == (200, "r-1", "hi")
    assert exchange.cancelled and exchange.outcome == "dropped"
    assert server.connections == 2


@pytest.mark.parametrize("dropping", [(2, _STREAM)], indirect=True)
def test_a_second_unanswered_connection_stays_a_transport_error(dropping) -> None:
    server, client = dropping
    exchange = client.stream_and_drop("t", 0, "completions", "hello", 4)
    assert exchange.status is None and "RemoteProtocolError" in (exchange.transport_error or "")
    assert exchange.outcome == "broken"
    assert server.connections == 2
