"""OpenAI's response bodies for /v1/completions, /v1/chat/completions and /v1/models, their stream chunks,
and the error body every failure is rendered in (api/errors.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from kvfence.api.logprobs import ChatLogprobs, CompletionLogprobs
from kvfence.api.protocol import ToolCall


def _absent() -> Any:
    """A field left out of the body where it is None: vLLM's reasoning fields without a parser, its
    `return_token_ids` fields on chunks where not asked for, usage's details on completions."""
    return Field(default=None, exclude_if=lambda value: value is None)


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int  # the answer's think block, in tokens (api/reasoning.py `ReasoningCounter`)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # Chat's (OpenAI's shape), left out of completions' usage, which has none (a batch's usage is summed
    # key by key).
    completion_tokens_details: CompletionTokensDetails | None = _absent()


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM's, when asked for
    # vLLM's `return_token_ids`: the prompt's and this choice's token ids, when asked for.
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    """Both the non-streaming body and each streamed chunk (OpenAI uses one shape for the two)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = _absent()
    reasoning: str | None = _absent()  # vLLM's newer name for the same text


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM's, when asked for
    token_ids: list[int] | None = None  # vLLM's `return_token_ids`: this choice's, when asked for


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None  # vLLM's `return_token_ids`, when asked for


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning_content: str | None = _absent()
    reasoning: str | None = _absent()


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM's, in the first chunk
    token_ids: list[int] | None = _absent()  # vLLM's `return_token_ids`: this chunk's, when asked for


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = _absent()  # vLLM's `return_token_ids`, in the first chunk


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvfence"
    max_model_len: int
    # kvfence's pin: a greedy answer does not depend on what shares the batch (engine/info.py), so an
    # auditor may fail any answer that changes under load (audit/replay.py). None: not known yet.
    batch_invariant: bool | None = None
    # What is served, from the pools' pins (/v1/audit/info): the GGUF's architecture, its tensors per
    # storage type ({"F32": 109, "Q5_0": 81, ...}) and the file's sha256. None where a pool does not say.
    architecture: str | None = None
    quantization: dict[str, int] | None = None
    model_sha256: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
