"""The HF transformers baseline: the same file's float32 model, greedy generate() over left-padded batches,
timed per step through a streamer.

Contracts: `hf_generate_batch` generates exactly `max_tokens` tokens per row (min_new_tokens =
max_new_tokens; asserted), every row sharing the batch's timing (arrival = the generate() call);
`run_hf` runs consecutive prompts in batches of `batch_size`, back to back.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence

import torch

from kvfence.harness.contention import ForeignCpu
from kvfence.harness.timings import RequestTiming, RunResult
from kvfence.model.gguf import GGUFModel


class StepClock:
    """A generate() streamer that only timestamps: put() is called once with the prompt, then once per step
    with the new tokens of the whole batch. The second call is the first token (prefill + first sample)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, _value: torch.Tensor) -> None:
        self.times.append(time.monotonic())

    def end(self) -> None:
        pass


def load_hf_model(gguf: GGUFModel) -> torch.nn.Module:
    """transformers' float32 model of the same file or directory."""
    from transformers import AutoModelForCausalLM

    if gguf.path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(str(gguf.path), dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.path.parent), gguf_file=gguf.path.name, dtype=torch.float32
        )
    return model.eval()


def left_pad(prompts: Sequence[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def hf_generate_batch(
    model: torch.nn.Module, prompts: Sequence[list[int]], max_tokens: int, pad_id: int
) -> list[RequestTiming]:
    """One greedy generate() over a left-padded batch; min_new_tokens=max_new_tokens, so length is exact.
    Every row of the batch shares the batch's timing (arrival = the generate() call)."""
    ids, mask = left_pad(prompts, pad_id)
    clock = StepClock()
    started = time.monotonic()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            pad_token_id=pad_id,
            streamer=clock,
        )
    finished = time.monotonic()
    assert out.shape[1] - ids.shape[1] == max_tokens
    first = clock.times[1]
    tpot = (finished - first) / (max_tokens - 1) if max_tokens > 1 else 0.0
    timing = RequestTiming(ttft=first - started, tpot=tpot, latency=finished - started, num_output=max_tokens)
    return [timing] * len(prompts)


def run_hf(
    model: torch.nn.Module, prompts: Sequence[list[int]], max_tokens: int, batch_size: int, pad_id: int
) -> RunResult:
    """Consecutive prompts in batches of `batch_size`, one generate() per batch, batches back to back."""
    timings: list[RequestTiming] = []
    gc.collect()
    foreign = ForeignCpu()
    started = time.monotonic()
    for first in range(0, len(prompts), batch_size):
        timings += hf_generate_batch(model, prompts[first : first + batch_size], max_tokens, pad_id)
    wall = time.monotonic() - started
    tokens = sum(t.num_output for t in timings)
    return RunResult("hf", batch_size, len(prompts), wall, tokens, timings, foreign_cpu=foreign.share())
