"""OpenAI-compatible request and response models for /v1/completions and /v1/chat/completions.

Requests ignore unknown fields (OpenAI clients send extras), but a field asking for something this server
does not do (n > 1, best_of > 1, logprobs, echo, suffix, logit_bias, penalties, a batch of prompts) is
refused with a clear message rather than silently dropped. Text must be valid Unicode: JSON can carry lone
surrogates (`"\ud800"`), which no tokenizer can encode. api/errors.py turns every validation failure into
HTTP 400 `invalid_request_error`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from kvfence.sampling import SamplingParams

MAX_STOP_STRINGS = 4  # OpenAI's limit
# Below these, sampling is greedy (the limit it tends to) instead of breaking float32 arithmetic: logits /
# 1e-40 overflow to inf and softmax to NaN; a top_p under float32's smallest value rounds to 0 and drops
# every token. Either way the sampler raised and the step failed for the whole batch.
GREEDY_TEMPERATURE = 1e-5
GREEDY_TOP_P = 1e-5


def _valid_unicode(text: str) -> str:
    """`text` unchanged, or ValueError when it holds a lone surrogate (not encodable as UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"text is not valid Unicode (lone surrogate at position {exc.start})") from None
    return text


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class GenerationRequest(BaseModel):
    """Fields both endpoints share, and their translation into SamplingParams."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)  # None: OpenAI's default, 1
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM's convention: -1 (or 0) means off
    seed: int | None = Field(default=None, ge=0, lt=2**64)  # the range torch.Generator.manual_seed takes
    stop: list[str] = Field(default_factory=list)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    user: str | None = None  # accepted for compatibility; the tenant always comes from the API key
    ignore_eos: bool = False
    # Asked-for behaviour this server does not implement: accepted only at their neutral values.
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    _unicode_model = field_validator("model")(_valid_unicode)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n not in (None, 1):
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("logit_bias", "presence_penalty", "frequency_penalty")
    @classmethod
    def _neutral_only(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_if_set(value, info)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, stop: object) -> object:
        """A single string, a list of strings, or null; every stop string must be non-empty (an empty one
        would match at once and end every generation with no output)."""
        stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if isinstance(stops, list):
            if len(stops) > MAX_STOP_STRINGS:
                raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported")
            if any(s == "" for s in stops):
                raise ValueError("stop strings must be non-empty")
            for s in stops:
                if isinstance(s, str):
                    _valid_unicode(s)
        return stops

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The engine's parameters; `default_max_tokens` applies when the client set no limit."""
        limits = (self.max_completion_tokens, self.max_tokens, default_max_tokens)
        temperature = 1.0 if self.temperature is None else self.temperature
        top_p = 1.0 if self.top_p is None else self.top_p
        greedy = temperature < GREEDY_TEMPERATURE or top_p < GREEDY_TOP_P
        return SamplingParams(
            max_tokens=next(limit for limit in limits if limit is not None),
            temperature=0.0 if greedy else temperature,
            top_p=1.0 if greedy else top_p,
            top_k=max(self.top_k or 0, 0),
            seed=self.seed,
            stop=list(self.stop),
            ignore_eos=self.ignore_eos,
        )


def _refuse_if_set(value: Any, info: ValidationInfo) -> Any:
    """Accept only a field's neutral values (None, false, 0, empty); anything else asks for a feature."""
    if value:
        raise ValueError(f"{info.field_name} is not supported by this server")
    return value


def _refuse_if_present(value: Any, info: ValidationInfo) -> Any:
    """Accept only null: even 0 asks for something (completions' logprobs=0 is the sampled token's)."""
    if value is not None:
        raise ValueError(f"{info.field_name} is not supported by this server")
    return value


class CompletionRequest(GenerationRequest):
    prompt: str | list[int]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    _unsupported = field_validator("echo", "suffix")(_refuse_if_set)
    _no_logprobs = field_validator("logprobs")(_refuse_if_present)

    @field_validator("best_of")
    @classmethod
    def _one_candidate(cls, best_of: int | None) -> int | None:
        if best_of not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return best_of

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: object) -> object:
        """One string or one list of token ids: batches of prompts (OpenAI's list forms) are refused."""
        if isinstance(prompt, list) and not all(_is_token_id(t) for t in prompt):
            raise ValueError(
                "prompt must be one string or one list of token ids; batches of prompts are not supported"
            )
        return prompt

    @field_validator("prompt")
    @classmethod
    def _unicode_prompt(cls, prompt: str | list[int]) -> str | list[int]:
        return _valid_unicode(prompt) if isinstance(prompt, str) else prompt


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not token 1


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str

    _unicode = field_validator("text")(_valid_unicode)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart] | None = None

    @field_validator("content")
    @classmethod
    def _unicode_content(cls, content: str | list[TextPart] | None) -> str | list[TextPart] | None:
        return _valid_unicode(content) if isinstance(content, str) else content

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None

    _unsupported = field_validator("logprobs", "top_logprobs")(_refuse_if_set)

    def template_messages(self) -> list[dict[str, str]]:
        """The conversation in the shape chat templates expect."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]


# ---- responses ----------------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: None = None


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
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvfence"
    max_model_len: int
    # kvfence's pin: a greedy answer does not depend on what shares the batch (engine/info.py), so an
    # auditor may fail any answer that changes under load (audit/replay.py). None: not known yet.
    batch_invariant: bool | None = None


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
