"""The serving console's two logs: vLLM's periodic stats line, and (`--enable-log-requests`) one line per
request at its arrival and one at its end.

Contracts:
- `StatsLogger.tick` writes one line per pool (`single`, or `prefill` and `decode`, each named) in vLLM's
  format (vllm/v1/metrics/loggers.py LoggingStatLogger): prompt tokens computed (prefix-cache hits
  excluded) and tokens generated per second over the interval since the last tick, requests running and
  waiting, the pool's pages held over all its pages, and the prefix cache's hit rate over every lookup
  since start. As vLLM, a line whose interval and the one before it saw no token is logged at DEBUG, not
  INFO: an idle server does not repeat itself. Time comes from the clock given (tests pass their own).
- `RequestLog` names a request by its id and tenant, never by its API key. A request's text is tenants'
  data: the prompt is logged only when the operator asked for it (`--log-request-prompts`), and a
  `cache_salt` never (it is a tenant's prefix-cache namespace).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Callable

from starlette.concurrency import run_in_threadpool

from kvfence.engine.engine import AdmissionError
from kvfence.engine.output import RequestOutput
from kvfence.engine.stats import EngineStats
from kvfence.model.tokenizer import Tokenizer
from kvfence.sampling import SamplingParams

STATS_INTERVAL_S = 10.0  # vLLM's
stats_log = logging.getLogger("kvfence.stats")
request_log = logging.getLogger("kvfence.requests")


def stats_line(prompt_per_s: float, generation_per_s: float, stats: EngineStats) -> str:
    """vLLM's stats line for one pool ("KV cache usage": the pool is wherever the engine runs)."""
    usage = stats.pages_held / stats.num_pages if stats.num_pages else 0.0
    queries = stats.prefix_query_tokens
    hit_rate = stats.prefix_hit_tokens / queries if queries else 0.0
    return (
        f"Avg prompt throughput: {prompt_per_s:.1f} tokens/s, "
        f"Avg generation throughput: {generation_per_s:.1f} tokens/s, "
        f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
        f"KV cache usage: {usage * 100:.1f}%, Prefix cache hit rate: {hit_rate * 100:.1f}%"
    )


@dataclasses.dataclass
class _Last:
    """A pool's counters at the previous tick, and whether that interval saw tokens."""

    prompt_tokens: int
    generation_tokens: int
    busy: bool = False


class StatsLogger:
    def __init__(
        self, read: Callable[[], dict[str, EngineStats]], clock: Callable[[], float] = time.monotonic
    ) -> None:
        """`read`: the pools' counters by role (EngineClient.stats: blocking)."""
        self._read, self._clock = read, clock
        self._since = clock()
        self._last: dict[str, _Last] = {}

    def tick(self) -> list[str]:
        """Log (and return) each pool's line for the interval since the previous tick."""
        now = self._clock()
        elapsed, self._since = now - self._since, now
        pools = {role: s for role, s in self._read().items() if s.num_pages}  # the router has no pool
        lines = []
        for role, stats in pools.items():
            last = self._last.get(role) or _Last(0, 0)
            prompt = stats.prompt_tokens_computed - last.prompt_tokens
            generated = stats.generation_tokens - last.generation_tokens
            busy = bool(prompt or generated)
            rate = 1 / elapsed if elapsed > 0 else 0.0
            line = stats_line(prompt * rate, generated * rate, stats)
            line = line if len(pools) == 1 else f"{role}: {line}"
            stats_log.log(logging.INFO if busy or last.busy else logging.DEBUG, "%s", line)
            self._last[role] = _Last(stats.prompt_tokens_computed, stats.generation_tokens, busy)
            lines.append(line)
        return lines

    async def run(self, interval_s: float = STATS_INTERVAL_S) -> None:
        """Tick every `interval_s` until cancelled; a failed read (an engine stuck past the stats timeout) is
        a warning, and the next tick tries again."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await run_in_threadpool(self.tick)
            except Exception:
                stats_log.warning("could not read the engine's stats", exc_info=True)


class RequestLog:
    def __init__(self, tokenizer: Tokenizer | None, with_prompts: bool = False) -> None:
        """`with_prompts`: the prompt's text too (decoded from its tokens, special tokens kept)."""
        self.tokenizer, self.with_prompts = tokenizer, with_prompts

    def arrived(self, request_id: str, tenant: str, prompt: list[int], params: SamplingParams) -> None:
        shown = dataclasses.replace(params, cache_salt="<set>") if params.cache_salt else params
        text = ""
        if self.with_prompts and self.tokenizer is not None:
            text = f", prompt: {self.tokenizer.decode(prompt, skip_special_tokens=False)!r}"
        request_log.info(
            "Received request %s: tenant: %s, prompt tokens: %d, params: %s%s",
            request_id,
            tenant,
            len(prompt),
            shown,
            text,
        )

    async def follow(
        self, request_id: str, outputs: AsyncGenerator[RequestOutput, None]
    ) -> AsyncGenerator[RequestOutput, None]:
        """Pass `outputs` through (closing this closes them) and log how the request ended: each choice's
        finish reason and tokens, its refusal, or that it was left before it finished."""
        last: dict[str, RequestOutput] = {}  # by request id: one per fork with n > 1
        try:
            async with contextlib.aclosing(outputs):
                async for output in outputs:
                    last[output.request_id] = output
                    yield output
        except AdmissionError as exc:
            request_log.info("Refused request %s: %s", request_id, exc.code)
            raise
        finally:
            self._finished(request_id, list(last.values()))

    def _finished(self, request_id: str, last: list[RequestOutput]) -> None:
        if not last:
            return
        ended = ", ".join(
            f"{o.finish_reason if o.finished else 'left unfinished'} after {o.completion_tokens} tokens"
            for o in sorted(last, key=lambda o: o.index)
        )
        request_log.info(
            "Finished request %s: %s (prompt tokens: %d)", request_id, ended, last[0].prompt_tokens
        )


def log_to_stderr() -> None:
    """Both logs on stderr at INFO, timestamped (`kvfence serve`; nothing else configures logging there)."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s"))
    for logger in (stats_log, request_log):
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)
        logger.propagate = False
