"""Pure-PyTorch references of every op in ``torch.ops.trainstream``: ``<op>_reference`` has the op's signature and
defines the maths its kernels are tested against (tests/test_ops_reference.py and the per-family tests; where a
build has no kernel for a device, the callers run the reference instead, see :func:`trainstream_hf.ops.has_kernel`).

By family, as the wrappers are split:

* :mod:`.adamw`: ``adamw_step_reference``, ``adamw_step_sr_reference``.
* :mod:`.formats`: NF4, NVFP4, int8 and FP8 quantize / dequantize (the native kernels' bits).
* :mod:`.fp8`: ``quantize_rows_e4m3_reference`` and ``transpose_bytes_reference`` (the kernels' bits), the row-wise
  scaled GEMM, the FP8 layer (straight-through backward) and its input gradient (within one rounding).
* :mod:`.layers`: LoRA's add, the weight-only quantized linear with or without its adapter, the bf16 split, RMSNorm
  and the two kernels under its node.

A package, not one module, only to keep each file short; import the names from here (or from
:mod:`trainstream_hf.ops`).
"""
from trainstream_hf.ops.reference.adamw import adamw_step_reference, adamw_step_sr_reference
from trainstream_hf.ops.reference.formats import (
    dequantize_fp8_reference, dequantize_int8_reference, dequantize_nf4_reference, dequantize_nvfp4_reference,
    quantize_fp8_reference, quantize_int8_reference, quantize_nf4_reference, quantize_nvfp4_reference,
)
from trainstream_hf.ops.reference.fp8 import (
    fp8_gemm_rowwise_reference, fp8_linear_dgrad_reference, fp8_linear_reference, quantize_rows_e4m3_reference,
    transpose_bytes_reference,
)
from trainstream_hf.ops.reference.layers import (
    dequant_linear_reference, lora_add_reference, lora_dequant_linear_reference, rms_norm_bwd_reference,
    rms_norm_fwd_reference, rms_norm_reference, split_bf16_reference,
)

__all__ = [
    "adamw_step_reference",
    "adamw_step_sr_reference",
    "quantize_nf4_reference", "dequantize_nf4_reference", "quantize_nvfp4_reference", "dequantize_nvfp4_reference",
    "quantize_int8_reference", "dequantize_int8_reference", "quantize_fp8_reference", "dequantize_fp8_reference",
    "quantize_rows_e4m3_reference", "transpose_bytes_reference", "fp8_gemm_rowwise_reference",
    "fp8_linear_reference", "fp8_linear_dgrad_reference",
    "lora_add_reference", "dequant_linear_reference", "lora_dequant_linear_reference", "split_bf16_reference",
    "rms_norm_reference", "rms_norm_fwd_reference", "rms_norm_bwd_reference",
]
