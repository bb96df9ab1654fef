"""The sampler against the formulas: logprobs, penalties, logit_bias, min_p, top_k, defaults, and per-row
isolation (a row's result is its solo result whatever shares the batch; a bad row fails alone)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import LogitsRecorder, make_engine

from kvfence.engine import sampler
from kvfence.engine.output import RequestOutput
from kvfence.engine.sampler import (
    CANDIDATE_STAGES,
    CANDIDATES,
    _inverse_cdf,
    _nucleus_kernel,
    _pick,
    adjusted_rows,
    candidates,
    make_generator,
    native_draw,
    nucleus,
    raw_logprobs,
    sample,
    token_logprobs,
)
from kvfence.model.transformer import StepInputs, Transformer
from kvfence.request import Status
from kvfence.sampling import SamplingDefaults, SamplingParams

VOCAB = 40


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def counts(history: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(history, dtype=torch.long), minlength=VOCAB).float()


def test_penalties_and_bias_follow_their_formulas() -> None:
    raw = logits(3)
    prompt, output = [1, 2, 3, 3], [3, 5, 5, 5, 7]
    params = [
        SamplingParams(repetition_penalty=1.7),
        SamplingParams(frequency_penalty=0.6, presence_penalty=-0.4),
        SamplingParams(logit_bias={4: 9.5, 0: -100.0}, presence_penalty=1.0),
    ]
    got = adjusted_rows(raw, params, [True] * 3, [prompt] * 3, [output] * 3)
    seen = (counts(prompt) + counts(output)) > 0
    # repetition (HF/vLLM): a seen token's positive logit divided by the penalty, a negative one multiplied.
    want0 = torch.where(seen, torch.where(raw[0] > 0, raw[0] / 1.7, raw[0] * 1.7), raw[0])
    # frequency and presence (OpenAI): over the output only.
    want1 = raw[1] - 0.6 * counts(output) - (-0.4) * (counts(output) > 0).float()
    want2 = raw[2].clone()
    want2[4] += 9.5
    want2[0] -= 100.0
    want2 -= 1.0 * (counts(output) > 0).float()
    for row, want in enumerate((want0, want1, want2)):
        got_row = got[row]
        assert got_row is not None
        torch.testing.assert_close(got_row, want)


def test_rows_without_bias_or_penalty_are_left_alone() -> None:
    params = [SamplingParams(), SamplingParams(temperature=0.7, top_k=5, min_p=0.1)]
    assert adjusted_rows(logits(2), params, [True, True], None, None) == {}


def reference_probabilities(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The per-row definition the batched sampler must meet (kvfence's sampler before it was batched):
    softmax(logits / temperature) without the tokens min_p, top_k and top_p drop, in that order, top_p
    over the whole row sorted: a token is dropped when the mass before it already reaches top_p."""
    scaled = (logits.float() - logits.max()) / p.temperature
    if p.min_p > 0:
        scaled = scaled.masked_fill(scaled < math.log(p.min_p), float("-inf"))
    if p.top_k > 0:
        kth = torch.topk(scaled, min(p.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = (probs.cumsum(-1) - probs) >= p.top_p
        drop[0] = False
        scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.softmax(scaled, dim=-1)


def test_min_p_and_top_k_drop_what_their_formulas_drop() -> None:
    row = logits(1)
    full = torch.softmax(row[0] / 0.8, dim=-1)
    by_min_p = batch_probabilities(row, [SamplingParams(temperature=0.8, min_p=0.05, top_k=VOCAB)])[0]
    kept = full >= 0.05 * full.max()
    torch.testing.assert_close(by_min_p, torch.where(kept, full, 0.0) / full[kept].sum())
    by_top_k = batch_probabilities(row, [SamplingParams(temperature=0.8, top_k=4)])[0]
    top = torch.topk(row[0], 4).indices
    want = torch.zeros_like(full)
    want[top] = full[top] / full[top].sum()
    torch.testing.assert_close(by_top_k, want)


def test_greedy_rows_apply_bias_and_penalties_before_argmax() -> None:
    raw = logits(2)
    low = int(raw[0].argmin())
    top = int(raw[1].argmax())
    params = [SamplingParams(logit_bias={low: 100.0}), SamplingParams(frequency_penalty=2.0)]
    tokens = sample(raw, params, [None, None], [[], []], [[], [top] * 50])
    assert tokens[0] == low
    assert tokens[1] != top and tokens[1] == int(raw[1].scatter(0, torch.tensor([top]), -1e9).argmax())


def test_rows_in_one_batch_equal_their_solo_results_and_a_bad_row_fails_alone() -> None:
    raw = logits(5, seed=3)
    bad_bias = SamplingParams(temperature=0.9, logit_bias={VOCAB + 5: 1.0}, seed=1)
    nan_penalty = SamplingParams(frequency_penalty=0.5)
    nan_penalty.presence_penalty = float("nan")  # slipped past validation
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.9, top_k=8, min_p=0.02, repetition_penalty=1.3, seed=7),
        bad_bias,
        SamplingParams(temperature=1.1, frequency_penalty=0.8, logit_bias={3: 4.0}, seed=9),
        nan_penalty,
    ]
    prompts, outputs = [[1, 2]] * 5, [[3, 3, 4]] * 5
    batch = sample(raw, params, [make_generator(p, raw.device) for p in params], prompts, outputs)
    solo = [
        sample(raw[r : r + 1], [p], [make_generator(p, raw.device)], [prompts[r]], [outputs[r]])[0]
        for r, p in enumerate(params)
    ]
    assert batch == solo
    assert batch[2] is None and batch[4] is None
    assert all(t is not None for t in (batch[0], batch[1], batch[3]))


