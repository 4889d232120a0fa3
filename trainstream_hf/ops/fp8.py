"""Wrappers of the FP8 matmul path's ops (trainstream_hf/quant/matmul.py): the per-row activation quantizer, the byte
transpose, the FP8 tensor-core layer and its input gradient (autograd node in C++, csrc/autograd/fp8_linear.cpp), the
cuBLASLt GEMM (csrc/cuda/fp8_gemm.cu) and the run-time settings of that layer (kept activation, GEMM choice)."""
from __future__ import annotations

import torch

from trainstream_hf import _C


# --------------------------------------------------------------------------------------------
# quantize_rows_e4m3 (activations of the FP8 matmul path)
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


# --------------------------------------------------------------------------------------------
# transpose_bytes (the FP8 backward's column-major weight operand)
# --------------------------------------------------------------------------------------------

def transpose_bytes(x: torch.Tensor) -> torch.Tensor:
    """``x.t().contiguous()`` for a 2-D tensor of 1-byte elements (uint8, int8, float8), same dtype.

    On CUDA a tiled shared-memory kernel: torch's generic strided copy reads or writes one side a byte at a time,
    far below memory bandwidth, and the FP8 backward transposes every weight it multiplies.
    """
    return torch.ops.trainstream.transpose_bytes.default(x)


# --------------------------------------------------------------------------------------------
# fp8_linear (the FP8 tensor-core layer with its autograd node in C++) and its GEMMs
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
    tensor is found dead, or at :func:`fp8_forget_activation` (csrc/autograd/fp8_linear.cpp says what is never kept:
    calls traced by torch.compile among them).

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
    # Under torch.compile nothing is kept or reused: the compiled code writes a freed buffer's next contents into the
    # same tensor object without a version bump (csrc/autograd/fp8_linear.cpp), which the reuse key cannot see.
    reuse = reuse and not torch.compiler.is_compiling()
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
    ``chosen`` (the kept one's index in the heuristic's order), ``alignments`` (the byte alignments of ``b``, ``a``
    and the output the plan was chosen for: part of its key), ``tuned`` (chosen by timing each once; False: the
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
