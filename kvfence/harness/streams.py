"""Streaming completions against any OpenAI-compatible server, timed: what the side-by-side benchmarks
measure kvfence and its peers with (bench/disagg.py, bench/vs_llama.py).

Contract: `stream_one` sends one `/v1/completions` request for a prompt of token ids with `ignore_eos`, so
the answer has exactly `max_tokens` tokens, and times it from the call to its first and last content
chunk; `drive` runs a list of prompts with at most `concurrency` in flight and returns every timing and
the wall time. A stream that errs or comes back short raises (a benchmark never counts a broken answer).
Tokens are counted from the final usage where the server reports one, else one per content chunk.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvfence.harness.sse import aiter_events


@dataclass(frozen=True)
class Timing:
    """Seconds from the request's send: to its first content chunk, between its chunks after the first
    (mean), to its last one; and its output tokens."""

    request_id: str
    ttft: float
    tpot: float
    latency: float
    tokens: int


@dataclass(frozen=True)
class Sampling:
    """What each request asks: greedy (temperature 0) or sampled; `extra` fields as they are."""

    temperature: float = 0.0
    top_p: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)

    def fields(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, **self.extra}


GREEDY = Sampling()


async def stream_one(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: list[int],
    max_tokens: int,
    sampling: Sampling = GREEDY,
) -> Timing:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **sampling.fields(),
    }
    started = time.monotonic()
    first = last = None
    chunks = usage = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        request_id = response.headers.get("x-request-id", "")
        async for chunk in aiter_events(response.aiter_lines()):
            if "error" in chunk:
                raise RuntimeError(f"{request_id} aborted: {chunk['error']}")
            request_id = request_id or str(chunk.get("id", ""))
            usage = (chunk.get("usage") or {}).get("completion_tokens", usage)
            if any(choice.get("text") for choice in chunk.get("choices") or []):
                first = first or time.monotonic()
                last = time.monotonic()
                chunks += 1
    tokens = usage or chunks
    if first is None or last is None or tokens != max_tokens:
        raise RuntimeError(f"{request_id}: {tokens} tokens of {max_tokens}")
    return Timing(request_id, first - started, (last - first) / max(tokens - 1, 1), last - started, tokens)


async def drive(
    url: str,
    model: str,
    prompts: list[list[int]],
    max_tokens: int,
    concurrency: int,
    sampling: Sampling = GREEDY,
    headers: dict[str, str] | None = None,
) -> tuple[list[Timing], float]:
    """Every prompt, at most `concurrency` in flight; returns the timings and the wall time."""
    gate = asyncio.Semaphore(concurrency)
    # A connection per request: a kept-alive one the server closed while idle (llama-server's keep-alive
    # is 5 s) fails the next request on it with "disconnected without sending a response".
    fresh = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), headers=headers, limits=fresh) as client:

        async def one(prompt: list[int]) -> Timing:
            async with gate:
                return await stream_one(client, url, model, prompt, max_tokens, sampling)

        started = time.monotonic()
        done = await asyncio.gather(*(one(p) for p in prompts))
        return list(done), time.monotonic() - started
