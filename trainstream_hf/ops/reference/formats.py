"""References of the frozen-weight formats (layouts: trainstream_hf/quant/formats.py): NF4 and NVFP4 quantize and
dequantize, which the native kernels reproduce bit for bit, and int8 and FP8, whose quantizers are these references on
every device and whose dequantizers the native kernels reproduce bit for bit."""
from __future__ import annotations

import math

import torch

from trainstream_hf.ops._common import (
    _NF4_MIDPOINTS, E2M1_MAX, E2M1_VALUES, E4M3_MAX, NF4_BLOCK, NF4_CODE, NF4_GROUP, NVFP4_BLOCK, _check_finite,
    _check_out_dtype, _on_device, _safe_div, check_weight, div_scalar,
)


# --------------------------------------------------------------------------------------------
# NF4
# --------------------------------------------------------------------------------------------

def _nf4_offset_reference(absmax: torch.Tensor) -> torch.Tensor:
    """The mean of the absmax values, summed exactly so that every device and thread count agrees bit for bit.

    Each absmax is floored to a fixed-point integer with 32 bits below the leading bit of the largest one
    (relative error <= 2^-32, far below float32's own), the integers are summed exactly in int64, and the mean
    is formed in float64 and rounded once to float32.
    """
    amax = float(absmax.max())
    if amax == 0.0:
        return torch.zeros((), dtype=torch.float32, device=absmax.device)
    k = 32 - math.frexp(amax)[1]
    total = int(torch.floor(absmax.double() * 2.0 ** k).long().sum())
    mean = float(total) / float(absmax.numel()) * 2.0 ** -k
    return torch.tensor(mean, dtype=torch.float32, device=absmax.device)


def _nf4_block_absmax(absmax_q, absmax_scale, absmax_offset):
    """Dequantised absmax per block of 64: e4m3 code * its group's scale + offset (two float32 roundings)."""
    s = absmax_scale.repeat_interleave(NF4_GROUP)[: absmax_q.numel()]
    return absmax_q.float() * s + absmax_offset


