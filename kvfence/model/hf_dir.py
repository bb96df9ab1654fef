"""A Hugging Face model directory, read without torch: its config as a `ModelConfig`, its safetensors
tensors under the GGUF names the rest of kvfence reads, its tokenizer files, and where a hub id's files
must be (nothing is ever fetched).

Contract: `read_dir` accepts a directory holding config.json (model_type llama, mistral without a sliding
window, qwen2, qwen3 or gemma3_text), its weights as model.safetensors or shards named by
model.safetensors.index.json (BF16, F16 or F32), and tokenizer.json; anything else is one ValueError line
naming what is missing or unsupported. `GGUF_NAMES` is the one table from HF parameter names to GGUF names
(the loader and the tests' GGUF writer share it). `model_path` turns a `--model` string into a path: an
existing path as it is, a hub id (`org/name`) to its snapshot in the local HF cache, or a one-line
refusal saying where the files must be.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from kvfence.model.archs import architecture
from kvfence.model.archs.base import ModelConfig
from kvfence.model.archs.gemma3 import LOCAL_ROPE_THETA
from kvfence.model.gguf_file import GGUFFile

CONFIG, TOKENIZER, TOKENIZER_CONFIG = "config.json", "tokenizer.json", "tokenizer_config.json"
GENERATION_CONFIG, CHAT_TEMPLATE = "generation_config.json", "chat_template.jinja"
WEIGHTS, WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"
DTYPES = ("BF16", "F16", "F32")  # safetensors' names, which are also GGUF's
# config.json's model_type -> the kvfence architecture that serves it.
MODEL_TYPES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
}
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")

# HF parameter name (layer index as {i}) -> GGUF tensor name; shared, then each architecture's own.
_COMMON = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
}
_PRE_FFN = {"model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight"}
_QK_NORM = {
    "model.layers.{i}.self_attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "blk.{i}.attn_k_norm.weight",
}
_BIASES = {f"model.layers.{{i}}.self_attn.{x}_proj.bias": f"blk.{{i}}.attn_{x}.bias" for x in "qkv"}
GGUF_NAMES = {
    "llama": _COMMON | _PRE_FFN,
    "qwen2": _COMMON | _PRE_FFN | _BIASES,
    "qwen3": _COMMON | _PRE_FFN | _QK_NORM,
    "gemma3": _COMMON
    | _QK_NORM
    | {
        "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.post_attention_norm.weight",
        "model.layers.{i}.pre_feedforward_layernorm.weight": "blk.{i}.ffn_norm.weight",
        "model.layers.{i}.post_feedforward_layernorm.weight": "blk.{i}.post_ffw_norm.weight",
    },
}
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def gguf_name(arch: str, hf_name: str) -> str:
    """The GGUF name of an HF parameter; KeyError for one the architecture does not hold."""
    layer = _LAYER.search(hf_name)
    pattern = hf_name.replace(layer.group(0), ".layers.{i}.") if layer else hf_name
    name = GGUF_NAMES[arch][pattern]
    return name.format(i=layer.group(1)) if layer else name


@dataclass(frozen=True)
class StoredTensor:
    """One safetensors tensor: the file holding it, its HF name, dtype and shape."""

    file: Path
    hf_name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class HFDir:
    """A readable HF directory: the model's config, its tensors by GGUF name, the RoPE frequency divisors
    Llama 3's scaling asks for (None without), and metadata in the GGUF keys kvfence reads (architecture,
    name, the generation config's sampling defaults)."""

    path: Path
    config: ModelConfig
    tensors: dict[str, StoredTensor]
    rope_freqs: list[float] | None
    metadata: dict[str, object]


def is_hf_dir(path: Path) -> bool:
    return path.is_dir()


def model_metadata(path: Path) -> dict[str, object]:
    """A model's metadata in GGUF's keys, a GGUF file's or a directory's (`HFDir.metadata`): no tensor
    data read (the sampling defaults come from here)."""
    return read_dir(path).metadata if is_hf_dir(path) else dict(GGUFFile(path, arrays=False).metadata)


def read_json(path: Path, name: str, required: bool = True) -> dict:
    """`path`/`name` as a JSON object; {} for a missing optional file."""
    file = path / name
    if not file.is_file():
        if required:
            raise ValueError(f"{path} has no {name}")
        return {}
    value = json.loads(file.read_text(encoding="utf-8"))
    if not isinstance(value, dict):
        raise ValueError(f"{file} is not a JSON object")
    return value


