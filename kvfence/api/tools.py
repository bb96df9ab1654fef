"""Tool calling for chat completions: the tools in the prompt, a forced call's grammar, and the calls read
back out of the model's text in OpenAI's shape.

Contracts:
- A chat template that renders `tools` itself gets them (and the conversation's calls and results) as HF
  passes them. Otherwise (SmolLM2's template) the tools go into the system prompt in the format below, and
  earlier calls and results are written into the messages in the same format:

      <tools>
      {"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}
      </tools>
      ... the model answers a call as
      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>
      ... and a tool's result comes back in a user turn as <tool_response>...</tool_response>.

- `tool_choice` "none": the tools are left out of the prompt and nothing is parsed. "auto": the output is
  scanned for <tool_call> blocks; with a `strict` tool, free text until the model opens a block, whose call
  is then held to the tools' schemas (`tool_guide`). "required" and a named function are enforced by
  grammar: the model can only write a JSON array of calls ([{"name", "arguments"}], one call when
  parallel_tool_calls is false), or the named function's arguments object.
- A forced call's schema is closed: every object schema that does not say otherwise gets
  `additionalProperties: false` (framework tools, LangChain's and instructor's, leave it out, and a small
  model pads extra keys until max_tokens cuts the call); a `strict` tool's schema is OpenAI's strict one
  (grammar/strict.py: also every property required), in a forced call and in an opened block alike.
- A call cut off by max_tokens is still a call: finish_reason "length" and the partial arguments in
  `tool_calls` (OpenAI's behaviour), never in content. Other output that does not parse into calls is
  returned as content, never as a half-made call.
- Streamed, a named call sends its arguments as they are written (one `tool_calls` delta with the id and
  name, then argument deltas); other calls go out whole when complete.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from kvfence.api.bodies import FunctionCallDelta, ToolCallDelta
from kvfence.api.protocol import ChatCompletionRequest, ChatMessage, FunctionCall, ToolCall, ToolSpec
from kvfence.api.reasoning import partial_tag
from kvfence.grammar.compiler import JSON_OPTIONS, Guide
from kvfence.grammar.strict import closed, strict_schema

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
# The start of a call cut off inside its arguments: {"name": "get_weather", "arguments": {"city": "Par
_CUT_CALL = re.compile(
    r'\{\s*"name"\s*:\s*"(?P<name>[A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*(?P<arguments>.*)', re.DOTALL
)
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CALL_CLOSE) + r"|$)", re.DOTALL)


def system_prompt(tools: list[ToolSpec]) -> str:
    """The documented tool format, for templates that do not render tools themselves."""
    signatures = "\n".join(json.dumps(tool.model_dump(exclude_none=True)) for tool in tools)
    return (
        "You may call functions to answer. Their signatures are within <tools></tools>:\n"
        f"<tools>\n{signatures}\n</tools>\n"
        "To call a function, answer with a JSON object per call within <tool_call></tool_call> tags:\n"
        f'{TOOL_CALL_OPEN}\n{{"name": <function name>, "arguments": <arguments object>}}\n{TOOL_CALL_CLOSE}'
    )


def template_messages(
    body: ChatCompletionRequest, native_tools: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The conversation for the chat template, and the tools to pass to it (None: nothing to pass)."""
    tools = body.tools if body.tools and body.tool_mode != "none" else []
    if native_tools:
        return [_native(m) for m in body.messages], [t.model_dump(exclude_none=True) for t in tools] or None
    messages = [_written_out(m) for m in body.messages]
    if tools:
        prompt = system_prompt(tools)
        if messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{prompt}"}
        else:
            messages.insert(0, {"role": "system", "content": prompt})
    return messages, None


