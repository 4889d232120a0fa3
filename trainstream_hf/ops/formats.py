"""Wrappers of the frozen-weight formats' kernels (layouts: trainstream_hf/quant/formats.py).

NF4 and NVFP4 pack bits, so they have native quantize and dequantize kernels (csrc/cpu/quant.cpp, csrc/cuda/quant.cu)
that equal their references (:mod:`trainstream_hf.ops.reference.formats`) bit for bit. int8 and FP8 have native
dequantize kernels (the hot path: one fused pass instead of a convert kernel plus a multiply); their quantizers are the
references on every device.
"""
from __future__ import annotations

import torch


# --------------------------------------------------------------------------------------------
# NF4
# --------------------------------------------------------------------------------------------

def quantize_nf4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantizes a weight to NF4 with double-quantised absmax (native kernel; maths: :func:`quantize_nf4_reference`).

    Args:
        weight: (out_features, in_features) float32 / bfloat16 / float16, in_features a multiple of 64, finite.

    Returns:
        ``(data, absmax_q, absmax_scale, absmax_offset)``: uint8 (out, in / 2) codes, two per byte with the even
        element in the high nibble; float8_e4m3fn (numel / 64,); float32 (ceil(numel / 64 / 256),); float32 ().
    """
    return torch.ops.trainstream.quantize_nf4.default(weight)


def dequantize_nf4(data: torch.Tensor, absmax_q: torch.Tensor, absmax_scale: torch.Tensor,
                   absmax_offset: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantizes :func:`quantize_nf4`'s output to a (out_features, in_features) ``dtype`` weight (native kernel)."""
    return torch.ops.trainstream.dequantize_nf4.default(data, absmax_q, absmax_scale, absmax_offset, dtype)


# --------------------------------------------------------------------------------------------
# NVFP4
# --------------------------------------------------------------------------------------------

def quantize_nvfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantizes a weight to NVFP4 (native kernel; maths: :func:`quantize_nvfp4_reference`).

    Args:
        weight: (out_features, in_features) float32 / bfloat16 / float16, in_features a multiple of 16, finite.

    Returns:
        ``(data, block_scale, tensor_scale)``: uint8 (out, in / 2) E2M1 codes, two per byte with the even element
        in the low nibble (``data.view(torch.float4_e2m1fn_x2)`` is torch's FP4 type); float8_e4m3fn
        (out, in / 16) row-major; float32 ().
    """
    return torch.ops.trainstream.quantize_nvfp4.default(weight)


def dequantize_nvfp4(data: torch.Tensor, block_scale: torch.Tensor, tensor_scale: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantizes :func:`quantize_nvfp4`'s output to a (out_features, in_features) ``dtype`` weight (native kernel)."""
    return torch.ops.trainstream.dequantize_nvfp4.default(data, block_scale, tensor_scale, dtype)


# --------------------------------------------------------------------------------------------
# int8 and FP8: native dequantize, reference quantize
# --------------------------------------------------------------------------------------------

def dequantize_int8(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantizes :func:`quantize_int8_reference`'s output in one fused pass (native kernel; maths:
    :func:`dequantize_int8_reference`, bit for bit).

    Args:
        data: int8 (out_features, in_features) codes.
        scale: float32 (out_features,) per-row scales.
        dtype: float32, bfloat16 or float16.

    Returns:
        (out_features, in_features) ``dtype``: ``dtype(float(data) * scale[:, None])``.
    """
    return torch.ops.trainstream.dequantize_int8.default(data, scale, dtype)


def dequantize_fp8(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantizes :func:`quantize_fp8_reference`'s output in one fused pass (native kernel; maths:
    :func:`dequantize_fp8_reference`, bit for bit).

    Args:
        data: float8_e4m3fn (out_features, in_features) codes.
        scale: float32 (out_features,) per-row scales.
        dtype: float32, bfloat16 or float16.

    Returns:
        (out_features, in_features) ``dtype``: ``dtype(float(data) * scale[:, None])``.
    """
    return torch.ops.trainstream.dequantize_fp8.default(data, scale, dtype)
