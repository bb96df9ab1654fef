"""Black-box probes of any OpenAI-compatible server: only HTTP, no audit trail, no engine internals.

Every probe sends a bounded number of requests with bounded timeouts and returns a `CheckResult`
(name, passed, details, evidence). Every request and what came back is kept as an `Exchange` on the
`ProbeClient`, so later checks (the canary scan, status consistency, the white-box acceptance checks in
acceptance.py) can read every answer of every tenant.

The probes:
- boundary: find, by galloping then bisecting the prompt length, where the server starts refusing;
  requests inside, at and beyond it must be a full normal answer or a clear 4xx, never a 5xx or a 200
  with empty or garbled content;
- cancellation storm: open streams and drop them after the first chunk, drop others before any answer,
  then the server must still answer normally;
- canary scan: every tenant plants a unique random canary while over-long and cancelled requests run
  concurrently; no answer of any tenant may contain (a fragment of) another tenant's canary;
- recovery: a normal request per tenant succeeds after the storms;
- status consistency: 200 means non-empty choices with a finish_reason, an error means no choices.

Probes target only loopback or private test deployments (`check_test_address`): never run them against
somebody else's production service.
"""

from __future__ import annotations

import ipaddress
import json
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

CANARY_PREFIX = "CANARY-"
CANARY_HEX_CHARS = 16
FRAGMENT_CHARS = 8  # a run of this many canary hex digits in another tenant's answer counts as a leak
BOUNDARY_MAX_TOKENS = 4
MAX_SEARCH_REQUESTS = 32  # boundary search budget (each request is one prompt length)
MAX_REPS = 2**17  # no boundary below ~128k prompt words: the probe gives up
STORM_STREAMS = 6
STORM_EARLY_DROPS = 2
EARLY_DROP_S = 0.05  # read timeout of a request dropped before any answer
CANARY_ROUNDS = 2
MAX_WORKERS = 16
_GARBLED = re.compile(r"[\ufffd\x00-\x08\x0b\x0c\x0e-\x1f]")
_REQUESTED = re.compile(r"requested (\d+) tokens")
Progress = Callable[[str], None]


# ---- results ----------------------------------------------------------------------------------------


@dataclass
class CheckResult:
    """One probe's or check's verdict. `passed` None: not run (the reason is in `details`)."""

    name: str
    passed: bool | None
    details: str
    evidence: list[dict[str, Any]] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)  # requests to draw timelines for

    @property
    def status(self) -> str:
        return "SKIP" if self.passed is None else "PASS" if self.passed else "FAIL"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "status": self.status}


def verdict(name: str, problems: list[dict[str, Any]], ok: str, request_ids: list[str]) -> CheckResult:
    """PASS with `ok` when there are no problems; else FAIL naming the first one (all are evidence)."""
    if not problems:
        return CheckResult(name, True, ok, [], request_ids)
    first = problems[0].get("problem", "")
    more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
    return CheckResult(name, False, f"{first}{more}", problems, request_ids)


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

    @property
    def has_error(self) -> bool:
        return self.error_type is not None or self.error_message is not None

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

    def body(self, endpoint: str, prompt: str, max_tokens: int, stream: bool = False) -> dict[str, Any]:
        """A greedy request for `prompt` (a chat with one user message, or a plain completion)."""
        body: dict[str, Any] = {"model": self.target.model, "max_tokens": max_tokens, "temperature": 0}
        if endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body | ({"stream": True} if stream else {})

    def send(
        self, label: str, key_index: int, endpoint: str, prompt: str, max_tokens: int, stream: bool = False
    ) -> Exchange:
        """One request, read to the end. A connection that fails before any answer (a kept-alive
        connection the server closed) is retried once on a fresh one."""
        exchange = self._new(label, key_index, endpoint, prompt, max_tokens, stream)
        for _ in range(2):
            exchange.transport_error = None
            timed = _Timed(exchange)
            with timed:
                self._request(exchange, endpoint, self.body(endpoint, prompt, max_tokens, stream), key_index)
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
        """Open a stream, read its first data event, and close the connection (a client going away)."""
        exchange = self._new(label, key_index, endpoint, prompt, max_tokens, True)
        body = self.body(endpoint, prompt, max_tokens, stream=True)
        with (
            _Timed(exchange),
            self.http.stream("POST", _path(endpoint), json=body, headers=self.headers(key_index)) as r,
        ):
            _read_head(exchange, r)
            if r.status_code != 200:
                _read_body(exchange, r)
                return exchange
            lines = r.iter_lines()
            first = next((line for line in lines if line.startswith("data:")), None)
            _read_events(exchange, [first] if first else [])
            exchange.cancelled = exchange.finish_reason is None and not exchange.has_error
        return exchange

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
    exchange.request_id = response.headers.get("x-request-id")


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
    _read_usage(exchange, data.get("usage"))