def test_logprobs_are_log_softmax_of_the_raw_logits_at_the_sampled_token() -> None:
    raw = logits(3)
    params = [SamplingParams(logprobs=3), SamplingParams(), SamplingParams(temperature=1.0, logprobs=0)]
    kept = raw_logprobs(raw, params)
    raw.fill_(0.0)  # a grammar's mask may edit the logits in place after this: logprobs keep the raw ones
    found = token_logprobs(kept, [5, 6, 7], params)
    assert set(found) == {0, 2}
    want = torch.log_softmax(logits(3), dim=-1)
    assert found[0].token == 5 and math.isclose(found[0].logprob, float(want[0, 5]), rel_tol=1e-6)
    values, ids = torch.topk(want[0], 3)
    assert [t for t, _ in found[0].top] == ids.tolist()
    assert [lp for _, lp in found[0].top] == pytest.approx(values.tolist())
    assert found[2].top == [] and math.isclose(found[2].logprob, float(want[2, 7]), rel_tol=1e-6)


def test_the_engine_reports_logprobs_of_the_logits_it_sampled_from(tiny: Transformer) -> None:
    engine = make_engine(tiny)
    recorder = LogitsRecorder(engine)
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=2, logprobs=2, ignore_eos=True)
    request = engine.add_request(list(range(1, 10)), params)
    plain = engine.add_request(list(range(3, 9)), SamplingParams(max_tokens=6, ignore_eos=True))
    outputs: list[RequestOutput] = []
    while engine.has_unfinished():
        outputs += engine.step()
    mine = [lp for o in outputs if o.request_id == request.request_id for lp in o.logprobs or []]
    assert all(o.logprobs is None for o in outputs if o.request_id == plain.request_id)
    assert [lp.token for lp in mine] == request.output_token_ids
    for entry, step_logits in zip(mine, recorder.steps[request.request_id], strict=True):
        want = torch.log_softmax(step_logits, dim=-1)
        assert entry.logprob == pytest.approx(float(want[entry.token]), rel=1e-5)
        assert [t for t, _ in entry.top] == torch.topk(want, 2).indices.tolist()


