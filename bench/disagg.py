"""Disaggregated serving vs single node on W1, through the HTTP API; what CURVE costs against the plain
transport (`--insecure-transport`); what page checksums cost.

    .venv/bin/python bench/disagg.py [--requests N] [--concurrency C] [--max-tokens N] [--pages N]
                                     [--rounds R] [--transport-pages N] [--transport-rounds R]

Same cores for every system (this machine has 2):
  single node             `kvfence serve --num-threads 2`: one engine, 2 torch threads;
  disaggregated           `kvfence serve --disaggregated --num-threads 1`: a prefill and a decode worker
                          process with 1 torch thread each, the router and the HTTP server in the parent
                          process; CURVE between the three (ephemeral keys), the default;
  disaggregated insecure  the same with `--insecure-transport`: plain TCP, no authentication.
The two disaggregated systems run `--rounds` times each, in alternating order (CURVE first in even rounds,
plain first in odd ones) so that a drifting machine load does not favour one; each transport's figures pool
its rounds. Verdict: CURVE's cost = 1 - CURVE / plain output tok/s (mean over rounds), target <= 10%; and
the ratio of the transfer GB/s (pooled audit trails) CURVE / plain. The server's own "transport:" log line
is checked, so a row is labelled with the transport it actually ran.
Each server is a subprocess; this process only drives load: W1 (32 distinct 64-token prompts, 128 output
tokens, greedy, ignore_eos so every request yields exactly 128 tokens) on /v1/completions with token-id
prompts and `stream: true`, 16 requests in flight (httpx.AsyncClient).
  TTFT  request sent -> first SSE chunk carrying text;
  TPOT  (last chunk - first text chunk) / (completion_tokens - 1), completion_tokens from the usage chunk.
Transfer GB/s comes from the audit trail of every measured request (admin endpoint): bytes = decode's
`page_received` events x bytes per page; "send" time = prefill's transfer_started -> transfer_complete (read,
checksum and hand each page to ZeroMQ); "end to end" time = transfer_started -> decode's last page_received
(adds the wire, decode's checks and write, and the wait for decode's current step to end).
"decode burst" = pages 2..n / first -> last page_received: decode's own rate once it handles the pages.
Checksum cost: there is no switch to turn verification off, so a microbenchmark replays the handoff of
`--pages` real-size pages in this process, one torch thread (prefill's read+serialize and xxh3_64, a ZeroMQ
send over loopback TCP, decode's receive and parse, xxh3_64 verification and write, each timed, one page at
a time) and reports the checksums' share of that time; once over CURVE and once over the plain transport.
Transport microbenchmark: two ZmqConnectors in this process (prefill -> decode, loopback TCP, CURVE with
ephemeral keys or none) stream `--transport-pages` `Page` messages of a real page's bytes, at most 64 in
flight, received and counted here: GB/s received, median of `--transport-rounds` alternating rounds.
"idle CPU" is what each server process burned, in % of one core, during 3 s with no request in flight.
Writes bench/results/disagg.json.

`--scale`: instead, single node (2 torch threads) beside N x M workers: `serve --disaggregated` with 1
prefill x 1 decode and with 2 x 2 worker processes (1 torch thread each, CURVE), W1 at `--scale-concurrency`
(default 16 and 64): output tok/s, TTFT p50/p95, the 2x2 / 1x1 and 1x1 / single ratios, and the CPU each
process used during the load (% of one core: on 2 cores, four workers compete, so the ratios and the CPU
tell more than the absolute rates); then bench/kv_transport.py's NIXL vs zmq page transfer (16-page
requests) beside it. Writes bench/results/disagg_scale.json.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import kv_transport
from common import (
    CONTENDED,
    RUN_HEADERS,
    VERDICTS,
    W1,
    RunResult,
    exit_status,
    make_prompts,
    run_cells,
    write_json,
)

from kvfence.harness.curve_cost import TransportSummary, compare, summarize
from kvfence.harness.page_handoff import STAGES, checksum_microbench
from kvfence.harness.page_stream import transport_microbench
from kvfence.harness.served_systems import SystemRun, run_system, scale_ratios
from kvfence.harness.tables import print_table
from kvfence.harness.trail_transfer import page_bytes
from kvfence.model.gguf import read_header
from kvfence.model.tokenizer import Tokenizer
from kvfence.pins import default_model_path

SYSTEMS = {  # label -> extra `kvfence serve` arguments
    "single node": ["--num-threads", "2"],
    "disaggregated": ["--disaggregated", "--num-threads", "1"],
    "disaggregated insecure": ["--disaggregated", "--insecure-transport", "--num-threads", "1"],
    "PD 1x1": ["--disaggregated", "--num-threads", "1"],
    "PD 2x2": ["--disaggregated", "--prefill-workers", "2", "--decode-workers", "2", "--num-threads", "1"],
}
SCALE = ("single node", "PD 1x1", "PD 2x2")  # --scale: these systems at each --scale-concurrency
TRANSPORTS = {"disaggregated": "CURVE", "disaggregated insecure": "plain"}  # disaggregated label -> transport


def run_labelled(
    label: str,
    prompts: list[list[int]],
    warm: list[list[int]],
    max_tokens: int,
    concurrency: int,
    round_: int = 0,
) -> SystemRun:
    """The system `label` (SYSTEMS), its transport checked against its label's (TRANSPORTS)."""
    return run_system(
        label,
        SYSTEMS[label],
        prompts,
        warm,
        max_tokens,
        concurrency,
        round_,
        transport_expected=TRANSPORTS.get(label),
    )


