"""What the router may take from a worker's reply: every reply is untrusted input.

`messages.decode` proved a reply's shape (its kind and top-level field types) and the transport proved who
sent it; neither makes a worker's numbers, events or pins sane. A worker's key may be stolen, so what it
says is checked here before the router aggregates, sorts, serves or places on it.

Contract: each function takes a payload that passed `messages.decode` and returns `(value, problems)`.
`value` is typed and bounded, so the router can use it with no further check: None when the whole reply
cannot be used, otherwise what survives of it (bad items left out, an implausible capacity capped).
`problems` names each item dropped or changed, one entry each: the router counts them as `bad_reply`
in `kvfence_transport_rejected_total` and logs them with the sender. Nothing here raises on such a
payload, whatever its contents.

- `stats`: exactly `EngineStats`' fields; every count an int in [0, 2^53] (exact as a Prometheus float),
  seconds finite and non-negative, each labelled dict at most 64 snake_case keys of such counts, and no
  more free (or per-state) pages than pages. A reply failing any of it is dropped whole.
- `events`: each event alone: at most 32 fields, `kind` a known event kind, `ts` a finite non-negative
  number (the merge sorts on it), `request_id` the one asked about, values nested at most 3 deep, at most
  2^18 of them, numbers finite (integers below 2^64), strings and keys of at most 1024 and 64 characters.
  A bad event is dropped, the others kept.
- `pins`: at most 64 entries, each value None, a bool, a number, a string (1024 characters: a model
  file's path) or a list or dict of at most 64 such values (`transport`), bounded as events are. A bad
  entry is dropped, the others kept. They stay the worker's own claim: nothing can check them.
- `worker` (a hello): page size in [1, 2^16] and equal to the one the router agreed on, capacity a
  positive multiple of it, capped at the router's ceiling (rounded down to whole pages), and a window in
  [1, capacity]: the engine refuses to start with a window its pool cannot hold, so a larger one is a lie.
  Its pins are `pins` of its info, and the four the hello states (`HELLO_PINS`) as the router uses them.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from typing import Any

from kvfence.disagg.messages import MAX_INT, HelloReply
from kvfence.disagg.placement import WorkerInfo
from kvfence.engine.stats import EngineStats
from kvfence.trail.events import EVENT_KINDS

Problems = list[str]

MAX_CAPACITY_TOKENS = 1 << 24  # the default ceiling on an advertised pool: far above any this engine sizes
MAX_PAGE_SIZE = 1 << 16
MAX_COUNT = 1 << 53  # the largest integer a Prometheus sample (a float64) holds exactly
MAX_LABELS = 64
LABEL = re.compile(r"[a-z][a-z0-9_]{0,63}")  # reasons and page states: snake_case codes, one label value each
MAX_KEY_CHARS = 64
MAX_STRING_CHARS = 1024
MAX_PINS = 64
MAX_EVENT_FIELDS = 32
MAX_EVENT_DEPTH = 3  # an event, a list in it, a dict in that list (`pages_read`' pages)
MAX_EVENT_VALUES = 1 << 18  # a window of 2^16 pages read, four values a page
HELLO_PINS = ("capacity_tokens", "max_model_len", "page_size", "isolation")
_STAT_TYPES = typing.get_type_hints(EngineStats)
_STAT_NAMES = frozenset(f.name for f in dataclasses.fields(EngineStats))


class _Unbounded(ValueError):
    """A value outside the bounds; caught inside this module, never raised out of it."""


def stats(data: dict[str, Any]) -> tuple[EngineStats | None, Problems]:
    """A stats reply as EngineStats, or None (dropped whole: a partial pool would mislead /metrics)."""
    if set(data) != _STAT_NAMES:
        return None, [f"stats: fields {sorted(set(data) ^ _STAT_NAMES)[:5]} differ from EngineStats'"]
    bad = [name for name in sorted(_STAT_NAMES) if not _is_stat(_STAT_TYPES[name], data[name])]
    if bad:
        return None, [f"stats: {bad[:5]} out of type or bounds"]
    checked = EngineStats(**data)
    if max([checked.pages_free, *checked.pages_by_state.values()]) > checked.num_pages:
        return None, ["stats: more free or per-state pages than pages"]
    return checked, []


def _is_stat(hint: Any, value: Any) -> bool:
    if hint is int:
        return _is_count(value)
    if hint is float:
        return _is_number(value) and 0 <= value <= MAX_COUNT
    if hint == list[int]:  # counts by position (speculative decoding's acceptance)
        return isinstance(value, list) and len(value) <= MAX_LABELS and all(_is_count(v) for v in value)
    if hint == dict[str, dict[str, int]]:  # counts by metric, then by label (KV tiers)
        return (
            isinstance(value, dict)
            and len(value) <= MAX_LABELS
            and all(
                isinstance(k, str) and LABEL.fullmatch(k) and _is_stat(dict[str, int], v)
                for k, v in value.items()
            )
        )
    return (
        isinstance(value, dict)
        and len(value) <= MAX_LABELS
        and all(isinstance(k, str) and LABEL.fullmatch(k) and _is_count(v) for k, v in value.items())
    )


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT


def _is_number(value: Any) -> bool:
    """A finite float or an int below 2^64 (the widest a message carries), never a bool: json.loads
    makes NaN, Infinity and integers of thousands of digits."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return abs(value) < MAX_INT if isinstance(value, int) else math.isfinite(value)


