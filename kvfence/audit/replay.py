"""The replay check: the same greedy prompts answered alone, then again under churn, must answer the same.

An output oracle for a server that answers from someone else's KV (a stale page, a page two requests
hold, another tenant's cached prefix): such an answer is built from the wrong context, so it changes, even
when a small model repeats no canary. The check, in a bounded number of requests (at most 8 x
SOLO_ATTEMPTS alone, then per wave 8 x LOAD_ATTEMPTS replays, a long prompt per tenant, WAVE_DROPS,
WAVE_TWINS and WAVE_SHORTS):

1. alone: each of REPLAY_PROMPTS (greedy, temperature 0, REPLAY_MAX_TOKENS), sent by one tenant in turn
   (prompt i by key i mod keys), one request at a time; a try the fence aborts (500 kv_integrity_error)
   is retried, up to SOLO_ATTEMPTS;
2. under churn, WAVES times, all at once: every prompt again (same tenant; a fence abort retried once,
   LOAD_ATTEMPTS), each tenant's long prompt near the window (a canary victim, canaries.py), streams
   dropped mid-flight, prefix twins (a probe's prompt plus another ending, sharing its pages) and short
   requests that recycle pages.

Every 200 under churn must equal its solo answer (text and finish_reason). A kv_integrity_error is no
mismatch (it is the fence doing its job) and is reported. The verdict depends on what the server declares
(in its GET /v1/models card; with the admin key, `declares_batch_invariance` of /v1/audit/info): a server
that pins `batch_invariant` FAILS on any change, naming the requests (and, with trails, the pages
they read: `name_pages`), and PASSES when at least MIN_COMPARED answers were compared and none changed;
against any other server a change may be its batch-dependent numerics, so the check reports the change
rate and is INCONCLUSIVE (as it is with fewer than MIN_COMPARED answers to compare).

REPLAY_PROMPTS are fixed: each continuation copies text from the prompt's first pages (so stale KV there
changes it: 8/8 changed under read_beyond_written, measured offline), and on SmolLM2-135M every greedy
step's top-2 logit gap is at least 0.016, far above the ~2e-5 by which kvfence's prefill numerics move
with chunking (tests/integration/test_replay.py checks the gaps). HTTP only (client.py): no torch.
"""

from __future__ import annotations

import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

from kvfence.audit.client import MAX_WORKERS, Exchange, ProbeClient
from kvfence.audit.confirm import confirm_departures
from kvfence.audit.neartie import Departure, Margin, departure, jitter
from kvfence.audit.replay_probe import Probe
from kvfence.audit.result import CheckResult, inconclusive
from kvfence.audit.trail import ENGINE, Trail, by_where, event_pages, tenant_of

