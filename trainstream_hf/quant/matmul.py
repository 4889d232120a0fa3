"""How ``y = x W^T`` and ``dx = dy W`` are computed for a quantized weight: the matmul paths, and
:func:`select_path`, the one place a (format, device, act_quant) picks its path.

``x`` is 2-D here, ``(T, K)`` (tokens x in_features); ``W`` a :class:`~trainstream_hf.quant.formats.QuantizedTensor`
``(N, K)``; ``s_w`` its per-output-channel scale (fp8). Every path is free of host synchronisation (no ``.item()``, no
data-dependent shapes, no pageable host-to-device copies after the first call).

Paths:

* ``dequant`` (int8, nf4; fp8 / nvfp4 with ``act_quant=False``): weight-only. ``y = F.linear(x, dequantize(W,
  x.dtype))``: exactly ``nn.Linear`` over the dequantized weight rounded once to the activation dtype (float32,
  bfloat16 or float16), so the matmul accumulates as torch's does for that dtype. ``dequantize`` is one fused native
  kernel per format on the CPU and on CUDA. Backward ``dx = dy @ dequantize(W, dy.dtype)``.
* ``fp8_w8a8_scaled_mm`` (fp8, ``act_quant=True``, CUDA sm_89+): FP8 tensor cores through ``torch._scaled_mm`` with
  row-wise scales, forward and backward.

  - Forward: ``(x_q, s_x) = quantize_rows_e4m3(x)``: per token ``s_x = max|x_row| / 448``, ``x_q = e4m3(x / s_x)``
    (nearest even, saturating; 0 for an all-zero row); then ``y = torch._scaled_mm(x_q, W_q^T, scale_a=s_x (T, 1),
    scale_b=s_w (1, N), out_dtype=x.dtype)``, i.e. ``y[t, n] = dtype(s_x[t] * s_w[n] * sum_k x_q[t, k] W_q[n, k])``:
    exact E4M3 products accumulated in float32 (``use_fast_accum=False``, torch's default: the kernels promote the
    tensor cores' partial sums to float32 accumulators rather than keep Hopper's reduced-precision FP8 accumulation),
    scales applied in the epilogue, one rounding to the activation dtype. Same maths as ``fp8_w8a8_emulated`` below up
    to summation order and the point where the scales are applied (tests/gpu/test_quant_fp8_cuda.py holds them
    together). Layers that read the same ``x`` (q / k / v, gate / up) share one ``(x_q, s_x)``
    (:func:`quantize_activation`; same bits as quantizing again).
  - Backward, ``dx[t, k] = sum_n dy[t, n] s_w[n] W_q[n, k]``: the weight scale lies along the reduced dimension, so it
    is folded into the gradient before quantizing it: ``(g_q, s_g) = quantize_rows_e4m3(dy, col_scale=s_w)``, i.e.
    per token ``g = dy * s_w`` (float32), ``s_g = max|g_row| / 448``, ``g_q = e4m3(g / s_g)``; then ``dx =
    torch._scaled_mm(g_q, W_q, scale_a=s_g (T, 1), scale_b=ones (1, K), out_dtype=dy.dtype)``. So ``dx`` is the
    straight-through gradient ``dy W_hat`` with ``dy`` rounded to E4M3 per token (relative error per element up to
    2^-4, about 2.5% in norm for Gaussian gradients, measured; a bf16 ``dx`` is within 2^-9).
  - Layout: ``_scaled_mm`` wants its second operand column-major. ``W_q^T`` of the row-major (N, K) codes is that, for
    free. For the backward the (N, K) operand must be column-major (Hopper's FP8 GEMMs take both operands K-major),
    which is the memory of a row-major (K, N) tensor: a transposed copy of ``W_q`` (N*K bytes read and written by
    one bandwidth-bound transpose: 7 calls, 0.169 ms of kernel time in a 2.08 ms Llama-3-8B block step of 2048
    tokens, H100, profiled at 78943ec). :class:`~trainstream_hf.quant.linear.QuantLinear` keeps that copy per layer,
    built at the first call that needs a backward and rebuilt when the weight's storage or version changes, as
    TransformerEngine keeps a transposed FP8 weight on Hopper; it costs 1 byte per weight element on the device for
    as long as the layer lives (``fp8_transpose_cache=False`` turns it off, and paged weights never get one: their
    storage is a transient slot). Without the copy the backward transposes per call and frees the copy right after.
    Same bytes either way, so the same bits.
  - Falls back, per call and with the same maths (``fp8_w8a8_emulated`` forward; ``dequant`` backward), where
    ``_scaled_mm`` cannot run or would not pay: float32 activations / gradients (float32 output of the row-wise
    kernels depends on the torch / cuBLAS version, and a float32 model wants float32 numerics), or ``K`` or ``N`` not a
    multiple of 16 (``_scaled_mm``'s shape rule). ``T`` may be anything. Operands at an address that is not 16-byte
    aligned (a strided or offset view) are copied first.
* ``fp8_w8a8_emulated`` (fp8, ``act_quant=True``, CPU and GPUs without FP8 tensor cores): what the path above
  computes, in PyTorch: ``y = (x_q @ W_q^T) * s_x * s_w`` with the E4M3 values decoded to float32 (products exact: 4 x
  4 significant bits), accumulated in float32, then rounded once to the activation dtype. Backward: ``dequant``'s.
* ``nvfp4_w4a4_emulated`` (nvfp4, ``act_quant=True``): what the FP4 tensor-core GEMM (sm_100+) computes. Activations
  are quantized to NVFP4 on the fly with exactly the maths of
  :func:`~trainstream_hf.ops.quantize_nvfp4_reference` (per-tensor scale ``ts_x = max|x| / (448 * 6)``, an E4M3
  scale per 16 consecutive features, E2M1 codes); ``y = ((e2m1_x * s_x) @ (e2m1_w * s_w)^T) * (ts_x * ts_w)``: each
  operand is its codes times its block scales (exact in float32), accumulated in float32, the two tensor scales
  applied to the output, rounded once to the activation dtype. Backward: ``dequant``'s. It runs float32 matmuls, so
  on a GPU it is a numerics reference, not a fast path: there the default is ``act_quant=False`` (see
  :func:`default_act_quant`), and an explicit ``act_quant=True`` warns once. No FP4 tensor-core path is implemented
  yet (sm_100+ GPUs get the emulation too, with the same warning).

For the activation-quantized paths the backward is the straight-through estimator: the rounding of ``x`` is treated
as the identity, so ``dx`` is the gradient of ``x W_hat^T``. The weight is dequantized (or read as FP8 codes) again in
backward, never saved in 16 bits. No weight gradient.
"""
from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from trainstream_hf import ops
from trainstream_hf.quant.formats import QuantFormat, QuantizedTensor, dequantize

