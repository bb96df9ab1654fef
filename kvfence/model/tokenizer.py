"""Tokenizer and chat template, rebuilt from a GGUF file's own metadata: byte-level BPE
(`tokenizer.ggml.model` "gpt2": SmolLM2, Llama 3, Qwen) or SentencePiece ("llama": Gemma 3, Mistral, Llama 2);
or, for a Hugging Face directory, its tokenizer.json as it is (`from_hf_dir`).

Contract: `Tokenizer` encodes like llama.cpp does for the file (same vocab, merges or scores, pre-tokenizer
and special tokens), and `apply_chat_template` renders the file's jinja template (or the one given instead)
as HF does. Control and user-defined tokens are matched whole in the text, as llama.cpp matches them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers

from kvfence.model import hf_dir

if TYPE_CHECKING:
    from kvfence.model.gguf import GGUFModel

_NORMAL = 1  # llama.cpp token type: an ordinary vocab entry, the only kind SentencePiece merges into
_CONTROL = 3  # llama.cpp token type: control token (<|im_start|>, <|endoftext|>, ...)
_USER_DEFINED = 4  # llama.cpp token type: added token that is matched whole but is not special
_SPM_SPACE = "\u2581"  # SentencePiece's visible space: "▁"

# Texts llama.cpp also treats as end-of-generation when they are control tokens (llama-vocab.cpp).
_END_OF_GENERATION_TEXTS = frozenset(
    {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>"}
)

# llama.cpp's regex for the "llama-bpe" (Llama 3) pre-tokenizer.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's regex for "qwen2" (Qwen 2, 2.5, 3): llama-bpe's, but every digit is its own pre-token.
_QWEN2_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}


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
    if pre_type in _SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre_type]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre_type!r} (known: smollm, gpt-2, llama-bpe, qwen2)")


def spm_merges(tokens: list[str], scores: list[float], token_types: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to llama.cpp's SentencePiece merging (llm_tokenizer_spm), best first.

    llama.cpp repeatedly joins the adjacent pair whose concatenation is the vocab entry of highest score;
    as merges, that is every split of every normal token into two vocab entries, ranked by the token's
    score, equal scores in vocab order. Only normal tokens are merge results: control and user-defined
    ones are matched whole before merging, and byte tokens come from byte fallback, not from text.
    """
    index = {token: position for position, token in enumerate(tokens)}
    ranked: list[tuple[float, int, str, str]] = []  # (-score, position, left, right): sorts best first
    for position, token in enumerate(tokens):
        if token_types[position] != _NORMAL:
            continue
        for cut in range(1, len(token)):
            # A plain loop slicing each piece once: on Gemma's 262144 tokens this is the slow part.
            left = token[:cut]
            if left in index and (right := token[cut:]) in index:
                ranked.append((-scores[position], position, left, right))
    # One token's splits never compete (a span of text is split one way at a time): their order is moot.
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]


# The `tokenizer.ggml.model` kinds built here, and whether a file without `tokenizer.ggml.add_bos_token`
# gets BOS: llama.cpp adds it for SentencePiece.
_DEFAULT_ADD_BOS = {"gpt2": False, "llama": True}


