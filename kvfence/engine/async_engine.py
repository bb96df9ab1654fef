"""Drives an LLMEngine from one background thread for an asyncio server.

Contract: every touch of engine state (admission, abort, step) happens on the engine thread; callers hand
it closures through a queue. Outputs travel back as immutable RequestOutput snapshots on one asyncio
queue per request. If a step raises, every in-flight request is aborted (fail closed) and the loop goes on.
Embeddings (engine/embedding.py) run on the same thread, one chunk between two steps, one prompt at a time
(first come, first served across requests), beside the pool and the scheduler, never through them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, runtime_checkable

import torch

from kvfence.engine.embedding import EmbeddingJob
from kvfence.engine.engine import LLMEngine
from kvfence.engine.heap import return_freed_heap
from kvfence.engine.info import engine_info
from kvfence.engine.output import RequestOutput
from kvfence.engine.stats import EngineStats
from kvfence.grammar.compiler import RequestGrammar
from kvfence.model.tokenizer import Tokenizer
from kvfence.request import fork_id
from kvfence.sampling import SamplingParams

log = logging.getLogger("kvfence.engine")
STATS_TIMEOUT_S = 10.0  # a stats or audit read fails rather than hangs when the engine is stuck


class EngineClient(Protocol):
    """What the HTTP server needs from whatever generates: a local engine thread (AsyncEngine) or a router
    in front of prefill and decode workers (disagg.router.Router)."""

    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int

    def start(self) -> None: ...

    def shutdown(self) -> None: ...

    @property
    def alive(self) -> bool:
        """Whether the thread that serves requests runs (/health answers 503 when it does not)."""
        ...

    def health(self) -> dict[str, Any]:
        """What /health adds to its status (never blocking): a router's workers and their states."""
        ...

    def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, tenant: str, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """A client that constrains decoding also takes `grammar: RequestGrammar | None` and sets
        `supports_grammar = True`; one that samples n > 1 choices from one prompt takes `n` and sets
        `supports_parallel_sampling = True` (the API refuses each where it is not set). The single node
        and the disaggregated router both do."""
        ...

    def stats(self) -> dict[str, EngineStats]:
        """Pool and fence counters by role: `single`, or `prefill` and `decode` (and the `router`'s dropped
        frames, without a pool). Blocking; call it off the event loop."""
        ...

    def audit_events(self, request_id: str) -> list[dict[str, Any]]:
        """The request's audit trail, empty when unknown (blocking)."""
        ...

    def info(self) -> dict[str, Any]:
        """What pins the service: mode, window and, per pool, engine_info (blocking: may hash the model)."""
        ...


@runtime_checkable
class Embedder(Protocol):
    """What /v1/embeddings needs besides an EngineClient: a local engine thread has it, the router does not
    (the API refuses embeddings there)."""

    embedding_size: int  # the vector's length: the model's hidden size

    async def embed(self, prompt_token_ids: list[int]) -> torch.Tensor:
        """The prompt's embedding, float32 [embedding_size] (engine/embedding.py)."""
        ...


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        assert engine.tokenizer is not None, "serving needs the model's tokenizer"
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model.config.vocab_size
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput]]] = {}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvfence-engine", daemon=True)
        self.embedding_size = engine.model.config.hidden_size
        self._embedding = asyncio.Lock()  # one prompt's scratch K/V at a time; waiters served in order

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def health(self) -> dict[str, Any]:
        return {}

    def shutdown(self) -> None:
        self._stopped.set()
        self._commands.put(lambda: None)
        self._thread.join(timeout=10)

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run `fn` on the engine thread between steps; the future holds its result or exception."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            # A caller that went away first (its task cancelled) cancelled the future: `fn` is not run, and
            # setting a cancelled future's result would raise here and end the engine thread.
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the caller, who decides
                future.set_exception(exc)

        self._commands.put(run)
        return future

    supports_grammar = True
    supports_logprobs = True  # outputs carry logprobs (the router's too)
    supports_prompt_logprobs = True  # the first output carries the prompt's (the router's do not)
    supports_parallel_sampling = True  # generate takes n > 1 (the router's does not: refused there)

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tenant: str,
        request_id: str,
        grammar: RequestGrammar | None = None,
        n: int = 1,
    ) -> AsyncIterator[RequestOutput]:
        """Admit the request (AdmissionError propagates) and yield its outputs until it finishes.
        Leaving the iterator early (client gone, task cancelled) aborts the request and frees its pages.
        With n > 1 the outputs are its forks' (`index` tells them apart), until all n finished or the
        parent was aborted before forking; leaving early aborts every fork still running. A request refused
        (an id a live request holds, say) leaves every other request and its stream as they were."""
        stream: asyncio.Queue[RequestOutput] = asyncio.Queue()
        target = (asyncio.get_running_loop(), stream)
        ids = [request_id, *(fork_id(request_id, i) for i in range(n if n > 1 else 0))]

        def admit() -> None:
            self.engine.add_request(prompt_token_ids, params, tenant, request_id, grammar, n=n)
            # Only once admitted, and on the engine thread before its next step: no output is missed, and
            # a refused request never takes the stream of the live request whose id it carries.
            for stream_id in ids:
                self._streams[stream_id] = target

        try:
            await asyncio.wrap_future(self.call(admit))
            running = n
            while True:
                output = await stream.get()
                yield output
                if output.finished:
                    running -= 1
                    if output.request_id == request_id or running == 0:
                        return
        finally:
            # Queued after `admit`, so it runs after it even when this caller left before admission.
            self.call(lambda: self._release(ids, target))

    async def embed(self, prompt_token_ids: list[int]) -> torch.Tensor:
        """The prompt's embedding (engine/embedding.py): float32 [embedding_size], unit norm. Its chunks of
        at most `max_num_batched_tokens` tokens run on the engine thread, between steps; prompts wait for
        each other in arrival order, so a request of many inputs takes turns with the others'."""
        job = EmbeddingJob(self.engine.model, prompt_token_ids, self.engine.scheduler.max_num_batched_tokens)
        async with self._embedding:
            while not await asyncio.wrap_future(self.call(job.step)):
                pass
        assert job.vector is not None
        return job.vector

    def stats(self) -> dict[str, EngineStats]:
        return {"single": self.call(lambda: EngineStats.read(self.engine)).result(timeout=STATS_TIMEOUT_S)}

    def audit_events(self, request_id: str) -> list[dict[str, Any]]:
        return self.engine.events.for_request(request_id)

    def info(self) -> dict[str, Any]:
        return {
            "mode": "single",
            "max_model_len": self.max_model_len,
            "pools": {"single": engine_info(self.engine)},
        }

    def _release(self, ids: list[str], target: tuple[asyncio.AbstractEventLoop, Any]) -> None:
        """On the engine thread: a caller's streams closed and what of its request still runs aborted; an
        id whose stream is another caller's (or nobody's: refused) is left alone."""
        for stream_id in ids:
            if self._streams.get(stream_id) is target:
                del self._streams[stream_id]
                self.engine.abort(stream_id, "client_disconnected")

    def _loop(self) -> None:
        while not self._stopped.is_set():
            self._run_commands(block=not self.engine.has_unfinished())
            if self.engine.has_unfinished():
                self._dispatch(self.engine.safe_step())
                if not self.engine.has_unfinished():
                    return_freed_heap()  # once a burst ends; its last outputs are already on their way

    def _run_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            command()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            target = self._streams.get(output.request_id)
            if target is not None:
                loop, stream = target
                if not loop.is_closed():  # a stream whose loop is gone has nobody left to tell
                    loop.call_soon_threadsafe(stream.put_nowait, output)
