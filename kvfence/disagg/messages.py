"""One declared type per message between router, prefill and decode, and the one parser that checks them.

A frame off the wire is untrusted until `parse` has turned it into one of these dataclasses: the kind is
known, every field is present with its declared type (no extra field), strings and lists are bounded,
token ids lie in the vocabulary, integers are non-negative, and only a `Page` (page bytes) and a `KvAgent`
(NIXL agent metadata, at most 64 KiB) carry a payload. Who may
send each kind is not decided here but by the receiver's role rules (`ROLE_RULES` below), against the
sender the transport authenticated.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from kvfence.grammar.compiler import Guide
from kvfence.sampling import SamplingParams, TokenLogprobs

if TYPE_CHECKING:  # the engine (torch) stays out of the wire's imports
    from kvfence.engine.engine import AdmissionError

MAX_ID_CHARS = 256  # request ids, tenants, tokens, codes, reasons, peer addresses
MAX_TEXT_CHARS = 1 << 16  # error messages and one step's output text
MAX_INT = 1 << 64  # an xxh3_64 checksum is the widest integer a message carries
MAX_ITEMS = 1 << 16  # any other list: a request's audit trail, stop strings
MAX_AGENT_BYTES = 1 << 16  # a NIXL agent's metadata (about 500 bytes over UCX)
MAX_GUIDE_CHARS = 1 << 20  # a structured-output guide (schema, pattern, choices or grammar), as JSON
MAX_CHOICES = 128  # n, as OpenAI bounds it
GUIDE_KINDS = {"json": dict, "regex": str, "choice": list, "lark": str}  # Guide.kind -> its spec's type
LOGPROB_FLOOR = -9999.0  # -inf on the wire, as OpenAI writes it (JSON has no infinity)


class BadMessage(ValueError):
    """A frame that is not a well-formed message; `reason` is the short label it is counted under."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class Bounds:
    """The receiver's limits: the longest token list its model could ever take, and its vocabulary."""

    max_tokens: int
    vocab_size: int


@dataclass(frozen=True)
class Msg:
    KIND: ClassVar[str]

    def fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "payload"}


# ---- control: every worker answers the router ----------------------------------------------------------


@dataclass(frozen=True)
class Hello(Msg):
    KIND: ClassVar[str] = "hello"
    token: str


@dataclass(frozen=True)
class HelloReply(Msg):
    KIND: ClassVar[str] = "hello_reply"
    token: str
    role: str
    capacity_tokens: int
    max_model_len: int
    page_size: int
    isolation: bool
    info: dict[str, Any]


@dataclass(frozen=True)
class Stats(Msg):
    KIND: ClassVar[str] = "stats"
    token: str


@dataclass(frozen=True)
class StatsReply(Msg):
    KIND: ClassVar[str] = "stats_reply"
    token: str
    stats: dict[str, Any]


@dataclass(frozen=True)
class Audit(Msg):
    KIND: ClassVar[str] = "audit"
    token: str
    request_id: str


@dataclass(frozen=True)
class AuditReply(Msg):
    KIND: ClassVar[str] = "audit_reply"
    token: str
    request_id: str
    events: list[dict[str, Any]]


# ---- one request's handoff ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reserve(Msg):
    KIND: ClassVar[str] = "reserve"
    request_id: str
    tenant: str
    prompt: list[int]
    params: dict[str, Any]
    prefill: str  # the prefill worker (a configured peer) the router assigned
    # Structured output or a forced tool call: {"kind", "spec"} of the Guide the API compiled; decode
    # compiles it again (its own tokenizer's matcher) before it reserves anything.
    guide: dict[str, Any] | None = None
    n: int = 1  # choices sampled from the prompt: decode computes it once and forks (n > 1)

    def sampling(self) -> SamplingParams:
        return SamplingParams(**self.params)

    def output_guide(self) -> Guide | None:
        return None if self.guide is None else Guide(self.guide["kind"], self.guide["spec"])


@dataclass(frozen=True)
class Reserved(Msg):
    KIND: ClassVar[str] = "reserved"
    request_id: str
    targets: list[list[int]]  # [page, generation] per logical page


REFUSAL_STATUSES = frozenset({400, 409, 429, 503})  # AdmissionError's statuses


KV_UNAVAILABLE = "kv_unavailable"  # a refusal's code: the worker's one-sided agent gave up (`kv_refusal`)


