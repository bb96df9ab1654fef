"""Sampling parameters and the batched sampler.

Greedy rows are one argmax over the batch; random rows each use their own torch.Generator so that a
request's seed gives the same tokens whatever else shares the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError("temperature must be a finite number >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


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
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int | None]:
    """One token per row of `logits` [batch, vocab] (float32); None for a row with a NaN or +inf logit,
    or only -inf ones, or whose own sampling values make sampling fail: there is nothing sound to sample,
    and the caller aborts that request alone. One row's failure never reaches another row."""
    best, argmax = logits.max(dim=-1)  # a NaN anywhere in a row makes its max NaN: one pass checks both
    finite = torch.isfinite(best).tolist()
    tokens: list[int | None] = argmax.tolist()
    for row, (p, generator) in enumerate(zip(params, generators, strict=True)):
        if not finite[row]:
            tokens[row] = None
        elif not p.greedy:
            try:
                tokens[row] = _sample_row(logits[row], p, generator)
            except (RuntimeError, ValueError):  # e.g. multinomial over NaN probabilities
                tokens[row] = None
    return tokens


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    # The top token scores exactly 0 after the shift and keeps probability > 0 however small the
    # temperature or top_p: the distribution can never become all -inf (NaN), so multinomial cannot fail.
    scaled = (logits.float() - logits.max()) / p.temperature
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
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