def _byte_level_backend(metadata: Mapping[str, object], tokens: list[str]) -> tokenizers.Tokenizer:
    """A byte-level BPE with the file's vocab, merges and pre-tokenizer."""
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizer_for(str(metadata.get("tokenizer.ggml.pre", "default")))
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_backend(
    metadata: Mapping[str, object], tokens: list[str], token_types: list[int]
) -> tokenizers.Tokenizer:
    """llama.cpp's SentencePiece tokenizer as a `tokenizers` BPE: spaces become "▁" (plus one in front
    when the file sets `add_space_prefix`, llama.cpp's default), pieces merge by score (`spm_merges`),
    and a character outside the vocab falls back to its <0xXX> byte tokens."""
    scores = [float(score) for score in metadata["tokenizer.ggml.scores"]]
    unknown = _optional_int(metadata.get("tokenizer.ggml.unknown_token_id"))
    model = models.BPE(
        vocab={token: index for index, token in enumerate(tokens)},
        merges=spm_merges(tokens, scores, token_types),
        unk_token=None if unknown is None else tokens[unknown],
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = tokenizers.Tokenizer(model)
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    spaces = normalizers.Replace(" ", _SPM_SPACE)
    # tokenizers normalizes each stretch of text between added tokens on its own, so the prefix goes
    # in front of every stretch: llama.cpp also prefixes the text after every special token.
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(_SPM_SPACE), spaces]) if prefix else spaces
    pieces = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    # llama.cpp drops the prefix space again from the first piece it detokenizes.
    backend.decoder = decoders.Sequence([*pieces, decoders.Strip(" ", 1, 0)] if prefix else pieces)
    return backend


class NoChatTemplateError(ValueError):
    """The GGUF file has no `tokenizer.chat_template` and no template was given in its place."""


def _raise_exception(message: str) -> None:
    """Exposed to chat templates, which call it to reject malformed conversations."""
    raise jinja2.exceptions.TemplateError(message)


