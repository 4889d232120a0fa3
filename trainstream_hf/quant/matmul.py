"""How ``y = x W^T`` and ``dx = dy W`` are computed for a quantized weight: the matmul paths, and
:func:`select_path`, the one place a (format, device, act_quant) picks its path.

``x`` is 2-D here, ``(T, K)`` (tokens x in_features); ``W`` a :class:`~trainstream_hf.quant.formats.QuantizedTensor`
``(N, K)``. Every path is pure PyTorch, correct on any device, and free of host synchronisation (no ``.item()``, no
data-dependent shapes, no pageable host-to-device copies after the first call), so a CUDA fast path can replace one
per (format, device capability) in :func:`select_path` without any change above it.

Paths on the CPU (and, until the GPU fast paths land, on CUDA):

* ``dequant`` (int8, nf4; fp8 / nvfp4 with ``act_quant=False``): weight-only. ``y = F.linear(x, dequantize(W,
  x.dtype))``: exactly ``nn.Linear`` over the dequantized weight rounded once to the activation dtype (float32,
  bfloat16 or float16), so the matmul accumulates as torch's does for that dtype.
* ``fp8_w8a8_emulated`` (fp8, ``act_quant=True``): what ``torch._scaled_mm`` with row-wise scales computes on sm_89+.
  Activations are quantized per row (token) on the fly: ``s_x = max|x_row| / 448``, ``x_q = e4m3(x / s_x)`` (nearest
  even, saturating; 0 for an all-zero row). ``y = (x_q @ W_q^T) * s_x * s_w`` with the E4M3 values decoded to float32
  (products exact: 4 x 4 significant bits) and accumulated in float32, then rounded once to the activation dtype.
* ``nvfp4_w4a4_emulated`` (nvfp4, ``act_quant=True``): what the FP4 tensor-core GEMM (sm_100+) computes. Activations
  are quantized to NVFP4 on the fly with exactly the maths of
  :func:`~trainstream_hf.ops.quantize_nvfp4_reference` (per-tensor scale ``ts_x = max|x| / (448 * 6)``, an E4M3
  scale per 16 consecutive features, E2M1 codes); ``y = ((e2m1_x * s_x) @ (e2m1_w * s_w)^T) * (ts_x * ts_w)``: each
  operand is its codes times its block scales (exact in float32), accumulated in float32, the two tensor scales
  applied to the output, rounded once to the activation dtype.

Backward, every path: ``dx = dy @ dequantize(W, dy.dtype)``, in the gradient's dtype; the weight is dequantized
again in backward, never saved in 16 bits. For the activation-quantized paths this is the straight-through
estimator: the rounding of ``x`` is treated as the identity, so ``dx`` is the gradient of ``x W_hat^T``. No weight
gradient.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from trainstream_hf import ops
from trainstream_hf.quant.formats import QuantFormat, QuantizedTensor, dequantize

__all__ = ["MatmulPath", "select_path", "default_act_quant", "ACT_QUANT_FORMATS", "quantize_rows_e4m3",
           "quantize_nvfp4_activations", "e2m1_decode"]


@dataclass(frozen=True)
class MatmulPath:
    """One way of computing a quantized linear layer's forward and input gradient."""

    name: str
    quantizes_activations: bool  # outlier protection applies only where this is True
    forward: Callable[[torch.Tensor, QuantizedTensor], torch.Tensor]  # x (T, K) -> (T, N), float32 or x.dtype
    backward: Callable[[torch.Tensor, QuantizedTensor], torch.Tensor]  # dy (T, N) -> dx (T, K) in dy.dtype


