"""The engine: admission, the step loop, and turning sampled tokens into text and finishes.

`LLMEngine` is synchronous and single-threaded: one `step()` schedules a batch, runs it through the
fence and the model, and applies the results. `AsyncEngine` (async_engine.py) drives it from a thread.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvfence.cache.allocator import PageAllocator
from kvfence.cache.fence import Fence, MappingRecord
from kvfence.cache.pool import KVPool
from kvfence.cache.prefix import PrefixCache
from kvfence.config import CapacityError, CapacityReport, EngineConfig
from kvfence.engine.runner import ModelRunner
from kvfence.engine.scheduler import Scheduler
from kvfence.engine.trace import PageTrace
from kvfence.model.llama import LlamaModel
from kvfence.model.tokenizer import IncrementalDecoder, Tokenizer
from kvfence.request import Request, Status
from kvfence.sampling import SamplingParams, make_generator
from kvfence.trail.events import EventLog
from kvfence.trail.faults import FaultInjector
from kvfence.trail.reasons import INTEGRITY_REASONS
from kvfence.units import cdiv

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
log = logging.getLogger("kvfence.engine")


class AdmissionError(ValueError):
    """A request refused before any page was reserved. `code` is the OpenAI error code; `status` the HTTP
    status: 400 for a request that can never be served, 503 for one that cannot be served right now."""

    def __init__(self, code: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.code = code
        self.status = status


def context_refusal(prompt: int, budget: int, limits: list[tuple[str, int, int]]) -> AdmissionError | None:
    """The first limit (text, limit in tokens, tokens needed) a request exceeds, as an OpenAI-style 400."""
    for text, limit, need in limits:
        if need > limit:
            asked = (
                f"However, you requested {prompt + budget} tokens "
                f"({prompt} in the prompt, {budget} for the completion)."
            )
            return AdmissionError(CONTEXT_LENGTH_EXCEEDED, f"{text} {limit} tokens. {asked}")
    return None


@dataclass(frozen=True)
class RequestOutput:
    """An immutable snapshot of what one step changed for one request (safe to hand to other threads)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    status: Status
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model: LlamaModel,
        tokenizer: Tokenizer | None = None,
        events: EventLog | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.model_file: Path | None = None  # the GGUF the weights came from (load_engine sets it)
        self.events = events or EventLog()
        mc = model.config
        num_pages = config.num_pages or config.kv_cache_memory // KVPool.bytes_per_page(
            mc.num_layers, config.page_size, mc.num_kv_heads, mc.head_dim, model.dtype
        )
        self.max_model_len = config.max_model_len or mc.context_length
        self.capacity = CapacityReport(
            num_pages=num_pages,
            page_size=config.page_size,
            pool_bytes=num_pages
            * KVPool.bytes_per_page(
                mc.num_layers, config.page_size, mc.num_kv_heads, mc.head_dim, model.dtype
            ),
            context_window=self.max_model_len,
        )
        log(self.capacity.describe())
        for part, path, note in (
            ("attention", model.decode_attention, model.decode_attention_note),
            ("matmul", model.decode_matmul, model.decode_matmul_note),
        ):
            log(f"decode {part}: {path}" + ("" if path == "kernel" else f" ({note})"))
        if not self.capacity.fits:
            raise CapacityError(self.capacity)
        if self.max_model_len > mc.context_length:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's {mc.context_length}")
        if not config.isolation:
            log(
                "WARNING: isolation is OFF. KV pages are read and written without the fence. "
                "Use this only for the lab and for benchmarks, never to serve tenants."
            )
        self.faults = FaultInjector()
        for name, rate in config.faults.items():
            self.faults.arm(name, rate)
        self.pool = KVPool(
            mc.num_layers,
            num_pages,
            config.page_size,
            mc.num_kv_heads,
            mc.head_dim,
            model.dtype,
            model.device,
        )
        self.prefix = PrefixCache(self.pool, self.faults) if config.enable_prefix_caching else None
        self.allocator = PageAllocator(self.pool, self.prefix, self.faults)
        self.fence = Fence(self.pool, enabled=config.isolation)
        self.scheduler = Scheduler(
            self.allocator,
            self.prefix,
            self.events,
            self.faults,
            config.max_num_seqs,
            config.max_num_batched_tokens,
        )
        self.runner = ModelRunner(model, self.pool, self.fence, self.faults)
        if config.trace_pages:
            self.runner.observer = PageTrace(self.pool, self.events, self.allocator.tenant_name)
        self.requests: dict[str, Request] = {}
        self._decoders: dict[str, IncrementalDecoder] = {}
        self._ids = itertools.count()
        self.stop_token_ids = tokenizer.stop_token_ids if tokenizer else set()
        self.num_steps = 0
        self.integrity_aborts: Counter[str] = Counter()  # by reason, whatever path caught it

    # ---- admission -------------------------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tenant: str = "default",
        request_id: str | None = None,
        prefill_only: bool = False,
    ) -> Request:
        """Admit a request or refuse it before any page is reserved (invariant 3).

        `prefill_only` (a prefill worker's request): compute the prompt's KV, then park the request with
        its pages for the transfer instead of sampling."""
        request = self._admit(prompt_token_ids, params, tenant, request_id)
        request.prefill_only = prefill_only
        self.scheduler.add(request)
        return request

    def reserve(
        self, prompt_token_ids: list[int], params: SamplingParams, tenant: str, request_id: str
    ) -> Request | None:
        """A decode worker's request: admit it and reserve pages for the KV of every prompt token but the
        last (the decode side computes that one and samples from it), then park it until the KV arrives.
        None when the pages are not free right now (nothing is then held)."""
        request = self._admit(prompt_token_ids, params, tenant, request_id)
        if not self.scheduler.reserve(request, len(prompt_token_ids) - 1):
            self._finish(request, Status.ABORTED, "no_free_pages")
            return None
        self.scheduler.park(request)
        return request

    def resume(self, request_id: str) -> None:
        """The decode side verified the transferred KV: the request believes its prompt but the last token
        is cached, and is scheduled next."""
        request = self.requests[request_id]
        request.num_computed_tokens = request.num_tokens - 1
        self.scheduler.resume(request)

    def finish_transfer(self, request_id: str) -> None:
        """The prefill side sent every page: its copy of the KV is no longer needed."""
        self._finish(self.requests[request_id], Status.FINISHED, "transferred")

    def drain(self, request_id: str, how: str) -> bool:
        return self.scheduler.drain(request_id, how)

    def _admit(
        self, prompt_token_ids: list[int], params: SamplingParams, tenant: str, request_id: str | None
    ) -> Request:
        request_id = request_id or f"req-{next(self._ids)}"
        assert request_id not in self.requests, f"duplicate request id {request_id}"
        request = Request(
            request_id,
            tenant,
            list(prompt_token_ids),
            params,
            MappingRecord(self.allocator.tenant_id(tenant)),
            generator=make_generator(params, self.model.device),
        )
        refusal = self._admission_refusal(request)
        if refusal is not None:
            self.scheduler.finish(request, Status.REJECTED, refusal.code)
            raise refusal
        self.requests[request_id] = request
        if self.tokenizer is not None:
            self._decoders[request_id] = IncrementalDecoder(self.tokenizer)
        self.events.emit(
            request_id,
            "admitted",
            tenant=tenant,
            prompt_tokens=len(prompt_token_ids),
            max_tokens=params.max_tokens,
        )
        return request

    def _admission_refusal(self, request: Request) -> AdmissionError | None:
        prompt, budget = len(request.prompt_token_ids), request.params.max_tokens
        if prompt == 0:
            return AdmissionError("empty_prompt", "the prompt is empty")
        total = prompt + budget
        return context_refusal(
            prompt,
            budget,
            [
                ("This model's maximum context length is", self.max_model_len, total),
                ("The KV pool holds", self.capacity.capacity_tokens, total),
            ],
        )

    # ---- the step loop ---------------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def abort(
        self, request_id: str, reason: str = "cancelled", quarantine: bool = False
    ) -> RequestOutput | None:
        """Abort a live request (None if unknown or already finished). `quarantine`: a transfer into its
        pages may still be in flight, so they stay blocked until `drain`."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        self._finish(request, Status.ABORTED, reason, quarantine)
        return self._snapshot(request, [], "")

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch.requests:
            return []
        self.num_steps += 1
        result = self.runner.execute(batch.requests, batch.num_new_tokens)
        outputs = []
        for request_id, reason in result.aborted.items():
            request = self.requests[request_id]
            self._finish(request, Status.ABORTED, reason)
            outputs.append(self._snapshot(request, [], ""))
        for request, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            if request.request_id in result.aborted:
                continue
            self._record_step(request, n)
            request.num_computed_tokens += n
            token = result.sampled.get(request.request_id)
            if token is not None:
                outputs.append(self._append_token(request, token))
            if request.is_finished:
                continue
            self.scheduler.publish_full_pages(request)
            if request.prefill_only and request.num_computed_tokens == request.num_tokens:
                self.scheduler.park(request)
                outputs.append(self._snapshot(request, [], ""))
        return outputs

    def safe_step(self) -> list[RequestOutput]:
        """`step()` for a serving loop: if it raises, every scheduled request is aborted (fail closed) and
        the loop can go on; requests whose KV is still being transferred are left alone."""
        try:
            return self.step()
        except Exception:
            log.exception("engine step failed; aborting every scheduled request")
            scheduled = list(self.scheduler.running) + list(self.scheduler.waiting)
            return [o for r in scheduled if (o := self.abort(r.request_id, "engine_error")) is not None]

    def _finish(self, request: Request, status: Status, reason: str, quarantine: bool = False) -> None:
        self.scheduler.finish(request, status, reason, quarantine)
        if status is Status.ABORTED and reason in INTEGRITY_REASONS:
            self.integrity_aborts[reason] += 1  # step validation, handoff checks and refused transfer writes
        del self.requests[request.request_id]
        self._decoders.pop(request.request_id, None)

    def _record_step(self, request: Request, n: int) -> None:
        """Every prefill chunk and the first decode step are on the record. Later decode steps repeat the
        first with one more token; the finish event's token count sums them up, so the trail stays small."""
        if n > 1 or len(request.output_token_ids) <= 1:
            pages = request.record.pages[: cdiv(request.num_computed_tokens + n, self.pool.page_size)]
            if self.fence.enabled:
                self.events.emit(request.request_id, "validated", pages=pages)
            self.events.emit(request.request_id, "step", tokens=n, position=request.num_computed_tokens)

    def _append_token(self, request: Request, token: int) -> RequestOutput:
        request.output_token_ids.append(token)
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        ending = self._ending(request, token)
        decoder = self._decoders.get(request.request_id)
        request.output_text += decoder.step(token, final=ending is not None) if decoder else ""
        reason = self._stop_string(request) or ending
        if reason is not None:
            self._finish(request, Status.FINISHED, reason)
        return self._snapshot(request, [token], self._new_text(request))

    @staticmethod
    def _new_text(request: Request) -> str:
        """Text not yet streamed. While running, the last len(longest stop)-1 characters are held back:
        they may be the start of a stop string, which must never reach the client."""
        end = len(request.output_text)
        if not request.is_finished and request.params.stop:
            end -= max(len(s) for s in request.params.stop) - 1
        if end <= request.num_streamed_chars:
            return ""
        text = request.output_text[request.num_streamed_chars : end]
        request.num_streamed_chars = end
        return text

    def _ending(self, request: Request, token: int) -> str | None:
        """Why `token`, just appended, is the request's last (EOS: "stop", budget or window: "length"), or
        None. Known before the token is decoded, so that the decoder can give out what it holds back."""
        if token in self.stop_token_ids and not request.params.ignore_eos:
            return "stop"
        if (
            len(request.output_token_ids) >= request.params.max_tokens
            or request.num_tokens >= self.max_model_len
        ):
            return "length"
        return None

    @staticmethod
    def _stop_string(request: Request) -> str | None:
        """A stop string appeared: the text is cut where it starts and the reason is "stop"."""
        for stop in request.params.stop:
            # A stop string can only start in text not yet streamed (see _new_text).
            cut = request.output_text.find(stop, request.num_streamed_chars)
            if cut != -1:
                request.output_text = request.output_text[:cut]
                return "stop"
        return None

    def _snapshot(self, request: Request, tokens: list[int], text: str) -> RequestOutput:
        return RequestOutput(
            request.request_id,
            tokens,
            text,
            request.is_finished,
            request.status,
            request.finish_reason,
            len(request.prompt_token_ids),
            len(request.output_token_ids),
        )

    # ---- offline use -----------------------------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], tenant: str = "default"
    ) -> list[Request]:
        """Run prompts to completion together (continuous batching); returns the finished requests.
        For offline use only: outputs of other requests stepped meanwhile are not delivered anywhere."""
        all_params = params if isinstance(params, list) else [params] * len(prompts)
        requests = [self.add_request(p, sp, tenant) for p, sp in zip(prompts, all_params, strict=True)]
        while not all(r.is_finished for r in requests):
            self.step()
        return requests

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
        for request in self.scheduler.running:
            assert request.status is Status.RUNNING and not request.is_finished


def load_engine(
    config: EngineConfig, events: EventLog | None = None, log: Callable[[str], None] = print
) -> LLMEngine:
    """Load the GGUF model and tokenizer named by `config` (default: packaged SmolLM2) and start."""
    from kvfence.model.gguf import load_gguf
    from kvfence.pins import default_model_path

    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    path = config.model or default_model_path()
    gguf = load_gguf(path, dtype=getattr(torch, config.dtype), device=config.device, progress=log)
    model = LlamaModel.from_gguf(gguf, config.decode_attention, config.decode_matmul)
    engine = LLMEngine(config, model, Tokenizer.from_gguf(gguf), events, log)
    engine.model_file = gguf.path
    return engine
