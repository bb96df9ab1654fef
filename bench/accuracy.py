"""The fast default's accuracy, the way llama.cpp measures its own: perplexity and KL divergence over a
fixed offline text, kvfence's defaults against its exact float32 path and against llama.cpp.

    .venv/bin/python bench/accuracy.py [--models smollm2,gemma3-270m] [--ctx 512,2048] [--chunks 24]
                                       [--llama-server PATH | --build] [--threads 2]

The text: Python's documentation topics (kvfence.harness.accuracy.reference_text; its sha256 is printed),
cut into chunks of `--ctx` tokens, the second half of each scored (as `llama-perplexity` scores). Per model
and context, on the same chunks:
  kvfence fast     `kvfence serve`'s defaults (int8 activations, float16 KV pool for a block-quantized file)
  kvfence float32  `--activation-dtype float32`: the exact path, the reference for KL and top-1
  llama.cpp        `llama-perplexity -c CTX --chunks N` on the same GGUF and text file, built from the
                   source the peer server is (kvfence.harness.peers.llama_tool), `-t --threads`
KL divergence of the fast path's distributions from float32's (mean and p99 over scored tokens) and the
share of tokens whose most likely token is the same; and llama.cpp's own against the same float32
reference: kvfence's float32 log-probabilities are written as the tool's `--kl-divergence-base` file
(kvfence.harness.accuracy.LlamaBaseLogits), and `llama-perplexity --kl-divergence` runs the same chunks
against it (the perplexity it reads back for the base must be kvfence's float32 one, or the run fails).
`llama-1b` (the 1.07B synthetic file, random weights) is a speed check only: seconds per chunk, kvfence's
defaults against llama-perplexity's pass, no float32 path and no goal. A packaged model's name with
`-bf16-dir` (`smollm2-bf16-dir`, `gemma3-270m-bf16-dir`) scores the Hugging Face directory transformers
writes of that file in bfloat16 (kvfence.harness.hf_dirs): kvfence's defaults there (bfloat16 rows on a CPU
with AVX512-BF16) against its float32 rows over the same weights, no llama.cpp row. Goals: kvfence fast
within 1% of llama.cpp's perplexity (a directory: of float32's), top-1 agreement >= 98%; exit status 1 when
one fails. JSON in bench/results/accuracy.json, one row per model and context (a run replaces its own
rows).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvfence.config import EngineConfig
from kvfence.engine.engine import LLMEngine, load_engine
from kvfence.harness.accuracy import Comparison, LlamaBaseLogits, Scorer, chunks, reference_text, sha256
from kvfence.harness.hf_dirs import bf16_dir_from_gguf
from kvfence.harness.peers import llama_server_binary, llama_tool
from kvfence.harness.synthetic import SYNTHETIC, benchmark_file

RESULTS = Path(__file__).parent / "results" / "accuracy.json"
TEXT = RESULTS.parent / "accuracy_text.txt"
PPL_GOAL, TOP1_GOAL = 0.01, 0.98
DIRECTORY = "-bf16-dir"  # a packaged model's name with this: its bfloat16 Hugging Face directory


def engine(model: Path, ctx: int, threads: int, activation_dtype: str) -> LLMEngine:
    config = EngineConfig(
        model=model,
        max_model_len=ctx + 1,  # the chunk and the one token every request must ask for
        num_pages=2 * ctx // 16 + 8,
        enable_prefix_caching=False,
        num_threads=threads,
        activation_dtype=activation_dtype,
    )
    return load_engine(config, log=lambda _: None)  # type: ignore[return-value]


def timed(score: Scorer, chunk: list[int], seconds: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    started = time.perf_counter()
    scored = score(chunk)
    seconds.append(time.perf_counter() - started)
    return scored


def kvfence_rows(
    model: Path, ctx: int, count: int, threads: int, base: Path | None, exact: bool = True
) -> dict[str, Any]:
    """The fast path against float32 over `count` chunks, float32's log-probabilities written to `base`
    for llama-perplexity (where given); without `exact` (a speed check) the fast path alone, timed."""
    fast = engine(model, ctx, threads, "auto")
    tokenizer = fast.tokenizer
    assert tokenizer is not None
    bos = tokenizer.encode("", add_special_tokens=True)
    tokens = tokenizer.encode(reference_text())
    chunked = chunks(tokens, ctx, count, bos[0] if bos else None)
    fast_score, seconds = Scorer(fast), []
    if not exact:
        for chunk in chunked:
            timed(fast_score, chunk, seconds)
        return {"text_tokens": len(tokens), "fast_s_per_chunk": statistics.median(seconds)}
    exact_score, compared, written = Scorer(engine(model, ctx, threads, "float32")), Comparison(), None
    for chunk in chunked:
        path, reference = timed(fast_score, chunk, seconds), exact_score(chunk)
        compared.add(path, reference)
        if base is not None:
            written = written or LlamaBaseLogits(str(base), ctx, reference[0].shape[1], chunked)
            written.add(reference[0])
    if written is not None:
        written.close()
    return {"text_tokens": len(tokens), "fast_s_per_chunk": statistics.median(seconds), **compared.summary()}


def llama_run(tool: Path, model: Path, ctx: int, threads: int, *args: str) -> str:
    command = [str(tool), "-m", str(model), "-c", str(ctx), "-b", str(ctx), "-t", str(threads), *args]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return done.stdout + done.stderr


def found(pattern: str, printed: str) -> float:
    match = re.search(pattern, printed)
    if match is None:
        raise RuntimeError(f"llama-perplexity printed no {pattern!r}:\n{printed[-2000:]}")
    return float(match.group(1))


def llama_ppl(tool: Path, model: Path, ctx: int, count: int, threads: int) -> dict[str, float]:
    """llama.cpp's own measurement: its tokenization of the text file, its chunks."""
    printed = llama_run(tool, model, ctx, threads, "-f", str(TEXT), "--chunks", str(count))
    return {
        "llama_ppl": found(r"Final estimate: PPL = ([0-9.]+)", printed),
        "llama_s_per_chunk": found(r"([0-9.]+) seconds per pass", printed),
    }


