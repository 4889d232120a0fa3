"""Outlier-channel protection for activation-quantized matmuls (``outliers=p``).

LLM activations carry a few input channels whose magnitude is tens of times the rest (Dettmers et al., "LLM.int8()",
arXiv:2208.07339). Quantizing them with the others spends the scale on them: under NVFP4 a 16-element block that holds
one crushes its other 15 values to zero. Per call, :func:`outlier_matmul` takes the ``k = ceil(p * K)`` input channels
with the largest ``max |x|`` over the tokens, multiplies them exactly (float32, against the matching dequantized weight
columns), zeroes them in ``x`` and runs the rest through the low-precision path::

    y = x[:, I] @ W_hat[:, I]^T  +  path(x with columns I zeroed)

which is an exact decomposition of ``x W_hat^T`` whenever ``path`` is exact. ``k`` follows from the shape alone and
the channels are picked with ``torch.topk`` on the device: no ``.item()``, no data-dependent shape, no host sync.

Weight columns: only the ``k`` chosen columns are decoded, per call, straight from the packed weight
(:func:`dequantize_columns`): ``O(N k)`` work and memory. Measured on the CPU (one thread, N = K = 4096, k = 41, median
of 5): decoding the chosen columns takes 4-7 ms for every format; decoding the whole weight and gathering takes
50-200 ms and a transient N x K float32 (64 MiB); gathering from a dequantized bf16 copy kept on the module takes 5-9 ms
(no faster: the strided gather dominates) but holds 32 MiB for good, 2-4x the packed weight, which undoes the
quantization. The outlier product itself runs in float32: the chosen activations are exact in it, the columns decode
exactly, and it is only k / K of the GEMM.

The gradient is unchanged by the split (``dx = dy W_hat``, see :mod:`trainstream_hf.quant.matmul`).

On the FP8 tensor-core path (``fp8_w8a8_scaled_mm``) the same decomposition runs inside the layer's C++ op
(:func:`trainstream_hf.ops.fp8_linear` with ``outliers=k``), the outlier product in the activations' 16-bit dtype
(the chosen columns rounded to it) on the tensor cores, float32 accumulation, added into the FP8 GEMM's output by
one ``addmm_``. As the Python route here (an autograd Function, ~20 dispatched ops from Python per layer call) it cost
1.88x a bf16 layer's time on one Llama-3-8B block on the H100 (quant-h100-a200522.json); the other
activation-quantized path (NVFP4 W4A4, emulated) still takes :func:`outlier_matmul`.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from trainstream_hf import ops
from trainstream_hf.quant.formats import QuantizedTensor
from trainstream_hf.quant.matmul import e2m1_decode

__all__ = ["check_outliers", "num_outliers", "select_outliers", "dequantize_columns", "outlier_matmul"]

MAX_OUTLIERS = 0.5


def check_outliers(p: float) -> float:
    """``p`` as a float; ValueError unless 0 <= p <= 0.5."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= float(p) <= MAX_OUTLIERS:
        raise ValueError(f"outliers must be a fraction of the input channels in [0, {MAX_OUTLIERS}] "
                         f"(e.g. 0.01), got {p!r}")
    return float(p)


def num_outliers(p: float, in_features: int) -> int:
    """``ceil(p * in_features)`` (a fraction that lands on an integer is not bumped up by float rounding)."""
    return min(in_features, math.ceil(round(p * in_features, 6)))


def select_outliers(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (int64, (k,), on x's device) of the ``k`` columns of ``x`` (T, K) with the largest ``max |x|``."""
    return torch.topk(x.abs().amax(dim=0), k, sorted=False).indices


def _columns_int8_fp8(q: QuantizedTensor, idx: torch.Tensor) -> torch.Tensor:
    return q.tensors["data"].index_select(1, idx).float() * q.tensors["scale"][:, None]


def _columns_nf4(q: QuantizedTensor, idx: torch.Tensor) -> torch.Tensor:
    t = q.tensors
    rows, cols = q.shape
    byte = t["data"].index_select(1, idx // 2)
    codes = torch.where(idx % 2 == 0, byte >> 4, byte & 0xF).long()
    blocks_per_row = cols // ops.NF4_BLOCK
    block = (torch.arange(rows, device=idx.device) * blocks_per_row)[:, None] + (idx // ops.NF4_BLOCK)[None, :]
    d = t["absmax_q"][block].float() * t["absmax_scale"][block // ops.NF4_GROUP] + t["absmax_offset"]
    return ops._on_device(ops.NF4_CODE, idx.device)[codes] * d


def _columns_nvfp4(q: QuantizedTensor, idx: torch.Tensor) -> torch.Tensor:
    t = q.tensors
    byte = t["data"].index_select(1, idx // 2)
    codes = torch.where(idx % 2 == 0, byte & 0xF, byte >> 4)
    scale = t["tensor_scale"] * t["block_scale"].index_select(1, idx // ops.NVFP4_BLOCK).float()
    return e2m1_decode(codes) * scale


# format -> decoder of selected columns; each computes exactly what its dequantize does, element for element.
_COLUMN_DECODERS = {"int8": _columns_int8_fp8, "fp8": _columns_int8_fp8, "nf4": _columns_nf4,
                    "nvfp4": _columns_nvfp4}


def dequantize_columns(q: QuantizedTensor, idx: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``dequantize(q, dtype)[:, idx]`` (bit for bit), decoding only those columns of the packed weight.

    Args:
        q: the (N, K) quantized weight.
        idx: int64 column indices on q's device.
        dtype: float32, bfloat16 or float16.

    Returns:
        (N, len(idx)) ``dtype``.
    """
    return _COLUMN_DECODERS[q.fmt.name](q, idx).to(dtype)


def outlier_matmul(x: torch.Tensor, q: QuantizedTensor, k: int,
                   low_precision: Callable[[torch.Tensor, QuantizedTensor], torch.Tensor]) -> torch.Tensor:
    """``x W_hat^T`` with the ``k`` largest input channels of ``x`` taken out of the low-precision path.

    Args:
        x: (T, K) activations, T >= 1.
        q: the (N, K) quantized weight.
        k: number of outlier channels, 1 <= k <= K (:func:`num_outliers`).
        low_precision: the path's forward, ``(x, q) -> (T, N)``.

    Returns:
        (T, N) float32.
    """
    idx = select_outliers(x, k)
    x_out = x.index_select(1, idx).float()
    x_rest = x.index_fill(1, idx, 0)
    return low_precision(x_rest, q).float().addmm_(x_out, dequantize_columns(q, idx).t())
