"""A draft model named as vLLM names it (`{"method": "draft_model", "model": ...}`), on the real SmolLM2 and
serving's default (fast) path: the draft model loads from its file with a pool of its own, the greedy text
is what decoding alone gives, in fewer steps; a draft model of another vocabulary is refused at start."""

from __future__ import annotations

import argparse

import pytest
from conftest import real_engine

from kvfence.cli_checks import speculative_config
from kvfence.config import SpeculativeConfig
from kvfence.engine.draft_model import DraftModelDrafter
from kvfence.engine.info import engine_info
from kvfence.model.gguf import GGUFModel
from kvfence.pins import file_sha256, packaged_model
from kvfence.sampling import SamplingParams

pytestmark = pytest.mark.real_model

ASK = [{"role": "user", "content": "Write a short poem about the sea, in four lines."}]


def test_a_draft_model_keeps_the_greedy_text_in_fewer_steps(smollm2: GGUFModel) -> None:
    """SmolLM2 drafting for itself (its own greedy picks, up to the rounding of a prompt fed in one chunk
    against one token at a time): the drafts are mostly accepted, the text is the same."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    spec = SpeculativeConfig("draft_model", 4, model=str(smollm2.path))
    outputs, steps = {}, {}
    for name, speculative in (("plain", None), ("draft", spec)):
        engine = real_engine(
            smollm2, activation_dtype="auto", num_pages=64, max_model_len=512, speculative=speculative
        )
        tok = engine.tokenizer
        assert tok is not None
        [request] = engine.generate([tok.encode(tok.apply_chat_template(ASK))], params)
        outputs[name], steps[name] = request.output_token_ids, engine.num_steps
        if speculative is not None:
            drafter = engine.scheduler.drafter
            assert isinstance(drafter, DraftModelDrafter) and drafter.model.activation_dtype == "int8"
            stats = engine.spec_stats
            assert stats.accepted_tokens > 0.7 * stats.draft_tokens
            assert drafter.allocator.num_free_pages == drafter.pool.num_pages
            pins = engine_info(engine)["speculative"]
            assert pins["draft_model_sha256"] == file_sha256(smollm2.path) and pins["draft_pool_fenced"]
    assert outputs["draft"] == outputs["plain"]
    assert steps["draft"] < steps["plain"] / 2


def test_a_draft_model_of_another_vocabulary_is_refused(smollm2: GGUFModel) -> None:
    spec = SpeculativeConfig("draft_model", 4, model=str(packaged_model("gemma3-270m")))
    with pytest.raises(ValueError, match="vocabulary"):
        real_engine(smollm2, num_pages=64, max_model_len=512, speculative=spec)


def test_the_cli_names_a_draft_model_as_it_names_the_model() -> None:
    text = '{"method": "draft_model", "model": "smollm2", "num_speculative_tokens": 3}'
    assert speculative_config(text).model == str(packaged_model("smollm2"))
    with pytest.raises(argparse.ArgumentTypeError):
        speculative_config(text.replace('"smollm2"', '"HuggingFaceTB/not-downloaded"'))  # fetches nothing
