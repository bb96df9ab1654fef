"""The service behind the OpenAI-compatible endpoints (routes.py): it turns validated requests into engine
generations and engine outputs into responses.

Contracts:
- A request id (`cmpl-…` / `chatcmpl-…`) is the response `id`, the `x-request-id` header and the key of
  the request's audit trail.
- An aborted request never returns content with a normal finish (invariant 8): a KV integrity abort is
  HTTP 500 `kv_integrity_error` (or, once streaming, an SSE error event then `[DONE]`).
- A refusal at admission keeps the engine's status and code; a request for another model is 404.
- A chat request to a model without a chat template (none in the file, no `--chat-template`) is 400
  `no_chat_template`, naming /v1/completions and `--chat-template` as the ways out.
- A batch of prompts in /v1/completions is one request per prompt (audited as `{id}-{i}`), answered as one
  body in OpenAI's numbering (prompt i's choice j at i * n + j); not streamed (a 400 naming `stream`).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import aclosing
from typing import Any

from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response

from kvfence.api.bodies import ModelCard, ModelList
from kvfence.api.choices import check_choices
from kvfence.api.choices import respond as respond_choices
from kvfence.api.embeddings import EmbeddingRequest, embedding_prompt, embedding_response
from kvfence.api.errors import APIError, abort_error
from kvfence.api.logprobs import LogprobsFormat, prompt_logprobs
from kvfence.api.metrics import Metrics
from kvfence.api.prompts import NO_CHAT_TEMPLATE, bad_words_token_ids, encode_chat, truncate_prompt
from kvfence.api.protocol import ChatCompletionRequest, CompletionRequest, GenerationRequest
from kvfence.api.reasoning import Reasoning, check_parser
from kvfence.api.responses import EngineStreamResponse, Format, add_token_ids, answer, sse_events, usage
from kvfence.api.responses_api import EventStream, ResponseBuilder, ResponsesRequest, to_chat
from kvfence.api.stats_log import RequestLog
from kvfence.api.tokenize import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from kvfence.api.tools import ToolCallParser, template_messages, tool_guide
from kvfence.engine.async_engine import Embedder, EngineClient
from kvfence.engine.engine import AdmissionError
from kvfence.grammar.compiler import GrammarCompiler, GrammarError, Guide, RequestGrammar
from kvfence.request import Status
from kvfence.sampling import SamplingDefaults

PROMPT_TAIL_TOKENS = 16  # read for an open or closed think block the template wrote (Qwen 3's takes 4)


class Service:
    """Turns validated requests into engine requests and engine outputs into responses."""

    request_log: RequestLog | None = None  # --enable-log-requests (api/stats_log.py)

    def __init__(
        self,
        engine: EngineClient,
        model_name: str,
        metrics: Metrics,
        sampling: SamplingDefaults,
        reasoning_parser: str | None = None,
    ) -> None:
        self.engine = engine
        self.reasoning_parser = check_parser(reasoning_parser)
        self.model_name = model_name
        self.metrics = metrics
        self.sampling = sampling
        self.created = int(time.time())
        self._pins: list[dict[str, Any]] | None = None
        self.grammars = GrammarCompiler(engine.tokenizer, engine.vocab_size)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    async def models(self) -> ModelList:
        pools = await self._pools()
        first = next(iter(pools), {})
        card = ModelCard(
            id=self.model_name,
            created=self.created,
            max_model_len=self.max_model_len,
            batch_invariant=bool(pools) and all(pool.get("batch_invariant") is True for pool in pools),
            **{key: first.get(key) for key in ("architecture", "quantization", "model_sha256")},
        )
        return ModelList(data=[card])

    async def _pools(self) -> list[dict[str, Any]]:
        """Every pool's pins, read once: they are static after start-up, and the first read may hash the
        model file, so it runs off the event loop."""
        if self._pins is None:
            self._pins = list((await run_in_threadpool(self.engine.info))["pools"].values())
        return self._pins

    async def complete(self, body: CompletionRequest, tenant: str, request_id: str | None = None) -> Response:
        """/v1/completions: one prompt, or a batch (`_complete_batch`); `request_id`: a batch's part's."""
        if parts := body.batch():
            return await self._complete_batch(body, parts, tenant)
        if isinstance(body.prompt, str):
            special = body.add_special_tokens is not False  # completions' default: the model's BOS
            prompt = await run_in_threadpool(self._tokenizer().encode, body.prompt, special)
        else:
            prompt = body.prompt
            vocab = self.engine.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        prompt = truncate_prompt(prompt, body.truncate_prompt_tokens, self.max_model_len)
        grammar = await self._grammar(body, None)
        return await self._generate(body, prompt, tenant, chat=False, grammar=grammar, request_id=request_id)

    async def _complete_batch(
        self, body: CompletionRequest, parts: list[CompletionRequest], tenant: str
    ) -> Response:
        """A batch of prompts, generated together as requests of their own (prompt i's audit trail under
        `{id}-{i}`), answered as one body: prompt i's choice j at index i * n + j, as OpenAI and vLLM number
        them, usage summed. The first failure fails the whole answer, and the other parts are aborted."""
        if body.stream:
            raise APIError(400, "stream: a batch of prompts is answered without streaming", param="stream")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        tasks = [
            asyncio.create_task(self.complete(part, tenant, f"{request_id}-{i}"))
            for i, part in enumerate(parts)
        ]
        try:
            answers = await asyncio.gather(*tasks)
        finally:  # after a failure, the parts still running: cancelling one closes its engine stream
            for task in tasks:
                task.cancel()
        bodies = [json.loads(bytes(answer.body)) for answer in answers]
        n = body.num_choices
        merged = bodies[0] | {"id": request_id}
        merged["choices"] = [
            c | {"index": i * n + c["index"]} for i, b in enumerate(bodies) for c in b["choices"]
        ]
        merged["usage"] = {key: sum(b["usage"][key] for b in bodies) for key in merged["usage"]}
        return JSONResponse(merged, headers={"x-request-id": request_id})

    async def chat(self, body: ChatCompletionRequest, tenant: str) -> Response:
        prompt = truncate_prompt(
            await self._chat_prompt(body), body.truncate_prompt_tokens, self.max_model_len
        )
        grammar = await self._grammar(body, tool_guide(body))
        parser = ToolCallParser(body) if body.tool_mode != "none" else None
        reasoning = await self._reasoning(prompt, grammar, parser, body.skip_special_tokens)
        return await self._generate(
            body, prompt, tenant, chat=True, grammar=grammar, tools=parser, reasoning=reasoning
        )

    async def _reasoning(
        self, prompt: list[int], grammar: RequestGrammar | None, tools: ToolCallParser | None, skip: bool
    ) -> Reasoning | None:
        """The answer's reasoning split (--reasoning-parser, api/reasoning.py), after the prompt's last
        tokens, its tokens decoded (`skip`: skip_special_tokens) as the engine decodes them for the usage
        count; None without a parser, or under a grammar that holds the answer from its first token
        (structured output, a forced call): none of it can be reasoning."""
        if self.reasoning_parser is None or (grammar is not None and (tools is None or tools.mode != "auto")):
            return None
        tokenizer = self._tokenizer()
        tail = await run_in_threadpool(tokenizer.decode, prompt[-PROMPT_TAIL_TOKENS:], False)
        return Reasoning(self.reasoning_parser, tail, tokenizer, skip)

    async def respond(self, body: ResponsesRequest, tenant: str) -> Response:
        """OpenAI's Responses API, answered by the chat path (api/responses_api.py)."""
        try:
            chat = to_chat(body)
        except ValidationError as exc:  # what chat refuses (an empty input, a bad tool name): a 400
            error = exc.errors()[0]
            where = ".".join(str(part) for part in error["loc"])
            raise APIError(400, f"{where}: {error['msg']}", param="input") from None
        builder = ResponseBuilder(body, self.model_name)
        answer = await self.chat(chat, tenant)
        headers = {"x-request-id": answer.headers["x-request-id"]}
        if not isinstance(answer, EngineStreamResponse):
            return JSONResponse(builder.from_chat(json.loads(bytes(answer.body))), headers=headers)
        events = EventStream(builder).relay(answer.body_iterator)
        return EngineStreamResponse(events, answer.outputs, headers)

    async def model(self, model_id: str) -> ModelCard:
        self.check_model(model_id)
        return (await self.models()).data[0]

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        """vLLM's /tokenize: a prompt's ids as /v1/completions encodes it, or a conversation's as /v1/chat
        renders it."""
        self.check_model(body.model)
        if body.messages is not None:
            chat = ChatCompletionRequest(
                messages=body.messages,
                add_generation_prompt=body.add_generation_prompt,
                add_special_tokens=body.add_special_tokens,
            )
            tokens = await self._chat_prompt(chat)
        else:
            special = body.add_special_tokens is not False
            tokens = await run_in_threadpool(self._tokenizer().encode, body.prompt, special)
        strs = None
        if body.return_token_strs:
            strs = [self._tokenizer().decode([token], skip_special_tokens=False) for token in tokens]
        return TokenizeResponse(
            count=len(tokens), max_model_len=self.max_model_len, tokens=tokens, token_strs=strs
        )

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(body.model)
        vocab = self.engine.vocab_size
        if any(not 0 <= token < vocab for token in body.tokens):
            raise APIError(400, f"tokens must be ids in [0, {vocab})", param="tokens")
        text = await run_in_threadpool(self._tokenizer().decode, body.tokens, False)
        return DetokenizeResponse(prompt=text)

    async def embed(self, body: EmbeddingRequest) -> Response:
        """OpenAI's /v1/embeddings (api/embeddings.py): every input's tokens checked first, then each one's
        vector from the engine, in order."""
        self.check_model(body.model)
        engine = self.engine
        if not isinstance(engine, Embedder):
            raise APIError(400, "embeddings are not supported by this deployment", param="input")
        size = engine.embedding_size
        if body.dimensions is not None and body.dimensions != size:
            message = f"dimensions: only {size} (the model's hidden size) is supported, not {body.dimensions}"
            raise APIError(400, message, param="dimensions")
        encode, window, vocab = self._encode, self.max_model_len, engine.vocab_size
        prompts = [
            await run_in_threadpool(embedding_prompt, body, i, item, encode, window, vocab)
            for i, item in enumerate(body.inputs())
        ]
        request_id = f"embd-{uuid.uuid4().hex}"
        vectors = [await engine.embed(prompt) for prompt in prompts]
        tokens = sum(len(prompt) for prompt in prompts)
        self.metrics.embedded(tokens)
        answer = embedding_response(request_id, self.model_name, vectors, body.encoding_format, tokens)
        return JSONResponse(answer.model_dump(mode="json"), headers={"x-request-id": request_id})

    def check_model(self, model: str | None) -> None:
        """A request naming another model than the served one is a 404 (None: the served one)."""
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"The model '{model}' does not exist (this server serves '{self.model_name}').",
                code="model_not_found",
                param="model",
            )

    async def _chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        messages, tools = template_messages(body, self._chat_tokenizer().template_supports_tools)
        return await run_in_threadpool(self._encode_chat, body, messages, tools)

    async def _grammar(self, body: GenerationRequest, tools: Guide | None) -> RequestGrammar | None:
        """The request's matcher for its tool choice's grammar or its one output guide (`response_format`,
        vLLM's guided_* and structured_outputs), compiled (once per guide, then cached) before admission: a
        guide that cannot be enforced is a 400 naming why."""
        guides = body.guides()
        if tools is not None and guides:
            message = f"{next(iter(guides))} cannot be combined with a forced or strict tool call"
            raise APIError(400, message, param="tool_choice")
        if tools is not None:
            guides = {"tools": tools}
        if not guides:
            return None
        param, guide = next(iter(guides.items()))
        if not getattr(self.engine, "supports_grammar", False):
            message = f"{param}: structured output is not supported by this deployment"
            raise APIError(400, message, param=param)
        try:
            return await run_in_threadpool(self.grammars.for_guide, guide)
        except GrammarError as exc:
            code = "invalid_json_schema" if guide.kind == "json" else "invalid_grammar"
            raise APIError(400, f"{param}: {exc}", code=code, param=param.split(".")[0]) from exc

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self._tokenizer().encode(text, add_special_tokens))

    def _tokenizer(self) -> Any:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
        return tokenizer

    def _chat_tokenizer(self) -> Any:
        """The tokenizer, if it has a chat template: else a 400 saying how to serve this model anyway."""
        tokenizer = self._tokenizer()
        if not tokenizer.has_chat_template:
            raise APIError(400, NO_CHAT_TEMPLATE, code="no_chat_template", param="messages")
        return tokenizer

    def _encode_chat(
        self, body: ChatCompletionRequest, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[int]:
        return encode_chat(self._tokenizer(), body, messages, tools)

    async def _generate(
        self,
        body: GenerationRequest,
        prompt: list[int],
        tenant: str,
        chat: bool,
        grammar: RequestGrammar | None = None,
        tools: ToolCallParser | None = None,
        reasoning: Reasoning | None = None,
        request_id: str | None = None,
    ) -> Response:
        self.check_model(body.model)
        request_id = request_id or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self._check_sampling(body)
        check_choices(body, self.engine)
        words = body.bad_words
        bad_words = await run_in_threadpool(bad_words_token_ids, self._tokenizer(), words) if words else None
        # max_tokens left out: the rest of the window, as vLLM (a prompt filling it is refused at admission).
        params = body.sampling_params(max(1, self.max_model_len - len(prompt)), self.sampling, bad_words)
        if params.min_tokens > params.max_tokens:
            message = f"min_tokens ({params.min_tokens}) is greater than max_tokens ({params.max_tokens})"
            raise APIError(400, message, param="min_tokens")
        # Only a grammar-capable engine gets the keyword (a client without it does not take it).
        extra: dict[str, Any] = {"grammar": grammar} if grammar is not None else {}
        if body.num_choices > 1:  # likewise n, for an engine that forks (check_choices made sure)
            extra["n"] = body.num_choices
        stream = self.engine.generate(prompt, params, tenant, request_id, **extra)
        if self.request_log is not None:
            self.request_log.arrived(request_id, tenant, prompt, params)
            stream = self.request_log.follow(request_id, stream)
        outputs = self.metrics.observe(stream)
        try:
            first = await anext(outputs)  # admission, then the first token (or an abort)
        except AdmissionError as exc:
            raise APIError(
                exc.status,
                str(exc),
                code=exc.code,
                param="messages" if chat else "prompt",
                request_id=request_id,
            ) from exc
        as_ids = bool(body.return_tokens_as_token_ids)
        logprobs = None if params.logprobs is None else LogprobsFormat(self.engine.tokenizer, chat, as_ids)
        echo = await self._echo(body, prompt)
        if logprobs is not None and echo is not None and first.prompt_logprobs is not None:
            logprobs.add_prompt(prompt, first.prompt_logprobs)
        ids = prompt if body.return_token_ids else None
        fmt = Format(request_id, self.model_name, chat, int(time.time()), logprobs, echo, reasoning, ids)
        headers = {"x-request-id": request_id}
        asked = body.prompt_logprobs is not None and first.prompt_logprobs is not None
        prompt_entries = prompt_logprobs(self.engine.tokenizer, first.prompt_logprobs) if asked else None
        if body.num_choices > 1:
            return await respond_choices(first, outputs, fmt, body, headers, tools, prompt_entries)
        if body.stream:
            events = sse_events(first, outputs, fmt, body.include_usage, tools, prompt_entries)
            return EngineStreamResponse(events, outputs, headers)
        counter = fmt.counter()
        async with aclosing(outputs):
            texts, tokens, last = [first.new_text], [*first.new_token_ids], first
            if logprobs is not None:
                logprobs.add(first.logprobs)
            if counter is not None:
                counter.feed(first.new_token_ids)
            async for output in outputs:
                texts.append(output.new_text)
                tokens += output.new_token_ids
                last = output
                if logprobs is not None:
                    logprobs.add(output.logprobs)
                if counter is not None:
                    counter.feed(output.new_token_ids)
        if last.status is Status.ABORTED:
            raise abort_error(last)
        used = usage(last, fmt.reasoning_tokens([counter]))
        body_model = answer(fmt, "".join(texts), last.finish_reason, used, tools, prompt_entries)
        if body.return_token_ids:
            add_token_ids(body_model, prompt, tokens)
        return JSONResponse(body_model.model_dump(mode="json"), headers=headers)

    async def _echo(self, body: GenerationRequest, prompt: list[int]) -> str | None:
        """Completions' `echo`: the prompt as sent (its text, or its token ids decoded); None without it."""
        if not getattr(body, "echo", False):
            return None
        if isinstance(getattr(body, "prompt", None), str):
            return str(body.prompt)  # type: ignore[attr-defined]
        return await run_in_threadpool(self._tokenizer().decode, prompt, False)

    def _check_sampling(self, body: GenerationRequest) -> None:
        """What only the served model and engine can tell: logit_bias ids in its vocabulary, and whether
        this engine reports logprobs and prompt logprobs (the disaggregated router carries the first, not
        the second: refused, not dropped)."""
        vocab = self.engine.vocab_size
        ids = {
            "logit_bias": [int(token) for token in body.logit_bias or {}],
            "stop_token_ids": body.stop_token_ids or [],
            "allowed_token_ids": body.allowed_token_ids or [],
        }
        for param, tokens in ids.items():
            if bad := [token for token in tokens if token >= vocab]:
                message = f"{param}: token id {bad[0]} is outside the vocabulary [0, {vocab})"
                raise APIError(400, message, param=param)
        if body.logprobs_wanted() is not None and not getattr(self.engine, "supports_logprobs", False):
            raise APIError(400, "logprobs are not supported by this deployment", param="logprobs")
        if body.prompt_logprobs is not None and not getattr(self.engine, "supports_prompt_logprobs", False):
            raise APIError(
                400, "prompt_logprobs are not supported by this deployment", param="prompt_logprobs"
            )

    async def audit(self, request_id: str) -> dict[str, Any]:
        events = await run_in_threadpool(self.engine.audit_events, request_id)
        if not events:
            raise APIError(404, f"no audit trail for request '{request_id}'", code="request_not_found")
        return {"request_id": request_id, "events": events}
