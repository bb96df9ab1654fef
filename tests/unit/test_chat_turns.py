"""The Ray benchmark's chat workload (kvfence.harness.chat_turns) over a fake two-replica server: each turn
carries the chat so far with the answers streamed before, each chat's placements are recorded, the hit rate
is the replicas' counters' change over the run (warm-ups before the first reading), and /metrics is asked
until every replica answered."""

from __future__ import annotations

import asyncio
import itertools
import json

import httpx
import pytest

from kvfence.harness.chat_turns import ChatPlan, WorkloadResult, chat_workload, replica_counters

ADMIN = "admin-key"


class FakeFleet:
    """Two replicas behind one URL: chats alternate between them, /metrics answers from each in turn."""

    def __init__(self) -> None:
        self.counters = {"r1": [0, 0], "r2": [0, 0]}  # hit, query
        self.chat_replicas = itertools.cycle(["r1", "r1", "r2"])
        self.metrics_replicas = itertools.cycle(["r1", "r1", "r2"])  # r2 answers every third time
        self.bodies: list[dict] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            assert request.headers["authorization"] == f"Bearer {ADMIN}"
            replica = next(self.metrics_replicas)
            hit, query = self.counters[replica]
            text = f'kvfence_prefix_cache_hit_tokens_total{{model_name="m"}} {hit}.0\n'
            text += f"kvfence_prefix_cache_query_tokens_total {query}.0\nkvfence_other_total 99.0\n"
            return httpx.Response(200, text=text, headers={"x-kvfence-replica": replica})
        body = json.loads(request.content)
        self.bodies.append(body)
        replica = next(self.chat_replicas)
        self.counters[replica][0] += 16
        self.counters[replica][1] += 32
        answer = f"answer{len(body['messages'])}"
        events = [{"choices": [{"delta": {"content": piece}}]} for piece in (answer[:3], answer[3:])]
        stream = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=stream, headers={"x-kvfence-replica": replica})


@pytest.fixture
def fleet(monkeypatch: pytest.MonkeyPatch) -> FakeFleet:
    fake = FakeFleet()
    real = httpx.AsyncClient

    def client(**kwargs: object) -> httpx.AsyncClient:
        return real(transport=httpx.MockTransport(fake.handle), **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(httpx, "AsyncClient", client)
    return fake


def test_the_workload_carries_each_chat_and_counts_the_replicas_hits(fleet: FakeFleet) -> None:
    plan = ChatPlan(tenants=2, conversations=1, turns=3, think_s=0.0)
    result = asyncio.run(chat_workload("http://fleet", ["sk-a", "sk-b"], ADMIN, 2, plan, "sk-warm"))
    warm, turns = fleet.bodies[:6], fleet.bodies[6:]
    assert all(b["messages"] == [{"role": "user", "content": "Hello"}] for b in warm)
    assert len(turns) == 6 and result.turns == 6 and len(result.ttft_s) == 6
    last = max(turns, key=lambda b: len(b["messages"]))["messages"]
    assert [m["role"] for m in last] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert last[2]["content"] == "answer2" and last[4]["content"] == "answer4"  # the streamed answers
    assert result.hit_tokens == 6 * 16 and result.query_tokens == 6 * 32  # warm-ups not counted
    summary = result.summary()
    assert summary["hit_rate"] == 0.5 and sum(summary["turns_by_replica"].values()) == 6
    assert sorted(result.placements) == ["0/0", "1/0"] and all(
        len(p) == 3 for p in result.placements.values()
    )


def test_counters_wait_for_every_replica(fleet: FakeFleet) -> None:
    async def read(replicas: int) -> dict[str, tuple[float, float]]:
        async with httpx.AsyncClient(base_url="http://fleet") as client:
            return await replica_counters(client, ADMIN, replicas)

    assert set(asyncio.run(read(2))) == {"r1", "r2"}  # r2 answered only on the third try
    with pytest.raises(RuntimeError, match="2 of 3 replicas answered"):
        asyncio.run(read(3))


def test_stayed_is_the_share_of_turns_on_the_previous_turns_replica() -> None:
    result = WorkloadResult(placements={"0/0": ["r1", "r1", "r2"], "1/0": ["r2", "r2"]})
    assert result.stayed() == round(2 / 3, 4)
