r"""Guides (a JSON schema, a regular expression, a list of choices, a grammar) compiled into llguidance
grammars over the model's own tokenizer, and one matcher per request.

Contracts:
- The llguidance tokenizer is built from kvfence's `Tokenizer` (its `tokenizers` JSON, the model's vocab
  size and every end-of-generation id as EOS): no Hugging Face hub, no transformers.
- A guide is compiled once per distinct canonical JSON of it (an LRU); each request gets a fresh copy of the
  compiled, unadvanced matcher, so requests never share parser state.
- A guide llguidance cannot honour (an unknown keyword, format or reference, a bad pattern, a grammar too
  large) raises `GrammarError` naming the problem, before anything reaches the engine.
- A grammar is GBNF/EBNF (llama.cpp's, vLLM's docs' examples) when a line defines a rule as `name ::=`,
  else Lark (llguidance's dialect); one that is neither is refused naming both syntaxes and where it failed.
- `\d` in a regular expression is an ASCII digit, `[0-9]` (and `\D` its complement), as in JSON schema
  patterns (ECMA-262) and Python's `re.ASCII`: Rust's syntax, llguidance's, would take any Unicode digit
  (`🯸`). A pattern that wants those says `\p{Nd}`. So is it in a Lark grammar's `/regex/` terminals
  (`lark_ascii_digits`), and nowhere else in it (a quoted string's `"\d"` is its own matter). GBNF has no
  `\d` (llama.cpp's escapes are `\x`, `\u`, `\U`, `\t`, `\n`, `\r` and quoted characters): the converter
  refuses it.
- JSON is generated compact-but-readable (`", "`, `": "`, no free whitespace): a model cannot pad the
  output with whitespace until it runs out of tokens.
"""

from __future__ import annotations

import json
import re
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
    one of a list of strings (`choice`) or a grammar (`lark`: llguidance's Lark dialect, or GBNF)."""

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
        return llguidance.LLMatcher.grammar_from_regex(ascii_digits(guide.spec))
    if guide.kind == "choice":
        # One Lark alternative per string, each a JSON-quoted literal: no choice is read as a pattern.
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in guide.spec)
        )
    return llguidance.LLMatcher.grammar_from_lark(_lark(guide.spec))


# A GBNF rule definition: `name ::=` at the start of a line (Lark writes `name:`, and never `::=` there).
_GBNF_RULE = re.compile(r"^\s*[A-Za-z][A-Za-z0-9_-]*\s*::=", re.MULTILINE)
SYNTAXES = "Lark (llguidance's dialect, rules as `name: ...`) or GBNF/EBNF (rules as `name ::= ...`)"


def is_gbnf(text: str) -> bool:
    return _GBNF_RULE.search(text) is not None


def _lark(text: str) -> str:
    """`text` as Lark: converted when it is GBNF (which has no `\\d`), its regex terminals' digits made ASCII
    when it is Lark; ValueError naming where a GBNF grammar fails."""
    if not is_gbnf(text):
        return lark_ascii_digits(text)
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return gbnf_to_lark(text)
    except Exception as exc:  # GbnfToLarkError, and the converter's own asserts on odd input
        raise ValueError(f"as GBNF: {exc}") from None


def ascii_digits(pattern: str) -> str:
    r"""`pattern` with `\d` as `[0-9]` and `\D` as `[^0-9]`, in character classes too (`[\d_]` is
    `[0-9_]`, `[a\D]` is `[a[^0-9]]`: Rust's nested class); every other escape is copied as it stands."""
    out, depth, i = [], 0, 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\" and i + 1 < len(pattern):
            escape = pattern[i : i + 2]
            out.append({"\\d": "0-9" if depth else "[0-9]", "\\D": "[^0-9]"}.get(escape, escape))
            i += 2
            continue
        if char == "[":
            # A class's opening `[`, `[^` and a leading `]` (a literal there) are copied whole.
            opening = re.match(r"\[\^?\]?", pattern[i:])
            assert opening is not None
            out.append(opening.group())
            i += len(opening.group())
            depth += 1
            continue
        if char == "]" and depth:
            depth -= 1
        out.append(char)
        i += 1
    return "".join(out)


# llguidance's Lark lexemes that may hold a `/` or a `\d` without being a regex terminal, so are copied as
# they stand: a comment (`//` or `#` to the line's end), a JSON-quoted string (also every string of a
# `%json {...}` schema), a special token (`<|im_end|>`, `</s>`). Then the regex terminal, `/.../` (at least
# one character: `//` opens a comment), any escape (`\/`, `\\`) inside, its flags left behind it.
_LARK_LEXEME = re.compile(r'(?://|#)[^\n]*|"(?:\\.|[^"\\\n])*"|<[^<>\s]+>|/(?P<regex>(?:\\.|[^/\\])+)/')


def lark_ascii_digits(grammar: str) -> str:
    """`grammar` (Lark) with `ascii_digits` applied to each `/regex/` terminal's pattern, and to nothing
    else."""

    def rewrite(match: re.Match[str]) -> str:
        regex = match.group("regex")
        return match.group() if regex is None else f"/{ascii_digits(regex)}/"

    return _LARK_LEXEME.sub(rewrite, grammar)


def _syntaxes(guide: Guide) -> str:
    """For a grammar's error: the syntaxes accepted, and which one it was read as."""
    if guide.kind != "lark":
        return ""
    return f"accepted are {SYNTAXES}; " + ("" if is_gbnf(guide.spec) else "as Lark: ")


class GrammarError(ValueError):
    """The schema cannot be turned into a grammar; the message names why (the API answers 400)."""


class RequestGrammar:
    """One request's position in its grammar: the mask for the next token, then the sampled token.
    `guide`: what it was compiled from (the disaggregated router sends that to decode, never a matcher)."""

    def __init__(self, matcher: llguidance.LLMatcher, guide: Guide | None = None) -> None:
        self.matcher, self.guide = matcher, guide

    def fork(self) -> RequestGrammar:
        """A matcher of its own at this one's position (n > 1: one per choice); later tokens fed to
        either leave the other where it was. deep_copy shares the compiled tables, as `for_guide`'s."""
        return RequestGrammar(self.matcher.deep_copy(), self.guide)

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
            raise GrammarError(f"invalid {what}: {_syntaxes(guide)}{exc}") from None
        tokenizer, llguidance = self._llg(), _llguidance()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise GrammarError(f"unsupported {what}: {_syntaxes(guide)}{'; '.join(messages)}")
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
