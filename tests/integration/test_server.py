"""The OpenAI-compatible server end to end: the real SmolLM2 behind a real uvicorn on a free port, driven by
the official `openai` client (and by httpx where a test needs headers, raw bodies or a dropped connection).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from conftest import real_engine, serving
from openai.types.chat import ChatCompletion

from kvfence.api.responses import EngineStreamResponse
from kvfence.api.server import build_app
from kvfence.engine.async_engine import AsyncEngine
from kvfence.harness.server import metric
from kvfence.model.gguf import GGUFModel
from kvfence.sampling import SamplingParams

pytestmark = pytest.mark.real_model

MODEL = "smollm2-test"
ADMIN_KEY = "admin-secret"
API_KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}
# A prompt whose greedy answer is longer than 16 tokens, so max_tokens ends it ("length").
STORY = [{"role": "user", "content": "Write a long story about a dragon who learns to paint."}]


@dataclass
class Server:
    engine: AsyncEngine
    url: str

    def client(self, key: str = "key-a") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60)

    def http(
        self,
        method: str,
        path: str,
        key: str | None = "key-a",
        headers: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        auth = {"authorization": f"Bearer {key}"} if key else {}
        headers = auth | (headers or {})
        return httpx.request(method, f"{self.url}{path}", headers=headers, timeout=60, **kwargs)

    def audit_kinds(self, request_id: str) -> list[str]:
        response = self.http("GET", f"/v1/audit/requests/{request_id}", key=ADMIN_KEY)
        assert response.status_code == 200, response.text
        return [event["kind"] for event in response.json()["events"]]

    def on_engine(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread (the only thread that may touch engine state)."""
        return self.engine.call(fn).result(timeout=120)

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        return metric(self.url, name, labels, ADMIN_KEY)


@pytest.fixture(scope="module")
def server(smollm2: GGUFModel) -> Iterator[Server]:
    engine = AsyncEngine(real_engine(smollm2, num_pages=64, max_model_len=512))
    with serving(build_app(engine, MODEL, API_KEYS, ADMIN_KEY)) as url:
        yield Server(engine, url)


@pytest.fixture(scope="module")
def story(server: Server) -> ChatCompletion:
    """One greedy chat completion, shared by the tests that compare against it. `user` names another
    tenant: it must not change the request's tenant (invariant 7)."""
    return server.client().chat.completions.create(
        model=MODEL, messages=STORY, max_tokens=16, temperature=0, user="tenant-b"
    )


def chat_prompt(server: Server, messages: list[dict[str, str]]) -> list[int]:
    tokenizer = server.engine.engine.tokenizer
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def test_health_and_models(server: Server) -> None:
    assert server.http("GET", "/health", key=None).json() == {"status": "ok"}
    assert [m.id for m in server.client().models.list()] == [MODEL]


def test_chat_completion_matches_offline_engine(server: Server, story: ChatCompletion) -> None:
    prompt = chat_prompt(server, STORY)
    choice = story.choices[0]
    assert story.id.startswith("chatcmpl-") and choice.message.role == "assistant"
    assert choice.message.content and choice.finish_reason == "length"
    assert story.usage is not None
    assert (story.usage.prompt_tokens, story.usage.completion_tokens) == (len(prompt), 16)
    assert story.usage.total_tokens == len(prompt) + 16
    # Nothing else is in flight, so running a whole offline generation on the engine thread is safe.
    engine = server.engine.engine
    offline = server.on_engine(lambda: engine.generate([prompt], SamplingParams(max_tokens=16))[0])
    assert choice.message.content == offline.output_text


