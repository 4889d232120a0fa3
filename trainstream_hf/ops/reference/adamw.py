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


_M32 = 0xFFFFFFFF


def _sr_bits(seed: int, step: int, n: int) -> torch.Tensor:
    """The kernel's 32 random bits per element (lowbias32 of seed, step and the element index), as int64."""
    i = torch.arange(n, dtype=torch.int64)
    h = (i & _M32) ^ (((i >> 32) * 0x27D4EB2D) & _M32) ^ ((seed * 0x9E3779B9) & _M32) ^ ((step * 0x85EBCA6B) & _M32)
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & _M32
    h = h ^ (h >> 15)
    h = (h * 0x846CA68B) & _M32
    return h ^ (h >> 16)


def _to_bf16_sr(x: torch.Tensor, r16: torch.Tensor) -> torch.Tensor:
    u = x.view(torch.int32).to(torch.int64) & _M32
    mag = u & 0x7FFFFFFF
    out = ((u + r16) >> 16) & 0xFFFF
    out = torch.where(mag == 0x7F800000, u >> 16, out)  # inf stays inf
    out = torch.where(mag > 0x7F800000, (u >> 16) | 0x40, out)  # quiet NaN
    return out.to(torch.int32).to(torch.int16).view(torch.bfloat16)


def adamw_step_sr_reference(param, exp_avg, exp_avg_sq, grad, *, lr, beta1=0.9, beta2=0.999, eps=1e-8,
                            weight_decay=0.01, step, maximize=False, seed=0, param_bf16=None, num_threads=0) -> None:
    """Pure-PyTorch :func:`adamw_step_sr_`: :func:`adamw_step_reference` on the moments widened to float32, then each
    moment stored by the kernel's stochastic rounding (the same random bits)."""
    m, v = exp_avg.float(), exp_avg_sq.float()
    adamw_step_reference(param, m, v, grad, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                         step=step, maximize=maximize, param_bf16=param_bf16)
    r = _sr_bits(seed, step, param.numel())
    exp_avg.copy_(_to_bf16_sr(m.reshape(-1), r & 0xFFFF).view_as(exp_avg))
    exp_avg_sq.copy_(_to_bf16_sr(v.reshape(-1), r >> 16).view_as(exp_avg_sq))
