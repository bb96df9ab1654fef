"""Black-box probes of any OpenAI-compatible server: only HTTP, no audit trail, no engine internals.

Every probe sends a bounded number of requests with bounded timeouts through a `ProbeClient` (client.py)
and returns a `CheckResult` (result.py). Every request and what came back is kept as an `Exchange` on the
client, so later checks (the canary scan, status consistency, the white-box acceptance checks in checks.py)
can read every answer of every tenant.

The probes, in this order (`run_probes`):
- boundary: find, by galloping then bisecting the prompt length, where the server starts refusing;
  requests inside, at and beyond it must be a full normal answer or a clear 4xx, never a 5xx (other than
  the fence's kv_integrity_error, retried and reported) or a 200 with empty or garbled content;
- cancellation storm: open streams and drop them after the first chunk, drop others before any answer,
  then the server must still answer normally;
- canaries (canaries.py): each tenant plants one alone (the positive control), later more concurrently
  with over-long and dropped requests; no answer of any tenant may contain (a fragment of) another
  tenant's canary;
- replay (replay.py): greedy prompts alone, then under churn (its long prompts are canary victims): every
  answer must be the same; FAIL or INCONCLUSIVE depending on whether the server declares batch invariance;
- recovery: a normal request per tenant succeeds after the storms;
- prefix timing (prefix_timing.py): a tenant's first token on another tenant's cached prefix comes at a
  computation's speed, not a cache hit's;
- status consistency: 200 means non-empty choices with a finish_reason, an error means no choices.

An integrity abort (`Exchange.fenced`) fails no probe: with a fault armed it is the fence doing its job;
the probes report how many they saw.

Probes target only loopback or private test deployments (`check_test_address` in client.py): never run
them against somebody else's production service.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from kvfence.audit import canaries
from kvfence.audit.client import MAX_WORKERS, Exchange, ProbeClient, Target, answered
from kvfence.audit.prefix_timing import probe_prefix_timing
from kvfence.audit.replay import LONG_FRACTION, LONG_MAX_TOKENS, run_replay
from kvfence.audit.result import CheckResult, verdict

BOUNDARY_MAX_TOKENS = 4
MAX_SEARCH_REQUESTS = 32  # boundary search budget (each request is one prompt length)
MAX_REPS = 2**17  # no boundary below ~128k prompt words: the probe gives up
STORM_STREAMS = 6
STORM_EARLY_DROPS = 2
ATTEMPTS = 3  # tries of a boundary length the server fails or the fence aborts
DEFAULT_WINDOW = 512  # tokens assumed for the replay's long prompts when nothing says otherwise
_REQUESTED = re.compile(r"requested (\d+) tokens")
Progress = Callable[[str], None]


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
        """The verdict for a `reps`-word prompt; a 5xx or broken answer is retried (an intermittent failure
        should not hide the boundary; a failed exchange other than a fence abort still fails the probe)."""
        for _ in range(ATTEMPTS):
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
        if e.outcome not in ("answer", "refused") and not e.fenced
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
        f"{boundary.refused_total}; inside/at answered, beyond/far a clean 4xx{_fenced(exchanges)}"
        if boundary
        else ""
    )
    return verdict("boundary", problems, ok, ids)


def _fenced(exchanges: list[Exchange]) -> str:
    aborts = sum(e.fenced for e in exchanges)
    return f"; {aborts} aborted by the fence (kv_integrity_error)" if aborts else ""


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
    after = answered(lambda: client.send("storm:after", 0, "completions", "The capital of France is", 8))
    problems = [
        {"problem": f"{e.label}: {'; '.join(e.problems()) or e.outcome}", **e.summary()}
        for e in [*sent, after]
        if e.outcome == "broken" or (e.outcome == "aborted" and not e.fenced)
    ]
    if after.outcome != "answer" and not problems:
        problems.append({"problem": f"after the storm: {after.outcome}", **after.summary()})
    dropped = sum(e.cancelled for e in sent)
    ids = [e.request_id for e in [*sent, after] if e.request_id]
    ok = f"{dropped} requests dropped mid-stream or early; then answered{_fenced(sent)}"
    return verdict("cancel_storm", problems, ok, ids)


def _unique(prompt: str) -> str:
    return f"[{secrets.token_hex(8)}] {prompt}"


# ---- recovery and consistency -----------------------------------------------------------------------


def probe_recovery(client: ProbeClient) -> CheckResult:
    """After everything else: one normal request per tenant, on both endpoints, must be answered."""
    sent = [
        answered(
            lambda key=key: client.send(
                "recovery", key, "chat" if key % 2 else "completions", "Name three colors.", 8
            )
        )
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


PROBE_STEPS = (
    "boundary",
    "cancel_storm",
    "canaries",
    "replay",
    "canaries",
    "recovery",
    "prefix_timing",
    "scan",
)


def run_probes(
    target: Target, window_hint: int | None, progress: Progress = lambda _: None, declared: bool = False
) -> ProbeRun:
    """Every probe, in order, against `target` (needs at least two API keys for the canary scan).
    `declared`: the server pins batch invariance (replay.declares_batch_invariance)."""
    client = ProbeClient(target)
    try:
        progress("boundary")
        boundary_result, boundary = probe_boundary(client, window_hint)
        progress("cancel_storm")
        storm = probe_cancel_storm(client)
        progress("canaries")
        canaries.plant_alone(client)
        progress("replay")
        window = boundary.accepted_total if boundary else window_hint or DEFAULT_WINDOW
        replay, _ = run_replay(client, _long_prompts(client, window), declared)
        progress("canaries")
        overlong = 2 * boundary.reps_refused + 64 if boundary else 4 * (window_hint or 4096)
        canaries.plant_concurrently(client, filler(min(overlong, MAX_REPS)))
        progress("recovery")
        recovery = probe_recovery(client)
        progress("prefix_timing")
        timing = probe_prefix_timing(client, window)
        progress("scan")
        exchanges = list(client.exchanges)
        scan = canaries.scan_canaries(exchanges, declared or replay.passed is True)
        results = [boundary_result, storm, scan, replay, recovery, timing, check_consistency(exchanges)]
        return ProbeRun(results, boundary, exchanges)
    finally:
        client.close()


def _long_prompts(client: ProbeClient, window: int) -> list[tuple[str, str]]:
    """Per tenant, the replay's long probe: a canary victim of about LONG_FRACTION of the window (sized by
    the tokens per record the lone plants reported), and its canary."""
    budget = int(LONG_FRACTION * window) - LONG_MAX_TOKENS
    records = canaries.records_for(budget, canaries.tokens_per_record(client.exchanges))
    canaries_ = [canaries.new_canary() for _ in client.target.api_keys]
    return [(canaries.victim_prompt(canary, records), canary) for canary in canaries_]