__all__ = ["MatmulPath", "select_path", "default_act_quant", "ACT_QUANT_FORMATS", "TENSOR_CORE_CAPABILITY",
           "quantize_rows_e4m3", "quantize_activation", "forget_activation", "quantize_nvfp4_activations",
           "e2m1_decode", "takes_transposed_weight"]


@dataclass(frozen=True)
class MatmulPath:
    """One way of computing a quantized linear layer's forward and input gradient."""

    name: str
    quantizes_activations: bool  # outlier protection applies only where this is True
    # (x (T, K), q, src=None) -> (T, N), float32 or x.dtype. src: the caller's tensor that x is a 2-D view of
    # (x = src.reshape(-1, K)), passed where the path may reuse src's quantization (quantize_activation); None: x
    # is a temporary (the outlier path's x with its outlier channels zeroed) and is quantized afresh.
    forward: Callable[..., torch.Tensor]
    # (dy (T, N), q) -> dx (T, K) in dy.dtype; the FP8 one also takes (dy, q, w_t) (takes_transposed_weight)
    backward: Callable[..., torch.Tensor]
    # Optional: (x (..., K), q) -> y (..., N) in x.dtype with its own autograd node (forward and backward as above,
    # the node in C++), or None where it cannot take this call; QuantLinear uses it when no outliers are split off,
    # or when layer_outliers says it splits them itself.
    layer: Callable[..., torch.Tensor | None] | None = None
    # layer is (x, q, w_t, outliers) (the FP8 one): the codes transposed, kept by the caller, or None
    # (takes_transposed_weight), and the outlier channel count, split off inside
    layer_outliers: bool = False


