"""The hooks into vLLM 0.32's v1 engine, installed by `register()` in every vLLM process (idempotent).

Scheduler process (vLLM's EngineCore):
- `BlockPool`: tags (tags.py) on its blocks; `get_new_blocks`, `touch` and `free_blocks` bump them.
- `Scheduler.__init__`: refuses anything but one full-attention KV cache group, async scheduling and
  pipeline parallelism (a step scheduled before the last one's output is read) and a KV connector (KV no
  step of this engine wrote);
  creates the records.
- `KVCacheManager.free` / `pop_blocks_for_free`: the request's record is forgotten (finish, preemption).
- `Scheduler.schedule`: after vLLM's own schedule, the records of every scheduled request are synced and
  judged (records.py); the plan rides on the SchedulerOutput as `kvfence_plan` (None with the fence off).
- `Scheduler.update_from_output`: the step ran, so the records' written lengths advance (less the drafts
  vLLM rejected), before vLLM frees the finished requests' blocks; the condemned requests' sampled tokens
  are dropped before vLLM reads them, and the requests go to vLLM's own finish-with-error path
  (FinishReason.ERROR), one warning line each, their error outputs marked with the reason (aborts.py); the
  rest of the batch is untouched.
API server:
- `init_entrypoints_middleware` (as vLLM's app module calls it): TenantSalt is added outermost where
  tenant keys are known (tenants.py), so every request's cache_salt is its tenant's; and the handler
  that answers a `FenceAbort` with a 500 `kv_integrity_error`.
- `OutputProcessor.process_outputs` notes the marked outputs' requests; `GenerateBaseServing`'s error
  check raises `FenceAbort` for them, and its stream error event is typed `kv_integrity_error` (aborts.py).
Worker (GPUModelRunner, which the CPU runner is):
- `_update_states`: once vLLM has brought its persistent block table and start positions up to the step,
  the faults (if armed: faults.py) move one decoding request's start a block ahead or swap two running
  rows, then every planned row and start is checked (rows.py `judge`); a condemned row is pointed at the
  null block before `_prepare_inputs` builds the slot mapping, so it reads and writes no one's KV.
- `sample_tokens`: the worker's verdict rides on the ModelRunnerOutput as `kvfence_verdict`, and the
  seconds its hooks took as `kvfence_seconds`.
The plan, the verdict and the seconds are attributes on vLLM's own objects, which vLLM's executor carries
between its processes itself (the CPU build's multiprocessing executor pickles both objects whole over its
shared-memory queues: tested with one worker); no new channel is opened. Every STATS_EVERY steps the
scheduler logs the fence's cost (stats.py).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from kvfence_vllm.aborts import INTEGRITY_ERROR, FencedRequests, error_body, mark_outputs, message
from kvfence_vllm.faults import WorkerFaults
from kvfence_vllm.records import SchedulerRecords, StepPlan
from kvfence_vllm.rows import judge, neutralise
from kvfence_vllm.settings import INFLATE, SWAP, PluginRefused, Settings, check_engine
from kvfence_vllm.tags import BlockTags
from kvfence_vllm.tenants import TenantSalt, tenant_keys

log = logging.getLogger("vllm.kvfence")  # under vLLM's logger, so its handlers print it
STATS_EVERY = 128  # steps between the fence's cost lines (bench/vllm_fence_overhead.py reads the last)
_installed: list[Settings] = []
_fenced = FencedRequests()  # the API server's: requests the fence ended, until their serving asks


def install(settings: Settings) -> None:
    if _installed:
        return
    _installed.append(settings)
    from vllm.entrypoints.launchers import app
    from vllm.v1.core import block_pool, kv_cache_manager
    from vllm.v1.core.sched import scheduler
    from vllm.v1.worker import gpu_model_runner

    _patch_block_pool(block_pool.BlockPool)
    _patch_manager(kv_cache_manager.KVCacheManager)
    _patch_scheduler(scheduler.Scheduler, settings)
    _patch_runner(gpu_model_runner.GPUModelRunner, settings)
    abort = _patch_api_errors()
    _patch_front(app, abort)


def _wrap(cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(cls, name)
    setattr(cls, name, functools.wraps(original)(make(original)))


def _patch_block_pool(cls: type) -> None:
    def init(original: Callable[..., None]) -> Callable[..., None]:
        def run(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            self.kvfence_tags = BlockTags(self.num_gpu_blocks)

        return run

    def get_new_blocks(original: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
        def run(self: Any, num_blocks: int) -> list[Any]:
            blocks = original(self, num_blocks)
            self.kvfence_tags.handed_out([b.block_id for b in blocks])
            return blocks

        return run

    def touch(original: Callable[..., None]) -> Callable[..., None]:
        def run(self: Any, blocks: Any) -> None:
            revived = [b.block_id for b in blocks if b.ref_cnt == 0 and not b.is_null]
            original(self, blocks)
            self.kvfence_tags.revived(revived)

        return run

    def free_blocks(original: Callable[..., None]) -> Callable[..., None]:
        def run(self: Any, ordered_blocks: Any) -> None:
            blocks = list(ordered_blocks)  # may be a generator: read twice
            original(self, blocks)
            mine = [b for b in blocks if b.pool is None or b.pool is self]  # others' pools tag their own
            self.kvfence_tags.freed([b.block_id for b in mine if b.ref_cnt == 0 and not b.is_null])

        return run

    _wrap(cls, "__init__", init)
    _wrap(cls, "get_new_blocks", get_new_blocks)
    _wrap(cls, "touch", touch)
    _wrap(cls, "free_blocks", free_blocks)


def _patch_manager(cls: type) -> None:
    def forgetting(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, request: Any) -> Any:
            result = original(self, request)
            records = getattr(self, "kvfence_records", None)
            if records is not None:
                records.forget(request.request_id)
            return result

        return run

    _wrap(cls, "free", forgetting)
    _wrap(cls, "pop_blocks_for_free", forgetting)


def _patch_scheduler(cls: type, settings: Settings) -> None:
    from vllm.v1.engine import FinishReason

    def init(original: Callable[..., None]) -> Callable[..., None]:
        def run(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            groups = self.kv_cache_config.kv_cache_groups
            try:
                check_engine(
                    [type(g.kv_cache_spec).__name__ for g in groups],
                    self.scheduler_config.async_scheduling,
                    self.use_pp,
                    self.connector is not None,
                )
            except PluginRefused as refused:
                raise SystemExit(str(refused)) from None
            manager = self.kv_cache_manager
            manager.kvfence_records = SchedulerRecords(
                manager.block_pool.kvfence_tags, groups[0].kv_cache_spec.block_size
            )
            block_size, blocks = groups[0].kv_cache_spec.block_size, manager.block_pool.num_gpu_blocks
            # The pool vs the window: vLLM refused at start a pool that cannot hold one request's window
            # (its check_enough_kv_cache_memory, the null block set aside); this line says what was kept.
            log.info(
                "kvfence-vllm: %d blocks of %d tokens tagged (%d tokens besides the null block) for a window "
                "of %d tokens, fence %s",
                blocks,
                block_size,
                (blocks - 1) * block_size,
                self.max_model_len,
                _mode(settings),
            )

        return run

    def schedule(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            records: SchedulerRecords = self.kv_cache_manager.kvfence_records
            records.stats.start_step()
            output = original(self, *args, **kwargs)
            started = time.perf_counter()
            manager, requests = self.kv_cache_manager, self.requests
            scheduled = [
                (req_id, requests[req_id].cache_salt or "", manager.get_block_ids(req_id)[0], count)
                for req_id, count in output.num_scheduled_tokens.items()
            ]
            plan = records.plan(scheduled)  # records are kept (and tags claimed) with the fence off too
            output.kvfence_plan = plan if settings.fence else None
            # For update_from_output, fence on or off; one step at a time (no async scheduling, no PP).
            records.in_flight = {id(output): plan}
            records.stats.scheduler_s += time.perf_counter() - started
            return output

        return run

    def update_from_output(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
            records: SchedulerRecords = self.kv_cache_manager.kvfence_records
            plan: StepPlan | None = getattr(scheduler_output, "kvfence_plan", None)
            verdict = dict(plan.condemned) if plan is not None else {}
            verdict.update(getattr(model_runner_output, "kvfence_verdict", {}))
            ran = records.in_flight.pop(id(scheduler_output), None)
            if ran is not None and hasattr(model_runner_output, "req_id_to_index"):
                rejected = _rejected(scheduler_output, model_runner_output, self.num_sampled_tokens_per_step)
                records.commit(ran, rejected, verdict)
            for req_id, reason in verdict.items():
                index = model_runner_output.req_id_to_index.get(req_id)
                if index is not None and index < len(model_runner_output.sampled_token_ids):
                    model_runner_output.sampled_token_ids[index] = []  # never a token from the wrong KV
                log.warning("kvfence-vllm: aborted request %s: %s", req_id, reason)
            # vLLM's own path for a request that must end in an error (FINISHED_ERROR, never resumed).
            self.encoder_cache_mismatch_reqs.update(r for r in verdict if r in self.requests)
            stats = records.stats
            if stats.end_step(getattr(model_runner_output, "kvfence_seconds", 0.0)) % STATS_EVERY == 0:
                log.info("kvfence-vllm: %s", stats.line())
            outputs = original(self, scheduler_output, model_runner_output)
            if verdict:
                for client in outputs.values():
                    mark_outputs(client.outputs, verdict, FinishReason.ERROR)
            return outputs

        return run

    _wrap(cls, "__init__", init)
    _wrap(cls, "schedule", schedule)
    _wrap(cls, "update_from_output", update_from_output)


def _patch_runner(cls: type, settings: Settings) -> None:
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    faults = WorkerFaults(settings)

    def update_states(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, scheduler_output: Any) -> Any:
            deferred = original(self, scheduler_output)
            started = time.perf_counter()
            batch = self.input_batch
            table = batch.block_table[0]
            faults.inject(batch, scheduler_output.num_scheduled_tokens, self.max_model_len)
            plan: StepPlan | None = getattr(scheduler_output, "kvfence_plan", None)
            if plan is not None:
                array, lengths = table.block_table.np, table.num_blocks_per_row
                verdict = judge(plan, batch.req_id_to_index, array, lengths, batch.num_computed_tokens_cpu)
                neutralise(array, [batch.req_id_to_index[r] for r in verdict if r in batch.req_id_to_index])
                self.kvfence_verdict = verdict
            self.kvfence_seconds = time.perf_counter() - started
            return deferred

        return run

    def sample_tokens(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            output = original(self, *args, **kwargs)
            verdict = getattr(self, "kvfence_verdict", None)
            if hasattr(output, "req_id_to_index") and output is not EMPTY_MODEL_RUNNER_OUTPUT:
                output.kvfence_seconds = getattr(self, "kvfence_seconds", 0.0)
                if verdict:
                    output.kvfence_verdict = verdict
            self.kvfence_verdict, self.kvfence_seconds = None, 0.0
            return output

        return run

    _wrap(cls, "_update_states", update_states)
    _wrap(cls, "sample_tokens", sample_tokens)


def _patch_api_errors() -> type[Exception]:
    """The API server's side of a fence abort (aborts.py); returns the exception its serving raises."""
    from vllm.entrypoints.generate.base.serving import GenerateBaseServing
    from vllm.exceptions import GenerationError
    from vllm.v1.engine import FinishReason
    from vllm.v1.engine.output_processor import OutputProcessor

    class FenceAbort(GenerationError):
        """A request the fence ended: answered as a 500 kv_integrity_error."""

    def process_outputs(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, engine_core_outputs: Any, *args: Any, **kwargs: Any) -> Any:
            for output in engine_core_outputs:
                state = self.request_states.get(output.request_id)
                if state is not None and output.finish_reason == FinishReason.ERROR:
                    _fenced.note(state.external_req_id, output.stop_reason)
            return original(self, engine_core_outputs, *args, **kwargs)

        return run

    def raise_if_error(original: Callable[..., None]) -> Callable[..., None]:
        def run(self: Any, finish_reason: str | None, request_id: str) -> None:
            reason = _fenced.take(request_id) if finish_reason == "error" else None
            if reason is not None:
                raise FenceAbort(message(reason))
            original(self, finish_reason, request_id)

        return run

    def streaming_error(original: Callable[..., str]) -> Callable[..., str]:
        def run(self: Any, error: Exception) -> str:
            if isinstance(error, FenceAbort):
                return self.create_streaming_error_response(str(error), INTEGRITY_ERROR, error.status_code)
            return original(self, error)

        return run

    _wrap(OutputProcessor, "process_outputs", process_outputs)
    _wrap(GenerateBaseServing, "_raise_if_error", raise_if_error)
    _wrap(GenerateBaseServing, "_convert_generation_error_to_streaming_response", streaming_error)
    return FenceAbort


