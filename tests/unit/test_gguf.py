"""GGUF loading and tokenization checked against transformers' own GGUF support.

The real-model tests share the session's SmolLM2 (conftest `smollm2`) and load transformers' tokenizer
once per module, so the file stays well under a minute; the synthetic-file tests need neither the model
nor transformers.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import dequantize

from kvfence.model.gguf import GGUFModel, load_gguf
from kvfence.model.tokenizer import IncrementalDecoder, Tokenizer, pre_tokenizer_for
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
    assert config.tie_word_embeddings and "lm_head.weight" not in smollm2.tensors
    assert smollm2.metadata["general.architecture"] == "llama"
    assert len(smollm2.metadata["tokenizer.ggml.tokens"]) == config.vocab_size


@real_model
def test_every_tensor_equals_transformers_gguf_load(smollm2: GGUFModel, model_path: Path) -> None:
    """Bit-identical to transformers, which also undoes llama.cpp's Q/K row permutation."""
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(
        model_path.parent, gguf_file=model_path.name, dtype=torch.float32
    )
    hf_tensors = {name.removeprefix("model."): t for name, t in hf_model.state_dict().items()}
    # transformers materialises the tied head as its own entry; ours is the embedding itself.
    assert torch.equal(hf_tensors.pop("lm_head.weight"), smollm2.tensors["embed_tokens.weight"])
    assert sorted(hf_tensors) == sorted(smollm2.tensors)
    for name, ours in smollm2.tensors.items():
        assert ours.dtype == torch.float32 and ours.shape == hf_tensors[name].shape, name
        assert torch.equal(ours, hf_tensors[name]), name


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


def test_pre_tokenizers_follow_llama_cpp_regexes() -> None:
    def words(pre_type: str, text: str) -> list[str]:
        return [piece for piece, _ in pre_tokenizer_for(pre_type).pre_tokenize_str(text)]

    assert words("smollm", "x  12") == ["x", "ĠĠ", "1", "2"]
    assert words("gpt-2", "x  12") == ["x", "Ġ", "Ġ12"]
    assert words("llama-bpe", "x  12345") == ["x", "Ġ", "Ġ", "123", "45"]
    with pytest.raises(ValueError, match="pre-tokenizer"):
        pre_tokenizer_for("default")


def _llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows (convert_hf_to_gguf.py LlamaModel.permute)."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(weights.shape)


def _write_tiny_gguf(
    path: Path, arch: str, tensors: dict[str, np.ndarray], q8_0: frozenset[str] = frozenset()
) -> None:
    """A 1-layer model file: hidden 8, 2 heads of 4, 1 kv head, vocab 16; the tensors named in `q8_0`
    are stored as Q8_0 blocks."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_context_length(32)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(12)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-6)
    for name, array in tensors.items():
        if name in q8_0:
            kind = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _tiny_llama_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    shapes = {
        "token_embd.weight": (16, 8),
        "output_norm.weight": (8,),
        "blk.0.attn_norm.weight": (8,),
        "blk.0.ffn_norm.weight": (8,),
        "blk.0.attn_q.weight": (8, 8),
        "blk.0.attn_k.weight": (4, 8),
        "blk.0.attn_v.weight": (4, 8),
        "blk.0.attn_output.weight": (8, 8),
        "blk.0.ffn_gate.weight": (12, 8),
        "blk.0.ffn_up.weight": (12, 8),
        "blk.0.ffn_down.weight": (8, 12),
    }
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def test_synthetic_llama_file_unpermutes_qk_and_casts(tmp_path: Path) -> None:
    original = _tiny_llama_tensors()
    on_disk = dict(original)
    on_disk["blk.0.attn_q.weight"] = _llama_cpp_permute(original["blk.0.attn_q.weight"], heads=2)
    on_disk["blk.0.attn_k.weight"] = _llama_cpp_permute(original["blk.0.attn_k.weight"], heads=1)
    _write_tiny_gguf(tmp_path / "tiny.gguf", "llama", on_disk)
    messages: list[str] = []

    loaded = load_gguf(tmp_path / "tiny.gguf", dtype=torch.bfloat16, progress=messages.append)

    assert (
        loaded.config.head_dim == 4 and loaded.config.vocab_size == 16 and loaded.config.rope_theta == 10000.0
    )
    assert loaded.config.tie_word_embeddings and messages
    for gguf_name, hf_name in [
        ("blk.0.attn_q.weight", "layers.0.self_attn.q_proj.weight"),
        ("blk.0.attn_k.weight", "layers.0.self_attn.k_proj.weight"),
        ("blk.0.ffn_down.weight", "layers.0.mlp.down_proj.weight"),
    ]:
        tensor = loaded.tensors[hf_name]
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, torch.from_numpy(original[gguf_name]).to(torch.bfloat16))


def test_block_quantized_weights_keep_their_codes_for_float32_on_cpu(tmp_path: Path) -> None:
    tensors = _tiny_llama_tensors()
    tensors["blk.0.ffn_down.weight"] = np.random.default_rng(1).standard_normal((8, 32)).astype(np.float32)
    _write_tiny_gguf(tmp_path / "q8.gguf", "llama", tensors, q8_0=frozenset({"blk.0.ffn_down.weight"}))

    loaded = load_gguf(tmp_path / "q8.gguf")
    assert list(loaded.quantized) == ["layers.0.mlp.down_proj.weight"]
    down = "layers.0.mlp.down_proj.weight"
    assert torch.equal(dequantize(loaded.quantized[down]), loaded.tensors[down])
    # Only float32 on CPU uses the codes (the packed kernel): other loads do not keep them.
    assert load_gguf(tmp_path / "q8.gguf", dtype=torch.bfloat16).quantized == {}


def test_non_llama_architecture_is_rejected(tmp_path: Path) -> None:
    _write_tiny_gguf(tmp_path / "other.gguf", "gpt2", _tiny_llama_tensors())
    with pytest.raises(ValueError, match="architecture 'gpt2'"):
        load_gguf(tmp_path / "other.gguf")


def test_unknown_tensor_is_rejected(tmp_path: Path) -> None:
    tensors = {**_tiny_llama_tensors(), "rope_freqs.weight": np.ones(2, dtype=np.float32)}
    _write_tiny_gguf(tmp_path / "extra.gguf", "llama", tensors)
    with pytest.raises(ValueError, match=r"rope_freqs\.weight"):
        load_gguf(tmp_path / "extra.gguf")
