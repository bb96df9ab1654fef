"""kvfence's tenant-scoped request router on a real local Ray cluster: `kvfence serve --ray-replicas 2`
(its default router, behind kvfence's front), the real SmolLM2, two tenants' keys. A tenant's next chat turn
lands on the replica that took its previous turn (its pool holds that prefix), every time; another tenant's
identical first turn is placed by load balancing, not by the first tenant's placement: over TRIALS fresh
prompts it lands elsewhere at least once (always on the first tenant's replica has odds 2^-TRIALS under
Ray's power-of-two choices, and is what a tenant-blind affinity would do every time).

One cluster, one test (each costs about a minute here); the launcher and clean-up are test_ray_serve's.
"""

from __future__ import annotations

import secrets
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from test_ray_serve import ENGINE_ARGS, HTTP_TIMEOUT_S, START_TIMEOUT_S, _secret_file, clean_up

from kvfence.disagg.launch import free_ports
from kvfence.harness.procs import launch, stop

pytest.importorskip("ray")
pytestmark = pytest.mark.real_model

TRIALS = 14
FILLER = "Please keep the answer short and plain, one sentence, no lists, no markdown at all. "  # 2 chunks


def _chat(url: str, key: str, messages: list[dict[str, str]]) -> str:
    """The replica that answered one greedy two-token chat turn."""
    body = {"messages": messages, "max_tokens": 2, "temperature": 0}
    response = httpx.post(
        f"{url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=HTTP_TIMEOUT_S,
    )
    assert response.status_code == 200, response.text
    return response.headers["x-kvfence-replica"]


@pytest.mark.timeout(600)
def test_a_tenants_prefix_sticks_and_steers_nobody_else() -> None:
    directory = Path(tempfile.mkdtemp(prefix="kvfr-"))  # short: Ray's socket paths must fit 107 bytes
    key_a, key_b = f"sk-{secrets.token_hex(16)}", f"sk-{secrets.token_hex(16)}"
    keys = _secret_file(directory / "api-keys", f"{key_a} tenant-a\n{key_b} tenant-b\n")
    (port,) = free_ports(1)
    args = ["serve", "--ray-replicas", "2", "--port", str(port), "--ray-temp-dir", str(directory / "ray")]
    args += ["--ray-replica-cpus", "0.5", *ENGINE_ARGS, "--api-keys", str(keys)]
    began = time.monotonic()
    proc = launch("kvfence serve --ray-replicas 2", args, env={"OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_for_http(url, START_TIMEOUT_S)
        print(f"  serving after {time.monotonic() - began:.1f} s (reported, not asserted)")
        placements = []
        for trial in range(TRIALS):
            turn1 = [{"role": "user", "content": f"Question {trial}. {FILLER}What is {trial} plus {trial}?"}]
            first = _chat(url, key_a, turn1)
            turn2 = [*turn1, {"role": "assistant", "content": "It is"}, {"role": "user", "content": "Why?"}]
            assert _chat(url, key_a, turn2) == first, f"trial {trial}: tenant-a's next turn moved"
            placements.append((first, _chat(url, key_b, turn1)))
        assert any(b != a for a, b in placements), f"tenant-b always followed tenant-a: {placements}"
        assert len({a for a, _ in placements}) == 2, (
            f"tenant-a's first turns all on one replica: {placements}"
        )
        print(f"  tenant-b elsewhere in {sum(b != a for a, b in placements)} of {TRIALS} trials")
        stop([proc])
        assert proc.popen.returncode == 0, proc.tail()
    finally:
        clean_up(proc, directory)
