"""The audit's HTTP side, and its HTTP-only entry: it imports neither torch nor the engine.

- `ProbeClient` sends a target's requests (one API key per tenant) and records every one, with what came
  back, as an `Exchange`, which the probes (probes.py) and the acceptance checks (checks.py) then read;
- `AuditReader` makes the admin reads of one kvfence server: request trails, `/v1/audit/info` and
  `/metrics`; `collect_trails` and `wait_for_drained_pool` poll it until the audit's requests are over;
- `discover` reads the model a server lists and its advertised window.

Probes target only loopback or private test deployments (`check_test_address`): never run them against
somebody else's production service.
"""

from __future__ import annotations

import ipaddress
import json
import re
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvfence.audit.tokens import Step, logprobs_request, read_steps
from kvfence.audit.trail import PoolState, Trail, pool_state, settled
from kvfence.harness.sse import MalformedEvent, decode_event

EARLY_DROP_S = 0.05  # read timeout of a request dropped before any answer
MAX_WORKERS = 16  # requests any probe has in flight at once
_GARBLED = re.compile(r"[\ufffd\x00-\x08\x0b\x0c\x0e-\x1f]")
SETTLE_TIMEOUT_S = 20.0  # how long trails and the pool may take to reach their final state
RECOVERY_ATTEMPTS = 8  # tries of a normal request the fence aborts (with a fault armed at 0.5: 1/256 fail)


# ---- exchanges -------------------------------------------------------------------------------------


@dataclass
class Exchange:
    """One request and what came back. `status` None: no HTTP answer (dropped by us, or a transport
    error). For a stream, `text` is every content delta received and `error_*` an SSE error event."""

    label: str  # the probe and role, e.g. "boundary:at", "canary:plant"
    key_index: int  # which API key (tenant) sent it
    endpoint: str  # "completions" or "chat"
    stream: bool
    prompt_words: int
    max_tokens: int
    status: int | None = None
    request_id: str | None = None
    text: str = ""
    choices: int = 0
    finish_reason: str | None = None
    error_type: str | None = None
    error_code: str | None = None
    error_message: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cancelled: bool = False  # dropped by the probe on purpose
    transport_error: str | None = None
    planted: str | None = None  # the canary this request planted
    elapsed_s: float = 0.0
    steps: list[Step] | None = None  # the answer's tokens and their logprobs, where asked for and given

    @property
    def has_error(self) -> bool:
        return self.error_type is not None or self.error_message is not None

    @property
    def fenced(self) -> bool:
        """Aborted by the server's KV fence (500 or SSE error `kv_integrity_error`): no content, by design."""
        return self.error_type == "kv_integrity_error"

    def problems(self) -> list[str]:
        """Why this exchange is not a clean answer, a clean refusal, a clean abort or a deliberate drop."""
        if self.cancelled:
            return []
        if self.status is None:
            return [f"no HTTP answer ({self.transport_error})"]
        if self.status != 200 or self.has_error:
            return self._error_problems()
        return self._answer_problems()

    def _error_problems(self) -> list[str]:
        """An error: an OpenAI error body, no choices (a stream may have sent content before its error
        event) and no normal finish_reason."""
        found = []
        if not self.has_error:
            found.append(f"HTTP {self.status} without an OpenAI error body")
        if self.choices and not self.stream:
            found.append(f"HTTP {self.status} error with {self.choices} choices")
        if self.finish_reason is not None:
            found.append(f"error with a normal finish_reason {self.finish_reason!r}")
        return found

    def _answer_problems(self) -> list[str]:
        found = []
        if self.choices == 0:
            found.append("200 without choices")
        if self.finish_reason is None:
            found.append("200 without a finish_reason")
        if not self.text and self.finish_reason != "stop":
            found.append(f"200 with empty content (finish_reason {self.finish_reason!r})")
        if _GARBLED.search(self.text):
            found.append("200 with garbled content (replacement or control characters)")
        return found

    @property
    def outcome(self) -> str:
        """answer | refused (4xx) | aborted (5xx, or a stream's error event) | dropped | broken."""
        if self.cancelled:
            return "dropped"
        if self.problems():
            return "broken"
        if self.status == 200 and not self.has_error:
            return "answer"
        return "refused" if self.status is not None and 400 <= self.status < 500 else "aborted"

    def summary(self) -> dict[str, Any]:
        """The evidence form: short, JSON-ready."""
        return {
            "label": self.label,
            "key": self.key_index,
            "request_id": self.request_id,
            "status": self.status,
            "outcome": self.outcome,
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "finish_reason": self.finish_reason,
            "error": self.error_code or self.error_type,
            "text": self.text[:120],
        }