# ---- report ---------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=W1.num_requests)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=W1.max_tokens)
    parser.add_argument("--pages", type=int, default=1000, help="pages in the checksum microbenchmark")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of each disaggregated transport (CURVE, plain), alternating",
    )
    parser.add_argument(
        "--transport-pages", type=int, default=500, help="pages per round of the transport microbenchmark"
    )
    parser.add_argument(
        "--transport-rounds", type=int, default=3, help="rounds of the transport microbenchmark"
    )
    parser.add_argument("--skip-single-node", action="store_true", help="only the two disaggregated systems")
    parser.add_argument("--scale", action="store_true", help="1x1 vs 2x2 workers, and NIXL vs zmq transfer")
    parser.add_argument("--scale-concurrency", type=int, nargs="+", default=[16, 64])
    return parser.parse_args()


def scale_bench(args: argparse.Namespace, prompts: list[list[int]], warm: list[list[int]]) -> None:
    """Single node, 1x1 and 2x2 workers at each concurrency, then the KV transport microbenchmark."""
    runs = []
    for concurrency in args.scale_concurrency:
        for label in SCALE:
            print(f"{label}: {len(prompts)} requests at concurrency {concurrency}", flush=True)
            runs.append(run_labelled(label, prompts, warm, args.max_tokens, concurrency))
            print(f"  {runs[-1].result.tok_per_s:.1f} output tok/s", flush=True)
    rows = []
    for run in runs:
        r = run.result
        cpu = " ".join(f"{name} {v:.0f}" for name, v in (run.load_cpu_pct or {}).items())
        rows.append([r.label, r.concurrency, f"{r.tok_per_s:.1f}", *_ttft_ms(r), f"{r.foreign_cpu:.0%}", cpu])
    ratios = scale_ratios(runs, args.scale_concurrency, SCALE)
    headers = [
        "system",
        "conc",
        "out tok/s",
        "TTFT p50 ms",
        "TTFT p95 ms",
        "others' CPU",
        "CPU % per process",
    ]
    print_table(headers, rows)
    for concurrency, ratio in ratios.items():
        print(
            f"concurrency {concurrency}: 2x2/1x1 output tok/s {ratio['tok_per_s_2x2_over_1x1']:.2f}x, "
            f"TTFT p50 {ratio['ttft_p50_2x2_over_1x1']:.2f}x; 1x1/single node output tok/s "
            f"{ratio['tok_per_s_1x1_over_single']:.2f}x"
        )
    wire = kv_transport.run(16, 20)
    print(kv_transport.table(wire))
    runs_json = [run.summary() for run in runs]
    write_json(
        "disagg_scale",
        {"runs": runs_json, "ratios": ratios, "kv_transport": wire, "max_tokens": args.max_tokens},
    )


