"""A multi-turn, multi-tenant chat workload over kvfence's HTTP API, with the replicas' own prefix-cache
counters before and after (bench/ray_serve.py drives it through Ray Serve, kvfence.ray.bench).

    result = asyncio.run(chat_workload(url, tenant_keys, admin_key, replicas=2, plan=ChatPlan()))

The hit rate is the replicas' own: the change, over the run, of every replica's
kvfence_prefix_cache_hit_tokens over kvfence_prefix_cache_query_tokens, read from each replica's /metrics
(asked until `replicas` distinct `x-kvfence-replica` values answered, bounded). TTFT is the time from
sending a streamed request to its first content event, as a client sees it. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvfence.harness.sse import aiter_events

HTTP_TIMEOUT_S = 300.0
METRICS_TRIES = 60
WARM_UPS = 3
_COUNTER = re.compile(r"^kvfence_prefix_cache_(hit|query)_tokens_total(?:\{[^}]*\})? (\S+)$", re.MULTILINE)


@dataclass(frozen=True)
class ChatPlan:
    """Each tenant holds `conversations` chats of `turns` turns, one after another; tenants run at once.
    Before each turn a tenant thinks for a while (uniform in [0, 2 * think_s), seeded per tenant): a user
    reads the answer and types. Without it the load itself keeps a tenant on its replica (its turn ends,
    its replica has the shorter queue), which no real chat traffic does. Every tenant's chats open with the
    same system prompt and questions (identical prompts across tenants: what a tenant-blind prefix router
    steers together)."""

    tenants: int = 6
    conversations: int = 2
    turns: int = 5
    max_tokens: int = 8
    think_s: float = 0.5
    system: str = (
        "You are a support assistant for a small bookshop. Answer in one short sentence, plainly, without "
        "lists or markdown, and never invent a title, a price or an opening hour you were not told. The "
        "shop opens at nine, closes at six, and ships only within the country. Orders placed before noon "
        "leave the same day; later ones leave the next working day. Delivery takes two to four working "
        "days, and a tracking number is sent by email once the parcel leaves. Returns are accepted within "
        "thirty days for unread books in their original condition; the customer pays the return postage "
        "unless the book arrived damaged or was not the one ordered. Gift cards never expire and cannot be "
        "exchanged for cash. Signed copies are final sale. Pre-orders are charged when they ship, not when "
        "they are placed, and can be cancelled until then. The shop does not sell e-books or audiobooks, "
        "does not buy used books, and does not hold a book for more than three days. Payment is by card "
        "or bank transfer; a transfer must arrive within five days or the order is cancelled. A customer "
        "who asks about anything else is told politely that the shop cannot help with it."
    )

    def question(self, conversation: int, turn: int) -> str:
        return f"Customer {conversation}, question {turn}: what should I know before ordering book {turn}?"


@dataclass
class WorkloadResult:
    ttft_s: list[float] = field(default_factory=list)
    turns: int = 0
    output_events: int = 0
    wall_s: float = 0.0
    hit_tokens: float = 0.0
    query_tokens: float = 0.0
    replicas_seen: dict[str, int] = field(default_factory=dict)
    placements: dict[str, list[str]] = field(default_factory=dict)  # "tenant/chat" -> each turn's replica

    def summary(self) -> dict[str, Any]:
        ordered = sorted(self.ttft_s)
        return {
            "turns": self.turns,
            "wall_s": round(self.wall_s, 2),
            "turns_per_s": round(self.turns / self.wall_s, 3) if self.wall_s else 0.0,
            "output_events_per_s": round(self.output_events / self.wall_s, 2) if self.wall_s else 0.0,
            "ttft_p50_s": round(_percentile(ordered, 50), 3),
            "ttft_p95_s": round(_percentile(ordered, 95), 3),
            "prefix_hit_tokens": self.hit_tokens,
            "prefix_query_tokens": self.query_tokens,
            "hit_rate": round(self.hit_tokens / self.query_tokens, 4) if self.query_tokens else 0.0,
            "turns_by_replica": self.replicas_seen,
            "turns_on_previous_turns_replica": self.stayed(),
            "placements": self.placements,
        }

    def stayed(self) -> float:
        """The share of turns after a chat's first that went to the replica of the turn before."""
        moves = [a == b for chat in self.placements.values() for a, b in itertools.pairwise(chat)]
        return round(sum(moves) / len(moves), 4) if moves else 0.0


