"""vLLM's `/tokenize` and `/detokenize`: the served model's own token ids for a prompt or a conversation (what
a client needs to write `logit_bias`, `stop_token_ids` or a prompt of ids), and the text of ids.

Contracts:
- `/tokenize` takes exactly one of `prompt` (encoded as /v1/completions would: the model's BOS unless
  `add_special_tokens` is false) or `messages` (rendered as /v1/chat/completions would, with
  `add_generation_prompt`), and answers `count`, `max_model_len`, `tokens` and, when asked, `token_strs`.
- `/detokenize` takes `tokens` inside the vocabulary (else a 400 naming it) and answers `prompt`, special
  tokens written out.
- Both sit behind the same API keys as generation, and a `model` other than the served one is a 404.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvfence.api.protocol import ChatMessage


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # None: the endpoint's default (prompt: true, messages: false)
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
