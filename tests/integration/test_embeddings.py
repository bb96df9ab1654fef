"""OpenAI's /v1/embeddings on the real SmolLM2, as a client moving from OpenAI or vLLM would call it: the
official client's `embeddings.create` (its default asks for base64 and decodes it; "float" asks for lists),
vectors equal to transformers' own final hidden states of the same GGUF (last token, L2-normalized: vLLM's
default pooler), a batch equal to its inputs sent one by one, vLLM's truncate_prompt_tokens, every refusal a
400 naming its parameter (an unknown field, dimensions, an empty input, one longer than the window), the API
keys, and the KV pool left exactly as it was (embeddings run beside it, never in it)."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from conftest import real_engine, serving

from kvfence.api.errors import UNKNOWN_PARAMETER
from kvfence.api.server import build_app
from kvfence.engine.async_engine import AsyncEngine
from kvfence.model.gguf import GGUFModel
from kvfence.model.tokenizer import Tokenizer

pytestmark = pytest.mark.real_model

MODEL = "smollm2-embed"
KEY, ADMIN = "key-a", "admin-a"
WINDOW = 256
CHUNK = 16  # max_num_batched_tokens: a prompt longer than this is computed in chunks
TEXT = "The capital of France is Paris."
OTHER = "Photosynthesis turns light into chemical energy."
# About 60 tokens: four chunks of CHUNK.
LONG = " ".join(["Embeddings of a long prompt are computed a chunk at a time, between engine steps."] * 4)
HIDDEN = 576  # SmolLM2-135M's hidden size


@pytest.fixture(scope="module")
def engine(smollm2: GGUFModel) -> AsyncEngine:
    return AsyncEngine(real_engine(smollm2, num_pages=64, max_model_len=WINDOW, max_num_batched_tokens=CHUNK))


@pytest.fixture(scope="module")
def url(engine: AsyncEngine) -> Iterator[str]:
    app = build_app(engine, MODEL, {KEY: "tenant-a"}, ADMIN)
    with serving(app) as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(smollm2: GGUFModel) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2)


def post(url: str, body: dict[str, Any], key: str | None = KEY) -> httpx.Response:
    """The body as JSON text with non-ASCII escaped, so that a lone surrogate travels as JSON allows."""
    headers = {"content-type": "application/json"} | ({"authorization": f"Bearer {key}"} if key else {})
    return httpx.post(f"{url}/v1/embeddings", content=json.dumps(body), headers=headers, timeout=120)


def vectors(url: str, **body: Any) -> list[list[float]]:
    response = post(url, body)
    assert response.status_code == 200, response.text
    return [item["embedding"] for item in response.json()["data"]]


def test_openai_client_string_list_and_base64(client: openai.OpenAI) -> None:
    """A string and a list of strings, as floats; the client's default (base64, decoded by the client)
    gives the very same float32 values."""
    one = client.embeddings.create(model=MODEL, input=TEXT, encoding_format="float")
    assert one.object == "list" and one.model == MODEL and len(one.data) == 1
    assert one.data[0].object == "embedding" and one.data[0].index == 0
    assert len(one.data[0].embedding) == HIDDEN
    assert one.usage.prompt_tokens == one.usage.total_tokens > 0
    assert np.linalg.norm(one.data[0].embedding) == pytest.approx(1.0, abs=1e-5)

    two = client.embeddings.create(model=MODEL, input=[TEXT, OTHER], encoding_format="float")
    assert [item.index for item in two.data] == [0, 1]
    assert two.usage.prompt_tokens > one.usage.prompt_tokens

    decoded = client.embeddings.create(model=MODEL, input=[TEXT, OTHER])  # the client asks for base64
    assert [item.embedding for item in decoded.data] == [item.embedding for item in two.data]
    assert decoded.data[0].embedding == one.data[0].embedding


def test_base64_is_little_endian_float32(url: str) -> None:
    response = post(url, {"input": TEXT, "encoding_format": "base64"})
    assert response.status_code == 200, response.text
    encoded = response.json()["data"][0]["embedding"]
    assert isinstance(encoded, str) and response.headers["x-request-id"].startswith("embd-")
    raw = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
    assert raw.tolist() == vectors(url, input=TEXT)[0]


@pytest.mark.parametrize("text", [TEXT, LONG], ids=["short", "chunked"])
def test_vectors_are_transformers_last_hidden_state(
    url: str, tokenizer: Tokenizer, hf_smollm2: torch.nn.Module, text: str
) -> None:
    """The reference: transformers' own model of the same GGUF, its last hidden state (after the final
    norm) at the last prompt token, L2-normalized. Token ids sent as such give the same vector as the
    text, and a prompt longer than a chunk matches as well as a short one."""
    tokens = tokenizer.encode(text, add_special_tokens=True)
    assert (len(tokens) > CHUNK) == (text is LONG)
    with torch.inference_mode():
        hidden = hf_smollm2.model(torch.tensor([tokens])).last_hidden_state[0, -1]
    expected = torch.nn.functional.normalize(hidden.float(), dim=-1)
    ours = torch.tensor(vectors(url, input=text)[0])
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-4)
    assert vectors(url, input=tokens)[0] == ours.tolist()
    assert vectors(url, input=[tokens])[0] == ours.tolist()


def test_batches_equal_single_requests_and_inputs_differ(url: str, tokenizer: Tokenizer) -> None:
    singles = [vectors(url, input=text)[0] for text in (TEXT, OTHER, LONG)]
    assert vectors(url, input=[TEXT, OTHER, LONG]) == singles
    ids = [tokenizer.encode(text, add_special_tokens=True) for text in (TEXT, OTHER, LONG)]
    assert vectors(url, input=ids) == singles
    assert singles[0] != singles[1]
    assert float(np.dot(singles[0], singles[1])) < 0.999  # not merely different in the last bits


def test_truncate_prompt_tokens_keeps_the_last_tokens(url: str, tokenizer: Tokenizer) -> None:
    """vLLM's truncate_prompt_tokens: the last N tokens, counted in usage; -1 keeps up to the window."""
    tokens = tokenizer.encode(LONG, add_special_tokens=True)
    response = post(url, {"input": LONG, "truncate_prompt_tokens": 5})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 5
    assert response.json()["data"][0]["embedding"] == vectors(url, input=tokens[-5:])[0]
    assert vectors(url, input=LONG, truncate_prompt_tokens=-1) == vectors(url, input=LONG)
    too_long = [1] * (WINDOW + 10)
    kept = post(url, {"input": too_long, "truncate_prompt_tokens": -1})
    assert kept.status_code == 200 and kept.json()["usage"]["prompt_tokens"] == WINDOW
    without = vectors(url, input=TEXT, add_special_tokens=False)[0]
    assert without == vectors(url, input=tokenizer.encode(TEXT, add_special_tokens=False))[0]


