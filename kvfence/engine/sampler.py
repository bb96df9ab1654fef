"""The sampler: one token per row of logits, and the log-probabilities reported to clients.

The contracts are kvfence.sampling's (the parameters' module): bias, penalties, then greedy argmax or
temperature, min_p, top_k, top_p and a draw; one row's failure answers None for that row alone; logprobs
are log-softmax of the raw logits. Sampling is batched: the rows that sample are drawn together in a
few tensor ops, top_p sorting only each row's best CANDIDATES tokens, or cutting a row whose nucleus is
wider by a threshold (vLLM's sampler likewise avoids a full sort); only a seeded row draws alone, from its
own generator. Where a C compiler is found, the truncated rows without a seed are drawn by csrc/nucleus.c
instead (the same kept set, found in one pass a row: 16 rows of 49,152 with a nucleus of thousands took
56 ms in tensor ops); the tensor ops stay for seeded rows (their draws unchanged) and as its reference.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from kvfence.model import native
from kvfence.sampling import SamplingParams, TokenLogprobs

# Top-p's candidates: a row's best tokens are sorted, not its whole vocabulary: the 64 best first (a model's
# nucleus is usually narrower; topk of 64 costs an eighth of topk of 1024), then the `CANDIDATES` best for
# the rows whose nucleus is wider; a row wider still (a flat distribution) is cut by a threshold (`nucleus`).
CANDIDATE_STAGES = (64, 1024)
CANDIDATES = CANDIDATE_STAGES[-1]


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A request's own generator when it sets a seed (its tokens then do not depend on the batch); None
    otherwise: greedy rows need no randomness, and unseeded rows draw from the batch's noise."""
    if params.greedy or params.seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed)
    return generator


@torch.inference_mode()  # the model's logits are an inference tensor: `consume` scales them in place
def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    prompts: Sequence[Sequence[int]] | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
    noise: torch.Generator | None = None,
    consume: bool = False,
) -> list[int | None]:
    """One token per row of `logits` [batch, vocab] (float32); None for a row with a NaN or +inf logit,
    or only -inf ones, or whose own sampling values make sampling fail: there is nothing sound to sample,
    and the caller aborts that request alone. One row's failure never reaches another row.

    `prompts` and `outputs` are each row's token ids so far; only rows whose params `adjusts_logits` read
    them (repetition_penalty reads both, frequency and presence penalties the output). Sampled rows are
    drawn together (`draw`): from their own generator where they set a seed, else from `noise`. `consume`:
    the caller reads `logits` no more (float32), and the draw scales them in place instead of a copy (a fresh
    buffer is pages faulted in: at 16 rows x 49,152, 3 MiB a step)."""
    best, argmax = logits.max(dim=-1)  # a NaN anywhere in a row makes its max NaN: one pass checks both
    finite = torch.isfinite(best).tolist()
    tokens: list[int | None] = argmax.tolist()
    adjusted = adjusted_rows(logits, params, finite, prompts, outputs)
    drawn = []
    for row, p in enumerate(params):
        row_logits = adjusted[row] if row in adjusted else logits[row] if finite[row] else None
        if row_logits is None:
            tokens[row] = None
        elif not p.greedy:
            drawn.append(row)
        elif row in adjusted:
            top, token = row_logits.max(dim=-1)
            tokens[row] = int(token) if torch.isfinite(top) else None
    if drawn:
        peaks = None  # the rows' maxima, where `best` holds them: no row adjusted
        if any(r in adjusted for r in drawn):
            rows = torch.stack([adjusted.get(r, logits[r]) for r in drawn])  # type: ignore[misc]
        elif len(drawn) == len(params):  # no copy of the batch's logits where every row draws
            rows, peaks = logits, best.unsqueeze(1)
        else:
            rows, peaks = logits[drawn], best[drawn].unsqueeze(1)
        mine = consume or rows is not logits  # draw() scales in place only what is float32
        picked = draw(rows, [params[r] for r in drawn], [generators[r] for r in drawn], noise, peaks, mine)
        for row, token in zip(drawn, picked, strict=True):
            tokens[row] = token
    return tokens


