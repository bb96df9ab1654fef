"""Copy-heavy prompts, the workload speculative decoding is for: return a code file with one name changed,
edit one field of a JSON document, quote a retrieved passage. Plain completion prompts (a base model
continues them as an instruction model does), each fresh: its names, values and words come from a seeded
generator, so no two share a prefix the cache could serve.

Contract: `copy_prompts(tokenizer, count, seed)` returns `count` token lists, the same for the same seed.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable

from kvfence.model.tokenizer import Tokenizer

_WORDS = (
    "river",
    "stone",
    "ledger",
    "harbor",
    "copper",
    "lantern",
    "orchard",
    "signal",
    "meadow",
    "archive",
    "beacon",
    "quarry",
    "willow",
    "summit",
    "cipher",
    "garden",
    "falcon",
    "timber",
    "canyon",
    "mirror",
    "ember",
    "glacier",
    "prairie",
    "compass",
    "thistle",
)


def _name(rng: random.Random) -> str:
    return "_".join(rng.sample(_WORDS, 2))


def _code(rng: random.Random) -> str:
    old, new, arg = _name(rng), _name(rng), rng.choice(_WORDS)
    body = "\n".join(
        f"    {rng.choice(_WORDS)}_{i} = {arg} * {rng.randint(2, 99)} + {rng.randint(0, 9)}" for i in range(8)
    )
    code = f"def {old}({arg}):\n{body}\n    return {arg}\n\n\nprint({old}({rng.randint(1, 9)}))\n"
    return f"Here is a Python file.\n\n{code}\nHere is the same file with `{old}` renamed to `{new}`:\n\n"


def _json(rng: random.Random) -> str:
    document = {_name(rng): rng.choice([rng.randint(0, 999), rng.choice(_WORDS)]) for _ in range(12)}
    key = rng.choice(list(document))
    text = json.dumps(document, indent=2)
    return f"JSON:\n{text}\n\nThe same JSON with {key!r} set to null:\n"


def _passage(rng: random.Random) -> str:
    sentences = [" ".join(rng.choices(_WORDS, k=rng.randint(8, 14))).capitalize() + "." for _ in range(6)]
    passage = " ".join(sentences)
    return f'Retrieved passage:\n"{passage}"\n\nQuote the passage exactly:\n"'


TASKS: tuple[Callable[[random.Random], str], ...] = (_code, _json, _passage)


def copy_prompts(tokenizer: Tokenizer, count: int, seed: int) -> list[list[int]]:
    """`count` fresh copy-heavy prompts, the three kinds in turn."""
    rng = random.Random(seed)
    return [tokenizer.encode(TASKS[i % len(TASKS)](rng)) for i in range(count)]