def test_penalised_requests_batched_equal_their_solo_runs(tiny: Transformer) -> None:
    """Penalties read each request's own history, step after step, whatever shares the batch."""
    params = [
        SamplingParams(max_tokens=8, repetition_penalty=1.5, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.9, presence_penalty=1.5, seed=4, ignore_eos=True),
        SamplingParams(max_tokens=8, frequency_penalty=2.0, logit_bias={7: 3.0}, ignore_eos=True),
    ]
    prompts = [[5, 6, 7, 5, 6], [9, 9, 9, 2], [1, 2, 3, 4, 5, 6]]
    solo = [
        make_engine(tiny).generate([p], sp)[0].output_token_ids for p, sp in zip(prompts, params, strict=True)
    ]
    done = make_engine(tiny).generate(prompts, params)
    assert [r.status for r in done] == [Status.FINISHED] * 3
    assert [r.output_token_ids for r in done] == solo
    plain = make_engine(tiny).generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [plain[0].output_token_ids, plain[2].output_token_ids] != [solo[0], solo[2]]  # penalties bit


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("min_p", 1.5),
        ("logprobs", 21),
        ("logit_bias", {3: 101.0}),
        ("logit_bias", {-1: 1.0}),
    ],
)
def test_out_of_range_values_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field.split("_")[0]):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_logit_bias_keys_arriving_as_json_strings_become_ids() -> None:
    assert SamplingParams(logit_bias={"12": 3}).logit_bias == {12: 3.0}  # type: ignore[dict-item]


def test_defaults_an_override_then_the_gguf_then_greedy() -> None:
    assert SamplingDefaults.resolve({}, {}) == SamplingDefaults(temperature=0.0, top_p=1.0)
    gguf = {"general.sampling.temp": 0.6, "general.sampling.top_p": 0.95, "general.sampling.top_k": 40}
    got = SamplingDefaults.resolve(gguf, {"temperature": 0.3, "top_p": None})
    assert got == SamplingDefaults(temperature=0.3, top_p=0.95, top_k=40)
    with pytest.raises(ValueError, match="top_p"):
        SamplingDefaults.resolve({"general.sampling.top_p": 0.0}, {})


