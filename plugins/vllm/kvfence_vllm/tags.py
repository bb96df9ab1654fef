"""Generation tags on one vLLM block pool's blocks: the metadata kvfence's read check judges records by.

Per block id (numpy, like kvfence's KVPool metadata): `generation`, bumped whenever the block's content or
holders change hands: handed out fresh by the pool (new or evicted and reused), revived from the free queue
by a prefix hit, and freed (its last holder let go); `owner`, the tenant whose KV the block holds (reset to
none when handed out fresh, claimed by the first record that maps it, kept across a free so that a prefix
hit by another tenant is judged foreign); `state`, OWNED while some request holds it, else FREE;
`written`, how many of its slots hold KV a step that ran wrote (reset to 0 when handed out fresh, kept across
a free and a revival: a prefix hit reads what was written).
Contract: only the block-pool hooks (patches.py) call `handed_out` / `revived` / `freed`; only the records
(records.py) call `claim` and raise `written`. The null block (vLLM's id 0) is never tagged: no record
maps it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvfence.cache.mapping import NO_OWNER, PageState


class BlockTags:
    def __init__(self, num_blocks: int) -> None:
        self.generation = np.zeros(num_blocks, dtype=np.int64)
        self.owner = np.full(num_blocks, NO_OWNER, dtype=np.int64)
        self.state = np.full(num_blocks, PageState.FREE, dtype=np.int8)
        self.written = np.zeros(num_blocks, dtype=np.int64)

    def handed_out(self, ids: Sequence[int]) -> None:
        """Fresh blocks from the free queue: whatever they held is about to be overwritten."""
        self.generation[ids] += 1
        self.owner[ids] = NO_OWNER
        self.state[ids] = PageState.OWNED
        self.written[ids] = 0

    def revived(self, ids: Sequence[int]) -> None:
        """Free cached blocks taken back by a prefix hit: same content, same owner, new holders."""
        self.generation[ids] += 1
        self.state[ids] = PageState.OWNED

    def freed(self, ids: Sequence[int]) -> None:
        """Blocks whose last holder let go: any record still mapping them is stale from now on."""
        self.generation[ids] += 1
        self.state[ids] = PageState.FREE

    def claim(self, ids: np.ndarray, tenant: int) -> None:
        """The first tenant to map a fresh block owns its content; a block already owned keeps its owner."""
        unowned = ids[self.owner[ids] == NO_OWNER]
        self.owner[unowned] = tenant
