"""The engines the offline benchmarks measure: weights loaded once in float32, an engine over them with the
default config, and prompts no two of which share a page.

Contracts: `load_weights` loads a GGUF file or a Hugging Face directory (default: the packaged SmolLM2)
once, setting torch's intra-op threads first when asked (a global: HF transformers in the same process
then runs with as many); `build_engine` keeps the window at most BENCH_WINDOW; `make_prompts` returns
`count` distinct prompts of exactly `length` token ids, the same for the same salt.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import torch

from kvfence.config import EngineConfig
from kvfence.engine.engine import LLMEngine
from kvfence.harness.load import WORDS
from kvfence.model.gguf import GGUFModel
from kvfence.model.hf_load import load_model
from kvfence.model.tokenizer import Tokenizer
from kvfence.model.transformer import Transformer
from kvfence.pins import default_model_path

BENCH_WINDOW = 4096  # tokens: every workload's prompt and output fit


def load_weights(threads: int | None = None, path: Path | None = None) -> GGUFModel:
    """Load a GGUF file or a Hugging Face directory (default: the packaged SmolLM2) in float32, once; build
    every engine from it. `threads` (None: leave torch's setting alone) is global, so HF transformers in the
    same process runs with the same number."""
    if threads is not None:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    gguf = load_model(path or default_model_path())
    seconds = time.perf_counter() - started
    print(f"loaded {gguf.path.name} in {seconds:.1f}s; torch threads {torch.get_num_threads()}")
    return gguf


def build_engine(
    gguf: GGUFModel, isolation: bool = True, model: Transformer | None = None, **overrides: Any
) -> LLMEngine:
    """An engine with the default config (prefix caching on, 512 MiB pool, a window of at most
    BENCH_WINDOW: Gemma's 32k would not fit the pool) over already loaded weights. Pass `model` to share
    one Transformer (it holds no per-engine state) between engines."""
    overrides.setdefault("max_model_len", min(BENCH_WINDOW, gguf.config.context_length))
    config = EngineConfig(isolation=isolation, **overrides)
    model = model or Transformer.from_gguf(gguf)
    return LLMEngine(config, model, Tokenizer.from_gguf(gguf), log=lambda _: None)


def make_prompts(tokenizer: Tokenizer, count: int, length: int, salt: int = 0) -> list[list[int]]:
    """`count` distinct prompts of exactly `length` token ids: numbered sentences of seeded words.

    Each prompt starts with its own number (and `salt`), so no two share even a first page and the prefix
    cache never turns one request's prefill into a hit for another; a new salt gives a fresh set."""
    prompts = []
    for index in range(count):
        rng = random.Random(f"{salt}-{index}")
        sentences, ids, batch = [f"Request {salt}-{index}."], [], 1
        while len(ids) < length:  # sentences in doubling batches: one encode per batch, not per sentence
            for _ in range(batch):
                sentences.append(f"Sentence {len(sentences)}: " + " ".join(rng.choices(WORDS, k=12)) + ".")
            ids, batch = tokenizer.encode(" ".join(sentences)), 2 * batch
        prompts.append(ids[:length])
    assert len({tuple(p) for p in prompts}) == count, "prompts must be distinct"
    return prompts
