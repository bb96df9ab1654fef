"""Speculative decoding on the real SmolLM2, on serving's default (fast) path: prompt lookup on a copy-heavy
request gives the same greedy text as decoding without it, in fewer steps, and so do 8 requests batched
(prefilled whole: verification rows against decode rows; that chunking does not move a prompt's logits is
test_chunk_invariance's); over
HTTP, usage counts the tokens returned and /metrics counts drafts under kvfence's and (compat) vLLM's
names."""

from __future__ import annotations

import re

import httpx
import pytest
from conftest import real_engine, serving

from kvfence.api.server import build_app
from kvfence.config import SpeculativeConfig
from kvfence.engine.async_engine import AsyncEngine
from kvfence.engine.engine import LLMEngine
from kvfence.harness.copy_tasks import copy_prompts
from kvfence.model.gguf import GGUFModel
from kvfence.sampling import SamplingParams

pytestmark = pytest.mark.real_model

NGRAM = SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4)
PASSAGE = (
    "def scale(values, factor):\n    result = []\n    for value in values:\n"
    "        result.append(value * factor)\n    return result\n"
)
TASK = "Rename the function scale to multiply. Return only the code."
ASK = [{"role": "user", "content": f"{TASK}\n\n{PASSAGE}"}]
ADMIN, KEY = "spec-admin", "spec-key"


def fast_engine(smollm2: GGUFModel, **settings: object) -> LLMEngine:
    sizes: dict[str, object] = {"num_pages": 64, "max_model_len": 512}
    return real_engine(smollm2, activation_dtype="auto", **{**sizes, **settings})


def test_prompt_lookup_keeps_the_greedy_text_in_fewer_steps(smollm2: GGUFModel) -> None:
    params = SamplingParams(max_tokens=48)
    outputs, steps = {}, {}
    for name, spec in (("plain", None), ("ngram", NGRAM)):
        engine = fast_engine(smollm2, speculative=spec)
        assert engine.model.activation_dtype == "int8" and engine.pool.kv.dtype.itemsize == 2
        tok = engine.tokenizer
        assert tok is not None
        [request] = engine.generate([tok.encode(tok.apply_chat_template(ASK))], params)
        outputs[name], steps[name] = request.output_token_ids, engine.num_steps
        if spec is not None:
            assert engine.spec_stats.accepted_tokens > 0
    assert outputs["ngram"] == outputs["plain"]
    assert "value * factor" in tok.decode(outputs["plain"])  # it copies the passage: drafts have hits
    assert steps["ngram"] < steps["plain"]


def test_batched_verification_rows_keep_every_greedy_token(smollm2: GGUFModel) -> None:
    # A step budget that prefills all 8 prompts (about 1,300 tokens) in the first step: what is compared is
    # the verification rows against decode rows, batched 8 requests wide
    params, outputs = SamplingParams(max_tokens=40), {}
    for name, spec in (("plain", None), ("ngram", NGRAM)):
        engine = fast_engine(smollm2, speculative=spec, num_pages=256, max_num_batched_tokens=4096)
        assert engine.tokenizer is not None
        prompts = copy_prompts(engine.tokenizer, 8, seed=1)
        outputs[name] = [r.output_token_ids for r in engine.generate(prompts, params)]
        if spec is not None:
            assert engine.spec_stats.accepted_tokens > 0
    assert outputs["ngram"] == outputs["plain"]


def test_usage_and_metrics_count_what_speculation_did(smollm2: GGUFModel) -> None:
    engine = AsyncEngine(fast_engine(smollm2, speculative=NGRAM))
    app = build_app(engine, "smollm2", {KEY: "tenant-a"}, ADMIN, metrics_compat="vllm")
    with serving(app) as url:
        body = {"model": "smollm2", "messages": ASK, "max_tokens": 48, "temperature": 0}
        headers = {"authorization": f"Bearer {KEY}"}
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120).json()
        tokenized = httpx.post(
            f"{url}/tokenize",
            json={"prompt": answer["choices"][0]["message"]["content"], "add_special_tokens": False},
            headers=headers,
            timeout=30,
        ).json()
        metrics = httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {ADMIN}"}, timeout=30).text
    usage = answer["usage"]["completion_tokens"]
    assert 0 < usage <= 48 and abs(usage - tokenized["count"]) <= 1  # the end token is counted, not shown

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", metrics, re.M))

    drafts, accepted = (
        total("vllm:spec_decode_num_draft_tokens_total"),
        total("vllm:spec_decode_num_accepted_tokens_total"),
    )
    assert 0 < accepted <= drafts
    assert total("kvfence_spec_decode_num_accepted_tokens_total") == accepted
    assert total("vllm:spec_decode_num_accepted_tokens_per_pos_total") == accepted
    # vLLM's prefix-cache series, in tokens: the chat prompt was looked up (its full pages), none found
    assert total("vllm:prefix_cache_queries_total") > 0 and total("vllm:prefix_cache_hits_total") == 0
