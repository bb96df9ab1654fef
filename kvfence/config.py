"""All settings in one place, and the start-up capacity report.

The capacity check is invariant 3 at start-up: the pool is sized from memory, the context window from the
model, and nothing forces the two to agree — so the engine compares them before it serves anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

# Bytes per element of each --dtype: the pool's size is known before torch (or the model) loads.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DECODE_ATTENTION = ("auto", "kernel", "sdpa")  # auto: the kernel where it can run (C on CPU, Triton on CUDA)
DECODE_MATMUL = ("auto", "kernel", "dense")  # auto: the kernel where it can run (float32 on CPU, quantized)
# What the packed kernel multiplies codes in groups of 32 by: the float32 rows (exact weights and products),
# or the rows quantized to int8 per 32 values, as llama.cpp does (integer dot products, ~4x less work);
# auto: int8 wherever the packed kernel runs (a block-quantized GGUF on CPU), float32 elsewhere. bfloat16:
# the rows rounded to bfloat16 times bfloat16 weights kept 16-bit (a Hugging Face directory's, on CPU), with
# float32 sums (twice the multiply-adds a cycle on AVX512-BF16); auto picks it there on a CPU with the flag.
ACTIVATION_DTYPES = ("auto", "float32", "int8", "bfloat16")
# What the KV pool holds: float16 under a float32 model (half the bytes each decode step reads, twice the
# tokens a pool holds; llama.cpp's default cache type; CPU only), or the model's own dtype. auto: float16
# where the activations are int8 (the fast path, what llama.cpp computes), the model's dtype elsewhere: so
# `--activation-dtype float32` alone gives the exact float32 path.
KV_CACHE_DTYPES = ("auto", "float16")
# The GGUF storage types that are not block formats (ggml type ids): F32, F16, BF16.
UNBLOCKED_GGML_TYPES = frozenset({0, 1, 30})


# vLLM's --speculative-config keys kvfence reads, per method; any other key is refused by name, never ignored.
SPECULATIVE_KEYS = {
    "ngram": ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"),
    "draft_model": ("method", "num_speculative_tokens", "model"),
}
SPECULATIVE_METHODS = tuple(SPECULATIVE_KEYS)
MAX_SPECULATIVE_TOKENS = 16  # verify rows per request and step: beyond this a draft is mostly wasted work


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config`: `method` "ngram" (prompt lookup) proposes `num_speculative_tokens`
    tokens a step from the request's own tokens, matching n-grams `prompt_lookup_min`..`prompt_lookup_max`
    long (vLLM's defaults: one given, the other equals it; neither, both 5); "draft_model" has the model at
    `model` (a GGUF file or a Hugging Face directory of the target's vocabulary) propose them."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative method {self.method!r} is not implemented; implemented: "
                + ", ".join(SPECULATIVE_METHODS)
            )
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative 'model' is what method 'draft_model' needs, and only it")

    @classmethod
    def from_dict(cls, values: dict[str, object]) -> SpeculativeConfig:
        """The config vLLM's JSON object names (ValueError naming a key kvfence does not read for that
        method, or a value of the wrong type)."""
        if "method" not in values or "num_speculative_tokens" not in values:
            raise ValueError("a speculative config needs 'method' and 'num_speculative_tokens'")
        method = values["method"]
        if method not in SPECULATIVE_METHODS:  # first: its other keys mean nothing without the method
            cls(str(method), 1)  # its refusal, naming the methods implemented
        unknown = sorted(set(values) - set(SPECULATIVE_KEYS[str(method)]))
        if unknown:
            raise ValueError(f"speculative config key(s) not supported with {method!r}: {', '.join(unknown)}")
        model = values.get("model")
        if method == "draft_model" and (not isinstance(model, str) or not model):
            raise ValueError("speculative 'model' must name the draft model's file or directory")
        ints = {k: v for k, v in values.items() if k not in ("method", "model")}
        for key, value in ints.items():
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"speculative {key!r} must be an integer")
        low, high = ints.get("prompt_lookup_min"), ints.get("prompt_lookup_max")
        low = high if low is None else low
        high = low if high is None else high
        low, high = (5, 5) if low is None else (low, high)
        k = int(ints["num_speculative_tokens"])
        return cls(str(method), k, int(low), int(high), model if isinstance(model, str) else None)


STEP_TOKENS_CPU = 512
STEP_TOKENS_ACCELERATOR = 2048  # vLLM's chunked-prefill default on GPUs
# The chunk of a prompt prefilling alone on CPU (see `Scheduler.step_budget`): each chunk re-reads (gathers
# and widens to float32) its whole cached context in every layer: in a profiled 6,000-token SmolLM2 prefill
# in 512-token chunks, index_select + copy_ took 24% of the aten time (SDPA 74%), attention ~49% of the TTFT.
LONG_PREFILL_TOKENS_CPU = 2048


@dataclass
class EngineConfig:
    """Everything the engine needs to start. `model` None means the packaged SmolLM2 GGUF."""

    model: Path | None = None
    dtype: str = "float32"
    device: str = "cpu"  # the CLI's default is "auto": cuda if available, resolved when the model loads
    page_size: int = 16
    num_pages: int | None = None  # wins over kv_cache_memory when set
    kv_cache_memory: int = 512 * 2**20  # SmolLM2 float32: 11,648 tokens, the 8,192 window fits
    max_model_len: int | None = None  # None: the model's context window
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # tokens per step; None: by device (`step_tokens`)
    enable_prefix_caching: bool = True
    isolation: bool = True
    faults: dict[str, float] = field(default_factory=dict)
    num_threads: int | None = None
    decode_attention: str = "auto"  # auto | kernel | sdpa (see DECODE_ATTENTION)
    decode_matmul: str = "auto"  # auto | kernel | dense (see DECODE_MATMUL)
    activation_dtype: str = "auto"  # auto | float32 | int8 | bfloat16 (see ACTIVATION_DTYPES)
    kv_cache_dtype: str = "auto"  # auto | float16 (see KV_CACHE_DTYPES)
    speculative: SpeculativeConfig | None = None  # None: one token per request and step
    # KV tiers below the pool (cache/tier_stores.py specs), searched in order, sealed under the key read
    # from `kv_tier_key_file` (64 hex digits: 32 random bytes).
    kv_tiers: tuple[str, ...] = ()
    kv_tier_key_file: Path | None = None
    # Decode steps replayed from captured CUDA graphs where the model runs on CUDA (engine/graphs.py); the
    # pool gets a scratch page for their padding rows (on CPU that page alone: the graph tests' stand-in).
    decode_graphs: bool = False
    trace_pages: bool = False  # audit `pages_read` events: which pages each request reads, whose data
    declare_batch_invariance: bool = True  # False: the `batch_invariant` pin is left out (audit tests)
    # Per-tenant limits (None: only the engine's own). Waiting requests beyond the queue limit are refused
    # with 429; the running and page limits keep a tenant's further requests waiting.
    max_waiting_per_tenant: int | None = 1024
    max_running_per_tenant: int | None = None
    max_pages_per_tenant: int | None = None
    fair_scheduling: bool = True  # weighted-fair across tenants; False: arrival order (benchmarks only)

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.max_num_seqs < 1 or (self.max_num_batched_tokens or 1) < 1:
            raise ValueError("page_size, max_num_seqs and max_num_batched_tokens must be positive")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, not {self.kv_cache_dtype!r}")
        if self.activation_dtype not in ACTIVATION_DTYPES:
            raise ValueError(
                f"activation_dtype must be one of {ACTIVATION_DTYPES}, not {self.activation_dtype!r}"
            )

    def step_tokens(self, device_type: str) -> int:
        """The step's token budget (the chunked-prefill chunk): `max_num_batched_tokens`, else by where the
        model runs. On CPU a smaller chunk lets each prompt finish its prefill sooner instead of all of them
        late together: SmolLM2 at 16 streams of 246-token prompts (bench/vs_vllm.py's rows), 512 against
        2048 gave TTFT p50 0.67-0.69 s against 1.99-2.04 s at 257-264 against 243-246 tok/s (256: 0.54 s,
        252-258 tok/s, TPOT 55 ms against 51)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return STEP_TOKENS_CPU if device_type == "cpu" else STEP_TOKENS_ACCELERATOR

    def alone_tokens(self, device_type: str) -> int:
        """The token budget of a step whose only work is one prompt's prefill: `max_num_batched_tokens` when
        set (a budget asked for is kept), else LONG_PREFILL_TOKENS_CPU on CPU (no other request waits on a
        longer step, and fewer chunks re-read the context), else the step's budget."""
        if self.max_num_batched_tokens is not None or device_type != "cpu":
            return self.step_tokens(device_type)
        return LONG_PREFILL_TOKENS_CPU

    def expected_kv_dtype(self, block_quantized: bool) -> str:
        """The pool's element type by name as this config will resolve it for a model whose GGUF holds block-
        quantized weights or not, before the model loads (the start-up check sizes the pool with it; the
        engine resolves it again from the loaded model, `builder.pool_dtype`, and checks again)."""
        if self.kv_cache_dtype != "auto":
            return self.kv_cache_dtype
        fast = (
            block_quantized
            and self.device in ("cpu", "auto")
            and self.dtype == "float32"
            and self.decode_matmul != "dense"
            and self.activation_dtype != "float32"
        )
        return "float16" if fast else self.dtype


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


class KVShape(Protocol):
    """What a pool's size and the window depend on: the model's config, or its GGUF header alone."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    context_length: int


def page_bytes(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """One page's K and V over every layer."""
    return num_layers * 2 * page_size * num_kv_heads * head_dim * dtype_bytes


def capacity_report(config: EngineConfig, shape: KVShape, dtype_bytes: int) -> CapacityReport:
    """The pool `config` asks for, in pages and bytes, next to the context window it must hold."""
    per_page = page_bytes(shape.num_layers, config.page_size, shape.num_kv_heads, shape.head_dim, dtype_bytes)
    num_pages = config.num_pages or config.kv_cache_memory // per_page
    return CapacityReport(
        num_pages=num_pages,
        page_size=config.page_size,
        pool_bytes=num_pages * per_page,
        context_window=config.max_model_len or shape.context_length,
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