@dataclass(frozen=True)
class Rejected(Msg):
    """A worker refused a request; `status` is the HTTP status the client gets, one of REFUSAL_STATUSES
    (a worker's key may be stolen: it cannot make a refusal a 200 or a 5xx of its choosing)."""

    KIND: ClassVar[str] = "rejected"
    request_id: str
    code: str
    message: str
    status: int = 400

    @classmethod
    def of(cls, request_id: str, refusal: AdmissionError) -> Rejected:
        return cls(request_id, refusal.code, str(refusal), refusal.status)


@dataclass(frozen=True)
class Prefill(Msg):
    KIND: ClassVar[str] = "prefill"
    request_id: str
    tenant: str
    prompt: list[int]
    decode: str  # the decode worker (a configured peer) holding the targets
    targets: list[list[int]]


@dataclass(frozen=True)
class Accepted(Msg):
    KIND: ClassVar[str] = "accepted"
    request_id: str


@dataclass(frozen=True)
class Page(Msg):
    KIND: ClassVar[str] = "page"
    request_id: str
    logical: int
    page: int
    generation: int
    checksum: int  # xxh3_64 of the payload: the page's written slots, as many as decode derives itself
    payload: bytes = field(default=b"", repr=False)


@dataclass(frozen=True)
class Complete(Msg):
    KIND: ClassVar[str] = "complete"
    request_id: str
    pages: int
    tokens: int
    failed: str = ""  # prefill aborted the request: decode must not wait for pages
    # One-sided (NIXL) transfers: xxh3_64 of each sealed page as prefill staged it, one per page written.
    # Decode tells a torn or lost WRITE by these; what decides is whether each page opens under its key.
    checksums: list[int] | None = None
    # One-sided: the NIXL agent that posted the WRITE; decode believes only that agent's notification.
    agent: str = ""


@dataclass(frozen=True)
class KvAgent(Msg):
    """decode -> prefill, on the authenticated channel only: how to WRITE into decode's landing area with
    NIXL (never its pool). Granting happens per request (`targets`); this only says where the area lies.
    With no metadata: decode's landing process is being replaced, so forget its agent (ZeroMQ frames
    until the next one is announced)."""

    KIND: ClassVar[str] = "kv_agent"
    base: int
    slots: int
    slot_bytes: int
    payload: bytes = field(default=b"", repr=False)  # the NIXL agent metadata


@dataclass(frozen=True)
class SealKey(Msg):
    """decode -> the prefill worker assigned to a request, on the authenticated channel only: the key its
    one-sided pages are sealed with (kvfence/disagg/seal.py), hex. It never travels on the fabric."""

    KIND: ClassVar[str] = "seal_key"
    request_id: str
    key: str


@dataclass(frozen=True)
class Abort(Msg):
    KIND: ClassVar[str] = "abort"
    request_id: str
    reason: str = "cancelled"


@dataclass(frozen=True)
class AbortAck(Msg):
    KIND: ClassVar[str] = "abort_ack"
    request_id: str


@dataclass(frozen=True)
class Output(Msg):
    KIND: ClassVar[str] = "output"
    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    status: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    # When the request asked for logprobs: per token id, its logprob, then the top ids and their logprobs
    # (best first); -inf is sent as LOGPROB_FLOOR.
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    fork: int | None = None  # n > 1: the choice this output is of; None: the request itself

    @staticmethod
    def logprobs_fields(entries: list[TokenLogprobs] | None) -> dict[str, Any]:
        """The three logprobs fields of `entries` (none without them)."""
        if entries is None:
            return {}
        return {
            "logprobs": [_finite(entry.logprob) for entry in entries],
            "top_ids": [[token for token, _ in entry.top] for entry in entries],
            "top_logprobs": [[_finite(value) for _, value in entry.top] for entry in entries],
        }

    def token_logprobs(self) -> list[TokenLogprobs] | None:
        if self.logprobs is None or self.top_ids is None or self.top_logprobs is None:
            return None
        return [
            TokenLogprobs(token, value, list(zip(ids, values, strict=True)))
            for token, value, ids, values in zip(
                self.token_ids, self.logprobs, self.top_ids, self.top_logprobs, strict=True
            )
        ]