def _read_events(exchange: Exchange, lines: Iterable[str]) -> None:
    """SSE `data:` events: content deltas, the finish_reason, usage, and error events."""
    for line in lines:
        payload = line.removeprefix("data:").strip()
        if not line.startswith("data:") or payload == "[DONE]":
            continue
        try:
            event = json.loads(payload)
        except json.JSONDecodeError:
            exchange.error_message = f"malformed SSE event: {payload[:80]}"
            continue
        if not isinstance(event, dict):
            continue
        exchange.request_id = exchange.request_id or event.get("id")
        _read_error(exchange, event.get("error"))
        for choice in event.get("choices") or []:
            exchange.choices = max(exchange.choices, 1)
            exchange.text += _choice_text(choice)
            exchange.finish_reason = choice.get("finish_reason") or exchange.finish_reason
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


def discover(url: str, api_key: str, timeout_s: float = 30.0) -> tuple[str, int | None]:
    """The first model the server lists and its advertised context window (None when not advertised)."""
    response = httpx.get(
        f"{url}/v1/models", headers={"authorization": f"Bearer {api_key}"}, timeout=timeout_s
    )
    response.raise_for_status()
    card = response.json()["data"][0]
    window = card.get("max_model_len") or card.get("context_length") or card.get("context_window")
    return str(card["id"]), int(window) if window else None


# ---- boundary ---------------------------------------------------------------------------------------


def filler(words: int) -> str:
    """A prompt of `words` words (one token each in common BPE vocabularies)."""
    return "hello" + " hello" * (words - 1)


@dataclass
class Boundary:
    """Where the server starts refusing, for prompts of repeated words and `max_tokens` completion."""

    max_tokens: int
    reps_accepted: int  # longest prompt (in words) answered
    reps_refused: int  # shortest prompt refused
    accepted_total: int  # prompt tokens + max_tokens of the longest answered request
    refused_total: int | None  # the same for the shortest refused one (from its error, else estimated)

    @property
    def exact(self) -> bool:
        return self.refused_total == self.accepted_total + 1

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "exact": self.exact}


class _Search:
    """Galloping then bisection over prompt lengths, within a request budget. `verdicts[reps]` is True
    (answered) or False (refused with a 4xx); a length with neither stops the search."""

    def __init__(self, client: ProbeClient, max_tokens: int) -> None:
        self.client = client
        self.max_tokens = max_tokens
        self.verdicts: dict[int, bool] = {}
        self.exchanges: dict[int, Exchange] = {}  # the exchange behind each verdict
        self.requests = 0

    def accepted(self, reps: int) -> bool | None:
        """The verdict for a `reps`-word prompt; a 5xx or broken answer is retried once (an intermittent
        failure should not hide the boundary; the failed exchange still fails the probe)."""
        for _ in range(2):
            if reps in self.verdicts or self.requests >= MAX_SEARCH_REQUESTS:
                break
            exchange = self.client.send("boundary:search", 0, "completions", filler(reps), self.max_tokens)
            self.requests += 1
            outcome = exchange.outcome
            if outcome in ("answer", "refused"):
                self.verdicts[reps], self.exchanges[reps] = outcome == "answer", exchange
        return self.verdicts.get(reps)

    def bracket(self, guess: int) -> tuple[int, int] | None:
        """(longest answered, shortest refused), adjacent, or None when the search failed or ran out."""
        first = self.accepted(guess)
        if first is None:
            return None
        edge, step = guess, 1
        while True:  # gallop away from the guess until the verdict flips
            nxt = min(MAX_REPS, edge + step) if first else max(1, edge - step)
            answer = None if nxt == edge else self.accepted(nxt)
            if answer is None:
                return None
            if answer is not first:
                break
            edge, step = nxt, step * 2
        lo, hi = (edge, nxt) if first else (nxt, edge)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            answer = self.accepted(mid)
            if answer is None:
                return None
            lo, hi = (mid, hi) if answer else (lo, mid)
        return lo, hi


