"""vLLM's offline `LLM`: many prompts generated together through one engine, no server.

Contracts:
- `generate` and `chat` admit every prompt of the call, then step the engine on the caller's thread until
  each has finished: continuous batching through the same scheduler, pool and fence as serving (isolation
  on unless `isolation=False` is given). Outputs come back in input order, each with its `n` choices in
  choice order.
- A prompt the engine refuses (empty, longer than the window or the pool) raises its ValueError, noting
  the prompt's place, and nothing of the call is left running. If a step raises, or the caller interrupts,
  every request of the call still live is aborted before the exception propagates: the engine is clean
  for the next call.
- Prompts as vLLM takes them: a string (encoded as /v1/completions does: with the model's BOS), or a dict
  with "prompt" (a string) or "prompt_token_ids", and optionally "cache_salt"; another key is a ValueError
  naming it. Conversations are rendered by the server's `encode_chat` (the model's chat template, or the
  `chat_template` given to LLM).
- `sampling_params` None: vLLM's defaults under the model's generation settings (its GGUF's
  general.sampling.*), as the server's defaults; one SamplingParams for all prompts or one per prompt.
- Engine options are EngineConfig's fields by name (an unknown one is a TypeError naming it), with the
  CLI's defaults: device "auto", decode steps from CUDA graphs where on CUDA unless `enforce_eager`;
  vLLM's `speculative_config` dict is `--speculative-config`'s (a ValueError naming what is wrong).
  The engine loads on a thread of its own (load_engine: the caller's thread keeps the only OpenMP pool).
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvfence.api.errors import APIError
from kvfence.api.prompts import NO_CHAT_TEMPLATE, bad_words_token_ids, encode_chat, truncate_prompt
from kvfence.api.protocol import ChatCompletionRequest
from kvfence.api.tools import template_messages
from kvfence.cli_checks import model_file, speculative_from_dict
from kvfence.config import EngineConfig
from kvfence.engine.engine import LLMEngine, load_engine
from kvfence.model.hf_dir import model_metadata
from kvfence.model.tokenizer import Tokenizer
from kvfence.offline.outputs import Collector, RequestOutput, log
from kvfence.offline.params import SamplingParams
from kvfence.sampling import SamplingDefaults
from kvfence.units import parse_size

PromptType = str | dict[str, Any]
Conversation = list[dict[str, Any]]
_PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}


class LLM:
    def __init__(
        self,
        model: str | Path | None = None,
        *,
        chat_template: str | None = None,
        enforce_eager: bool = False,
        **options: Any,
    ) -> None:
        """`model`: a GGUF path or a packaged model's name (None: the packaged SmolLM2); `chat_template`:
        jinja source in place of the file's; `options`: EngineConfig fields (`kv_cache_memory` may be
        "1GiB")."""
        config = engine_config(model, enforce_eager, options)
        self._attach(load_engine(config, log=log.info, chat_template=chat_template))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """The offline API over an engine already built (tests; a tiny model without a tokenizer takes
        token-id prompts only)."""
        llm = object.__new__(cls)
        llm._attach(engine)
        return llm

    def _attach(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._ids = itertools.count()
        metadata = model_metadata(engine.model_file) if engine.model_file else {}
        self.defaults = SamplingDefaults.resolve(metadata, {})

    def get_tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**vars(self.defaults))

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        one = isinstance(prompts, str | dict)
        items = [prompts] if one else list(prompts)  # type: ignore[list-item]
        encoded = [self._prompt(index, item) for index, item in enumerate(items)]
        return self._run(encoded, sampling_params, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; each rendered as /v1/chat/completions does."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        options = {
            "add_generation_prompt": add_generation_prompt,
            "chat_template_kwargs": chat_template_kwargs,
        }
        if tools is not None:
            options["tools"] = tools
        encoded = [self._chat_prompt(c, options) for c in conversations]  # type: ignore[arg-type]
        return self._run(encoded, sampling_params, use_tqdm)

    # ---- prompts ---------------------------------------------------------------------------------------

    def _prompt(self, index: int, item: PromptType) -> tuple[str | None, list[int], str | None]:
        """A prompt's text (None for token ids), its token ids and its cache salt."""
        if isinstance(item, str):
            item = {"prompt": item}
        if not isinstance(item, dict):
            raise ValueError(f"prompt {index}: a string, or a dict with 'prompt' or 'prompt_token_ids'")
        unknown = sorted(set(item) - _PROMPT_KEYS)
        if unknown:
            raise ValueError(f"prompt {index}: key(s) not supported: {', '.join(unknown)}")
        salt = item.get("cache_salt")
        if "prompt_token_ids" in item:
            return None, [int(token) for token in item["prompt_token_ids"]], salt
        if not isinstance(item.get("prompt"), str):
            raise ValueError(f"prompt {index}: a string, or a dict with 'prompt' or 'prompt_token_ids'")
        return item["prompt"], self._tokenizer().encode(item["prompt"], add_special_tokens=True), salt

    def _chat_prompt(
        self, conversation: Conversation, options: dict[str, Any]
    ) -> tuple[str, list[int], None]:
        tokenizer = self._tokenizer()
        if not tokenizer.has_chat_template:
            raise ValueError(NO_CHAT_TEMPLATE)
        body = ChatCompletionRequest(messages=conversation, **options)
        messages, tools = template_messages(body, tokenizer.template_supports_tools)
        try:
            ids = encode_chat(tokenizer, body, messages, tools)
        except APIError as exc:
            raise ValueError(str(exc)) from exc
        return tokenizer.decode(ids, skip_special_tokens=False), ids, None

    def _truncated(self, ids: list[int], keep: int | None) -> list[int]:
        try:
            return truncate_prompt(ids, keep, self.engine.max_model_len)
        except APIError as exc:
            raise ValueError(str(exc)) from exc

    def _tokenizer(self) -> Tokenizer:
        if self.engine.tokenizer is None:
            raise ValueError("this model has no tokenizer: give prompts as {'prompt_token_ids': [...]}")
        return self.engine.tokenizer

    # ---- the run ---------------------------------------------------------------------------------------

    def _run(
        self,
        prompts: list[tuple[str | None, list[int], str | None]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        params = self._params_per_prompt(sampling_params, len(prompts))
        collectors = self._admit(prompts, params)
        self._step_until_done(collectors, use_tqdm)
        tokenizer = self.engine.tokenizer
        return [c.output(tokenizer, p.logprobs is not None) for c, p in zip(collectors, params, strict=True)]

    def _params_per_prompt(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if len(sampling_params) != count:
            raise ValueError(
                f"{len(sampling_params)} sampling params for {count} prompts: give one, or one each"
            )
        return list(sampling_params)

    def _admit(
        self, prompts: list[tuple[str | None, list[int], str | None]], params: list[SamplingParams]
    ) -> list[Collector]:
        """Every prompt admitted, or none: a refusal aborts those admitted before it."""
        collectors: list[Collector] = []
        try:
            for (text, ids, salt), sp in zip(prompts, params, strict=True):
                request_id = str(next(self._ids))
                ids = self._truncated(ids, sp.truncate_prompt_tokens)
                window = max(1, self.engine.max_model_len - len(ids))  # max_tokens None: the rest, as vLLM
                bad = bad_words_token_ids(self._tokenizer(), sp.bad_words) if sp.bad_words else None
                engine_params = sp.engine_params(window, salt, bad)
                self.engine.add_request(ids, engine_params, request_id=request_id, n=sp.n)
                collectors.append(Collector(request_id, text, ids, sp.n))
        except ValueError as exc:  # AdmissionError among them
            exc.add_note(f"(prompt {len(collectors)})")
            self._abort(collectors)
            raise
        return collectors

    def _step_until_done(self, collectors: list[Collector], use_tqdm: bool) -> None:
        owner = {request_id: c for c in collectors for request_id in c.engine_ids}
        bar = tqdm(total=len(collectors), desc="Processed prompts", unit="prompt", disable=not use_tqdm)
        pending = set(collectors)
        try:
            while pending:
                if not self.engine.has_unfinished():
                    raise RuntimeError("the engine has no work left but requests have not finished")
                for snapshot in self.engine.step():
                    collector = owner.get(snapshot.request_id)
                    if collector is None or collector not in pending:
                        continue
                    collector.add(snapshot)
                    if collector.done:
                        pending.discard(collector)
                        bar.update(1)
        except BaseException:
            self._abort(list(pending))
            raise
        finally:
            bar.close()

    def _abort(self, collectors: list[Collector]) -> None:
        for request_id in (request_id for c in collectors for request_id in c.engine_ids):
            self.engine.abort(request_id, "cancelled")


def engine_config(model: str | Path | None, enforce_eager: bool, options: dict[str, Any]) -> EngineConfig:
    """EngineConfig from LLM's arguments, with the CLI's defaults where the caller gives none."""
    settings: dict[str, Any] = {"device": "auto", "decode_graphs": not enforce_eager} | options
    if isinstance(settings.get("kv_cache_memory"), str):
        settings["kv_cache_memory"] = parse_size(settings["kv_cache_memory"])
    try:
        path = None if model is None else model_file(str(model))
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"model {model!s}: {exc}") from None
    if (speculative := settings.pop("speculative_config", None)) is not None:  # vLLM's name and dict
        try:
            settings["speculative"] = speculative_from_dict(speculative)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"speculative_config: {exc}") from None
    return EngineConfig(model=path, **settings)