# ---- the client -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    url: str  # base URL without /v1, e.g. http://127.0.0.1:8000
    api_keys: tuple[str, ...]  # one per tenant
    model: str
    timeout_s: float = 120.0


def check_test_address(url: str) -> None:
    """ValueError unless `url` names a loopback or private (test) address: probes are for your own test
    deployments, never for somebody else's service."""
    host = httpx.URL(url).host
    if not host:
        raise ValueError(f"no host in {url!r}")
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError as exc:
        raise ValueError(f"cannot resolve {host!r}: {exc}") from exc
    for info in infos:
        ip = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if not (ip.is_loopback or ip.is_private or ip.is_link_local):
            raise ValueError(f"{host} ({ip}) is not a loopback or private test address; refusing to probe it")


class ProbeClient:
    """Sends requests to one target and records every one as an Exchange (thread-safe)."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.http = httpx.Client(base_url=target.url, timeout=target.timeout_s)
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()

    def close(self) -> None:
        self.http.close()

    def headers(self, key_index: int) -> dict[str, str]:
        return {"authorization": f"Bearer {self.target.api_keys[key_index]}"}

    def body(
        self, endpoint: str, prompt: str, max_tokens: int, stream: bool = False, logprobs: bool = False
    ) -> dict[str, Any]:
        """A greedy request for `prompt` (a chat with one user message, or a plain completion); with
        `logprobs`, asking for each token's log-probability and its best alternatives'."""
        body: dict[str, Any] = {"model": self.target.model, "max_tokens": max_tokens, "temperature": 0}
        if endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if logprobs:
            body |= logprobs_request(endpoint)
        return body | ({"stream": True} if stream else {})

    def send(
        self,
        label: str,
        key_index: int,
        endpoint: str,
        prompt: str,
        max_tokens: int,
        stream: bool = False,
        logprobs: bool = False,
    ) -> Exchange:
        """One request, read to the end. A connection that fails before any answer (a kept-alive
        connection the server closed) is retried once on a fresh one."""
        exchange = self._new(label, key_index, endpoint, prompt, max_tokens, stream)
        body = self.body(endpoint, prompt, max_tokens, stream, logprobs)
        for _ in range(2):
            exchange.transport_error = None
            timed = _Timed(exchange)
            with timed:
                self._request(exchange, endpoint, body, key_index)
            if not timed.unanswered:
                break
        return exchange

    def _request(self, exchange: Exchange, endpoint: str, body: dict[str, Any], key_index: int) -> None:
        headers = self.headers(key_index)
        if not exchange.stream:
            _read_body(exchange, self.http.post(_path(endpoint), json=body, headers=headers))
            return
        with self.http.stream("POST", _path(endpoint), json=body, headers=headers) as r:
            if r.status_code == 200:
                _read_head(exchange, r)
                _read_events(exchange, r.iter_lines())
            else:
                _read_body(exchange, r)

    def stream_and_drop(
        self, label: str, key_index: int, endpoint: str, prompt: str, max_tokens: int
    ) -> Exchange:
        """Open a stream, read its first data event, and close the connection (a client going away).
        A connection that fails before any answer is retried once on a fresh one, as in `send`."""
        exchange = self._new(label, key_index, endpoint, prompt, max_tokens, True)
        body = self.body(endpoint, prompt, max_tokens, stream=True)
        for _ in range(2):
            exchange.transport_error = None
            timed = _Timed(exchange)
            with timed:
                self._first_event(exchange, endpoint, body, key_index)
            if not timed.unanswered:
                break
        return exchange

    def _first_event(self, exchange: Exchange, endpoint: str, body: dict[str, Any], key_index: int) -> None:
        with self.http.stream("POST", _path(endpoint), json=body, headers=self.headers(key_index)) as r:
            _read_head(exchange, r)
            if r.status_code != 200:
                _read_body(exchange, r)
                return
            lines = r.iter_lines()
            first = next((line for line in lines if line.startswith("data:")), None)
            _read_events(exchange, [first] if first else [])
            exchange.cancelled = exchange.finish_reason is None and not exchange.has_error

    def drop_early(self, label: str, key_index: int, endpoint: str, prompt: str, max_tokens: int) -> Exchange:
        """Send a stream request and give up before any answer arrives (its request id stays unknown)."""
        exchange = self._new(label, key_index, endpoint, prompt, max_tokens, True)
        body = self.body(endpoint, prompt, max_tokens, stream=True)
        timeout = httpx.Timeout(self.target.timeout_s, read=EARLY_DROP_S)
        started = time.monotonic()
        try:
            with self.http.stream(
                "POST", _path(endpoint), json=body, headers=self.headers(key_index), timeout=timeout
            ) as r:
                _read_head(exchange, r)
                exchange.cancelled = True  # answered within the timeout: drop it right after the headers
        except httpx.TimeoutException:
            exchange.cancelled = True
        except httpx.HTTPError as exc:
            exchange.transport_error = f"{type(exc).__name__}: {exc}"
        exchange.elapsed_s = time.monotonic() - started
        return exchange

    def _new(
        self, label: str, key: int, endpoint: str, prompt: str, max_tokens: int, stream: bool
    ) -> Exchange:
        exchange = Exchange(label, key, endpoint, stream, len(prompt.split()), max_tokens)
        with self._lock:
            self.exchanges.append(exchange)
        return exchange


def answered(send: Callable[[], Exchange]) -> Exchange:
    """`send()` again while the fence aborts it (up to RECOVERY_ATTEMPTS): a normal request must get
    through."""
    exchange = send()
    for _ in range(RECOVERY_ATTEMPTS - 1):
        if not exchange.fenced:
            break
        exchange = send()
    return exchange


class _Timed:
    """Context: times the exchange and turns transport errors into `transport_error` (never raises them)."""

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange
        self.started = time.monotonic()
        self.unanswered = False  # the connection failed before any HTTP answer (worth one retry)

    def __enter__(self) -> Exchange:
        return self.exchange

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        self.exchange.elapsed_s = time.monotonic() - self.started
        if isinstance(exc, httpx.HTTPError):
            self.exchange.transport_error = f"{type(exc).__name__}: {exc}"
            network = isinstance(exc, httpx.NetworkError | httpx.RemoteProtocolError)
            self.unanswered = network and self.exchange.status is None
            return True
        return False


def _path(endpoint: str) -> str:
    return "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"


def _read_head(exchange: Exchange, response: httpx.Response) -> None:
    exchange.status = response.status_code
    # The server's own id is the first: a proxy in front (Ray Serve's) appends an id of its own after it.
    exchange.request_id = next(iter(response.headers.get_list("x-request-id")), None)


def _read_body(exchange: Exchange, response: httpx.Response) -> None:
    """A whole JSON body: an answer's choices and usage, or an error."""
    _read_head(exchange, response)
    try:
        data = json.loads(response.read() or b"null")
    except json.JSONDecodeError:
        data = None
    if not isinstance(data, dict):
        return
    exchange.request_id = exchange.request_id or data.get("id")
    _read_error(exchange, data.get("error"))
    choices = data.get("choices") or []
    exchange.choices = len(choices)
    if choices:
        exchange.text = _choice_text(choices[0])
        exchange.finish_reason = choices[0].get("finish_reason")
        exchange.steps = read_steps(choices[0])
    _read_usage(exchange, data.get("usage"))