def batch_probabilities(rows: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """What `candidates` keeps of each row, scattered back over the vocabulary."""
    temperature = torch.tensor([p.temperature for p in params]).unsqueeze(1)
    scaled = (rows - rows.max(dim=-1, keepdim=True).values) / temperature
    floor = torch.tensor([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params]).unsqueeze(1)
    probs, ids, wide = candidates(scaled.masked_fill(scaled < floor, -math.inf), params)
    assert not wide
    return torch.zeros_like(rows).scatter(1, ids, probs)


def test_batched_truncation_keeps_what_the_per_row_formulas_keep() -> None:
    """top_k, top_p and min_p over a batch's candidates give each row the distribution `probabilities`
    gives it alone (sorting the whole vocabulary): the same tokens kept, the same probabilities."""
    gen = torch.Generator().manual_seed(11)
    rows = torch.randn(64, 3000, generator=gen) * 4
    params = [
        SamplingParams(
            temperature=float(0.2 + 1.5 * torch.rand(1, generator=gen)),
            top_k=int(torch.randint(0, 60, (1,), generator=gen)),
            top_p=float(0.05 + 0.95 * torch.rand(1, generator=gen)),
            min_p=float(0.2 * torch.rand(1, generator=gen)) if i % 3 == 0 else 0.0,
        )
        for i in range(len(rows))
    ]
    got = batch_probabilities(rows, params)
    for row, p in enumerate(params):
        want = reference_probabilities(rows[row], p)
        assert torch.equal(got[row] > 0, want > 0), f"row {row}: another set of tokens kept"
        torch.testing.assert_close(got[row], want, rtol=1e-5, atol=1e-7)


def test_a_nucleus_wider_than_the_candidates_is_cut_by_a_threshold_over_the_whole_row() -> None:
    """Flat rows keep far more than CANDIDATES tokens at top_p 0.9: `candidates` says so, and `nucleus`
    keeps, without sorting, exactly the tokens the per-row definition keeps; `sample` then draws such a
    row from all of them (tokens beyond the first CANDIDATES come out)."""
    gen = torch.Generator().manual_seed(8)
    flat = torch.randn(6, 4 * CANDIDATES, generator=gen) * 0.5
    params = [SamplingParams(temperature=1.0, top_p=p) for p in (0.9, 0.5, 0.99, 0.95, 0.7, 0.6)]
    _, _, wide = candidates(flat - flat.max(dim=-1, keepdim=True).values, params)
    assert wide == set(range(6))
    got = nucleus(flat - flat.max(dim=-1, keepdim=True).values, torch.tensor([[p.top_p] for p in params]))
    for row, p in enumerate(params):
        want = reference_probabilities(flat[row], p)
        assert torch.equal(got[row] > 0, want > 0), f"row {row}: another set of tokens kept"
        torch.testing.assert_close(got[row], want, rtol=1e-4, atol=1e-8)
    tokens = sample(flat[:1].expand(200, -1), params[:1] * 200, [None] * 200)
    assert all(t is not None for t in tokens) and max(tokens) >= CANDIDATES  # type: ignore[type-var]


def test_unseeded_rows_draw_from_their_distribution() -> None:
    """Unseeded rows are drawn in one multinomial from the batch's noise: over 20,000 draws with fixed
    noise, each token comes out at its probability (within four standard deviations)."""
    probs = torch.tensor([[0.5, 0.25, 0.15, 0.07, 0.03]]).expand(20_000, -1).contiguous()
    ids = torch.arange(5).expand(20_000, -1)
    noise = torch.Generator().manual_seed(3)
    drawn = torch.tensor(_pick(probs, ids, [None] * 20_000, noise))
    freq = torch.bincount(drawn, minlength=5).float() / 20_000
    sigma = (probs[0] * (1 - probs[0]) / 20_000).sqrt()
    assert ((freq - probs[0]).abs() < 4 * sigma).all(), freq


def test_prompt_logprobs_are_each_prompt_tokens_log_softmax_at_the_position_before(
    tiny: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the chunking (prefill in chunks of 4 here) and the prefix cache (a second request with the
    same prompt computes it again: a cached page has no logits), every prompt token but the first gets
    log_softmax of the logits of the position before it, with the top k, delivered with the first token."""
    prompt = [5, 17, 3, 99, 42, 7, 1, 250, 13, 8]
    params = SamplingParams(max_tokens=2, prompt_logprobs=3)
    engine = make_engine(tiny, max_num_batched_tokens=4)
    first = engine.add_request(prompt, params)
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.request_id == first.request_id]
    assert outputs[0].prompt_logprobs is not None and all(o.prompt_logprobs is None for o in outputs[1:])
    entries = outputs[0].prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    again = make_engine(tiny).generate([prompt, prompt], params)  # the second would hit the first's pages
    assert all(len(r.prompt_logprobs) == len(prompt) - 1 for r in again)
    # The reference: the whole prompt in one step, every position's logits.
    reference = make_engine(tiny)
    recorder_logits = []
    forward = reference.model.forward

    def all_rows(inputs: StepInputs, kv: torch.Tensor) -> torch.Tensor:
        if inputs.prefills:
            inputs.logits_rows = torch.arange(len(inputs.input_ids))
            recorder_logits.append(forward(inputs, kv))
            inputs.logits_rows = inputs.logits_rows[-1:]
        return forward(inputs, kv)

    monkeypatch.setattr(reference.model, "forward", all_rows)
    reference.generate([prompt], SamplingParams(max_tokens=1))
    logp = torch.log_softmax(recorder_logits[0], dim=-1)
    for position in range(1, len(prompt)):
        entry = entries[position]
        assert entry is not None and entry.token == prompt[position]
        assert math.isclose(entry.logprob, float(logp[position - 1, prompt[position]]), abs_tol=1e-4)
        assert [t for t, _ in entry.top] == torch.topk(logp[position - 1], 3).indices.tolist()


@pytest.mark.parametrize("path", ["tensor ops", "C"])
def test_each_candidate_stage_draws_only_what_the_row_keeps(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows whose nucleus fits the 64 best, the 1,024 best, or neither are drawn by the stage that holds
    it: every drawn token is one the per-row definition keeps, and the wider rows do draw beyond 64 and
    beyond 1,024 tokens (each stage ran). The same of csrc/nucleus.c, which draws such rows where it is
    built (seeded rows always take the tensor ops)."""
    if path == "tensor ops":
        monkeypatch.setattr(sampler, "_nucleus_kernel", lambda: None)
    gen = torch.Generator().manual_seed(21)
    base = torch.randn(4 * CANDIDATES, generator=gen)
    rows = torch.stack([base * 12, base * 2.5, base * 0.3])  # nuclei of ~tens, hundreds, thousands
    params = SamplingParams(temperature=1.0, top_p=0.9)
    kept = [reference_probabilities(row, params) > 0 for row in rows]
    widths = [int(k.sum()) for k in kept]
    assert widths[0] < CANDIDATE_STAGES[0] < widths[1] < CANDIDATES < widths[2], widths
    batch = rows.repeat_interleave(300, dim=0)
    tokens = sample(batch, [params] * len(batch), [None] * len(batch), noise=gen)
    for which in range(3):
        drawn = torch.tensor(tokens[which * 300 : (which + 1) * 300])
        assert bool(kept[which][drawn].all()), f"row {which}: a token its definition drops"
    rank = torch.argsort(torch.argsort(rows, dim=1, descending=True), dim=1)  # each token's place in its row
    assert int(rank[1][torch.tensor(tokens[300:600])].max()) >= CANDIDATE_STAGES[0]
    assert int(rank[2][torch.tensor(tokens[600:])].max()) >= CANDIDATES


def test_the_draw_follows_the_probabilities_and_never_a_zero() -> None:
    """Unseeded rows are drawn by inverse CDF: frequencies follow the probabilities, and a token of
    probability 0 (inside the row or at its end) never comes out."""
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2, 0.0, 0.0]]).expand(20000, -1)
    drawn = _inverse_cdf(probs, torch.Generator().manual_seed(3)).squeeze(1)
    counts = torch.bincount(drawn, minlength=6).double() / len(drawn)
    assert counts[1] == counts[4] == counts[5] == 0
    assert torch.allclose(counts[[0, 2, 3]], torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64), atol=0.015)