def events(items: list[dict[str, Any]], request_id: str) -> tuple[list[dict[str, Any]], Problems]:
    """The events of `request_id` that are sane, in the order given; one problem per event left out."""
    kept, problems = [], []
    for index, event in enumerate(items):
        problem = _event_problem(event, request_id)
        if problem is None:
            kept.append(event)
        else:
            problems.append(f"event {index}: {problem}")
    return kept, problems


def _event_problem(event: Any, request_id: str) -> str | None:
    if not isinstance(event, dict):
        return f"a {type(event).__name__}"
    if len(event) > MAX_EVENT_FIELDS:
        return f"{len(event)} fields"
    if not isinstance(event.get("kind"), str) or event["kind"] not in EVENT_KINDS:
        return "no known kind"
    if not _is_number(event.get("ts")) or event["ts"] < 0:
        return "no finite ts"
    if event.get("request_id") != request_id:
        return "another request's"
    try:
        size = _size(event, MAX_EVENT_DEPTH)
    except _Unbounded as exc:
        return str(exc)
    return None if size <= MAX_EVENT_VALUES else f"{size} values"


def pins(info: dict[str, Any]) -> tuple[dict[str, Any], Problems]:
    """The worker's pins that are bounded: the first MAX_PINS good entries; one problem per entry left."""
    kept: dict[str, Any] = {}
    problems = []
    for key, value in info.items():
        problem = _pin_problem(key, value, len(kept))
        if problem is None:
            kept[key] = value
        else:
            problems.append(f"pin {str(key)[:MAX_KEY_CHARS]!r}: {problem}")
    return kept, problems


def _pin_problem(key: Any, value: Any, kept: int) -> str | None:
    try:
        _size({key: value}, 3)  # the pins' dict, `transport`, then its `conditions`
    except _Unbounded as exc:
        return str(exc)
    if isinstance(value, list | dict) and len(value) > MAX_PINS:
        return f"{len(value)} entries"
    return f"more than {MAX_PINS} pins" if kept == MAX_PINS else None


def _size(value: Any, depth: int) -> int:
    """How many JSON values `value` holds, itself included: scalars (finite numbers, short strings) nested
    in lists and dicts (short keys) at most `depth` deep; _Unbounded otherwise."""
    if value is None or isinstance(value, bool) or _is_number(value):
        return 1
    if isinstance(value, str):
        if len(value) > MAX_STRING_CHARS:
            raise _Unbounded(f"a string of {len(value)} characters")
        return 1
    if not isinstance(value, list | dict):
        raise _Unbounded(f"a {type(value).__name__}")  # an infinite or huge number: json.loads makes them
    if depth == 0:
        raise _Unbounded("nested too deep")
    if isinstance(value, dict) and not all(isinstance(k, str) and len(k) <= MAX_KEY_CHARS for k in value):
        raise _Unbounded("a key that is no short string")
    children = value.values() if isinstance(value, dict) else value
    return 1 + sum(_size(child, depth - 1) for child in children)


def worker(reply: HelloReply, page_size: int | None, ceiling: int) -> tuple[WorkerInfo | None, Problems]:
    """The worker as the router will count it, from its hello; None when the hello cannot be true.
    `page_size`: the one agreed at start (None while start is learning them: it compares them itself);
    `ceiling`: the largest pool the router believes, in tokens."""
    refusal = _hello_refusal(reply, page_size)
    if refusal is not None:
        return None, [refusal]
    problems: Problems = []
    whole_pages = ceiling - ceiling % reply.page_size
    capacity = min(reply.capacity_tokens, whole_pages)
    if capacity < reply.capacity_tokens:
        problems.append(f"hello: capacity {reply.capacity_tokens} tokens capped at {capacity}")
    if not 1 <= reply.max_model_len <= capacity:
        return None, [*problems, f"hello: window {reply.max_model_len} outside [1, pool {capacity}]"]
    shown, dropped = pins({k: v for k, v in reply.info.items() if k not in HELLO_PINS})
    checked = (capacity, reply.max_model_len, reply.page_size, reply.isolation)
    shown |= dict(zip(HELLO_PINS, checked, strict=True))  # what the router acts on, not a second claim
    return WorkerInfo(reply.role, *checked, shown), problems + dropped


def _hello_refusal(reply: HelloReply, page_size: int | None) -> str | None:
    if not 1 <= reply.page_size <= MAX_PAGE_SIZE:
        return f"hello: page size {reply.page_size} outside [1, {MAX_PAGE_SIZE}]"
    if page_size is not None and reply.page_size != page_size:
        return f"hello: page size {reply.page_size}, not the {page_size} agreed"
    if reply.capacity_tokens < reply.page_size or reply.capacity_tokens % reply.page_size:
        return f"hello: capacity {reply.capacity_tokens} tokens is not whole pages of {reply.page_size}"
    return None