def _native(message: ChatMessage) -> dict[str, Any]:
    """HF's convention: calls carry their arguments as objects, results their call id."""
    rendered: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.tool_calls:
        rendered["tool_calls"] = [
            {"type": "function", "function": {"name": c.function.name, "arguments": _arguments(c)}}
            for c in message.tool_calls
        ]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _written_out(message: ChatMessage) -> dict[str, str]:
    """A message in the documented format: calls as <tool_call> blocks, a result as a user turn."""
    if message.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message.text()}\n</tool_response>"}
    calls = [{"name": c.function.name, "arguments": _arguments(c)} for c in message.tool_calls or []]
    blocks = [f"{TOOL_CALL_OPEN}\n{json.dumps(call)}\n{TOOL_CALL_CLOSE}" for call in calls]
    return {"role": message.role, "content": "\n".join(filter(None, [message.text(), *blocks]))}


def _arguments(call: ToolCall) -> Any:
    """A call's arguments as an object where they parse (a client may send any string back)."""
    try:
        return json.loads(call.function.arguments)
    except json.JSONDecodeError:
        return call.function.arguments


def tool_guide(body: ChatCompletionRequest) -> Guide | None:
    """The grammar a tool choice asks for: a forced call's JSON schema ("required", named), or with "auto"
    and a `strict` tool, free text in which each <tool_call> block is held to the tools' schemas (a lazy
    Lark grammar: anything until the model opens a block); None when nothing is enforced."""
    schema = forced_schema(body)
    if schema is not None:
        return Guide("json", schema)
    if body.tool_mode != "auto" or not any(tool.function.strict for tool in body.tools or []):
        return None
    calls = {"anyOf": _call_schemas(body)} | {"x-guidance": JSON_OPTIONS}
    return Guide(
        "lark",
        "start: call* tail\ntail: TEXT\nTEXT: /(.|\\n)*/\n"
        f'call_head[lazy]: TEXT "{TOOL_CALL_OPEN}"\n'
        f'call: call_head "\\n" %json {json.dumps(calls)} "\\n{TOOL_CALL_CLOSE}"\n',
    )


def forced_schema(body: ChatCompletionRequest) -> dict[str, Any] | None:
    """The JSON schema that forces a call ("required", named), None when the model chooses."""
    if body.tool_mode == "named":
        assert not isinstance(body.tool_choice, str) and body.tool_choice is not None
        named = next(t for t in body.tools or [] if t.function.name == body.tool_choice.function.name)
        return _arguments_schema(named)
    if body.tool_mode != "required":
        return None
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": _call_schemas(body)}, "minItems": 1}
    if body.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


def _call_schemas(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """One schema per tool for a call written out: {"name": the tool, "arguments": its closed schema}."""
    return [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool.function.name},
                "arguments": _arguments_schema(tool),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in body.tools or []
    ]


def _arguments_schema(tool: ToolSpec) -> dict[str, Any]:
    """A tool's parameters as its calls are held to them: strict where the tool says so, else closed."""
    return (strict_schema if tool.function.strict else closed)(tool.function.parameters)


def finish_reason(reason: str | None, calls: list[ToolCall]) -> str | None:
    """OpenAI's finish_reason for an answer that made calls ("length" stays: the last call is cut off)."""
    return "tool_calls" if calls and reason != "length" else reason


def whole(calls: list[ToolCall]) -> list[ToolCallDelta]:
    """Complete calls as one stream delta each."""
    return [
        ToolCallDelta(
            index=i, id=c.id, type="function", function=FunctionCallDelta(**c.function.model_dump())
        )
        for i, c in enumerate(calls)
    ]


def new_call(name: str, arguments: str) -> ToolCall:
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=name, arguments=arguments))