def test_streaming_matches_non_streaming(server: Server, story: ChatCompletion) -> None:
    chunks = list(
        server.client().chat.completions.create(
            model=MODEL,
            messages=STORY,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert "".join(d.delta.content or "" for d in deltas) == story.choices[0].message.content
    assert [d.finish_reason for d in deltas if d.finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == story.usage.prompt_tokens  # type: ignore[union-attr]
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")


def test_completion_with_text_and_token_prompts(server: Server) -> None:
    text = "The capital of France is"
    client = server.client()
    reply = client.completions.create(model=MODEL, prompt=text, max_tokens=8, temperature=0)
    ids = server.engine.engine.tokenizer.encode(text, add_special_tokens=True)
    assert reply.id.startswith("cmpl-") and reply.choices[0].text
    assert reply.usage is not None and reply.usage.prompt_tokens == len(ids)
    again = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert again.choices[0].text == reply.choices[0].text


def test_tenant_comes_from_the_key_and_is_audited(server: Server, story: ChatCompletion) -> None:
    response = server.http("GET", f"/v1/audit/requests/{story.id}", key=ADMIN_KEY)
    events = response.json()["events"]
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "admitted" and events[0]["tenant"] == "tenant-a"
    assert {"pages_allocated", "step", "released", "finished"} <= set(kinds)


def test_wrong_or_missing_key_is_401(server: Server) -> None:
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").models.list()
    response = server.http("POST", "/v1/completions", key=None, json={"model": MODEL, "prompt": "hi"})
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"


def test_context_length_exceeded_is_rejected_before_any_page(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        server.client().completions.create(model=MODEL, prompt="hello " * 100, max_tokens=500)
    assert info.value.code == "context_length_exceeded"
    assert "maximum context length is 512" in info.value.message
    kinds = server.audit_kinds(info.value.response.headers["x-request-id"])
    assert "rejected" in kinds
    assert not {"admitted", "pages_allocated", "prefix_hit", "validated", "step"} & set(kinds)


def test_audit_endpoint_is_admin_only(server: Server, story: ChatCompletion) -> None:
    path = f"/v1/audit/requests/{story.id}"
    assert server.http("GET", path, key="key-a").status_code == 403
    assert server.http("GET", path, key=None).status_code == 401
    assert server.http("GET", path, key="wrong").status_code == 401
    missing = server.http("GET", "/v1/audit/requests/chatcmpl-nope", key=ADMIN_KEY)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "request_not_found"


def test_audit_info_reports_what_pins_the_service(server: Server, smollm2: GGUFModel) -> None:
    assert server.http("GET", "/v1/audit/info", key="key-a").status_code == 403
    response = server.http("GET", "/v1/audit/info", key=ADMIN_KEY)
    assert response.status_code == 200, response.text
    info = response.json()
    assert (info["mode"], info["max_model_len"], list(info["pools"])) == ("single", 512, ["single"])
    pool = info["pools"]["single"]
    assert (pool["page_size"], pool["num_pages"], pool["capacity_tokens"]) == (16, 64, 1024)
    assert pool["model_sha256"] == hashlib.sha256(smollm2.path.read_bytes()).hexdigest()
    assert pool["isolation"] is True and pool["dtype"] == "float32" and pool["kvfence_version"]
    assert pool["decode_attention"] == pool["decode_matmul"] == "kernel"


@pytest.mark.parametrize(
    "extra",
    [
        {"n": 17},
        {"top_logprobs": 2},  # without logprobs: true
        {"presence_penalty": 3},
        {"temperature": 3},
        {"max_tokens": 0},
        {"stop": [""]},
    ],
)
def test_unsupported_or_invalid_options_are_400(server: Server, extra: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(model=MODEL, messages=STORY, extra_body=extra)
    assert info.value.type == "invalid_request_error" and info.value.param == next(iter(extra))


def test_batch_of_prompts_and_unknown_model(server: Server) -> None:
    client = server.client()
    batch = client.completions.create(model=MODEL, prompt=["one", "two"], max_tokens=2)
    assert [choice.index for choice in batch.choices] == [0, 1]
    with pytest.raises(openai.BadRequestError, match="batch of prompts"):
        client.completions.create(model=MODEL, prompt=["one", [1]])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[10**9])
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi")


def test_framework_errors_have_the_openai_shape(server: Server) -> None:
    malformed = server.http(
        "POST", "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert malformed.status_code == 400
    assert set(malformed.json()["error"]) == {"message", "type", "param", "code"}
    assert malformed.json()["error"]["type"] == "invalid_request_error"
    for method, path, status in [("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)]:
        response = server.http(method, path)
        assert response.status_code == status and response.json()["error"]["message"]


def _arm_once(server: Server, fault: str) -> None:
    server.on_engine(lambda: server.engine.engine.faults.arm(fault, times=1))


def _unique_prompt() -> str:
    # A fresh first page: no prefix-cache hit, so the fault below fires on this request and no other.
    return f"Ticket {uuid.uuid4().hex}: summarise the history of paged memory in operating systems."


def test_integrity_abort_returns_500_without_content(server: Server) -> None:
    _arm_once(server, "read_beyond_written")
    with pytest.raises(openai.InternalServerError) as info:
        server.client(key="key-b").completions.create(model=MODEL, prompt=_unique_prompt(), max_tokens=8)
    error = info.value.body
    assert isinstance(error, dict)
    assert (error["type"], error["code"]) == ("kv_integrity_error", "unwritten_read")
    assert "choices" not in info.value.response.text
    kinds = server.audit_kinds(info.value.response.headers["x-request-id"])
    assert "aborted" in kinds and "finished" not in kinds


def test_integrity_abort_while_streaming_sends_error_event(server: Server) -> None:
    _arm_once(server, "read_beyond_written")
    body = {"model": MODEL, "prompt": _unique_prompt(), "max_tokens": 8, "stream": True}
    response = server.http("POST", "/v1/completions", key="key-b", json=body)
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
    assert events[-1] == "[DONE]" and '"kv_integrity_error"' in events[-2]
    assert all('"finish_reason":"' not in e for e in events)
    assert server.metric("kvfence_integrity_aborts_total", {"reason": "unwritten_read"}) >= 1


def test_client_disconnect_aborts_and_frees_pages(server: Server) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count from one to one thousand."}],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=60) as http,
        http.stream(
            "POST", f"{server.url}/v1/chat/completions", json=body, headers={"authorization": "Bearer key-a"}
        ) as response,
    ):
        request_id = response.headers["x-request-id"]
        assert next(response.iter_lines()).startswith("data: ")
    # Leaving both blocks closed the connection mid-stream.
    deadline = time.monotonic() + 30
    while not {"aborted", "released"} <= set(kinds := server.audit_kinds(request_id)):
        assert time.monotonic() < deadline, f"request not aborted after disconnect: {kinds}"
        time.sleep(0.1)
    events = server.http("GET", f"/v1/audit/requests/{request_id}", key=ADMIN_KEY).json()["events"]
    assert [e["reason"] for e in events if e["kind"] == "aborted"] == ["client_disconnected"]
    assert "finished" not in kinds
    engine = server.engine.engine
    free, total = server.on_engine(lambda: (engine.allocator.num_free_pages, engine.pool.num_pages))
    assert free == total
    assert server.metric("kvfence_pages_free") == total


def test_stream_is_closed_when_the_client_leaves_during_a_send() -> None:
    """Starlette cancels a stream on disconnect but leaves a body paused at `yield` (here: blocked in a slow
    send) unclosed; the engine stream behind it must still be closed at once, as closing it is the abort."""
    closed: list[str] = []

    async def engine_stream() -> AsyncGenerator[int, None]:
        try:
            yield 1
            await asyncio.sleep(3600)
            yield 2
        finally:
            closed.append("engine stream")

    async def body(outputs: AsyncGenerator[int, None]) -> AsyncGenerator[str, None]:
        yield "data: 1\n\n"
        yield f"data: {await anext(outputs)}\n\n"

    async def scenario() -> list[str]:
        sent_body = asyncio.Event()

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                sent_body.set()
                await asyncio.sleep(3600)  # a client that stopped reading

        async def receive() -> dict[str, Any]:
            await sent_body.wait()
            return {"type": "http.disconnect"}

        outputs = engine_stream()
        await anext(outputs)  # the handler has already taken the first output
        response = EngineStreamResponse(body(outputs), outputs, {})  # type: ignore[arg-type]
        await response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)  # type: ignore[arg-type]
        return list(closed)  # before asyncio.run's own clean-up could close it

    assert asyncio.run(scenario()) == ["engine stream"]


def test_metrics_need_the_admin_key_when_tenants_have_keys(server: Server) -> None:
    """Token counts and prefix hits per scrape would tell one tenant about another's traffic."""
    assert server.http("GET", "/metrics", key=None).status_code == 401
    refused = server.http("GET", "/metrics", key="key-a")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_only"
    assert "kvfence_pages_free" in server.http("GET", "/metrics", key=ADMIN_KEY).text


def test_metrics_exposition(server: Server, story: ChatCompletion) -> None:
    """`story` makes sure one request has finished, whichever tests ran before."""
    text = server.http("GET", "/metrics", key=ADMIN_KEY).text
    for name in [
        "kvfence_prompt_tokens_total",
        "kvfence_generation_tokens_total",
        "kvfence_pages_used",
        "kvfence_time_to_first_token_seconds_bucket",
        "kvfence_time_per_output_token_seconds_bucket",
        "kvfence_prefix_cache_hits_total",
        "kvfence_refused_writes_total",
        "kvfence_fence_validation_seconds_total",
        'kvfence_pages{role="single",state="quarantined"}',
        'kvfence_integrity_aborts_total{reason="stale_generation",role="single"}',
    ]:
        assert name in text, name
    assert server.metric("kvfence_requests_total", {"status": "finished"}) >= 1


def test_the_engine_thread_returns_freed_heap_once_each_burst_ends(
    smollm2: GGUFModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the engine thread, in order: the heap is handed back right after the step that left no request
    unfinished, and after no other step. Two requests admitted together are one burst; a third, later,
    another."""
    from kvfence.engine import async_engine

    engine = real_engine(smollm2, num_pages=64, max_model_len=512)
    log: list[tuple[str, bool]] = []
    step = engine.safe_step

    def logged_step() -> list[Any]:
        outputs = step()
        log.append(("step", engine.has_unfinished()))
        return outputs

    monkeypatch.setattr(engine, "safe_step", logged_step)
    monkeypatch.setattr(
        async_engine, "return_freed_heap", lambda: log.append(("trim", engine.has_unfinished()))
    )
    front = AsyncEngine(engine)
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    async def finish(request_id: str) -> None:
        async for _ in front.generate([1, 2, 3, 4, 5], params, "t", request_id):
            pass

    async def bursts() -> None:
        first = [asyncio.create_task(finish(name)) for name in ("a", "b")]
        await asyncio.sleep(0)  # both admissions queued before the engine thread takes any
        front.start()
        await asyncio.gather(*first)
        await finish("c")

    try:
        asyncio.run(bursts())
    finally:
        front.shutdown()
    trims = [i for i, entry in enumerate(log) if entry[0] == "trim"]
    assert len(trims) == 2 and all(log[i - 1] == ("step", False) and log[i] == ("trim", False) for i in trims)
    assert [i + 1 for i, entry in enumerate(log) if entry == ("step", False)] == trims, log