def draw(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    noise: torch.Generator | None,
    peaks: torch.Tensor | None = None,
    consume: bool = False,
) -> list[int | None]:
    """A sampled token per row of `logits` [rows, vocab], the batch in a few tensor ops: temperature and
    min_p over every row at once; top_k and top_p over each row's best candidates (`candidates`), or, for a
    nucleus wider than them, by a threshold over the whole row (`nucleus`). A seeded row draws with
    torch.multinomial from its own generator; the others together by inverse CDF from `noise`. None for
    a row that cannot be sampled. `peaks` [rows, 1]: the rows' maxima where the caller has them; `consume`:
    `logits` (float32) are the caller's no more, and are scaled in place."""
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32).unsqueeze(1)
    peaks = logits.max(dim=-1, keepdim=True).values if peaks is None else peaks
    in_place = consume and logits.dtype == torch.float32
    scaled = (logits.sub_(peaks) if in_place else logits.float() - peaks).div_(temperature)
    if any(p.min_p > 0 for p in params):
        floor = torch.tensor([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params]).unsqueeze(1)
        scaled.masked_fill_(scaled < floor, -math.inf)
    tokens: list[int | None] = [None] * len(params)
    cut = [r for r, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
    whole = [r for r in range(len(params)) if r not in set(cut)]
    if whole:
        probs = torch.softmax(scaled[whole], dim=-1)
        _place(tokens, whole, _pick(probs, None, [generators[r] for r in whole], noise))
    unseeded = [r for r in cut if generators[r] is None]
    if unseeded and _nucleus_kernel() is not None:
        rows = scaled if len(unseeded) == len(params) else scaled[unseeded]  # read by no one after the draw
        drawn = native_draw(rows, [params[r] for r in unseeded], noise, consume=True, peaked=True)[0]
        _place(tokens, unseeded, drawn)
        cut = [r for r in cut if generators[r] is not None]
    for limit in CANDIDATE_STAGES:
        if not cut:
            break
        rows = scaled if len(cut) == len(params) else scaled[cut]  # no copy where every row is cut
        probs, ids, wide = candidates(rows, [params[r] for r in cut], limit)
        narrow = [i for i in range(len(cut)) if i not in wide]
        if narrow:
            picked = _pick(probs[narrow], ids[narrow], [generators[cut[i]] for i in narrow], noise)
            _place(tokens, [cut[i] for i in narrow], picked)
        cut = [cut[i] for i in sorted(wide)]
    if cut:
        top_p = torch.tensor([params[r].top_p for r in cut]).unsqueeze(1)
        picked = _pick(nucleus(scaled[cut], top_p), None, [generators[r] for r in cut], noise)
        _place(tokens, cut, picked)
    return tokens


def native_draw(
    scaled: torch.Tensor,
    params: Sequence[SamplingParams],
    noise: torch.Generator | None,
    consume: bool = False,
    peaked: bool = False,
) -> tuple[list[int | None], torch.Tensor]:
    """csrc/nucleus.c's draw for `scaled` [rows, vocab] (temperature and min_p applied) under each row's
    top_k and top_p, one uniform a row from `noise`: (tokens, None where no logit is finite or one is NaN
    or +inf; each row's least kept probability relative to its largest, the kept set's edge). `consume`:
    the caller reads `scaled` no more, and a float32 one is overwritten instead of copied (at 16 rows of
    Gemma's 262,144, each fresh 16 MiB buffer is pages faulted in: 3-5 ms). `peaked`: each row's largest
    value is 0 already (`draw`'s rows, less their maxima), so no pass finds and subtracts it."""
    kernel = _nucleus_kernel()
    assert kernel is not None
    rows = scaled.float()
    # The exps here, vectorised (a scalar expf a token was most of the C draw's time), in place over one
    # buffer; a NaN or +inf logit leaves its row a NaN, which the kernel refuses.
    if peaked:
        rows = (rows if consume else rows.clone()).exp_().contiguous()
    else:
        peak = rows.amax(dim=-1, keepdim=True)
        rows = (rows.sub_(peak) if consume and rows.is_contiguous() else rows - peak).exp_().contiguous()
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64)
    uniform = torch.rand(len(params), dtype=torch.float64, generator=noise)
    tokens = torch.empty(len(params), dtype=torch.int64)
    edges = torch.zeros(len(params), dtype=torch.float32)
    arrays = (top_k, top_p, uniform, tokens, edges)
    if kernel(rows.data_ptr(), *rows.shape, *(a.data_ptr() for a in arrays), torch.get_num_threads()):
        raise MemoryError("nucleus draw: out of memory")
    return [t if t >= 0 else None for t in tokens.tolist()], edges


