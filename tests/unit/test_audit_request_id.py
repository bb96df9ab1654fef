"""The audit names a request by the server's own `x-request-id`, the first: Ray Serve's proxy appends an id
of its own after it (seen through `kvfence serve --ray-replicas`), which joined into one value named no
trail and failed rejection_terminates and recycle_timing against a fleet."""

from __future__ import annotations

import httpx

from kvfence.audit.client import Exchange, _read_body

ERROR = {"error": {"message": "too long", "type": "invalid_request_error", "code": "context_length_exceeded"}}


def test_the_servers_own_request_id_is_kept_when_a_proxy_appends_its_own() -> None:
    headers = [("x-request-id", "cmpl-kvfence"), ("x-request-id", "0d49d379-ray-proxy")]
    exchange = Exchange("boundary:beyond", 0, "completions", False, 4, 4)
    _read_body(exchange, httpx.Response(400, headers=headers, json=ERROR))
    assert exchange.request_id == "cmpl-kvfence" and exchange.error_code == "context_length_exceeded"


def test_one_request_id_or_none() -> None:
    for headers, expected in (([("x-request-id", "cmpl-1")], "cmpl-1"), ([], None)):
        exchange = Exchange("refused", 0, "completions", False, 4, 4)
        _read_body(exchange, httpx.Response(400, headers=headers, json=ERROR))
        assert exchange.request_id == expected