def _safe_div(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x / d where d != 0, else 0 (broadcasting); no host sync."""
    nz = d != 0
    return torch.where(nz, x / torch.where(nz, d, torch.ones_like(d)), torch.zeros_like(x))


# --------------------------------------------------------------------------------------------------------------
# Activation quantizers (sync-free; used by the emulated paths, and the maths the GPU paths must reproduce)
# --------------------------------------------------------------------------------------------------------------

def quantize_rows_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row FP8 E4M3: ``s = max|x_row| / 448``, ``q = e4m3(x / s)`` (nearest even, saturating; 0 where s == 0).

    Args:
        x: (T, K) float32 / bfloat16 / float16.

    Returns:
        ``(q, s)``: float8_e4m3fn (T, K); float32 (T, 1), the layout ``torch._scaled_mm``'s ``scale_a`` takes.
    """
    xf = x.float()
    s = xf.abs().amax(dim=1, keepdim=True) / ops.E4M3_MAX
    return _safe_div(xf, s).clamp_(-ops.E4M3_MAX, ops.E4M3_MAX).to(torch.float8_e4m3fn), s


def _e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value to ``v`` (ties to the even code, saturating at +-6, sign kept, -0 included): the
    thresholds of :func:`~trainstream_hf.ops.quantize_nvfp4_reference`, producing values instead of codes."""
    a = v.abs()
    mag = 0.5 * ((a > 0.25).float() + (a >= 0.75).float() + (a > 1.25).float() + (a >= 1.75).float()) \
        + (a > 2.5).float() + (a >= 3.5).float() + 2.0 * (a > 5.0).float()
    return torch.copysign(mag, v)


def quantize_nvfp4_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4-quantizes activations, as :func:`~trainstream_hf.ops.quantize_nvfp4_reference` does a weight, without
    packing and without its finiteness check (a host sync).

    Args:
        x: (T, K) float32 / bfloat16 / float16, K a multiple of 16, T >= 1.

    Returns:
        ``(v, ts)``: float32 (T, K) ``e2m1 * float(block_scale)`` (exact), and the float32 per-tensor scale ``()``;
        the quantized activations are ``v * ts``.
    """
    rows, cols = x.shape
    xb = x.float().view(rows, cols // ops.NVFP4_BLOCK, ops.NVFP4_BLOCK)
    bmax = xb.abs().amax(dim=-1)
    ts = bmax.amax() / (ops.E4M3_MAX * ops.E2M1_MAX)
    s = _safe_div(bmax / ops.E2M1_MAX, ts).to(torch.float8_e4m3fn).float()
    v = _e2m1_round(_safe_div(xb, (ts * s)[..., None]))
    return (v * s[..., None]).view(rows, cols), ts


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 code (low 4 bits, bit 3 the sign) -> float32 value, by arithmetic (no table to copy to the device)."""
    c = codes.to(torch.int32)
    e, m = (c >> 1) & 3, (c & 1).float()
    mag = torch.where(e == 0, 0.5 * m, torch.exp2((e - 1).float()) * (1.0 + 0.5 * m))
    return torch.where((c & 8) != 0, -mag, mag)


def _nvfp4_weight_operand(q: QuantizedTensor) -> torch.Tensor:
    """(N, K) float32 ``e2m1 * float(block_scale)`` of an NVFP4 weight (exact): the operand without its tensor scale."""
    data, block_scale = q.tensors["data"], q.tensors["block_scale"]
    rows, half = data.shape
    codes = torch.stack([data & 0xF, data >> 4], dim=-1).view(rows, -1, ops.NVFP4_BLOCK)
    return (e2m1_decode(codes) * block_scale.float()[..., None]).view(rows, half * 2)


# --------------------------------------------------------------------------------------------------------------
# Paths
# --------------------------------------------------------------------------------------------------------------

def _dequant_forward(x: torch.Tensor, q: QuantizedTensor) -> torch.Tensor:
    return F.linear(x, dequantize(q, x.dtype))


def _dequant_backward(dy: torch.Tensor, q: QuantizedTensor) -> torch.Tensor:
    return dy.mm(dequantize(q, dy.dtype))


def _fp8_w8a8_forward(x: torch.Tensor, q: QuantizedTensor) -> torch.Tensor:
    xq, sx = quantize_rows_e4m3(x)
    acc = xq.float().mm(q.tensors["data"].float().t())
    return acc * sx * q.tensors["scale"]


def _nvfp4_w4a4_forward(x: torch.Tensor, q: QuantizedTensor) -> torch.Tensor:
    xv, ts = quantize_nvfp4_activations(x)
    return xv.mm(_nvfp4_weight_operand(q).t()) * (ts * q.tensors["tensor_scale"])


DEQUANT = MatmulPath("dequant", False, _dequant_forward, _dequant_backward)
FP8_W8A8_EMULATED = MatmulPath("fp8_w8a8_emulated", True, _fp8_w8a8_forward, _dequant_backward)
NVFP4_W4A4_EMULATED = MatmulPath("nvfp4_w4a4_emulated", True, _nvfp4_w4a4_forward, _dequant_backward)

# Formats whose weight has an activation-quantized path (W8A8 / W4A4); act_quant defaults to True for them
# because that is what their tensor-core paths do. int8 and nf4 are weight-only.
ACT_QUANT_FORMATS = {"fp8": FP8_W8A8_EMULATED, "nvfp4": NVFP4_W4A4_EMULATED}


def default_act_quant(fmt: QuantFormat) -> bool:
    return fmt.name in ACT_QUANT_FORMATS


def select_path(fmt: QuantFormat, device: torch.device, act_quant: bool) -> MatmulPath:
    """The matmul path for a ``fmt`` weight on ``device``; fastest correct first.

    Args:
        fmt: the weight's format.
        device: where the weight and the activations are.
        act_quant: quantize activations on the fly (fp8: W8A8, nvfp4: W4A4) rather than dequantizing the weight.

    Returns:
        The :class:`MatmulPath`.

    Raises:
        ValueError: ``act_quant`` for a weight-only format (int8, nf4).
    """
    if act_quant and fmt.name not in ACT_QUANT_FORMATS:
        raise ValueError(f"act_quant=True needs a format with an activation-quantized path "
                         f"({', '.join(ACT_QUANT_FORMATS)}); {fmt.name} is weight-only")
    # GPU fast paths slot in here, each behind the capability it needs, e.g. fp8 + act_quant on sm_89+ ->
    # torch._scaled_mm with row-wise scales; nvfp4 + act_quant on sm_100+ -> FP4 tensor cores; nf4 / int8 ->
    # a fused dequantize kernel feeding the GEMM. Their numerics must match the emulated paths' (tests/gpu).
    if act_quant:
        return ACT_QUANT_FORMATS[fmt.name]
    return DEQUANT
