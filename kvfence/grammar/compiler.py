"""Guides (a JSON schema, a regular expression, a list of choices, a Lark grammar) compiled into llguidance
grammars over the model's own tokenizer, and one matcher per request.

Contracts:
- The llguidance tokenizer is built from kvfence's `Tokenizer` (its `tokenizers` JSON, the model's vocab
  size and every end-of-generation id as EOS): no Hugging Face hub, no transformers.
- A guide is compiled once per distinct canonical JSON of it (an LRU); each request gets a fresh copy of the
  compiled, unadvanced matcher, so requests never share parser state.
- A guide llguidance cannot honour (an unknown keyword, format or reference, a bad pattern, a grammar too
  large) raises `GrammarError` naming the problem, before anything reaches the engine.
- JSON is generated compact-but-readable (`", "`, `": "`, no free whitespace): a model cannot pad the
  output with whitespace until it runs out of tokens.
"""

from __future__ import annotations

import json
import threading
import unicodedata
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

from kvfence.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    import llguidance

CACHE_SIZE = 256  # distinct schemas kept compiled
# How JSON is written under a grammar (also inlined as "x-guidance" where a Lark grammar embeds a schema).
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Guide:
    """What the output must match: a JSON schema (`json`), a regular expression (`regex`, Rust's syntax),
    one of a list of strings (`choice`) or a Lark grammar (`lark`, llguidance's dialect)."""

    kind: Literal["json", "regex", "choice", "lark"]
    spec: Any  # a schema dict, a pattern, a list of strings or the grammar's text


_WHAT = {"json": "JSON schema", "regex": "regular expression", "choice": "choice", "lark": "grammar"}


# Unicode categories a pattern, choice or grammar may not hold: control characters (but tab, newline and
# carriage return), unassigned and private-use code points. llguidance 1.9 masked bytes for such a pattern
# that its parser then refused mid-answer (a fuzzed guided_regex: 500 grammar_error for a valid request).
_UNMATCHABLE = {"Cc", "Cn", "Co"}


def _check_text(text: str) -> None:
    for char in text:
        if unicodedata.category(char) in _UNMATCHABLE and char not in "\t\n\r":
            raise ValueError(f"U+{ord(char):04X} (control, unassigned or private use) is not supported")


def _llguidance() -> ModuleType:
    """llguidance, imported with the first guide: a server that compiles none never maps its native library
    (2.4 MiB resident, of a bound the 1B file's server meets by a MiB or two)."""
    import llguidance

    return llguidance


def _grammar(guide: Guide) -> str:
    """llguidance's grammar for `guide`; ValueError when the spec is malformed."""
    llguidance = _llguidance()
    if guide.kind != "json":
        for text in guide.spec if guide.kind == "choice" else [guide.spec]:
            _check_text(text)
    if guide.kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(guide.spec, defaults=JSON_OPTIONS)
    if guide.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(guide.spec)
    if guide.kind == "choice":
        # One Lark alternative per string, each a JSON-quoted literal: no choice is read as a pattern.
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in guide.spec)
        )
    return llguidance.LLMatcher.grammar_from_lark(guide.spec)


class GrammarError(ValueError):
    """The schema cannot be turned into a grammar; the message names why (the API answers 400)."""


class RequestGrammar:
    """One request's position in its grammar: the mask for the next token, then the sampled token.
    `guide`: what it was compiled from (the disaggregated router sends that to decode, never a matcher)."""

    def __init__(self, matcher: llguidance.LLMatcher, guide: Guide | None = None) -> None:
        self.matcher, self.guide = matcher, guide

    @property
    def error(self) -> str:
        """The matcher's error, "" while it is healthy."""
        return self.matcher.get_error()

    @property
    def is_done(self) -> bool:
        """The output is complete: nothing but EOS may follow (or the matcher consumed EOS)."""
        return self.matcher.is_stopped()

    def advance(self, token: int) -> bool:
        """Consume a sampled token; False when the matcher rejects it (then it stays in error)."""
        return self.matcher.consume_token(token)

    def look_ahead(self, tokens: list[int], at: Callable[[llguidance.LLMatcher], object]) -> bool:
        """Call `at` with the matcher as it would be after `tokens` (drafts not yet accepted), then put it
        back where it was. False, `at` not called and the matcher untouched, when the grammar refuses one
        of them (checked before any is consumed: a refused token would leave the matcher in error)."""
        if self.matcher.validate_tokens(tokens) < len(tokens):
            return False
        if tokens:
            self.matcher.consume_tokens(tokens)
        at(self.matcher)
        if tokens:
            self.matcher.rollback(len(tokens))
        return True


class GrammarCompiler:
    """Compiles schemas for one tokenizer. Thread-safe: the API compiles on its worker threads."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = CACHE_SIZE) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._cache_size = cache_size
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._llg_tokenizer: llguidance.LLTokenizer | None = None
        self.compilations = 0  # schemas compiled (cache misses), for tests and the bench

    def for_schema(self, schema: dict[str, Any]) -> RequestGrammar:
        """A fresh matcher for `schema`; GrammarError when it cannot be compiled."""
        return self.for_guide(Guide("json", schema))

    def for_guide(self, guide: Guide) -> RequestGrammar:
        """A fresh matcher for `guide`; GrammarError when it cannot be compiled."""
        key = json.dumps([guide.kind, guide.spec], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        with self._lock:
            template = self._cache.get(key)
            if template is None:
                template = self._compile(guide)
                self._cache[key] = template
                if len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
            # deep_copy shares the compiled lexer and parser tables: microseconds, not a compile.
            return RequestGrammar(template.deep_copy(), guide)

    def _compile(self, guide: Guide) -> llguidance.LLMatcher:
        what = _WHAT[guide.kind]
        try:
            grammar = _grammar(guide)
        except ValueError as exc:
            raise GrammarError(f"invalid {what}: {exc}") from None
        tokenizer, llguidance = self._llg(), _llguidance()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise GrammarError(f"unsupported {what}: {'; '.join(messages)}")
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"unsupported {what}: {matcher.get_error()}")
        self.compilations += 1
        return matcher

    def _llg(self) -> llguidance.LLTokenizer:
        """Built on first use (about half a second for a 49k vocab), then shared by every grammar."""
        if self._llg_tokenizer is None:
            self._llg_tokenizer = _llguidance().LLTokenizer(
                self._tokenizer.backend_json(),
                n_vocab=self._vocab_size,
                eos_token=sorted(self._tokenizer.stop_token_ids),
            )
        return self._llg_tokenizer
