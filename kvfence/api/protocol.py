"""OpenAI-compatible request models for /v1/completions and /v1/chat/completions (vLLM's extras in
api/vllm_extras.py, the response bodies in api/bodies.py).

Every parameter OpenAI defines is declared: implemented, accepted because it changes no answer by definition
(`user`, `metadata`, the prompt-cache hints), or refused unless neutral (best_of other than n, suffix, audio,
functions, store, reasoning_effort, ...: a 400 naming it, never silently dropped). So is each of vLLM's extra
parameters: implemented where it maps onto what exists (guided_json/regex/choice/grammar and
structured_outputs as grammars, min_tokens, stop_token_ids, include_stop_str_in_output, prompt_logprobs,
add_special_tokens, add_generation_prompt, continue_final_message, skip_special_tokens, allowed_token_ids and
bad_words as logits masks, truncate_prompt_tokens, return_token_ids, return_tokens_as_token_ids), accepted at
its neutral value only (priority 0: no priority scheduling, as vLLM's default policy), or refused by name. A
field neither defines is a 400 naming it (an ignored one would answer 200 with what it did not ask for);
nested objects (messages, tools) ignore unknown keys, as clients echo a response's extra fields back. A value
out of its range (top_logprobs over 20, a logit_bias over 100) is a 400 naming it, and so is what vLLM refuses
and a template could not render: `stream_options` without `stream`, `continue_final_message` with
`add_generation_prompt`, a user message without content, a tool message without `tool_call_id` (param
`messages`). What needs the served model is checked by the server (api/service.py): token ids inside its
vocabulary (`logit_bias`, `stop_token_ids`, `allowed_token_ids`, prompts), `min_tokens` within `max_tokens`.
/v1/completions takes one prompt or a batch (`CompletionRequest.batch`). Values a request leaves out come
from the server's `SamplingDefaults` (the model's generation settings, else the server's) and `max_tokens`
from the rest of the window. Text must be valid Unicode: JSON can carry lone surrogates (`"\ud800"`), which no
tokenizer can encode. api/errors.py turns every validation failure into HTTP 400 `invalid_request_error`.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from kvfence.api.vllm_extras import VllmExtras, refuse_if_set
from kvfence.grammar.compiler import Guide
from kvfence.grammar.strict import strict_schema
from kvfence.sampling import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    SamplingDefaults,
    SamplingParams,
)

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_N = 16  # choices per request: each is a sequence of its own in the batch and the pool
MAX_PROMPTS = 64  # prompts in one /v1/completions request, each answered as a request of its own
MAX_TEMPLATE_KWARGS = 16
TEMPLATE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
# What a client may hand the server's chat template: plain values (Qwen 3's enable_thinking is a bool).
TemplateValue = bool | int | float | str | None
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


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # OpenAI's strict mode: objects closed, every property required


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON valid against a schema."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format.json_schema is required when type is 'json_schema'")
        return self

    def output_schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must satisfy; None for free text."""
        if self.type == "json_object":
            return {"type": "object"}
        if self.type == "json_schema" and self.json_schema is not None:
            schema = self.json_schema.schema_ or {}  # OpenAI's default: no schema, any JSON value
            return strict_schema(schema) if self.json_schema.strict else schema
        return None


