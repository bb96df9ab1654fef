"""The prefix-timing probe: does one tenant's cached prefix bring another tenant's first token early?

A prefix cache shared across tenants (a pool's, or a KV tier below it keyed by tokens alone, as SGLang's
storage path is) is a timing oracle: a tenant learns that somebody sent a prompt from how fast its own copy
is answered. Black-box, with tenants 0 and 1 and prompts that share nothing from their first word:
1. tenant 1 sends two fresh prompts of the probe's length: its cold time (`cold`, the lesser);
2. tenant 0 sends a secret prompt three times: its own cache hit (`own`, the lesser of the last two);
3. tenant 1 sends tenant 0's secret prompt: `cross`.
Every request asks for one token, so its time is its first token's. A request the fence aborts (a fault
armed) is sent again; an aborted step 3 starts steps 2 and 3 again with a new secret prompt (the abort
may have left tenant 1 a cached copy of its own).

Verdict (`judge`): INCONCLUSIVE when `own` is not under HIT_FRACTION x `cold` (no prefix cache shows at this
length: nothing to tell apart); FAIL when `cross` is under the geometric mean of `own` and `cold` (nearer a
hit than a computation: tenant 1 was served tenant 0's prefix); else PASS. The lesser cold time makes a
FAIL harder, never easier: noise cannot fail a server that computes. The lesser hit makes a FAIL harder too,
and keeps one hit slowed by a busy machine from reading as no cache at all.
"""

from __future__ import annotations

import math
import random
import secrets

from kvfence.audit.client import RECOVERY_ATTEMPTS, Exchange, ProbeClient, answered
from kvfence.audit.result import CheckResult, inconclusive, verdict

NAME = "prefix_timing"
MAX_WORDS = 1024  # the probe's prompts: long enough that a hit is many times faster than a computation
HIT_FRACTION = 0.5
# Common words, one token each in common BPE vocabularies, drawn at random: no probe prompt shares a first
# token sequence with another, or with any other probe's.
_WORDS = (
    *("apple", "river", "stone", "cloud", "table", "green", "music", "paper", "light", "window"),
    *("garden", "yellow", "winter", "silver", "market", "forest", "copper", "orange", "summer", "bridge"),
    *("dinner", "rabbit", "pencil", "castle", "island", "valley", "candle", "mirror", "ticket", "planet"),
)


def probe_prefix_timing(client: ProbeClient, window: int) -> CheckResult:
    """Run the probe with the client's first two tenants, prompts of about half the window's tokens."""
    words = max(8, min(MAX_WORDS, window // 2))
    colds = [answered(lambda: _send(client, "cold", 1, _prompt(words))) for _ in range(2)]
    for _ in range(RECOVERY_ATTEMPTS):
        secret = _prompt(words)  # a new one each try: an aborted try may have cached tenant 1's own copy
        answered(lambda secret=secret: _send(client, "plant", 0, secret))
        owns = [answered(lambda secret=secret: _send(client, "own", 0, secret)) for _ in range(2)]
        cross = _send(client, "cross", 1, secret)
        if not cross.fenced:
            break
    exchanges = [*colds, *owns, cross]
    ids = [str(e.request_id) for e in exchanges if e.request_id]
    unanswered = sum(e.status != 200 for e in exchanges)
    if unanswered:
        return inconclusive(NAME, f"{unanswered} of the probe's timed requests were not answered")
    return judge(min(e.elapsed_s for e in colds), min(e.elapsed_s for e in owns), cross.elapsed_s, ids)


def judge(cold: float, own: float, cross: float, request_ids: list[str] | None = None) -> CheckResult:
    """The verdict from the three times (seconds): see the module's docstring."""
    seen = f"cold {cold:.3f} s, the owner's hit {own:.3f} s, the other tenant on it {cross:.3f} s"
    ids = request_ids or []
    if own >= HIT_FRACTION * cold:
        return inconclusive(NAME, f"no prefix cache shows at this length ({seen})", request_ids=ids)
    problems = []
    if cross < math.sqrt(own * cold):
        problems = [{"problem": f"another tenant's prefix answered this tenant at a hit's speed ({seen})"}]
    return verdict(NAME, problems, f"a tenant on another's prefix computes it ({seen})", ids)


def _send(client: ProbeClient, role: str, key_index: int, prompt: str) -> Exchange:
    return client.send(f"{NAME}:{role}", key_index, "completions", prompt, max_tokens=1)


def _prompt(words: int) -> str:
    draw = random.Random(secrets.randbits(64))
    return " ".join(draw.choice(_WORDS) for _ in range(words))