def _ttft_ms(result: RunResult) -> list[str]:
    return [f"{result.pct('ttft', q) * 1e3:.0f}" for q in (50, 95)]


def w1_row(run: SystemRun) -> list[object]:
    idle = " ".join(f"{name} {v:.0f}" for name, v in run.idle_cpu_pct.items())
    label, *cells = run_cells(run.result)
    return [label, run.transport, run.round, *cells, idle]


def report(
    runs: list[SystemRun],
    transports: list[TransportSummary],
    versus: dict[str, Any],
    checksums: list[dict[str, Any]],
    wire: dict[str, Any],
) -> None:
    print(
        "\nW1 through the HTTP API (ms columns). others %: CPU share of unrelated processes during the run."
    )
    print("idle CPU %: % of one core per server process (server, prefill, decode), with nothing in flight.")
    headers = [RUN_HEADERS[0], "transport", "round", *RUN_HEADERS[1:], "idle CPU %"]
    print_table(headers, [w1_row(run) for run in runs])
    print("\nKV transfer (disaggregated runs, from the audit trail). send: prefill's transfer_started ->")
    print("transfer_complete. end to end: transfer_started -> decode's last page_received (includes the wait")
    print("for decode's running step). decode burst: pages 2..n of a request / first -> last page_received.")
    print_table(
        [
            "transport",
            "requests",
            "pages",
            "MB moved",
            "send GB/s",
            "end-to-end GB/s",
            "e2e median req",
            "decode burst GB/s",
        ],
        [
            [
                summary.transport,
                summary.rates["requests"],
                summary.rates["pages"],
                summary.rates["mb_moved"],
                summary.rates["send_gb_per_s"],
                summary.rates["end_to_end_gb_per_s"],
                summary.rates["end_to_end_gb_per_s_median_request"],
                summary.rates["decode_burst_gb_per_s"],
            ]
            for summary in transports
        ],
    )
    print(
        f"\nCURVE vs plain transport, disaggregated, {versus['rounds']} round(s) each. out tok/s: mean of"
        " the rounds;\nTTFT (ms): every request of the rounds; GB/s: the pooled trails."
    )
    print_table(
        ["transport", "runs", "out tok/s", "TTFT p50", "TTFT p95", "send GB/s", "e2e GB/s", "others %"],
        [
            [
                s.transport,
                s.runs,
                s.tok_per_s,
                s.ttft_p50_s * 1e3,
                s.ttft_p95_s * 1e3,
                s.rates["send_gb_per_s"],
                s.rates["end_to_end_gb_per_s"],
                f"{s.foreign_cpu * 100:.0f}",
            ]
            for s in transports
        ],
    )
    ratio = versus["transfer_gb_per_s_curve_over_plain"]
    # A contended run's verdict is noise: it reads NOISY, but a miss still fails the exit status.
    result = VERDICTS.record("CURVE cost", versus["passed"])
    tag = "NOISY" if versus["contended"] else result
    print(
        f"{tag}  CURVE costs {versus['curve_cost_pct']:.1f}% of PD output "
        f"tok/s (target <= {versus['target_pct']:.0f}%)"
    )
    print(
        f"      transfer GB/s CURVE / plain: send {ratio['send']:.2f}, end to end {ratio['end_to_end']:.2f}, "
        f"decode burst {ratio['decode_burst']:.2f}"
    )
    if versus["contended"]:
        print(
            f"      (contended: others used > {CONTENDED * 100:.0f}% of the CPUs during a run: the verdict"
            f" is noise; it would read {result})"
        )
    first = checksums[0]
    print(
        f"\nChecksum microbenchmark: {first['pages']} pages of {first['bytes_per_page']} bytes, us per page"
    )
    print_table(
        ["transport", *STAGES, "total", "checksum share %", "GB/s", "GB/s w/o checksums"],
        [
            [
                micro["transport"],
                *(micro["us_per_page"][s] for s in STAGES),
                micro["us_per_page_total"],
                micro["checksum_share"] * 100,
                micro["gb_per_s_with_checksums"],
                micro["gb_per_s_without_checksums"],
            ]
            for micro in checksums
        ],
    )
    print(
        f"\nTransport microbenchmark: {wire['pages']} pages of {wire['bytes_per_page']} bytes streamed, "
        f"at most {wire['in_flight']} in flight, GB/s received (median of {wire['rounds']} rounds)"
    )
    print_table(
        ["transport", "GB/s", "rounds"],
        [
            [t, wire["gb_per_s_median"][t], " ".join(f"{v:.2f}" for v in wire["gb_per_s"][t])]
            for t in ("CURVE", "plain")
        ],
    )
    print(f"      CURVE / plain: {wire['curve_over_plain']:.2f}")


