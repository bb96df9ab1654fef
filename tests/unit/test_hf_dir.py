"""Hugging Face directories: tiny random models of every architecture, built with transformers' own classes
and written by its `save_pretrained` in bfloat16, served by kvfence (16-bit weights, float32 rows) and
compared with transformers running the same directory (float64, as test_archs does) and, through the C
decoder layer, with kvfence's own torch forward (bfloat16 and float16 weights); a sharded directory
loads the same tensors; what kvfence cannot serve is one line naming what is missing; a hub id is never
fetched; the chat template comes from chat_template.jinja.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import LogitsRecorder, make_engine
from test_archs import ARCH, SHAPE, assert_engine_matches, hf_model
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from kvfence.cli_checks import check_engine
from kvfence.config import EngineConfig
from kvfence.engine.engine import LLMEngine
from kvfence.model import half_matmul
from kvfence.model.hf_dir import model_path, read_dir, served_name
from kvfence.model.hf_load import load_hf_dir
from kvfence.model.tokenizer import Tokenizer
from kvfence.model.transformer import Transformer
from kvfence.sampling import SamplingParams
from kvfence.startup import StartupError

transformers = pytest.importorskip("transformers")


def write_dir(
    path: Path, model: torch.nn.Module, shard: str | None = None, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """`model` saved in `dtype` by transformers, beside a word-level tokenizer of its vocab ("t0" ...)."""
    model.to(dtype).save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    vocab = {f"t{i}": i for i in range(SHAPE["vocab_size"])}
    backend = Backend(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t1", "bos_token": "t2"}))
    return path


@pytest.mark.parametrize("variant", sorted(ARCH))
def test_logits_and_tokens_match_transformers(tmp_path: Path, variant: str) -> None:
    directory = write_dir(tmp_path / variant, hf_model(variant))
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    loaded = load_hf_dir(directory)
    assert loaded.config.architecture == ARCH[variant]
    model = Transformer.from_gguf(loaded, activation_dtype="float32")
    assert model.weight_dtype == torch.bfloat16 and model.decode_matmul == "kernel"
    half = [p.half for layer in model.layers for p in layer.projections()] + [model.lm_head.half]
    assert all(w is not None and w.dtype == torch.bfloat16 for w in half)  # no float32 copy of a weight
    assert_engine_matches(model, reference)


def test_sharded_directory_loads_the_same_tensors(tmp_path: Path) -> None:
    one = load_hf_dir(write_dir(tmp_path / "one", hf_model("qwen2")))
    sharded = write_dir(tmp_path / "sharded", hf_model("qwen2"), shard="300KB")
    assert (sharded / "model.safetensors.index.json").is_file() and len(
        list(sharded.glob("*.safetensors"))
    ) > 2
    many = load_hf_dir(sharded)
    assert many.config == one.config and many.tensors.keys() == one.tensors.keys()
    assert all(torch.equal(many.tensors[name], one.tensors[name]) for name in one.tensors)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dir(tmp_path_factory.mktemp("hf") / "llama", hf_model("llama"))


def copy_without(source: Path, target: Path, *names: str) -> Path:
    target.mkdir()
    for file in source.iterdir():
        if file.name not in names:
            (target / file.name).write_bytes(file.read_bytes())
    return target


@pytest.mark.parametrize(
    ("missing", "says"),
    [
        ("config.json", "has no config.json"),
        ("tokenizer.json", "has no tokenizer.json"),
        ("model.safetensors", "has no model.safetensors or model.safetensors.index.json"),
    ],
)
def test_a_missing_file_is_named(llama_dir: Path, tmp_path: Path, missing: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        read_dir(copy_without(llama_dir, tmp_path / "dir", missing))


def test_an_unknown_architecture_is_refused(llama_dir: Path, tmp_path: Path) -> None:
    directory = copy_without(llama_dir, tmp_path / "dir")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"model_type": "mixtral"}))
    with pytest.raises(ValueError, match=r"unsupported model_type 'mixtral'.*kvfence serves llama"):
        read_dir(directory)


def test_a_hub_id_is_never_fetched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError, match="looks like a Hugging Face hub id and kvfence fetches nothing"):
        model_path("Qwen/Qwen2.5-0.5B-Instruct")


def test_a_hub_id_in_the_cache_is_its_snapshot(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--org--tiny-llama"
    snapshot = copy_without(llama_dir, (repo / "snapshots").mkdir(parents=True) or repo / "snapshots" / "abc")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")
    assert model_path("org/tiny-llama") == snapshot
    assert served_name(snapshot) == "org/tiny-llama" and served_name(llama_dir) == "llama"
    assert model_path(str(llama_dir)) == llama_dir


def test_the_tokenizer_and_its_chat_template(llama_dir: Path, tmp_path: Path) -> None:
    directory = copy_without(llama_dir, tmp_path / "dir")
    tokenizer = Tokenizer.from_hf_dir(directory)
    assert not tokenizer.has_chat_template
    assert tokenizer.eos_token_id == 1 and tokenizer.encode("t5 t7", add_special_tokens=True) == [5, 7]
    (directory / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ bos_token }}{{ m['content'] }}{% endfor %}"
    )
    tokenizer = Tokenizer.from_hf_dir(directory)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "t9"}]) == "t2t9"


def decode(model: Transformer, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Greedy answers with every prompt prefilled in one step, then decoded together, and their logits."""
    engine = make_engine(model, max_num_batched_tokens=128)
    recorder = LogitsRecorder(engine)
    requests = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    return [r.output_token_ids for r in requests], [recorder.steps[r.request_id] for r in requests]


