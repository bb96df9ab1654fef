"""What a grammar costs: decode tokens/s with a JSON-schema grammar vs unconstrained, same prompts, side by
side in one run (interleaved ABAB).

    .venv/bin/python bench/structured.py [--pairs 2] [--max-tokens 48] [--concurrency 1,8] [--threads N]

Both arms decode exactly `--max-tokens` tokens per request from the same chat prompts, so the batches have
the same shape at every step: the schemas demand more JSON than that (at least 40 array items), and the
free arm ignores EOS. The grammar arm pays for its mask (llguidance, per row, every step), applying it to the
logits and advancing the matcher; the table also shows the mask time per step and its share of the grammar
arm's wall time, which other processes on a shared machine cannot inflate the way they swing tokens/s.
Target: the grammar arm at 90% or more of the free arm's tokens/s. Writes bench/results/structured.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from common import DEFAULT_THREADS, THREADS_HELP, build_engine, exit_status, load_weights, verdict, write_json

from kvfence.engine.engine import LLMEngine
from kvfence.grammar import mask as grammar_mask
from kvfence.grammar.compiler import GrammarCompiler
from kvfence.harness.tables import print_table
from kvfence.sampling import SamplingParams

TARGET = 0.90
SCHEMAS: dict[str, dict[str, Any]] = {
    "people": {
        "type": "array",
        "minItems": 40,
        "items": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer"},
                "city": {"type": "string"},
            },
            "required": ["name", "age", "city"],
            "additionalProperties": False,
        },
    },
    "enums+nested": {
        "type": "array",
        "minItems": 40,
        "items": {
            "type": "object",
            "properties": {
                "kind": {"enum": ["cat", "dog", "bird"]},
                "pos": {
                    "type": "object",
                    "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                    "required": ["x", "y"],
                },
                "ok": {"type": "boolean"},
            },
            "required": ["kind", "pos", "ok"],
        },
    },
}
TOPICS = [
    "people in a village",
    "pets in a park",
    "a football team",
    "a list of cities",
    "a family",
    "a class",
]
HEADERS = (
    "schema",
    "conc",
    "tok/s free",
    "tok/s grammar",
    "grammar/free med",
    "min-max",
    "mask ms/step",
    "mask share",
)


class MaskClock:
    """Times the runner's grammar masking (the only per-step work the grammar adds besides one consume)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._apply: Callable[..., set[int]] = grammar_mask.apply_masks
        grammar_mask.apply_masks = self  # type: ignore[assignment]

    def __call__(self, *args: Any) -> set[int]:
        started = time.perf_counter()
        try:
            return self._apply(*args)
        finally:
            self.seconds += time.perf_counter() - started


def prompts(engine: LLMEngine, count: int) -> list[list[int]]:
    tokenizer = engine.tokenizer
    assert tokenizer is not None
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": f"Write JSON about {TOPICS[i % len(TOPICS)]} (variant {i})."}]
            )
        )
        for i in range(count)
    ]


def run(
    engine: LLMEngine,
    batch: list[list[int]],
    max_tokens: int,
    compiler: GrammarCompiler | None,
    schema: dict[str, Any],
) -> tuple[float, int]:
    """All prompts at once; returns (wall seconds, steps). Every request yields exactly max_tokens."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    requests = [
        engine.add_request(p, params, grammar=compiler.for_schema(schema) if compiler else None)
        for p in batch
    ]
    steps = 0
    while not all(r.is_finished for r in requests):
        engine.step()
        steps += 1
    wall = time.perf_counter() - started
    assert all(len(r.output_token_ids) == max_tokens for r in requests), [r.finish_reason for r in requests]
    return wall, steps


def measure(
    engine: LLMEngine, compiler: GrammarCompiler, clock: MaskClock, args: argparse.Namespace
) -> tuple[list[list[object]], list[dict[str, Any]], list[float]]:
    rows, records, medians = [], [], []
    for name, schema in SCHEMAS.items():
        for concurrency in args.concurrency:
            free, constrained, ratios, mask_ms, shares = [], [], [], [], []
            batch = prompts(engine, concurrency)
            for _ in range(args.pairs):
                tokens = concurrency * args.max_tokens
                wall_free, _ = run(engine, batch, args.max_tokens, None, schema)
                before = clock.seconds
                wall_grammar, steps = run(engine, batch, args.max_tokens, compiler, schema)
                mask_ms.append((clock.seconds - before) / steps * 1e3)
                shares.append((clock.seconds - before) / wall_grammar)
                free.append(tokens / wall_free)
                constrained.append(tokens / wall_grammar)
                ratios.append(constrained[-1] / free[-1])
            median = statistics.median(ratios)
            medians.append(median)
            print(f"  {name} c={concurrency}: grammar/free {median:.3f}", flush=True)
            rows.append(
                [
                    name,
                    concurrency,
                    f"{statistics.median(free):.1f}",
                    f"{statistics.median(constrained):.1f}",
                    f"{median:.3f}",
                    f"{min(ratios):.3f}-{max(ratios):.3f}",
                    f"{statistics.median(mask_ms):.2f}",
                    f"{statistics.median(shares) * 100:.1f}%",
                ]
            )
            records.append(
                {
                    "schema": name,
                    "concurrency": concurrency,
                    "tok_per_s_free": free,
                    "tok_per_s_grammar": constrained,
                    "ratio": ratios,
                    "ratio_median": median,
                    "mask_ms_per_step": mask_ms,
                    "mask_share_of_wall": shares,
                }
            )
    return rows, records, medians


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=2, help="free/grammar pairs per cell (default 2)")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens decoded per request (default 48)")
    parser.add_argument(
        "--concurrency",
        type=lambda s: [int(c) for c in s.split(",")],
        default=[1, 8],
        help="requests decoded together, comma-separated (default 1,8)",
    )
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS, help=THREADS_HELP)
    args = parser.parse_args()
    gguf = load_weights(args.threads)
    # No prefix cache: both arms prefill the same prompts in full, whichever runs first.
    engine = build_engine(gguf, num_pages=256, max_model_len=2048, enable_prefix_caching=False)
    assert engine.tokenizer is not None
    compiler = GrammarCompiler(engine.tokenizer, engine.model.config.vocab_size)
    for schema in SCHEMAS.values():  # compile (and build the llguidance tokenizer) outside the timings
        compiler.for_schema(schema)
    clock = MaskClock()
    run(engine, prompts(engine, 2), 8, compiler, SCHEMAS["people"])  # warm-up
    rows, records, medians = measure(engine, compiler, clock, args)
    print_table(HEADERS, rows)
    worst = min(medians)
    verdict("grammar tokens/s", worst >= TARGET, f"worst median ratio {worst:.3f} (target >= {TARGET})")
    write_json("structured", {"args": vars(args), "target": TARGET, "cells": records})
    return exit_status()


if __name__ == "__main__":
    sys.exit(main())
