"""References of the layer ops (their autograd nodes in C++, csrc/autograd/): LoRA's add, the weight-only quantized
linear with or without its adapter, the bf16 split of float32 operands, and RMSNorm with the two kernels under it.

Each is plain differentiable PyTorch (autograd gives the gradients the tests compare the op's against). Where the op
rounds in other places than the plain maths (RMSNorm's row sums, the adapter accumulated into the base GEMM), the
reference states the maths and its docstring says how far the op may be from it."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from trainstream_hf.ops.reference.formats import (
    dequantize_fp8_reference, dequantize_int8_reference, dequantize_nf4_reference, dequantize_nvfp4_reference,
)

# fmt -> dequantize_<fmt>_reference, taking the packed tensors in QuantFormat.tensor_names order, then the dtype.
_DEQUANTIZE = {"int8": dequantize_int8_reference, "nf4": dequantize_nf4_reference, "fp8": dequantize_fp8_reference,
               "nvfp4": dequantize_nvfp4_reference}
_PACKED = {"int8": 2, "nf4": 4, "fp8": 2, "nvfp4": 3}


def _dequantize(op: str, packed: list[torch.Tensor], fmt: str, dtype: torch.dtype) -> torch.Tensor:
    if fmt not in _DEQUANTIZE:
        raise ValueError(f"{op}: unknown format '{fmt}' (int8, nf4, fp8 or nvfp4)")
    if len(packed) != _PACKED[fmt]:
        raise ValueError(f"{op}: {fmt} takes {_PACKED[fmt]} packed tensors, got {len(packed)}")
    return _DEQUANTIZE[fmt](*packed, dtype=dtype)


def _compute_dtype(x: torch.Tensor, otherwise: torch.dtype) -> torch.dtype:
    """The autocast dtype where autocast is on for x's device, else ``otherwise``."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else otherwise


# --------------------------------------------------------------------------------------------
# lora_add
# --------------------------------------------------------------------------------------------

def lora_add_reference(result: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                       scaling: float) -> torch.Tensor:
    """Pure-PyTorch :func:`lora_add`: PEFT's vanilla ``lora.Linear`` graph (dropout off), which the op reproduces
    bit for bit, forward and gradients.

    With ``c`` the autocast dtype under autocast, else the adapters' dtype: ``ys = ((x_c A_c^T) B_c^T) * scaling``,
    each product rounded to ``c`` (F.linear), the scaling a separate multiply; ``out = (result + ys)`` in the
    promoted dtype, then cast to result's. The op folds a power-of-two scaling into B instead, which commutes with
    every rounding (barring subnormal results): the same bits.

    Args:
        result: (..., N); x: (..., K); lora_a: (r, K); lora_b: (N, r); scaling: PEFT's ``lora_alpha / r``.
    """
    c = _compute_dtype(x, lora_a.dtype)
    with torch.autocast(x.device.type, enabled=False):  # the casts are explicit, as autocast would make them
        ys = F.linear(F.linear(x.to(c), lora_a.to(c)), lora_b.to(c)) * scaling
        return (result + ys).to(result.dtype)


# --------------------------------------------------------------------------------------------
# dequant_linear / lora_dequant_linear
# --------------------------------------------------------------------------------------------

def dequant_linear_reference(x: torch.Tensor, packed: list[torch.Tensor], fmt: str) -> torch.Tensor:
    """Pure-PyTorch :func:`dequant_linear`: ``F.linear(x, dequantize_<fmt>_reference(*packed, x.dtype))``,
    differentiable in ``x`` (``dx = dy W``, W in dy's dtype, as the op's node decodes it again). The dequantize
    references equal the kernels bit for bit and the GEMMs are the same torch calls, so the op equals this bit for
    bit, forward and input gradient.

    Args:
        x: (..., K) float32 / bfloat16 / float16; packed: the format's tensors in ``QuantFormat.tensor_names``
            order; fmt: ``"int8"``, ``"nf4"``, ``"fp8"`` or ``"nvfp4"``.
    """
    return F.linear(x, _dequantize("dequant_linear", packed, fmt, x.dtype))


