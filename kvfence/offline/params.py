"""vLLM's `SamplingParams` for the offline API: vLLM's field names and defaults (vllm/sampling_params.py),
turned into the engine's own parameters (kvfence.sampling.SamplingParams).

Contracts:
- Every field kvfence honours means what it means in vLLM: `temperature` below 1e-5 is greedy (as vLLM and
  the server), `top_k` -1 is off, `stop` may be one string, `max_tokens` None is the rest of the window;
  `bad_words` are encoded as the server encodes them (`bad_words_token_ids`, given to `engine_params`),
  `truncate_prompt_tokens` is applied by the LLM as the server applies it (`truncate_prompt`), and
  `spaces_between_special_tokens` changes nothing (as in vLLM's fast detokenizer).
- A vLLM field kvfence cannot honour, set to anything but its neutral value, is a ValueError naming it when
  the params are made; so is a value out of its range (the engine's own checks, run then too). A name vLLM
  does not define is Python's TypeError naming it. Nothing is silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvfence.api.protocol import GREEDY_TEMPERATURE, GREEDY_TOP_P
from kvfence.sampling import SamplingParams as EngineParams

# vLLM's fields that change what is generated in ways this engine does not implement, with the value that
# asks for nothing (the only one accepted).
_NEUTRAL: dict[str, Any] = {
    "detokenize": True,
    "logits_processors": None,
    "guided_decoding": None,
    "structured_outputs": None,
    "extra_args": None,
}


@dataclass
class SamplingParams:
    """vLLM's sampling parameters (vLLM's defaults: temperature 1.0, max_tokens 16)."""

    n: int = 1
    best_of: int | None = None  # only None or n: candidates beyond the returned ones are not generated
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: the rest of the window
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    logits_processors: Any = None
    guided_decoding: Any = None
    structured_outputs: Any = None
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        for name, neutral in _NEUTRAL.items():
            if getattr(self, name) != neutral:
                raise ValueError(f"{name}: not supported by kvfence (only {neutral!r})")
        if self.n < 1:
            raise ValueError("n must be at least 1")
        if self.best_of not in (None, self.n):
            raise ValueError("best_of: supported only equal to n")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError("seed must be in [0, 2**64)")  # what torch.Generator.manual_seed takes
        if self.top_k < -1:
            raise ValueError("top_k must be -1 (off), 0 (off) or positive")
        self.engine_params(default_max_tokens=1)  # the engine's range checks, now rather than at generate

    def engine_params(
        self,
        default_max_tokens: int,
        cache_salt: str | None = None,
        bad_words_token_ids: list[list[int]] | None = None,
    ) -> EngineParams:
        """The engine's parameters; `default_max_tokens` where `max_tokens` is None (the rest of the window),
        `cache_salt` the prompt's (vLLM carries it on the prompt, not here), `bad_words_token_ids` the
        encoding of `bad_words` (it needs the tokenizer: the LLM's)."""
        # Out-of-range values pass through, for the engine's checks to name them.
        greedy = 0 <= self.temperature < GREEDY_TEMPERATURE or 0 < self.top_p < GREEDY_TOP_P
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if "" in stop:
            raise ValueError("stop strings must be non-empty")
        return EngineParams(
            max_tokens=default_max_tokens if self.max_tokens is None else self.max_tokens,
            temperature=0.0 if greedy else self.temperature,
            top_p=1.0 if greedy else self.top_p,
            top_k=max(self.top_k, 0),
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=dict(self.logit_bias or {}),
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            seed=self.seed,
            stop=stop,
            ignore_eos=self.ignore_eos,
            stop_token_ids=list(self.stop_token_ids or []),
            min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            cache_salt=cache_salt,
            skip_special_tokens=self.skip_special_tokens,
            allowed_token_ids=None if self.allowed_token_ids is None else list(self.allowed_token_ids),
            bad_words_token_ids=bad_words_token_ids or [],
        )
