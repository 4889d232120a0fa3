"""The only Python face of the native library (``torch.ops.trainstream``), laid out as bitsandbytes lays out its ops.

* The schemas are C++: one ``TORCH_LIBRARY(trainstream, m)`` block in csrc/trainstream.cpp; the kernels register
  beside their definitions (csrc/cpu, csrc/cuda) and the autograd nodes in csrc/autograd. Importing this package
  loads the library (``trainstream_hf._C``).
* :mod:`._common`: the kernel query (:func:`has_kernel`), :func:`built_with_cuda`, :func:`div_scalar`, the formats'
  constants and code tables, and the quantizers' input checks (:func:`check_weight`).
* :mod:`.fakes`: the fake (meta) kernel of every op, registered on import (this package imports it).
* Wrappers, one documented function per op calling ``torch.ops.trainstream.<op>.default``, by family:
  :mod:`.adamw` (the optimizer step), :mod:`.formats` (NF4, NVFP4, int8, FP8 quantize / dequantize), :mod:`.fp8`
  (the FP8 matmul path: activation quantizer, byte transpose, FP8 layer, its input gradient, the cuBLASLt GEMM and
  its settings), :mod:`.layers` (LoRA's add, the weight-only quantized linear with or without its adapter, the bf16
  split, RMSNorm).
* :mod:`.reference`: a pure-PyTorch ``<op>_reference`` for every op, with the op's signature, defining the maths the
  kernels are tested against (tests/test_ops_reference.py), and run by callers where a build has no kernel for a
  device.

Everything public is re-exported here: ``from trainstream_hf import ops; ops.X`` and ``from trainstream_hf.ops import
X``. Callers go through this namespace (not the submodules), so a test that patches ``ops.X`` reaches them.
"""
from __future__ import annotations

from trainstream_hf.ops import fakes  # noqa: F401  (registers the fake kernels)
from trainstream_hf.ops._common import (
    E2M1_MAX, E2M1_VALUES, E4M3_MAX, NF4_BLOCK, NF4_CODE, NF4_GROUP, NVFP4_BLOCK, WEIGHT_DTYPES, built_with_cuda,
    check_weight, div_scalar, has_kernel,
)
# Private helpers kept in this namespace as the single module had them (trainstream_hf/quant/outliers.py reaches
# ops._on_device).
from trainstream_hf.ops._common import (  # noqa: F401
    _NF4_MIDPOINTS, _check_finite, _check_out_dtype, _on_device, _safe_div,
)
from trainstream_hf.ops.adamw import adamw_step_, adamw_step_sr_
from trainstream_hf.ops.formats import (
    dequantize_fp8, dequantize_int8, dequantize_nf4, dequantize_nvfp4, quantize_nf4, quantize_nvfp4,
)
from trainstream_hf.ops.fp8 import (
    FP8_GEMMS, fp8_activation_cache, fp8_forget_activation, fp8_gemm, fp8_gemm_plans, fp8_gemm_rowwise, fp8_linear,
    fp8_linear_dgrad, quantize_rows_e4m3, set_fp8_gemm, transpose_bytes,
)
from trainstream_hf.ops.layers import dequant_linear, lora_add, lora_dequant_linear, rms_norm, split_bf16
from trainstream_hf.ops import reference as _references
from trainstream_hf.ops.reference import (
    adamw_step_reference, adamw_step_sr_reference, dequant_linear_reference, dequantize_fp8_reference,
    dequantize_int8_reference, dequantize_nf4_reference, dequantize_nvfp4_reference, fp8_gemm_rowwise_reference, fp8_linear_dgrad_reference,
    fp8_linear_reference, lora_add_reference, lora_dequant_linear_reference, quantize_fp8_reference,
    quantize_int8_reference, quantize_nf4_reference, quantize_nvfp4_reference, quantize_rows_e4m3_reference,
    rms_norm_bwd_reference, rms_norm_fwd_reference, rms_norm_reference, split_bf16_reference,
    transpose_bytes_reference,
)
from trainstream_hf.ops.reference.formats import _nf4_block_absmax, _nf4_offset_reference  # noqa: F401

__all__ = [
    # _common
    "built_with_cuda", "has_kernel", "div_scalar", "check_weight",
    "WEIGHT_DTYPES", "E4M3_MAX", "E2M1_MAX", "NF4_BLOCK", "NF4_GROUP", "NVFP4_BLOCK", "NF4_CODE", "E2M1_VALUES",
    # wrappers
    "adamw_step_", "adamw_step_sr_",
    "quantize_nf4", "dequantize_nf4", "quantize_nvfp4", "dequantize_nvfp4", "dequantize_int8", "dequantize_fp8",
    "quantize_rows_e4m3", "transpose_bytes", "fp8_linear", "fp8_linear_dgrad", "fp8_gemm_rowwise",
    "fp8_activation_cache", "fp8_forget_activation", "FP8_GEMMS", "fp8_gemm", "fp8_gemm_plans", "set_fp8_gemm",
    "lora_add", "dequant_linear", "lora_dequant_linear", "split_bf16", "rms_norm",
    # references
    *_references.__all__,
]
