"""The optimizer op: one AdamW step over fp32 master weights, in place (CPU kernel, csrc/cpu/adamw.cpp; reference:
:func:`trainstream_hf.ops.reference.adamw.adamw_step_reference`)."""
from __future__ import annotations

import torch


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


def adamw_step_sr_(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   grad: torch.Tensor, *, lr: float, beta1: float = 0.9, beta2: float = 0.999,
                   eps: float = 1e-8, weight_decay: float = 0.01, step: int, maximize: bool = False,
                   seed: int = 0, param_bf16: torch.Tensor | None = None, num_threads: int = 0) -> None:
    """:func:`adamw_step_` with bfloat16 moments (CPU kernel): ``exp_avg`` and ``exp_avg_sq`` are read as bf16,
    updated in float32 exactly as :func:`adamw_step_` updates them, and stored back by stochastic rounding (the
    float's bits plus 16 random bits, truncated: unbiased, so a moment whose change per step is below half a bf16 ulp
    still moves on average). The random bits are a hash of (``seed``, ``step``, element index): the result does not
    depend on the thread count. 4 bytes of moments per parameter instead of 8; an approximation of AdamW, opt-in
    (``TrainStreamConfig.optimizer_moments``).
    """
    torch.ops.trainstream.adamw_step_sr_.default(param, exp_avg, exp_avg_sq, grad, param_bf16, lr, beta1,
                                                 beta2, eps, weight_decay, step, maximize, seed, num_threads)
