"""What every servable job must answer: its greedy output on a separate cold engine, and the comparison
that accepts a divergence only at a near-tie of the reference's top-2 logits (as the golden tests do).

Contracts: `reference_engine` has no prefix cache and no faults, so a reference never depends on what
else ran; `compute_references` batches jobs on it (batched equals solo up to near-ties), deduplicated by
prompt and length; `compare` says 'exact', 'near_tie' or 'differs', never raises on a mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfence.config import EngineConfig
from kvfence.engine.engine import LLMEngine
from kvfence.harness.load import Job
from kvfence.model.gguf import GGUFModel
from kvfence.model.tokenizer import IncrementalDecoder, Tokenizer
from kvfence.model.transformer import Transformer
from kvfence.request import Request
from kvfence.sampling import SamplingParams
from kvfence.units import cdiv

TIE_GAP = 1e-3  # a reference step whose top-2 logits are closer than this may flip under batching


@dataclass(frozen=True)
class Reference:
    tokens: list[int]
    text: str
    gaps: list[float]  # top-2 logit gap of each sampled step


# What every engine compared with a reference computes: the exact path. Batching and chunking move its
# logits by float rounding alone, which `compare` allows at near-ties; int8 activations (the serving
# default) turn such rounding into a quantum of a row's scale, and a flip could not be told from a leak.
EXACT = "float32"


def reference_engine(gguf: GGUFModel, window: int) -> LLMEngine:
    """A separate cold engine: no prefix cache, no faults, a pool for a few windows, the exact path."""
    pages = cdiv(window, 16) * 8
    config = EngineConfig(
        num_pages=pages, max_model_len=window, enable_prefix_caching=False, activation_dtype=EXACT
    )
    model = Transformer.from_gguf(gguf, activation_dtype=EXACT)
    return LLMEngine(config, model, Tokenizer.from_gguf(gguf), log=lambda _: None)


def compute_references(engine: LLMEngine, jobs: list[Job], batch: int = 8) -> dict[int, Reference]:
    """Greedy outputs of every servable job (deduplicated by prompt and length), `batch` at a time on a
    cold engine: batched equals solo up to near-ties (tests/test_golden.py), which `compare` allows."""
    gaps: dict[str, list[float]] = {}

    def observe(requests: list[Request], logits: torch.Tensor) -> None:
        top2 = torch.topk(logits, 2, dim=-1).values
        for request, (a, b) in zip(requests, top2.tolist(), strict=True):
            gaps.setdefault(request.request_id, []).append(a - b)

    engine.runner.logits_observer = observe
    unique: dict[tuple[tuple[int, ...], int], list[int]] = {}
    for job in jobs:
        if not job.must_reject:
            unique.setdefault((tuple(job.prompt), job.max_tokens), []).append(job.index)
    keys = list(unique)
    refs: dict[int, Reference] = {}
    for start in range(0, len(keys), batch):
        chunk = keys[start : start + batch]
        params = [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in chunk]
        for key, request in zip(chunk, engine.generate([list(p) for p, _ in chunk], params), strict=True):
            ref = Reference(request.output_token_ids, request.output_text, gaps.pop(request.request_id))
            refs.update(dict.fromkeys(unique[key], ref))
    return refs


def compare(reference: Reference, text: str, tokenizer: Tokenizer) -> str:
    """'exact', 'near_tie' (the texts part where the reference's top-2 gap is below TIE_GAP), or
    'differs'."""
    if text == reference.text:
        return "exact"
    decoder, seen = IncrementalDecoder(tokenizer), ""
    for step, token in enumerate(reference.tokens):
        seen += decoder.step(token)
        if not text.startswith(seen):
            return "near_tie" if reference.gaps[step] < TIE_GAP else "differs"
    return "differs"
