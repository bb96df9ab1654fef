"""n > 1 through the HTTP API on the real SmolLM2: choices with their indexes, streamed and not, usage over
every choice, reproducible under a seed, and the forks on the audit trail sharing the prompt's pages."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from conftest import real_engine, serving

from kvfence.api.server import build_app
from kvfence.audit.trail import held_pages
from kvfence.engine.async_engine import AsyncEngine
from kvfence.harness.server import metric
from kvfence.model.gguf import GGUFModel
from kvfence.request import fork_id

pytestmark = pytest.mark.real_model

MODEL = "smollm2-n"
KEY, ADMIN = "key-n", "admin-n"
# Long enough for a full page of the prompt to be shared (16 tokens a page).
QUESTION = "Name a colour, then describe where it appears in nature, in a sentence."
MESSAGES = [{"role": "user", "content": QUESTION}]
SEEDED: dict[str, Any] = {"n": 3, "max_tokens": 8, "temperature": 1.0, "seed": 7}


@pytest.fixture(scope="module")
def url(smollm2: GGUFModel) -> Iterator[str]:
    engine = AsyncEngine(real_engine(smollm2, num_pages=64, max_model_len=512))
    with serving(build_app(engine, MODEL, {KEY: "tenant-n"}, ADMIN)) as running:
        yield running


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)


def test_three_choices_with_indexes_usage_and_seeded_reproducibility(url: str) -> None:
    reply = client(url).chat.completions.create(model=MODEL, messages=MESSAGES, **SEEDED)  # type: ignore[call-overload]
    assert [c.index for c in reply.choices] == [0, 1, 2]
    texts = [c.message.content for c in reply.choices]
    assert all(texts) and all(c.finish_reason in ("stop", "length") for c in reply.choices)
    assert len(set(texts)) > 1  # three seeds, three samples
    assert reply.usage is not None
    assert reply.usage.completion_tokens > 3 and reply.usage.completion_tokens <= 3 * 8
    again = client(url).chat.completions.create(model=MODEL, messages=MESSAGES, **SEEDED)  # type: ignore[call-overload]
    assert [c.message.content for c in again.choices] == texts

    stream = client(url).chat.completions.create(  # type: ignore[call-overload]
        model=MODEL, messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **SEEDED
    )
    chunks = list(stream)
    streamed = ["", "", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == texts
    finishes = [c.index for chunk in chunks for c in chunk.choices if c.finish_reason]
    assert sorted(finishes) == [0, 1, 2]
    assert (
        chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    )


def test_forks_share_the_prompts_pages_on_the_audit_trail(url: str) -> None:
    reply = client(url).completions.create(model=MODEL, prompt=QUESTION, **SEEDED)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    trails = [_trail(url, fork_id(reply.id, i)) for i in range(3)]
    forked = [trail[0] for trail in trails]
    assert all(f["kind"] == "forked" and f["parent"] == reply.id for f in forked)
    assert forked[0]["shared"] and forked[0]["shared"] == forked[1]["shared"] == forked[2]["shared"]
    copies = [page for f in forked for page in f["copied"]]
    assert len(set(copies)) == len(copies)  # each fork its own copy of the partial page
    assert [e["kind"] for e in _trail(url, reply.id)][-3:] == ["forked", "released", "finished"]
    # The audit reads a fork's mapping from that event: every page it held, it released.
    for trail, event in zip(trails, forked, strict=True):
        assert held_pages(trail[:1]) == set(event["pages"]) and not held_pages(trail)


def generated_tokens(url: str) -> float:
    return metric(url, "kvfence_generation_tokens_total", {"model_name": MODEL}, ADMIN)


def test_metrics_count_every_choice(url: str) -> None:
    before = generated_tokens(url)
    reply = client(url).chat.completions.create(model=MODEL, messages=MESSAGES, **SEEDED)  # type: ignore[call-overload]
    assert reply.usage is not None
    assert generated_tokens(url) - before == reply.usage.completion_tokens  # all three choices' tokens


def test_n_out_of_range_or_best_of_other_than_n_is_400(url: str) -> None:
    for extra in ({"n": 0}, {"n": 17}, {"n": 2, "best_of": 3}):
        with pytest.raises(openai.BadRequestError) as info:
            client(url).completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body=extra)
        assert info.value.param == next(reversed(extra))
    ok = client(url).completions.create(model=MODEL, prompt="Hi", max_tokens=2, n=2, best_of=2)
    assert len(ok.choices) == 2


def _trail(url: str, request_id: str) -> list[dict[str, Any]]:
    response = httpx.get(
        f"{url}/v1/audit/requests/{request_id}", headers={"authorization": f"Bearer {ADMIN}"}, timeout=30
    )
    assert response.status_code == 200, response.text
    return response.json()["events"]
