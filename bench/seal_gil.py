"""What a thread sealing KV pages takes from the thread beside it: cache/gcm.py's kernel (GIL released)
against cryptography's AESGCM (GIL held), side by side in one run.

    .venv/bin/python bench/seal_gil.py [--page-bytes 368640] [--rounds 5] [--round-s 0.5]

The main thread stands for the engine's: `python` counts steps of a pure-Python loop, `torch` steps of
small torch ops with Python between them (an engine step's shape: many short calls). A second thread seals
pages of `--page-bytes` (SmolLM2's 16-slot float16 page) back to back, as a tier writer with a full queue
does, or is absent. Rounds alternate none, kernel, held, held, kernel, none (`--rounds` times), so a
machine drifting at a steady pace cancels; reports the main thread's steps/s median per case, each as a
fraction of none's, and the pages/s the sealer managed. On a busy machine the sealer also competes for a
core, whatever the GIL does: the gap between the kernel's and cryptography's fraction is the GIL's part.
Writes bench/results/seal_gil.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from collections.abc import Callable

import torch
from common import write_json

from kvfence.cache.gcm import TAG_BYTES, Gcm, backend
from kvfence.harness.tables import print_table

ORDER = ("none", "kernel", "held", "held", "kernel", "none")


def python_step() -> None:
    total = 0
    for i in range(2000):
        total += i * i % 7


def torch_step(x: torch.Tensor = torch.ones(32, 32)) -> None:  # noqa: B008 (one tensor for every call)
    for _ in range(20):
        x.mul(1.0001).add_(1.0).sum()


def sealer(cipher: Gcm, page: bytes, stop: threading.Event, sealed: list[int]) -> None:
    out = memoryview(bytearray(len(page) + TAG_BYTES))
    nonce = os.urandom(12)
    while not stop.is_set():
        cipher.encrypt_into(nonce, page, b"tenant|model|layout|chain|index", out)
        sealed[0] += 1


def one_round(
    step: Callable[[], None], cipher: Gcm | None, page: bytes, seconds: float
) -> tuple[float, float]:
    """(the main thread's steps/s, the sealer's pages/s) over `seconds`."""
    stop, sealed = threading.Event(), [0]
    thread = threading.Thread(target=sealer, args=(cipher, page, stop, sealed)) if cipher else None
    if thread is not None:
        thread.start()
    steps, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        step()
        steps += 1
    elapsed = time.perf_counter() - started
    stop.set()
    if thread is not None:
        thread.join()
    return steps / elapsed, sealed[0] / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page-bytes", type=int, default=368_640)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--round-s", type=float, default=0.5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    page, key = os.urandom(args.page_bytes), os.urandom(32)
    ciphers = {"none": None, "kernel": Gcm(key), "held": Gcm(key, kernel=False)}
    rows, result = [], {"cipher": backend(), "page_bytes": args.page_bytes}
    for name, step in (("python", python_step), ("torch", torch_step)):
        found: dict[str, list[tuple[float, float]]] = {case: [] for case in ciphers}
        for _ in range(args.rounds):
            for case in ORDER:
                found[case].append(one_round(step, ciphers[case], page, args.round_s))
        steps = {case: statistics.median(s for s, _ in v) for case, v in found.items()}
        pages = {case: statistics.median(p for _, p in v) for case, v in found.items()}
        for case in ciphers:
            fraction = steps[case] / steps["none"]
            rows.append([name, case, f"{steps[case]:.0f}", f"{fraction:.3f}", f"{pages[case]:.0f}"])
            result[f"{name} {case}"] = {
                "steps_per_s": steps[case],
                "of_none": fraction,
                "pages_per_s": pages[case],
            }
    print(f"sealer: {backend()} (kernel) vs cryptography (held), {args.page_bytes} B pages")
    print_table(["main thread", "sealer", "steps/s", "x none", "pages/s sealed"], rows)
    write_json("seal_gil", result)


if __name__ == "__main__":
    main()
