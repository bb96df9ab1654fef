"""OpenAI's Responses API (`POST /v1/responses`) over chat completions: text in and out, `instructions`,
conversation items (messages, function calls and their outputs), `text.format` (json_object, json_schema),
function tools and `tool_choice`, streamed as Responses events.

Contracts:
- A request is translated into one ChatCompletionRequest (`to_chat`) and served by the chat path, so every
  rule of chat holds: the tenant from the key, grammars for formats and forced calls, fail-closed aborts.
- Every field is implemented, accepted because it changes no answer (`user`, `metadata`, the cache hints,
  `store` false), or a 400 naming it (`store: true`, `previous_response_id` and `conversation` need stored
  state; `background`, `reasoning`, `include`, `prompt`, ...).
- The answer is one `message` item (its `output_text`) and a `function_call` item per call, after a
  `reasoning` item (its `reasoning_text`) where the server splits reasoning off (--reasoning-parser); a
  `max_output_tokens` cut gives status `incomplete` with reason `max_output_tokens`. Usage's
  `output_tokens_details.reasoning_tokens` is chat's `completion_tokens_details.reasoning_tokens`.
- Streamed: `response.created`, `response.in_progress`, then per item `output_item.added`, its text or
  argument deltas (`reasoning_text` deltas for reasoning) and their `done` events, `output_item.done`,
  and `response.completed` (or
  `response.incomplete`). An aborted request ends with an `error` event and no completion (invariant 8).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvfence.api.protocol import ChatCompletionRequest
from kvfence.api.vllm_extras import refuse_if_set


class InputText(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutput(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call_output"]
    call_id: str
    output: str


InputItem = InputMessage | FunctionCallItem | FunctionCallOutput


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # only the default: the length is the model's


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(BaseModel):
    type: Literal["function"]
    name: str


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    # Nothing is stored here: `store: true` is refused (a later read of the response would find nothing).
    store: bool | None = None
    # Accepted: they change no answer.
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Any = None
    truncation: Literal["disabled"] | None = None  # "auto" would drop input: refused by the Literal
    service_tier: Literal["auto", "default"] | None = None
    # Refused when set: stored state, background runs, reasoning, extra outputs.
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    reasoning: Any = None
    include: list[str] | None = None
    prompt: Any = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    stream_options: Any = None
    context_management: Any = None

    _unsupported = field_validator(
        "previous_response_id",
        "conversation",
        "background",
        "reasoning",
        "include",
        "prompt",
        "max_tool_calls",
        "top_logprobs",
        "stream_options",
        "context_management",
    )(refuse_if_set)

    @field_validator("store")
    @classmethod
    def _not_stored(cls, store: bool | None) -> bool | None:
        if store:
            raise ValueError("responses are not stored by this server: send store false (or leave it out)")
        return store


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that answers `body` (streamed with usage when `body` streams)."""
    messages: list[dict[str, Any]] = (
        [{"role": "system", "content": body.instructions}] if body.instructions else []
    )
    items = [InputMessage(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    for item in items:
        if isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stream": body.stream,
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    if body.tools:
        chat["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in body.tools
        ]
    if isinstance(body.tool_choice, NamedFunction):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        schema = {"name": fmt.name or "output", "schema": fmt.schema_, "strict": fmt.strict}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    return ChatCompletionRequest.model_validate(chat)


class ResponseBuilder:
    """The Response object for one request, from the chat answer (whole, or as its stream goes by)."""

    def __init__(self, body: ResponsesRequest, model: str) -> None:
        self.body = body
        self.id = f"resp_{uuid.uuid4().hex}"
        self.model = model
        self.created_at = int(time.time())

    def response(
        self, output: list[dict[str, Any]], status: str, usage: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        body = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": output,
            "usage": _usage(usage),
            "error": None,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "tool_choice": _dump(body.tool_choice) or "auto",
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
            "text": _dump(body.text) or {"format": {"type": "text"}},
            "metadata": body.metadata or {},
            "store": False,
        }

    def from_chat(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The Response for a whole chat completion."""
        choice = chat["choices"][0]
        message, output = choice["message"], []
        if message.get("reasoning_content"):
            output.append(reasoning_item(f"rs_{uuid.uuid4().hex}", message["reasoning_content"], "completed"))
        if message.get("content") or not message.get("tool_calls"):
            output.append(message_item(f"msg_{uuid.uuid4().hex}", message.get("content") or "", "completed"))
        for call in message.get("tool_calls") or []:
            function = call["function"]
            output.append(call_item(call["id"], function["name"], function["arguments"], "completed"))
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        return self.response(output, status, chat.get("usage"))


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "reasoning_text", "text": text}
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [], "content": [part]}


def call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{call_id.removeprefix('call_')}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """The Response's usage from the chat answer's (its reasoning tokens: the think block's, in tokens)."""
    if usage is None:
        return None
    details = usage.get("completion_tokens_details") or {}
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
        "total_tokens": usage["total_tokens"],
    }


def _dump(value: BaseModel | str | None) -> Any:
    return value.model_dump(exclude_none=True, by_alias=True) if isinstance(value, BaseModel) else value


class EventStream:
    """Chat completion chunks in, Responses events out (as SSE lines)."""

    def __init__(self, builder: ResponseBuilder) -> None:
        self.builder = builder
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # output items, in order; the open one last
        self.calls: dict[int, int] = {}  # chat tool call index -> its output item's index
        self.finish: str | None = None

    async def relay(self, chunks: AsyncIterator[str | bytes]) -> AsyncIterator[str]:
        """The events for a chat stream's SSE body."""
        yield self._event("response.created", response=self.builder.response([], "in_progress"))
        yield self._event("response.in_progress", response=self.builder.response([], "in_progress"))
        async with aclosing(chunks):  # type: ignore[type-var]
            async for raw in chunks:
                for line in (raw.decode() if isinstance(raw, bytes) else raw).splitlines():
                    if not line.startswith("data: {"):
                        continue
                    data = json.loads(line.removeprefix("data: "))
                    if "error" in data:  # an abort: no completion, ever (invariant 8)
                        error = {k: data["error"].get(k) for k in ("message", "code", "param")}
                        yield self._event("error", **error)
                        return
                    for event in self._chunk(data):
                        yield event

    def _chunk(self, data: dict[str, Any]) -> list[str]:
        events: list[str] = []
        for choice in data.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._reasoning(delta["reasoning_content"])
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        if data.get("usage") is not None:  # the last chunk: close every item, then the response
            events += [event for index in range(len(self.items)) for event in self._close(index)]
            status = "incomplete" if self.finish == "length" else "completed"
            response = self.builder.response(self.items, status, data["usage"])
            events.append(self._event(f"response.{status}", response=response))
        return events

    def _open(self, kind: str) -> bool:
        """Whether the last item is an open one of `kind` (more text goes into it)."""
        last = self.items[-1] if self.items else {}
        return last.get("type") == kind and last.get("status") == "in_progress"

    def _reasoning(self, text: str) -> list[str]:
        events = []
        if not self._open("reasoning"):
            item = reasoning_item(f"rs_{uuid.uuid4().hex}", "", "in_progress")
            self.items.append(item)
            events.append(
                self._event("response.output_item.added", output_index=len(self.items) - 1, item=item)
            )
        self.items[-1]["content"][0]["text"] += text
        events.append(self._event("response.reasoning_text.delta", **self._where(), delta=text))
        return events

    def _text(self, text: str) -> list[str]:
        events = []
        if not self._open("message"):
            if self.items and self.items[-1]["type"] == "reasoning":  # the answer follows its reasoning
                events += self._close(len(self.items) - 1)
            item = message_item(f"msg_{uuid.uuid4().hex}", "", "in_progress")
            self.items.append(item)
            events.append(
                self._event("response.output_item.added", output_index=len(self.items) - 1, item=item)
            )
            events.append(self._part_event("response.content_part.added"))
        item = self.items[-1]
        item["content"][0]["text"] += text
        events.append(self._event("response.output_text.delta", **self._where(), delta=text, logprobs=[]))
        return events

    def _call(self, call: dict[str, Any]) -> list[str]:
        events = []
        function = call.get("function") or {}
        if call.get("id"):  # a call opens: the message before it is complete
            if self.items and self.items[-1]["status"] == "in_progress":
                events += self._close(len(self.items) - 1)
            item = call_item(call["id"], function.get("name") or "", "", "in_progress")
            self.items.append(item)
            self.calls[call["index"]] = len(self.items) - 1
            events.append(
                self._event("response.output_item.added", output_index=len(self.items) - 1, item=item)
            )
        index = self.calls[call["index"]]
        if function.get("arguments"):
            self.items[index]["arguments"] += function["arguments"]
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=self.items[index]["id"],
                    output_index=index,
                    delta=function["arguments"],
                )
            )
        return events

    def _close(self, index: int) -> list[str]:
        item = self.items[index]
        if item["status"] != "in_progress":
            return []
        item["status"] = "completed"
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            events = [self._event("response.reasoning_text.done", **where, text=text)]
        elif item["type"] == "message":
            text = item["content"][0]["text"]
            events = [self._event("response.output_text.done", **where, text=text, logprobs=[])]
            events.append(self._event("response.content_part.done", **where, part=item["content"][0]))
        else:
            done = {"item_id": item["id"], "output_index": index, "arguments": item["arguments"]}
            events = [self._event("response.function_call_arguments.done", **done)]
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1, "content_index": 0}

    def _part_event(self, kind: str) -> str:
        return self._event(kind, **self._where(), part={"type": "output_text", "text": "", "annotations": []})

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence} | fields
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"
