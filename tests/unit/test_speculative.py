"""Speculative decoding (`--speculative-config`): drafts verified in one forward, each position a decode row
of its own, so greedy output is token for token what decoding alone gives; sampled output keeps the target
distribution; a rejected draft's KV is taken back by the fence (zeroed, `written` moved back, on the trail)
and a read of it leaks with the fence off and aborts with it on."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from conftest import make_engine, tiny_model

from kvfence.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from kvfence.engine.drafter import Drafted, Drafter, NgramDrafter
from kvfence.engine.engine import LLMEngine
from kvfence.engine.scheduler import Batch, draft_rows
from kvfence.model.transformer import Transformer
from kvfence.request import Status
from kvfence.sampling import SamplingParams
from kvfence.trail.reasons import UNWRITTEN_READ

NGRAM = SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
# Repetitive prompts: prompt lookup finds n-grams to copy, and the tiny model's greedy loops repeat too.
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9, 10], [3, 4, 3, 4, 3, 4, 3, 4, 3, 4, 3]]


def greedy_tokens(model: Transformer, prompts: list[list[int]], **settings: object) -> tuple[list, LLMEngine]:
    engine = make_engine(model, page_size=4, max_model_len=64, **settings)
    requests = engine.generate(prompts, GREEDY)
    assert all(r.status is Status.FINISHED for r in requests)
    return [r.output_token_ids for r in requests], engine


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "int8 fast path"])
@pytest.mark.parametrize("budget", [64, 6], ids=["whole prompts", "prefill chunks beside verification"])
def test_greedy_output_is_token_for_token_what_decoding_alone_gives(quantized: bool, budget: int) -> None:
    """Drafts right for 0 to K positions, varying step by step (some rows fully accepted, some not at all),
    while other rows prefill: every row's tokens are what it decodes without drafts, in fewer steps."""
    model = tiny_model(decode_matmul="auto", activation_dtype="auto") if quantized else tiny_model()
    plain, alone = greedy_tokens(model, PROMPTS, max_num_batched_tokens=budget)
    engine = make_engine(
        model, page_size=4, max_model_len=64, max_num_batched_tokens=budget, speculative=NGRAM
    )
    # Right for 0 to K positions as the length goes (n % 7, at most K): the adaptive draft lengths see full
    # accepts and cut ones, and verification reaches every position.
    engine.scheduler.drafter = Following(PROMPTS, plain, wrong_after=lambda n: min(n % 7, 4))
    requests = engine.generate(PROMPTS, GREEDY)
    assert [r.output_token_ids for r in requests] == plain
    stats = engine.spec_stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens and all(stats.accepted_per_position)
    assert engine.num_steps < alone.num_steps
    engine.check_integrity()
    assert engine.allocator.num_free_pages == engine.pool.num_pages


def test_ngram_speculation_on_a_model_that_repeats_itself() -> None:
    """The real drafter where the output copies the prompt: the tiny model made to repeat its input (every
    layer's output projection zero, the head reading the embedding's token back), so prompt lookup hits."""
    model = tiny_model()
    for layer in model.layers:
        for projection in (layer.o, layer.down):
            assert projection.dense is not None
            projection.dense.zero_()
    plain, _ = greedy_tokens(model, PROMPTS)
    spec, engine = greedy_tokens(model, PROMPTS, speculative=NGRAM)
    assert spec == plain
    assert engine.spec_stats.accepted_tokens > 0


# The drafts verified by a request whose drafts are all wrong, over its 23 decode steps: K each (less its
# output budget at the end) while the step's rows fit DRAFT_ROWS with K drafts each (up to 1 + 2 requests);
# otherwise its draft length halves to 0, then it probes with one draft after pauses of 1 and 2 tokens
# (verified at output positions 1, 2, 3, then 5 and 8; K again once the others have finished).
FULL, ADAPTED = [4] * 19 + [3, 2, 1], [4, 2, 1, 1, 1]