def scaled_as_drawn(rows: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """What `draw` hands the truncation: logits less their max, over the temperature, min_p's drops -inf."""
    scaled = rows - rows.max(dim=-1, keepdim=True).values
    scaled = scaled / torch.tensor([[p.temperature] for p in params])
    floor = torch.tensor([[math.log(p.min_p) if p.min_p > 0 else -math.inf] for p in params])
    return scaled.masked_fill(scaled < floor, -math.inf)


def test_the_c_draw_keeps_what_the_per_row_formulas_keep() -> None:
    """csrc/nucleus.c, which draws the unseeded truncated rows: on sharp and flat rows under random top_k,
    top_p and min_p, the tokens it keeps (all at or above its edge) are the per-row definition's, and the
    token it draws is one of them."""
    assert _nucleus_kernel() is not None, "CI has a C compiler: a silent fallback would leave it untested"
    gen = torch.Generator().manual_seed(13)
    rows = torch.cat([torch.randn(40, 3000, generator=gen) * 4, torch.randn(24, 3000, generator=gen) * 0.3])
    params = [
        SamplingParams(
            temperature=float(0.2 + 1.5 * torch.rand(1, generator=gen)),
            top_k=int(torch.randint(0, 60, (1,), generator=gen)) if i % 2 else 0,
            top_p=float(0.05 + 0.95 * torch.rand(1, generator=gen)),
            min_p=float(0.2 * torch.rand(1, generator=gen)) if i % 3 == 0 else 0.0,
        )
        for i in range(len(rows))
    ]
    scaled = scaled_as_drawn(rows, params)
    tokens, edges = native_draw(scaled, params, torch.Generator().manual_seed(5))
    widths = []
    for row, p in enumerate(params):
        want = reference_probabilities(rows[row], p) > 0
        kept = torch.exp(scaled[row]) >= edges[row]  # the weights the kernel selected over, bit for bit
        assert torch.equal(kept, want), f"row {row}: another set of tokens kept"
        assert tokens[row] is not None and bool(want[tokens[row]])
        widths.append(int(want.sum()))
    assert min(widths) < 10 and max(widths) > 1000, widths  # narrow and wide nuclei both ran


def test_the_c_draw_takes_the_same_tokens_on_two_threads() -> None:
    """Rows are drawn in parallel, each from its own uniform: the thread count changes no token."""
    rows = torch.randn(16, 3000, generator=torch.Generator().manual_seed(8)) * 3
    params = [SamplingParams(temperature=0.7, top_k=40 * (i % 2), top_p=0.9) for i in range(16)]
    threads = torch.get_num_threads()
    drawn = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            drawn.append(native_draw(scaled_as_drawn(rows, params), params, torch.Generator().manual_seed(9)))
    finally:
        torch.set_num_threads(threads)
    assert drawn[0][0] == drawn[1][0] and torch.equal(drawn[0][1], drawn[1][1])


def test_the_batch_draw_consuming_its_rows_takes_the_c_draws_tokens() -> None:
    """`sample` hands the C draw its scaled rows to overwrite (no second buffer of exps): the tokens are
    those the draw takes from an untouched copy with the same noise, and the caller's logits are unchanged."""
    rows = torch.randn(16, 3000, generator=torch.Generator().manual_seed(10)) * 3
    params = [SamplingParams(temperature=0.7, top_k=40 * (i % 2), top_p=0.9) for i in range(16)]
    before = rows.clone()
    sampled = sample(rows, params, [None] * 16, noise=torch.Generator().manual_seed(4))
    assert torch.equal(rows, before)
    drawn, _ = native_draw(scaled_as_drawn(rows, params), params, torch.Generator().manual_seed(4))
    assert sampled == drawn


def test_sampling_in_place_takes_the_tokens_of_sampling_a_copy() -> None:
    """`consume` (the runner's logits, read by no one after): the draw scales them in place and the C draw
    takes the rows' maxima from `sample`'s own pass; every kind of row takes the tokens it takes from a
    caller's untouched logits with the same noise and generators: greedy, nucleus (C), top_k, min_p, a
    whole distribution, seeded, and rows whose penalties adjust them."""
    rows = torch.randn(12, 3000, generator=torch.Generator().manual_seed(11)) * 3
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_p=0.95),
        SamplingParams(temperature=0.7, top_k=40),
        SamplingParams(temperature=0.9, min_p=0.05),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7),
        SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.3),
    ]
    history = [[1, 5, 9, 2999]] * 12
    for params in ([kinds[i % len(kinds)] for i in range(12)], [kinds[1], kinds[0]] * 6, [kinds[1]] * 12):
        taken = []
        for consume in (False, True):
            logits = rows.clone()
            generators = [make_generator(p, logits.device) for p in params]
            noise = torch.Generator().manual_seed(3)
            taken.append(sample(logits, params, generators, history, history, noise, consume=consume))
            assert consume or torch.equal(logits, rows)
        assert taken[0] == taken[1] and all(t is not None for t in taken[1])
    assert not torch.equal(logits, rows)  # every row drawn, by the C draw: the logits themselves consumed


def test_the_c_draw_follows_the_probabilities() -> None:
    """20,000 draws of one row (top_k 6, top_p 0.9) with fixed noise: each kept token comes out at its
    probability (within four standard deviations) and a dropped one never; a row with no finite logit,
    or with a NaN or +inf one, draws nothing."""
    row = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 3.0]])
    p = SamplingParams(temperature=1.0, top_k=6, top_p=0.9)
    want = reference_probabilities(row[0], p)
    batch = row.expand(20_000, -1)
    tokens, _ = native_draw(
        scaled_as_drawn(batch, [p] * 20_000), [p] * 20_000, torch.Generator().manual_seed(3)
    )
    freq = torch.bincount(torch.tensor(tokens), minlength=8).double() / 20_000
    sigma = (want * (1 - want) / 20_000).sqrt().double()
    assert bool((freq[want == 0] == 0).all()) and bool(
        ((freq - want.double()).abs() <= 4 * sigma + 1e-12).all()
    )
    assert native_draw(torch.full((1, 8), -math.inf), [p], None)[0] == [None]
    for poison in (math.nan, math.inf):  # a penalty gone wrong: no distribution, the row fails closed
        assert native_draw(row.index_fill(1, torch.tensor([3]), poison), [p], None)[0] == [None]