def _read_events(exchange: Exchange, lines: Iterable[str]) -> None:
    """SSE `data:` events: content deltas, the finish_reason, usage, and error events."""
    for line in lines:
        try:
            event = decode_event(line)
        except MalformedEvent as exc:
            exchange.error_message = str(exc)
            continue
        if event is None:
            continue
        exchange.request_id = exchange.request_id or event.get("id")
        _read_error(exchange, event.get("error"))
        for choice in event.get("choices") or []:
            exchange.choices = max(exchange.choices, 1)
            exchange.text += _choice_text(choice)
            exchange.finish_reason = choice.get("finish_reason") or exchange.finish_reason
            if (steps := read_steps(choice)) is not None:
                exchange.steps = (exchange.steps or []) + steps
        _read_usage(exchange, event.get("usage"))


def _read_error(exchange: Exchange, error: object) -> None:
    if isinstance(error, dict):
        exchange.error_type = str(error.get("type"))
        exchange.error_code = error.get("code")
        exchange.error_message = str(error.get("message", ""))


def _read_usage(exchange: Exchange, usage: object) -> None:
    if isinstance(usage, dict):
        exchange.prompt_tokens = usage.get("prompt_tokens")
        exchange.completion_tokens = usage.get("completion_tokens")


def _choice_text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return str(choice["text"] or "")
    message = choice.get("message") or choice.get("delta") or {}
    return str(message.get("content") or "")