def _patch_front(app: Any, abort: type[Exception]) -> None:
    """The API server: TenantSalt outside vLLM's own middleware (tenants.py), where keys are known, and
    the handler for the fence's aborts (more specific than vLLM's own for its GenerationError)."""
    from starlette.responses import JSONResponse

    async def aborted(_: Any, error: Exception) -> JSONResponse:
        return JSONResponse(error_body(str(error), INTEGRITY_ERROR, 500), status_code=500)

    original = app.init_entrypoints_middleware

    @functools.wraps(original)
    def run(args: Any, fastapi_app: Any, *rest: Any, **kwargs: Any) -> Any:
        result = original(args, fastapi_app, *rest, **kwargs)
        try:
            keys = tenant_keys(getattr(args, "api_key", None), os.environ)
        except PluginRefused as refused:
            raise SystemExit(str(refused)) from None
        if keys:
            fastapi_app.add_middleware(TenantSalt, keys=keys)
        fastapi_app.add_exception_handler(abort, aborted)
        log.info(
            "kvfence-vllm: %d tenant keys, cache_salt %s", len(keys), "per tenant" if keys else "the client's"
        )
        return result

    app.init_entrypoints_middleware = run


def _rejected(scheduler_output: Any, runner_output: Any, sampled_per_step: int) -> dict[str, int]:
    """Draft tokens each request's step wrote but vLLM rejected, as its update_from_output counts them
    (it rolls num_computed_tokens back by as many)."""
    rejected = {}
    for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
        index = runner_output.req_id_to_index.get(req_id)
        sampled = runner_output.sampled_token_ids
        generated = sampled[index] if sampled and index is not None and index < len(sampled) else []
        if drafts and (generated or sampled_per_step == 0):
            rejected[req_id] = len(drafts) - max(len(generated) - sampled_per_step, 0)
    return rejected


def _mode(settings: Settings) -> str:
    faults = [
        f"{name}:{p}"
        for name, p in ((SWAP, settings.swap_probability), (INFLATE, settings.inflate_probability))
        if p
    ]
    return ("on" if settings.fence else "off") + (f", faults {','.join(faults)}" if faults else "")


__all__ = ["PluginRefused", "install"]
