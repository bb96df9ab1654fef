"""The injected faults (settings.py: `KVFENCE_INJECT_FAULT`), applied in the worker to vLLM's input batch
after vLLM brought it up to the step and before the fence checks it: the bookkeeping bugs the fence exists
to catch. Off unless armed; each draw comes from its own generator seeded by `KVFENCE_FAULT_SEED`.

- `inflate_computed:P`: in a step of two or more requests, with probability P, the start (the batch's
  num_computed_tokens) of the decoding request furthest along (the earliest row on a tie) moves a block
  ahead, so its step attends over slots no step wrote for it and writes its token a block too far. At most
  once per process, on a request whose moved step still fits the window: one firing shows the read, and
  leaves the rest of the server's run (an audit) to the other fault. Drawn before the swap in a step.
- `swap_block_tables:P`: in a step, with probability P, two running requests (KV already computed) trade
  block-table rows.
The swap spares the request whose start moved, and the move spares a request swapped before, so that
request shows that one fault's effect. Both name whom they hit on the log (one warning line each).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from typing import Any

import numpy as np

from kvfence_vllm.rows import choose_rows, decoding_rows
from kvfence_vllm.settings import INFLATE, Settings

log = logging.getLogger("vllm.kvfence")


class WorkerFaults:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.swap_rng = random.Random(settings.fault_seed)
        self.inflate_rng = random.Random(f"{INFLATE}:{settings.fault_seed}")  # the swap's draws stay its own
        self.swapped: set[str] = set()  # request ids the swap hit (only while the move has not fired)
        self.inflated: str | None = None  # the request whose start moved

    def inject(self, batch: Any, scheduled: Mapping[str, int], window: int) -> None:
        if self.settings.inflate_probability and self.inflated is None and batch.num_reqs >= 2:
            self._inflate(batch, scheduled, window)
        if self.settings.swap_probability:
            self._swap(batch)

    def _inflate(self, batch: Any, scheduled: Mapping[str, int], window: int) -> None:
        num, ids, computed = batch.num_reqs, batch.req_ids, batch.num_computed_tokens_cpu
        counts = np.array([scheduled.get(ids[i], 0) for i in range(num)], dtype=np.int64)
        size = batch.block_table[0].block_size
        rows = decoding_rows(computed[:num], batch.num_prompt_tokens[:num], counts, size, window)
        rows = [row for row in rows if ids[row] not in self.swapped]
        if not rows or self.inflate_rng.random() >= self.settings.inflate_probability:
            return
        # The furthest along, not a draw among them: whom the move hits is then known before the step (the
        # tests' scenario: its long request, whose prompt is the longest of those starting beside it).
        row = max(rows, key=lambda r: int(computed[r]))
        self.inflated = ids[row]
        self.swapped.clear()  # not needed any more
        computed[row] += size
        log.warning(
            "kvfence-vllm: fault inflate_computed moved the start of %s from %d to %d",
            ids[row],
            computed[row] - size,
            computed[row],
        )

    def _swap(self, batch: Any) -> None:
        ids, computed = batch.req_ids, batch.num_computed_tokens_cpu
        running = [i for i in range(batch.num_reqs) if computed[i] > 0 and ids[i] != self.inflated]
        pair = choose_rows(self.swap_rng, self.settings.swap_probability, running, 2)
        if pair is None:
            return
        batch.block_table.swap_row(*pair)
        if self.settings.inflate_probability and self.inflated is None:
            self.swapped.update(ids[row] for row in pair)
        log.warning(
            "kvfence-vllm: fault swap_block_tables swapped the rows of %s and %s", ids[pair[0]], ids[pair[1]]
        )
