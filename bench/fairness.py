"""Fairness between tenants: a flooding tenant against a light one, weighted-fair vs arrival order.

    .venv/bin/python bench/fairness.py [--flood 24] [--prompt 1000] [--output 48] [--probes 6] [--threads N]

Tenant A queues `--flood` requests of `--prompt` tokens (`--output` tokens each) at once; tenant B then
sends `--probes` short requests one after another, each as soon as the previous one has its first token.
The same run is made with the scheduler's weighted-fair order and with arrival order (FIFO), one engine
each over one shared model, plus B alone on an idle engine. Per policy it reports B's TTFT p50/p95, A's
completion, total output tok/s, and the verdicts of issue 14: B's TTFT p95 <= 2x its idle TTFT plus one
prefill step (timed in a separate run of A's prompts alone, so the bound owes nothing to the runs it
judges), FIFO's B TTFT p95 above that same bound (the bound can fail), and total throughput within 5% of
FIFO. Exits 1 when a verdict fails. Writes bench/results/fairness.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any

from common import (
    DEFAULT_THREADS,
    THREADS_HELP,
    build_engine,
    exit_status,
    load_weights,
    make_prompts,
    verdict,
    warm_up,
    write_json,
)

from kvfence.engine.engine import LLMEngine
from kvfence.harness.tables import print_table
from kvfence.model.gguf import GGUFModel
from kvfence.model.transformer import Transformer
from kvfence.request import Request
from kvfence.sampling import SamplingParams
from kvfence.units import cdiv


@dataclass
class Run:
    policy: str
    b_ttft_s: list[float]
    wall_s: float
    output_tokens: int
    a_finished: int
    longest_step_s: float

    def row(self) -> list[object]:
        p50, p95 = percentile(self.b_ttft_s, 50), percentile(self.b_ttft_s, 95)
        tok_s = self.output_tokens / self.wall_s if self.wall_s else 0.0
        return [
            self.policy,
            len(self.b_ttft_s),
            f"{p50:.2f}",
            f"{p95:.2f}",
            self.a_finished,
            f"{self.wall_s:.1f}",
            f"{tok_s:.1f}",
        ]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else 0.0


def run(engine: LLMEngine, flood: list[list[int]], probes: list[list[int]], output: int, policy: str) -> Run:
    """A's flood first, then B's probes one at a time; every step timed."""
    a_params = SamplingParams(max_tokens=output, ignore_eos=True)
    b_params = SamplingParams(max_tokens=4, ignore_eos=True)
    started = time.perf_counter()
    a = [engine.add_request(p, a_params, "A") for p in flood]
    b_done: list[Request] = []
    pending = list(probes)
    current = engine.add_request(pending.pop(0), b_params, "B") if pending else None
    longest = 0.0
    while engine.has_unfinished() or current is not None:
        t = time.perf_counter()
        engine.step()
        longest = max(longest, time.perf_counter() - t)
        if current is not None and current.first_token_time is not None:
            b_done.append(current)
            current = engine.add_request(pending.pop(0), b_params, "B") if pending else None
    wall = time.perf_counter() - started
    ttft = [r.first_token_time - r.arrival_time for r in b_done if r.first_token_time is not None]
    tokens = sum(len(r.output_token_ids) for r in [*a, *b_done])
    return Run(policy, ttft, wall, tokens, sum(r.finish_reason == "length" for r in a), longest)


def prefill_step_s(gguf: GGUFModel, model: Transformer, probes: int, prompt: int) -> float:
    """The bound's "one prefill step", timed apart from the runs it judges (their own longest step would let
    the bound grow with whatever they did): on an engine of its own, fresh A-length prompts alone fill the
    step's token budget `probes` times over; the slowest of those full steps. Under the flood a fair
    scheduler gives each probe its first token from one such full step (its 32 tokens beside A's chunks),
    so B's p95 over `probes` probes is the slowest of as many full steps."""
    engine = build_engine(gguf, model=model)
    assert engine.tokenizer is not None
    warm_up(engine, engine.tokenizer)
    count = cdiv(probes * engine.config.max_num_batched_tokens, prompt) + 1
    prompts = make_prompts(engine.tokenizer, count, prompt, salt=5)
    return run(engine, prompts, [], 1, "A alone").longest_step_s


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--flood", type=int, default=24)
    parser.add_argument("--prompt", type=int, default=1000)
    parser.add_argument("--output", type=int, default=48)
    parser.add_argument("--probes", type=int, default=6)
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS, help=THREADS_HELP)
    args = parser.parse_args()
    gguf = load_weights(args.threads)
    model = Transformer.from_gguf(gguf)
    engines = {fair: build_engine(gguf, model=model, fair_scheduling=fair) for fair in (True, False)}
    tokenizer = engines[True].tokenizer
    assert tokenizer is not None
    for engine in engines.values():
        warm_up(engine, tokenizer)
    flood = make_prompts(tokenizer, args.flood, args.prompt, salt=1)
    idle = run(engines[True], [], make_prompts(tokenizer, args.probes, 32, salt=2), args.output, "B alone")
    step_s = prefill_step_s(gguf, model, args.probes, args.prompt)
    runs = [idle]
    for fair, policy in ((True, "fair"), (False, "fifo")):  # fresh probe prompts each: no prefix hits
        probes = make_prompts(tokenizer, args.probes, 32, salt=3 + fair)
        runs.append(run(engines[fair], flood, probes, args.output, policy))
    print_table(
        ["policy", "B reqs", "B TTFT p50 s", "B TTFT p95 s", "A done", "wall s", "out tok/s"],
        [r.row() for r in runs],
    )
    fair, fifo = runs[1], runs[2]
    idle_p95, fair_p95, fifo_p95 = (percentile(r.b_ttft_s, 95) for r in runs)
    bound = 2 * idle_p95 + step_s
    bound_text = f"2 x idle {idle_p95:.2f}s + one prefill step {step_s:.2f}s (timed alone) = {bound:.2f}s"
    ratio = (fair.output_tokens / fair.wall_s) / (fifo.output_tokens / fifo.wall_s)
    verdict("B TTFT p95 under flood, fair", fair_p95 <= bound, f"{fair_p95:.2f}s <= {bound_text}")
    verdict("B TTFT p95 under flood, FIFO fails it", fifo_p95 > bound, f"{fifo_p95:.2f}s > {bound_text}")
    verdict("throughput vs FIFO", ratio >= 0.95, f"fair / fifo output tok/s = {ratio:.3f} (target >= 0.95)")
    payload: dict[str, Any] = {
        "args": vars(args),
        "runs": [r.__dict__ for r in runs],
        "prefill_step_s": step_s,
        "b_ttft_p95_bound_s": bound,
        "throughput_ratio_fair_over_fifo": ratio,
    }
    write_json("fairness", payload)
    return exit_status()


if __name__ == "__main__":
    sys.exit(main())
