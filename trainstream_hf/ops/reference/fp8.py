"""References of the FP8 matmul path's ops (trainstream_hf/quant/matmul.py): the per-row activation quantizer and the
byte transpose (the native kernels equal them bit for bit), and the row-wise scaled GEMM, the FP8 layer and its input
gradient, whose kernels (torch._scaled_mm, cuBLASLt) accumulate the same exact E4M3 products in float32 in another
order: they agree with these references to one rounding of the output dtype."""
from __future__ import annotations

import torch

from trainstream_hf.ops._common import E4M3_MAX, _safe_div, div_scalar


# --------------------------------------------------------------------------------------------
# quantize_rows_e4m3, transpose_bytes (bit for bit)
# --------------------------------------------------------------------------------------------

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


def transpose_bytes_reference(x: torch.Tensor) -> torch.Tensor:
    """Pure-PyTorch :func:`transpose_bytes` (through uint8: a float8 strided copy is not supported everywhere)."""
    return x.view(torch.uint8).t().contiguous().view(x.dtype)


# --------------------------------------------------------------------------------------------
# fp8_gemm_rowwise, fp8_linear_dgrad, fp8_linear
# --------------------------------------------------------------------------------------------

def fp8_gemm_rowwise_reference(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Pure-PyTorch :func:`fp8_gemm_rowwise` (and ``torch._scaled_mm`` with row-wise scales).

    ``out[m, n] = out_dtype(scale_a[m] * scale_b[n] * sum_k a[m, k] b[n, k])``: the E4M3 values decoded to float32
    (each product exact: 4 x 4 significant bits), accumulated in float32, the scales applied to the sum, one rounding
    to ``out_dtype``. The kernels sum in another order and may apply the scales in another order, so they agree with
    this to float32 rounding before the final one (in practice: equal, or one ulp of ``out_dtype`` apart).

    Args:
        a: (M, K) float8_e4m3fn; b: (N, K) float8_e4m3fn.
        scale_a: float32, M values; scale_b: float32, N values (any shape holding them, e.g. (M, 1) / (1, N)).
        out_dtype: the result's dtype.
    """
    acc = a.float() @ b.float().t()
    return (acc * scale_a.reshape(-1, 1) * scale_b.reshape(1, -1)).to(out_dtype)


def fp8_linear_dgrad_reference(dy: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                               w_t: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-PyTorch :func:`fp8_linear_dgrad`: the straight-through input gradient of the FP8 layer.

    ``dx = dy W_hat`` with ``W_hat[n, k] = s_w[n] W_q[n, k]``; the weight scale lies along the reduced dimension, so it
    is folded into the gradient before that is quantized: ``(g_q, s_g) = quantize_rows_e4m3_reference(dy, s_w)``
    (``g = dy * s_w`` in float32, E4M3 per row), then ``dx = fp8_gemm_rowwise_reference(g_q, W_q^T, s_g, ones)`` in
    dy's dtype. ``w_t`` (``W_q^T``, (K, N)) is taken where given, else made: the same bytes either way.

    Args:
        dy: (T, N) bfloat16 / float16 (float32 runs too); w: (N, K) float8_e4m3fn; w_scale: float32 (N,).
        w_t: optional (K, N) float8_e4m3fn, ``w`` transposed.
    """
    gq, sg = quantize_rows_e4m3_reference(dy, w_scale.reshape(-1))
    wt = transpose_bytes_reference(w) if w_t is None else w_t
    ones = torch.ones(wt.shape[0], dtype=torch.float32, device=dy.device)
    return fp8_gemm_rowwise_reference(gq, wt, sg, ones, dy.dtype)


def _fp8_linear_forward(x2d: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, outliers: int) -> torch.Tensor:
    """The FP8 layer's forward on (T, K): see :func:`fp8_linear_reference`."""
    if outliers == 0 or x2d.shape[0] == 0:
        xq, sx = quantize_rows_e4m3_reference(x2d)
        return fp8_gemm_rowwise_reference(xq, w, sx, w_scale, x2d.dtype)
    # the channels of largest max |x| over the tokens, as the op picks them (torch.topk, on the device)
    idx = torch.topk(torch.linalg.vector_norm(x2d, float("inf"), dim=0), outliers, sorted=False).indices
    keep = torch.ones(x2d.shape[1], dtype=torch.float32, device=x2d.device).index_fill_(0, idx, 0.0)
    xq, sx = quantize_rows_e4m3_reference(x2d, keep)
    y = fp8_gemm_rowwise_reference(xq, w, sx, w_scale, x2d.dtype)
    cols = (w[:, idx].float() * w_scale.reshape(-1, 1)).to(x2d.dtype)  # W_hat's outlier columns in x's dtype
    return (y.float() + x2d[:, idx].float() @ cols.float().t()).to(x2d.dtype)


class _Fp8LinearReference(torch.autograd.Function):
    """The straight-through estimator: forward quantizes x, backward is :func:`fp8_linear_dgrad_reference` of dy (the
    gradient of ``x W_hat^T`` with dy quantized per row), as the op's C++ node computes it."""

    @staticmethod
    def forward(ctx, x, w, w_scale, w_t, outliers):
        ctx.save_for_backward(w, w_scale)
        ctx.w_t = w_t
        y = _fp8_linear_forward(x.reshape(-1, w.shape[1]), w, w_scale, outliers)
        return y.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        w, w_scale = ctx.saved_tensors
        dx = fp8_linear_dgrad_reference(dy.reshape(-1, w.shape[0]), w, w_scale, ctx.w_t)
        return dx.view(*dy.shape[:-1], w.shape[1]), None, None, None, None


def fp8_linear_reference(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, reuse: bool = True,
                         w_t: torch.Tensor | None = None, outliers: int = 0) -> torch.Tensor:
    """Pure-PyTorch :func:`fp8_linear`, differentiable in ``x`` with the op's straight-through backward.

    Forward, on ``x2d = x.reshape(-1, K)``: ``(x_q, s_x) = quantize_rows_e4m3_reference(x2d)``, then ``y =
    fp8_gemm_rowwise_reference(x_q, W_q, s_x, s_w, x.dtype)``, i.e. ``y[t, n] = dtype(s_x[t] s_w[n] sum_k x_q[t, k]
    W_q[n, k])``. With ``outliers = k > 0``: the ``k`` channels ``I`` of largest ``max_t |x[t, i]|`` are zeroed in
    the quantized operand (a column scale of 0) and ``y = dtype(y_fp8 + x[:, I] W_hat[:, I]^T)`` with ``W_hat[:, I]``
    rounded to x's dtype and the product in float32. Backward: ``dx = fp8_linear_dgrad_reference(dy, w, w_scale)``
    (with or without outliers, as the op's). ``reuse`` changes no bits (a reused quantization equals a fresh one), so
    it is ignored here; ``w_t`` only feeds the backward (same bytes as transposing ``w``).

    The op's outlier product is added by an ``addmm_`` in x's dtype, which on CUDA rounds it to that dtype before the
    sum (csrc/autograd/fp8_linear.cpp): one more rounding than this reference there.

    Args:
        x: (..., K) bfloat16 / float16; w: (N, K) float8_e4m3fn; w_scale: float32 (N,).
        reuse, w_t, outliers: as :func:`fp8_linear`'s.
    """
    return _Fp8LinearReference.apply(x, w, w_scale, w_t, int(outliers))
