"""vLLM's allowed_token_ids and bad_words as logits masks (engine/sampler.ban_tokens): what is banned, for
which row, and that rows asking for neither are untouched."""

from __future__ import annotations

import math

import torch

from kvfence.engine.sampler import ban_tokens
from kvfence.sampling import SamplingParams


def banned(logits: torch.Tensor) -> list[set[int]]:
    return [{t for t, v in enumerate(row.tolist()) if v == -math.inf} for row in logits]


def test_a_bad_words_last_token_is_banned_only_after_its_prefix() -> None:
    words = SamplingParams(bad_words_token_ids=[[5, 6, 7], [3]])
    logits = torch.zeros(3, 10)
    ban_tokens(logits, [words, words, SamplingParams()], [[1, 5, 6], [5, 8], [5, 6]])
    assert banned(logits) == [{7, 3}, {3}, set()]


def test_allowed_token_ids_keep_their_logits_and_ban_the_rest() -> None:
    logits = torch.arange(12, dtype=torch.float32).reshape(2, 6)
    ban_tokens(logits, [SamplingParams(allowed_token_ids=[1, 4]), SamplingParams()], [[], []])
    assert logits[0].tolist() == [-math.inf, 1.0, -math.inf, -math.inf, 4.0, -math.inf]
    assert logits[1].tolist() == [6.0, 7.0, 8.0, 9.0, 10.0, 11.0]