class GenerationRequest(VllmExtras):
    """Fields both endpoints share (vLLM's extras among them), and their translation into SamplingParams."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)  # None: the server's default
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM's convention: -1 (or 0) means off
    min_p: float | None = Field(default=None, ge=0, le=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(
        default=None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY, allow_inf_nan=False
    )
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias; ids checked by the server
    seed: int | None = Field(default=None, ge=0, lt=2**64)  # the range torch.Generator.manual_seed takes
    stop: list[str] = Field(default_factory=list)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    user: str | None = None  # accepted for compatibility; the tenant always comes from the API key
    ignore_eos: bool = False
    response_format: ResponseFormat | None = None  # enforced by a grammar (kvfence/grammar)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # vLLM's: each prompt token's

    @model_validator(mode="after")
    def _one_guide(self) -> GenerationRequest:
        """At most one way to constrain the output: two would ask for the intersection of grammars."""
        guides = self.guides()
        if len(guides) > 1:
            raise ValueError(f"only one of {', '.join(sorted(guides))} may constrain the output")
        return self

    def guides(self) -> dict[str, Guide]:
        """Each output constraint the request sets, by the parameter that set it."""
        found: dict[str, Guide] = {}
        if self.response_format is not None and (schema := self.response_format.output_schema()) is not None:
            found["response_format"] = Guide("json", schema)
        return found | self.vllm_guides()

    @field_validator("model")
    @classmethod
    def _unicode_model(cls, model: str | None) -> str | None:
        return model if model is None else _valid_unicode(model)

    @field_validator("n")
    @classmethod
    def _choices(cls, n: int | None) -> int | None:
        """1 to MAX_N choices, sampled in parallel from one computation of the prompt."""
        if n is not None and not 1 <= n <= MAX_N:
            raise ValueError(f"n must be between 1 and {MAX_N}")
        return n

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @field_validator("logit_bias")
    @classmethod
    def _bias_by_token_id(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        """Keys are token ids written as decimal strings (OpenAI's shape), values in [-100, 100]."""
        for token, value in (bias or {}).items():
            if not token.isdecimal():
                raise ValueError(f"keys must be token ids (decimal strings), got {token[:20]!r}")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(f"token {token}: a bias must be in [-100, 100], got {value}")
        return bias

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

    @field_validator("stream_options")
    @classmethod
    def _options_need_a_stream(
        cls, options: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise ValueError("stream_options can only be set when stream is true")  # vLLM's rule
        return options

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(
        self, default_max_tokens: int, defaults: SamplingDefaults, bad_words: list[list[int]] | None = None
    ) -> SamplingParams:
        """The engine's parameters; `default_max_tokens` applies when the client set no limit, `defaults`
        to every sampling value it left out; `bad_words`: `bad_words` as token sequences (the server's
        tokenizer encodes them)."""
        limits = (self.max_completion_tokens, self.max_tokens, default_max_tokens)
        temperature = defaults.temperature if self.temperature is None else self.temperature
        top_p = defaults.top_p if self.top_p is None else self.top_p
        greedy = temperature < GREEDY_TEMPERATURE or top_p < GREEDY_TOP_P
        return SamplingParams(
            max_tokens=next(limit for limit in limits if limit is not None),
            temperature=0.0 if greedy else temperature,
            top_p=1.0 if greedy else top_p,
            top_k=max(defaults.top_k if self.top_k is None else self.top_k, 0),
            min_p=defaults.min_p if self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or defaults.repetition_penalty,
            logit_bias={int(token): bias for token, bias in (self.logit_bias or {}).items()},
            logprobs=self.logprobs_wanted(),
            prompt_logprobs=self.prompt_logprobs_wanted(),
            seed=self.seed,
            stop=list(self.stop),
            ignore_eos=self.ignore_eos,
            stop_token_ids=list(self.stop_token_ids or []),
            min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            cache_salt=self.cache_salt,
            skip_special_tokens=self.skip_special_tokens,
            allowed_token_ids=self.allowed_token_ids,
            bad_words_token_ids=bad_words or [],
        )

    def logprobs_wanted(self) -> int | None:
        """How many top logprobs beside the sampled token's; None: no logprobs. Each endpoint has its own."""
        return None

    def prompt_logprobs_wanted(self) -> int | None:
        """How many top logprobs beside each prompt token's; None: none (vLLM's `prompt_logprobs`)."""
        return self.prompt_logprobs


class CompletionRequest(GenerationRequest):
    # One prompt (text or token ids), or a batch of them (OpenAI's list forms): see `batch`.
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # top k, and the sampled token's
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    _unsupported = field_validator("suffix")(refuse_if_set)

    def logprobs_wanted(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_wanted(self) -> int | None:
        """`echo` with `logprobs` reports the prompt's tokens too (OpenAI's legacy completions)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    @field_validator("best_of")
    @classmethod
    def _no_extra_candidates(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        """Candidates beyond the returned choices (ranked by logprob) are not generated: only best_of=n."""
        if best_of is not None and best_of != (info.data.get("n") or 1):
            raise ValueError("best_of is supported only equal to n")
        return best_of

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, prompt: object) -> object:
        """A string, a list of token ids, or a batch: a non-empty list of strings or of token-id lists,
        at most MAX_PROMPTS (each prompt is its own sequences in the batch and the pool)."""
        if not isinstance(prompt, list) or all(_is_token_id(t) for t in prompt):
            return prompt
        if len(prompt) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts in one request")
        ids = all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt)
        if not ids and not all(isinstance(p, str) for p in prompt):
            raise ValueError("a batch of prompts is a list of strings or a list of non-empty token-id lists")
        return prompt

    @field_validator("prompt")
    @classmethod
    def _unicode_prompt(cls, prompt: str | list[Any]) -> str | list[Any]:
        texts = [prompt] if isinstance(prompt, str) else [p for p in prompt if isinstance(p, str)]
        for text in texts:
            _valid_unicode(text)
        return prompt

    def batch(self) -> list[CompletionRequest]:
        """One request per prompt of a batch, each with everything else this one asks; [] for one prompt."""
        if isinstance(self.prompt, str) or not self.prompt or _is_token_id(self.prompt[0]):
            return []
        return [self.model_copy(update={"prompt": prompt}) for prompt in self.prompt]


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not token 1


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str

    _unicode = field_validator("text")(_valid_unicode)


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's shape)


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None  # the call is generated under its schema, forced or (with auto) once opened


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # OpenAI's `developer` is its newer name for `system`; chat templates know only the older one.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    @model_validator(mode="after")
    def _complete(self) -> ChatMessage:
        """What a template cannot render without: a user's content, and the call a tool message answers."""
        if self.role == "user" and self.content is None:
            raise ValueError("a user message needs content (null is only for an assistant's tool calls)")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id, the id of the call it answers")
        return self

    @field_validator("role")
    @classmethod
    def _developer_is_system(cls, role: str) -> str:
        return "system" if role == "developer" else role

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
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    # OpenAI's other chat parameters. Each asks for behaviour this server does not have, so anything but
    # its neutral value (absent, null, false, empty; text-only `modalities`; the default `service_tier`) is
    # refused, never ignored (tests/integration/test_sampling_api.py walks the openai client's list).
    audio: Any = None
    functions: Any = None  # the deprecated form of `tools`
    function_call: Any = None
    moderation: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    store: bool | None = None  # nothing is stored
    verbosity: Any = None
    web_search_options: Any = None
    modalities: list[str] | None = None
    service_tier: str | None = None
    # Accepted: they identify or hint and, by OpenAI's own definition, change no answer (`metadata` tags a
    # stored completion, and nothing is stored; prompt caching here is automatic, per tenant).
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    # vLLM's chat extras: the generation prompt may be left off, or the last message continued instead
    # (rendered open, without what closes it); the rest would change the rendering.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # a client's jinja is not run on this server
    # Variables for the server's own template (Qwen 3's `enable_thinking`): names, and plain values only.
    chat_template_kwargs: dict[str, TemplateValue] | None = Field(
        default=None, max_length=MAX_TEMPLATE_KWARGS
    )
    documents: Any = None
    echo: bool = False

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_names(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        if kwargs and not all(TEMPLATE_NAME.fullmatch(name) for name in kwargs):
            raise ValueError("chat_template_kwargs: names are identifiers (letters, digits, _), 1-64 long")
        return kwargs

    _unsupported = field_validator(
        "audio",
        "functions",
        "function_call",
        "moderation",
        "prediction",
        "reasoning_effort",
        "store",
        "verbosity",
        "web_search_options",
        "chat_template",
        "documents",
        "echo",
    )(refuse_if_set)

    @field_validator("continue_final_message")
    @classmethod
    def _continue_or_prompt(cls, go_on: bool, info: ValidationInfo) -> bool:
        if go_on and info.data.get("add_generation_prompt"):
            raise ValueError("cannot be true together with add_generation_prompt (set that to false)")
        return go_on

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, modalities: list[str] | None) -> list[str] | None:
        if modalities not in (None, [], ["text"]):
            raise ValueError("modalities: only text is supported by this server")
        return modalities

    @field_validator("service_tier")
    @classmethod
    def _default_tier(cls, tier: str | None) -> str | None:
        if tier not in (None, "auto", "default"):
            raise ValueError(f"service_tier {tier!r} is not supported by this server (only auto/default)")
        return tier

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs: true")
        return top

    def logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def _choice_names_a_tool(self) -> ChatCompletionRequest:
        names = {tool.function.name for tool in self.tools or []}
        if self.tool_choice not in (None, "none", "auto") and not names:
            raise ValueError("tool_choice requires tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools")
        return self

    @property
    def tool_mode(self) -> str:
        """'none', 'auto', 'required' or 'named' (OpenAI's default: auto with tools, else none)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")
