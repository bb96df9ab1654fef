"""What a numeric path costs in accuracy, measured the way llama.cpp's `llama-perplexity` measures it.

The text is Python's own documentation as every CPython ships it (`pydoc_data.topics`, its topics joined
in sorted order: plain English prose about the language, offline), named by its sha256. It is cut into
chunks of `n_ctx` tokens, each chunk's first token the model's BOS where its vocabulary adds one; each
chunk is one prompt, and only the tokens of its second half are scored (a token's context is never
shorter than n_ctx / 2), as `llama-perplexity` scores them.

`Scorer(engine)` runs a chunk through a kvfence engine with prompt logprobs on and keeps the raw logits of
the scored positions (the runner's `prompt_logits_observer`); `compare` accumulates, over the same
chunks, the perplexity of a path and of a reference path, the KL divergence of the path's distributions
from the reference's (mean and p99 over tokens, natural log, as `llama-perplexity --kl-divergence`
reports) and the share of tokens where both put the same token first.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from kvfence.engine.engine import LLMEngine
from kvfence.request import Request
from kvfence.sampling import SamplingParams


def reference_text() -> str:
    """Python's documentation topics (pydoc_data.topics), joined in sorted order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def chunks(tokens: list[int], n_ctx: int, count: int, bos: int | None) -> list[list[int]]:
    """The first `count` whole chunks of `n_ctx` tokens, each starting with `bos` where given."""
    found = []
    for start in range(0, len(tokens) - n_ctx + 1, n_ctx):
        chunk = list(tokens[start : start + n_ctx])
        if bos is not None:
            chunk[0] = bos
        found.append(chunk)
    return found[:count]


class Scorer:
    """Log-probabilities [scored tokens, vocab] of a chunk's second half under one engine's numerics."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._rows: dict[int, torch.Tensor] = {}
        self._first = 0  # the first position kept: a 2048-token chunk's rows of a 262k vocabulary are 2 GB
        engine.runner.prompt_logits_observer = self._observe

    def _observe(self, rows: list[tuple[Request, int]], logits: torch.Tensor) -> None:
        for (_, position), row in zip(rows, logits, strict=True):
            if position >= self._first:
                self._rows[position] = row.float().clone()

    def __call__(self, chunk: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probabilities at the scored positions, the tokens they score)."""
        self._first = len(chunk) // 2 + 1
        params = SamplingParams(max_tokens=1, prompt_logprobs=0)
        self.engine.generate([chunk], params)
        positions = range(self._first, len(chunk))  # the logits that predict token p, for p in the 2nd half
        logits = torch.stack([self._rows.pop(p) for p in positions])
        self._rows.clear()
        return torch.log_softmax(logits, dim=-1), torch.tensor([chunk[p] for p in positions])


@dataclass
class Comparison:
    """A path against a reference path over the same chunks."""

    nll: list[float] = field(default_factory=list)  # the path's, per scored token
    reference_nll: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)  # KL(reference || path), per token
    same_top: int = 0

    def add(
        self, path: tuple[torch.Tensor, torch.Tensor], reference: tuple[torch.Tensor, torch.Tensor]
    ) -> None:
        (logp, tokens), (ref, ref_tokens) = path, reference
        assert torch.equal(tokens, ref_tokens)
        picked = tokens.unsqueeze(1)
        self.nll += (-logp.gather(1, picked)).squeeze(1).tolist()
        self.reference_nll += (-ref.gather(1, picked)).squeeze(1).tolist()
        self.kl += (ref.exp() * (ref - logp)).sum(dim=1).clamp_min(0).tolist()
        self.same_top += int((logp.argmax(1) == ref.argmax(1)).sum())

    def summary(self) -> dict[str, float]:
        tokens = len(self.nll)
        return {
            "tokens": tokens,
            "ppl": math.exp(sum(self.nll) / tokens),
            "reference_ppl": math.exp(sum(self.reference_nll) / tokens),
            "kl_mean": float(np.mean(self.kl)),
            "kl_p99": float(np.percentile(self.kl, 99)),
            "top1_agreement": self.same_top / tokens,
        }


class LlamaBaseLogits:
    """A reference path's log-probabilities as `llama-perplexity --kl-divergence-base` reads them, so that
    llama.cpp's own tool measures its KL divergence and top-1 agreement against kvfence's reference.

    The layout is the tool's (tools/perplexity/perplexity.cpp): b"_logits_", n_ctx (uint32), n_vocab and
    n_chunk (int32), every chunk's tokens (int32), then per chunk one row per scored position of
    nv = 2 * ceil(n_vocab / 2) + 4 uint16: two float32 (scale, the smallest kept log-probability), then
    each token's log-probability as round((lp - min) / scale), min at most 16 nats below the largest
    (0 for anything below it), as the tool itself writes its base runs."""

    def __init__(self, path: str, n_ctx: int, n_vocab: int, chunked: list[list[int]]) -> None:
        self.n_vocab, self.nv = n_vocab, 2 * ((n_vocab + 1) // 2) + 4
        self._out = open(path, "wb")  # noqa: SIM115 (rows are added chunk by chunk; close() ends it)
        self._out.write(b"_logits_")
        self._out.write(
            np.array([n_ctx], np.uint32).tobytes() + np.array([n_vocab, len(chunked)], np.int32).tobytes()
        )
        self._out.write(np.asarray(chunked, np.int32).tobytes())

    def add(self, logp: torch.Tensor) -> None:
        """One chunk's scored rows, [positions, n_vocab] log-probabilities."""
        top = logp.max(dim=1, keepdim=True).values
        low = torch.maximum(logp.min(dim=1, keepdim=True).values, top - 16)
        scale = (top - low) / 65535
        codes = torch.where(logp > low, torch.round((logp - low) / scale.clamp_min(1e-30)), 0.0)
        rows = np.zeros((len(logp), self.nv), np.uint16)
        rows[:, 4 : 4 + self.n_vocab] = codes.numpy().astype(np.uint16)
        floats = torch.cat([scale, low], dim=1).numpy().astype(np.float32)
        rows[:, :4] = floats.view(np.uint16)
        self._out.write(rows.tobytes())

    def close(self) -> None:
        self._out.close()