class Tokenizer:
    """Encode/decode text and render chat prompts for one GGUF model."""

    def __init__(self, metadata: Mapping[str, object], chat_template: str | None = None) -> None:
        """Build from GGUF metadata: `tokenizer.ggml.{model,tokens,token_type,eos_token_id}`, plus `merges`
        for byte-level BPE or `scores` for SentencePiece. `chat_template` (jinja source) replaces the
        file's `tokenizer.chat_template`."""
        tokenizer_model = metadata.get("tokenizer.ggml.model")
        if tokenizer_model not in _DEFAULT_ADD_BOS:
            raise ValueError(
                f"unsupported GGUF tokenizer model {tokenizer_model!r}: "
                "only byte-level BPE ('gpt2') and SentencePiece ('llama')"
            )
        template = chat_template if chat_template is not None else metadata.get("tokenizer.chat_template")
        self._setup(*self._read_vocab(metadata, _DEFAULT_ADD_BOS[str(tokenizer_model)]), template)

    @classmethod
    def _read_vocab(
        cls, metadata: Mapping[str, object], default_bos: bool
    ) -> tuple[tokenizers.Tokenizer, int, int | None, bool, int, set[int]]:
        """The backend and the ids `_setup` takes. The vocab's texts are read here and not kept (the backend
        holds them; 49,152 strings are 3.4 MiB): they are gone before `_setup` compiles the template, whose
        objects would otherwise share allocator arenas with them and keep those from being returned."""
        tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
        token_types: list[int] = list(metadata["tokenizer.ggml.token_type"])
        eos = int(metadata["tokenizer.ggml.eos_token_id"])
        return (
            cls._build_backend(metadata, tokens, token_types),
            len(tokens),
            _optional_int(metadata.get("tokenizer.ggml.bos_token_id")),
            bool(metadata.get("tokenizer.ggml.add_bos_token", default_bos)),
            eos,
            _end_of_generation_ids(eos, metadata, tokens, token_types),
        )

    def _setup(
        self,
        backend: tokenizers.Tokenizer,
        vocab_size: int,
        bos: int | None,
        add_bos: bool,
        eos: int,
        stop_ids: set[int],
        template: object,
    ) -> None:
        """The one place a tokenizer's fields are set, whichever files it came from."""
        for name, token_id in (("bos", bos), ("eos", eos)):
            if token_id is not None and not 0 <= token_id < vocab_size:
                raise ValueError(f"the model's {name} token id {token_id} is outside its {vocab_size} tokens")
        self._backend, self._vocab_size = backend, vocab_size
        self._bos_token_id, self._add_bos, self._eos_token_id = bos, add_bos, eos
        self._stop_token_ids = stop_ids
        self._bos_text = "" if bos is None else str(backend.id_to_token(bos))
        self._eos_text = str(backend.id_to_token(eos))
        self._template_source = None if template is None else str(template)
        self._chat_template = _compile_template(self._template_source)

    @classmethod
    def from_gguf(cls, model: GGUFModel, chat_template: str | None = None) -> Tokenizer:
        """The tokenizer of a loaded model: a GGUF file's, from its metadata; a Hugging Face directory's
        (hf_load.load_hf_dir gives the same GGUFModel), from its files (`from_hf_dir`). `chat_template`
        as in `__init__`."""
        if model.path.is_dir():
            return cls.from_hf_dir(model.path, chat_template)
        return cls(model.metadata, chat_template)

    @staticmethod
    def _build_backend(
        metadata: Mapping[str, object], tokens: list[str], token_types: list[int]
    ) -> tokenizers.Tokenizer:
        """The file's kind of `tokenizers` model; control tokens become special tokens."""
        if metadata["tokenizer.ggml.model"] == "llama":
            backend = _sentencepiece_backend(metadata, tokens, token_types)
        else:
            backend = _byte_level_backend(metadata, tokens)
        # Both kinds are matched whole in raw text (as llama.cpp does) instead of being cut into pieces.
        backend.add_special_tokens(_tokens_of_type(tokens, token_types, _CONTROL, special=True))
        backend.add_tokens(_tokens_of_type(tokens, token_types, _USER_DEFINED, special=False))
        return backend

    @classmethod
    def from_hf_dir(cls, path: Path, chat_template: str | None = None) -> Tokenizer:
        """The tokenizer of a Hugging Face directory: tokenizer.json as it is (HF's own normalizer,
        pre-tokenizer and added tokens), BOS and EOS from tokenizer_config.json (else generation_config.json
        or config.json), the chat template from chat_template.jinja or tokenizer_config.json's
        `chat_template` (`chat_template` as in `__init__`). Stop ids: EOS, the generation config's
        eos_token_id(s), and special tokens llama.cpp treats as end of turn."""
        backend = tokenizers.Tokenizer.from_file(str(path / hf_dir.TOKENIZER))
        settings = hf_dir.read_json(path, hf_dir.TOKENIZER_CONFIG, required=False)
        generation = hf_dir.read_json(path, hf_dir.GENERATION_CONFIG, required=False)
        fallback = generation | {
            k: v for k, v in hf_dir.read_json(path, hf_dir.CONFIG).items() if k not in generation
        }
        bos = _special_id(backend, settings.get("bos_token"), fallback.get("bos_token_id"))
        eos = _special_id(backend, settings.get("eos_token"), fallback.get("eos_token_id"))
        if eos is None:
            raise ValueError(f"{path}: no eos_token in {hf_dir.TOKENIZER_CONFIG} and no eos_token_id")
        add_bos = settings.get("add_bos_token")
        if add_bos is None:  # what tokenizer.json's post-processor adds, as HF encodes with special tokens
            add_bos = bos is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos]
        stops = {eos, *_ids(generation.get("eos_token_id"))}
        stops.update(
            index
            for index, added in backend.get_added_tokens_decoder().items()
            if added.special and added.content in _END_OF_GENERATION_TEXTS
        )
        if chat_template is None:
            chat_template = _hf_chat_template(path, settings)
        tokenizer = cls.__new__(cls)
        tokenizer._setup(
            backend,
            backend.get_vocab_size(with_added_tokens=True),
            bos,
            bool(add_bos),
            eos,
            stops,
            chat_template,
        )
        return tokenizer

    @property
    def eos_token_id(self) -> int:
        return self._eos_token_id

    @property
    def stop_token_ids(self) -> set[int]:
        """Ids that end a generation; a copy, so callers may not alter the tokenizer."""
        return set(self._stop_token_ids)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def same_vocabulary(self, other: Tokenizer) -> bool:
        """Whether every token has the same id in both (a draft model's proposals are ids of the target's)."""
        mine = self._backend.get_vocab(with_added_tokens=True)
        return mine == other._backend.get_vocab(with_added_tokens=True)

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
    def has_chat_template(self) -> bool:
        """Whether `apply_chat_template` can render (the file's template, or one given instead)."""
        return self._chat_template is not None

    @property
    def template_supports_tools(self) -> bool:
        """Whether the chat template renders a `tools` variable (else tools go into a system prompt)."""
        return self._template_source is not None and "tools" in self._template_source

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}]) from the chat template;
        `tools` (OpenAI's tool list) is passed to templates that render it, as HF does; `template_kwargs`
        (vLLM's `chat_template_kwargs`, e.g. Qwen 3's `enable_thinking`) are further variables of the
        template, never one of those above (ValueError). NoChatTemplateError (a ValueError) when there is
        no template."""
        if self._chat_template is None:
            raise NoChatTemplateError("this GGUF file has no tokenizer.chat_template and none was given")
        fixed = {
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self._bos_text,
            "eos_token": self._eos_text,
        }
        clash = sorted(set(template_kwargs or {}) & set(fixed))
        if clash:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(clash)}")
        return self._chat_template.render(**(template_kwargs or {}), **fixed)


def _tokens_of_type(
    tokens: list[str], token_types: list[int], wanted: int, special: bool
) -> list[tokenizers.AddedToken]:
    """The vocab entries of token type `wanted`, as added tokens that never go through normalization."""
    return [
        tokenizers.AddedToken(token, normalized=False, special=special)
        for token, token_type in zip(tokens, token_types, strict=True)
        if token_type == wanted
    ]


def _end_of_generation_ids(
    eos: int, metadata: Mapping[str, object], tokens: list[str], token_types: list[int]
) -> set[int]:
    """eos, eot and eom ids from the header, plus control tokens llama.cpp treats as end of turn."""
    ids = {eos}
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if (token_id := _optional_int(metadata.get(key))) is not None:
            ids.add(token_id)
    ids.update(
        index
        for index, (token, token_type) in enumerate(zip(tokens, token_types, strict=True))
        if token_type == _CONTROL and token in _END_OF_GENERATION_TEXTS
    )
    return ids


def _ids(value: object) -> list[int]:
    """A config's token id or list of ids as a list."""
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value] if isinstance(value, list) else []