def read_dir(path: Path) -> HFDir:
    """The directory's config and tensors, from config.json and the safetensors headers (no tensor data)."""
    raw = read_json(path, CONFIG)
    if not (path / TOKENIZER).is_file():
        raise ValueError(f"{path} has no {TOKENIZER} (kvfence reads the tokenizer from it)")
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        known = ", ".join(MODEL_TYPES)
        raise ValueError(f"{path}: unsupported model_type {model_type!r} in {CONFIG}: kvfence serves {known}")
    arch = MODEL_TYPES[str(model_type)]
    tensors = _gguf_tensors(arch, _stored_tensors(path))
    config = _config(arch, raw, tensors)
    architecture(arch).check_tensors(set(tensors), config.num_layers)
    metadata: dict[str, object] = {"general.architecture": arch, "general.name": path.name}
    metadata |= _sampling(read_json(path, GENERATION_CONFIG, required=False))
    return HFDir(path, config, tensors, llama3_rope_freqs(raw, config.head_dim), metadata)


def _stored_tensors(path: Path) -> list[StoredTensor]:
    """Every tensor of the directory's safetensors (one file, or the shards its index names)."""
    if (path / WEIGHTS_INDEX).is_file():
        weight_map = read_json(path, WEIGHTS_INDEX).get("weight_map", {})
        files = sorted({path / str(name) for name in weight_map.values()})
    elif (path / WEIGHTS).is_file():
        files = [path / WEIGHTS]
    else:
        raise ValueError(f"{path} has no {WEIGHTS} or {WEIGHTS_INDEX}")
    return [tensor for file in files for tensor in _header(file)]


def _header(file: Path) -> list[StoredTensor]:
    """A safetensors file's tensors, from its JSON header (8 bytes of length, then the JSON)."""
    try:
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{file}: not a safetensors file ({exc})") from None
    header.pop("__metadata__", None)
    tensors = [StoredTensor(file, name, str(v["dtype"]), tuple(v["shape"])) for name, v in header.items()]
    for tensor in tensors:
        if tensor.dtype not in DTYPES:
            raise ValueError(f"{file}: tensor {tensor.hf_name} is {tensor.dtype}; kvfence reads {DTYPES}")
    return tensors


def _gguf_tensors(arch: str, stored: list[StoredTensor]) -> dict[str, StoredTensor]:
    """The tensors under their GGUF names; one the architecture does not hold is refused, named."""
    tensors: dict[str, StoredTensor] = {}
    for tensor in stored:
        try:
            tensors[gguf_name(arch, tensor.hf_name)] = tensor
        except KeyError:
            raise ValueError(
                f"not a {arch} model kvfence can serve: unknown tensor {tensor.hf_name}"
            ) from None
    return tensors


def _config(arch: str, raw: dict, tensors: dict[str, StoredTensor]) -> ModelConfig:
    """config.json as a ModelConfig (transformers 4's rope_theta/rope_scaling or 5's rope_parameters)."""
    heads = int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // heads)
    if float(raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"partial rotary embeddings (partial_rotary_factor) are unsupported for {arch}")
    activation = raw.get("hidden_activation") or raw.get("hidden_act")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is unsupported (kvfence: {', '.join(_ACTIVATIONS)})")
    if raw.get("model_type") == "mistral" and raw.get("sliding_window"):
        raise ValueError("Mistral's sliding window (config.json sliding_window) is unsupported")
    global_rope, local_rope = _rope(raw, arch)
    factor = _rope_factor(global_rope, arch)
    fields: dict[str, object] = {
        "vocab_size": tensors["token_embd.weight"].shape[0] if "token_embd.weight" in tensors else 0,
        "hidden_size": int(raw["hidden_size"]),
        "intermediate_size": int(raw["intermediate_size"]),
        "num_layers": int(raw["num_hidden_layers"]),
        "num_heads": heads,
        "num_kv_heads": int(raw.get("num_key_value_heads") or heads),
        "head_dim": head_dim,
        "rope_theta": float(global_rope.get("rope_theta", 10000.0)),
        "rms_norm_eps": float(raw["rms_norm_eps"]),
        "context_length": int(raw["max_position_embeddings"]),
        "tie_word_embeddings": "output.weight" not in tensors,
        "architecture": arch,
        "activation": _ACTIVATIONS[str(activation)],
        "rope_linear_factor": factor,
    }
    if arch == "gemma3":
        fields |= _gemma3(raw, local_rope)
    return ModelConfig(**fields)  # type: ignore[arg-type]


