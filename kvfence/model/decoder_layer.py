"""The C decoder layer (csrc/decoder_layer.c, linked with the packed and 16-bit matmuls and the paged
attention): a layer's row-wise work in two calls around attention, and a pure decode step in one call for
every layer.

Contract: `DecoderLayers.build` takes the model's layers when every projection is packed or 16-bit
(bfloat16 or float16 rows under a CPU float32 model: each weight says which kernel multiplies by it), else
returns None with the reason; `qkv` / `out` run one layer for the step's rows (any rows: prefill and
decode alike, each row alone; K and V written into a float32 or float16 pool), `decode` every layer of a
step whose rows are all decode rows, attention over their validated block tables included. The step's
buffers (`StepBuffers`) are the caller's; the structs handed to C point into tensors this object and the
buffers keep alive.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvfence.model import native
from kvfence.model.archs.base import ModelConfig
from kvfence.model.half_matmul import HALF_DTYPES, HalfWeight
from kvfence.model.weights import Layer, Projection

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
STATUS = {1: "a block table names a page outside the pool or a length beyond its pages", 2: "out of memory"}


class DecoderLayerError(RuntimeError):
    """The C layer refused a step before reading anything it should not (or could not allocate)."""


class _Weight(ctypes.Structure):
    _fields_ = [
        ("codes", _ptr),
        ("scales", _ptr),
        ("offsets", _ptr),
        ("bias", _ptr),
        ("in_features", _i64),
        ("out_features", _i64),
        ("group", _i64),
        ("panels", _i64),
        ("format", _i64),
        ("kind", _i64),
    ]


# decoder_layer.c's KVF_PACKED, KVF_BF16, KVF_FP16, KVF_BF16_PAIRS
_PACKED, _KINDS, _PAIRS = 0, {torch.bfloat16: 1, torch.float16: 2}, 3


class _Layer(ctypes.Structure):
    _fields_ = [
        ("attn_norm", _ptr),
        ("ffn_norm", _ptr),
        ("q_norm", _ptr),
        ("k_norm", _ptr),
        ("post_attn_norm", _ptr),
        ("post_ffn_norm", _ptr),
        ("qkv", _Weight),
        ("o", _Weight),
        ("gate_up", _Weight),
        ("down", _Weight),
        ("local", _i64),
        ("window", _i64),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        *((name, _i64) for name in ("rows", "hidden", "heads", "kv_heads", "head_dim", "intermediate")),
        ("eps", _f32),
        ("scale", _f32),
        ("gelu", _i64),
        ("kv", _ptr),
        ("kv_half", _i64),
        ("num_pages", _i64),
        ("page_size", _i64),
        ("slots", _ptr),
        ("tables", _ptr),
        ("table_width", _i64),
        ("context_lens", _ptr),
        *((name, _ptr) for name in ("cos", "sin", "local_cos", "local_sin", "x", "qkv", "attn", "gate_up")),
        ("threads", ctypes.c_int),
    ]


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _sixteen_bit(projection: Projection) -> HalfWeight | None:
    """The projection's 16-bit panels, as half_matmul.c reads them; None if it has none."""
    half = projection.half
    if projection.packed is not None or half is None or half.dtype not in HALF_DTYPES:
        return None
    return half if half.panels.is_contiguous() else None


def _weight(projection: Projection) -> _Weight:
    bias, packed = _address(projection.bias), projection.packed
    if packed is None:
        half = _sixteen_bit(projection)
        assert half is not None
        return _Weight(
            half.panels.data_ptr(),
            None,
            None,
            bias,
            half.in_features,
            half.out_features,
            0,
            0,
            0,
            _PAIRS if half.pairs else _KINDS[half.dtype],
        )
    assert packed.codes.is_contiguous()
    return _Weight(
        packed.codes.data_ptr(),
        packed.scales.data_ptr(),
        packed.offsets_address(),
        bias,
        packed.in_features,
        packed.out_features,
        packed.group,
        packed.codes.shape[0],
        packed.format,
        _PACKED,
    )


@dataclass
class StepBuffers:
    """The step's scratch rows (the layer's intermediate results) and its per-row inputs, as C reads them."""

    x: torch.Tensor  # [rows, hidden]
    qkv: torch.Tensor  # [rows, (heads + 2 kv_heads) * head_dim]: q after norm and RoPE, then k, v
    attn: torch.Tensor  # [rows, heads * head_dim]
    gate_up: torch.Tensor  # [rows, 2 * intermediate]
    slots: torch.Tensor  # [rows] int64
    angles: Sequence[torch.Tensor]  # cos, sin, local cos, local sin: [rows, head_dim] each (contiguous)


