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
share of tokens whose most likely token is the same. llama.cpp's own KL against that float32 reference is
not measured: its tool compares two of its own runs (`--kl-divergence-base` from a run of another file),
and it has no float32 path for a block-quantized file. Goals: kvfence fast within 1% of llama.cpp's
perplexity, top-1 agreement >= 98%; exit status 1 when one fails. JSON in bench/results/accuracy.json.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from kvfence.config import EngineConfig
from kvfence.engine.engine import LLMEngine, load_engine
from kvfence.harness.accuracy import Comparison, Scorer, chunks, reference_text, sha256
from kvfence.harness.peers import llama_server_binary, llama_tool
from kvfence.pins import packaged_model

RESULTS = Path(__file__).parent / "results" / "accuracy.json"
TEXT = RESULTS.parent / "accuracy_text.txt"
PPL_GOAL, TOP1_GOAL = 0.01, 0.98


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


def kvfence_rows(model: Path, ctx: int, count: int, threads: int) -> dict[str, Any]:
    fast, exact = engine(model, ctx, threads, "auto"), engine(model, ctx, threads, "float32")
    tokenizer = fast.tokenizer
    assert tokenizer is not None
    bos = tokenizer.encode("", add_special_tokens=True)
    tokens = tokenizer.encode(reference_text())
    compared = Comparison()
    fast_score, exact_score = Scorer(fast), Scorer(exact)
    for chunk in chunks(tokens, ctx, count, bos[0] if bos else None):
        compared.add(fast_score(chunk), exact_score(chunk))
    return {"text_tokens": len(tokens), **compared.summary()}


def llama_ppl(tool: Path, model: Path, ctx: int, count: int, threads: int) -> float:
    args = [str(tool), "-m", str(model), "-f", str(TEXT), "-c", str(ctx), "--chunks", str(count)]
    done = subprocess.run(
        [*args, "-t", str(threads), "-b", str(ctx)], capture_output=True, text=True, check=True
    )
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", done.stdout + done.stderr)
    if found is None:
        raise RuntimeError(f"llama-perplexity printed no estimate:\n{(done.stdout + done.stderr)[-2000:]}")
    return float(found.group(1))


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
    rows, failed = [], False
    for name in args.models.split(","):
        model = packaged_model(name)
        for ctx in (int(c) for c in args.ctx.split(",")):
            row = {"model": name, "ctx": ctx, **kvfence_rows(model, ctx, args.chunks, args.threads)}
            row["llama_ppl"] = llama_ppl(tool, model, ctx, args.chunks, args.threads)
            row["ppl_vs_llama"] = row["ppl"] / row["llama_ppl"] - 1
            row["pass"] = row["ppl_vs_llama"] <= PPL_GOAL and row["top1_agreement"] >= TOP1_GOAL
            failed |= not row["pass"]
            rows.append(row)
            print(
                f"{name:>12} ctx {ctx:>4} ({row['tokens']} tokens): PPL fast {row['ppl']:.3f}, float32 "
                f"{row['reference_ppl']:.3f}, llama.cpp {row['llama_ppl']:.3f} ({row['ppl_vs_llama']:+.2%}); "
                f"KL mean {row['kl_mean']:.5f} p99 {row['kl_p99']:.4f}; top-1 {row['top1_agreement']:.2%} "
                f"{'PASS' if row['pass'] else 'FAIL'}",
                flush=True,
            )
    RESULTS.write_text(json.dumps({"text_sha256": sha256(text), "rows": rows}, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