def test_dimensions_only_at_the_hidden_size_and_user_accepted(url: str) -> None:
    assert vectors(url, input=TEXT, dimensions=HIDDEN, user="someone") == vectors(url, input=TEXT)
    response = post(url, {"input": TEXT, "dimensions": 64})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "dimensions" and str(HIDDEN) in error["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": TEXT, "normalize": False}, "normalize"),
        ({"input": TEXT, "pooling": "mean"}, "pooling"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [""]}, "input"),
        ({"input": [TEXT, ""]}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [[1, 2], []]}, "input"),
        ({"input": [-1]}, "input"),
        ({"input": [10**9]}, "input"),
        ({"input": [TEXT, 3]}, "input"),
        ({"input": "\ud800"}, "input"),
        ({"input": [1] * (WINDOW + 1)}, "input"),
        ({"input": [TEXT, [1] * (WINDOW + 1)]}, "input"),
        ({"input": TEXT, "truncate_prompt_tokens": WINDOW + 1}, "truncate_prompt_tokens"),
        ({"input": TEXT, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"input": TEXT, "encoding_format": "bytes"}, "encoding_format"),
        ({}, "input"),
    ],
    ids=[
        "unknown field", "unknown pooling", "empty string", "empty list", "list of empty", "one empty",
        "empty ids", "one empty ids", "negative id", "id outside vocab", "mixed", "lone surrogate",
        "over the window", "one over the window", "truncate over the window", "truncate 0",
        "encoding format", "no input",
    ],
)  # fmt: skip
def test_refusals_are_400_naming_the_parameter(url: str, body: dict[str, Any], param: str) -> None:
    response = post(url, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    if param in ("normalize", "pooling"):
        assert UNKNOWN_PARAMETER in error["message"]
    if "input" in body and isinstance(body["input"], list) and len(body["input"]) > WINDOW:
        assert error["code"] == "context_length_exceeded" and str(WINDOW) in error["message"]


def test_keys_and_model(url: str) -> None:
    for key in (None, "wrong"):
        response = post(url, {"input": TEXT}, key=key)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    other = post(url, {"input": TEXT, "model": "another-model"})
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
    anonymous = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.embeddings.create(model=MODEL, input=TEXT)


def test_the_kv_pool_is_left_as_it_was(url: str, engine: AsyncEngine) -> None:
    """No page allocated, validated, written or cached: the pool's bytes and counters are unchanged."""

    def snapshot() -> tuple[torch.Tensor, dict[str, int], int, int]:
        stats = engine.stats()["single"]
        kv = engine.call(lambda: engine.engine.pool.kv.clone()).result(timeout=60)
        return kv, stats.pages_by_state, stats.validation_checks, stats.prefix_hits

    before = snapshot()
    vectors(url, input=[TEXT, OTHER, LONG])
    after = snapshot()
    assert torch.equal(before[0], after[0]) and before[1:] == after[1:]


def test_generation_still_served_and_metrics_count(url: str) -> None:
    """A completion beside embeddings answers as usual; /metrics counts the embedding requests."""
    headers = {"authorization": f"Bearer {ADMIN}"}
    before = httpx.get(f"{url}/metrics", headers=headers, timeout=60).text
    vectors(url, input=[TEXT, OTHER])
    body = {"prompt": TEXT, "max_tokens": 4}
    completion = httpx.post(
        f"{url}/v1/completions", json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=120
    )
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 4
    after = httpx.get(f"{url}/metrics", headers=headers, timeout=60).text

    def count(text: str, name: str) -> float:
        line = next(x for x in text.splitlines() if x.startswith(f"{name}{{"))
        return float(line.rsplit(" ", 1)[1])

    assert (
        count(after, "kvfence_embedding_requests_total")
        == count(before, "kvfence_embedding_requests_total") + 1
    )
    assert count(after, "kvfence_embedding_prompt_tokens_total") > count(
        before, "kvfence_embedding_prompt_tokens_total"
    )
