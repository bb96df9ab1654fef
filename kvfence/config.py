"""All settings in one place, and the start-up capacity report.

The capacity check is invariant 3 at start-up: the pool is sized from memory, the context window from the
model, and nothing forces the two to agree — so the engine compares them before it serves anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class EngineConfig:
    """Everything the engine needs to start. `model` None means the packaged SmolLM2 GGUF."""

    model: Path | None = None
    dtype: str = "float32"
    device: str = "cpu"
    page_size: int = 16
    num_pages: int | None = None  # wins over kv_cache_memory when set
    kv_cache_memory: int = 512 * 2**20  # SmolLM2 float32: 11,648 tokens, the 8,192 window fits
    max_model_len: int | None = None  # None: the model's context window
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    isolation: bool = True
    faults: dict[str, float] = field(default_factory=dict)
    num_threads: int | None = None
    decode_attention: str = "auto"  # auto | kernel | sdpa (see kvfence.model.llama.DECODE_ATTENTION)
    decode_matmul: str = "auto"  # auto | kernel | dense (see kvfence.model.llama.DECODE_MATMUL)
    trace_pages: bool = False  # audit `pages_read` events: which pages each request reads, whose data
    # Per-tenant limits (None: only the engine's own). Waiting requests beyond the queue limit are refused
    # with 429; the running and page limits keep a tenant's further requests waiting.
    max_waiting_per_tenant: int | None = 1024
    max_running_per_tenant: int | None = None
    max_pages_per_tenant: int | None = None
    fair_scheduling: bool = True  # weighted-fair across tenants; False: arrival order (benchmarks only)

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("page_size, max_num_seqs and max_num_batched_tokens must be positive")


@dataclass(frozen=True)
class CapacityReport:
    """Pool size next to the context window: the two numbers the incident showed must agree."""

    num_pages: int
    page_size: int
    pool_bytes: int
    context_window: int

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def fits(self) -> bool:
        return self.context_window <= self.capacity_tokens

    def describe(self) -> str:
        return (
            f"KV pool: {self.num_pages} pages x {self.page_size} tokens = {self.capacity_tokens} tokens "
            f"({self.pool_bytes / 2**20:.1f} MiB); context window: {self.context_window} tokens"
        )


class CapacityError(RuntimeError):
    """The context window cannot be served: it does not fit in the pool, or it is longer than the model's
    own window. The engine refuses to start, naming the --max-model-len that would work: the smaller of what
    the pool holds and the model's window (when known), so following the advice starts the server."""

    def __init__(self, report: CapacityReport, model_window: int | None = None) -> None:
        limit = report.capacity_tokens if model_window is None else min(report.capacity_tokens, model_window)
        if model_window is not None and report.context_window > model_window:
            problem = f"The window is longer than the model's own context window ({model_window} tokens)."
        else:
            problem = "The window does not fit in the pool: a request near the window could never be served."
        more_memory = "give the pool more memory (--kv-cache-memory / --num-pages)"
        if limit < 1:
            fix = f"The pool holds no page: {more_memory}."
        elif report.capacity_tokens < min(report.context_window, model_window or report.context_window):
            fix = f"Start with --max-model-len {limit} (or smaller), or {more_memory}."
        else:
            fix = f"Start with --max-model-len {limit} (or smaller)."
        super().__init__(f"{report.describe()}. {problem} {fix}")
        self.report = report
        self.suggested_max_model_len = limit


def check_window(report: CapacityReport, model_window: int) -> None:
    """Invariant 3 at start-up: the window must fit in the pool and must not exceed the model's own window
    (CapacityError otherwise)."""
    if report.context_window > model_window or not report.fits:
        raise CapacityError(report, model_window)