REPLAY_PROMPTS: tuple[tuple[str, str], ...] = (
    (
        "completions",
        "Shopping list: eggs, milk, bread, apples, rice, cheese, butter, tomatoes, onions, coffee, sugar, "
        "pasta.\nThe same shopping list, copied exactly: eggs,",
    ),
    (
        "completions",
        "Guest list for the dinner on Friday: Alice Moreau, Bruno Lindqvist, Chiara Okafor, Dmitri Haddad, "
        "Elena Sato, Farid Novak.\nGuest list, copied exactly: Alice Moreau,",
    ),
    (
        "completions",
        "Inventory of the workshop: 12 hammers, 7 saws, 30 boxes of nails, 4 ladders, 9 drills, 15 "
        "clamps.\nInventory, copied exactly: 12 hammers,",
    ),
    (
        "completions",
        "Train timetable: Oslo 08:15, Hamar 09:40, Lillehammer 10:32, Otta 11:58, Dombas 12:41, Trondheim "
        "14:55.\nTimetable, copied exactly: Oslo 08:15,",
    ),
    (
        "chat",
        "Repeat this list exactly, then stop: red fox, blue whale, green turtle, yellow canary, black "
        "panther, white owl.",
    ),
    (
        "chat",
        "Repeat this sentence exactly: The lighthouse keeper counted forty-two ships passing the northern "
        "cape before dawn.",
    ),
    ("chat", "Copy these codes exactly, one per line: KX-4471, BR-2093, TM-8812, QL-5530, ZP-1187."),
    (
        "chat",
        "Repeat these words in the same order: anchor, meadow, violin, glacier, lantern, pepper, harbor, "
        "quartz.",
    ),
)
REPLAY_MAX_TOKENS = 24
SOLO_ATTEMPTS = 5  # tries alone of a prompt the fence aborts
LOAD_ATTEMPTS = 2  # tries under load of a prompt the fence aborts (while the wave's churn still runs)
BUSY_RETRIES = 5  # 503s (server busy: nothing started) a prompt under load is sent again after
BUSY_WAIT_S = 1.0
WAVES = 2
CALIBRATION_BATCHES = (2, 8)  # batch sizes the short probes are answered in without churn
WAVE_DROPS = 2
WAVE_TWINS = 2
WAVE_SHORTS = 6
LONG_FRACTION = 0.9  # a long prompt's size, as a share of the window
LONG_MAX_TOKENS = 16  # a long probe's answer: its canary's 12 digits and the next record's start
MIN_COMPARED = len(REPLAY_PROMPTS)  # answers under load compared with a solo one, before a PASS
DROP_PROMPT = "Write the numbers from 1 to 300 in words, separated by commas: one, two, three,"
# What a change means where the server does not pin batch invariance.
UNDECLARED = (
    "the server does not declare batch invariance (no `batch_invariant` pin in its /v1/models card or "
    "/v1/audit/info): a change can be its batch-dependent numerics as well as another tenant's KV, and "
    "no change does not prove isolation"
)


def declares_batch_invariance(info: dict[str, Any] | None) -> bool:
    """The server pins `batch_invariant: true` in every pool of its GET /v1/audit/info."""
    pools = (info or {}).get("pools") or {}
    return bool(pools) and all(pool.get("batch_invariant") is True for pool in pools.values())


def new_probes(keys: int, long_prompts: list[tuple[str, str]]) -> list[Probe]:
    """REPLAY_PROMPTS (prompt i by key i mod keys), then one long probe per (prompt, canary), by key."""
    probes = [
        Probe(i, i % keys, endpoint, prompt, REPLAY_MAX_TOKENS)
        for i, (endpoint, prompt) in enumerate(REPLAY_PROMPTS)
    ]
    for key, (prompt, canary) in enumerate(long_prompts):
        probes.append(Probe(len(probes), key, "completions", prompt, LONG_MAX_TOKENS, canary))
    return probes


# ---- traffic ----------------------------------------------------------------------------------------


def answer_alone(client: ProbeClient, probes: list[Probe]) -> None:
    """Each probe alone, one request at a time; an integrity abort or a transport error is retried."""
    for probe in probes:
        for _ in range(SOLO_ATTEMPTS):
            exchange = probe.send(client, "alone")
            probe.attempts.append(exchange)
            if exchange.outcome == "answer":
                probe.solo = exchange
                break


def churn_wave(client: ProbeClient, probes: list[Probe], wave: int) -> None:
    """Every probe again, concurrently: the long ones first, then dropped streams, the others with their
    prefix twins, then short requests that recycle pages while the rest is in flight."""
    keys = len(client.target.api_keys)
    short = [p for p in probes if not p.long]
    with ThreadPoolExecutor(MAX_WORKERS) as pool:
        jobs = [pool.submit(_replay, client, probe) for probe in probes if probe.long]
        jobs += [
            pool.submit(client.stream_and_drop, "replay:drop", i % keys, "completions", DROP_PROMPT, 64)
            for i in range(WAVE_DROPS)
        ]
        for i, probe in enumerate(short):
            jobs.append(pool.submit(_replay, client, probe))
            if (i - wave * WAVE_TWINS) % len(short) < WAVE_TWINS:
                twin = probe.prompt + " Then add one more line of your own."
                jobs.append(pool.submit(client.send, "replay:twin", probe.key_index, probe.endpoint, twin, 8))
        jobs += [
            pool.submit(client.send, "replay:short", i % keys, "completions", _short(), 2)
            for i in range(WAVE_SHORTS)
        ]
        for job in jobs:
            job.result()