def _percentile(ordered: list[float], pct: float) -> float:
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))]


async def chat_workload(
    url: str, tenant_keys: Sequence[str], admin_key: str, replicas: int, plan: ChatPlan, warm_key: str
) -> WorkloadResult:
    """Run `plan` with one API key per tenant; the `replicas` replicas' prefix counters before and after.
    First WARM_UPS short requests per replica from `warm_key`'s tenant (shorter than a routing chunk, so
    spread by load; its pages are its own, so they give no tenant of the plan a hit), not counted."""
    result = WorkloadResult()
    async with httpx.AsyncClient(base_url=url, timeout=HTTP_TIMEOUT_S) as client:
        for _ in range(WARM_UPS * replicas):
            await _turn(client, warm_key, [{"role": "user", "content": "Hello"}], 2, WorkloadResult())
        before = await replica_counters(client, admin_key, replicas)
        began = time.monotonic()
        tenants = enumerate(tenant_keys[: plan.tenants])
        await asyncio.gather(*(_tenant(client, i, key, plan, result) for i, key in tenants))
        result.wall_s = time.monotonic() - began
        after = await replica_counters(client, admin_key, replicas)
    for replica, (hits, queries) in after.items():
        result.hit_tokens += hits - before.get(replica, (0.0, 0.0))[0]
        result.query_tokens += queries - before.get(replica, (0.0, 0.0))[1]
    return result


async def _tenant(
    client: httpx.AsyncClient, tenant: int, key: str, plan: ChatPlan, result: WorkloadResult
) -> None:
    thinking = random.Random(tenant)
    for conversation in range(plan.conversations):
        messages = [{"role": "system", "content": plan.system}]
        placements = result.placements.setdefault(f"{tenant}/{conversation}", [])
        for turn in range(plan.turns):
            await asyncio.sleep(thinking.uniform(0, 2 * plan.think_s))
            messages.append({"role": "user", "content": plan.question(conversation, turn)})
            answer, replica = await _turn(client, key, messages, plan.max_tokens, result)
            messages.append({"role": "assistant", "content": answer})
            placements.append(replica)


async def _turn(
    client: httpx.AsyncClient,
    key: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    result: WorkloadResult,
) -> tuple[str, str]:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    sent, pieces, first = time.monotonic(), [], None
    headers = {"authorization": f"Bearer {key}"}
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"chat turn: HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        replica = response.headers.get("x-kvfence-replica", "?")
        async for event in aiter_events(response.aiter_lines()):
            for choice in event.get("choices", []):
                text = (choice.get("delta") or {}).get("content")
                if text:
                    first = first if first is not None else time.monotonic()
                    pieces.append(text)
                    result.output_events += 1
    result.ttft_s.append((first if first is not None else time.monotonic()) - sent)
    result.turns += 1
    result.replicas_seen[replica] = result.replicas_seen.get(replica, 0) + 1
    return "".join(pieces), replica


async def replica_counters(
    client: httpx.AsyncClient, admin_key: str, replicas: int
) -> dict[str, tuple[float, float]]:
    """Each replica's (prefix hit tokens, prefix query tokens), from its /metrics through the proxy: asked
    until `replicas` replicas answered (at most METRICS_TRIES times)."""
    seen: dict[str, tuple[float, float]] = {}
    for _ in range(METRICS_TRIES):
        response = await client.get("/metrics", headers={"authorization": f"Bearer {admin_key}"})
        response.raise_for_status()
        counts = {"hit": 0.0, "query": 0.0}
        for kind, value in _COUNTER.findall(response.text):
            counts[kind] += float(value)
        seen[response.headers["x-kvfence-replica"]] = (counts["hit"], counts["query"])
        if len(seen) == replicas:
            return seen
    raise RuntimeError(f"/metrics: {len(seen)} of {replicas} replicas answered in {METRICS_TRIES} tries")
