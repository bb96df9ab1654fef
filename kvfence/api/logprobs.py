"""Log-probabilities in OpenAI's two shapes: chat (`choices[].logprobs.content[]`: token, logprob, bytes,
top_logprobs) and completions (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).

Contracts:
- The numbers are the engine's (kvfence.sampling): log-softmax of the model's raw logits, before bias,
  penalties, temperature, truncation or a grammar's mask, at the sampled token.
- A token's text is its own decode, special tokens included; `bytes` are that text's UTF-8 (a token holding
  half a character reads U+FFFD, as its decode does). A -inf logprob is written -9999.0, as OpenAI does:
  JSON has no infinity.
- One `LogprobsFormat` per choice (`fork`: n > 1) renders a whole answer or its stream chunk by chunk:
  completions' `text_offset` runs on across chunks; with `echo`, the prompt's tokens come first, the first
  of them with a null logprob (OpenAI's legacy shape). Tokens whose text a chunk did not carry yet (held
  back for a stop string) are rendered with the next chunk that goes out, so none is lost.
- `prompt_logprobs` renders vLLM's field of that name.
- With vLLM's `return_tokens_as_token_ids`, every token (sampled and top) is written "token_id:N" (its
  `bytes` that string's), so tokens that are not whole characters stay distinct; `text_offset` still counts
  the answer's text.
"""

from __future__ import annotations

from pydantic import BaseModel

from kvfence.model.tokenizer import Tokenizer
from kvfence.sampling import TokenLogprobs

FLOOR = -9999.0  # OpenAI's stand-in for a token the model gives no probability at all


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: the first token of an echoed prompt (nothing precedes it)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


def prompt_logprobs(
    tokenizer: Tokenizer, entries: list[TokenLogprobs | None]
) -> list[dict[str, dict[str, float | int | str | None]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (the first None), token id -> its logprob, rank and
    text, for the prompt's own token and the most likely ones at its place."""
    rendered: list[dict[str, dict[str, float | int | str | None]] | None] = []
    for entry in entries:
        if entry is None:
            rendered.append(None)
            continue
        ranked = {entry.token: (entry.logprob, entry.rank)}
        ranked |= {t: (lp, i + 1) for i, (t, lp) in enumerate(entry.top) if t != entry.token}
        rendered.append(
            {
                str(token): {
                    "logprob": max(logprob, FLOOR),
                    "rank": rank,
                    "decoded_token": tokenizer.decode([token], skip_special_tokens=False),
                }
                for token, (logprob, rank) in ranked.items()
            }
        )
    return rendered


class LogprobsFormat:
    """Renders one request's logprobs, for chat or completions, chunk by chunk or all at once."""

    def __init__(self, tokenizer: Tokenizer, chat: bool, as_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.chat = chat
        self.as_ids = as_ids  # vLLM's `return_tokens_as_token_ids`: every token written "token_id:N"
        self.offset = 0  # completions' text_offset of the next token
        self.pending: list[TokenLogprobs] = []

    def fork(self) -> LogprobsFormat:
        """A formatter of its own from here on (n > 1: one per choice), holding what this one holds (an
        echoed prompt's tokens) and counting its own `text_offset`."""
        copy = LogprobsFormat(self.tokenizer, self.chat, self.as_ids)
        copy.offset, copy.pending = self.offset, list(self.pending)
        return copy

    def add(self, entries: list[TokenLogprobs] | None) -> None:
        self.pending += entries or []

    def add_prompt(self, prompt: list[int], entries: list[TokenLogprobs | None]) -> None:
        """An echoed prompt's tokens (completions' `echo`): the first one without a logprob, as OpenAI
        renders it."""
        self.pending += [
            entry or TokenLogprobs(token, float("nan"), [])
            for token, entry in zip(prompt, entries, strict=True)
        ]

    def take(self) -> ChatLogprobs | CompletionLogprobs | None:
        """The pending tokens' logprobs in this endpoint's shape (None when there are none), then forgets
        them."""
        entries, self.pending = self.pending, []
        if not entries:
            return None
        return self._chat(entries) if self.chat else self._completion(entries)

    def _text(self, token: int) -> str:
        return f"token_id:{token}" if self.as_ids else self._decoded(token)

    def _decoded(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def _top(self, token: int, logprob: float) -> TopLogprob:
        text = self._text(token)
        return TopLogprob(token=text, logprob=max(logprob, FLOOR), bytes=list(text.encode("utf-8")))

    def _chat(self, entries: list[TokenLogprobs]) -> ChatLogprobs:
        content = [
            ChatTokenLogprob(
                **self._top(e.token, e.logprob).model_dump(), top_logprobs=[self._top(*t) for t in e.top]
            )
            for e in entries
        ]
        return ChatLogprobs(content=content)

    def _completion(self, entries: list[TokenLogprobs]) -> CompletionLogprobs:
        tokens, offsets, tops = [], [], []
        for e in entries:
            text = self._text(e.token)
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(self._decoded(e.token))  # an offset into the answer's text, ids or not
            # OpenAI: the top `logprobs` tokens, and the sampled one's always (so up to logprobs + 1).
            top = {self._text(t): max(lp, FLOOR) for t, lp in e.top}
            top.setdefault(text, max(e.logprob, FLOOR))
            tops.append(None if e.logprob != e.logprob else top)  # NaN: an echoed prompt's first token
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[None if e.logprob != e.logprob else max(e.logprob, FLOOR) for e in entries],
            top_logprobs=tops,
            text_offset=offsets,
        )
