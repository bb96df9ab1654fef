"""A prompt prefilling alone takes the longer chunk (`EngineConfig.alone_tokens`, `Scheduler.step_budget`);
with anyone else running or waiting, or a budget set explicitly, each step keeps the step's budget."""

from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import TINY, make_engine, tiny_tensors

from kvfence.config import LONG_PREFILL_TOKENS_CPU, STEP_TOKENS_ACCELERATOR, STEP_TOKENS_CPU, EngineConfig
from kvfence.engine.engine import LLMEngine
from kvfence.model.transformer import Transformer
from kvfence.sampling import SamplingParams

LONG = replace(TINY, context_length=4096)
PROMPT = LONG_PREFILL_TOKENS_CPU + 300  # two chunks alone, more at the step's budget


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    """The tiny model with a long window and the CPU's default budgets (none set)."""
    model = Transformer(LONG, tiny_tensors(0, LONG))
    return make_engine(model, num_pages=2400, max_num_batched_tokens=None, max_model_len=4096)


def test_an_explicit_budget_is_kept_and_only_cpu_defaults_grow() -> None:
    assert EngineConfig().alone_tokens("cpu") == LONG_PREFILL_TOKENS_CPU > STEP_TOKENS_CPU
    assert EngineConfig(max_num_batched_tokens=64).alone_tokens("cpu") == 64
    assert EngineConfig().alone_tokens("cuda") == STEP_TOKENS_ACCELERATOR


def _computed_per_step(engine: LLMEngine, tokens: list[int]) -> list[list[int]]:
    """Prompt tokens computed after each step, per request (a prompt of each token: no shared prefix),
    until every prompt is computed."""
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    requests = [engine.add_request([token] * PROMPT, params) for token in tokens]
    seen = []
    while any(r.num_computed_tokens < PROMPT for r in requests):
        engine.step()
        seen.append([min(r.num_computed_tokens, PROMPT) for r in requests])
    while engine.has_unfinished():
        engine.step()
    return seen


def test_a_prompt_alone_prefills_in_long_chunks(engine: LLMEngine) -> None:
    assert _computed_per_step(engine, [7]) == [[LONG_PREFILL_TOKENS_CPU], [PROMPT]]


def test_prompts_side_by_side_keep_the_step_budget(engine: LLMEngine) -> None:
    seen = _computed_per_step(engine, [8, 9])
    together = next(i for i, computed in enumerate(seen) if PROMPT in computed) + 1
    steps = [sum(b) - sum(a) for a, b in zip([[0, 0], *seen], seen, strict=False)]
    assert steps[: together - 1] == [STEP_TOKENS_CPU] * (together - 1)  # full steps while both prefill
    # The first prompt done (one output token), the second is alone: its rest in one long chunk.
    rest = 2 * PROMPT - sum(seen[together - 1])
    chunks = [LONG_PREFILL_TOKENS_CPU] * (rest // LONG_PREFILL_TOKENS_CPU)
    assert steps[together:] == chunks + (
        [rest % LONG_PREFILL_TOKENS_CPU] if rest % LONG_PREFILL_TOKENS_CPU else []
    )