def _finite(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


KINDS: dict[str, type[Msg]] = {
    cls.KIND: cls
    for cls in (
        Hello,
        HelloReply,
        Stats,
        StatsReply,
        Audit,
        AuditReply,
        Reserve,
        Reserved,
        Rejected,
        Prefill,
        Accepted,
        Page,
        Complete,
        KvAgent,
        SealKey,
        Abort,
        AbortAck,
        Output,
    )
}
PAYLOAD_LIMITS: dict[type[Msg], int] = {Page: 1 << 62, KvAgent: MAX_AGENT_BYTES}  # the only kinds with one

# Receiver role -> kind -> the sender roles it accepts that kind from. Anything else is dropped and
# counted. Which *one* peer of a role may send a request's messages is the receiver's own bookkeeping.
ROLE_RULES: dict[str, dict[str, frozenset[str]]] = {
    "decode": {
        "hello": frozenset({"router"}),
        "stats": frozenset({"router"}),
        "audit": frozenset({"router"}),
        "reserve": frozenset({"router"}),
        "abort": frozenset({"router"}),
        "page": frozenset({"prefill"}),
        "complete": frozenset({"prefill"}),
        "abort_ack": frozenset({"prefill"}),
    },
    "prefill": {
        "hello": frozenset({"router"}),
        "stats": frozenset({"router"}),
        "audit": frozenset({"router"}),
        "prefill": frozenset({"router"}),
        "abort": frozenset({"decode"}),
        "kv_agent": frozenset({"decode"}),
        "seal_key": frozenset({"decode"}),
    },
    "router": {
        "hello_reply": frozenset({"prefill", "decode"}),
        "stats_reply": frozenset({"prefill", "decode"}),
        "audit_reply": frozenset({"prefill", "decode"}),
        "reserved": frozenset({"decode"}),
        "rejected": frozenset({"prefill", "decode"}),
        "accepted": frozenset({"prefill"}),
        "output": frozenset({"decode"}),
    },
}


# ---- wire form ------------------------------------------------------------------------------------------


def encode(message: Msg) -> tuple[bytes, bytes]:
    """The two frames: a JSON header (`kind` and the fields) and the payload (page bytes, else empty)."""
    header = json.dumps({"kind": message.KIND, **message.fields()}).encode()
    return header, getattr(message, "payload", b"")


def decode(header: bytes, payload: bytes, bounds: Bounds) -> Msg:
    """Parse and check an untrusted frame pair; raises BadMessage, never anything else."""
    try:
        data = json.loads(header.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # RecursionError: nesting past the stack
        raise BadMessage("not_json", str(exc)[:80] or type(exc).__name__) from None
    if not isinstance(data, dict):
        raise BadMessage("not_json", "the header is not an object")
    kind = data.pop("kind", None)
    cls = KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise BadMessage("unknown_kind", f"{str(kind)[:40]!r}")
    return build(cls, data, payload, bounds)


def accept(header: bytes, payload: bytes, sender_role: str | None, receiver_role: str, bounds: Bounds) -> Msg:
    """`decode`, then the role rule: may a `sender_role` peer send this kind to a `receiver_role` one?
    (`sender_role` None: an insecure transport, where no role is proven and only the kind is checked.)
    Raises BadMessage, with reason `wrong_role` for a message its sender may not send."""
    message = decode(header, payload, bounds)
    allowed = ROLE_RULES[receiver_role].get(message.KIND)
    if allowed is None or (sender_role is not None and sender_role not in allowed):
        raise BadMessage("wrong_role", f"{message.KIND} from a {sender_role or 'unknown'} peer")
    return message


def build(cls: type[Msg], data: dict[str, Any], payload: bytes, bounds: Bounds) -> Msg:
    """`cls` from untrusted fields: exactly its fields, each of its declared type and within bounds."""
    hints = typing.get_type_hints(cls)
    declared = {f.name: f for f in dataclasses.fields(cls) if f.name != "payload"}
    extra = set(data) - set(declared)
    if extra:
        raise BadMessage("bad_field", f"{cls.KIND}: unknown fields {sorted(extra)[:5]}")
    values: dict[str, Any] = {}
    for name, spec in declared.items():
        if name not in data:
            if spec.default is dataclasses.MISSING:
                raise BadMessage("bad_field", f"{cls.KIND}: missing {name}")
            continue
        values[name] = _checked(hints[name], data[name], f"{cls.KIND}.{name}", bounds)
    limit = PAYLOAD_LIMITS.get(cls, 0)
    if len(payload) > limit:
        raise BadMessage("bad_field", f"{cls.KIND} payload of {len(payload)} bytes (at most {limit})")
    message = cls(**values, **({"payload": payload} if cls in PAYLOAD_LIMITS else {}))
    _check_meaning(message, bounds)
    return message


def _checked(kind: Any, value: Any, where: str, bounds: Bounds) -> Any:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        return _checked(next(a for a in args if a is not type(None)), value, where, bounds)
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        low = -MAX_INT if where.endswith(".seed") else 0  # a seed may be negative; counts and indices not
        ok = isinstance(value, int) and not isinstance(value, bool) and low <= value < MAX_INT
    elif kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    elif kind is str:
        limit = MAX_TEXT_CHARS if where.endswith((".message", ".text")) else MAX_ID_CHARS
        ok = isinstance(value, str) and len(value) <= limit
    elif origin is list:
        tokens = args[0] is int or where.endswith(".targets")  # one entry per token or per page
        ok = isinstance(value, list) and len(value) <= (bounds.max_tokens + 1 if tokens else MAX_ITEMS)
        if ok:
            return [_checked(args[0], item, where, bounds) for item in value]
    elif origin is dict or kind is Any:
        ok = isinstance(value, dict if origin is dict else object)
    else:
        raise TypeError(f"no check for {kind}")
    if not ok:
        raise BadMessage("bad_field", f"{where}: {type(value).__name__} out of type or range")
    return value


def _check_logprobs(message: Output, bounds: Bounds) -> None:
    """An output's logprobs: all three lists or none, one entry per token, as many top ids as logprobs,
    ids in the vocabulary, no log-probability above 0."""
    parts = (message.logprobs, message.top_ids, message.top_logprobs)
    if all(part is None for part in parts):
        return
    logprobs, top_ids, top_logprobs = parts
    if logprobs is None or top_ids is None or top_logprobs is None:
        raise BadMessage("bad_field", "output: logprobs, top_ids and top_logprobs come together")
    if not len(logprobs) == len(top_ids) == len(top_logprobs) == len(message.token_ids):
        raise BadMessage("bad_field", "output: not one logprobs entry per token")
    if any(len(ids) != len(values) for ids, values in zip(top_ids, top_logprobs, strict=True)):
        raise BadMessage("bad_field", "output: top ids and top logprobs differ in length")
    if any(t >= bounds.vocab_size for ids in top_ids for t in ids):
        raise BadMessage("bad_field", "output.top_ids: token id outside the vocabulary")
    if any(value > 0 for value in [*logprobs, *(v for values in top_logprobs for v in values)]):
        raise BadMessage("bad_field", "output: a log-probability above 0")


def _check_meaning(message: Msg, bounds: Bounds) -> None:
    """What the types alone cannot say: token ids in the vocabulary, pairs as targets, sane params."""
    for name in ("prompt", "token_ids"):
        tokens = getattr(message, name, None)
        if tokens is not None and any(t >= bounds.vocab_size for t in tokens):
            raise BadMessage("bad_field", f"{message.KIND}.{name}: token id outside the vocabulary")
    if isinstance(message, Output):
        _check_logprobs(message, bounds)
    if isinstance(message, Rejected) and message.status not in REFUSAL_STATUSES:
        raise BadMessage("bad_field", f"rejected.status: {message.status} is not a refusal's status")
    targets = getattr(message, "targets", None)
    if targets is not None and any(len(t) != 2 for t in targets):
        raise BadMessage("bad_field", f"{message.KIND}.targets: not (page, generation) pairs")
    if isinstance(message, Reserve):
        hints = typing.get_type_hints(SamplingParams)
        if not set(message.params) <= set(hints):
            raise BadMessage("bad_field", "reserve.params: unknown sampling parameter")
        for name, value in message.params.items():
            _checked(hints[name], value, f"reserve.params.{name}", bounds)
        try:
            message.sampling()
        except (TypeError, ValueError) as exc:
            raise BadMessage("bad_field", f"reserve.params: {str(exc)[:80]}") from None
        if message.guide is not None:
            _check_guide(message.guide)
        if not 1 <= message.n <= MAX_CHOICES:
            raise BadMessage("bad_field", f"reserve.n: not in [1, {MAX_CHOICES}]")


def _check_guide(guide: dict[str, Any]) -> None:
    """A reserve's guide: exactly a known kind and a spec of its type, bounded. Whether it compiles is
    decode's to find out (a 400 back to the router), as it is the API's."""
    kind = guide.get("kind")
    shaped = set(guide) == {"kind", "spec"} and kind in GUIDE_KINDS
    if not shaped or not isinstance(guide["spec"], GUIDE_KINDS[kind]):
        raise BadMessage("bad_field", "reserve.guide: not a {kind, spec} guide")
    if len(json.dumps(guide["spec"])) > MAX_GUIDE_CHARS:
        raise BadMessage("bad_field", f"reserve.guide: longer than {MAX_GUIDE_CHARS} characters")
