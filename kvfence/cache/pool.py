"""The KV page pool: the tensors plus the per-page metadata that is the fence's ground truth.

KV layout is [layers, 2, pages, page_size, kv_heads, head_dim] on the model's device, `pages` counting
the scratch and zero pages past `num_pages` (`KVPool.__init__`). Pages are never zeroed on reuse (as in
every fast engine): a recycled page holds its previous owner's data until it is overwritten, which is
exactly why every read must be fenced.

Metadata (docs/fence.md: "How the fence works") is host-side numpy, one entry per page:
  generation  bumped on every allocation            (allocator only)
  owner       tenant id allowed to read the page    (allocator only; NO_OWNER when free)
  written     slots written at this generation      (the KV writer only; reset to 0 on allocation)
  state       FREE / OWNED / QUARANTINED            (allocator only)
  last_writer tenant whose data the page holds      (the KV writer; survives reallocation, for tracing)
  holders     requests that map the page            (allocator only: its reference counts)
Writes are append-only, gapless and exclusive: a page's writes fill slots written, written + 1, ... in
order (a written slot is never rewritten, whoever asks, and no slot is skipped, so `written` counts only
slots this generation wrote and a read up to it never sees a previous owner's KV) and need at most one
holder (a page another request can read is never written).
Bookkeeping lives on the host because the scheduler that edits it runs there, and so the fence check
never has to synchronise with the device.
"""

from __future__ import annotations

import numpy as np
import torch
import xxhash

