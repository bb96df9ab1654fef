"""A decode step's time against the rows in it, and what that leaves speculation at a stream count.

Contracts: `decode_step_seconds` admits `rows` requests of `prompt_len`-token prompts into a fresh engine
over the shared model, steps until every prompt is prefilled and `warm` decode steps more, and returns the
median of `steps` decode steps of `rows` rows each (the requests ask for enough tokens to stay running),
then runs them to the end. `ceiling` is the most a speculating server could gain at `streams` streams with
`k` drafts a stream if every draft were kept: (1 + k) tokens a stream for a step of streams x (1 + k)
rows, against one token a stream for a step of `streams` rows, verify rows costing what decode rows do.
"""

from __future__ import annotations

import statistics
import time

from kvfence.harness.offline_engine import build_engine, make_prompts
from kvfence.model.gguf import GGUFModel
from kvfence.model.transformer import Transformer
from kvfence.sampling import SamplingParams


def decode_step_seconds(
    gguf: GGUFModel, model: Transformer, rows: int, prompt_len: int = 64, steps: int = 20, warm: int = 5
) -> float:
    engine = build_engine(gguf, model=model, max_num_seqs=rows)
    assert engine.tokenizer is not None
    params = SamplingParams(max_tokens=2 * (steps + warm) + 8, ignore_eos=True)
    prompts = make_prompts(engine.tokenizer, rows, prompt_len, salt=rows)
    requests = [engine.add_request(prompt, params) for prompt in prompts]
    while any(len(r.output_token_ids) == 0 for r in requests):
        engine.step()
    for _ in range(warm):
        engine.step()
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        seconds.append(time.perf_counter() - started)
    assert all(not r.is_finished for r in requests), "a request ended inside the timed steps"
    while engine.has_unfinished():
        engine.step()
    return statistics.median(seconds)


def ceiling(seconds: dict[int, float], streams: int, k: int) -> float:
    return (1 + k) * seconds[streams] / seconds[streams * (1 + k)]