def main() -> int:
    args = parse_args()
    config, metadata = read_header(default_model_path())
    tokenizer = Tokenizer(metadata)
    prompts = make_prompts(tokenizer, args.requests, W1.prompt_len)
    warm = make_prompts(tokenizer, 2, 48, salt=-1)
    if args.scale:
        scale_bench(args, prompts, warm)
        return exit_status()
    print(f"checksum microbenchmark over {args.pages} pages, CURVE and plain", flush=True)
    checksums = [checksum_microbench(config, args.pages, transport) for transport in ("CURVE", "plain")]
    print(f"transport microbenchmark: {args.transport_rounds} x {args.transport_pages} pages", flush=True)
    wire = transport_microbench(config, args.transport_pages, args.transport_rounds)
    schedule = [] if args.skip_single_node else [("single node", 0)]
    for round_ in range(args.rounds):
        pair = list(TRANSPORTS) if round_ % 2 == 0 else list(TRANSPORTS)[::-1]
        schedule += [(label, round_) for label in pair]
    runs = []
    for label, round_ in schedule:
        print(
            f"{label} (round {round_}): {args.requests} requests at concurrency {args.concurrency}",
            flush=True,
        )
        runs.append(run_labelled(label, prompts, warm, args.max_tokens, args.concurrency, round_))
        print(f"  {runs[-1].result.tok_per_s:.1f} output tok/s", flush=True)
    bytes_per_page = page_bytes(config)
    curve, plain = (summarize(runs, transport, bytes_per_page) for transport in ("CURVE", "plain"))
    versus = compare(curve, plain)
    report(runs, [curve, plain], versus, checksums, wire)
    write_json(
        "disagg",
        {
            "workload": {
                "prompt_len": W1.prompt_len,
                "max_tokens": args.max_tokens,
                "requests": args.requests,
                "concurrency": args.concurrency,
                "rounds": args.rounds,
            },
            "systems": {label: " ".join(["kvfence serve", *extra]) for label, extra in SYSTEMS.items()},
            "runs": [run.summary() for run in runs],
            "transfer": curve.rates,  # the default deployment's (CURVE)
            "transfer_by_transport": {s.transport: s.rates for s in (curve, plain)},
            "transfer_method": "audit trail: decode page_received x bytes per page / prefill transfer time",
            "curve_vs_plain": versus,
            "checksum_microbench": {micro["transport"]: micro for micro in checksums},
            "transport_microbench": wire,
        },
    )
    return exit_status()


if __name__ == "__main__":
    sys.exit(main())
