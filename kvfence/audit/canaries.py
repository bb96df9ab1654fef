"""The cross-tenant canary scan: canaries a small model repeats, planted by every tenant, and a scan of
every answer for another tenant's.

A canary is `CANARY-` and 12 random decimal digits. Its prompt (`victim_prompt`, a raw completion) holds
it in many identical records and ends at the start of one more, so the greedy continuation is the canary,
copied from the context: SmolLM2-135M echoed its own in 12 of 12 offline tries and 10 of 10 answered
plants of a clean audit, and a request that reads another tenant's such KV instead of its own (stale
pages under `read_beyond_written`, measured offline) copies that tenant's canary 5/6 times, a 7-digit run
of it 6/6. Every plant is at once a victim (its pages hold its canary) and an attacker (its continuation
copies whatever records precede it). Plants: one per tenant alone (`plant_alone`), the replay's long
prompts (replay.py), and rounds of concurrent plants, dropped plants and over-long requests
(`plant_concurrently`).

The positive control: the share of answered plants that echo their own canary. Below
POSITIVE_CONTROL_MIN the model does not copy, so the absence of a leak proves nothing: INCONCLUSIVE, with
the measured rate. A clean scan is a PASS only where the replay check backs it (replay.py: the server
declares batch invariance, or the near-tie oracle passed its answers); elsewhere INCONCLUSIVE, since
canaries alone prove no isolation. A leak is a FAIL everywhere. HTTP only (client.py): no torch.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvfence.audit.client import MAX_WORKERS, Exchange, ProbeClient
from kvfence.audit.result import CheckResult, inconclusive, verdict

CANARY_PREFIX = "CANARY-"
CANARY_DIGITS = 12
FRAGMENT_DIGITS = 7  # a run of this many canary digits in another tenant's answer counts as a leak
RECORDS = 10  # records in a planted prompt (about 200 tokens in SmolLM2's vocabulary)
PLANT_MAX_TOKENS = 16
PLANT_ATTEMPTS = (
    3  # tries of an answered plant the fence aborts (each abort leaves the control a sample short)
)
CANARY_ROUNDS = 2
POSITIVE_CONTROL_MIN = 0.9
POSITIVE_CONTROL_SAMPLES = 4  # answered plants needed before the rate means anything
DEFAULT_TOKENS_PER_RECORD = 24.0  # when no plant reported its usage (a generous guess: prompts stay short)
_DIGIT_RUN = re.compile(rf"\d{{{FRAGMENT_DIGITS},}}")


def new_canary() -> str:
    return CANARY_PREFIX + "".join(str(secrets.randbelow(10)) for _ in range(CANARY_DIGITS))


def victim_prompt(canary: str, records: int = RECORDS) -> str:
    """`records` identical records holding `canary`, then the start of one more: the natural continuation
    is the canary's digits, copied from whatever records the request attends to."""
    lines = [f"Record {i}: code {canary}" for i in range(1, records + 1)]
    return "\n".join(lines) + f"\nRecord {records + 1}: code {CANARY_PREFIX}"


def plant(
    client: ProbeClient,
    label: str,
    key: int,
    records: int = RECORDS,
    drop: bool = False,
    attempts: int = 1,
) -> Exchange:
    """One planted canary (a raw completion: a chat template would answer instead of copying); `drop`:
    a stream closed after its first event; `attempts`: sent again while the fence aborts it."""
    canary = new_canary()
    prompt = victim_prompt(canary, records)
    for _ in range(attempts):
        if drop:
            exchange = client.stream_and_drop(label, key, "completions", prompt, PLANT_MAX_TOKENS)
        else:
            exchange = client.send(label, key, "completions", prompt, PLANT_MAX_TOKENS)
        exchange.planted = canary
        if not exchange.fenced:
            break
    return exchange


def plant_alone(client: ProbeClient) -> None:
    """Each tenant plants one canary, one request at a time (the positive control's cleanest samples)."""
    for key in range(len(client.target.api_keys)):
        plant(client, "canary:alone", key, attempts=PLANT_ATTEMPTS)


def plant_concurrently(client: ProbeClient, overlong_prompt: str, rounds: int = CANARY_ROUNDS) -> None:
    """Each round, every tenant plants a fresh canary (one answered request, one stream dropped after its
    first event) while every tenant also sends an over-long request, all concurrently."""
    keys = range(len(client.target.api_keys))
    for _ in range(rounds):
        with ThreadPoolExecutor(min(MAX_WORKERS, 3 * len(keys))) as pool:
            jobs = [
                pool.submit(plant, client, "canary:plant", key, RECORDS, False, PLANT_ATTEMPTS)
                for key in keys
            ]
            jobs += [pool.submit(plant, client, "canary:dropped", key, RECORDS, True) for key in keys]
            jobs += [
                pool.submit(client.send, "canary:overlong", key, "completions", overlong_prompt, 16)
                for key in keys
            ]
            for job in jobs:
                job.result()


