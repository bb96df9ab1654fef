"""What the benchmark scripts share: their workloads, their thread option, their results directory and their
verdicts, and the harness's runners under the names the scripts import (`from common import ...`).

The logic lives in kvfence.harness (offline_engine.py: weights, engines, prompts; contention.py: the shared
machine; timings.py: request timings, a run's result and its table row; timed_runs.py: offline and HTTP
runs; hf_baseline.py: HF transformers; bandwidth.py: memory bandwidth; verdicts.py; results.py: the JSON
written). What is here is the scripts' own: one process, one script, one set of verdicts.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfence.harness.bandwidth import decode_matmul_bandwidth, read_bandwidth
from kvfence.harness.contention import CONTENDED, ForeignCpu, contention_threshold, quietly, wait_for_quiet
from kvfence.harness.hf_baseline import load_hf_model, run_hf
from kvfence.harness.offline_engine import build_engine, load_weights, make_prompts
from kvfence.harness.results import write_results
from kvfence.harness.timed_runs import run_kvfence, run_streams, warm_up
from kvfence.harness.timings import RUN_HEADERS, RunResult, median_min_max, run_cells
from kvfence.harness.verdicts import Verdicts

__all__ = [  # the harness's names the scripts import from here
    "CONTENDED",
    "RUN_HEADERS",
    "ForeignCpu",
    "RunResult",
    "build_engine",
    "contention_threshold",
    "decode_matmul_bandwidth",
    "load_hf_model",
    "load_weights",
    "make_prompts",
    "median_min_max",
    "quietly",
    "read_bandwidth",
    "run_cells",
    "run_hf",
    "run_kvfence",
    "run_streams",
    "wait_for_quiet",
    "warm_up",
]

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Workload:
    name: str
    num_requests: int
    prompt_len: int
    max_tokens: int

    def scaled(self, num_requests: int) -> Workload:
        return Workload(self.name, num_requests, self.prompt_len, self.max_tokens)


W1 = Workload("W1", num_requests=32, prompt_len=64, max_tokens=128)  # decode-heavy
W2 = Workload("W2", num_requests=32, prompt_len=512, max_tokens=16)  # prefill-heavy
WORKLOADS = {w.name: w for w in (W1, W2)}


DEFAULT_THREADS = 2  # see THREADS_HELP
THREADS_HELP = (
    "torch intra-op threads (default 2, the engine's default; kvfence and HF alike). On a quiet 2-core "
    "machine two threads are faster (c16 decode 121 vs 163 ms/step, measured), but two OpenMP threads slow "
    "down up to 10x whenever another process takes a core: on a shared machine --threads 1 degrades "
    "gracefully."
)


VERDICTS = Verdicts()  # the script's own: one process, one script


def verdict(name: str, passed: bool, detail: str) -> str:
    """Print and return the verdict's line; a FAIL makes `exit_status()` non-zero."""
    line = f"{VERDICTS.record(name, passed)}  {name}: {detail}"
    print(line)
    return line


def exit_status() -> int:
    """What a bench script exits with (`sys.exit(main())`): non-zero when any of its verdicts failed."""
    return VERDICTS.exit_status()


def write_json(name: str, payload: dict[str, Any]) -> Path:
    """bench/results/NAME.json: `payload` beside what was measured where (kvfence.harness.results)."""
    return write_results(RESULTS_DIR, name, payload)


def add_llama_server_options(parser: argparse.ArgumentParser) -> None:
    """--llama-server and --build: where the peer's binary comes from (kvfence.harness.peers)."""
    parser.add_argument(
        "--llama-server", type=Path, help="the binary (default: $KVFENCE_LLAMA_SERVER or cache)"
    )
    parser.add_argument("--build", action="store_true", help="build llama-server if none is found (~10 min)")
