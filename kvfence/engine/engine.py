"""The engine: admission and the step.

`LLMEngine` is synchronous and single-threaded: one `step()` schedules a batch, runs it through the
fence and the model, and applies the results. Its parts are built by builder.py; text, stop rules and
snapshots are output.py's; `AsyncEngine` (async_engine.py) drives it from a thread. The prefill/decode
handoff extends it in disagg/handoff.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from kvfence.config import EngineConfig
from kvfence.engine.builder import build_parts
from kvfence.engine.drafter import SpecStats
from kvfence.engine.heap import map_large_buffers, return_freed_heap
from kvfence.engine.iteration import StepTokens
from kvfence.engine.output import OutputProcessor, RequestOutput
from kvfence.engine.runner import StepResult
from kvfence.engine.sampler import make_generator
from kvfence.engine.scheduler import Batch
from kvfence.grammar.compiler import RequestGrammar
from kvfence.model.tokenizer import Tokenizer
from kvfence.model.transformer import Transformer
from kvfence.request import Request, Status, fork_id
from kvfence.sampling import SamplingParams, TokenLogprobs
from kvfence.trail.events import EventLog
from kvfence.trail.reasons import INTEGRITY_REASONS
from kvfence.units import cdiv

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
DUPLICATE_REQUEST_ID = "duplicate_request_id"
FORKED = "forked"  # a parent's finish reason once its forks took over its pages (n > 1)
RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
log = logging.getLogger("kvfence.engine")


class AdmissionError(ValueError):
    """A request refused before any page was reserved. `code` is the OpenAI error code; `status` the HTTP
    status: 400 for a request that can never be served, 409 for an id a live request holds, 429 for a
    tenant over its queue, 503 for one that cannot be served right now."""

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


def duplicate_refusal(request_id: str) -> AdmissionError:
    """The refusal of a request whose id a live request holds: that request is left as it was."""
    return AdmissionError(DUPLICATE_REQUEST_ID, f"Request id {request_id!r} is held by a live request.", 409)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model: Transformer,
        tokenizer: Tokenizer | None = None,
        events: EventLog | None = None,
        log: Callable[[str], None] = print,
        model_file: Path | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.model_file = model_file  # the GGUF the weights came from, None for weights built in memory
        self.events = events or EventLog()
        parts = build_parts(config, model, self.events, log, model_file, tokenizer)
        self.capacity, self.max_model_len, self.faults = parts.capacity, parts.max_model_len, parts.faults
        self.pool, self.prefix, self.allocator, self.fence = (
            parts.pool,
            parts.prefix,
            parts.allocator,
            parts.fence,
        )
        self.kv_cache, self.scheduler, self.runner = parts.kv_cache, parts.scheduler, parts.runner
        self.outputs = OutputProcessor(tokenizer, self.max_model_len)
        self.runner.eos_ids = frozenset(self.outputs.stop_token_ids)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.integrity_aborts: Counter[str] = Counter()  # by reason, whatever path caught it
        # Prompt tokens the model computed (prefix-cache hits excluded) and tokens sampled, as vLLM's
        # throughput counts them (api/stats_log.py).
        self.prompt_tokens_computed = 0
        self.generation_tokens = 0
        self.spec_stats = SpecStats()
        self.step_tokens = StepTokens()  # tokens per step (iteration.py)

    # ---- admission -------------------------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tenant: str = "default",
        request_id: str | None = None,
        grammar: RequestGrammar | None = None,
        n: int = 1,
    ) -> Request:
        """Admit a request or refuse it before any page is reserved (invariant 3); beyond its tenant's
        queue limit, refuse it with 429 (the tenant floods: its own requests wait, nobody else's); with an
        id a live request holds (`_ids_in_use`), refuse it with 409, that request untouched.
        `grammar`: this request's own matcher (structured output), already compiled. `n` > 1: parallel
        sampling, the prompt computed once and forked into n requests `fork_id(request_id, i)`, each with
        its own copy of the matcher."""
        limit = self.config.max_waiting_per_tenant
        if limit is not None and self.scheduler.waiting.queued(tenant) >= limit:
            raise AdmissionError(
                RATE_LIMIT_EXCEEDED,
                f"Tenant {tenant!r} has {limit} requests waiting already; retry later.",
                429,
            )
        request = self._admit(prompt_token_ids, params, tenant, request_id, n)
        request.constrain(grammar)
        self.scheduler.add(request)
        return request

    def _admit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tenant: str,
        request_id: str | None,
        n: int = 1,
    ) -> Request:
        request_id = request_id or f"req-{next(self._ids)}"
        claimed = {request_id, *(fork_id(request_id, index) for index in range(n if n > 1 else 0))}
        held = claimed & self._ids_in_use()
        if held:
            # Refused before anything is made for it, and nothing goes on the record: the trail under that
            # id is the live request's.
            log.warning("refused a request whose id %r a live request holds", min(held))
            raise duplicate_refusal(min(held))
        request = Request(
            request_id,
            tenant,
            list(prompt_token_ids),
            params,
            self.kv_cache.new_record(tenant),
            generator=make_generator(params, self.model.device),
        )
        if n > 1:
            request.forks = [self._fork_of(request, index) for index in range(n)]
        refusal = self._admission_refusal(request)
        if refusal is not None:
            self.scheduler.finish(request, Status.REJECTED, refusal.code)
            raise refusal
        self.requests[request_id] = request
        self.outputs.start(request)
        self.events.emit(
            request_id,
            "admitted",
            tenant=tenant,
            prompt_tokens=len(prompt_token_ids),
            max_tokens=params.max_tokens,
        )
        return request

    def _ids_in_use(self) -> set[str]:
        """The ids a new request may not take: each live request's, the forks a live parent will start, the
        parent of a live fork (a decode worker ends the forks by their parent's id) and each quarantined
        request's (its pages wait under that id for `drain`)."""
        held = set(self.requests) | set(self.scheduler.quarantined)
        for request in self.requests.values():
            held.update(fork.request_id for fork in request.forks)
            if request.parent_id is not None:
                held.add(request.parent_id)
        return held

    def _fork_of(self, parent: Request, index: int) -> Request:
        """Fork `index` of a parent, not yet running: the same tenant and prompt, its own record and its own
        generator, seeded `seed + index` when the parent has a seed (so that every choice is reproducible,
        and choice 0 is what the same request with n=1 gives)."""
        params = parent.params
        if params.seed is not None:
            params = dataclasses.replace(params, seed=(params.seed + index) % 2**64)
        return Request(
            fork_id(parent.request_id, index),
            parent.tenant,
            list(parent.prompt_token_ids),
            params,
            self.kv_cache.new_record(parent.tenant),
            generator=make_generator(params, self.model.device),
            index=index,
            parent_id=parent.request_id,
        )

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
        ) or self._fork_refusal(request)

    def _fork_refusal(self, request: Request) -> AdmissionError | None:
        """Forks must fit the pool together: the prompt's full pages once, each fork's own pages (its copy
        of the partial page and what it generates), and the parent's partial page while it is copied."""
        n, page_size, config = len(request.forks), self.pool.page_size, self.config
        if n <= 1:
            return None
        # The forks run at once, as n of the tenant's requests: they must fit its running and page limits
        # too, or n would be a way around them.
        rows = min(config.max_num_seqs, config.max_running_per_tenant or config.max_num_seqs)
        if n > rows:
            message = f"n={n} exceeds the {rows} sequences a tenant may run at once"
            return AdmissionError("invalid_request_error", message)
        prompt, total = len(request.prompt_token_ids), request.num_tokens + request.params.max_tokens
        full, partial = divmod(prompt, page_size)
        own = cdiv(total, page_size) - full
        peak = full + max(n * own, n + 1 if partial else 0)
        pages = min(self.pool.num_pages, config.max_pages_per_tenant or self.pool.num_pages)
        if peak <= pages:
            return None
        message = (
            f"A tenant may hold {pages} KV pages. However, n={n} sequences of {total} tokens sharing "
            f"the prompt's full pages need {peak}."
        )
        return AdmissionError(CONTEXT_LENGTH_EXCEEDED, message)

    # ---- the step --------------------------------------------------------------------------------------

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
        return RequestOutput.of(request)

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        outputs = self._abort_refused(batch)
        if not batch.requests:
            return outputs
        self.num_steps += 1
        before = self.prompt_tokens_computed + self.generation_tokens
        result = self.runner.execute(batch.requests, batch.num_new_tokens)
        outputs += self._apply(batch, result)
        self.step_tokens.observe(self.prompt_tokens_computed + self.generation_tokens - before)
        return outputs

    def _abort_refused(self, batch: Batch) -> list[RequestOutput]:
        """Requests whose tier restore the fence refused at admission, or whose draft model's pages it
        refused while drafting, end here, aborted for integrity, out of the batch before any row runs."""
        refused = self.kv_cache.take_refused_restores()
        if self.scheduler.drafter is not None:
            refused |= self.scheduler.drafter.take_violations()
        batch.drop(refused)
        return [o for rid, reason in refused.items() if (o := self.abort(rid, reason)) is not None]

    def _apply(self, batch: Batch, result: StepResult) -> list[RequestOutput]:
        """The step's results, row by row: integrity aborts first, then each surviving row's tokens."""
        outputs = [r for rid, reason in result.aborted.items() if (r := self.abort(rid, reason)) is not None]
        for request in batch.requests:  # before the tokens: the first token's output carries them
            request.prompt_logprobs.update(result.prompt_logprobs.get(request.request_id, {}))
        parents = []
        for request, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            if request.request_id in result.aborted:
                continue
            self._record_step(request, n)
            prompt_left = len(request.prompt_token_ids) - request.num_computed_tokens
            self.prompt_tokens_computed += max(0, min(n, prompt_left))
            token = result.sampled.get(request.request_id)
            tokens = [] if token is None else [*result.accepted.get(request.request_id, ()), token]
            if request.draft_token_ids and token is not None:
                reason = self._settle_drafts(request, n, len(tokens) - 1)
                if reason is not None:
                    outputs.extend(o for o in [self.abort(request.request_id, reason)] if o is not None)
                    continue
                n = len(tokens)  # its last token and the drafts accepted: the KV it keeps
            request.num_computed_tokens += n
            # Before its tokens, which may finish it: the pages it filled are cached (and offered to the KV
            # tiers) even when this step is its last, as a one-token request's whole prompt is.
            self.kv_cache.publish_full_pages(request, min(request.num_computed_tokens, request.num_tokens))
            if tokens:
                outputs.append(self._append_tokens(request, tokens, result.logprobs.get(request.request_id)))
            if not request.is_finished:
                outputs.extend(self._after_compute(request))
                if request.forks and request.num_computed_tokens == request.num_tokens:
                    parents.append(request)
        # After every row is applied: making room for the copies may preempt a request of this batch, even
        # another parent (it then recomputes its prompt and forks later).
        for parent in parents:
            if parent.status is Status.RUNNING:
                outputs.extend(self._fork(parent, result))
        return outputs

    def _fork(self, parent: Request, result: StepResult) -> list[RequestOutput]:
        """The parent's prompt is computed and its forks sampled their first tokens: unless a fork's
        sampling failed or the fence finds the parent's pages no longer its own (then the parent is
        aborted, and no fork ever starts), the forks take over its pages and run, and the parent finishes
        ("forked"), dropping its own references: the shared pages live on while any fork holds them."""
        failed = (result.aborted.get(child.request_id) for child in parent.forks)
        reason = next((r for r in failed if r is not None), None)
        reason = reason or self.fence.check_record(parent.record, parent.num_computed_tokens)
        if reason is not None:
            output = self.abort(parent.request_id, reason)
            return [output] if output is not None else []
        self.scheduler.fork(parent)
        self._finish(parent, Status.FINISHED, FORKED)
        outputs = []
        for child in parent.forks:
            self.requests[child.request_id] = child
            self.outputs.start(child)
            child.prompt_logprobs = dict(parent.prompt_logprobs)  # computed once, for each first output
            outputs.append(
                self._append_tokens(
                    child, [result.sampled[child.request_id]], result.logprobs.get(child.request_id)
                )
            )
        return outputs

    def _after_compute(self, request: Request) -> list[RequestOutput]:
        """Hook for what a role does with a live request after a step computed some of its tokens (the
        prefill side parks a finished prompt for its transfer, disagg/handoff.py). Nothing here."""
        return []

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
        self.outputs.forget(request.request_id)

    def _record_step(self, request: Request, n: int) -> None:
        """Every prefill chunk and the first decode step are on the record. Later decode steps repeat the
        first with one more token; the finish event's token count sums them up, so the trail stays small."""
        if n > 1 + len(request.draft_token_ids) or len(request.output_token_ids) <= 1:
            pages = list(request.record.pages[: cdiv(request.num_computed_tokens + n, self.pool.page_size)])
            if self.fence.enabled:
                self.events.emit(request.request_id, "validated", pages=pages)
            self.events.emit(request.request_id, "step", tokens=n, position=request.num_computed_tokens)

    def _append_tokens(
        self, request: Request, tokens: list[int], logprobs: TokenLogprobs | None
    ) -> RequestOutput:
        """A step's tokens for one request, in order, until one ends it (the rest are dropped)."""
        taken = []
        for token in tokens:
            taken.append(token)
            reason = self.outputs.append(request, token, last=len(taken) == len(tokens))
            if reason is not None:
                self._finish(request, Status.FINISHED, reason)
                break
        self.generation_tokens += len(taken)
        return RequestOutput.of(
            request, taken, self.outputs.new_text(request), None if logprobs is None else [logprobs]
        )

    def _settle_drafts(self, request: Request, n: int, accepted: int) -> str | None:
        """After a verification of n positions kept 1 + `accepted`: take back the rest of what it wrote (the
        fence zeroes those slots and moves the pages' `written` back, the trail records it) and count it.
        The fence's violation when the tail is not the request's own to take back, else None."""
        drafted, keep = len(request.draft_token_ids), request.num_computed_tokens + 1 + accepted
        end = request.num_computed_tokens + n
        request.draft_token_ids, request.draft_tail = [], end - keep
        self.spec_stats.count(drafted, accepted)
        self.scheduler.draft_lengths.record(
            request.request_id, len(request.output_token_ids), drafted, accepted
        )
        if keep == end:
            return None
        size = self.pool.page_size
        pages = list(request.record.pages[keep // size : cdiv(end, size)])
        self.events.emit(
            request.request_id, "drafts_rolled_back", position=keep, slots=end - keep, pages=pages
        )
        return self.fence.roll_back(request.record, keep, end)

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
        self.kv_cache.check_integrity()
        for request in self.scheduler.running:
            assert request.status is Status.RUNNING and not request.is_finished


Engine = TypeVar("Engine", bound=LLMEngine)


def load_engine(
    config: EngineConfig,
    events: EventLog | None = None,
    log: Callable[[str], None] = print,
    engine_cls: type[Engine] = LLMEngine,  # type: ignore[assignment]
    chat_template: str | None = None,
) -> Engine:
    """Load the model and tokenizer named by `config` (a GGUF file or a Hugging Face directory; default:
    the packaged SmolLM2) and start an engine
    of `engine_cls` (a prefill or decode worker passes disagg's HandoffEngine); `chat_template` (jinja
    source, `--chat-template`) replaces the file's.

    The load runs on a thread of its own that has ended when this returns. Why: libgomp keeps a pool of
    OpenMP workers for every thread that ran a parallel region (packing the weights does), and while a
    second pool lives beside the one the engine thread steps with, there are more OpenMP threads than cores
    and libgomp cuts the spinning of both to a few hundred rounds, so every one of a step's hundreds of
    parallel regions wakes its workers through the kernel: SmolLM2 on 2 cores, a 5-row step took 15.1 ms
    after a load on the serving thread's parent, 9.4 ms after a load on a thread that ended."""
    loaded: list[Engine] = []
    failed: list[BaseException] = []

    def load() -> None:
        try:
            loaded.append(_load_engine(config, events, log, engine_cls, chat_template))
        except BaseException as exc:  # re-raised on the caller's thread, as if it had loaded there
            failed.append(exc)

    loader = threading.Thread(target=load, name="kvfence-load")
    loader.start()
    loader.join()
    if failed:
        raise failed[0]
    return loaded[0]


def _load_engine(
    config: EngineConfig,
    events: EventLog | None,
    log: Callable[[str], None],
    engine_cls: type[Engine],
    chat_template: str | None,
) -> Engine:
    from kvfence.model.hf_load import load_model
    from kvfence.pins import default_model_path

    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    map_large_buffers()
    path = config.model or default_model_path()
    device = config.device if config.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    # Graphs are captured on CUDA alone: elsewhere the flag would only add an unused scratch page.
    config = dataclasses.replace(config, decode_graphs=config.decode_graphs and device.startswith("cuda"))
    gguf = load_model(path, dtype=getattr(torch, config.dtype), device=device, progress=log)
    model = Transformer.from_gguf(
        gguf, config.decode_attention, config.decode_matmul, config.activation_dtype, progress=log
    )
    tokenizer = Tokenizer.from_gguf(gguf, chat_template)
    model_file = gguf.path
    del gguf  # the file's map and the loader's tensors: the model holds its packed copy
    return_freed_heap()
    return engine_cls(config, model, tokenizer, events, log, model_file=model_file)
