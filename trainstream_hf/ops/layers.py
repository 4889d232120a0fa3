"""Wrappers of the layer ops with their autograd nodes in C++ (csrc/autograd/): LoRA's add
(trainstream_hf/integrations/peft.py, trainstream_hf/quant/lora.py), the weight-only quantized linear with or without
its adapter (trainstream_hf/quant/matmul.py), the bf16 split of float32 operands those adapters use, and RMSNorm
(trainstream_hf/engine/norms.py)."""
from __future__ import annotations

import torch


# --------------------------------------------------------------------------------------------
# lora_add (a LoRA adapter's contribution)
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


# --------------------------------------------------------------------------------------------
# dequant_linear / lora_dequant_linear (the weight-only quantized layer, with or without its adapter)
# --------------------------------------------------------------------------------------------

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


def split_bf16(t: torch.Tensor, pattern: list[int], dim: int) -> torch.Tensor:
    """A float32 matrix as bfloat16 parts laid out for one bf16 GEMM: ``t = p0 + p1 + p2`` with ``p0 = bf16(t)``,
    ``p1 = bf16(t - p0)``, ``p2 = bf16(t - p0 - p1)`` (round to nearest even; exact for ``t`` in bf16's normal
    range), and the parts named by ``pattern`` side by side: row blocks (``dim=0``, shape ``(len(pattern) * R, C)``)
    or column blocks (``dim=1``, shape ``(R, len(pattern) * C)``). Same bits on CPU and GPU.

    Args:
        t: (R, C) float32; pattern: 1 to 8 part indices, each 0, 1 or 2; dim: 0 or 1.
    """
    return torch.ops.trainstream.split_bf16.default(t, list(pattern), dim)


# --------------------------------------------------------------------------------------------
# rms_norm (Llama-family RMSNorm, fused)
# --------------------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x.float() * rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)`` (transformers'
    LlamaRMSNorm) in one kernel each way, differentiable in ``x`` and ``weight`` (its autograd node in C++). Same
    maths and rounding points as the module; the row sums are reduced in another order, so results may differ from
    it in the last bit.

    Args:
        x: (..., K) float32 / bfloat16 / float16; weight: (K,) of x's dtype; eps: the module's ``variance_epsilon``.
    """
    return torch.ops.trainstream.rms_norm.default(x, weight, eps)