def _replay(client: ProbeClient, probe: Probe) -> None:
    """One answer under load: a fence abort is tried again (LOAD_ATTEMPTS in all), and a 503 (busy: it
    never started) after BUSY_WAIT_S, up to BUSY_RETRIES times, counted but not compared."""
    tries = 0
    while tries < LOAD_ATTEMPTS:
        exchange = probe.send(client, "load")
        if exchange.status == 503 and probe.busy < BUSY_RETRIES:
            probe.busy += 1
            time.sleep(BUSY_WAIT_S)
            continue
        probe.replays.append(exchange)
        tries += 1
        if not exchange.fenced:
            break


def _short() -> str:
    """A short prompt nobody else sends (its own first page: no prefix shared with anything audited)."""
    return f"[{secrets.token_hex(6)}] Say yes."


def offers_logprobs(client: ProbeClient) -> bool:
    """Whether the server answers a greedy request's logprobs (one short request, a fresh first page)."""
    exchange = client.send("replay:logprobs", 0, "completions", _short(), 2, logprobs=True)
    return exchange.outcome == "answer" and bool(exchange.steps)


def calibrate(client: ProbeClient, probes: list[Probe]) -> None:
    """The short probes again, in concurrent batches of CALIBRATION_BATCHES sizes and nothing else (no
    drops, twins or page-recycling shorts): how far the server's own numerics move an answer between
    batch shapes (`neartie.jitter`)."""
    short = [p for p in probes if not p.long]
    for size in CALIBRATION_BATCHES:
        for first in range(0, len(short), size):
            group = short[first : first + size]
            with ThreadPoolExecutor(min(MAX_WORKERS, len(group))) as pool:
                answers = list(pool.map(lambda probe: probe.send(client, "batch"), group))
            for probe, exchange in zip(group, answers, strict=True):
                probe.calibration.append(exchange)


def run_replay(
    client: ProbeClient, long_prompts: list[tuple[str, str]], declared: bool
) -> tuple[CheckResult, list[Probe]]:
    """The whole check: answers alone, calibration batches (for the near-tie oracle: where the server
    declares no batch invariance and answers logprobs), WAVES churn waves, the verdict. `long_prompts`:
    per tenant (by key) a canary victim near the window and its canary (canaries.py)."""
    probes = new_probes(len(client.target.api_keys), long_prompts)
    logprobs = not declared and offers_logprobs(client)
    for probe in probes:
        probe.logprobs = logprobs
    answer_alone(client, probes)
    if logprobs:
        calibrate(client, probes)
    for wave in range(WAVES):
        churn_wave(client, probes, wave)
    result = judge(probes, declared, logprobs)
    confirm_departures(client, probes, result)
    return result, probes


# ---- the verdict ------------------------------------------------------------------------------------


def probe_rows(probes: list[Probe]) -> list[dict[str, Any]]:
    """Per probe: its solo answer and each replay's verdict (the report's replay table)."""
    rows = []
    for p in probes:
        solo = p.solo or (p.attempts[-1] if p.attempts else None)
        replays = [
            {"request_id": e.request_id, "verdict": p.compare(e), "status": e.status, "text": e.text[:80]}
            for e in p.replays
        ]
        rows.append(
            {
                "probe": p.index,
                "key": p.key_index,
                "endpoint": p.endpoint,
                "solo_request_id": solo.request_id if solo else None,
                "solo": "answer" if p.solo else (solo.outcome if solo else "not sent"),
                "solo_tries": len(p.attempts),
                "solo_text": p.solo.text[:80] if p.solo else "",
                "replays": replays,
            }
        )
    return rows


