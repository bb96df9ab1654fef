"""The offline API (kvfence.offline) on the tiny random model: token-id prompts, batching, order, choices and
vLLM's SamplingParams. Text, chat and the server's answers: tests/integration/test_offline_smollm2.py."""

from __future__ import annotations

import random

import pytest
from conftest import make_engine

import kvfence
from kvfence.model.transformer import Transformer
from kvfence.offline import LLM, SamplingParams
from kvfence.pins import packaged_model
from kvfence.sampling import SamplingParams as EngineParams

_rng = random.Random(48)
PROMPTS = [[_rng.randrange(256) for _ in range(length)] for length in (3, 11, 6, 17)]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def offline(tiny: Transformer, **overrides: object) -> LLM:
    return LLM.from_engine(make_engine(tiny, **overrides))


def solo(tiny: Transformer, prompt: list[int], params: EngineParams) -> list[int]:
    """What the engine alone gives one prompt (its own offline loop, a fresh engine)."""
    return make_engine(tiny).generate([prompt], params)[0].output_token_ids


def test_the_package_exports_the_offline_api() -> None:
    assert kvfence.LLM is LLM and kvfence.SamplingParams is SamplingParams


def test_a_batch_comes_back_in_input_order_with_each_prompts_solo_tokens(tiny: Transformer) -> None:
    llm = offline(tiny)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    engine_params = EngineParams(max_tokens=6, ignore_eos=True)
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    for output, prompt in zip(outputs, PROMPTS, strict=True):
        (choice,) = output.outputs
        assert choice.token_ids == solo(tiny, prompt, engine_params)
        assert (choice.index, choice.finish_reason, choice.text) == (0, "length", "")
        assert choice.cumulative_logprob is None and choice.logprobs is None  # none asked for
    assert len({o.request_id for o in outputs}) == len(PROMPTS)
    assert (
        not llm.engine.has_unfinished() and llm.engine.allocator.num_free_pages == llm.engine.pool.num_pages
    )


def test_one_prompt_alone_and_params_per_prompt(tiny: Transformer) -> None:
    llm = offline(tiny)
    (single,) = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False)
    assert single.outputs[0].token_ids == solo(tiny, PROMPTS[0], EngineParams(max_tokens=6, ignore_eos=True))
    lengths = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in (2, 5)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], lengths, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [2, 5]
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], lengths, use_tqdm=False)


def test_n_gives_n_choices_each_its_seeded_solo_sample(tiny: Transformer) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True)
    (output,) = offline(tiny).generate({"prompt_token_ids": PROMPTS[1]}, params, use_tqdm=False)
    assert [c.index for c in output.outputs] == [0, 1, 2]
    for choice in output.outputs:  # fork i draws with seed + i (engine.py _fork_of)
        seeded = EngineParams(max_tokens=5, temperature=1.0, seed=7 + choice.index, ignore_eos=True)
        assert choice.token_ids == solo(tiny, PROMPTS[1], seeded)
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1


def test_logprobs_are_vllms_shape_and_sum_to_the_cumulative(tiny: Transformer) -> None:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    (output,) = offline(tiny).generate({"prompt_token_ids": PROMPTS[2]}, params, use_tqdm=False)
    choice = output.outputs[0]
    assert choice.logprobs is not None and len(choice.logprobs) == 4
    for token, position in zip(choice.token_ids, choice.logprobs, strict=True):
        assert token in position and 2 <= len(position) <= 3
        assert position[token].rank == 1  # greedy: the sampled token is the likeliest
    assert choice.cumulative_logprob == pytest.approx(
        sum(p[t].logprob for t, p in zip(choice.token_ids, choice.logprobs, strict=True))
    )


def test_a_refused_prompt_names_its_place_and_leaves_nothing_running(tiny: Transformer) -> None:
    llm = offline(tiny)
    too_long = {"prompt_token_ids": [1] * 45}  # + 6 > the 48-token window
    with pytest.raises(ValueError, match="maximum context length") as caught:
        llm.generate([{"prompt_token_ids": PROMPTS[0]}, too_long], GREEDY, use_tqdm=False)
    assert "(prompt 1)" in caught.value.__notes__
    assert not llm.engine.has_unfinished() and not llm.engine.requests


def test_prompts_the_api_cannot_take_are_refused_by_name(tiny: Transformer) -> None:
    llm = offline(tiny)
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt_token_ids": [1], "multi_modal_data": {}}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 0: a string, or a dict"):  # vLLM's old bare id lists
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="no tokenizer"):  # the tiny model has none: text cannot be encoded
        llm.generate("hello", GREEDY, use_tqdm=False)


def test_allowed_token_ids_and_truncate_prompt_tokens_reach_the_engine(tiny: Transformer) -> None:
    allowed = [5, 9, 200]
    params = SamplingParams(
        temperature=1.0,
        seed=3,
        max_tokens=8,
        ignore_eos=True,
        allowed_token_ids=allowed,
        truncate_prompt_tokens=4,
    )
    (output,) = offline(tiny).generate({"prompt_token_ids": PROMPTS[3]}, params, use_tqdm=False)
    assert output.prompt_token_ids == PROMPTS[3][-4:]  # the last 4, as vLLM keeps them
    tokens = output.outputs[0].token_ids
    assert set(tokens) <= set(allowed)
    seeded = EngineParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True, allowed_token_ids=allowed)
    assert tokens == solo(tiny, PROMPTS[3][-4:], seeded)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):  # more than the 48-token window
        offline(tiny).generate(
            {"prompt_token_ids": [1]}, SamplingParams(truncate_prompt_tokens=49), use_tqdm=False
        )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("detokenize", False),
        ("structured_outputs", {"json": {}}),
        ("best_of", 3),
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("logprobs", -1),  # vLLM's "the whole vocabulary"
        ("seed", -1),
        ("n", 0),
    ],
)
def test_a_value_kvfence_cannot_honour_is_a_value_error_naming_it(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_a_field_vllm_does_not_have_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match="temprature"):
        SamplingParams(temprature=0.5)  # type: ignore[call-arg]


def test_vllm_conventions_map_onto_the_engines_params() -> None:
    assert SamplingParams().temperature == 1.0 and SamplingParams().max_tokens == 16  # vLLM's defaults
    params = SamplingParams(temperature=1e-6, top_k=-1, stop="END", max_tokens=None, n=2, best_of=2)
    engine = params.engine_params(default_max_tokens=40, cache_salt="s")
    assert (engine.temperature, engine.top_k, engine.stop) == (0.0, 0, ["END"])  # tiny temperature: greedy
    assert (engine.max_tokens, engine.cache_salt) == (40, "s")


def test_engine_options_are_engine_config_fields_by_name() -> None:
    from kvfence.offline.llm import engine_config

    config = engine_config(None, True, {"kv_cache_memory": "1GiB", "max_model_len": 512})
    assert (config.kv_cache_memory, config.max_model_len, config.decode_graphs) == (2**30, 512, False)
    assert config.device == "auto" and config.model is None
    with pytest.raises(TypeError, match="tensor_parallel_size"):
        engine_config(None, False, {"tensor_parallel_size": 2})
    draft = {"method": "draft_model", "model": "smollm2", "num_speculative_tokens": 3}
    spec = engine_config(None, True, {"speculative_config": draft}).speculative
    assert spec is not None and (spec.method, spec.num_speculative_tokens) == ("draft_model", 3)
    assert spec.model == str(packaged_model("smollm2"))  # named as the model is
    with pytest.raises(ValueError, match=r"speculative_config: .*prompt_lookup_max"):
        engine_config(None, True, {"speculative_config": {**draft, "prompt_lookup_max": 3}})
