"""vLLM's extra request parameters (its docs' "extra parameters"), shared by both generation endpoints:
implemented where they map onto what exists, accepted at their neutral values only, or refused by name.

Contracts:
- `VllmExtras` declares every extra this server knows; api/protocol.py's GenerationRequest inherits it, so an
  extra nobody declares stays a 400 naming it (extra="forbid").
- `vllm_guides()` gives each output constraint the extras set (guided_json/regex/choice/grammar and
  structured_outputs), by the parameter that set it, as grammar Guides.
- `refuse_if_set` is the one validator for "only the neutral value": every refused field in api/ uses it.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from kvfence.grammar.compiler import Guide


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: one of a JSON schema, any JSON object, a pattern, choices, a grammar."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None


def refuse_if_set(value: Any, info: ValidationInfo) -> Any:
    """Accept only a field's neutral values (None, false, 0, empty); anything else asks for a feature."""
    if value:
        raise ValueError(f"{info.field_name} is not supported by this server")
    return value


def _json_schema(value: dict[str, Any] | str) -> dict[str, Any]:
    """A schema given as an object or as its JSON text (vLLM takes both)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError("the JSON schema is not valid JSON") from None
    if not isinstance(value, dict):
        raise ValueError("a JSON schema must be an object")
    return value


class VllmExtras(BaseModel):
    """The extras' fields and their checks; the sampling ones reach SamplingParams in GenerationRequest."""

    model_config = ConfigDict(extra="forbid")

    # Implemented (kvfence.sampling, the grammar compiler, the tokenizer).
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    add_special_tokens: bool | None = None  # None: the endpoint's default (completions True, chat False)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    # Special tokens' text kept in the output or not (SamplingParams.skip_special_tokens).
    skip_special_tokens: bool = True
    # Logits masks (kvfence.sampling): ids checked against the vocabulary by the server, `bad_words`
    # encoded by it.
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1)
    bad_words: list[str] | None = None
    # The prompt's last N tokens only (-1: the window's worth), cut by the server after encoding.
    truncate_prompt_tokens: int | None = None
    # Rendering: logprob tokens as "token_id:N"; the prompt's and each choice's token ids in the answer.
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    # Accepted: which library enforces a guide changes nothing it allows; spaces between special tokens
    # are a slow HF tokenizer's join, which vLLM's fast detokenizer ignores as this tokenizer does.
    guided_decoding_backend: str | None = None
    spaces_between_special_tokens: bool = True
    # Accepted at their neutral values only (vLLM's defaults): anything else asks for what is not built.
    priority: int = 0
    length_penalty: float = 1.0
    # vLLM's: a namespace for cached KV inside the request's tenant (SamplingParams.cache_salt).
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # Refused when set: each changes the answer, or its handling, in a way this server does not implement.
    use_beam_search: bool = False
    logits_processors: Any = None
    prompt_embeds: Any = None
    guided_whitespace_pattern: str | None = None
    request_id: str | None = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    mm_processor_kwargs: Any = None

    _unsupported_vllm = field_validator(
        "use_beam_search",
        "logits_processors",
        "prompt_embeds",
        "guided_whitespace_pattern",
        "request_id",
        "kv_transfer_params",
        "vllm_xargs",
        "mm_processor_kwargs",
    )(refuse_if_set)

    @field_validator("priority", "length_penalty")
    @classmethod
    def _neutral(cls, value: float, info: ValidationInfo) -> float:
        """There is no priority scheduling (as vLLM's default fcfs policy, which refuses a priority too)
        and no beam search for a length penalty to rank."""
        neutral = {"priority": 0, "length_penalty": 1.0}[str(info.field_name)]
        if value != neutral:
            raise ValueError(f"{info.field_name}: only {neutral} is supported by this server")
        return value

    @field_validator("stop_token_ids", "allowed_token_ids")
    @classmethod
    def _token_ids(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None and any(t < 0 for t in ids):
            raise ValueError("token ids are >= 0")
        return ids

    @field_validator("bad_words")
    @classmethod
    def _words(cls, words: list[str] | None) -> list[str] | None:
        if words is not None and any(not word.strip() for word in words):
            raise ValueError("bad words must hold more than white space")
        return words

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keep(cls, keep: int | None) -> int | None:
        if keep is not None and keep < 1 and keep != -1:
            raise ValueError("keeps the prompt's last N tokens (N >= 1), or -1 for the model's window")
        return keep

    @field_validator("guided_json")
    @classmethod
    def _guided_schema(cls, schema: dict[str, Any] | str | None) -> dict[str, Any] | None:
        return None if schema is None else _json_schema(schema)

    def vllm_guides(self) -> dict[str, Guide]:
        """Each output constraint the extras set, by the parameter that set it."""
        found: dict[str, Guide] = {}
        if self.guided_json is not None:
            found["guided_json"] = Guide("json", self.guided_json)
        for name, kind in (
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "lark"),
        ):
            if getattr(self, name) is not None:
                found[name] = Guide(kind, getattr(self, name))  # type: ignore[arg-type]
        if self.structured_outputs is not None:
            found |= {f"structured_outputs.{n}": g for n, g in _structured(self.structured_outputs).items()}
        return found


def _structured(outputs: StructuredOutputs) -> dict[str, Guide]:
    found: dict[str, Guide] = {}
    if outputs.json_ is not None:
        found["json"] = Guide("json", _json_schema(outputs.json_))
    if outputs.json_object:
        found["json_object"] = Guide("json", {"type": "object"})
    for name, kind in (("regex", "regex"), ("choice", "choice"), ("grammar", "lark")):
        if getattr(outputs, name) is not None:
            found[name] = Guide(kind, getattr(outputs, name))  # type: ignore[arg-type]
    return found