@pytest.mark.parametrize(("streams", "wrong_ones"), [(1, FULL), (2, FULL), (4, ADAPTED), (16, None)])
def test_adaptive_draft_lengths_keep_greedy_output_at_every_batch_size(
    streams: int, wrong_ones: list[int] | None
) -> None:
    """`streams` requests with drafts right for 0 to K positions as their lengths go, beside one whose drafts
    are all wrong: every row's tokens are what it decodes without drafts; the wrong one's verifications are
    `wrong_ones`; a step's drafts stay within `draft_rows`."""
    model = tiny_model()
    prompts = [PROMPTS[0] + [19]] + [PROMPTS[i % len(PROMPTS)] + [20 + i] for i in range(streams)]
    plain, _ = greedy_tokens(model, prompts, num_pages=256)
    engine = make_engine(model, page_size=4, max_model_len=64, num_pages=256, speculative=NGRAM)
    right, wrong = (Following(prompts, plain, wrong_after=f) for f in (lambda n: min(n % 7, 4), lambda _: 0))
    drafter = Asked(right, wrong, prompts[0])
    engine.scheduler.drafter = drafter
    steps: list[tuple[int, int]] = []  # (decode rows as the step is scheduled, its drafts)
    schedule = engine.scheduler.schedule

    def recorded() -> Batch:
        decode = sum(r.num_tokens - r.num_computed_tokens <= 1 for r in engine.scheduler.running)
        batch = schedule()
        steps.append((decode, sum(len(r.draft_token_ids) for r in batch.requests)))
        return batch

    engine.scheduler.schedule = recorded  # type: ignore[method-assign]
    requests = engine.generate(prompts, GREEDY)
    assert [r.output_token_ids for r in requests] == plain
    stats = engine.spec_stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens and all(stats.accepted_per_position)
    if wrong_ones is not None:  # at 16 + 1 rows no step drafts until some have finished
        assert [k for k in drafter.asked[requests[0].request_id] if k][: len(wrong_ones)] == wrong_ones
    assert all(drafts <= draft_rows(decode) for decode, drafts in steps)
    assert engine.allocator.num_free_pages == engine.pool.num_pages


class Asked(Drafter):
    """`right`'s drafts, but `wrong`'s for the request of prompt `first`, whose drafts are all wrong; records
    the drafts each verification was given, by request."""

    def __init__(self, right: Drafter, wrong: Drafter, first: list[int]) -> None:
        self.right, self.wrong, self.first = right, wrong, first
        self.asked: dict[str, list[int]] = {}

    def propose(self, request: Drafted, k: int) -> list[int]:
        tokens = request.all_token_ids
        drafter = self.wrong if tokens[: len(self.first)] == self.first else self.right
        drafts = drafter.propose(request, k)
        self.asked.setdefault(request.request_id, []).append(len(drafts))
        return drafts


class Following(Drafter):
    """Drafts each prompt's greedy continuation wherever a sequence is on it, the drafts after the first
    `wrong_after(length)` of them shifted off it (wrong)."""

    def __init__(
        self,
        prompts: list[list[int]],
        outputs: list[list[int]],
        wrong_after: Callable[[int], int] = lambda _: MAX_SPECULATIVE_TOKENS,
    ) -> None:
        self.paths = [p + o for p, o in zip(prompts, outputs, strict=True)]
        self.wrong_after = wrong_after

    def propose(self, request: Drafted, k: int) -> list[int]:
        tokens = request.all_token_ids
        n = len(tokens)
        path = next((p for p in self.paths if p[:n] == list(tokens)), None)
        if path is None:
            return []
        drafts, keep = path[n : n + k], self.wrong_after(n)
        return drafts[:keep] + [(t + 1) % 256 for t in drafts[keep:]]


class Scripted(Drafter):
    """Proposes what `script` says follows each sequence length: known right or wrong drafts."""

    def __init__(self, script: dict[int, list[int]]) -> None:
        self.script = script

    def propose(self, request: Drafted, k: int) -> list[int]:
        return self.script.get(len(request.all_token_ids), [])[:k]


