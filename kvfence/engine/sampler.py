"""The sampler: one token per row of logits, and the log-probabilities reported to clients.

The contracts are kvfence.sampling's (the parameters' module): bias, penalties, then greedy argmax or
temperature, min_p, top_k, top_p and a draw from the request's own generator; one row's failure answers
None for that row alone; logprobs are log-softmax of the raw logits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvfence.sampling import SamplingParams, TokenLogprobs


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A per-request generator; None for greedy requests (they need no randomness)."""
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    prompts: Sequence[Sequence[int]] | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
) -> list[int | None]:
    """One token per row of `logits` [batch, vocab] (float32); None for a row with a NaN or +inf logit,
    or only -inf ones, or whose own sampling values make sampling fail: there is nothing sound to sample,
    and the caller aborts that request alone. One row's failure never reaches another row.

    `prompts` and `outputs` are each row's token ids so far; only rows whose params `adjusts_logits` read
    them (repetition_penalty reads both, frequency and presence penalties the output)."""
    best, argmax = logits.max(dim=-1)  # a NaN anywhere in a row makes its max NaN: one pass checks both
    finite = torch.isfinite(best).tolist()
    tokens: list[int | None] = argmax.tolist()
    adjusted = adjusted_rows(logits, params, finite, prompts, outputs)
    for row, (p, generator) in enumerate(zip(params, generators, strict=True)):
        if row in adjusted:
            tokens[row] = _pick(adjusted[row], p, generator)
        elif not finite[row]:
            tokens[row] = None
        elif not p.greedy:
            tokens[row] = _pick(logits[row], p, generator)
    return tokens


def _pick(logits: torch.Tensor | None, p: SamplingParams, generator: torch.Generator | None) -> int | None:
    """One row's token from its (adjusted) logits, or None when there is nothing sound to pick."""
    if logits is None:
        return None
    if p.greedy:
        top, token = logits.max(dim=-1)
        return int(token) if torch.isfinite(top) else None
    try:
        return _sample_row(logits, p, generator)
    except (RuntimeError, ValueError):  # e.g. multinomial over NaN probabilities
        return None


def adjusted_rows(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    finite: list[bool],
    prompts: Sequence[Sequence[int]] | None,
    outputs: Sequence[Sequence[int]] | None,
) -> dict[int, torch.Tensor | None]:
    """Bias and penalties, vectorised over the rows that ask for them: row -> its new logits, or None for a
    row that cannot be adjusted (a bias id outside the vocabulary). Rows asking for neither are absent."""
    vocab = logits.shape[-1]
    rows = [r for r, p in enumerate(params) if finite[r] and p.adjusts_logits]
    failed = {r for r in rows if any(t >= vocab for t in params[r].logit_bias)}
    rows = [r for r in rows if r not in failed]
    result: dict[int, torch.Tensor | None] = dict.fromkeys(failed)
    if not rows:
        return result
    sub = logits[rows].float()  # a copy: the caller's logits stay raw (logprobs, other rows)
    picked = [params[r] for r in rows]
    _add_bias(sub, picked)
    output_counts = _counts(sub, [outputs[r] if outputs else () for r in rows])
    if any(p.repetition_penalty != 1.0 for p in picked):
        seen = (output_counts > 0) | (_counts(sub, [prompts[r] if prompts else () for r in rows]) > 0)
        penalty = _column(sub, [p.repetition_penalty for p in picked])
        sub = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    if any(p.frequency_penalty or p.presence_penalty for p in picked):
        sub -= _column(sub, [p.frequency_penalty for p in picked]) * output_counts
        sub -= _column(sub, [p.presence_penalty for p in picked]) * (output_counts > 0)
    result.update(zip(rows, sub, strict=True))
    return result


def _add_bias(sub: torch.Tensor, params: list[SamplingParams]) -> None:
    pairs = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias.items()]
    if pairs:
        index = torch.tensor([(i, t) for i, t, _ in pairs], dtype=torch.long, device=sub.device)
        values = torch.tensor([b for _, _, b in pairs], dtype=sub.dtype, device=sub.device)
        sub.index_put_((index[:, 0], index[:, 1]), values, accumulate=True)


def _counts(sub: torch.Tensor, histories: list[Sequence[int]]) -> torch.Tensor:
    """[rows, vocab]: how often each token occurs in each row's history."""
    counts = torch.zeros_like(sub)
    longest = max((len(h) for h in histories), default=0)
    if longest:
        ids = torch.zeros(len(histories), longest, dtype=torch.long)
        present = torch.zeros(len(histories), longest, dtype=sub.dtype)
        for i, history in enumerate(histories):
            ids[i, : len(history)] = torch.as_tensor(history, dtype=torch.long)
            present[i, : len(history)] = 1
        counts.scatter_add_(1, ids.to(sub.device), present.to(sub.device))
    return counts


def _column(sub: torch.Tensor, values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=sub.dtype, device=sub.device).unsqueeze(1)


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probabilities(logits, p), 1, generator=generator).item())


def probabilities(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a sampled (not greedy) row draws from: softmax(logits / temperature), without the
    tokens min_p, top_k and top_p drop, in that order."""
    # The top token scores exactly 0 after the shift and keeps probability > 0 however small the
    # temperature, min_p or top_p: the distribution can never become all -inf (NaN), so multinomial cannot
    # fail on its account.
    scaled = (logits.float() - logits.max()) / p.temperature
    if p.min_p > 0:
        # probability < min_p x top probability  <=>  scaled logit < log(min_p) (the top one scores 0)
        scaled = scaled.masked_fill(scaled < math.log(p.min_p), float("-inf"))
    if p.top_k > 0:
        kth = torch.topk(scaled, min(p.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p; the first token always stays.
        drop = (probs.cumsum(-1) - probs) >= p.top_p
        drop[0] = False
        scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.softmax(scaled, dim=-1)


def raw_logprobs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> dict[int, torch.Tensor]:
    """Row -> log-softmax of its raw logits, for the rows that ask for logprobs. Call it before anything
    edits `logits` in place (a grammar's mask): logprobs report the model's own distribution."""
    rows = [r for r, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return {}
    return dict(zip(rows, torch.log_softmax(logits[rows].float(), dim=-1), strict=True))


def token_logprobs(
    raw: dict[int, torch.Tensor], tokens: Sequence[int | None], params: Sequence[SamplingParams]
) -> dict[int, TokenLogprobs]:
    """Row -> the sampled token's logprob and the top `logprobs` ones, from `raw_logprobs`' rows."""
    found = {}
    for row, logp in raw.items():
        token, k = tokens[row], params[row].logprobs or 0
        if token is None:
            continue
        values, ids = torch.topk(logp, k) if k else (logp[:0], logp[:0].long())
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
        found[row] = TokenLogprobs(token, float(logp[token]), top)
    return found
