"""Sampling parameters: what a request asks of the sampler, validated once, and the defaults a request that
leaves a value out gets. No torch here, so the CLI and the HTTP layer can check requests without loading
it; the sampler itself is kvfence.engine.sampler.

Contracts (kept by kvfence.engine.sampler):
- `sample` turns one row of logits into one token per request. The order, as vLLM's: logit_bias, then the
  penalties (repetition over prompt + output, frequency and presence over the output), then greedy argmax
  or temperature, min_p, top_k, top_p and a draw: a request with a `seed` draws from its own
  torch.Generator, so that it gets the same tokens whatever else shares the batch; the others draw from
  the batch's noise, all at once.
- Rows that ask for no bias and no penalty cost nothing extra: greedy ones stay one argmax over the batch.
  Bias and penalties are applied to those rows only, vectorised over them.
- One row's failure (non-finite logits, a NaN parameter, a bias id outside the vocabulary) answers None for
  that row alone; it never reaches another row.
- A row short of its `min_tokens` cannot sample an end (EOS, unless `ignore_eos`, or a `stop_token_ids`
  entry): they go to -inf with the grammar's mask (engine/runner.py), after the raw logprobs.
- `allowed_token_ids` and `bad_words_token_ids` are masks of the same kind, at the same place: every token
  outside the allowed ones, and each bad word's last token where the output (drafts included) ends with
  the word's other tokens, go to -inf (vLLM's bad-words rule: the output only, not the prompt).
- Log-probabilities (`raw_logprobs`, `token_logprobs`) are log-softmax of the model's raw logits, before
  bias, penalties, temperature, truncation or a grammar's mask (vLLM's default "raw" mode), taken at the
  sampled token, with the `logprobs` most likely tokens beside it. `prompt_logprobs` are the same at every
  prompt token, from the logits of the position before it (the prompt's first token has none).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # OpenAI's bound on top_logprobs; vLLM's default max_logprobs
MAX_LOGIT_BIAS = 100.0  # OpenAI: a bias is in [-100, 100]
# Bounds that keep a penalised logit finite in float32 (a logit / 1e-300 is inf: the row would abort with
# non_finite_logits, found by the fuzz test); far beyond any useful penalty either way.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
# Where the GGUF keeps the model's generation settings (llama.cpp's general.sampling.* keys).
_GGUF_SAMPLING_KEYS = {
    "temperature": "general.sampling.temp",
    "top_p": "general.sampling.top_p",
    "top_k": "general.sampling.top_k",
    "min_p": "general.sampling.min_p",
    "repetition_penalty": "general.sampling.penalty_repeat",
}


MAX_CACHE_SALT = 256


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means off
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability; 0 means off
    presence_penalty: float = 0.0  # OpenAI: minus this for every token already in the output
    frequency_penalty: float = 0.0  # OpenAI: minus this times the token's count in the output
    repetition_penalty: float = 1.0  # HF/vLLM: a seen token's logit divided (> 0) or multiplied (< 0) by it
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    logprobs: int | None = None  # None: none; k: the sampled token's logprob and the k most likely
    # None: none; k: each prompt token's logprob (the first has none) and the k most likely at its place
    prompt_logprobs: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    # vLLM's: tokens that end the request as EOS does; a request short of `min_tokens` output tokens cannot
    # sample EOS or these; a stop string (or stop token's text) stays in the text when asked.
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    # vLLM's `cache_salt`: a namespace for the prefix cache and the KV tiers inside the request's tenant
    # (never across tenants: the tenant comes from the API key); requests share cached KV only when their
    # tenants and salts are equal.
    cache_salt: str | None = None
    # vLLM's: special tokens' text (a template's markers) left out of the output text, or kept. An end token
    # (EOS, a stop token id) never shows unless `include_stop_str_in_output`.
    skip_special_tokens: bool = True
    # vLLM's logits masks, after the grammar's: only these tokens may be sampled (None: any), and a bad
    # word's last token is banned wherever the output ends with the rest of the word (one token: always).
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Keys arrive as strings when the params travel as JSON (disaggregated serving): normalise them.
        self.logit_bias = {int(token): float(bias) for token, bias in self.logit_bias.items()}
        if self.cache_salt is not None and not 0 < len(self.cache_salt) <= MAX_CACHE_SALT:
            raise ValueError(f"cache_salt must be 1 to {MAX_CACHE_SALT} characters")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError("temperature must be a finite number >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2]")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]"
            )
        if any(t < 0 or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for t, b in self.logit_bias.items()):
            raise ValueError(
                f"logit_bias maps token ids >= 0 to values in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
            )
        if self.min_tokens < 0 or any(t < 0 for t in self.stop_token_ids):
            raise ValueError("min_tokens and stop_token_ids must be >= 0")
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids or any(t < 0 for t in self.allowed_token_ids)
        ):
            raise ValueError("allowed_token_ids must be a non-empty list of token ids >= 0")
        if any(not word or any(t < 0 for t in word) for word in self.bad_words_token_ids):
            raise ValueError("bad_words_token_ids must be non-empty lists of token ids >= 0")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def adjusts_logits(self) -> bool:
        """Whether bias or a penalty changes the logits before sampling (they read the token history)."""
        return bool(self.logit_bias) or (
            (self.presence_penalty, self.frequency_penalty, self.repetition_penalty) != (0.0, 0.0, 1.0)
        )


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a value out gets: the model's generation settings where its GGUF has
    them, else the server's. Greedy by default: SmolLM2-135M-Instruct answers "What is the capital of
    France?" with Paris greedily, and with French gibberish in 3 of 8 seeds at temperature 0.2."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @classmethod
    def resolve(
        cls, metadata: Mapping[str, object], overrides: Mapping[str, float | None]
    ) -> SamplingDefaults:
        """An override the operator gave wins, then the GGUF's general.sampling.* value, then the default."""
        values: dict[str, float] = {}
        for name, key in _GGUF_SAMPLING_KEYS.items():
            value = overrides.get(name)
            value = metadata.get(key) if value is None else value
            if isinstance(value, int | float):
                values[name] = int(value) if name == "top_k" else float(value)
        defaults = cls(**values)  # type: ignore[arg-type]
        SamplingParams(**vars(defaults))  # out-of-range settings fail here, at start, not per request
        return defaults


@dataclass(frozen=True)
class TokenLogprobs:
    """The sampled token's log-probability and the `logprobs` most likely tokens', best first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None  # the token's place in its distribution (1: the likeliest), where computed
