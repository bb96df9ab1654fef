"""OpenAI's `POST /v1/embeddings` (as vLLM serves it for a generative model): one vector per input, the
final hidden state of the input's last token after the model's final norm, L2-normalized (vLLM's default
pooler for a decoder-only model: LAST, normalized; engine/embedding.py computes it beside the KV pool).

Contracts:
- `input` is a string, a list of strings, a list of token ids or a list of lists of token ids (at most
  2048 inputs, OpenAI's limit); strings are encoded as /v1/completions encodes a prompt (the model's BOS
  unless `add_special_tokens` is false). An empty input, an empty string or token list, or a token id
  outside the vocabulary is a 400 naming `input`; so is an input longer than the window
  (`context_length_exceeded`) after vLLM's `truncate_prompt_tokens` (keep the last N tokens; -1: the
  window) was applied.
- `encoding_format` "float" (the default) answers lists of floats, "base64" each vector's little-endian
  float32 bytes in base64, as OpenAI does. `dimensions` is accepted only at the model's hidden size (no
  model here is trained to be cut shorter); `user` is accepted and changes nothing. Any other field is a
  400 naming it.
- Same keys, tenants and `model` rule (404 for another) as generation; the answer is `{"object": "list",
  "data": [{"object": "embedding", "index": i, "embedding": ...}], "model", "usage"}`, with vLLM's `id`
  and `created`; the id is also the `x-request-id` header.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvfence.api.errors import APIError
from kvfence.api.prompts import truncate_prompt

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on the inputs of one request

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input: EmbeddingInput
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extras for embeddings.
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    add_special_tokens: bool = True

    @field_validator("input")
    @classmethod
    def _inputs(cls, value: EmbeddingInput) -> EmbeddingInput:
        items = _as_list(value)
        if not items:
            raise ValueError("the input is empty: send at least one string or token id list")
        if len(items) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"at most {MAX_EMBEDDING_INPUTS} inputs per request, not {len(items)}")
        for item in items:
            if not item:
                raise ValueError("an input is empty: every string and token id list needs a token")
            if isinstance(item, str):
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise ValueError(f"text is not valid Unicode (lone surrogate at {exc.start})") from None
            elif any(token < 0 for token in item):
                raise ValueError("token ids are >= 0")
        return value

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("keep at least one token (or -1: the model's window)")
        return value

    def inputs(self) -> list[str | list[int]]:
        """The inputs as a list: one string or token list becomes a list of one."""
        return _as_list(self.input)


def _as_list(value: EmbeddingInput) -> list[str | list[int]]:
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        return [value]  # type: ignore[list-item]
    return list(value)  # type: ignore[arg-type]


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage


def embedding_prompt(
    body: EmbeddingRequest,
    index: int,
    item: str | list[int],
    encode: Callable[[str, bool], list[int]],
    window: int,
    vocab: int,
) -> list[int]:
    """One input's token ids: `encode`d (strings), inside the vocabulary (ids), cut to vLLM's
    `truncate_prompt_tokens` (its last N tokens) and within the window (APIError 400 naming `input`)."""
    where = f"input[{index}]"
    if isinstance(item, str):
        prompt = encode(item, body.add_special_tokens)
    else:
        prompt = item
        if any(not 0 <= token < vocab for token in prompt):
            raise APIError(400, f"{where}: token ids must be in [0, {vocab})", param="input")
    prompt = truncate_prompt(prompt, body.truncate_prompt_tokens, window)
    if not prompt:
        raise APIError(400, f"{where}: the input has no tokens", param="input")
    if len(prompt) > window:
        message = (
            f"This model's maximum context length is {window} tokens. However, {where} has "
            f"{len(prompt)} tokens. Shorten it, or set truncate_prompt_tokens."
        )
        raise APIError(400, message, code="context_length_exceeded", param="input")
    return prompt


def embedding_response(
    request_id: str, model: str, vectors: list[torch.Tensor], encoding_format: str, tokens: int
) -> EmbeddingResponse:
    """The answer: each vector in the request's `encoding_format`, in input order."""
    return EmbeddingResponse(
        id=request_id,
        created=int(time.time()),
        model=model,
        data=[Embedding(index=i, embedding=encode_vector(v, encoding_format)) for i, v in enumerate(vectors)],
        usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
    )


def encode_vector(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    """A float32 vector as the request asked: a list of floats, or its little-endian float32 bytes in
    base64 (what OpenAI's client decodes with numpy.frombuffer(..., dtype="float32"))."""
    values = vector.detach().float().cpu().numpy()
    if encoding_format == "base64":
        return base64.b64encode(values.astype("<f4").tobytes()).decode("ascii")
    return list(values.tolist())
