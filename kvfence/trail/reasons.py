"""Why a request was aborted for integrity: the reasons the fence, the handoff checks and refused
transfer writes put on the trail (`aborted(reason)`), the API reports and the audit reads back.

Kept apart from cache/fence.py (which needs torch) so that an HTTP-only auditor can name them.
"""

from __future__ import annotations

STALE_GENERATION = "stale_generation"  # the page was reallocated since the request was given it
FOREIGN_OWNER = "foreign_owner"  # the page belongs to another tenant, or to nobody
UNWRITTEN_READ = "unwritten_read"  # the step would read slots never written at this generation
STALE_WRITE = "stale_write"  # a KV write names a generation or owner that does not hold the page
# A request's rejected drafts could not be taken back: a page of its tail is no longer its own alone.
DRAFT_ROLLBACK_REFUSED = "draft_rollback_refused"
# Handoff (prefill -> decode) failures, checked by the receiver before decode may start (invariant 6).
INCOMPLETE_HANDOFF = "incomplete_handoff"  # "complete" arrived but `written` does not cover the prompt
CHECKSUM_MISMATCH = "checksum_mismatch"  # a page's bytes do not match the checksum sent with them
INTEGRITY_REASONS = frozenset(
    {
        STALE_GENERATION,
        FOREIGN_OWNER,
        UNWRITTEN_READ,
        STALE_WRITE,
        DRAFT_ROLLBACK_REFUSED,
        INCOMPLETE_HANDOFF,
        CHECKSUM_MISMATCH,
    }
)