def lora_dequant_linear_reference(x: torch.Tensor, packed: list[torch.Tensor], fmt: str, lora_a: torch.Tensor,
                                  lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """Pure-PyTorch :func:`lora_dequant_linear`: ``y = x W^T + scaling (x A^T) B^T`` in the compute dtype ``c``
    (autocast's under autocast, else x's), with ``W = dequantize_<fmt>_reference(*packed, c)``, differentiable in
    ``x``, ``lora_a`` and ``lora_b``.

    Rounding points, as the op's on the CPU: the base product ``x W^T`` rounded to ``c``; the adapter's ``t =
    scaling (x A^T) B^T`` in float32 and added to it with one rounding to ``c`` (the op accumulates it into the base
    GEMM's output). ``x A^T`` is rounded to ``c`` first, except for bfloat16 ``x`` with float32 adapters outside
    autocast (PEFT's default adapter dtype), where the adapter runs in float32 throughout, as PEFT's does.

    How far the op may be: its float32 sums run in another order (the bf16 split of float32 operands keeps the six
    terms above 2^-24 of each product, csrc/autograd/dequant_linear.cpp), which can move the final rounding by one
    ulp of ``c``; on CUDA the adapter's term is rounded to ``c`` before the sum (cuBLAS' bf16 addmm), one more
    rounding. Gradients (autograd's here): the reference scales the adapter's gradients in float32 and rounds the
    base's and the adapter's input-gradient terms separately before adding them; the op rounds ``g B`` and ``g^T (x
    A^T)`` to ``c`` before scaling them and the input gradient once: one or two ulps of ``c`` apart (float32-level
    apart for the float32 adapters' gradients).

    Args:
        x: (..., K); packed, fmt: as :func:`dequant_linear_reference`'s; lora_a: (r, K); lora_b: (N, r);
        scaling: PEFT's ``lora_alpha / r`` (or rsLoRA's).
    """
    device = x.device.type
    autocast = torch.is_autocast_enabled(device)
    c = _compute_dtype(x, x.dtype)
    split = not autocast and x.dtype == torch.bfloat16 and lora_a.dtype == torch.float32
    if not autocast and not split and lora_a.dtype != c:
        raise TypeError(f"lora_dequant_linear: outside autocast x and the adapters must share a dtype (or be bfloat16 "
                        f"x with float32 adapters), got {c} and {lora_a.dtype}")
    with torch.autocast(device, enabled=False):
        xc = x.to(c)
        base = dequant_linear_reference(xc, packed, fmt)
        if split:
            t = F.linear(F.linear(xc.float(), lora_a), lora_b) * scaling
        else:
            ya = F.linear(xc, lora_a.to(c))
            t = F.linear(ya.float(), lora_b.to(c).float()) * scaling
        return (base.float() + t).to(c)


# --------------------------------------------------------------------------------------------
# split_bf16
# --------------------------------------------------------------------------------------------

def split_bf16_reference(t: torch.Tensor, pattern: list[int], dim: int) -> torch.Tensor:
    """Pure-PyTorch :func:`split_bf16`, the op's bits: ``p0 = bf16(t)``, ``p1 = bf16(t - p0)``, ``p2 = bf16(t - p0 -
    p1)`` (each difference exact in float32, each cast round to nearest even), and the parts named by ``pattern``
    concatenated along ``dim`` (row blocks for 0, column blocks for 1). ``p0 + p1 + p2 == t`` exactly for ``t`` in
    bfloat16's normal range: 3 x 8 significant bits cover float32's 24.

    Args:
        t: (R, C) float32; pattern: part indices, each 0, 1 or 2; dim: 0 or 1.
    """
    p0 = t.to(torch.bfloat16)
    rest = t - p0.float()
    p1 = rest.to(torch.bfloat16)
    p2 = (rest - p1.float()).to(torch.bfloat16)
    parts = (p0, p1, p2)
    return torch.cat([parts[i] for i in pattern], dim=dim)


# --------------------------------------------------------------------------------------------
# rms_norm, and the kernels under its node: rms_norm_fwd, rms_norm_bwd
# --------------------------------------------------------------------------------------------

def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Pure-PyTorch :func:`rms_norm`, transformers' LlamaRMSNorm op for op (differentiable in ``x`` and ``weight``):
    ``weight * (float(x) * rsqrt(mean(float(x)^2, -1) + eps)).to(x.dtype)``.

    The op keeps these rounding points but reduces the row's sum of squares (and, backward, the row's ``sum(g x)``) in
    another order, and takes ``1 / sqrt`` for ``rsqrt``: float32 differences of a few ulps in ``rstd``, which can move
    a rounding to x's dtype by one ulp.

    Args:
        x: (..., K) float32 / bfloat16 / float16; weight: (K,) of x's dtype; eps: the module's ``variance_epsilon``.
    """
    h = x.float()
    variance = h.pow(2).mean(-1, keepdim=True)
    return weight * (h * torch.rsqrt(variance + eps)).to(x.dtype)


def rms_norm_fwd_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch ``torch.ops.trainstream.rms_norm_fwd`` (the forward kernel under :func:`rms_norm`'s node).

    Args:
        x: (T, K); weight: (K,) of x's dtype; eps: as :func:`rms_norm_reference`'s.

    Returns:
        ``(y, rstd)``: ``y`` as :func:`rms_norm_reference`'s; ``rstd = rsqrt(mean(float(x)^2, -1) + eps)``, float32
        (T,), saved for the backward.
    """
    h = x.float()
    rstd = torch.rsqrt(h.pow(2).mean(-1) + eps)
    return weight * (h * rstd[:, None]).to(x.dtype), rstd


def rms_norm_bwd_reference(gy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
                           ) -> torch.Tensor:
    """Pure-PyTorch ``torch.ops.trainstream.rms_norm_bwd``: the input gradient of :func:`rms_norm_reference`.

    ``g = gy * weight`` rounded to x's dtype (the product autograd forms), then in float32 per row ``dx = rstd g -
    x rstd^3 sum(g x) / K``, rounded once to x's dtype. The module's graph rounds the same terms (it reaches the same
    float32 value through its own ops, within float32 rounding).

    Args:
        gy: (T, K) of x's dtype; x: (T, K); weight: (K,); rstd: float32 (T,) from :func:`rms_norm_fwd_reference`.
    """
    g = (gy * weight).float()
    xf = x.float()
    r = rstd.reshape(-1, 1)
    c = r * r * r * (g * xf).sum(-1, keepdim=True) / x.shape[-1]
    return (r * g - xf * c).to(x.dtype)
