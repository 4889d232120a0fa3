"""The fake (meta) kernel of every op in ``torch.ops.trainstream``, registered with ``torch.library.register_fake``
when this module is imported (``trainstream_hf.ops`` imports it): output shapes and dtypes, and the input checks
that can be made without data, for torch.compile, FakeTensor tracing and ``torch.library.opcheck``.

The schemas are declared in C++ (csrc/trainstream.cpp, one ``TORCH_LIBRARY`` block); these kernels must agree with
them and with the real kernels' output metadata (``opcheck`` in the tests compares them).
"""
from __future__ import annotations

import torch

from trainstream_hf.ops._common import NF4_BLOCK, NF4_GROUP, NVFP4_BLOCK, WEIGHT_DTYPES


def _fake_check_weight(op, weight, multiple):
    torch._check(weight.dim() == 2, lambda: f"{op}: weight must be 2-D (out_features, in_features)")
    torch._check(weight.dtype in WEIGHT_DTYPES, lambda: f"{op}: weight must be float32, bfloat16 or float16")
    torch._check(weight.shape[1] % multiple == 0, lambda: f"{op}: in_features must be a multiple of {multiple}")


# --------------------------------------------------------------------------------------------
# adamw_step_
# --------------------------------------------------------------------------------------------

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


@torch.library.register_fake("trainstream::adamw_step_sr_")
def _adamw_step_sr_fake(param, exp_avg, exp_avg_sq, grad, param_bf16, lr, beta1, beta2, eps, weight_decay,
                        step, maximize, seed, num_threads=0):
    torch._check(param.dtype == torch.float32, lambda: f"adamw_step_sr_: param must be float32, got {param.dtype}")
    for name, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        torch._check(t.dtype == torch.bfloat16, lambda: f"adamw_step_sr_: {name} must be bfloat16, got {t.dtype}")
        torch._check(t.numel() == param.numel(), lambda: f"adamw_step_sr_: {name} numel differs from param's")
    torch._check(grad.dtype in (torch.float32, torch.bfloat16),
                 lambda: f"adamw_step_sr_: grad must be float32 or bfloat16, got {grad.dtype}")
    torch._check(grad.numel() == param.numel(), lambda: "adamw_step_sr_: grad numel differs from param's")
    torch._check(step >= 1, lambda: f"adamw_step_sr_: step must be >= 1, got {step}")
    return None


# --------------------------------------------------------------------------------------------
# Frozen-weight formats: NF4, NVFP4, int8, FP8
# --------------------------------------------------------------------------------------------

