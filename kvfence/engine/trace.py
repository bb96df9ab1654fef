"""Page trace: which pages each request really reads and writes, and whose data they hold.

It hooks the runner after validation and before the model runs, so it sees exactly what attention will
read. With isolation off it is how the lab and the fault tests *show* a leak; with isolation on it must
stay empty of foreign accesses.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvfence.cache.fence import StepLayout
from kvfence.cache.pool import KVPool
from kvfence.request import Request
from kvfence.trail.events import EventLog


@dataclass(frozen=True)
class PageAccess:
    page: int
    owner: int  # tenant id allowed to use the page now
    last_writer: int  # tenant id whose data the page holds


@dataclass
class PageTrace:
    """With `events`, each access a request makes for the first time also goes on its audit trail as a
    `pages_read` event naming tenants (`tenant_name`), so a trace can be read from another process."""

    pool: KVPool
    events: EventLog | None = None
    tenant_name: Callable[[int], str] = str
    reads: dict[str, list[PageAccess]] = field(default_factory=lambda: defaultdict(list))
    writes: dict[str, list[PageAccess]] = field(default_factory=lambda: defaultdict(list))
    tenants: dict[str, int] = field(default_factory=dict)

    def __call__(self, requests: list[Request], layout: StepLayout) -> None:
        ps = self.pool.page_size
        for row, request in enumerate(requests):
            self.tenants[request.request_id] = request.record.tenant
            pages = layout.pages[layout.starts[row] : layout.starts[row + 1]]
            read = pages[np.arange(pages.size) * ps < layout.num_cached[row]]  # pages holding cached tokens
            seen = set(self.reads[request.request_id])
            new = [a for a in self._accesses(read) if a not in seen]
            self.reads[request.request_id].extend(new)
            self.writes[request.request_id].extend(
                self._accesses(layout.write_pages[layout.write_rows == row])
            )
            if self.events is not None and new:
                self.events.emit(
                    request.request_id,
                    "pages_read",
                    pages=[
                        {
                            "page": a.page,
                            "owner": self.tenant_name(a.owner),
                            "last_writer": self.tenant_name(a.last_writer),
                        }
                        for a in new
                    ],
                )

    def _accesses(self, pages: np.ndarray) -> list[PageAccess]:
        return [
            PageAccess(int(p), int(self.pool.owner[p]), int(self.pool.last_writer[p]))
            for p in np.unique(pages)
        ]

    def foreign_reads(self, request_id: str) -> list[PageAccess]:
        """Pages read that another tenant owns, or whose content this tenant did not write."""
        tenant = self.tenants.get(request_id)
        return [a for a in self.reads.get(request_id, []) if a.owner != tenant or a.last_writer != tenant]

    def foreign_writes(self, request_id: str) -> list[PageAccess]:
        tenant = self.tenants.get(request_id)
        return [a for a in self.writes.get(request_id, []) if a.owner != tenant]