class ToolCallParser:
    """Splits a chat answer into content and tool calls, incrementally for streams.

    `feed` returns the content that can be streamed now; `finish` the rest of the content and the calls.
    In "auto" text is streamed until something that may open a <tool_call> block; from there it is held
    until the end. A forced call ("required", named) is held whole: it is all call."""

    def __init__(self, body: ChatCompletionRequest) -> None:
        self.mode = body.tool_mode
        self.names = {tool.function.name for tool in body.tools or []}
        choice = body.tool_choice
        self.forced_name = "" if choice is None or isinstance(choice, str) else choice.function.name
        self._held = ""
        self._in_call = self.mode in ("named", "required")
        self._named_call = new_call(self.forced_name, "") if self.mode == "named" else None
        self._sent: int | None = (
            None  # characters of the named call's arguments streamed (None: no delta yet)
        )

    def arguments_delta(self) -> ToolCallDelta | None:
        """Streaming a named call: the arguments written since the last delta (the first delta carries the
        call's id and name); None when there is nothing new, or the call is not a named one."""
        call = self._named_call
        if call is None or (self._sent is not None and len(self._held) == self._sent):
            return None
        new, opening = self._held[self._sent or 0 :], self._sent is None
        self._sent = len(self._held)
        if opening:  # OpenAI's first delta: the call's id, type and name
            return ToolCallDelta(
                index=0,
                id=call.id,
                type="function",
                function=FunctionCallDelta(name=call.function.name, arguments=new),
            )
        return ToolCallDelta(index=0, function=FunctionCallDelta(arguments=new))

    def feed(self, text: str) -> str:
        self._held += text
        if self._in_call:
            return ""
        start = self._held.find(TOOL_CALL_OPEN)
        if start != -1:
            self._in_call = True
            out, self._held = self._held[:start], self._held[start:]
            return out
        keep = partial_tag(self._held, TOOL_CALL_OPEN)
        out, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
        return out

    def finish(self, cut: bool = False) -> tuple[str, list[ToolCall]]:
        """(content not yet handed out, calls); no calls when the held text does not parse into them.
        `cut`: max_tokens ended the answer, so the last call may be partial and is returned as it stands."""
        text, self._held = self._held, ""
        parse = {"named": self._named, "required": self._required, "auto": self._auto}.get(self.mode)
        calls = parse(text, cut) if parse is not None and self._in_call else None
        if calls is None:
            return text, []
        return ("" if self.mode != "auto" else _BLOCK.sub("", text).strip()), calls

    def _named(self, text: str, cut: bool) -> list[ToolCall] | None:
        if not (cut or isinstance(_loads(text), dict)):
            return None
        assert self._named_call is not None
        return [
            self._named_call.model_copy(
                update={"function": FunctionCall(name=self.forced_name, arguments=text)}
            )
        ]

    def _required(self, text: str, cut: bool) -> list[ToolCall] | None:
        items = _loads(text)
        if isinstance(items, list) and items:
            calls = [self._call(item) for item in items]
            return None if None in calls else calls  # type: ignore[return-value]
        return self._partial(text) if cut else None

    def _auto(self, text: str, cut: bool) -> list[ToolCall] | None:
        blocks = [block.strip() for block in _BLOCK.findall(text)]
        calls = [self._call(_loads(block)) for block in blocks]
        if cut and calls and calls[-1] is None:  # the last block is the one max_tokens cut
            calls[-1:] = self._partial(blocks[-1]) or [None]
        return None if not calls or None in calls else calls  # type: ignore[return-value]

    def _partial(self, text: str) -> list[ToolCall] | None:
        """The calls in `text` cut off by max_tokens: the complete ones, then the cut one with its arguments
        as written so far (None when not even its name was complete)."""
        calls, decoder, at = [], json.JSONDecoder(), text.find("{")
        while at != -1:
            try:
                item, end = decoder.raw_decode(text, at)
            except json.JSONDecodeError:
                cut = _CUT_CALL.match(text, at)
                if cut is None or cut["name"] not in self.names:
                    return calls or None
                return [*calls, new_call(cut["name"], cut["arguments"])]
            call = self._call(item)
            if call is None:
                return None
            calls.append(call)
            at = text.find("{", end)
        return calls or None

    def _call(self, item: Any) -> ToolCall | None:
        """{"name": a known tool, "arguments": an object} as a call, else None."""
        if not isinstance(item, dict) or item.get("name") not in self.names:
            return None
        arguments = item.get("arguments", {})
        return new_call(item["name"], json.dumps(arguments)) if isinstance(arguments, dict) else None


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
