"""The audit trail: ordered lifecycle events per request (docs/fence.md: "How the fence works").

Events live in a bounded in-memory ring per tenant (a tenant's oldest requests fall out first, so one
tenant's traffic, refused requests included, can never evict another tenant's trails) and, when a path is
given, are appended to a JSONL file. A request's tenant is the `tenant` field of its first event that has
one (`admitted`, `rejected`, a fork's `forked`). The engine thread writes; the server reads: one lock
guards both.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, TextIO

EVENT_KINDS = frozenset(
    {
        "admitted",
        "rejected",
        "pages_allocated",
        "prefix_hit",
        "tier_restored",  # full pages restored from a KV tier into fresh pages of the request (fenced)
        "forked",  # n > 1: the parent names its forks; each fork its shared and copied pages
        "transfer_started",
        "page_received",
        "transfer_complete",
        "validated",
        "step",
        "drafts_rolled_back",  # speculative decoding: unaccepted draft slots zeroed, `written` moved back
        "aborted",
        "quarantined",
        "drained",
        "released",
        "preempted",
        "finished",
        "fault_injected",
        "write_refused",
        "pages_read",
    }
)


NO_TENANT = "-"  # requests whose events never named a tenant


class EventLog:
    """Per-request event lists, at most `max_requests` per tenant; optionally mirrored to a JSONL file."""

    def __init__(self, max_requests: int = 10_000, path: Path | None = None) -> None:
        self._by_request: dict[str, list[dict[str, Any]]] = {}
        self._by_tenant: dict[str, OrderedDict[str, None]] = {}  # each tenant's request ids, oldest first
        self._tenant_of: dict[str, str] = {}
        self._max_requests = max_requests
        self._lock = threading.Lock()
        self._seq = 0
        self._file: TextIO | None = path.open("a", encoding="utf-8") if path else None

    def emit(self, request_id: str, kind: str, **fields: Any) -> None:
        assert kind in EVENT_KINDS, f"unknown event kind {kind}"
        with self._lock:
            self._seq += 1
            event = {"seq": self._seq, "ts": time.time(), "request_id": request_id, "kind": kind, **fields}
            events = self._by_request.get(request_id)
            if events is None:
                events = self._by_request[request_id] = []
                self._file_under(request_id, NO_TENANT)
            tenant = fields.get("tenant")
            if isinstance(tenant, str) and self._tenant_of[request_id] == NO_TENANT:
                self._file_under(request_id, tenant)
            events.append(event)
            if self._file is not None:
                self._file.write(json.dumps(event) + "\n")
                self._file.flush()

    def _file_under(self, request_id: str, tenant: str) -> None:
        """Put the request in its tenant's ring, evicting that tenant's oldest request when full."""
        previous = self._tenant_of.get(request_id)
        if previous is not None:
            del self._by_tenant[previous][request_id]
        self._tenant_of[request_id] = tenant
        ring = self._by_tenant.setdefault(tenant, OrderedDict())
        ring[request_id] = None
        if len(ring) > self._max_requests:
            oldest, _ = ring.popitem(last=False)
            del self._by_request[oldest], self._tenant_of[oldest]

    def for_request(self, request_id: str) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._by_request.get(request_id, ()))

    def kinds(self, request_id: str) -> list[str]:
        return [e["kind"] for e in self.for_request(request_id)]

    def request_ids(self) -> list[str]:
        with self._lock:
            return list(self._by_request)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
