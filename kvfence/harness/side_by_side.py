"""Servers set side by side on one model file, and one timed row of streams against one of them: what
bench/vs_llama.py, bench/vs_vllm.py and bench/long_context.py compare kvfence with its peers through.

Contracts: `started(spec, model, args)` starts the server `spec` names on `model`, yields it (`Served`: its
URL, pid, the seconds until it answered /health, the model id its requests name) once healthy and stops it on
leaving; `kvfence_spec(serve_args)` is `kvfence serve` as such a spec; `timed_row` streams every prompt
(`timed_runs.run_streams`: ignore_eos, a broken or short answer raises), at most `streams` in flight, and
sums the row like `RunResult.summary()` plus the server's CPU (its process and descendants) over the row's
wall time.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfence.harness.cluster import cluster
from kvfence.harness.peers import Peer
from kvfence.harness.procs import cpu_seconds
from kvfence.harness.streams import Sampling
from kvfence.harness.timed_runs import run_streams
from kvfence.harness.timings import RunResult


@dataclass(frozen=True)
class Served:
    url: str
    pid: int
    ready_s: float  # from its start until /health answered
    model: str  # the model id its requests name


@dataclass(frozen=True)
class PeerSpec:
    """An engine in the comparison: its name in the tables, how it starts on a model file (beside the
    bench's arguments), and the model id its requests name."""

    name: str
    start: Callable[[Path, argparse.Namespace], AbstractContextManager[Peer]]
    model_id: Callable[[Path], str]


@contextmanager
def started(spec: PeerSpec, model: Path, args: argparse.Namespace) -> Iterator[Served]:
    """`spec`'s server on `model`, healthy, with the seconds it took to be."""
    start = time.perf_counter()
    with spec.start(model, args) as peer:
        yield Served(peer.url, peer.pid, time.perf_counter() - start, spec.model_id(model))


@contextmanager
def _kvfence(serve_args: list[str]) -> Iterator[Peer]:
    with cluster(serve_args=serve_args) as running:
        yield Peer(running.url, running.processes[0].pid)


def kvfence_spec(serve_args: Callable[[Path, argparse.Namespace], list[str]]) -> PeerSpec:
    """`kvfence serve SERVE_ARGS(model, args)` as one process; its requests name the file's stem."""
    return PeerSpec("kvfence", lambda model, args: _kvfence(serve_args(model, args)), lambda m: m.stem)


def timed_row(
    served: Served, prompts: list[list[int]], max_tokens: int, streams: int, sampling: Sampling, label: str
) -> dict[str, Any]:
    """One row's summary (percentiles in ms), with the CPU % the server used over the row's wall time."""
    cpu = cpu_seconds(served.pid)
    _, timings, wall = run_streams(served.url, prompts, max_tokens, streams, served.model, sampling)
    used = cpu_seconds(served.pid) - cpu
    result = RunResult(label, streams, len(timings), wall, sum(t.num_output for t in timings), timings)
    return result.summary() | {"cpu_pct": 100 * used / wall}