def llama_kl(
    tool: Path, model: Path, base: Path, ctx: int, threads: int, reference_ppl: float
) -> dict[str, float]:
    """llama.cpp's numerics against kvfence's float32 on kvfence's chunks (`base`)."""
    printed = llama_run(tool, model, ctx, threads, "--kl-divergence", "--kl-divergence-base", str(base))
    read_back = found(r"Mean PPL\(base\)\s*:\s*([0-9.]+)", printed)
    if abs(read_back / reference_ppl - 1) > 1e-3:  # the base file's 16-bit steps move it by ~1e-5
        raise RuntimeError(
            f"llama-perplexity read the float32 reference as PPL {read_back}, not {reference_ppl}"
        )
    return {
        "llama_kl_ppl": found(r"Mean PPL\(Q\)\s*:\s*([0-9.]+)", printed),
        "llama_kl_mean": found(r"Mean +KLD:\s*([0-9.]+)", printed),
        "llama_kl_p99": found(r"99\.0% +KLD:\s*([0-9.]+)", printed),
        "llama_top1_agreement": found(r"Same top p:\s*([0-9.]+)", printed) / 100,
    }


def directory_row(name: str, ctx: int, count: int, threads: int) -> dict[str, Any]:
    """The bfloat16 directory of `name` (…-bf16-dir): kvfence's defaults against its float32 rows."""
    with tempfile.TemporaryDirectory(prefix="kvfence-accuracy-") as scratch:
        gguf = benchmark_file(name.removesuffix(DIRECTORY))
        directory = bf16_dir_from_gguf(gguf, Path(scratch) / name)
        row = {"model": name, "ctx": ctx, **kvfence_rows(directory, ctx, count, threads, None)}
    row["ppl_vs_float32"] = row["ppl"] / row["reference_ppl"] - 1
    row["pass"] = row["ppl_vs_float32"] <= PPL_GOAL and row["top1_agreement"] >= TOP1_GOAL
    return row