def judge(probes: list[Probe], declared: bool, logprobs: bool = False) -> CheckResult:
    """The answers in batches and under load against the solo ones, by the first oracle that applies:
    `exact` where the server declares batch invariance (any change FAILs); `near-tie` where it answers
    logprobs (a change FAILs where the solo run was surer than the calibrated margin: `neartie`); else
    none (INCONCLUSIVE, with the change rate). A PASS needs MIN_COMPARED answers compared."""
    answers = [(p, e) for p in probes for e in (*p.calibration, *p.replays)]
    verdicts = [(p, e, p.compare(e)) for p, e in answers]
    changed = [(p, e) for p, e, v in verdicts if v == "changed"]
    compared = sum(v in ("same", "changed") for _, _, v in verdicts)
    aborted = sum(v == "fenced" for _, _, v in verdicts) + sum(e.fenced for p in probes for e in p.attempts)
    rate = len(changed) / compared if compared else 0.0
    oracle = "exact" if declared else "near-tie" if logprobs else "none"
    summary: dict[str, Any] = {
        "oracle": oracle,
        "declared_batch_invariant": declared,
        "logprobs": logprobs,
        "probes": len(probes),
        "baselines": sum(p.solo is not None for p in probes),
        "compared": compared,
        "changed": len(changed),
        "change_rate": round(rate, 3),
        "integrity_aborts": aborted,
        "busy_retries": sum(p.busy for p in probes),
        "other": sum(v not in ("same", "changed", "fenced") for _, _, v in verdicts),
    }
    ids = [
        str(e.request_id) for p in probes for e in (*p.attempts, *p.calibration, *p.replays) if e.request_id
    ]
    counted = (
        f"{len(changed)} of {compared} answers in batches and under load differ from the same prompt alone"
    )
    counted += f" ({rate:.0%})" + (
        f"; {aborted} aborted by the fence (kv_integrity_error)" if aborted else ""
    )
    if oracle == "near-tie":
        return _near_tie(probes, changed, compared, summary, counted, ids)
    evidence: list[dict[str, Any]] = [summary, *[_mismatch(p, e) for p, e in changed], *probe_rows(probes)]
    if oracle == "none":
        return inconclusive("replay", f"{counted}; {UNDECLARED}", evidence, ids)
    if changed:
        named = ", ".join(f"{e.request_id} (probe {p.index}, key #{p.key_index})" for p, e in changed[:4])
        more = f" +{len(changed) - 4} more" if len(changed) > 4 else ""
        return CheckResult("replay", False, f"exact oracle: {counted}: {named}{more}", evidence, ids)
    if compared < MIN_COMPARED:
        why = f"only {compared} answers under load to compare with one alone (a PASS needs {MIN_COMPARED})"
        return inconclusive("replay", f"exact oracle: {why}", evidence, ids)
    ok = f"exact oracle: {counted} ({len(probes)} prompts, {WAVES} waves)"
    return CheckResult("replay", True, ok, evidence, ids)


def _near_tie(
    probes: list[Probe],
    changed: list[tuple[Probe, Exchange]],
    compared: int,
    summary: dict[str, Any],
    counted: str,
    ids: list[str],
) -> CheckResult:
    """The near-tie verdict: the margin from the calibration batches, then each change's departure."""
    margin = Margin.measured(
        jitter(p.solo.steps, e.steps)
        for p in probes
        for e in p.calibration
        if p.solo and p.solo.steps and e.steps and e.outcome == "answer"
    )
    judged = [(p, e, *_departure(p, e, margin)) for p, e in changed]
    kinds = [kind for *_, kind in judged]
    summary |= margin.evidence() | {k: kinds.count(k) for k in ("explained", "beyond", "undecided")}
    evidence: list[dict[str, Any]] = [summary]
    evidence += [_mismatch(p, e, found, kind) for p, e, found, kind in judged]
    evidence += probe_rows(probes)
    head = f"near-tie oracle, {margin.describe()}"
    beyond = [(p, e, found) for p, e, found, kind in judged if kind == "beyond"]
    if beyond:
        named = "; ".join(
            f"{e.request_id} (probe {p.index}) {found.describe()}" for p, e, found in beyond[:3]
        )
        more = f" +{len(beyond) - 3} more" if len(beyond) > 3 else ""
        details = f"{counted}, {len(beyond)} beyond the margin: {named}{more}; {head}"
        return CheckResult("replay", False, details, evidence, ids)
    if "undecided" in kinds:
        why = f"{kinds.count('undecided')} changed answers end where the solo one goes on (no gap to judge)"
        return inconclusive("replay", f"{counted}; {why}; {head}", evidence, ids)
    if compared < MIN_COMPARED:
        why = f"only {compared} answers under load to compare with one alone (a PASS needs {MIN_COMPARED})"
        return inconclusive("replay", f"{why}; {head}", evidence, ids)
    explained = ", every change at a near-tie within the margin" if changed else ""
    return CheckResult("replay", True, f"{counted}{explained}; {head}", evidence, ids)