def probe_boundary(
    client: ProbeClient, window_hint: int | None, max_tokens: int = BOUNDARY_MAX_TOKENS
) -> tuple[CheckResult, Boundary | None]:
    """Find the longest answered prompt, then check requests inside, at and beyond it: each must be a
    full answer or a clean 4xx, the boundary must be monotone, and nothing may be a 5xx or broken."""
    search = _Search(client, max_tokens)
    small = [search.accepted(8), search.accepted(16)]
    guess = _guess(search, window_hint, max_tokens) if small == [True, True] else 8
    found = search.bracket(guess)
    boundary = _boundary(search, found, max_tokens) if found else None
    if boundary is not None:
        search.exchanges[boundary.reps_accepted].label = "boundary:at"
        search.exchanges[boundary.reps_refused].label = "boundary:beyond"
        client.send(
            "boundary:inside", 0, "completions", filler(max(1, boundary.reps_accepted // 2)), max_tokens
        )
        far = filler(2 * boundary.reps_refused + 64)
        client.send("boundary:far", 0, "completions", far, max_tokens)
        client.send("boundary:far", 1 % len(client.target.api_keys), "chat", far, max_tokens)
    exchanges = [e for e in client.exchanges if e.label.startswith("boundary:")]
    return _boundary_verdict(exchanges, boundary, search), boundary


def _guess(search: _Search, window_hint: int | None, max_tokens: int) -> int:
    """Words for a prompt that should just fit the advertised window (from the 8- and 16-word probes'
    token counts), or 32 when the server advertises no window."""
    short, long = search.exchanges[8].prompt_tokens, search.exchanges[16].prompt_tokens
    if window_hint is None or short is None or long is None or long <= short:
        return 32
    per_word = (long - short) / 8
    overhead = short - 8 * per_word
    return max(1, int((window_hint - max_tokens - overhead) / per_word))


def _boundary(search: _Search, found: tuple[int, int], max_tokens: int) -> Boundary:
    lo, hi = found
    accepted, refused = search.exchanges[lo], search.exchanges[hi]
    prompt = accepted.prompt_tokens if accepted.prompt_tokens is not None else lo
    asked = _REQUESTED.search(refused.error_message or "")
    refused_total = int(asked.group(1)) if asked else prompt + max_tokens + round((hi - lo) * prompt / lo)
    return Boundary(max_tokens, lo, hi, prompt + max_tokens, refused_total)


def _boundary_verdict(exchanges: list[Exchange], boundary: Boundary | None, search: _Search) -> CheckResult:
    problems = [
        {
            "problem": f"{e.label} ({e.prompt_words} words): {'; '.join(e.problems()) or e.outcome}",
            **e.summary(),
        }
        for e in exchanges
        if e.outcome not in ("answer", "refused")
    ]
    answered = [r for r, v in search.verdicts.items() if v]
    refused = [r for r, v in search.verdicts.items() if v is False]
    if answered and refused and max(answered) > min(refused):
        problems.append({"problem": f"not monotone: {min(refused)} words refused, {max(answered)} answered"})
    expected = {"boundary:inside": "answer", "boundary:at": "answer", "boundary:beyond": "refused"}
    expected["boundary:far"] = "refused"
    for e in exchanges:
        want = expected.get(e.label)
        if want and e.outcome != want and e.outcome in ("answer", "refused"):
            problems.append({"problem": f"{e.label}: expected {want}, got {e.outcome}", **e.summary()})
    if boundary is None and not problems:
        problems.append({"problem": f"no boundary found within {search.requests} requests"})
    ids = [e.request_id for e in exchanges if e.request_id and e.label != "boundary:search"]
    ok = (
        f"answered up to {boundary.accepted_total} tokens (prompt+max_tokens), refused from "
        f"{boundary.refused_total}; inside/at answered, beyond/far a clean 4xx"
        if boundary
        else ""
    )
    return verdict("boundary", problems, ok, ids)


# ---- cancellation storm -----------------------------------------------------------------------------

COUNTING = "Count from 1 to 500, separated by commas: 1, 2, 3,"


def probe_cancel_storm(
    client: ProbeClient, streams: int = STORM_STREAMS, early: int = STORM_EARLY_DROPS
) -> CheckResult:
    """Open `streams` streams and drop each after its first event; send `early` more and drop them before
    any answer; then the server must answer a normal request."""
    keys = len(client.target.api_keys)
    with ThreadPoolExecutor(min(MAX_WORKERS, streams + early)) as pool:
        jobs = [
            pool.submit(client.stream_and_drop, "storm:stream", i % keys, "completions", COUNTING, 64)
            for i in range(streams)
        ]
        # A fresh first page for each early drop: their ids stay unknown, so nothing audited may share
        # their pages through the prefix cache.
        jobs += [
            pool.submit(client.drop_early, "storm:early", i % keys, "completions", _unique(COUNTING), 64)
            for i in range(early)
        ]
        sent = [job.result() for job in jobs]
    after = client.send("storm:after", 0, "completions", "The capital of France is", 8)
    problems = [
        {"problem": f"{e.label}: {'; '.join(e.problems()) or e.outcome}", **e.summary()}
        for e in [*sent, after]
        if e.outcome in ("broken", "aborted")
    ]
    if after.outcome != "answer" and not problems:
        problems.append({"problem": f"after the storm: {after.outcome}", **after.summary()})
    dropped = sum(e.cancelled for e in sent)
    ids = [e.request_id for e in [*sent, after] if e.request_id]
    return verdict(
        "cancel_storm", problems, f"{dropped} requests dropped mid-stream or early; then answered", ids
    )


def _unique(prompt: str) -> str:
    return f"[{secrets.token_hex(8)}] {prompt}"


# ---- canaries ---------------------------------------------------------------------------------------


def new_canary() -> str:
    return CANARY_PREFIX + secrets.token_hex(CANARY_HEX_CHARS // 2)


def canary_prompt(canary: str) -> str:
    """A prompt whose natural continuation is the canary's digits (so an echo of it is easy to see)."""
    return f"Remember the code {canary}. The code is {CANARY_PREFIX}"


def plant_canaries(client: ProbeClient, overlong_words: int, rounds: int = CANARY_ROUNDS) -> None:
    """Each round, every tenant plants a fresh canary (one answered request, one stream dropped after its
    first event) while every tenant also sends an over-long request, all concurrently."""
    keys = range(len(client.target.api_keys))
    for round_ in range(rounds):
        endpoint = "chat" if round_ % 2 else "completions"
        plants = [(key, new_canary(), new_canary()) for key in keys]
        with ThreadPoolExecutor(min(MAX_WORKERS, 3 * len(keys))) as pool:
            jobs = [pool.submit(_plant, client, key, endpoint, kept, 16) for key, kept, _ in plants]
            jobs += [
                pool.submit(_plant, client, key, endpoint, dropped, 32, True) for key, _, dropped in plants
            ]
            long = filler(overlong_words)
            jobs += [pool.submit(client.send, "canary:overlong", key, endpoint, long, 16) for key in keys]
            for job in jobs:
                job.result()


def _plant(
    client: ProbeClient, key: int, endpoint: str, canary: str, max_tokens: int, drop: bool = False
) -> Exchange:
    prompt = canary_prompt(canary)
    if drop:
        exchange = client.stream_and_drop("canary:dropped", key, endpoint, prompt, max_tokens)
    else:
        exchange = client.send("canary:plant", key, endpoint, prompt, max_tokens)
    exchange.planted = canary
    return exchange


def canary_fragments(canary: str) -> Iterator[str]:
    """Every run of FRAGMENT_CHARS digits of the canary (a partial echo is still a leak)."""
    digits = canary.removeprefix(CANARY_PREFIX)
    for start in range(len(digits) - FRAGMENT_CHARS + 1):
        yield digits[start : start + FRAGMENT_CHARS]


def scan_canaries(exchanges: list[Exchange]) -> CheckResult:
    """No answer (or partial stream) of any tenant may contain a fragment of another tenant's canary."""
    planted = [(e.key_index, e.planted) for e in exchanges if e.planted]
    if len({key for key, _ in planted}) < 2:
        return CheckResult("canary_scan", None, "needs canaries from at least two tenants (API keys)")
    problems = []
    for exchange in exchanges:
        text = exchange.text.lower()
        for key, canary in planted:
            if key != exchange.key_index and any(f in text for f in canary_fragments(canary)):
                problems.append(
                    {
                        "problem": f"key #{exchange.key_index}'s answer holds key #{key}'s canary {canary}",
                        "canary": canary,
                        **exchange.summary(),
                    }
                )
    echoed = sum(bool(e.planted and e.planted.removeprefix(CANARY_PREFIX) in e.text) for e in exchanges)
    tenants = len({key for key, _ in planted})
    ok = (
        f"{len(planted)} canaries planted by {tenants} tenants; none in another tenant's answer "
        f"({len(exchanges)} scanned, {echoed} echoed their own)"
    )
    ids = [e.request_id for e in exchanges if e.request_id and e.label.startswith("canary:")]
    return verdict("canary_scan", problems, ok, ids)


# ---- recovery and consistency -----------------------------------------------------------------------


def probe_recovery(client: ProbeClient) -> CheckResult:
    """After everything else: one normal request per tenant, on both endpoints, must be answered."""
    sent = [
        client.send("recovery", key, "chat" if key % 2 else "completions", "Name three colors.", 8)
        for key in range(len(client.target.api_keys))
    ]
    problems = [
        {"problem": f"key #{e.key_index}: {'; '.join(e.problems()) or e.outcome}", **e.summary()}
        for e in sent
        if e.outcome != "answer"
    ]
    return verdict(
        "recovery",
        problems,
        f"{len(sent)} normal requests answered",
        [e.request_id for e in sent if e.request_id],
    )


def check_consistency(exchanges: list[Exchange]) -> CheckResult:
    """Status vs content over every exchange: 200 => choices with a finish_reason and content;
    error => an OpenAI error body and no choices (a stream: an error event and no normal finish)."""
    problems = [
        {"problem": f"{e.label}: {'; '.join(e.problems())}", **e.summary()}
        for e in exchanges
        if e.outcome == "broken"
    ]
    counts: dict[str, int] = {}
    for e in exchanges:
        counts[e.outcome] = counts.get(e.outcome, 0) + 1
    ok = f"{len(exchanges)} exchanges consistent: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    return verdict("status_consistency", problems, ok, [])


# ---- all probes -------------------------------------------------------------------------------------


@dataclass
class ProbeRun:
    results: list[CheckResult]
    boundary: Boundary | None
    exchanges: list[Exchange]


PROBE_STEPS = ("boundary", "cancel_storm", "canaries", "recovery", "scan")


def run_probes(target: Target, window_hint: int | None, progress: Progress = lambda _: None) -> ProbeRun:
    """Every probe, in order, against `target` (needs at least two API keys for the canary scan)."""
    client = ProbeClient(target)
    try:
        progress("boundary")
        boundary_result, boundary = probe_boundary(client, window_hint)
        progress("cancel_storm")
        storm = probe_cancel_storm(client)
        progress("canaries")
        overlong = 2 * boundary.reps_refused + 64 if boundary else 4 * (window_hint or 4096)
        plant_canaries(client, min(overlong, MAX_REPS))
        progress("recovery")
        recovery = probe_recovery(client)
        progress("scan")
        exchanges = list(client.exchanges)
        results = [boundary_result, storm, scan_canaries(exchanges), recovery, check_consistency(exchanges)]
        return ProbeRun(results, boundary, exchanges)
    finally:
        client.close()