@dataclass(frozen=True)
class Served:
    """What GET /v1/models says of the first model it lists: its id, its advertised context window (None:
    not advertised) and whether it declares batch-invariant answers (kvfence's `batch_invariant`)."""

    model: str
    window: int | None
    batch_invariant: bool


def discover(url: str, api_key: str, timeout_s: float = 30.0) -> Served:
    """The first model the server lists, as a tenant sees it."""
    response = httpx.get(
        f"{url}/v1/models", headers={"authorization": f"Bearer {api_key}"}, timeout=timeout_s
    )
    response.raise_for_status()
    card = response.json()["data"][0]
    window = card.get("max_model_len") or card.get("context_length") or card.get("context_window")
    return Served(str(card["id"]), int(window) if window else None, card.get("batch_invariant") is True)


# ---- reading the server -----------------------------------------------------------------------------


class AuditError(RuntimeError):
    """The audit trail cannot be read (wrong admin key, not a kvfence server)."""


class AuditReader:
    """Admin reads of one kvfence server: request trails and /metrics."""

    def __init__(self, url: str, admin_key: str, timeout_s: float = 30.0) -> None:
        self.http = httpx.Client(
            base_url=url, timeout=timeout_s, headers={"authorization": f"Bearer {admin_key}"}
        )

    def close(self) -> None:
        self.http.close()

    def trail(self, request_id: str) -> Trail:
        """The request's events ([] when the server has none); AuditError when the key is refused."""
        response = self.http.get(f"/v1/audit/requests/{request_id}")
        if response.status_code == 404:
            return []
        if response.status_code != 200:
            raise AuditError(f"GET /v1/audit/requests/{request_id}: HTTP {response.status_code}")
        return list(response.json()["events"])

    def info(self) -> dict[str, Any] | None:
        """What the server reports pins it (GET /v1/audit/info); None when it has no such endpoint."""
        response = self.http.get("/v1/audit/info")
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise AuditError(f"GET /v1/audit/info: HTTP {response.status_code}")
        return dict(response.json())

    def metrics(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        """Sample name -> [(labels, value)]: a kvfence server reports one series per pool (`role`)."""
        samples: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
        for family in text_string_to_metric_families(self.http.get("/metrics").text):
            for sample in family.samples:
                samples[sample.name].append((dict(sample.labels), sample.value))
        return dict(samples)


def collect_trails(
    reader: AuditReader, request_ids: Iterable[str], timeout_s: float = SETTLE_TIMEOUT_S
) -> dict[str, Trail]:
    """Every request's trail, polled until it settled or `timeout_s` passed (unsettled ones as they are)."""
    pending, trails = set(request_ids), {}
    deadline = time.monotonic() + timeout_s
    while pending:
        for request_id in sorted(pending):
            trails[request_id] = reader.trail(request_id)
            if settled(trails[request_id]):
                pending.discard(request_id)
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return trails


def wait_for_drained_pool(reader: AuditReader, timeout_s: float = SETTLE_TIMEOUT_S) -> PoolState:
    """Poll /metrics until every page is free again (or the timeout): cancelled and aborted requests,
    including those dropped before their id was known, must give every page back."""
    started = time.monotonic()
    while True:
        state = pool_state(reader.metrics(), time.monotonic() - started)
        if state.drained or state.waited_s > timeout_s:
            return state
        time.sleep(0.2)