def scripted_engine(model: Transformer, script: dict[int, list[int]], **settings: object) -> LLMEngine:
    engine = make_engine(model, page_size=4, max_model_len=64, speculative=NGRAM, **settings)
    engine.scheduler.drafter = Scripted(script)
    return engine


def wrong_drafts(prompt: list[int], reference: list[int], keep: int = 0) -> dict[int, list[int]]:
    """At every length, `keep` right drafts and then wrong ones (the reference's next tokens, shifted)."""
    script = {}
    for done in range(len(reference)):
        nexts = reference[done : done + NGRAM.num_speculative_tokens]
        script[len(prompt) + done] = nexts[:keep] + [(t + 1) % 256 for t in nexts[keep:]]
    return script


@pytest.mark.parametrize("keep", [0, 1, 2])
def test_rejected_drafts_are_taken_back_zeroed_and_on_the_trail(keep: int) -> None:
    model = tiny_model()
    prompt = PROMPTS[0]
    [reference], _ = greedy_tokens(model, [prompt])
    engine = scripted_engine(model, wrong_drafts(prompt, reference, keep))
    request = engine.add_request(prompt, GREEDY)
    size = engine.pool.page_size
    while not request.is_finished:
        verifications = engine.spec_stats.drafts
        engine.step()
        if request.is_finished or not request.draft_tail or engine.spec_stats.drafts == verifications:
            continue  # the tail is the last verification's: check it on the step that made it
        mark, tail = request.num_computed_tokens, request.draft_tail
        for position in range(mark, mark + tail):  # every slot past the kept tokens: zero, unreadable
            page = request.record.entry(position // size)[0]
            assert not engine.pool.kv[:, :, page, position % size].any()
        last = request.record.entry((mark - 1) // size)[0] if mark % size else None
        if last is not None:
            assert engine.pool.written[last] == mark % size  # the watermark moved back to the kept tokens
    assert request.output_token_ids == reference
    trail = [e for e in engine.events.for_request(request.request_id) if e["kind"] == "drafts_rolled_back"]
    assert trail[0]["slots"] == NGRAM.num_speculative_tokens - keep and all(e["slots"] > 0 for e in trail)
    stats = engine.spec_stats
    assert stats.accepted_per_position[0] == (stats.drafts if keep else 0)
    assert sum(stats.accepted_per_position[keep:]) == 0


@pytest.mark.parametrize("isolation", [False, True], ids=["fence off: leak", "fence on: abort"])
def test_a_read_of_a_rejected_draft_leaks_without_the_fence_and_aborts_with_it(isolation: bool) -> None:
    """Fault `read_rejected_draft`: a request reads its context through the slots its rejected drafts were
    written to. Fence off, nothing took them back: its logits come from the drafts' KV, not its own. Fence on,
    the fence finds them unwritten and aborts that request only; its neighbour (logprobs: no drafts) ends
    with its own tokens."""
    model = tiny_model()
    prompt, neighbour = PROMPTS[0], PROMPTS[1]
    [reference, neighbour_ref], _ = greedy_tokens(model, [prompt, neighbour])
    seen: dict[str, list[torch.Tensor]] = {}
    engine = scripted_engine(model, wrong_drafts(prompt, reference), isolation=isolation)
    engine.faults.arm("read_rejected_draft", 1.0, times=1)
    engine.runner.logits_observer = lambda requests, logits: [
        seen.setdefault(r.request_id, []).append(row.clone())
        for r, row in zip(requests, logits, strict=False)
    ]
    victim = engine.add_request(prompt, GREEDY)
    other = engine.add_request(neighbour, SamplingParams(max_tokens=24, ignore_eos=True, logprobs=1))
    while engine.has_unfinished():
        engine.step()
    assert [e.fault for e in engine.faults.effects] == ["read_rejected_draft"]
    assert other.status is Status.FINISHED and other.output_token_ids == neighbour_ref
    if isolation:
        assert (victim.status, victim.finish_reason) == (Status.ABORTED, UNWRITTEN_READ)
        assert engine.integrity_aborts[UNWRITTEN_READ] == 1
    else:
        assert victim.status is Status.FINISHED
        solo = make_engine(model, page_size=4, max_model_len=64)
        expected: list[torch.Tensor] = []
        solo.runner.logits_observer = lambda requests, logits: expected.extend(logits.clone())
        solo.generate([prompt], GREEDY)
        # The first verification's rows match decoding alone; the faulted one, after it, does not.
        assert torch.equal(seen[victim.request_id][0], expected[0])
        assert any(
            not torch.equal(a, b) for a, b in zip(seen[victim.request_id][1:], expected[1:], strict=False)
        )


def test_sampled_output_keeps_the_target_distribution() -> None:
    """Seeded requests at temperature 1: the second token's frequencies with drafts of the greedy path
    (often accepted) match those without speculation, and are not the drafts' (total variation < 0.08,
    where always accepting the drafts would give about 0.5 here)."""
    model, prompt = tiny_model(), PROMPTS[2]
    [reference], _ = greedy_tokens(model, [prompt])
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=seed) for seed in range(600)]

    def second_tokens(speculate: bool) -> tuple[Counter[int], LLMEngine]:
        engine = make_engine(model, page_size=4, max_model_len=64, num_pages=512, max_num_seqs=128)
        if speculate:
            engine = scripted_engine(model, {}, num_pages=512, max_num_seqs=128)
            engine.scheduler.drafter = Following([prompt], [reference])
        requests = engine.generate([prompt] * len(params), params)
        return Counter(r.output_token_ids[1] for r in requests), engine

    plain, _ = second_tokens(False)
    spec, engine = second_tokens(True)
    assert engine.spec_stats.accepted_tokens > 0
    total_variation = sum(abs(plain[t] - spec[t]) for t in plain | spec) / (2 * len(params))
    assert total_variation < 0.08
    assert spec[reference[1]] < len(params) * 0.9


