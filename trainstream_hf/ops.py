"""The only Python face of the native library (``torch.ops.trainstream``).

For each op, in this order: a documented wrapper calling ``torch.ops.trainstream.<op>.default``, its
fake (meta) kernel registered with ``torch.library.register_fake``, autograd where it trains, and a
pure-PyTorch ``<op>_reference`` that defines the maths the kernels are tested against.
"""
from __future__ import annotations

import math

import torch

from trainstream_hf import _C  # noqa: F401  (loads the library: registers torch.ops.trainstream)

__all__ = [
    "adamw_step_", "adamw_step_reference", "built_with_cuda",
    "quantize_nf4", "dequantize_nf4", "quantize_nf4_reference", "dequantize_nf4_reference",
    "quantize_nvfp4", "dequantize_nvfp4", "quantize_nvfp4_reference", "dequantize_nvfp4_reference",
    "dequantize_int8", "dequantize_fp8", "quantize_int8_reference", "dequantize_int8_reference",
    "quantize_fp8_reference", "dequantize_fp8_reference",
    "quantize_rows_e4m3", "quantize_rows_e4m3_reference", "has_kernel", "transpose_bytes",
    "transpose_bytes_reference", "div_scalar",
]


def built_with_cuda() -> bool:
    """True when the native extension was compiled with CUDA support."""
    return bool(_C.built_with_cuda())


_HAS_KERNEL: dict[tuple[str, str], bool] = {}  # (op, device type) -> answer


def has_kernel(op: str, device: torch.device | str) -> bool:
    """True when ``torch.ops.trainstream.<op>`` has a kernel for ``device``'s type (CPU always; CUDA in a CUDA build).

    torch has no public "is there a kernel for this op on this device" query; this private one has been stable since
    torch 1.10. Callers use it to fall back to the ``<op>_reference`` where a build has no kernel for the device.
    The answer is cached per (op, device type): the library registers its kernels once, when ``_C`` loads, and the
    dispatcher query costs ~10 us, which the FP8 matmul path would otherwise pay twice per layer call.
    """
    dev_type = device.type if isinstance(device, torch.device) else torch.device(device).type
    hit = _HAS_KERNEL.get((op, dev_type))
    if hit is None:
        key = {"cpu": "CPU", "cuda": "CUDA"}.get(dev_type)
        hit = key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(f"trainstream::{op}", key)
        _HAS_KERNEL[(op, dev_type)] = hit
    return hit


def div_scalar(t: torch.Tensor, c: float) -> torch.Tensor:
    """``t / c`` correctly rounded on every device. CUDA divides a tensor by a Python scalar as a multiplication by
    the scalar's float32 reciprocal, one ulp off for some inputs (found on the H200: a different NVFP4 tensor scale
    than the CPU's); a divisor that lives on the tensor's device takes the true division."""
    return t / torch.full((), c, dtype=t.dtype, device=t.device)


# --------------------------------------------------------------------------------------------
# adamw_step_
# --------------------------------------------------------------------------------------------

def adamw_step_(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                grad: torch.Tensor, *, lr: float, beta1: float = 0.9, beta2: float = 0.999,
                eps: float = 1e-8, weight_decay: float = 0.01, step: int,
                maximize: bool = False, param_bf16: torch.Tensor | None = None, num_threads: int = 0) -> None:
    """One AdamW step over fp32 master weights, in place (CPU kernel).

    The maths is torch.optim.AdamW's (Loshchilov & Hutter, "Decoupled Weight Decay Regularization",
    ICLR 2019), with t = ``step`` (1 for the first update)::

        g  = -grad if maximize else grad
        p  = p * (1 - lr * weight_decay)
        m  = m + (1 - beta1) * (g - m)                  (torch's lerp, weight < 0.5)
        v  = beta2 * v + (1 - beta2) * g * g
        p  = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

    Args:
        param: fp32 master weights, contiguous, updated in place.
        exp_avg: fp32 first moment, same numel, updated in place.
        exp_avg_sq: fp32 second moment, same numel, updated in place.
        grad: fp32 or bf16 gradient, same numel.
        lr, beta1, beta2, eps, weight_decay: AdamW hyper-parameters.
        step: the step number after this update (>= 1), used for bias correction.
        maximize: ascend instead of descend.
        param_bf16: optional bf16 tensor, same numel, that receives bf16(param) after the update
            (round to nearest even) in the same pass.
        num_threads: threads of the native pool to use (0: ``torch.get_num_threads()``); the bits do not depend
            on it (elementwise).
    """
    torch.ops.trainstream.adamw_step_.default(param, exp_avg, exp_avg_sq, grad, param_bf16, lr, beta1,
                                              beta2, eps, weight_decay, step, maximize, num_threads)


