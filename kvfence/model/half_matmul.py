"""Float32 rows times 16-bit weights (bfloat16 or float16, as a Hugging Face directory stores them), with
no float32 copy of the weights: csrc/half_matmul.c.

Contract: `HalfMatmulKernel(x, w)` is `x @ w.T` computed in float32 over the weights' exact float32 values
(what a float32 model over the same weights computes, in another summation order), each row alone: a
row's result does not depend on how many rows share the call. `load()` says why not where it cannot run.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kvfence.model import native

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
HALF_DTYPES = (torch.bfloat16, torch.float16)


class HalfMatmulKernel:
    def __init__(self, library: ctypes.CDLL) -> None:
        self._fns = {
            split: getattr(library, name)
            for split, name in ((False, "half_matmul"), (True, "half_matmul_threads"))
        }
        for fn in self._fns.values():
            fn.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _i64, ctypes.c_int, _ptr, ctypes.c_int]
            fn.restype = None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, split: bool = False) -> torch.Tensor:
        """x [rows, in_features] float32 (rows may be strided; each row contiguous), weight [out_features,
        in_features] bfloat16 or float16, contiguous -> [rows, out_features] float32. Output features go
        over torch's threads where the product repays waking them, or always with `split` (as the C
        decoder layer calls it: measurements of that path)."""
        rows, in_features = x.shape
        assert x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(1) == 1
        assert weight.dtype in HALF_DTYPES and weight.is_contiguous() and weight.shape[1] == in_features
        out = torch.empty(rows, weight.shape[0], dtype=torch.float32)
        if rows:
            self._fns[split](
                x.data_ptr(),
                x.stride(0),
                rows,
                weight.data_ptr(),
                in_features,
                weight.shape[0],
                int(weight.dtype == torch.float16),
                out.data_ptr(),
                torch.get_num_threads(),
            )
        return out


@functools.cache
def load() -> tuple[HalfMatmulKernel | None, str]:
    """(the kernel, "") or (None, why not)."""
    library, why = native.load_library("half_matmul")
    return (HalfMatmulKernel(library), "") if library is not None else (None, why)
