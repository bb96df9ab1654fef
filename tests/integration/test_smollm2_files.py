"""The real SmolLM2 file, checked against transformers' own GGUF support: config, every tensor, the
quantized codes, the tokenizer and the chat template.

They share the session's SmolLM2 (conftest `smollm2`) and load transformers' tokenizer once per module.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_reference import gguf_name

from kvfence.model.gguf import GGUFModel
from kvfence.model.tokenizer import IncrementalDecoder, Tokenizer
from kvfence.pins import default_model_path

real_model = pytest.mark.real_model

ENCODE_CASES = [
    "Hello, world!",
    "12345",
    "3.14159e-10 and 1,000,000",
    "Ünïcödé façade naïve",
    "emoji 😀🎉👍🏽 mixed",
    "你好，世界。今天天气很好",
    "日本語のテキスト",
    "tab\tseparated\r\nwindows line",
    "   leading and trailing   ",
    "many     inner      spaces",
    "\n\n\nnewlines\n",
    "def f(x):\n    return x ** 2  # square\n",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "it's they're we've I'm you'll he'd",
    "<|im_start|>user\nhi<|im_end|>",
    "<|endoftext|>",
    "<repo_name>kvfence<file_sep>main.py",
    "",
    "   ",
    "em — dash “quotes” ‘single’ …",
    "Ωμέγα русский العربية",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one, in 日本語?"},
    ],
]


@pytest.fixture(scope="module")
def model_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def tokenizer(smollm2: GGUFModel) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2)


@pytest.fixture(scope="module")
def hf_tokenizer(model_path: Path):  # -> transformers tokenizer; untyped to keep the import lazy
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path.parent, gguf_file=model_path.name)


@real_model
def test_smollm2_config_matches_gguf_header(smollm2: GGUFModel) -> None:
    config = smollm2.config
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (30, 9, 3)
    assert (config.hidden_size, config.intermediate_size, config.head_dim) == (576, 1536, 64)
    assert (config.vocab_size, config.context_length) == (49152, 8192)
    assert config.rope_theta == 100000.0
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.tie_word_embeddings
    assert "output.weight" not in smollm2.tensors.keys() | smollm2.quantized.keys()
    assert smollm2.metadata["general.architecture"] == "llama"
    assert len(smollm2.metadata["tokenizer.ggml.tokens"]) == config.vocab_size


@real_model
def test_every_tensor_equals_transformers_gguf_load(smollm2: GGUFModel, hf_smollm2: torch.nn.Module) -> None:
    """Bit-identical to transformers, which also undoes llama.cpp's Q/K row permutation."""
    hf_tensors = dict(hf_smollm2.state_dict())
    # transformers materialises the tied head as its own entry; ours is the embedding itself.
    embedding = smollm2.quantized["token_embd.weight"].dequantize()
    assert torch.equal(hf_tensors.pop("lm_head.weight"), embedding)
    ours = smollm2.tensors | {name: q.dequantize() for name, q in smollm2.quantized.items()}
    assert sorted(gguf_name("llama", name) for name in hf_tensors) == sorted(ours)
    for name, theirs in hf_tensors.items():
        tensor = ours[gguf_name("llama", name)]
        assert tensor.dtype == torch.float32 and tensor.shape == theirs.shape, name
        assert torch.equal(tensor, theirs), name


@real_model
@pytest.mark.parametrize("text", ENCODE_CASES)
def test_encode_matches_transformers_and_round_trips(tokenizer: Tokenizer, hf_tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


@real_model
def test_whitespace_run_before_digit_follows_llama_cpp_smollm_split(tokenizer: Tokenizer) -> None:
    """Digits are split off first, so the space run before them stays one token ("ĠĠ").

    transformers' GGUF tokenizer has no "smollm" pre-tokenizer and yields "Ġ", "Ġ" here instead;
    llama.cpp and SmolLM2's own tokenizer.json split digits first, as we do.
    """
    double_space = tokenizer.encode("  ")
    assert len(double_space) == 1
    assert tokenizer.encode("x  1") == [*tokenizer.encode("x"), *double_space, *tokenizer.encode("1")]


@real_model
def test_decode_skips_special_tokens_by_default(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids) == "user\nhi"


@real_model
def test_special_ids(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 49152
    assert tokenizer.eos_token_id == tokenizer.encode("<|im_end|>")[0]
    assert tokenizer.stop_token_ids == {tokenizer.eos_token_id, *tokenizer.encode("<|endoftext|>")}
    assert tokenizer.encode("hi", add_special_tokens=True) == tokenizer.encode("hi")  # file: no BOS


@real_model
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(
    tokenizer: Tokenizer, hf_tokenizer, messages: list[dict[str, str]]
) -> None:
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(messages) == expected
    without_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert without_prompt + "<|im_start|>assistant\n" == expected


@real_model
def test_incremental_decoder_holds_back_split_characters(tokenizer: Tokenizer) -> None:
    text = "Emoji 😀🎉👍🏽, 你好世界, naïve — done."
    ids = tokenizer.encode(text)
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.step(token_id) for token_id in ids]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in piece for piece in pieces)
    assert "" in pieces  # some character really was split across tokens
    cut = next(i for i, piece in enumerate(pieces) if piece == "")  # the stream ends mid-character
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.step(token_id, final=i == cut) for i, token_id in enumerate(ids[: cut + 1])]
    assert "".join(pieces) == tokenizer.decode(ids[: cut + 1]) and pieces[-1].endswith("\ufffd")


@real_model
def test_every_projection_is_kept_only_as_its_codes(smollm2: GGUFModel) -> None:
    """Q4_1 projections and the Q8_0 embedding (the tied LM head): codes only, no float32 copy (their
    values are checked bit for bit against transformers above)."""
    assert len(smollm2.quantized) == 7 * smollm2.config.num_layers + 1
    assert not smollm2.quantized.keys() & smollm2.tensors.keys()
    assert smollm2.quantization == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    assert all(tensor.dim() == 1 for tensor in smollm2.tensors.values())  # only the norms are float