@torch.library.register_fake("trainstream::adamw_step_")
def _adamw_step_fake(param, exp_avg, exp_avg_sq, grad, param_bf16, lr, beta1, beta2, eps, weight_decay,
                     step, maximize, num_threads=0):
    for name, t in (("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        torch._check(t.dtype == torch.float32, lambda: f"adamw_step_: {name} must be float32, got {t.dtype}")
        torch._check(t.numel() == param.numel(), lambda: f"adamw_step_: {name} numel differs from param's")
    torch._check(grad.dtype in (torch.float32, torch.bfloat16),
                 lambda: f"adamw_step_: grad must be float32 or bfloat16, got {grad.dtype}")
    torch._check(grad.numel() == param.numel(), lambda: "adamw_step_: grad numel differs from param's")
    if param_bf16 is not None:
        torch._check(param_bf16.dtype == torch.bfloat16, lambda: "adamw_step_: param_bf16 must be bfloat16")
        torch._check(param_bf16.numel() == param.numel(), lambda: "adamw_step_: param_bf16 numel differs")
    torch._check(step >= 1, lambda: f"adamw_step_: step must be >= 1, got {step}")
    return None


def adamw_step_reference(param, exp_avg, exp_avg_sq, grad, *, lr, beta1=0.9, beta2=0.999, eps=1e-8,
                         weight_decay=0.01, step, maximize=False, param_bf16=None, num_threads=0) -> None:
    """Pure-PyTorch AdamW step with the same signature and maths as :func:`adamw_step_`.

    Written as torch.optim.AdamW's single-tensor path is, so that the two agree to rounding.
    """
    g = grad.to(torch.float32)
    if maximize:
        g = -g
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    step_size = lr / (1 - beta1 ** step)
    bias_correction2_sqrt = math.sqrt(1 - beta2 ** step)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
    if param_bf16 is not None:
        param_bf16.copy_(param.view_as(param_bf16) if param.shape == param_bf16.shape else param.reshape(param_bf16.shape))


# --------------------------------------------------------------------------------------------
# Frozen-weight formats (layouts: trainstream_hf/quant/formats.py)
#
# NF4 and NVFP4 pack bits, so they have native quantize and dequantize kernels (csrc/cpu/quant.cpp, csrc/cuda/quant.cu)
# that equal these references bit for bit. int8 and FP8 have native dequantize kernels (the hot path: one fused pass
# instead of a convert kernel plus a multiply); their quantizers are the references on every device.
# --------------------------------------------------------------------------------------------

WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
E4M3_MAX = 448.0
E2M1_MAX = 6.0
NF4_BLOCK, NF4_GROUP, NVFP4_BLOCK = 64, 256, 16

# QLoRA's NormalFloat-4 code (Dettmers et al. 2023, arXiv:2305.14314), exactly as bitsandbytes stores it:
# bitsandbytes/backends/utils.py, _NF4_QUANT_TABLE (bitsandbytes-foundation/bitsandbytes @ 0155ecc6).
NF4_CODE = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023,
    1.0], dtype=torch.float32)
_NF4_MIDPOINTS = (NF4_CODE[:-1] + NF4_CODE[1:]) * 0.5

# E2M1 (FP4) code -> value; bit 3 is the sign (OCP Microscaling Formats spec v1.0, FP4 E2M1).
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)

_DEVICE_TABLES: dict[tuple[int, torch.device], torch.Tensor] = {}