def _departure(probe: Probe, exchange: Exchange, margin: Margin) -> tuple[Departure | None, str]:
    """Where a changed answer departs from its solo answer, and the margin's word on it."""
    solo = probe.solo
    if solo is None or solo.steps is None or exchange.steps is None:
        return None, "undecided"
    found = departure(solo.steps, exchange.steps)
    return (found, margin.judge(found)) if found else (None, "undecided")


def _mismatch(
    probe: Probe, exchange: Exchange, found: Departure | None = None, kind: str = "changed"
) -> dict[str, Any]:
    """A changed answer as evidence: a `problem` (the exact rule's changes, a departure beyond the margin
    or one left undecided), or `explained` (a near-tie within it)."""
    solo = probe.solo
    assert solo is not None
    what = (
        f"{exchange.request_id}: probe {probe.index} (key #{probe.key_index}) answered "
        f"{exchange.text[:40]!r} in a batch or under load, {solo.text[:40]!r} alone ({solo.request_id})"
    )
    if found is not None:
        what += f"; {found.describe()}"
    return {
        "explained" if kind == "explained" else "problem": what,
        "verdict": kind,
        "departure": None if found is None else asdict(found),
        "request_id": exchange.request_id,
        "solo_request_id": solo.request_id,
        "probe": probe.index,
        "key": probe.key_index,
        "text": exchange.text,
        "solo_text": solo.text,
    }


# ---- naming the pages -------------------------------------------------------------------------------


def mismatched_ids(result: CheckResult) -> list[str]:
    """The changed answers' request ids and their solo baselines' (whose trails name the pages)."""
    ids = []
    for item in result.evidence:
        if "problem" in item:
            ids += [str(item[k]) for k in ("request_id", "solo_request_id") if item.get(k)]
    return ids


def pages_of(trail: Trail) -> dict[str, Any]:
    """The pages a request read: `pages_read` events (with --trace-pages: whose data each held), else the
    pages it was allocated or shared (`pages_allocated`, `prefix_hit`). Disaggregated: "where:page"."""
    tenant = tenant_of(trail)
    read: dict[int | str, bool] = {}  # page -> held another tenant's data
    held: list[int | str] = []
    for place, events in by_where(trail).items():
        for event in events:
            if event["kind"] == "pages_read":
                for p in event["pages"]:
                    page = _page(place, p["page"])
                    read[page] = read.get(page, False) or p["owner"] != tenant or p["last_writer"] != tenant
            elif event["kind"] in ("pages_allocated", "prefix_hit"):
                held += [_page(place, p) for p in event_pages(event) if _page(place, p) not in held]
    if read:
        return {"source": "pages_read", "pages": list(read), "foreign": [p for p, f in read.items() if f]}
    return {"source": "pages_allocated/prefix_hit", "pages": held}


def _page(place: str, page: int) -> int | str:
    return int(page) if place == ENGINE else f"{place}:{page}"


def name_pages(result: CheckResult, trails: dict[str, Trail]) -> None:
    """Add to each mismatch the pages it (and its solo baseline) read, and name them in the details: the
    foreign ones when the trails say whose data they held (--trace-pages), on whichever side read them."""
    named = []
    for item in result.evidence:
        if "problem" not in item or not trails.get(str(item.get("request_id"))):
            continue
        item["pages"] = pages_of(trails[str(item["request_id"])])
        solo = trails.get(str(item.get("solo_request_id")))
        item["solo_pages"] = pages_of(solo) if solo else {}
        if item["pages"].get("foreign"):
            named.append(f"{item['request_id']} read foreign pages {item['pages']['foreign']}")
        elif item["solo_pages"].get("foreign"):
            solo_id, pages = item["solo_request_id"], item["solo_pages"]["foreign"]
            named.append(f"{item['request_id']}'s solo answer {solo_id} read foreign pages {pages}")
        else:
            named.append(f"{item['request_id']} read pages {item['pages']['pages'][:12]}")
    if named and result.passed is False:
        result.details += "; " + "; ".join(named[:3])