def measure(tool: Path, name: str, ctx: int, count: int, threads: int) -> dict[str, Any]:
    if name.endswith(DIRECTORY):
        return directory_row(name, ctx, count, threads)
    model = benchmark_file(name)
    if name in SYNTHETIC:
        row = {"model": name, "ctx": ctx, **kvfence_rows(model, ctx, count, threads, None, exact=False)}
        return {**row, **llama_ppl(tool, model, ctx, count, threads)}
    with tempfile.TemporaryDirectory(prefix="kvfence-accuracy-") as scratch:
        base = Path(scratch) / "float32.kld"  # 2 bytes a vocabulary entry a scored token: Gemma 2048 is 6 GB
        row = {"model": name, "ctx": ctx, **kvfence_rows(model, ctx, count, threads, base)}
        row |= llama_kl(tool, model, base, ctx, threads, row["reference_ppl"])
    row |= llama_ppl(tool, model, ctx, count, threads)
    row["ppl_vs_llama"] = row["ppl"] / row["llama_ppl"] - 1
    row["pass"] = row["ppl_vs_llama"] <= PPL_GOAL and row["top1_agreement"] >= TOP1_GOAL
    return row


def line(row: dict[str, Any]) -> str:
    if row["model"].endswith(DIRECTORY):
        return (
            f"{row['model']:>12} ctx {row['ctx']:>4} ({row['tokens']} tokens): PPL fast {row['ppl']:.3f}, "
            f"float32 {row['reference_ppl']:.3f} ({row['ppl_vs_float32']:+.2%}); KL {row['kl_mean']:.5f} p99 "
            f"{row['kl_p99']:.4f} top-1 {row['top1_agreement']:.2%}; s/chunk {row['fast_s_per_chunk']:.2f}; "
            f"{'PASS' if row['pass'] else 'FAIL'}"
        )
    speed = (
        f"s/chunk kvfence {row['fast_s_per_chunk']:.2f}, llama.cpp {row['llama_s_per_chunk']:.2f} "
        f"({row['llama_s_per_chunk'] / row['fast_s_per_chunk']:.2f}x)"
    )
    if "pass" not in row:
        return f"{row['model']:>12} ctx {row['ctx']:>4}: speed check only, {speed}"
    return (
        f"{row['model']:>12} ctx {row['ctx']:>4} ({row['tokens']} tokens): PPL fast {row['ppl']:.3f}, "
        f"float32 {row['reference_ppl']:.3f}, llama.cpp {row['llama_ppl']:.3f} ({row['ppl_vs_llama']:+.2%}); "
        f"against float32: kvfence fast KL {row['kl_mean']:.5f} p99 {row['kl_p99']:.4f} top-1 "
        f"{row['top1_agreement']:.2%}, llama.cpp KL {row['llama_kl_mean']:.5f} p99 {row['llama_kl_p99']:.4f} "
        f"top-1 {row['llama_top1_agreement']:.2%}; {speed}; {'PASS' if row['pass'] else 'FAIL'}"
    )


def save(text: str, rows: list[dict[str, Any]]) -> None:
    """This run's rows in place of the same model and context's earlier ones."""
    kept = json.loads(RESULTS.read_text())["rows"] if RESULTS.exists() else []
    ran = {(r["model"], r["ctx"]) for r in rows}
    merged = [r for r in kept if (r["model"], r["ctx"]) not in ran] + rows
    RESULTS.write_text(json.dumps({"text_sha256": sha256(text), "rows": merged}, indent=2))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2,gemma3-270m")
    parser.add_argument("--ctx", default="512,2048")
    parser.add_argument("--chunks", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-server", type=Path, default=None)
    parser.add_argument("--build", action="store_true", help="build llama.cpp with the peers script")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    text = reference_text()
    TEXT.parent.mkdir(parents=True, exist_ok=True)
    TEXT.write_text(text)
    python = sys.version.split()[0]
    print(f"text: pydoc_data.topics of Python {python}, {len(text)} chars, sha256 {sha256(text)}")
    tool = llama_tool("llama-perplexity", llama_server_binary(args.llama_server, args.build))
    rows = []
    for name in args.models.split(","):
        for ctx in (int(c) for c in args.ctx.split(",")):
            rows.append(measure(tool, name, ctx, args.chunks, args.threads))
            print(line(rows[-1]), flush=True)
            save(text, rows)  # each row as it comes: a Gemma row at 2048 takes a while
    return 1 if any(not r.get("pass", True) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