@dataclass
class Tokens:
    """A request as a drafter reads it."""

    all_token_ids: list[int]
    request_id: str = "r"
    tenant: str = "t"


def test_ngram_drafts_follow_the_latest_earlier_match_of_the_longest_suffix() -> None:
    drafter = NgramDrafter(lookup_min=1, lookup_max=3)
    assert drafter.propose(Tokens([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3]), 2) == [7, 1]  # 3-gram, latest match
    assert drafter.propose(Tokens([4, 5, 6, 5]), 3) == [6, 5, 6]  # a 1-gram two back: around the loop
    assert drafter.propose(Tokens([1, 2, 3]), 3) == []  # nothing repeats
    assert NgramDrafter(lookup_min=2, lookup_max=2).propose(Tokens([4, 5, 6, 5]), 3) == []


def test_rows_that_must_sample_alone_are_not_drafted() -> None:
    model = tiny_model()
    engine = make_engine(model, page_size=4, max_model_len=64, speculative=NGRAM)
    asked = [
        SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=1),  # no room: the one token a step produces is all it may
    ]
    requests = engine.generate([PROMPTS[0]] * len(asked), asked)
    assert engine.spec_stats.drafts == 0 and all(r.status is Status.FINISHED for r in requests)


@pytest.mark.parametrize(
    ("given", "refusal"),
    [
        ({"method": "eagle", "model": "x.gguf", "num_speculative_tokens": 3}, "not implemented"),
        ({"method": "draft_model", "num_speculative_tokens": 3}, "'model'"),
        (
            {"method": "draft_model", "model": "x.gguf", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
            "prompt_lookup_max",
        ),
        ({"method": "ngram", "model": "x.gguf", "num_speculative_tokens": 3}, "model"),
        (
            {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 4},
            "disable_by_batch_size",
        ),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, r"\[1, 16\]"),
        ({"method": "ngram", "num_speculative_tokens": "3"}, "integer"),
        (
            {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "min",
        ),
    ],
)
def test_a_speculative_config_is_vllms_and_anything_else_is_refused_by_name(
    given: dict, refusal: str
) -> None:
    with pytest.raises(ValueError, match=refusal):
        SpeculativeConfig.from_dict(given)
    one = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    )
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (4, 4)  # vLLM's: the other one equals it
    both = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (5, 5)
