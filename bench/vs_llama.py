"""kvfence against llama.cpp's llama-server, side by side in one run: the same GGUF, streaming, greedy and
sampled, at 1, 4 and 16 streams.

    .venv/bin/python bench/vs_llama.py [--llama-server PATH | --build]
                                       [--models smollm2,gemma3-270m,llama-1b]
                                       [--streams 1,4,16] [--requests 2] [--prompt-len 246]
                                       [--max-tokens 64] [--threads 2]
                                       [--activation-dtype auto|float32|int8]
                                       [--kv-cache-dtype auto|float16]

Both servers run at once, each on the same `--threads` threads (llama-server: `-t`/`-tb`, 16 slots, continuous
batching; kvfence: `kvfence serve --num-threads`), and the rows alternate between them, so each pair sees the
same machine. A row streams `--requests` x streams fresh prompts (never a prefix another row sent) of exactly
`--prompt-len` SmolLM2 tokens with `ignore_eos` and `--max-tokens` output tokens, at most `streams` in flight:
greedy, or temperature 0.8 with top_p 0.95 (what OpenAI clients send). Models: the packaged SmolLM2 (Q4_1),
the packaged Gemma-3-270M (Q4_K_M) and `llama-1b`, a 1.07B llama-shaped file of random Q4_0 weights with
SmolLM2's tokenizer (kvfence.harness.synthetic, written once into ~/.cache/kvfence-bench), where memory
bandwidth rather than per-step overhead decides. kvfence serves with its defaults (the fast path: int8
activations and a float16 KV pool, as llama.cpp computes) unless `--activation-dtype` or `--kv-cache-dtype`
names another (`--activation-dtype float32`: the exact path). Prints a table of output
tok/s with the ratio, TTFT and TPOT p50, each server's resident memory after the rows (and its peak,
loading included) and the seconds from its start until it answered /health; writes
bench/results/vs_llama.json. Exit status 1 when a verdict fails: kvfence >= 1.2 x llama-server at every row,
sampled >= 0.9 x greedy at 16 streams (over kvfence's rows in A-B-B-A order: the table's pair, then that pair
again reversed), resident memory serving the 1B file <= 1.5 x the file plus the KV
pool (SmolLM2's is in the table: its bound, 653 MiB, is less than torch's runtime plus the pool).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path
from typing import Any

from common import (
    add_llama_server_options,
    exit_status,
    make_prompts,
    verdict,
    write_json,
)

from kvfence.config import ACTIVATION_DTYPES, KV_CACHE_DTYPES
from kvfence.harness.peers import Peer, llama_server, llama_server_binary
from kvfence.harness.procs import memory_mb
from kvfence.harness.side_by_side import PeerSpec, Served, kvfence_spec, started, timed_row
from kvfence.harness.streams import Sampling
from kvfence.harness.synthetic import benchmark_file
from kvfence.harness.tables import print_table
from kvfence.model.gguf import read_header
from kvfence.model.tokenizer import Tokenizer
from kvfence.units import parse_size

SAMPLINGS = {"greedy": Sampling(), "sampled": Sampling(temperature=0.8, top_p=0.95)}
KV_POOL = "512MiB"
SHARE_STREAMS = 16  # where sampled throughput is held to 0.9 x greedy
WINDOW = 2048  # both servers: prompt + output fit many times over
TARGET = 1.2  # kvfence / llama-server output tok/s at every row, with kvfence's defaults


def llama_peer(binary: Path) -> PeerSpec:
    def start(model: Path, args: argparse.Namespace) -> AbstractContextManager[Peer]:
        return llama_server(binary, model, args.threads, 16, 16 * WINDOW // 4)

    return PeerSpec("llama-server", start, lambda model: model.stem)


@contextmanager
def servers(
    peer: PeerSpec, model: Path, args: argparse.Namespace, systems: tuple[str, ...]
) -> Iterator[dict[str, Served]]:
    """The servers `systems` names (the peer's name, "kvfence") on `model`, started one after the other
    (each on an idle machine)."""
    with ExitStack() as stack:
        specs = [spec for spec in (peer, KVFENCE) if spec.name in systems]
        yield {spec.name: stack.enter_context(started(spec, model, args)) for spec in specs}


def kvfence_args(model: Path, args: argparse.Namespace) -> list[str]:
    serve = ["--model", str(model), "--num-threads", str(args.threads), "--max-num-seqs", "16"]
    serve += ["--max-model-len", str(WINDOW), "--kv-cache-memory", KV_POOL]
    for flag, value in (
        ("--activation-dtype", args.activation_dtype),
        ("--kv-cache-dtype", args.kv_cache_dtype),
    ):
        serve += [flag, value] if value is not None else []  # unnamed: what `kvfence serve` does alone
    return serve


KVFENCE = kvfence_spec(kvfence_args)


def row(
    served: Served, prompts: list[list[int]], args: argparse.Namespace, streams: int, sampling: str
) -> dict[str, Any]:
    """One row's summary, with the CPU the server (its processes) used over the row's wall time."""
    return timed_row(served, prompts, args.max_tokens, streams, SAMPLINGS[sampling], sampling)


def bench_model(
    peer: PeerSpec, name: str, args: argparse.Namespace, alone: bool = False
) -> list[dict[str, Any]]:
    """Every (streams, sampling) row on both servers, each row's prompts fresh. Both servers up at once,
    their rows alternating (each pair sees one machine state), or with `alone` one server at a time (a
    peer that keeps every core busy while idle, as vLLM's CPU build does, would take them from the
    other): the peer's rows, then kvfence's, the same prompts."""
    path = benchmark_file(name)
    tokenizer = Tokenizer(read_header(path)[1])
    cells = [(streams, sampling) for streams in args.streams for sampling in SAMPLINGS]
    groups = [(peer.name,), ("kvfence",)] if alone else [(peer.name, "kvfence")]
    results: dict[tuple[int, str], dict[str, Any]] = {}
    memory, ready, repeat = {}, {}, None
    for group in groups:
        with servers(peer, path, args, group) as running:
            for served in running.values():  # a warm-up each: one-off allocations are not measured
                row(served, make_prompts(tokenizer, 4, args.prompt_len, salt=-1), args, 4, "greedy")
            for index, (streams, sampling) in enumerate(cells):
                for system, served in running.items():
                    salt = 2 * index + (2 if system == "kvfence" else 1)  # a prompt set per row and server
                    prompts = make_prompts(tokenizer, args.requests * streams, args.prompt_len, salt=salt)
                    results[index, system] = found = row(served, prompts, args, streams, sampling)
                    print(f"{name} {sampling} x{streams}: {system} {found['output_tok_per_s']:.1f} tok/s")
            if "kvfence" in running and SHARE_STREAMS in args.streams:
                repeat = _repeat_share(running["kvfence"], tokenizer, args, 2 * len(cells))
            memory |= {system: memory_mb(served.pid) for system, served in running.items()}
            ready |= {system: served.ready_s for system, served in running.items()}
    rows = []
    for index, (streams, sampling) in enumerate(cells):
        found = {"model": name, "sampling": sampling, "streams": streams, "peer": peer.name, "alone": alone}
        found |= {system: results[index, system] for system in (peer.name, "kvfence")}
        found["share_repeat"] = repeat
        found["rss_mb"] = {system: now for system, (now, _) in memory.items()}
        found["peak_rss_mb"] = {system: peak for system, (_, peak) in memory.items()}
        found["ready_s"] = ready
        found["file_mb"] = path.stat().st_size / 2**20
        print(line(found), flush=True)
        rows.append(found)
    return rows


def _repeat_share(
    served: Served, tokenizer: Tokenizer, args: argparse.Namespace, salt: int
) -> dict[str, float]:
    """kvfence's sampled then greedy row again at SHARE_STREAMS: with the table's greedy-then-sampled
    pair, an A-B-B-A order, whose summed rates cancel a machine drifting at a steady pace (one pair on
    these machines swung 0.83-1.01 between rounds)."""
    found: dict[str, float] = {}
    for offset, sampling in enumerate(("sampled", "greedy"), start=1):
        prompts = make_prompts(tokenizer, args.requests * SHARE_STREAMS, args.prompt_len, salt=salt + offset)
        rate = row(served, prompts, args, SHARE_STREAMS, sampling)["output_tok_per_s"]
        found[sampling] = rate
        print(f"{served.model} {sampling} x{SHARE_STREAMS} again: kvfence {rate:.1f} tok/s", flush=True)
    return found


def line(found: dict[str, Any]) -> str:
    k, other = found["kvfence"], found[found["peer"]]
    ratio = k["output_tok_per_s"] / other["output_tok_per_s"]
    where = f"{found['model']} {found['sampling']} x{found['streams']}"
    return (
        f"{where}: kvfence {k['output_tok_per_s']:.1f} tok/s, "
        f"{found['peer']} {other['output_tok_per_s']:.1f} ({ratio:.2f}x)"
    )


def table(rows: list[dict[str, Any]]) -> None:
    """kvfence beside the peer (k / p), a row per model, sampling and streams."""
    print_table(
        ["model", "sampling", "streams", "kvfence tok/s", "peer tok/s", "ratio", "TPOT p50 k / p ms",
         "TTFT p50 k / p ms", "CPU % k / p", "RSS k / p MiB", "peak RSS k / p MiB", "ready k / p s"],
        [
            [
                r["model"], r["sampling"], r["streams"],
                f"{r['kvfence']['output_tok_per_s']:.1f}", f"{r[r['peer']]['output_tok_per_s']:.1f}",
                f"{r['kvfence']['output_tok_per_s'] / r[r['peer']]['output_tok_per_s']:.2f}x",
                f"{r['kvfence']['tpot_p50_ms']:.1f} / {r[r['peer']]['tpot_p50_ms']:.1f}",
                f"{r['kvfence']['ttft_p50_ms']:.0f} / {r[r['peer']]['ttft_p50_ms']:.0f}",
                f"{r['kvfence']['cpu_pct']:.0f} / {r[r['peer']]['cpu_pct']:.0f}",
                f"{r['rss_mb']['kvfence']:.0f} / {r['rss_mb'][r['peer']]:.0f}",
                f"{r['peak_rss_mb']['kvfence']:.0f} / {r['peak_rss_mb'][r['peer']]:.0f}",
                f"{r['ready_s']['kvfence']:.1f} / {r['ready_s'][r['peer']]:.1f}",
            ]
            for r in rows
        ],
    )  # fmt: skip
    print(
        f"peer: {rows[0]['peer']}; CPU %: the server's processes' CPU time over the row's wall (200: 2 cores)"
    )


def ratio_verdicts(rows: list[dict[str, Any]], target: float) -> list[str]:
    """kvfence / peer output tok/s >= `target` at every row."""
    found = []
    for r in rows:
        ratio = r["kvfence"]["output_tok_per_s"] / r[r["peer"]]["output_tok_per_s"]
        name = f"{r['model']} {r['sampling']} x{r['streams']}: kvfence / {r['peer']} tok/s"
        found.append(verdict(name, ratio >= target, f"{ratio:.2f}x (target >= {target}x)"))
    return found


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    found = ratio_verdicts(rows, TARGET)
    for model in sorted({r["model"] for r in rows}):
        by = {(r["sampling"], r["streams"]): r for r in rows if r["model"] == model}
        pair = by.get(("greedy", SHARE_STREAMS)), by.get(("sampled", SHARE_STREAMS))
        if pair[0] and pair[1]:
            greedy, sampled, repeat = pair[0]["kvfence"], pair[1]["kvfence"], pair[0]["share_repeat"]
            share = (sampled["output_tok_per_s"] + repeat["sampled"]) / (
                greedy["output_tok_per_s"] + repeat["greedy"]
            )
            found.append(
                verdict(f"{model} x16: sampled / greedy", share >= 0.9, f"{share:.2f} (target >= 0.9)")
            )
        if model != "llama-1b":
            continue  # the issue bounds the 1B file; under 0.2 GB the bound is less than torch's own runtime
        first = next(iter(by.values()))
        bound = 1.5 * first["file_mb"] + parse_size(KV_POOL) / 2**20
        rss = first["rss_mb"]["kvfence"]
        found.append(
            verdict(f"{model}: kvfence RSS serving", rss <= bound, f"{rss:.0f} MiB (<= {bound:.0f})")
        )
    return found


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_llama_server_options(parser)
    parser.add_argument("--models", default="smollm2,gemma3-270m,llama-1b")
    parser.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=2, help="requests per stream in a row (default 2)")
    parser.add_argument("--prompt-len", type=int, default=246)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--activation-dtype", choices=ACTIVATION_DTYPES, help="default: kvfence's own")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, help="default: kvfence's own")
    args = parser.parse_args()
    binary = llama_server_binary(args.llama_server, build=args.build)
    peer = llama_peer(binary)
    rows = [r for name in args.models.split(",") for r in bench_model(peer, name, args)]
    table(rows)
    found = {"binary": str(binary), "activation_dtype": args.activation_dtype, "rows": rows}
    found["kv_cache_dtype"] = args.kv_cache_dtype
    write_json("vs_llama", found | {"verdicts": verdicts(rows)})
    return exit_status()


if __name__ == "__main__":
    sys.exit(main())
