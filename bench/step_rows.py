"""A decode step's time against its rows, and the most speculation could give at a stream count.

    .venv/bin/python bench/step_rows.py [--model PATH] [--rows 16,32,48,64,96] [--rounds 2] [--threads 2]

kvfence's defaults in process (the packaged SmolLM2 unless --model): for each row count a fresh engine over
the same weights decodes that many 64-token-prompt requests at once; a row count's time is the best over
`--rounds` rounds (each round runs every count once, in turn) of the median decode step
(kvfence.harness.step_rows). Speculation's ceiling at the smallest count with k drafts a stream: (1 + k)
tokens a stream for a step of (1 + k) times the rows, every draft kept, verify rows costing decode rows'.
Where the step is linear in its rows, no draft length pays at that stream count. Prints the load and what
other processes took of the CPUs; writes bench/results/step_rows.json.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from common import DEFAULT_THREADS, THREADS_HELP, ForeignCpu, load_weights, write_json

from kvfence.harness.step_rows import ceiling, decode_step_seconds
from kvfence.harness.tables import print_table
from kvfence.model.transformer import Transformer


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--rows", default="16,32,48,64,96")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS, help=THREADS_HELP)
    args = parser.parse_args()
    gguf = load_weights(args.threads, args.model)
    model = Transformer.from_gguf(gguf)
    counts = [int(r) for r in args.rows.split(",")]
    others, load_before = ForeignCpu(), os.getloadavg()
    seconds = {n: float("inf") for n in counts}
    for _ in range(args.rounds):
        for n in counts:
            seconds[n] = min(seconds[n], decode_step_seconds(gguf, model, n))
    share = others.share()
    base = counts[0]
    print_table(
        ["rows", "step ms", "ms a row", f"x {base} rows' step"],
        [[n, f"{1e3 * s:.1f}", f"{1e3 * s / n:.2f}", f"{s / seconds[base]:.2f}"] for n, s in seconds.items()],
    )
    ceilings = {k: ceiling(seconds, base, k) for k in range(1, 8) if base * (1 + k) in seconds}
    for k, c in ceilings.items():
        print(f"{base} streams, {k} draft(s) each, every one kept: at most {c:.2f}x")
    print(f"load average before {load_before}, after {os.getloadavg()}; others took {share:.0%} of the CPUs")
    write_json(
        "step_rows",
        {"seconds": seconds, "ceilings": ceilings, "others_share": share, "load_average": os.getloadavg()},
    )


if __name__ == "__main__":
    main()
