"""Teacher-forced confirmation of a replay departure the near-tie oracle failed.

The answer given under load, up to and including the token where it departed from its solo answer, is sent
again as a prompt, alone, with completions' `echo` and `logprobs`: the server scores every prompt token in the
true context, so the departing token's logprob there, beside the solo run's logprob of its own token, shows
which answer the true context supports (usually the solo one: a token chosen from the wrong KV scores far
below it; but a fault can hit the solo run too, and then the departing token is the likely one). Evidence a
reader can check by sending the same request, not a second verdict. Where the server refuses `echo` with
logprobs, or the probe is a chat (no echo there), the confirmation says so and the verdict stands on the solo
run's own logprobs.

Contract: `confirm` sends one request and returns a JSON-ready dict: `request` (the body sent), and
either `logprob` (the departing token's, summed over the echoed tokens that spell it), or `why` not;
`confirm_departures` does so for the first MAX_CONFIRMATIONS departures beyond the margin of a replay
verdict, beside the solo run's logprob of its own token there, into the evidence and the details.
"""

from __future__ import annotations

import math
from typing import Any

import httpx

from kvfence.audit.client import Exchange, ProbeClient
from kvfence.audit.neartie import Departure
from kvfence.audit.replay_probe import Probe
from kvfence.audit.result import CheckResult

MAX_CONFIRMATIONS = 3  # departures re-scored per audit: evidence, not a second verdict


def confirm(
    client: ProbeClient, key_index: int, prompt: str, exchange: Exchange, found: Departure
) -> dict[str, Any]:
    """Re-score `exchange` (a changed answer to `prompt`, sent by key `key_index`) up to its departure."""
    if exchange.endpoint != "completions" or exchange.steps is None or found.other_token is None:
        return {"why": "not a completion with the departing token known: nothing to echo"}
    forced = prompt + "".join(step.token for step in exchange.steps[: found.step]) + found.other_token
    body = {"model": client.target.model, "prompt": forced, "max_tokens": 1, "temperature": 0}
    body |= {"echo": True, "logprobs": 1}
    try:
        response = client.http.post("/v1/completions", json=body, headers=client.headers(key_index))
        data = response.json()
    except (httpx.HTTPError, ValueError) as exc:
        return {"request": body, "why": f"no answer ({type(exc).__name__})"}
    if response.status_code != 200:
        return {
            "request": body,
            "why": f"the server refused echo with logprobs (HTTP {response.status_code})",
        }
    logprob = _trailing_logprob(data, found.other_token)
    if logprob is None:
        return {"request": body, "why": "the echoed tokens do not end with the departing token"}
    return {"request": body, "token": found.other_token, "logprob": logprob, "solo_token": found.solo_token}


def _trailing_logprob(data: Any, token: str) -> float | None:
    """The summed logprob of the echoed prompt tokens (all but the one generated) that spell `token` at
    the prompt's end; None when they do not, or the numbers are malformed."""
    try:
        logprobs = data["choices"][0]["logprobs"]
        tokens, values = list(logprobs["tokens"])[:-1], list(logprobs["token_logprobs"])[:-1]
    except (KeyError, IndexError, TypeError):
        return None
    spelled, total = "", 0.0
    for text, value in zip(reversed(tokens), reversed(values), strict=True):
        if not isinstance(value, int | float) or math.isnan(value):
            return None
        spelled, total = str(text) + spelled, total + float(value)
        if spelled == token:
            return total
        if len(spelled) >= len(token):
            return None
    return None


def confirm_departures(client: ProbeClient, probes: list[Probe], result: CheckResult) -> None:
    """Re-score the first MAX_CONFIRMATIONS departures beyond the margin (confirm.py), each beside the
    solo run's logprob of its own token there, into the evidence and the details."""
    by_id = {e.request_id: (p, e) for p in probes for e in (*p.calibration, *p.replays)}
    beyond = [item for item in result.evidence if item.get("verdict") == "beyond"][:MAX_CONFIRMATIONS]
    shown = []
    for item in beyond:
        probe, exchange = by_id[item["request_id"]]
        found = Departure(**item["departure"])
        checked = confirm(client, probe.key_index, probe.prompt, exchange, found)
        if probe.solo is not None and probe.solo.steps is not None and found.step < len(probe.solo.steps):
            checked["solo_logprob"] = probe.solo.steps[found.step].logprob
        item["confirmation"] = checked
        if "logprob" in checked and "solo_logprob" in checked:
            solo = f"the solo answer's {found.solo_token!r}: {checked['solo_logprob']:.3g}"
            shown.append(
                f"{item['request_id']}'s {found.other_token!r} re-scored alone: logprob "
                f"{checked['logprob']:.3g} ({solo})"
            )
    if shown:
        result.details += "; teacher-forced: " + "; ".join(shown)
