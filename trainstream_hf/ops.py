"""The only Python face of the native library (``torch.ops.trainstream``).

For each op, in this order: a documented wrapper calling ``torch.ops.trainstream.<op>.default``, its
fake (meta) kernel registered with ``torch.library.register_fake``, autograd where it trains, and a
pure-PyTorch ``<op>_reference`` that defines the maths the kernels are tested against.
"""
from __future__ import annotations

import math

import torch

from trainstream_hf import _C  # noqa: F401  (loads the library: registers torch.ops.trainstream)

__all__ = ["adamw_step_", "adamw_step_reference", "built_with_cuda"]


def built_with_cuda() -> bool:
    """True when the native extension was compiled with CUDA support."""
    return bool(_C.built_with_cuda())


# --------------------------------------------------------------------------------------------
# adamw_step_
# --------------------------------------------------------------------------------------------

def adamw_step_(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                grad: torch.Tensor, *, lr: float, beta1: float = 0.9, beta2: float = 0.999,
                eps: float = 1e-8, weight_decay: float = 0.01, step: int,
                maximize: bool = False, param_bf16: torch.Tensor | None = None) -> None:
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
    """
    torch.ops.trainstream.adamw_step_.default(param, exp_avg, exp_avg_sq, grad, param_bf16, lr, beta1,
                                              beta2, eps, weight_decay, step, maximize)


@torch.library.register_fake("trainstream::adamw_step_")
def _adamw_step_fake(param, exp_avg, exp_avg_sq, grad, param_bf16, lr, beta1, beta2, eps, weight_decay,
                     step, maximize):
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


def adamw_step_reference(param, exp_avg, exp_avg_sq, grad, *, lr, beta1=0.9, beta2=0.999, eps=1e-8,
                         weight_decay=0.01, step, maximize=False, param_bf16=None) -> None:
    """Pure-PyTorch AdamW step with the same signature and maths as :func:`adamw_step_`.

    Written as torch.optim.AdamW's single-tensor path is, so that the two agree to rounding.
    """
    g = grad.to(torch.float32)
    if maximize:
        g = -g
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    step_size = lr / (1 - beta1 ** step)
    bias_correction2_sqrt = math.sqrt(1 - beta2 ** step)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
    if param_bf16 is not None:
        param_bf16.copy_(param.view_as(param_bf16) if param.shape == param_bf16.shape else param.reshape(param_bf16.shape))
