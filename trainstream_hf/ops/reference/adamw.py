"""Reference of the optimizer op: the AdamW step :func:`trainstream_hf.ops.adamw_step_`'s kernel is tested against."""
from __future__ import annotations

import math

import torch


def adamw_step_reference(param, exp_avg, exp_avg_sq, grad, *, lr, beta1=0.9, beta2=0.999, eps=1e-8,
                         weight_decay=0.01, step, maximize=False, param_bf16=None, num_threads=0) -> None:
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