def _special_id(backend: tokenizers.Tokenizer, token: object, fallback: object) -> int | None:
    """The id of a tokenizer_config.json special token (a string, or {"content": ...}), else the config's
    first id."""
    text = token.get("content") if isinstance(token, dict) else token
    if isinstance(text, str) and (token_id := backend.token_to_id(text)) is not None:
        return int(token_id)
    ids = _ids(fallback)
    return ids[0] if ids else None


def _hf_chat_template(path: Path, settings: Mapping[str, object]) -> str | None:
    """chat_template.jinja (where transformers now writes it), else tokenizer_config.json's template (a
    string, or a list of named ones: "default")."""
    if (path / hf_dir.CHAT_TEMPLATE).is_file():
        return (path / hf_dir.CHAT_TEMPLATE).read_text(encoding="utf-8")
    template = settings.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


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

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens  # vLLM's: special tokens' text left out, or kept
        self._ids: list[int] = []
        self._prefix_start = 0  # ids[_prefix_start:_pending_start] give context already emitted
        self._pending_start = 0  # ids from here on are not emitted yet

    def step(self, token_id: int, final: bool = False) -> str:
        """Add one token; return the text it completes ("" while a character is still incomplete).
        `final`: no token follows, so nothing is held back any more."""
        self._ids.append(token_id)
        emitted = self._tokenizer.decode(self._ids[self._prefix_start : self._pending_start], self._skip)
        text = self._tokenizer.decode(self._ids[self._prefix_start :], self._skip)
        if len(text) <= len(emitted) or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix_start, self._pending_start = self._pending_start, len(self._ids)
        return text[len(emitted) :]