@functools.cache
def _nucleus_kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """csrc/nucleus.c's nucleus_draw, or None where it cannot be built (the tensor ops draw instead)."""
    library, _ = native.load_library("nucleus", csrc=Path(__file__).parent / "csrc")
    if library is None:
        return None
    function = library.nucleus_draw
    function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, *[ctypes.c_void_p] * 5]
    function.argtypes += [ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def _place(tokens: list[int | None], rows: Sequence[int], picked: Sequence[int | None]) -> None:
    for row, token in zip(rows, picked, strict=True):
        tokens[row] = token


def nucleus(scaled: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """top_p over whole rows without sorting them: softmax(scaled) [rows, vocab] keeping, per row, the
    tokens at least as probable as the least probable one `probabilities` keeps (the same set, but for
    exact ties at the edge, which it keeps all of), renormalised. The edge is the largest t with
    mass(p >= t) >= top_p, found as a radix select over the float32 bits of the probabilities (ordered as
    the floats for values >= 0): a histogram of the mass by the high 16 bits picks the edge's bin, a
    second over the low 16 bits of that bin's tokens picks the edge in it; masses summed in float64. Two
    passes over the rows (a bisection took 31: 111 ms a step for 16 flat rows of 49,152, now a tenth)."""
    probs = torch.softmax(scaled, dim=-1)
    bits = probs.view(torch.int32)
    high, low = (bits >> 16).long(), (bits & 0xFFFF).long()
    wanted = top_p.double()
    above, edge = _edge_bin(torch.zeros(len(probs), dtype=torch.float64), high, probs, wanted, 1 << 15)
    in_edge = probs * (high == edge[:, None])
    _, edge_low = _edge_bin(above, low, in_edge, wanted, 1 << 16)
    kept = probs.masked_fill(bits < ((edge << 16) | edge_low)[:, None], 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def _edge_bin(
    base: torch.Tensor, keys: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor, bins: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the mass of the bins above it, the largest bin b with base + mass(keys >= b) >= top_p) per row.
    mass(keys >= b) = total - mass(keys < b), and mass(keys < b) rises with b: b is found by bisection."""
    mass = torch.zeros(len(probs), bins, dtype=torch.float64).scatter_add_(1, keys, probs.double())
    before = mass.cumsum(1)  # mass(keys <= b)
    total = before[:, -1:]
    edge = torch.searchsorted(before - mass, base[:, None] + total - top_p, right=True) - 1
    return (base[:, None] + total - before.gather(1, edge)).squeeze(1), edge.squeeze(1)


def candidates(
    scaled: torch.Tensor, params: Sequence[SamplingParams], limit: int = CANDIDATES
) -> tuple[torch.Tensor, torch.Tensor, set[int]]:
    """(probabilities [rows, K], token ids [rows, K], rows whose nucleus is wider than K) after top_k and
    top_p over each row's K best tokens: K covers every top_k asked for, and `limit` for top_p alone.
    The probabilities are normalised over the tokens kept, as the per-row definition (sort the row, keep
    a token while the mass before it is under top_p) does."""
    vocab = scaled.shape[1]
    top_k = [p.top_k or vocab for p in params]
    needed = [k if p.top_p >= 1.0 else min(k, limit) for k, p in zip(top_k, params, strict=True)]
    width = min(vocab, max(needed))
    # One softmax over the rows (a fused kernel: a separate logsumexp costs twice as much), then the best.
    values, ids = torch.topk(torch.softmax(scaled, dim=-1), width, dim=-1)  # sorted, best first
    column = torch.arange(width)
    keep = column < torch.tensor(top_k).unsqueeze(1)
    # top_p's mass is over what top_k and min_p left: all among the candidates where top_k <= width, else
    # (top_p alone) the whole row, whose softmax it already is.
    whole_row = torch.tensor([k > width for k in top_k]).unsqueeze(1)
    survivors = values * keep
    mass = torch.where(whole_row, survivors, survivors / survivors.sum(dim=-1, keepdim=True))
    before = mass.cumsum(-1) - mass
    top_p = torch.tensor([p.top_p for p in params]).unsqueeze(1)
    # Drop a token once the mass before it reaches top_p, never the first (a top_p below float32's range
    # is 0 here, and 0 < 0 would drop every token).
    keep &= (before < top_p) | (column == 0)
    short = (before[:, -1] + mass[:, -1] < top_p[:, 0]) & whole_row[:, 0]  # the nucleus goes on past K
    wide = set(torch.nonzero(short).flatten().tolist())
    kept = values * keep
    return kept / kept.sum(dim=-1, keepdim=True), ids, wide


def _pick(
    probs: torch.Tensor,
    ids: torch.Tensor | None,
    generators: Sequence[torch.Generator | None],
    noise: torch.Generator | None,
) -> list[int | None]:
    """One token per row of `probs` [rows, width] (`ids`: each column's token; None: the column is the
    token): seeded rows by multinomial from their own generator, over the whole vocabulary as the per-row
    sampler drew, the others by inverse CDF from `noise` (`_inverse_cdf`). None where a row's
    probabilities are no distribution (a NaN, say)."""
    sound = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)
    safe = torch.where(sound[:, None], probs, 1.0)  # an unsound row draws from anything: it is dropped
    drawn = _inverse_cdf(safe, noise)
    drawn = (drawn if ids is None else ids.gather(1, drawn)).squeeze(1).tolist()
    tokens: list[int | None] = []
    for row, generator in enumerate(generators):
        if not sound[row]:
            tokens.append(None)
        elif generator is None:
            tokens.append(int(drawn[row]))
        else:
            full = (
                probs[row]
                if ids is None
                else torch.zeros(int(ids[row].max()) + 1).scatter(0, ids[row], probs[row])
            )
            tokens.append(int(torch.multinomial(full, 1, generator=generator)))
    return tokens


def _inverse_cdf(probs: torch.Tensor, noise: torch.Generator | None) -> torch.Tensor:
    """[rows, 1]: per row of `probs` (>= 0, some > 0) the first column whose cumulative mass exceeds a
    uniform draw below the row's total, so never a zero-probability column. One uniform a row: torch's
    multinomial draws an exponential per column (17 ms for 16 rows of 49,152)."""
    cumulative = probs.double().cumsum(dim=-1)
    total = cumulative[:, -1:]
    target = torch.rand(len(probs), 1, dtype=torch.float64, generator=noise) * total
    last = probs.shape[1] - 1 - (probs > 0).flip(1).int().argmax(dim=1, keepdim=True)  # a rounding's guard
    return torch.minimum(torch.searchsorted(cumulative, target, right=True), last)


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


def hold_ends(
    logits: torch.Tensor, params: Sequence[SamplingParams], produced: Sequence[int], eos: frozenset[int]
) -> None:
    """min_tokens, in place: a row with fewer than its `min_tokens` output tokens (`produced`) cannot sample
    an end: its EOS ids (unless it ignores EOS) and its `stop_token_ids` go to -inf (vLLM's rule)."""
    vocab = logits.shape[-1]
    held = [
        (row, p) for row, (p, done) in enumerate(zip(params, produced, strict=True)) if done < p.min_tokens
    ]
    with torch.inference_mode():  # the model's logits are an inference tensor: update them in place here
        for row, p in held:
            ends = [t for t in (*(() if p.ignore_eos else eos), *p.stop_token_ids) if t < vocab]
            logits[row, ends] = float("-inf")


def ban_tokens(
    logits: torch.Tensor, params: Sequence[SamplingParams], outputs: Sequence[Sequence[int]]
) -> None:
    """vLLM's `allowed_token_ids` and `bad_words`, in place: a row's tokens outside its allowed ones, and
    each bad word's last token where the row's output so far (`outputs`) ends with the word's other
    tokens, go to -inf. Rows asking for neither are not touched."""
    vocab = logits.shape[-1]
    with torch.inference_mode():  # the model's logits are an inference tensor: update them in place here
        for row, p in enumerate(params):
            if p.allowed_token_ids is not None:
                allowed = torch.tensor([t for t in p.allowed_token_ids if t < vocab], dtype=torch.long)
                kept = logits[row, allowed.to(logits.device)].clone()
                logits[row] = float("-inf")
                logits[row, allowed.to(logits.device)] = kept
            banned = [word[-1] for word in p.bad_words_token_ids if _ends_with(outputs[row], word[:-1])]
            if banned:
                logits[row, [t for t in banned if t < vocab]] = float("-inf")


def _ends_with(tokens: Sequence[int], tail: Sequence[int]) -> bool:
    return not tail or (len(tokens) >= len(tail) and list(tokens[len(tokens) - len(tail) :]) == list(tail))


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