def _safe_div(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x / d where d != 0, else 0 (broadcasting); no host sync."""
    nz = d != 0
    return torch.where(nz, x / torch.where(nz, d, torch.ones_like(d)), torch.zeros_like(x))


# --------------------------------------------------------------------------------------------------------------
# Activation quantizers (sync-free; used by the emulated paths, and the maths the GPU paths must reproduce)
# --------------------------------------------------------------------------------------------------------------

def quantize_rows_e4m3(x: torch.Tensor, col_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row FP8 E4M3: ``s = max|v_row| / 448``, ``q = e4m3(v / s)`` with ``v = x * col_scale`` (or ``x``)
    (nearest even, saturating; 0 where s == 0).

    The fused native kernel (:func:`trainstream_hf.ops.quantize_rows_e4m3`) where this build has one for the device,
    else :func:`trainstream_hf.ops.quantize_rows_e4m3_reference`; same bits.

    Args:
        x: (T, K) float32 / bfloat16 / float16.
        col_scale: optional float32 (K,) per-feature factor applied first.

    Returns:
        ``(q, s)``: float8_e4m3fn (T, K); float32 (T, 1), the layout ``torch._scaled_mm``'s ``scale_a`` takes.
    """
    if ops.has_kernel("quantize_rows_e4m3", x.device):
        return ops.quantize_rows_e4m3(x, col_scale)
    return ops.quantize_rows_e4m3_reference(x, col_scale)


# --------------------------------------------------------------------------------------------------------------
# Reuse of one quantized activation by the layers that read the same tensor
# --------------------------------------------------------------------------------------------------------------
#
# Llama's q / k / v projections read one hidden state, gate / up another: quantizing it once instead of three (two)
# times saves 3 of the 7 per-token quantizations of a block's forward. The last quantization is kept, keyed by the
# identity of the caller's tensor and everything that would change its contents or layout:
#
# * a weak reference to the tensor object (not its address: a freed tensor's memory is reused by the next
#   allocation of the same size, so an address alone would hit on different data); a freed tensor never hits (its
#   entry is replaced at the next call, or dropped at the first backward: no weakref callback, which would run Python
#   code wherever the tensor is freed and could swallow a Ctrl-C);
# * ``_version``, which every in-place write through the tensor or any view or ``detach()`` of it bumps (autograd's
#   own check for saved tensors), and ``data_ptr``, shape, stride, dtype and device (``x.data = y`` swaps the
#   storage without a version bump);
# * on CUDA, the current stream: a consumer on another stream would not be ordered after the quantizing kernel.
#
# Writes that bypass the version counter are not seen, as autograd does not see them either: through ``x.data``
# (its own counter), from outside torch (a NumPy view, a raw pointer), or a CUDA graph replay rewriting its static
# outputs. To narrow that window, the Python backward of a QuantLinear (the outlier route) ends the reuse. Nothing is
# kept or reused while a CUDA graph is being captured (an entry made outside the graph would be read by it but owned
# by this cache). Inference-mode tensors (no version counter), tensor subclasses and ``torch.compile`` tracing are
# quantized afresh every time. The cost: one quantized activation (T x K bytes + T floats) stays alive until another
# one replaces it or a backward (or forget_activation) drops it.
#
# The reused result is the same bits as a fresh one (the quantizer is deterministic), so reuse changes no numerics.
#
# This serves the Python paths (the emulated W8A8 forward, the tensor-core forward of the Python Function). The
# tensor-core layer, ops.fp8_linear, keeps its own under the same rules in C++ (csrc/autograd/fp8_linear.cpp), with no
# Python per call; there the kept copy also goes at the first backward through an FP8 layer.

_LAST: tuple | None = None  # (weakref to the source tensor, key, (x_q, s_x))


# The current CUDA stream's handle as an int, without building a torch.cuda.Stream object per call (the private
# function is the one torch's inductor-generated code calls); torch.cuda.current_stream where it is missing.
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream_id(device: torch.device) -> int:
    if _RAW_STREAM is not None:
        return _RAW_STREAM(device.index)
    return torch.cuda.current_stream(device).cuda_stream


def forget_activation() -> None:
    """Drops the kept activation quantizations, this module's and the tensor-core layer's (the next
    :func:`quantize_activation` / :func:`trainstream_hf.ops.fp8_linear` quantizes afresh)."""
    if torch.compiler.is_compiling():
        return  # nothing is kept under compile (_reuse_key); the compiled graph calls fp8_linear with reuse off
    global _LAST
    _LAST = None
    ops.fp8_forget_activation()


def _reuse_key(src: torch.Tensor) -> tuple | None:
    """The key :func:`quantize_activation` keeps src's quantization under, or None where it must not be kept."""
    if torch.compiler.is_compiling() or type(src) is not torch.Tensor or src.is_inference():
        return None
    device = src.device
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return None
        return src._version, src.data_ptr(), src.shape, src.stride(), src.dtype, device, _stream_id(device)
    return src._version, src.data_ptr(), src.shape, src.stride(), src.dtype, device


def quantize_activation(x: torch.Tensor, src: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows_e4m3` of ``x``, reused from the previous call when that one quantized the same,
    unmodified ``src`` (see the comment above this function).

    Args:
        x: (T, K) activations: ``src.reshape(-1, K)``.
        src: the caller's tensor (the one object that every layer reading this activation receives); None:
            quantize ``x`` without keeping or reusing anything.

    Returns:
        ``(x_q, s_x)`` as :func:`quantize_rows_e4m3`; the tensors may be shared with other callers: read-only.
    """
    global _LAST
    key = None if src is None else _reuse_key(src)
    if key is None:
        return quantize_rows_e4m3(x)
    last = _LAST
    if last is not None and last[0]() is src and last[1] == key:
        return last[2]
    out = quantize_rows_e4m3(x)
    # No weakref callback to drop it when src dies: Python code run wherever a tensor is freed can swallow a Ctrl-C.
    # It goes at the next call, the first backward through a layer, or forget_activation().
    _LAST = (weakref.ref(src), key, out)
    return out


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
    ts = ops.div_scalar(bmax.amax(), ops.E4M3_MAX * ops.E2M1_MAX)
    s = _safe_div(ops.div_scalar(bmax, ops.E2M1_MAX), ts).to(torch.float8_e4m3fn).float()
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

def _dequant_forward(x: torch.Tensor, q: QuantizedTensor, src: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, dequantize(q, x.dtype))


def _dequant_backward(dy: torch.Tensor, q: QuantizedTensor) -> torch.Tensor:
    return dy.mm(dequantize(q, dy.dtype))


def _dequant_layer(x: torch.Tensor, q: QuantizedTensor) -> torch.Tensor | None:
    """The whole layer through :func:`trainstream_hf.ops.dequant_linear` (its autograd node in C++), or None where
    this build has no native dequantize kernel for the device. Same bits as the forward / backward above."""
    fmt = q.fmt
    if fmt.native[1] is None or not ops.has_kernel(fmt.native[1], x.device):
        return None
    return ops.dequant_linear(x, [q.tensors[name] for name in fmt.tensor_names], fmt.name)


def _fp8_w8a8_forward(x: torch.Tensor, q: QuantizedTensor, src: torch.Tensor | None = None) -> torch.Tensor:
    xq, sx = quantize_activation(x, src)
    acc = xq.float().mm(q.tensors["data"].float().t())
    return acc * sx * q.tensors["scale"]


def _nvfp4_w4a4_forward(x: torch.Tensor, q: QuantizedTensor, src: torch.Tensor | None = None) -> torch.Tensor:
    xv, ts = quantize_nvfp4_activations(x)
    return xv.mm(_nvfp4_weight_operand(q).t()) * (ts * q.tensors["tensor_scale"])


# Output dtypes given to the row-wise torch._scaled_mm. bf16 is what every torch >= 2.11 takes on sm_89+ (CUTLASS or
# cuBLAS kernels); fp16 is taken by torch 2.14's CUTLASS and by cuBLAS 12.9+ on sm_90 (tests/gpu checks it on the
# reference GPU); float32 output is cuBLAS-only, so float32 activations take the emulated path.
_SCALED_MM_DTYPES = (torch.bfloat16, torch.float16)


def _scaled_mm_ok(dtype: torch.dtype, q: QuantizedTensor) -> bool:
    """Whether torch._scaled_mm can run this fp8 weight for activations / gradients of ``dtype``: 16-bit outputs,
    and both weight dimensions multiples of 16 (its rule for the second operand and the first's inner dimension)."""
    n, k = q.shape
    return dtype in _SCALED_MM_DTYPES and n % 16 == 0 and k % 16 == 0


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous tensor at a 16-byte aligned address (cuBLAS' operand rule): itself, or a copy for a
    strided or offset view (a host-side pointer check, no sync)."""
    return t if t.is_contiguous() and t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)


def _fp8_scaled_mm_forward(x: torch.Tensor, q: QuantizedTensor, src: torch.Tensor | None = None) -> torch.Tensor:
    if not _scaled_mm_ok(x.dtype, q):
        return _fp8_w8a8_forward(x, q, src)
    xq, sx = quantize_activation(x, src)
    t = q.tensors
    w = _aligned(t["data"])  # (N, K) row-major: its .t() is the column-major (K, N) operand
    sw = _aligned(t["scale"]).view(1, -1)
    return torch._scaled_mm(xq, w.t(), scale_a=sx, scale_b=sw, out_dtype=x.dtype)


def _fp8_scaled_mm_backward(dy: torch.Tensor, q: QuantizedTensor, w_t: torch.Tensor | None = None) -> torch.Tensor:
    if not _scaled_mm_ok(dy.dtype, q):
        return _dequant_backward(dy, q)
    # dy * s_w per token to E4M3; the (N, K) operand column-major = a row-major (K, N) copy, viewed back (a tiled
    # byte transpose: torch's strided copy moves bytes at a fraction of memory bandwidth), or w_t, that copy kept by
    # the caller; one native call.
    return ops.fp8_linear_dgrad(dy, q.tensors["data"], q.tensors["scale"], w_t)


def _fp8_scaled_mm_layer(x: torch.Tensor, q: QuantizedTensor, w_t: torch.Tensor | None = None, outliers: int = 0
                         ) -> torch.Tensor | None:
    """The whole layer through :func:`trainstream_hf.ops.fp8_linear` (x quantized per row inside, or the kept
    quantization of this very x reused; its autograd node in C++: the backward runs no Python), or None where
    ``_scaled_mm`` cannot run this call (the caller falls back to the path's forward / backward). Same maths as
    :func:`_fp8_scaled_mm_forward` / :func:`_fp8_scaled_mm_backward` (the same bits where both take the same GEMM).
    ``w_t``: the codes transposed, (K, N), kept by the caller (:func:`takes_transposed_weight`); the backward then
    does not transpose them. ``outliers``: that many input channels split off in the op
    (:func:`trainstream_hf.quant.outliers.outlier_matmul`'s decomposition, the outlier product in x's dtype on the
    tensor cores where outlier_matmul takes float32: within bf16 rounding of it, not its bits)."""
    if not _scaled_mm_ok(x.dtype, q):
        return None
    t = q.tensors
    # The op keeps nothing under torch.compile itself (ops.fp8_linear): the layers' shared input is one graph value
    # there anyway.
    return ops.fp8_linear(x, t["data"], t["scale"], True, w_t, outliers)


def takes_transposed_weight(path: MatmulPath, dtype: torch.dtype, q: QuantizedTensor) -> bool:
    """Whether ``path.layer`` and ``path.backward`` run the FP8 tensor-core backward for inputs of ``dtype`` and so
    can take a kept transposed copy of ``q``'s codes as ``w_t`` (``fp8_w8a8_scaled_mm`` where ``_scaled_mm`` runs
    the call)."""
    return path is FP8_W8A8_SCALED_MM and _scaled_mm_ok(dtype, q)


DEQUANT = MatmulPath("dequant", False, _dequant_forward, _dequant_backward, _dequant_layer)
FP8_W8A8_EMULATED = MatmulPath("fp8_w8a8_emulated", True, _fp8_w8a8_forward, _dequant_backward)
FP8_W8A8_SCALED_MM = MatmulPath("fp8_w8a8_scaled_mm", True, _fp8_scaled_mm_forward, _fp8_scaled_mm_backward,
                                _fp8_scaled_mm_layer, layer_outliers=True)
NVFP4_W4A4_EMULATED = MatmulPath("nvfp4_w4a4_emulated", True, _nvfp4_w4a4_forward, _dequant_backward)

# Formats whose weight has an activation-quantized path (W8A8 / W4A4), and its portable (emulated) form. int8 and nf4
# are weight-only.
ACT_QUANT_FORMATS = {"fp8": FP8_W8A8_EMULATED, "nvfp4": NVFP4_W4A4_EMULATED}

# The CUDA capability whose tensor cores run a format's activation-quantized matmul natively: FP8 from Ada / Hopper
# (sm_89), FP4 from Blackwell (sm_100).
TENSOR_CORE_CAPABILITY = {"fp8": (8, 9), "nvfp4": (10, 0)}

# act_quant paths implemented on tensor cores, by format (the FP4 one is not written yet: no sm_100 GPU to test it).
_TENSOR_CORE_PATHS = {"fp8": FP8_W8A8_SCALED_MM}

_WARNED: set[tuple[str, tuple[int, int]]] = set()
_CAPABILITY: dict[int, tuple[int, int]] = {}  # device index -> capability (default_act_quant asks per call)


def _capability(device: torch.device) -> tuple[int, int]:
    if device.index is None:  # "the current device", which may change: not cached
        return tuple(torch.cuda.get_device_capability(device))
    cap = _CAPABILITY.get(device.index)
    if cap is None:
        cap = _CAPABILITY[device.index] = tuple(torch.cuda.get_device_capability(device))
    return cap


def default_act_quant(fmt: QuantFormat, device: torch.device | str | None = None) -> bool:
    """Whether ``fmt`` quantizes activations by default on ``device``.

    int8 and nf4: never (weight-only). fp8 and nvfp4: on the CPU (and ``device=None``), yes: the emulated W8A8 / W4A4
    paths define the numerics the tensor-core paths have. On a CUDA device, only where a tensor-core path for the
    format is implemented and the device has the tensor cores (fp8: sm_89+); elsewhere (nvfp4 on any GPU today, fp8
    before sm_89) the emulation would run float32 matmuls, much slower than the weight-only path, so the default is
    ``act_quant=False`` there.
    """
    if fmt.name not in ACT_QUANT_FORMATS:
        return False
    if device is None or torch.device(device).type != "cuda":
        return True
    return fmt.name in _TENSOR_CORE_PATHS and _capability(torch.device(device)) >= TENSOR_CORE_CAPABILITY[fmt.name]


def _warn_emulated(fmt: QuantFormat, cap: tuple[int, int]) -> None:
    key = (fmt.name, cap)
    if key in _WARNED:
        return
    _WARNED.add(key)
    need = TENSOR_CORE_CAPABILITY[fmt.name]
    if cap < need:
        why = (f"{'FP4' if fmt.name == 'nvfp4' else 'FP8'} tensor cores need sm_{need[0]}{need[1]}+ and this GPU is "
               f"sm_{cap[0]}{cap[1]}")
    else:
        why = f"the {fmt.name} tensor-core path is not implemented yet"
    warnings.warn(f"act_quant=True for {fmt.name} on CUDA: {why}, so activations are quantized by the emulated path "
                  f"(float32 matmuls, slow). act_quant=False (the default on this GPU) dequantizes the weight into a "
                  f"16-bit GEMM instead.", RuntimeWarning, stacklevel=3)


def select_path(fmt: QuantFormat, device: torch.device, act_quant: bool | None = None) -> MatmulPath:
    """The matmul path for a ``fmt`` weight on ``device``; fastest correct first.

    * ``act_quant`` False (always for int8 / nf4; by default for nvfp4 on GPUs and fp8 before sm_89): ``dequant``.
    * fp8 with ``act_quant``: ``fp8_w8a8_scaled_mm`` on CUDA sm_89+; ``fp8_w8a8_emulated`` on the CPU, and on older
      GPUs with a one-time warning.
    * nvfp4 with ``act_quant``: ``nvfp4_w4a4_emulated``; on CUDA with a one-time warning (FP4 tensor cores need
      sm_100+, and no path for them is implemented yet).

    Args:
        fmt: the weight's format.
        device: where the weight and the activations are.
        act_quant: quantize activations on the fly (fp8: W8A8, nvfp4: W4A4) rather than dequantizing the weight;
            None: :func:`default_act_quant` for ``device``.

    Returns:
        The :class:`MatmulPath`.

    Raises:
        ValueError: ``act_quant`` for a weight-only format (int8, nf4).
    """
    device = torch.device(device)
    if act_quant is None:
        act_quant = default_act_quant(fmt, device)
    if act_quant and fmt.name not in ACT_QUANT_FORMATS:
        raise ValueError(f"act_quant=True needs a format with an activation-quantized path "
                         f"({', '.join(ACT_QUANT_FORMATS)}); {fmt.name} is weight-only")
    if not act_quant:
        return DEQUANT
    if device.type == "cuda":
        cap = _capability(device)
        fast = _TENSOR_CORE_PATHS.get(fmt.name)
        if fast is not None and cap >= TENSOR_CORE_CAPABILITY[fmt.name]:
            return fast
        _warn_emulated(fmt, cap)
    return ACT_QUANT_FORMATS[fmt.name]