@torch.library.register_fake("trainstream::quantize_nf4")
def _quantize_nf4_fake(weight):
    _fake_check_weight("quantize_nf4", weight, NF4_BLOCK)
    rows, cols = weight.shape
    nb = rows * cols // NF4_BLOCK
    return (weight.new_empty((rows, cols // 2), dtype=torch.uint8),
            weight.new_empty((nb,), dtype=torch.float8_e4m3fn),
            weight.new_empty(((nb + NF4_GROUP - 1) // NF4_GROUP,), dtype=torch.float32),
            weight.new_empty((), dtype=torch.float32))


@torch.library.register_fake("trainstream::dequantize_nf4")
def _dequantize_nf4_fake(data, absmax_q, absmax_scale, absmax_offset, dtype):
    torch._check(data.dim() == 2 and data.dtype == torch.uint8, lambda: "dequantize_nf4: data must be 2-D uint8")
    torch._check(absmax_q.dtype == torch.float8_e4m3fn, lambda: "dequantize_nf4: absmax_q must be float8_e4m3fn")
    torch._check(dtype in WEIGHT_DTYPES, lambda: f"dequantize_nf4: unsupported dtype {dtype}")
    return data.new_empty((data.shape[0], data.shape[1] * 2), dtype=dtype)


@torch.library.register_fake("trainstream::quantize_nvfp4")
def _quantize_nvfp4_fake(weight):
    _fake_check_weight("quantize_nvfp4", weight, NVFP4_BLOCK)
    rows, cols = weight.shape
    return (weight.new_empty((rows, cols // 2), dtype=torch.uint8),
            weight.new_empty((rows, cols // NVFP4_BLOCK), dtype=torch.float8_e4m3fn),
            weight.new_empty((), dtype=torch.float32))


@torch.library.register_fake("trainstream::dequantize_nvfp4")
def _dequantize_nvfp4_fake(data, block_scale, tensor_scale, dtype):
    torch._check(data.dim() == 2 and data.dtype == torch.uint8, lambda: "dequantize_nvfp4: data must be 2-D uint8")
    torch._check(block_scale.dtype == torch.float8_e4m3fn,
                 lambda: "dequantize_nvfp4: block_scale must be float8_e4m3fn")
    torch._check(dtype in WEIGHT_DTYPES, lambda: f"dequantize_nvfp4: unsupported dtype {dtype}")
    return data.new_empty((data.shape[0], data.shape[1] * 2), dtype=dtype)


def _dequantize_rowwise_fake(op, data, scale, dtype, code_dtype):
    torch._check(data.dim() == 2 and data.dtype == code_dtype, lambda: f"{op}: data must be 2-D {code_dtype}")
    torch._check(scale.dtype == torch.float32 and scale.dim() == 1 and scale.shape[0] == data.shape[0],
                 lambda: f"{op}: scale must be float32 (out_features,)")
    torch._check(dtype in WEIGHT_DTYPES, lambda: f"{op}: unsupported dtype {dtype}")
    return data.new_empty(data.shape, dtype=dtype)


@torch.library.register_fake("trainstream::dequantize_int8")
def _dequantize_int8_fake(data, scale, dtype):
    return _dequantize_rowwise_fake("dequantize_int8", data, scale, dtype, torch.int8)


@torch.library.register_fake("trainstream::dequantize_fp8")
def _dequantize_fp8_fake(data, scale, dtype):
    return _dequantize_rowwise_fake("dequantize_fp8", data, scale, dtype, torch.float8_e4m3fn)


# --------------------------------------------------------------------------------------------
# The FP8 matmul path: activation quantizer, byte transpose, the layer, its input gradient, the cuBLASLt GEMM
# --------------------------------------------------------------------------------------------

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


@torch.library.register_fake("trainstream::transpose_bytes")
def _transpose_bytes_fake(x):
    torch._check(x.dim() == 2, lambda: "transpose_bytes: x must be 2-D")
    torch._check(x.element_size() == 1, lambda: f"transpose_bytes: x must have 1-byte elements, got {x.dtype}")
    return x.new_empty((x.shape[1], x.shape[0]))


@torch.library.register_fake("trainstream::fp8_gemm_rowwise")
def _fp8_gemm_rowwise_fake(a, b, scale_a, scale_b, out_dtype):
    torch._check(a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[1],
                 lambda: "fp8_gemm_rowwise: a must be (M, K) and b (N, K)")
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


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


# --------------------------------------------------------------------------------------------
# Layers: LoRA's add, the weight-only quantized linear (with or without its adapter), RMSNorm, the bf16 split
# --------------------------------------------------------------------------------------------

@torch.library.register_fake("trainstream::lora_add")
def _lora_add_fake(result, x, lora_a, lora_b, scaling):
    torch._check(x.shape[-1] == lora_a.shape[1] and result.shape[-1] == lora_b.shape[0],
                 lambda: "lora_add: x must be (..., K) and result (..., N)")
    return torch.empty_like(result)


@torch.library.register_fake("trainstream::lora_dequant_linear")
def _lora_dequant_linear_fake(x, packed, fmt, lora_a, lora_b, scaling):
    torch._check(x.dim() >= 1 and x.shape[-1] == lora_a.shape[1], lambda: "lora_dequant_linear: x must be (..., K)")
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    return x.new_empty((*x.shape[:-1], lora_b.shape[0]), dtype=dtype)


@torch.library.register_fake("trainstream::dequant_linear")
def _dequant_linear_fake(x, packed, fmt):
    torch._check(x.dim() >= 1, lambda: "dequant_linear: x must be (..., K)")
    return x.new_empty((*x.shape[:-1], packed[0].shape[0]))


@torch.library.register_fake("trainstream::split_bf16")
def _split_bf16_fake(t, pattern, dim):
    n = len(pattern)
    shape = (n * t.shape[0], t.shape[1]) if dim == 0 else (t.shape[0], n * t.shape[1])
    return t.new_empty(shape, dtype=torch.bfloat16)


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
