"""The landing wire's deadlines on a quiet and a busy machine: how soon a stopped landing process fails its
transfer closed, and whether an honest one is ever refused while two busy loops share the CPUs.

    .venv/bin/python bench/landing_deadlines.py [--rounds 10] [--writes 200] [--hogs 2]

Two real landing processes (`LandingAgent`, a uid of their own each, UCX on loopback), 16 slots of 64 KiB.
  stopped   a WRITE is posted, its sender's landing process gets SIGSTOP; time until the WRITE polls ERR
            (the call's deadline judged it, the process was killed and another started), per round.
  honest    `--writes` WRITEs of 4 slots each, polled to the end: how many ended ERR, how many restarts.
Each runs quiet, then beside `--hogs` busy loops (kvfence.harness.procs.busy_loops). Needs root and NIXL.
JSON on stdout and in bench/results/landing_deadlines.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import time
from pathlib import Path
from typing import Any

from kvfence.disagg.landing import LandingAgent
from kvfence.harness.procs import busy_loops

RESULTS = Path(__file__).parent / "results" / "landing_deadlines.json"
SLOTS, SLOT_BYTES = 16, 64 << 10


def finish(sender: LandingAgent, receiver: LandingAgent, write: Any) -> str:
    while (state := sender.poll(write)) == "PROC":
        receiver.notified()
    return state


def stopped_rounds(rounds: int) -> list[float]:
    """Seconds from SIGSTOP of the sender's landing process to its WRITE's ERR, one a round."""
    times = []
    for _ in range(rounds):
        sender, receiver = (
            LandingAgent("sender", SLOTS, SLOT_BYTES, "lo"),
            LandingAgent("receiver", SLOTS, SLOT_BYTES, "lo"),
        )
        try:
            peer = sender.add_peer(receiver.metadata())
            write = sender.write(peer, receiver.layout, [(0, 0)], "r")
            assert sender.pid is not None
            os.kill(sender.pid, signal.SIGSTOP)
            began = time.monotonic()
            state = finish(sender, receiver, write)
            times.append(time.monotonic() - began)
            assert state == "ERR" and sender.restarts == 1, (state, sender.restarts)
        finally:
            sender.close()
            receiver.close()
    return times


def honest_writes(writes: int) -> dict[str, int]:
    sender, receiver = (
        LandingAgent("sender", SLOTS, SLOT_BYTES, "lo"),
        LandingAgent("receiver", SLOTS, SLOT_BYTES, "lo"),
    )
    try:
        peer = sender.add_peer(receiver.metadata())
        states = [
            finish(
                sender,
                receiver,
                sender.write(peer, receiver.layout, [(i % 4 * 4 + k, k) for k in range(4)], f"r{i}"),
            )
            for i in range(writes)
        ]
        return {
            "writes": writes,
            "refused": states.count("ERR"),
            "restarts": sender.restarts + receiver.restarts,
        }
    finally:
        sender.close()
        receiver.close()


def measure(rounds: int, writes: int) -> dict[str, Any]:
    stopped = stopped_rounds(rounds)
    return {
        "stopped_s": {"median": statistics.median(stopped), "max": max(stopped)},
        "honest": honest_writes(writes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--writes", type=int, default=200)
    parser.add_argument("--hogs", type=int, default=2)
    args = parser.parse_args()
    results = {"quiet": measure(args.rounds, args.writes)}
    with busy_loops(args.hogs):
        results[f"{args.hogs} busy loops"] = measure(args.rounds, args.writes)
    for name, row in results.items():
        s, h = row["stopped_s"], row["honest"]
        print(f"{name:>14}: SIGSTOP -> ERR median {s['median']:.2f} s, max {s['max']:.2f} s; "
              f"honest WRITEs {h['writes']}: {h['refused']} refused, {h['restarts']} restarts")  # fmt: skip
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