def _on_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``table`` (one of the constant code tables above) on ``device``, copied once per device and kept.

    A pageable host-to-device copy synchronises with the host; caching it keeps the CUDA fallbacks (and the
    QuantLinear forward built on them) free of host syncs after the first call.
    """
    if device.type == "cpu":
        return table
    key = (id(table), device)
    cached = _DEVICE_TABLES.get(key)
    if cached is None:
        cached = _DEVICE_TABLES[key] = table.to(device)
    return cached


def check_weight(op: str, weight: torch.Tensor, multiple: int = 1) -> None:
    """Raises ValueError / TypeError unless ``weight`` can be quantized by ``op``.

    Args:
        op: name used in the message.
        weight: the (out_features, in_features) weight.
        multiple: in_features must be a multiple of this (the format's block size).
    """
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{op}: weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"{op}: weight must be 2-D (out_features, in_features), got shape {tuple(weight.shape)}")
    if weight.dtype not in WEIGHT_DTYPES:
        raise TypeError(f"{op}: weight must be float32, bfloat16 or float16, got {weight.dtype}")
    if weight.numel() == 0:
        raise ValueError(f"{op}: weight is empty (shape {tuple(weight.shape)})")
    if weight.shape[1] % multiple:
        raise ValueError(f"{op}: in_features must be a multiple of {multiple}, got {weight.shape[1]}; pad the "
                         f"weight's columns (and the input's features) with zeros")


def _check_finite(op: str, absmax: torch.Tensor) -> None:
    if not bool(torch.isfinite(absmax).all()):
        raise ValueError(f"{op}: weight contains inf or NaN")


def _check_out_dtype(op: str, dtype: torch.dtype) -> None:
    if dtype not in WEIGHT_DTYPES:
        raise TypeError(f"{op}: dtype must be float32, bfloat16 or float16, got {dtype}")


def _fake_check_weight(op, weight, multiple):
    torch._check(weight.dim() == 2, lambda: f"{op}: weight must be 2-D (out_features, in_features)")
    torch._check(weight.dtype in WEIGHT_DTYPES, lambda: f"{op}: weight must be float32, bfloat16 or float16")
    torch._check(weight.shape[1] % multiple == 0, lambda: f"{op}: in_features must be a multiple of {multiple}")


def _safe_div(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x / d where d != 0, else 0 (a zero scale means an all-zero block)."""
    return torch.where(d != 0, x / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(x))


# --------------------------------------------------------------------------------------------
# quantize_nf4 / dequantize_nf4
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


@torch.library.register_fake("trainstream::quantize_nf4")
def _quantize_nf4_fake(weight):
    _fake_check_weight("quantize_nf4", weight, NF4_BLOCK)
    rows, cols = weight.shape
    nb = rows * cols // NF4_BLOCK
    return (weight.new_empty((rows, cols // 2), dtype=torch.uint8),
            weight.new_empty((nb,), dtype=torch.float8_e4m3fn),
            weight.new_empty(((nb + NF4_GROUP - 1) // NF4_GROUP,), dtype=torch.float32),
            weight.new_empty((), dtype=torch.float32))


def dequantize_nf4(data: torch.Tensor, absmax_q: torch.Tensor, absmax_scale: torch.Tensor,
                   absmax_offset: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantizes :func:`quantize_nf4`'s output to a (out_features, in_features) ``dtype`` weight (native kernel)."""
    return torch.ops.trainstream.dequantize_nf4.default(data, absmax_q, absmax_scale, absmax_offset, dtype)


@torch.library.register_fake("trainstream::dequantize_nf4")
def _dequantize_nf4_fake(data, absmax_q, absmax_scale, absmax_offset, dtype):
    torch._check(data.dim() == 2 and data.dtype == torch.uint8, lambda: "dequantize_nf4: data must be 2-D uint8")
    torch._check(absmax_q.dtype == torch.float8_e4m3fn, lambda: "dequantize_nf4: absmax_q must be float8_e4m3fn")
    torch._check(dtype in WEIGHT_DTYPES, lambda: f"dequantize_nf4: unsupported dtype {dtype}")
    return data.new_empty((data.shape[0], data.shape[1] * 2), dtype=dtype)


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
# quantize_nvfp4 / dequantize_nvfp4
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


@torch.library.register_fake("trainstream::quantize_nvfp4")
def _quantize_nvfp4_fake(weight):
    _fake_check_weight("quantize_nvfp4", weight, NVFP4_BLOCK)
    rows, cols = weight.shape
    return (weight.new_empty((rows, cols // 2), dtype=torch.uint8),
            weight.new_empty((rows, cols // NVFP4_BLOCK), dtype=torch.float8_e4m3fn),
            weight.new_empty((), dtype=torch.float32))


def dequantize_nvfp4(data: torch.Tensor, block_scale: torch.Tensor, tensor_scale: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantizes :func:`quantize_nvfp4`'s output to a (out_features, in_features) ``dtype`` weight (native kernel)."""
    return torch.ops.trainstream.dequantize_nvfp4.default(data, block_scale, tensor_scale, dtype)


@torch.library.register_fake("trainstream::dequantize_nvfp4")
def _dequantize_nvfp4_fake(data, block_scale, tensor_scale, dtype):
    torch._check(data.dim() == 2 and data.dtype == torch.uint8, lambda: "dequantize_nvfp4: data must be 2-D uint8")
    torch._check(block_scale.dtype == torch.float8_e4m3fn,
                 lambda: "dequantize_nvfp4: block_scale must be float8_e4m3fn")
    torch._check(dtype in WEIGHT_DTYPES, lambda: f"dequantize_nvfp4: unsupported dtype {dtype}")
    return data.new_empty((data.shape[0], data.shape[1] * 2), dtype=dtype)


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


def _dequantize_rowwise_fake(op, data, scale, dtype, code_dtype):
    torch._check(data.dim() == 2 and data.dtype == code_dtype, lambda: f"{op}: data must be 2-D {code_dtype}")
    torch._check(scale.dtype == torch.float32 and scale.dim() == 1 and scale.shape[0] == data.shape[0],
                 lambda: f"{op}: scale must be float32 (out_features,)")
    torch._check(dtype in WEIGHT_DTYPES, lambda: f"{op}: unsupported dtype {dtype}")
    return data.new_empty(data.shape, dtype=dtype)


@torch.library.register_fake("trainstream::dequantize_int8")
def _dequantize_int8_fake(data, scale, dtype):
    return _dequantize_rowwise_fake("dequantize_int8", data, scale, dtype, torch.int8)


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


@torch.library.register_fake("trainstream::dequantize_fp8")
def _dequantize_fp8_fake(data, scale, dtype):
    return _dequantize_rowwise_fake("dequantize_fp8", data, scale, dtype, torch.float8_e4m3fn)


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


# --------------------------------------------------------------------------------------------
# quantize_rows_e4m3 (activations of the FP8 matmul path, trainstream_hf/quant/matmul.py)
# --------------------------------------------------------------------------------------------

def quantize_rows_e4m3(x: torch.Tensor, col_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row FP8 E4M3 quantization in one fused kernel (maths: :func:`quantize_rows_e4m3_reference`, bit for bit).

    The CUDA kernel runs one thread block per row (a pass for the row's amax, a pass to write the codes, the row held
    in registers between them up to 32768 features) and never synchronises with the host; on sm_89+ it rounds to E4M3
    with the hardware conversion, the same bits as c10's (csrc/cuda/quant.cu gives the argument).

    Args:
        x: (T, K) float32 / bfloat16 / float16, K >= 1.
        col_scale: optional float32 (K,) multiplied into every row first (the FP8 backward folds the weight's
            per-output-channel scale into the gradient with it).

    Returns:
        ``(q, row_scale)``: float8_e4m3fn (T, K); float32 (T, 1), the layout ``torch._scaled_mm``'s row-wise
        ``scale_a`` takes.
    """
    return torch.ops.trainstream.quantize_rows_e4m3.default(x, col_scale)


@torch.library.register_fake("trainstream::quantize_rows_e4m3")
def _quantize_rows_e4m3_fake(x, col_scale):
    torch._check(x.dim() == 2, lambda: "quantize_rows_e4m3: x must be 2-D (tokens, features)")
    torch._check(x.dtype in WEIGHT_DTYPES, lambda: f"quantize_rows_e4m3: x must be float32, bfloat16 or float16, "
                                                   f"got {x.dtype}")
    torch._check(x.shape[1] >= 1, lambda: "quantize_rows_e4m3: x has no features")
    if col_scale is not None:
        torch._check(col_scale.dtype == torch.float32 and col_scale.dim() == 1 and col_scale.shape[0] == x.shape[1],
                     lambda: "quantize_rows_e4m3: col_scale must be float32 (K,)")
    return (x.new_empty(x.shape, dtype=torch.float8_e4m3fn), x.new_empty((x.shape[0], 1), dtype=torch.float32))


def quantize_rows_e4m3_reference(x: torch.Tensor, col_scale: torch.Tensor | None = None
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch per-row E4M3 quantization; the maths :func:`quantize_rows_e4m3` reproduces bit for bit.

    In float32: ``v = x * col_scale`` (one rounding; ``v = x`` without it), ``s = max|v_row| / 448``,
    ``q = e4m3(clamp(v / s, -448, 448))`` (round to nearest even). A row of zeros gets ``s = 0`` and codes +0; a row
    holding a NaN gets a NaN scale and NaN codes. Without ``col_scale`` this is :func:`quantize_fp8_reference`
    applied to activations (scale kept (T, 1)), minus its finiteness check (a host sync).
    """
    v = x.float()
    if col_scale is not None:
        v = v * col_scale
    s = div_scalar(v.abs().amax(dim=1, keepdim=True), E4M3_MAX)
    return _safe_div(v, s.expand_as(v)).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), s


# --------------------------------------------------------------------------------------------
# transpose_bytes (the FP8 backward's column-major weight operand, trainstream_hf/quant/matmul.py)
# --------------------------------------------------------------------------------------------

def transpose_bytes(x: torch.Tensor) -> torch.Tensor:
    """``x.t().contiguous()`` for a 2-D tensor of 1-byte elements (uint8, int8, float8), same dtype.

    On CUDA a tiled shared-memory kernel: torch's generic strided copy reads or writes one side a byte at a time,
    far below memory bandwidth, and the FP8 backward transposes every weight it multiplies.
    """
    return torch.ops.trainstream.transpose_bytes.default(x)


@torch.library.register_fake("trainstream::transpose_bytes")
def _transpose_bytes_fake(x):
    torch._check(x.dim() == 2, lambda: "transpose_bytes: x must be 2-D")
    torch._check(x.element_size() == 1, lambda: f"transpose_bytes: x must have 1-byte elements, got {x.dtype}")
    return x.new_empty((x.shape[1], x.shape[0]))


def transpose_bytes_reference(x: torch.Tensor) -> torch.Tensor:
    """Pure-PyTorch :func:`transpose_bytes` (through uint8: a float8 strided copy is not supported everywhere)."""
    return x.view(torch.uint8).t().contiguous().view(x.dtype)


# --------------------------------------------------------------------------------------------
# fp8_linear (the FP8 tensor-core layer with its autograd node in C++, trainstream_hf/quant/matmul.py)
# --------------------------------------------------------------------------------------------

def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, reuse: bool = True,
               w_t: torch.Tensor | None = None, outliers: int = 0) -> torch.Tensor:
    """``y = torch._scaled_mm(e4m3(x) per row, w.t(), scale_a=s_x, scale_b=w_scale (1, N), out_dtype=x.dtype)`` as
    (..., N), differentiable in ``x``: the backward is :func:`fp8_linear_dgrad` of the output gradient, computed in
    C++ (no Python, no GIL, on the autograd thread). ``w`` and ``w_scale`` are saved for it with ``save_for_backward``
    (saved-tensor hooks see them). No gradient for ``w``, ``w_scale``.

    ``x`` is quantized inside (:func:`quantize_rows_e4m3` of ``x.reshape(-1, K)``), or, with ``reuse``, the quantization
    kept from the previous call is taken when that call quantized this very ``x``, unmodified (same tensor object,
    version counter, storage, layout, stream; same bits as a fresh one): the q / k / v layers reading one hidden state
    quantize it once. The kept copy goes at the first backward through the op, when another one replaces it, when its
    tensor is found dead, or at :func:`fp8_forget_activation` (csrc/autograd/fp8_linear.cpp says what is never kept).

    Args:
        x: (..., K) bfloat16 / float16, the layer's input.
        w: (N, K) float8_e4m3fn codes; w_scale: float32 (N,) per-output-channel scale.
        reuse: keep / reuse the activation quantization as above.
        w_t: optional ``w`` transposed, (K, N) float8_e4m3fn (:func:`transpose_bytes` of ``w``), which the caller keeps
            in step with ``w``: the backward takes it instead of transposing ``w`` on every call (same bits). It is
            held by the autograd node, not saved with ``save_for_backward`` (saved-tensor hooks do not see it).
        outliers: ``k >= 0``; with ``k > 0`` the ``k`` input channels of largest ``max |x|`` over the tokens (picked
            on the device, no host sync) are zeroed in the quantized operand and multiplied in x's dtype (float32
            accumulation) against their dequantized weight columns, added into the FP8 GEMM's output
            (:mod:`trainstream_hf.quant.outliers`); that quantization is never kept or reused. The backward is the
            same.
    """
    return torch.ops.trainstream.fp8_linear.default(x, w, w_scale, reuse, w_t, outliers)


def fp8_gemm_rowwise(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                     out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``(a @ b.T) * scale_a[:, None] * scale_b[None, :]`` in ``out_dtype``: what ``torch._scaled_mm(a, b.t(),
    scale_a (M, 1), scale_b (1, N))`` computes, on cuBLASLt with its algorithm chosen once per shape instead of on
    every call (CUDA builds, sm_90 and cuBLAS 12.9+; csrc/cuda/fp8_gemm.cu). The FP8 layer uses it by default on
    sm_90 where the build has it (:func:`fp8_gemm`, :func:`set_fp8_gemm`).

    Args:
        a: (M, K) float8_e4m3fn; b: (N, K) float8_e4m3fn (row-major, as a linear layer's weight).
        scale_a: float32, M values; scale_b: float32, N values.
        out_dtype: bfloat16 or float16.
    """
    return torch.ops.trainstream.fp8_gemm_rowwise.default(a, b, scale_a, scale_b, out_dtype)


@torch.library.register_fake("trainstream::fp8_gemm_rowwise")
def _fp8_gemm_rowwise_fake(a, b, scale_a, scale_b, out_dtype):
    torch._check(a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[1],
                 lambda: "fp8_gemm_rowwise: a must be (M, K) and b (N, K)")
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def fp8_activation_cache() -> dict:
    """The kept activation quantization of :func:`fp8_linear`: ``{"kept": bool, "hits": int, "misses": int}`` (counts
    since the library loaded, over the calls with ``reuse``; a miss is a quantization made)."""
    kept, hits, misses = _C.fp8_activation_cache(False)
    return {"kept": bool(kept), "hits": hits, "misses": misses}


def fp8_forget_activation() -> None:
    """Drops :func:`fp8_linear`'s kept activation quantization (the next call quantizes afresh)."""
    _C.fp8_activation_cache(True)


def fp8_linear_dgrad(dy: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     w_t: torch.Tensor | None = None) -> torch.Tensor:
    """The FP8 layer's input gradient: ``g = dy * w_scale`` quantized per row to E4M3 (:func:`quantize_rows_e4m3`),
    times the column-major codes on the tensor cores with scale_b ones; (T, K) in dy's dtype. The column-major codes
    are ``w_t`` where given ((K, N) float8_e4m3fn, ``w`` transposed), else :func:`transpose_bytes` of ``w``, made for
    this call; the same bytes either way, so the same bits."""
    return torch.ops.trainstream.fp8_linear_dgrad.default(dy, w, w_scale, w_t)


def _check_transposed_fake(op, w, w_t):
    if w_t is not None:
        torch._check(w_t.dim() == 2 and w_t.shape[0] == w.shape[1] and w_t.shape[1] == w.shape[0],
                     lambda: f"{op}: w_t must be w transposed, (K, N)")


@torch.library.register_fake("trainstream::fp8_linear")
def _fp8_linear_fake(x, w, w_scale, reuse=True, w_t=None, outliers=0):
    torch._check(x.dim() >= 1 and w.dim() == 2 and x.shape[-1] == w.shape[1], lambda: "fp8_linear: x must be (..., K)")
    torch._check(0 <= outliers <= w.shape[1], lambda: "fp8_linear: outliers must be a channel count in [0, K]")
    _check_transposed_fake("fp8_linear", w, w_t)
    return x.new_empty((*x.shape[:-1], w.shape[0]))


@torch.library.register_fake("trainstream::fp8_linear_dgrad")
def _fp8_linear_dgrad_fake(dy, w, w_scale, w_t=None):
    torch._check(dy.dim() == 2 and w.dim() == 2 and dy.shape[1] == w.shape[0],
                 lambda: "fp8_linear_dgrad: dy must be (T, N)")
    _check_transposed_fake("fp8_linear_dgrad", w, w_t)
    return dy.new_empty((dy.shape[0], w.shape[1]))


FP8_GEMMS = ("auto", "cublaslt", "torch")


def fp8_gemm(device: torch.device | str | None = None) -> str:
    """The FP8 layer's GEMM: with ``device``, the one its calls on ``device`` run now, ``"cublaslt"``
    (:func:`fp8_gemm_rowwise`) or ``"torch"`` (``torch._scaled_mm``; always on the CPU); without, the setting,
    one of :data:`FP8_GEMMS`.

    The setting comes from ``TRAINSTREAM_FP8_GEMM``, read once (at the first FP8 GEMM or the first call here), not per
    GEMM: a change to the variable afterwards is seen only through :func:`set_fp8_gemm`. ``auto`` (the default, also
    for an empty variable) takes cuBLASLt where this build has it and the device is sm_90, torch elsewhere.
    """
    if device is None:
        return _C.fp8_gemm_setting(None, False)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _C.fp8_gemm_on(device)


def fp8_gemm_plans(clear: bool = False) -> list[dict]:
    """The plans :func:`fp8_gemm_rowwise` keeps, one per (device, M, N, K, output dtype, alignments), sorted: keys
    ``device``, ``m``, ``n``, ``k``, ``out_dtype``, ``candidates`` (algorithms cuBLASLt's heuristic offered, up to 8),
    ``chosen`` (the kept one's index in the heuristic's order), ``tuned`` (chosen by timing each once; False: the
    heuristic's first, as under CUDA graph capture or with ``TRAINSTREAM_FP8_GEMM_TUNE=0``), ``ms_chosen`` and
    ``ms_first`` (milliseconds per GEMM of the kept and of the heuristic's first algorithm, -1 where not timed). Empty
    where the build has no cuBLASLt GEMM.

    Args:
        clear: forget the plans after reading them (the next call of each shape chooses again; tests).
    """
    return list(_C.fp8_gemm_plans(clear))


def set_fp8_gemm(choice: str | None) -> str:
    """Changes the FP8 layer's GEMM setting at run time (tests, benchmarks); it applies from the next GEMM, process
    wide.

    Args:
        choice: one of :data:`FP8_GEMMS`, or None to read ``TRAINSTREAM_FP8_GEMM`` again (e.g. after a script has
            set ``os.environ``).

    Returns:
        The setting before the change, to give back to this function afterwards (None where it was never read and
        the variable's value is unknown: giving None back reads the variable again).

    Raises:
        ValueError: an unknown choice, or an unknown value of the variable (the setting is then left as it was).
    """
    try:
        before = _C.fp8_gemm_setting(None, False)
    except ValueError:  # TRAINSTREAM_FP8_GEMM was never read, and is wrong: the choice may put that right
        before = None
    if choice is None:
        _C.fp8_gemm_setting(None, True)
    else:
        _C.fp8_gemm_setting(choice, False)
    return before


# --------------------------------------------------------------------------------------------
# lora_add (a LoRA adapter's contribution with its autograd node in C++, trainstream_hf/integrations/peft.py)
# --------------------------------------------------------------------------------------------

def lora_add(result: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             scaling: float) -> torch.Tensor:
    """``result + (x A^T) B^T * scaling``, as PEFT's vanilla ``lora.Linear`` adds it to its base layer's output
    (dropout off), with PEFT's dtypes and rounding: the matmuls in the autocast dtype under autocast, else in the
    adapters' dtype (x cast to it); the sum in the promoted dtype, returned in ``result``'s. Differentiable in
    ``result``, ``x``, ``lora_a`` and ``lora_b`` through one autograd node in C++ (autograd's own matmul forms).

    Args:
        result: (..., N) the base layer's output for ``x``.
        x: (..., K) the layer's input.
        lora_a: (r, K); lora_b: (N, r), one floating dtype.
        scaling: PEFT's ``lora_alpha / r`` (or its rsLoRA form).
    """
    return torch.ops.trainstream.lora_add.default(result, x, lora_a, lora_b, scaling)


@torch.library.register_fake("trainstream::lora_add")
def _lora_add_fake(result, x, lora_a, lora_b, scaling):
    torch._check(x.shape[-1] == lora_a.shape[1] and result.shape[-1] == lora_b.shape[0],
                 lambda: "lora_add: x must be (..., K) and result (..., N)")
    return torch.empty_like(result)


def lora_dequant_linear(x: torch.Tensor, packed: list[torch.Tensor], fmt: str, lora_a: torch.Tensor,
                        lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """A weight-only quantized layer and its LoRA adapter in one autograd node (C++): ``y = x W^T + scaling (x A^T)
    B^T`` with ``W = dequantize_<fmt>(*packed)`` in the compute dtype (autocast's under autocast, else ``x``'s, which
    must then be the adapters'). The adapter's product is accumulated into the base GEMM's output (a GEMM with beta =
    1), and in the backward its input gradient into the base's: no separate multiply or add over (T, N) / (T, K)
    tensors, and one rounding fewer than PEFT's graph (so not its bits). Gradients for ``x``, ``lora_a``,
    ``lora_b``; the packed weight is saved with ``save_for_backward`` and decoded again in the backward.

    bf16 ``x`` with float32 adapters outside autocast (PEFT's default adapter dtype) is taken without widening
    ``x``: the adapters' float32 operands are split into bf16 parts (:func:`split_bf16`) and each product is one bf16
    GEMM with float32 accumulation, float32-level results (csrc/autograd/dequant_linear.cpp says which terms).

    Args:
        x: (..., K); packed: the weight's packed tensors; fmt: ``"int8"``, ``"nf4"``, ``"fp8"`` or ``"nvfp4"``.
        lora_a: (r, K); lora_b: (N, r); scaling: PEFT's ``lora_alpha / r`` (or rsLoRA's).
    """
    return torch.ops.trainstream.lora_dequant_linear.default(x, packed, fmt, lora_a, lora_b, scaling)


@torch.library.register_fake("trainstream::lora_dequant_linear")
def _lora_dequant_linear_fake(x, packed, fmt, lora_a, lora_b, scaling):
    torch._check(x.dim() >= 1 and x.shape[-1] == lora_a.shape[1], lambda: "lora_dequant_linear: x must be (..., K)")
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    return x.new_empty((*x.shape[:-1], lora_b.shape[0]), dtype=dtype)


# --------------------------------------------------------------------------------------------
# rms_norm (Llama-family RMSNorm, fused; trainstream_hf/engine/norms.py)
# --------------------------------------------------------------------------------------------

def split_bf16(t: torch.Tensor, pattern: list[int], dim: int) -> torch.Tensor:
    """A float32 matrix as bfloat16 parts laid out for one bf16 GEMM: ``t = p0 + p1 + p2`` with ``p0 = bf16(t)``,
    ``p1 = bf16(t - p0)``, ``p2 = bf16(t - p0 - p1)`` (round to nearest even; exact for ``t`` in bf16's normal
    range), and the parts named by ``pattern`` side by side: row blocks (``dim=0``, shape ``(len(pattern) * R, C)``)
    or column blocks (``dim=1``, shape ``(R, len(pattern) * C)``). Same bits on CPU and GPU.

    Args:
        t: (R, C) float32; pattern: 1 to 8 part indices, each 0, 1 or 2; dim: 0 or 1.
    """
    return torch.ops.trainstream.split_bf16.default(t, list(pattern), dim)


@torch.library.register_fake("trainstream::split_bf16")
def _split_bf16_fake(t, pattern, dim):
    n = len(pattern)
    shape = (n * t.shape[0], t.shape[1]) if dim == 0 else (t.shape[0], n * t.shape[1])
    return t.new_empty(shape, dtype=torch.bfloat16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x.float() * rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)`` (transformers'
    LlamaRMSNorm) in one kernel each way, differentiable in ``x`` and ``weight`` (its autograd node in C++). Same
    maths and rounding points as the module; the row sums are reduced in another order, so results may differ from
    it in the last bit.

    Args:
        x: (..., K) float32 / bfloat16 / float16; weight: (K,) of x's dtype; eps: the module's ``variance_epsilon``.
    """
    return torch.ops.trainstream.rms_norm.default(x, weight, eps)


@torch.library.register_fake("trainstream::rms_norm")
def _rms_norm_fake(x, weight, eps):
    torch._check(x.shape[-1] == weight.shape[0], lambda: "rms_norm: x must be (..., K)")
    return torch.empty_like(x)


@torch.library.register_fake("trainstream::rms_norm_fwd")
def _rms_norm_fwd_fake(x, weight, eps):
    return torch.empty_like(x), x.new_empty((x.shape[0],), dtype=torch.float32)


@torch.library.register_fake("trainstream::rms_norm_bwd")
def _rms_norm_bwd_fake(gy, x, weight, rstd):
    return torch.empty_like(x)


def dequant_linear(x: torch.Tensor, packed: list[torch.Tensor], fmt: str) -> torch.Tensor:
    """``F.linear(x, dequantize_<fmt>(*packed, x.dtype))``, differentiable in ``x`` with its autograd node in C++: the
    backward decodes the weight again in the gradient's dtype, ``dx = dy @ W``, without Python or the GIL. ``packed``
    (the format's tensors in ``QuantFormat.tensor_names`` order) is saved with ``save_for_backward``.

    Args:
        x: (..., K) float32 / bfloat16 / float16 (y is (..., N); the reshapes happen inside, no autograd nodes).
        packed: the weight's packed tensors (``QuantizedTensor.tensors`` values).
        fmt: ``"int8"``, ``"nf4"``, ``"fp8"`` or ``"nvfp4"``.
    """
    return torch.ops.trainstream.dequant_linear.default(x, packed, fmt)


@torch.library.register_fake("trainstream::dequant_linear")
def _dequant_linear_fake(x, packed, fmt):
    torch._check(x.dim() >= 1, lambda: "dequant_linear: x must be (..., K)")
    return x.new_empty((*x.shape[:-1], packed[0].shape[0]))