def tokens_per_record(exchanges: list[Exchange]) -> float:
    """Prompt tokens per record, from the usage of answered plants of RECORDS records."""
    counts = [
        e.prompt_tokens / (RECORDS + 1)
        for e in exchanges
        if e.planted and e.label.startswith("canary:") and e.prompt_tokens and not e.cancelled
    ]
    return max(counts) if counts else DEFAULT_TOKENS_PER_RECORD


def records_for(tokens: int, per_record: float) -> int:
    """The most records whose prompt stays within `tokens` (at least RECORDS)."""
    return max(RECORDS, int(tokens / per_record) - 2)


# ---- the scan ---------------------------------------------------------------------------------------


def canary_fragments(canary: str) -> Iterator[str]:
    """Every run of FRAGMENT_DIGITS digits of the canary (a partial echo is still a leak)."""
    digits = canary.removeprefix(CANARY_PREFIX)
    for start in range(len(digits) - FRAGMENT_DIGITS + 1):
        yield digits[start : start + FRAGMENT_DIGITS]


def echoes_own(exchange: Exchange) -> bool:
    return bool(exchange.planted) and str(exchange.planted).removeprefix(CANARY_PREFIX) in exchange.text


def positive_control(exchanges: list[Exchange]) -> dict[str, Any]:
    """How many answered plants echo their own canary (aborted, dropped or refused plants do not count)."""
    answered = [e for e in exchanges if e.planted and e.outcome == "answer"]
    echoed = sum(echoes_own(e) for e in answered)
    rate = echoed / len(answered) if answered else 0.0
    return {
        "answered": len(answered),
        "echoed": echoed,
        "rate": round(rate, 3),
        "required": POSITIVE_CONTROL_MIN,
    }


def _leaks(exchanges: list[Exchange], planted: list[tuple[int, str]]) -> list[dict[str, Any]]:
    problems = []
    for exchange in exchanges:
        runs = _DIGIT_RUN.findall(exchange.text)
        if not runs:
            continue
        for key, canary in planted:
            if key != exchange.key_index and any(f in run for run in runs for f in canary_fragments(canary)):
                problems.append(
                    {
                        "problem": f"key #{exchange.key_index}'s answer holds key #{key}'s canary {canary}",
                        "canary": canary,
                        **exchange.summary(),
                    }
                )
    return problems


def scan_canaries(exchanges: list[Exchange], backed: bool) -> CheckResult:
    """No answer (or partial stream) of any tenant may contain a fragment of another tenant's canary: FAIL
    when one does. Otherwise PASS only when the positive control holds and the replay check `backed` it
    (the exact oracle's pin, or a near-tie PASS); else INCONCLUSIVE, saying why."""
    planted = [(e.key_index, str(e.planted)) for e in exchanges if e.planted]
    tenants = len({key for key, _ in planted})
    if tenants < 2:
        return CheckResult("canary_scan", None, "needs canaries from at least two tenants (API keys)")
    control = positive_control(exchanges)
    ids = [e.request_id for e in exchanges if e.request_id and e.planted]
    facts = {
        "planted": len(planted),
        "tenants": tenants,
        "scanned": len(exchanges),
        "positive_control": control,
    }
    problems = _leaks(exchanges, planted)
    seen = (
        f"{len(planted)} canaries planted by {tenants} tenants, none in another tenant's answer "
        f"({len(exchanges)} scanned); positive control {control['echoed']}/{control['answered']} echoed "
        f"their own"
    )
    if problems:
        result = verdict("canary_scan", problems, "", ids)
    elif control["answered"] < POSITIVE_CONTROL_SAMPLES:
        why = f"too few answered plants for a positive control (needs {POSITIVE_CONTROL_SAMPLES})"
        result = inconclusive("canary_scan", f"{seen}: {why}", [], ids)
    elif control["rate"] < POSITIVE_CONTROL_MIN:
        why = (
            f"below the {POSITIVE_CONTROL_MIN:.0%} needed: the model does not copy, so seeing no leak proves "
        )
        why += "nothing"
        result = inconclusive("canary_scan", f"{seen} ({control['rate']:.0%}), {why}", [], ids)
    elif not backed:
        why = "but no replay backs this (the server declares no batch invariance and the near-tie oracle "
        why += "did not pass its answers), and canaries alone prove nothing"
        result = inconclusive("canary_scan", f"{seen}; {why}", [], ids)
    else:
        result = verdict("canary_scan", [], seen, ids)
    result.evidence.insert(0, facts)
    return result
