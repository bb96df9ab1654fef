"""GGUF loading and pre-tokenization on synthetic files and regexes: no model file, no transformers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from kvfence.model.ggml_types import BLOCK_GEOMETRY, GGMLType
from kvfence.model.gguf import _dequantize_blocks, load_gguf
from kvfence.model.gguf_file import GGUFFile
from kvfence.model.tokenizer import pre_tokenizer_for


def test_pre_tokenizers_follow_llama_cpp_regexes() -> None:
    def words(pre_type: str, text: str) -> list[str]:
        return [piece for piece, _ in pre_tokenizer_for(pre_type).pre_tokenize_str(text)]

    assert words("smollm", "x  12") == ["x", "ĠĠ", "1", "2"]
    assert words("gpt-2", "x  12") == ["x", "Ġ", "Ġ12"]
    assert words("llama-bpe", "x  12345") == ["x", "Ġ", "Ġ", "123", "45"]
    # qwen2 is llama-bpe's regex with single digits; its case-blind contractions are spelled out as classes.
    assert words("qwen2", "x  12345") == ["x", "Ġ", "Ġ", "1", "2", "3", "4", "5"]
    assert words("qwen2", "I'LL") == words("llama-bpe", "I'LL") == ["I", "'LL"]
    with pytest.raises(ValueError, match="pre-tokenizer"):
        pre_tokenizer_for("default")


def _llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows (convert_hf_to_gguf.py Transformer.permute)."""
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
    for gguf_name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_down.weight"):
        tensor = loaded.tensors[gguf_name]
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, torch.from_numpy(original[gguf_name]).to(torch.bfloat16))


def test_block_quantized_weights_are_kept_only_as_their_codes(tmp_path: Path) -> None:
    tensors = _tiny_llama_tensors()
    tensors["blk.0.ffn_down.weight"] = np.random.default_rng(1).standard_normal((8, 32)).astype(np.float32)
    _write_tiny_gguf(tmp_path / "q8.gguf", "llama", tensors, q8_0=frozenset({"blk.0.ffn_down.weight"}))

    loaded = load_gguf(tmp_path / "q8.gguf")
    down = "blk.0.ffn_down.weight"
    assert list(loaded.quantized) == [down] and down not in loaded.tensors  # the codes are its only copy
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    reference = gguf.quants.dequantize(gguf.quants.quantize(tensors[down], q8_0), q8_0)
    assert torch.equal(loaded.quantized[down].dequantize(), torch.from_numpy(reference.reshape(8, 32)))
    assert loaded.quantization == {"F32": 10, "Q8_0": 1}


def test_a_weight_cut_short_fails_the_load_not_the_model(tmp_path: Path) -> None:
    """Block weights are read only when the model asks for one, but a file that ends inside one (here the
    last tensor, 8 rows of one 34-byte Q8_0 block, padded to 288 bytes) is refused by load_gguf itself."""
    tensors = _tiny_llama_tensors()
    tensors["blk.0.ffn_down.weight"] = np.random.default_rng(1).standard_normal((8, 32)).astype(np.float32)
    path = tmp_path / "cut.gguf"
    _write_tiny_gguf(path, "llama", tensors, q8_0=frozenset({"blk.0.ffn_down.weight"}))
    load_gguf(path)
    with path.open("r+b") as file:
        file.truncate(path.stat().st_size - 40)
    with pytest.raises(ValueError, match=r"ffn_down\.weight runs past the end"):
        load_gguf(path)


def test_a_string_array_reads_back_whole_and_a_cut_one_is_refused(tmp_path: Path) -> None:
    """A vocabulary's strings (empty, non-ASCII, a byte token) come back as written; a file that ends
    inside the array is refused, whichever string it ends in, never read past its end."""
    tokens = ["", "hello", "▁naïve", "<0x0A>", "你好"] * 3
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_token_list(tokens)
    writer.add_string("general.name", "after the array")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    read = GGUFFile(path)
    assert read.metadata["tokenizer.ggml.tokens"] == tokens
    assert read.metadata["general.name"] == "after the array"
    whole = path.read_bytes()
    array_end = whole.index(b"general.name") - 8  # the next key's length comes right after the array
    for cut in (array_end - 1, array_end - 3 - 8, array_end - 40):
        path.write_bytes(whole[:cut])
        with pytest.raises(ValueError, match="the header is cut short"):
            GGUFFile(path)