def _rope(raw: dict, arch: str) -> tuple[dict, dict]:
    """(global, local) RoPE parameters: `rope_theta` plus the scaling's `rope_type` and `factor`."""
    params = raw.get("rope_parameters")
    if params is None:  # transformers 4: rope_theta, rope_scaling, Gemma's rope_local_base_freq
        scaling = raw.get("rope_scaling") or {}
        glob = {"rope_theta": raw.get("rope_theta", 10000.0), **scaling}
        return glob, {"rope_theta": raw.get("rope_local_base_freq", LOCAL_ROPE_THETA)}
    if arch == "gemma3":
        return params.get("full_attention", {}), params.get("sliding_attention", {})
    return params, {}


def _rope_factor(rope: dict, arch: str) -> float:
    """The linear RoPE scaling factor (1 without); Llama 3's scaling comes as `llama3_rope_freqs`."""
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "linear":
        return float(rope["factor"])
    if kind not in ("default", "llama3") or (kind == "llama3" and arch != "llama"):
        raise ValueError(f"RoPE scaling {kind!r} is unsupported for {arch}")
    return 1.0


def _gemma3(raw: dict, local_rope: dict) -> dict[str, object]:
    """Gemma 3's own fields (archs/gemma3.py says what each does)."""
    for unsupported in ("attn_logit_softcapping", "final_logit_softcapping"):
        if raw.get(unsupported):
            raise ValueError(f"gemma3 {unsupported} is unsupported")
    layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types")
    if types is None:
        pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    return {
        "embedding_scale": float(int(raw["hidden_size"]) ** 0.5),
        "query_scale": float(raw.get("query_pre_attn_scalar") or raw.get("head_dim")) ** -0.5,
        "sliding_window": int(raw["sliding_window"]),
        "local_layers": frozenset(i for i, kind in enumerate(types) if kind == "sliding_attention"),
        "local_rope_theta": float(local_rope.get("rope_theta", LOCAL_ROPE_THETA)),
    }


def llama3_rope_freqs(raw: dict, head_dim: int) -> list[float] | None:
    """The per-frequency divisors of Llama 3's RoPE scaling, as llama.cpp's converter writes them into
    `rope_freqs.weight` (the forward divides the inverse frequencies by them); None for other scalings."""
    rope = raw.get("rope_parameters") or {
        "rope_theta": raw.get("rope_theta"),
        **(raw.get("rope_scaling") or {}),
    }
    if (rope.get("rope_type") or rope.get("type")) != "llama3":
        return None
    base, factor = float(rope["rope_theta"]), float(rope["factor"])
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old = float(rope["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old / low, old / high
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * base ** (i / head_dim)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return factors


def _sampling(generation: dict) -> dict[str, object]:
    """generation_config.json's sampling defaults under the GGUF keys `SamplingDefaults.resolve` reads
    (vLLM serves them as defaults too)."""
    keys = {
        "temperature": "general.sampling.temp",
        "top_p": "general.sampling.top_p",
        "top_k": "general.sampling.top_k",
        "min_p": "general.sampling.min_p",
        "repetition_penalty": "general.sampling.penalty_repeat",
    }
    return {
        key: generation[name] for name, key in keys.items() if isinstance(generation.get(name), int | float)
    }


def hub_cache() -> Path:
    """Where the HF libraries keep downloaded repositories ($HF_HUB_CACHE, $HF_HOME/hub, or ~/.cache)."""
    if cache := os.environ.get("HF_HUB_CACHE"):
        return Path(cache)
    home = os.environ.get("HF_HOME")
    return Path(home) / "hub" if home else Path.home() / ".cache" / "huggingface" / "hub"


def model_path(text: str) -> Path:
    """`--model`'s string as a path: an existing path as it is; a hub id to its snapshot in the local HF
    cache (the revision refs/main names, else the newest); ValueError saying where the files must be."""
    path = Path(text)
    if path.exists() or not _HUB_ID.fullmatch(text):
        return path
    repo = hub_cache() / f"models--{text.replace('/', '--')}"
    ref = repo / "refs" / "main"
    snapshots = repo / "snapshots"
    if ref.is_file() and (snapshots / ref.read_text().strip() / CONFIG).is_file():
        return snapshots / ref.read_text().strip()
    found = (
        sorted(snapshots.glob(f"*/{CONFIG}"), key=lambda p: p.stat().st_mtime) if snapshots.is_dir() else []
    )
    if found:
        return found[-1].parent
    raise ValueError(
        f"{text!r} looks like a Hugging Face hub id and kvfence fetches nothing: download it first (it is "
        f"not in {hub_cache()}), or give a local directory with {CONFIG}, safetensors weights and {TOKENIZER}"
    )


def served_name(path: Path) -> str:
    """The model id the API names: the hub id for a snapshot in the HF cache, else the file or directory
    directory's name, or the file's without its suffix."""
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.removeprefix("models--").replace("--", "/")
    return path.name if path.is_dir() else path.stem