class DecoderLayers:
    """Every layer of one model, as the C layer reads them."""

    def __init__(
        self, library: ctypes.CDLL, layers: list[Layer], windows: list[int], local: set[int]
    ) -> None:
        self._qkv, self._out, self._decode = library.layer_qkv, library.layer_out, library.decode_layers
        step, layer = ctypes.POINTER(_Step), ctypes.POINTER(_Layer)
        self._qkv.argtypes = [step, layer, _i64, _ptr]
        self._out.argtypes = [step, layer, _ptr]
        self._decode.argtypes = [step, layer, _i64, _ptr]
        for fn in (self._qkv, self._out, self._decode):
            fn.restype = ctypes.c_int
        self._layers = (_Layer * len(layers))()
        for i, layer in enumerate(layers):
            self._layers[i] = _Layer(
                *(
                    _address(norm)
                    for norm in (
                        layer.attn_norm,
                        layer.ffn_norm,
                        layer.q_norm,
                        layer.k_norm,
                        layer.post_attn_norm,
                        layer.post_ffn_norm,
                    )
                ),
                *(_weight(p) for p in layer.projections()),
                int(i in local),
                windows[i],
            )
        self._keep = layers  # the tensors the structs point into

    @classmethod
    def build(
        cls, layers: list[Layer], windows: list[int], local: set[int]
    ) -> tuple[DecoderLayers | None, str]:
        """The C layers over `layers`, or (None, why) where they cannot run."""
        projections = [p for layer in layers for p in layer.projections()]
        if not all(p.packed is not None or _sixteen_bit(p) is not None for p in projections):
            return None, "a projection is neither packed nor 16-bit"
        library, why = _library()
        return (cls(library, layers, windows, local), "") if library is not None else (None, why)

    @staticmethod
    def step(
        cfg: ModelConfig,
        buffers: StepBuffers,
        kv: torch.Tensor,
        tables: torch.Tensor | None = None,
        context_lens: torch.Tensor | None = None,
    ) -> _Step:
        """The C view of one step: `kv` the pool, `tables` and `context_lens` the decode rows' (pure decode
        steps only)."""
        return _Step(
            buffers.x.shape[0],
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            cfg.rms_norm_eps,
            cfg.attention_scale,
            int(cfg.activation == "gelu_tanh"),
            kv.data_ptr(),
            _kv_half(kv),
            kv.shape[2],
            kv.shape[3],
            buffers.slots.data_ptr(),
            _address(tables),
            0 if tables is None else tables.shape[1],
            _address(context_lens),
            *(angle.data_ptr() for angle in buffers.angles),
            buffers.x.data_ptr(),
            buffers.qkv.data_ptr(),
            buffers.attn.data_ptr(),
            buffers.gate_up.data_ptr(),
            torch.get_num_threads(),
        )

    def qkv(self, step: _Step, layer: int, h: torch.Tensor) -> None:
        """Layer `layer` up to attention for every row of `h` (q, k, v in the buffers, k and v cached)."""
        _check(self._qkv(ctypes.byref(step), ctypes.byref(self._layers[layer]), layer, h.data_ptr()))

    def out(self, step: _Step, layer: int, h: torch.Tensor) -> None:
        """Layer `layer` from the attention in the buffers on: `h` updated in place."""
        _check(self._out(ctypes.byref(step), ctypes.byref(self._layers[layer]), h.data_ptr()))

    def decode(self, step: _Step, h: torch.Tensor) -> None:
        """Every layer of a pure decode step: `h` updated in place."""
        _check(self._decode(ctypes.byref(step), self._layers, len(self._layers), h.data_ptr()))


def _kv_half(kv: torch.Tensor) -> int:
    """1 where the pool holds float16, 0 for float32: the two element types the C layer reads and writes."""
    assert kv.dtype in (torch.float16, torch.float32) and kv.is_contiguous()
    return int(kv.dtype == torch.float16)


def _check(status: int) -> None:
    if status:
        raise DecoderLayerError(f"decoder layer: {STATUS.get(status, status)}")


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    sources = ("packed_matmul", "half_matmul", "paged_attention")
    return native.load_library("decoder_layer", with_sources=sources)
