"""vLLM's `--reasoning-parser`: a chat answer's `<think>...</think>` block split out of its content into
`reasoning_content` (and vLLM's newer name for it, `reasoning`), whole or delta by delta.

Contracts:
- PARSERS names the styles: `qwen3` (reasoning only where the answer opens with `<think>`, leading
  whitespace aside: Qwen 3 with `enable_thinking` false, or any model that does not think, answers content
  only) and `deepseek_r1` (everything before `</think>` is reasoning, a leading `<think>` dropped: R1's
  template writes the opening tag into the prompt). `check_parser` refuses any other name, naming these.
- The prompt has the last word: a prompt that ends (whitespace aside) with `</think>` (Qwen 3's template
  with `enable_thinking` false writes the empty block there) gives content only, one that ends with
  `<think>` reasoning first, under either style.
- The tags are found in the text, wherever the tokens split them; a tag's start at the end of the text
  so far is held back until the next text says what it is. The tags themselves are never handed out, and
  only one block is split off: after `</think>` everything is content. An answer cut off inside the block
  (max_tokens) is reasoning to its end.
- A stream split anywhere gives, concatenated, exactly the reasoning and content of the whole text.
- Usage's `reasoning_tokens` (`ReasoningCounter`) counts token ids, not characters: an answer's tokens up
  to and including the one that completes `</think>`, all of them when the block never closes, none when
  the answer never reasons (qwen3 without `<think>`, a prompt that closed the block). Each token is
  decoded as the engine decodes it (`IncrementalDecoder`, the request's skip_special_tokens), so the count
  and the split agree on where the block ends, whatever the text the stream holds back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI imports this module for --reasoning-parser's choices: --help loads no model code
    from kvfence.model.tokenizer import Tokenizer

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")
# Where an answer opens and no <think> comes: qwen3's answer is content, deepseek_r1's is reasoning.
_UNOPENED = {"qwen3": "content", "deepseek_r1": "reasoning"}


def check_parser(name: str | None) -> str | None:
    """`name` when it is a known parser (None: none); ValueError naming the choices."""
    if name is not None and name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}: choose from {', '.join(PARSERS)}")
    return name


@dataclass(frozen=True)
class Reasoning:
    """How one request's answers are split: the server's parser, and the end of the prompt they follow;
    `tokenizer` and `skip_special_tokens` decode the answer's tokens for usage's count (`counter`)."""

    parser: str
    prompt_tail: str
    tokenizer: Tokenizer | None = None
    skip_special_tokens: bool = True

    def splitter(self) -> ReasoningSplitter:
        """A split for one answer as it streams."""
        return ReasoningSplitter(self.parser, self.prompt_tail)

    def counter(self) -> ReasoningCounter:
        """A count of one answer's reasoning tokens, its tokens decoded as the engine decodes them."""
        from kvfence.model.tokenizer import IncrementalDecoder

        if self.tokenizer is None:
            raise ValueError("counting reasoning tokens needs the tokenizer")
        decoder = IncrementalDecoder(self.tokenizer, self.skip_special_tokens)
        return ReasoningCounter(self.splitter(), decoder.step)

    def split(self, text: str) -> tuple[str, str]:
        """A whole answer's (reasoning, content)."""
        return self.splitter().feed(text, final=True)


class ReasoningSplitter:
    """One answer's split: `feed` each new text; each call gives the (reasoning, content) that can go out."""

    def __init__(self, parser: str, prompt_tail: str) -> None:
        tail = prompt_tail.rstrip()
        self._unopened = _UNOPENED[check_parser(parser) or ""]
        self._held = ""
        self.reasoned = False  # the answer has been inside the block (open now, or closed)
        self._enter("content" if tail.endswith(CLOSE) else "reasoning" if tail.endswith(OPEN) else "opening")

    @property
    def closed(self) -> bool:
        """Everything from here on is content (the block closed, or there is none)."""
        return self._state == "content"

    def would_reason(self) -> bool:
        """Whether the answer so far, were it to end here, has reasoning: an open or closed block, or
        (deepseek_r1) an opening that never said <think>."""
        return self.reasoned or (self._state == "opening" and self._unopened == "reasoning")

    def _enter(self, state: str) -> None:
        self._state = state
        self.reasoned = self.reasoned or state == "reasoning"

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and content in `text` (and what was held back before it) that are settled; all of
        it when `final` (the answer's last text: a tag's start that never completed is text of the part it
        was in)."""
        self._held += text
        out: dict[str, list[str]] = {"reasoning": [], "content": []}
        while self._held and self._step(out):
            pass
        if final:
            state = self._unopened if self._state == "opening" else self._state
            out[state].append(self._held)
            self._held = ""
        return "".join(out["reasoning"]), "".join(out["content"])

    def _step(self, out: dict[str, list[str]]) -> bool:
        """Move what is settled in the held text out; False when the rest must wait for more text."""
        held = self._held
        if self._state == "content":
            out["content"].append(held)
            self._held = ""
            return False
        if self._state == "opening":
            stripped = held.lstrip()
            if stripped.startswith(OPEN):
                self._enter("reasoning")
                self._held = stripped[len(OPEN) :]
                return True
            if OPEN.startswith(stripped):  # whitespace, or the tag's start: wait
                return False
            self._enter(self._unopened)
            return True
        end = held.find(CLOSE)
        if end != -1:
            out["reasoning"].append(held[:end])
            self._enter("content")
            self._held = held[end + len(CLOSE) :]
            return True
        keep = partial_tag(held, CLOSE)
        out["reasoning"].append(held[: len(held) - keep])
        self._held = held[len(held) - keep :]
        return False


class ReasoningCounter:
    """How many of one answer's tokens are reasoning (usage's `reasoning_tokens`): each token id decoded
    by `step` (an `IncrementalDecoder`'s, fresh for this answer) and fed to a split of its own, until the
    split says the block closed; the token that closed it is the last one counted."""

    def __init__(self, split: ReasoningSplitter, step: Callable[[int], str]) -> None:
        self._split, self._step = split, step
        self._read = 0  # tokens fed before the block closed, the closing one included

    def feed(self, token_ids: Iterable[int]) -> None:
        """The answer's next tokens (an output's `new_token_ids`); nothing is decoded once it closed."""
        for token in token_ids:
            if self._split.closed:
                return
            self._read += 1
            self._split.feed(self._step(token))

    @property
    def tokens(self) -> int:
        """The reasoning tokens of the answer so far, as if it ended here: a block still open (cut by
        max_tokens) holds all of them; an answer that never reasoned, none."""
        return self._read if self._split.would_reason() else 0


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that may be the start of `tag` (held back)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