def quantize_nf4_reference(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-PyTorch NF4 quantization; defines the maths :func:`quantize_nf4`'s kernels reproduce bit for bit.

    QLoRA's NF4 (Dettmers et al. 2023) with double quantisation, in float32 throughout:

    1. Flatten the weight row-major into blocks of 64; ``a_b = max |w|`` per block.
    2. ``offset = mean(a)`` (exact sum, see ``_nf4_offset_reference``). In groups of 256 blocks (the last may be
       shorter), ``s_g = max |a_b - offset| / 448`` and ``q_b = e4m3(( a_b - offset) / s_g)`` (round to nearest
       even, saturating; 0 when ``s_g == 0``). This is *not* bitsandbytes' double quantisation, which codes
       ``a_b - offset`` with its 8-bit dynamic map: we use the E4M3 float8 type as the 8-bit code instead.
    3. ``d_b = float(q_b) * s_g + offset`` is the absmax dequantize will use; every weight is coded against it:
       ``code = nearest NF4 value to w / d_b`` (ties to the lower code; 0 where ``d_b == 0``).
    4. Two codes per byte, the even element in the high nibble (bitsandbytes' order).
    """
    check_weight("quantize_nf4", weight, NF4_BLOCK)
    rows, cols = weight.shape
    x = weight.float().reshape(-1, NF4_BLOCK)
    absmax = x.abs().amax(dim=1)
    _check_finite("quantize_nf4", absmax)
    offset = _nf4_offset_reference(absmax)
    nb = absmax.numel()
    ng = (nb + NF4_GROUP - 1) // NF4_GROUP
    centred = absmax - offset
    padded = torch.zeros(ng * NF4_GROUP, dtype=torch.float32, device=x.device)
    padded[:nb] = centred
    absmax_scale = div_scalar(padded.view(ng, NF4_GROUP).abs().amax(dim=1), E4M3_MAX)
    absmax_q = _safe_div(centred, absmax_scale.repeat_interleave(NF4_GROUP)[:nb]).to(torch.float8_e4m3fn)
    d = _nf4_block_absmax(absmax_q, absmax_scale, offset)
    v = _safe_div(x, d[:, None].expand_as(x))
    codes = torch.bucketize(v, _on_device(_NF4_MIDPOINTS, v.device)).to(torch.uint8).view(rows, cols)
    data = (codes[:, 0::2] << 4) | codes[:, 1::2]
    return data, absmax_q, absmax_scale, offset


def dequantize_nf4_reference(data, absmax_q, absmax_scale, absmax_offset, dtype=torch.bfloat16) -> torch.Tensor:
    """Pure-PyTorch inverse of :func:`quantize_nf4_reference`: ``NF4[code] * d_b``, rounded once to ``dtype``."""
    _check_out_dtype("dequantize_nf4", dtype)
    rows, half = data.shape
    codes = torch.stack([data >> 4, data & 0xF], dim=-1).view(-1, NF4_BLOCK).long()
    d = _nf4_block_absmax(absmax_q, absmax_scale, absmax_offset)
    return (_on_device(NF4_CODE, data.device)[codes] * d[:, None]).to(dtype).view(rows, half * 2)


# --------------------------------------------------------------------------------------------
# NVFP4
# --------------------------------------------------------------------------------------------

def quantize_nvfp4_reference(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-PyTorch NVFP4 quantization; defines the maths :func:`quantize_nvfp4`'s kernels reproduce bit for bit.

    NVFP4 as NVIDIA defines it ("Introducing NVFP4 for Efficient and Accurate Low-Precision Inference", NVIDIA
    technical blog, 2025): E2M1 values, one E4M3 scale per 16 consecutive weights along in_features, and one
    float32 scale per tensor. In float32:

    1. ``ts = amax(|w|) / (448 * 6)``, so that the largest block's scale is E4M3's largest value.
    2. Per block of 16: ``s = e4m3((max |w_block| / 6) / ts)`` (nearest even, saturating at 448; 0 when ts == 0).
    3. ``t = ts * float(s)``; ``code = e2m1(w / t)``: nearest E2M1 value, ties to the even code, saturating at
       +-6, sign from the sign bit (0 where ``t == 0``). Same rounding as torch's ``_f32_to_floatx_unpacked`` and
       torchao's ``nvfp4_quantize`` with a per-tensor scale.
    4. Two codes per byte, the even element in the low nibble (torch.float4_e2m1fn_x2's order).
    """
    check_weight("quantize_nvfp4", weight, NVFP4_BLOCK)
    rows, cols = weight.shape
    x = weight.float().view(rows, cols // NVFP4_BLOCK, NVFP4_BLOCK)
    bmax = x.abs().amax(dim=-1)
    _check_finite("quantize_nvfp4", bmax)
    tensor_scale = div_scalar(bmax.amax(), E4M3_MAX * E2M1_MAX)
    block_scale = _safe_div(div_scalar(bmax, E2M1_MAX), tensor_scale.expand_as(bmax)).to(torch.float8_e4m3fn)
    t = (tensor_scale * block_scale.float())[..., None]
    v = _safe_div(x, t.expand_as(x))
    a = v.abs()
    codes = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5)
             + (a > 5.0)) | (torch.signbit(v).to(torch.uint8) << 3)
    codes = codes.view(rows, cols)
    data = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return data, block_scale, tensor_scale


def dequantize_nvfp4_reference(data, block_scale, tensor_scale, dtype=torch.bfloat16) -> torch.Tensor:
    """Pure-PyTorch inverse of :func:`quantize_nvfp4_reference`: ``E2M1[code] * (ts * s)``, rounded to ``dtype``."""
    _check_out_dtype("dequantize_nvfp4", dtype)
    rows, half = data.shape
    codes = torch.stack([data & 0xF, data >> 4], dim=-1).view(rows, -1, NVFP4_BLOCK).long()
    t = (tensor_scale * block_scale.float())[..., None]
    return (_on_device(E2M1_VALUES, data.device)[codes] * t).to(dtype).view(rows, half * 2)


# --------------------------------------------------------------------------------------------
# int8 and FP8 (per-output-row scale)
# --------------------------------------------------------------------------------------------

def quantize_int8_reference(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-row absmax int8: ``s = max |w_row| / 127``, ``q = clamp(round(w / s), -127, 127)``.

    Returns:
        ``(data, scale)``: int8 (out, in); float32 (out,). Rows of zeros get ``s = 0`` and codes 0.
    """
    check_weight("quantize_int8", weight)
    x = weight.float()
    amax = x.abs().amax(dim=1)
    _check_finite("quantize_int8", amax)
    scale = div_scalar(amax, 127.0)
    q = torch.round(_safe_div(x, scale[:, None].expand_as(x))).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8_reference(data, scale, dtype=torch.bfloat16) -> torch.Tensor:
    """``float(q) * s`` per row, rounded once to ``dtype``."""
    _check_out_dtype("dequantize_int8", dtype)
    return (data.float() * scale[:, None]).to(dtype)


def quantize_fp8_reference(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel FP8 E4M3: ``s = max |w_row| / 448``, ``q = e4m3(w / s)`` (nearest even, saturating).

    Returns:
        ``(data, scale)``: float8_e4m3fn (out, in); float32 (out,), the layout ``torch._scaled_mm``'s row-wise
        scaling takes for the weight operand.
    """
    check_weight("quantize_fp8", weight)
    x = weight.float()
    amax = x.abs().amax(dim=1)
    _check_finite("quantize_fp8", amax)
    scale = div_scalar(amax, E4M3_MAX)
    v = _safe_div(x, scale[:, None].expand_as(x)).clamp_(-E4M3_MAX, E4M3_MAX)
    return v.to(torch.float8_e4m3fn), scale


def dequantize_fp8_reference(data, scale, dtype=torch.bfloat16) -> torch.Tensor:
    """``float(q) * s`` per row, rounded once to ``dtype``."""
    _check_out_dtype("dequantize_fp8", dtype)
    return (data.float() * scale[:, None]).to(dtype)