from kvfence.cache.mapping import NO_OWNER, PageState
from kvfence.config import page_bytes


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        scratch_page: bool = False,
    ) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        # The scratch page (captured decode graphs pad their buckets with rows that write only there) is
        # allocated with the pool, past `num_pages`: no metadata, so no allocator hands it out and the fence
        # never validates a read of it; allocated here, not appended later, so nothing registered on `kv`
        # is orphaned and the pool's memory is never briefly doubled.
        self.scratch_page = num_pages if scratch_page else None
        # The zero page, past every other, holds zeros for good: the fence refuses a write into it (it has
        # no metadata), no allocator hands it out, and the graphs' padding rows write the scratch page. The
        # torch decode path reads it for every slot past a row's context, so neither a table's padding nor
        # a page's unwritten slots (a previous owner's KV, NaN for all it knows) reach attention: a mask
        # alone does not neutralise them, as 0 * NaN is NaN.
        self.zero_page = num_pages + scratch_page
        self.kv = torch.zeros(
            num_layers,
            2,
            self.zero_page + 1,
            page_size,
            num_kv_heads,
            head_dim,
            dtype=dtype,
            device=device,
        )
        # The pool's bytes as numpy, on the host: a rollback zeroes a few slots through it in about a
        # microsecond, where a torch indexing call costs five (a step's fence work is ~10); checksums read it.
        self._host_bytes = self.kv.view(torch.uint8).numpy() if self.kv.device.type == "cpu" else None
        self.generation = np.zeros(num_pages, dtype=np.int64)
        self.owner = np.full(num_pages, NO_OWNER, dtype=np.int64)
        self.written = np.zeros(num_pages, dtype=np.int64)
        self.state = np.full(num_pages, PageState.FREE, dtype=np.int8)
        self.last_writer = np.full(num_pages, NO_OWNER, dtype=np.int64)
        self.holders = np.zeros(num_pages, dtype=np.int64)
        self.refused_writes = 0

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return page_bytes(num_layers, page_size, num_kv_heads, head_dim, dtype.itemsize)

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [pages, page_size, kv_heads, head_dim] of one layer's K and V."""
        return self.kv[layer, 0], self.kv[layer, 1]

    @property
    def token_bytes(self) -> int:
        """One slot's K and V over every layer: what a page's payload grows by per written slot."""
        return self.kv[:, :, 0, 0].numel() * self.kv.element_size()

    def page_bytes(self, page: int, slots: int | None = None) -> bytes:
        """The first `slots` slots (default: all) of a page, K/V for every layer
        ([layers, 2, slots, kv_heads, head_dim]), as raw bytes. A transfer sends only the written slots:
        the rest of a recycled page still holds its previous owner's KV."""
        if self._host_bytes is not None:  # one copy, not torch's gather and then numpy's
            return self._host_bytes[:, :, page, :slots].tobytes()
        return self.kv[:, :, page, :slots].contiguous().view(torch.uint8).cpu().numpy().tobytes()

    def copy_page_into(self, page: int, out: np.ndarray) -> None:
        """`page_bytes(page)`'s bytes into `out` (uint8, one page long), nothing allocated: on the host one
        numpy copy, which runs outside the GIL (a KV tier's writer thread copies while a step runs); on a
        device, torch's copy on the thread's stream, after the writes queued before it. The caller decides
        whether the bytes are the page's (`is_current` once the copy is done)."""
        source = self._host_bytes[:, :, page] if self._host_bytes is not None else None
        if source is not None:
            np.copyto(out.reshape(source.shape), source)
            return
        target = torch.from_numpy(out).view(self.kv.dtype)
        target.view(self.kv[:, :, page].shape).copy_(self.kv[:, :, page])

    def is_current(self, page: int, generation: int, tenant: int) -> bool:
        """Whether `page` is still `tenant`'s at `generation`, OWNED (not freed, not quarantined): every
        allocation starts a new generation, so a page still at the one a reference names was not handed out
        again since it was taken."""
        return bool(
            self.generation[page] == generation
            and self.state[page] == PageState.OWNED
            and self.owner[page] == tenant
        )

    def page_checksum(self, page: int) -> int:
        """xxh3_64 of `page_bytes(page)`; on the host hashed block by block where the page lies, without the
        two copies `page_bytes` makes (a one-sided handoff hashes every page on both sides)."""
        if self._host_bytes is None:
            return xxhash.xxh3_64_intdigest(self.page_bytes(page))
        blocks = self._host_bytes[:, :, page]  # numpy views: no per-block torch call
        digest = xxhash.xxh3_64()
        for layer in blocks:
            for half in layer:  # K, then V: the order of page_bytes
                digest.update(half)
        return digest.intdigest()

    def load_page_bytes(self, page: int, payload: bytes | memoryview, slots: int | None = None) -> None:
        """Inverse of `page_bytes`. Unfenced: the caller has authorised the write (or isolation is off). A
        writable buffer is read in place; read-only bytes are copied once (torch reads only writable ones)."""
        source = payload if isinstance(payload, memoryview) and not payload.readonly else bytearray(payload)
        data = torch.frombuffer(source, dtype=torch.uint8).view(self.kv.dtype)
        target = self.kv[:, :, page, :slots]
        target.copy_(data.view(target.shape))

    def authorize_writes(
        self, pages: np.ndarray, generations: np.ndarray, tenants: np.ndarray, offsets: np.ndarray
    ) -> np.ndarray:
        """Fenced writes (invariant 2): a write of slot `offsets[i]` is allowed only into a page of the pool
        that is OWNED by the writer's tenant at the generation the writer names and mapped by at most one
        request (exclusive), and only at the page's next slot (append-only, no gaps): the k-th such write
        into a page, in the order given, must be at slot `written + k`. A gap would leave slots that
        `commit_writes` marks written while they hold a previous owner's KV. A page id outside
        [0, num_pages) is refused, never wrapped or raised on. Returns the allowed mask; refusals are
        counted."""
        inside = (pages >= 0) & (pages < self.num_pages)
        safe = np.where(inside, pages, 0)  # gathered at page 0 only to be refused below
        granted = (
            inside
            & (self.generation[safe] == generations)
            & (self.owner[safe] == tenants)
            & (self.state[safe] == PageState.OWNED)
            & (self.holders[safe] <= 1)
        )
        allowed = granted & (offsets == self.written[safe] + _rank_per_page(safe, granted))
        self.refused_writes += int(allowed.size - np.count_nonzero(allowed))
        return allowed

    def commit_writes(self, pages: np.ndarray, offsets: np.ndarray) -> None:
        """Record that slots `offsets` of `pages` now hold data written at the page's current generation."""
        np.maximum.at(self.written, pages, offsets + 1)
        self.last_writer[pages] = self.owner[pages]

    def take_back(self, page: int, generation: int, tenant: int, start: int, end: int) -> bool:
        """Roll back slots [start, end) of `page`, the last it wrote (speculative decoding's rejected drafts):
        only for `tenant` holding the page alone at `generation` (as a write must), only its written tail
        (`written` is `end`), never below what it keeps (`start` >= 0). The slots are zeroed, so what was
        written there can never be read again whoever asks, and `written` moves back to `start`, so the
        next write appends there. False, nothing changed, when refused (counted as a refused write)."""
        inside = 0 <= page < self.num_pages
        allowed = (
            inside
            and 0 <= start < end <= self.page_size
            and self.generation[page] == generation
            and self.owner[page] == tenant
            and self.state[page] == PageState.OWNED
            and self.holders[page] <= 1
            and self.written[page] == end
        )
        if not allowed:
            self.refused_writes += 1
            return False
        if self._host_bytes is not None:
            self._host_bytes[:, :, page, start:end] = 0
        else:
            self.kv[:, :, page, start:end] = 0
        self.written[page] = start
        return True

    def copy_page(self, src: int, dst: int, dst_generation: int, tenant: int, slots: int) -> bool:
        """Copy-on-write for a fork: the first `slots` slots of `src` (every layer, K and V) into `dst`, which
        must be `tenant`'s at `dst_generation` (a fenced write, invariant 2; False when refused). `written`
        of `dst` covers only what `src` had written of those slots, so a copy of unwritten slots stays
        unreadable."""
        allowed = self.authorize_writes(
            np.array([dst], dtype=np.int64),
            np.array([dst_generation], dtype=np.int64),
            np.array([tenant], dtype=np.int64),
            np.zeros(1, dtype=np.int64),
        )
        if not allowed[0]:
            return False
        self.kv[:, :, dst, :slots] = self.kv[:, :, src, :slots]
        self.written[dst] = min(int(self.written[src]), slots)
        self.last_writer[dst] = self.last_writer[src]  # the data's origin, for tracing
        return True

    def begin_generation(self, page: int, owner: int) -> None:
        """Allocator hook: `page` is handed out anew. Old references to it stop matching from here on."""
        self.generation[page] += 1
        self.owner[page] = owner
        self.written[page] = 0
        self.state[page] = PageState.OWNED

    def mark_free(self, page: int) -> None:
        """Allocator hook: nobody may read or write `page` until its next generation."""
        self.owner[page] = NO_OWNER
        self.written[page] = 0
        self.state[page] = PageState.FREE


def _rank_per_page(pages: np.ndarray, counted: np.ndarray) -> np.ndarray:
    """For each counted entry, how many counted entries before it name the same page (0 elsewhere)."""
    ranks = np.zeros(pages.size, dtype=np.int64)
    where = np.flatnonzero(counted)
    if where.size < 2:  # nothing to rank against
        return ranks
    order = where[np.argsort(pages[where], kind="stable")]  # grouped by page, in the given order within
    sorted_pages = pages[order]
    first = np.flatnonzero(np.r_[True, sorted_pages[1:] != sorted_pages[:-1]])
    sizes = np.diff(np.r_[first, order.size])
    ranks[order] = np.arange(order.size) - np.repeat(first, sizes)
    return ranks