def test_an_array_is_read_at_each_lookup_and_left_out_without_arrays(tmp_path: Path) -> None:
    """The header's arrays are not held: each lookup reads a new list (a caller's edit never shows in the
    next); `in`, `len` and the keys count them; `arrays=False` leaves them out."""
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_token_list(["a", "b"])
    writer.add_array("numbers", [1, 2, 3])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    metadata = GGUFFile(path).metadata
    first = metadata["tokenizer.ggml.tokens"]
    first.append("edited")
    assert metadata["tokenizer.ggml.tokens"] == ["a", "b"] and metadata["numbers"] == [1, 2, 3]
    assert "numbers" in metadata and len(metadata) == len(list(metadata)) == 3
    assert dict(metadata) == {
        "general.architecture": "llama",
        "tokenizer.ggml.tokens": ["a", "b"],
        "numbers": [1, 2, 3],
    }
    without = GGUFFile(path, arrays=False).metadata
    assert "numbers" not in without and dict(without) == {"general.architecture": "llama"}


def test_non_llama_architecture_is_rejected(tmp_path: Path) -> None:
    _write_tiny_gguf(tmp_path / "other.gguf", "gpt2", _tiny_llama_tensors())
    with pytest.raises(ValueError, match="architecture 'gpt2'"):
        load_gguf(tmp_path / "other.gguf")


@pytest.mark.parametrize(
    "extra", ["blk.0.ffn_gate_exps.weight", "blk.0.attn_q.bias"], ids=["experts", "bias"]
)
def test_a_tensor_the_forward_would_not_read_is_refused(tmp_path: Path, extra: str) -> None:
    """MoE experts, or a bias llama has no place for: serving without them would be a different model."""
    tensors = {**_tiny_llama_tensors(), extra: np.ones(8, dtype=np.float32)}
    _write_tiny_gguf(tmp_path / "extra.gguf", "llama", tensors)
    with pytest.raises(ValueError, match=f"not a llama model kvfence can serve: unknown tensors .*{extra}"):
        load_gguf(tmp_path / "extra.gguf")


def test_the_type_table_is_gguf_pys_and_plain_floats_read_as_gguf_py_reads_them() -> None:
    """ggml_types.py names every type the pinned gguf-py knows by the same id and block; F32, F16 and
    BF16, read here without gguf-py, equal its reading."""
    reference = {int(t): (t.name, gguf.GGML_QUANT_SIZES[t]) for t in gguf.GGMLQuantizationType}
    assert {int(t): (t.name, BLOCK_GEOMETRY[t]) for t in GGMLType} == reference
    rng = np.random.default_rng(0)
    for kind in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        raw = rng.integers(0, 256, size=(64, BLOCK_GEOMETRY[kind][1]), dtype=np.uint8)
        if kind is not GGMLType.F32:  # finite halves: NaN payloads need not survive either reader
            raw[:, 1] &= 0x3F
        else:
            raw[:, 3] &= 0x3F
        expected = gguf.quants.dequantize(raw.reshape(1, -1), gguf.GGMLQuantizationType(int(kind)))
        np.testing.assert_array_equal(_dequantize_blocks(raw, kind), expected.reshape(-1))


def test_loading_a_file_of_plain_floats_and_block_formats_leaves_gguf_py_unloaded() -> None:
    """The packaged SmolLM2 (Q4_1, Q8_0 and F32 tensors) loads and answers without gguf-py in the process."""
    code = (
        "import sys\n"
        "from kvfence.config import EngineConfig\n"
        "from kvfence.engine.engine import load_engine\n"
        "from kvfence.sampling import SamplingParams\n"
        "engine = load_engine(EngineConfig(), log=lambda _: None)\n"
        "(out,) = engine.generate([engine.tokenizer.encode('Hello')], SamplingParams(max_tokens=2))\n"
        "print(len(out.output_token_ids), 'gguf' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.split() == ["2", "False"], run.stderr[-2000:]