@pytest.mark.parametrize(
    ("variant", "dtype", "activation"),
    [(v, torch.bfloat16, "float32") for v in sorted(ARCH)]
    + [("qwen2", torch.float16, "float32")]
    + [(v, torch.bfloat16, "bfloat16") for v in ("llama", "gemma3")],
)
def test_the_c_layer_runs_16_bit_weights_as_the_torch_forward_does(
    tmp_path: Path, variant: str, dtype: torch.dtype, activation: str
) -> None:
    """16-bit projections run in the C decoder layer (whole decode steps in one call): the torch forward's
    tokens and logits within float32 rounding, and a row's logits bit for bit the same alone and beside
    three others (each row alone, in a fixed order); with float32 rows, and with bfloat16 rows (pairs)."""
    directory = write_dir(tmp_path / variant, hf_model(variant), dtype=dtype)
    fused = Transformer.from_gguf(load_hf_dir(directory), activation_dtype=activation)
    assert fused.weight_dtype == dtype and fused._c_layers is not None, (
        "16-bit weights under a CPU float32 model: the C layer runs"
    )
    pairs = [p.half.pairs for layer in fused.layers for p in layer.projections()]
    assert pairs == [activation == "bfloat16"] * len(pairs)
    plain = Transformer.from_gguf(load_hf_dir(directory), activation_dtype=activation)
    plain._c_layers = None  # the same weights through the torch forward, op by op
    gen = torch.Generator().manual_seed(7)
    four = [torch.randint(0, SHAPE["vocab_size"], (n,), generator=gen).tolist() for n in (13, 5, 21, 9)]
    ours, our_logits = decode(fused, four)
    theirs, their_logits = decode(plain, four)
    assert ours == theirs
    # bfloat16 rows: the two forwards' float32 rows differ in their last bits, which can move a row's
    # rounding to bfloat16 by one step (2^-8 of it)
    tolerance = 1e-4 if activation == "float32" else 2**-7
    for mine, reference in zip(our_logits, their_logits, strict=True):
        for a, b in zip(mine, reference, strict=True):
            assert (a - b).abs().max() <= tolerance * max(1.0, float(b.abs().max()))
    alone, alone_logits = decode(fused, four[:1])
    assert alone[0] == ours[0]
    assert all(torch.equal(a, b) for a, b in zip(alone_logits[0], our_logits[0], strict=True))


def test_bfloat16_weights_serve_bfloat16_rows_by_default_where_the_cpu_has_them(tmp_path: Path) -> None:
    """The defaults over a bfloat16 directory: bfloat16 rows (pairs) on a CPU with AVX512-BF16, float32
    rows elsewhere, and the start-up line says which; `--activation-dtype bfloat16` anywhere else (float16
    weights, or weights not kept 16-bit) is refused by name, never half applied."""
    directory = write_dir(tmp_path / "llama", hf_model("llama"))
    model = Transformer.from_gguf(load_hf_dir(directory))
    fast = half_matmul.pairs_native()
    assert model.activation_dtype == ("bfloat16" if fast else "float32")
    assert all(p.half.pairs == fast for layer in model.layers for p in layer.projections())
    heard: list[str] = []
    LLMEngine(EngineConfig(num_pages=64, page_size=4, max_model_len=48), model, log=heard.append)
    rows = "bfloat16" if fast else "float32"
    line = f"{rows} activations x bfloat16 weights (16-bit kernel), float32 KV cache"
    assert any(line in said and said.startswith("numerics: fast" if fast else "numerics:") for said in heard)
    halves = write_dir(tmp_path / "f16", hf_model("llama"), dtype=torch.float16)
    with pytest.raises(ValueError, match=r"activation dtype 'bfloat16' .* are torch\.float16"):
        Transformer.from_gguf(load_hf_dir(halves), activation_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"bfloat16 \(a torch\.bfloat16 model on cpu: no 16-bit kernel\)"):
        Transformer.from_gguf(load_hf_dir(directory, dtype=torch.bfloat16), activation_dtype="bfloat16")


def test_bfloat16_rows_without_bfloat16_weights_are_refused_before_the_load(tmp_path: Path) -> None:
    """`kvfence serve --activation-dtype bfloat16` checks the model's stored dtypes from its headers: one
    line naming why for a GGUF, a float16 directory or --dtype bfloat16; a bfloat16 directory starts."""
    bf16 = write_dir(tmp_path / "bf16", hf_model("llama"))
    check_engine(EngineConfig(model=bf16, activation_dtype="bfloat16"))
    f16 = write_dir(tmp_path / "f16", hf_model("llama"), dtype=torch.float16)
    refusals = [
        (EngineConfig(activation_dtype="bfloat16"), "the model holds none"),  # the packaged GGUF
        (EngineConfig(model=f16, activation_dtype="bfloat16"), "the model holds none"),
        (EngineConfig(model=bf16, dtype="bfloat16", activation_dtype="bfloat16"), "--dtype bfloat16: they"),
    ]
    for config, why in refusals:
        with pytest.raises(StartupError, match=f"^--activation-dtype bfloat16 multiplies .*: {why}"):
            check_engine(config)
