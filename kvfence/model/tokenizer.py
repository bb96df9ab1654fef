"""Byte-level BPE tokenizer and chat template, rebuilt from a GGUF file's own metadata.

Contract: `Tokenizer` encodes like llama.cpp does for the file (same vocab, merges, pre-tokenizer and
special tokens), and `apply_chat_template` renders the file's jinja template as HF does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers

if TYPE_CHECKING:
    from kvfence.model.gguf import GGUFModel

_CONTROL = 3  # llama.cpp token type: control token (<|im_start|>, <|endoftext|>, ...)
_USER_DEFINED = 4  # llama.cpp token type: added token that is matched whole but is not special

# Texts llama.cpp also treats as end-of-generation when they are control tokens (llama-vocab.cpp).
_END_OF_GENERATION_TEXTS = frozenset(
    {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>"}
)

# llama.cpp's regex for the "llama-bpe" (Llama 3) pre-tokenizer.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def pre_tokenizer_for(pre_type: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer matching llama.cpp's `tokenizer.ggml.pre` type; ValueError for unknown ones.

    A wrong pre-tokenizer still round-trips but produces token ids the model was never trained on,
    so an unknown type is refused rather than approximated. A file without the key gets llama.cpp's
    "default" regex set, which is not implemented here either.
    """
    if pre_type == "smollm":
        # Every digit is its own pre-token (llama.cpp's "\p{N}" split), then GPT-2's byte-level regex.
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    if pre_type == "gpt-2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    if pre_type == "llama-bpe":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre_type!r} (known: smollm, gpt-2, llama-bpe)")


def _raise_exception(message: str) -> None:
    """Exposed to chat templates, which call it to reject malformed conversations."""
    raise jinja2.exceptions.TemplateError(message)


class Tokenizer:
    """Encode/decode text and render chat prompts for one GGUF model."""

    def __init__(self, metadata: Mapping[str, object]) -> None:
        """Build from GGUF metadata; needs `tokenizer.ggml.{model,tokens,merges,token_type,eos_token_id}`."""
        tokenizer_model = metadata.get("tokenizer.ggml.model")
        if tokenizer_model != "gpt2":
            raise ValueError(
                f"unsupported GGUF tokenizer model {tokenizer_model!r}: only byte-level BPE ('gpt2')"
            )
        self._tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
        token_types: list[int] = list(metadata["tokenizer.ggml.token_type"])
        self._backend = self._build_backend(metadata, token_types)
        self._bos_token_id = _optional_int(metadata.get("tokenizer.ggml.bos_token_id"))
        self._add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
        self._eos_token_id = int(metadata["tokenizer.ggml.eos_token_id"])
        self._stop_token_ids = self._end_of_generation_ids(metadata, token_types)
        template = metadata.get("tokenizer.chat_template")
        self._template_source = None if template is None else str(template)
        self._chat_template = _compile_template(self._template_source)

    @classmethod
    def from_gguf(cls, model: GGUFModel) -> Tokenizer:
        """The tokenizer stored in a loaded GGUF model's metadata."""
        return cls(model.metadata)

    def _build_backend(self, metadata: Mapping[str, object], token_types: list[int]) -> tokenizers.Tokenizer:
        """A `tokenizers` BPE with the file's vocab and merges; control tokens become special tokens."""
        vocab = {token: index for index, token in enumerate(self._tokens)}
        merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
        backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges))
        backend.pre_tokenizer = pre_tokenizer_for(str(metadata.get("tokenizer.ggml.pre", "default")))
        backend.decoder = decoders.ByteLevel()
        # Both kinds are matched whole in raw text (as llama.cpp does) instead of being cut into pieces.
        backend.add_special_tokens(self._tokens_of_type(token_types, _CONTROL, special=True))
        backend.add_tokens(self._tokens_of_type(token_types, _USER_DEFINED, special=False))
        return backend

    def _tokens_of_type(
        self, token_types: list[int], wanted: int, special: bool
    ) -> list[tokenizers.AddedToken]:
        """The vocab entries of token type `wanted`, as added tokens that never go through normalization."""
        return [
            tokenizers.AddedToken(token, normalized=False, special=special)
            for token, token_type in zip(self._tokens, token_types, strict=True)
            if token_type == wanted
        ]

    def _end_of_generation_ids(self, metadata: Mapping[str, object], token_types: list[int]) -> set[int]:
        """eos, eot and eom ids from the header, plus control tokens llama.cpp treats as end of turn."""
        ids = {self._eos_token_id}
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            if (token_id := _optional_int(metadata.get(key))) is not None:
                ids.add(token_id)
        ids.update(
            index
            for index, (token, token_type) in enumerate(zip(self._tokens, token_types, strict=True))
            if token_type == _CONTROL and token in _END_OF_GENERATION_TEXTS
        )
        return ids

    @property
    def eos_token_id(self) -> int:
        return self._eos_token_id

    @property
    def stop_token_ids(self) -> set[int]:
        """Ids that end a generation; a copy, so callers may not alter the tokenizer."""
        return set(self._stop_token_ids)

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special-token texts in `text` (e.g. "<|im_start|>") always map to their
        ids; `add_special_tokens` only adds BOS, and only if the file sets `tokenizer.ggml.add_bos_token`.
        """
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self._add_bos and self._bos_token_id is not None:
            return [self._bos_token_id, *ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; bytes that are not valid UTF-8 (e.g. half a character) decode to U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def backend_json(self) -> str:
        """The `tokenizers` JSON of this tokenizer (what llguidance builds its token trie from)."""
        return self._backend.to_str()

    @property
    def template_supports_tools(self) -> bool:
        """Whether the chat template renders a `tools` variable (else tools go into a system prompt)."""
        return self._template_source is not None and "tools" in self._template_source

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}]) from the file's chat template;
        `tools` (OpenAI's tool list) is passed to templates that render it, as HF does."""
        if self._chat_template is None:
            raise ValueError("this GGUF file has no tokenizer.chat_template")
        return self._chat_template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token_text(self._bos_token_id),
            eos_token=self._token_text(self._eos_token_id),
        )

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self._tokens[token_id]


def _optional_int(value: object) -> int | None:
    return None if value is None else int(value)


def _compile_template(source: object) -> jinja2.Template | None:
    """Compile a chat template with the same jinja settings HF uses, in a sandbox: it comes from a file."""
    if source is None:
        return None
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(str(source))


class IncrementalDecoder:
    """Turns a stream of token ids into text pieces whose concatenation is the decode of the whole stream.

    A character split across tokens (multi-byte UTF-8) is held back until its last byte arrives, so no
    piece ends in U+FFFD, except the final piece: bytes that can no longer be completed are then given
    out as U+FFFD, as a whole-stream decode would, rather than silently dropped. Only the ids since the
    last emitted boundary are re-decoded on each step.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix_start = 0  # ids[_prefix_start:_pending_start] give context already emitted
        self._pending_start = 0  # ids from here on are not emitted yet

    def step(self, token_id: int, final: bool = False) -> str:
        """Add one token; return the text it completes ("" while a character is still incomplete).
        `final`: no token follows, so nothing is held back any more."""
        self._ids.append(token_id)
        emitted = self._tokenizer.decode(self._ids[self._prefix_start : self._pending_start])
        text = self._tokenizer.decode(self._ids[self._prefix_start :])
        if len(text) <= len(emitted) or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix_start, self._pending_start = self._pending_start, len(self._ids)
        return text[len(emitted) :]
