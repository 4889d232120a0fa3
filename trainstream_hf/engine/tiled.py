"""Token-tiled MLPs for long sequences (``TrainStreamConfig.tiled_mlp``).

A decoder block's MLP is token-wise (each token's output depends on that token's input alone), and at long sequences
its intermediate activations dominate a block's memory: Llama-3-8B's gate, up, their product and the SiLU keep
about four ``tokens x 14336`` tensors for backward, 18 GiB of bf16 at 160k tokens, where the block's input is 1.3
GiB. :class:`TiledMLP` runs such an MLP over tiles of rows instead: forward without saving anything but its input,
backward recomputing one tile at a time and taking its gradients, so the MLP's peak is one tile's. The same maths,
not the same bits (a tile's GEMM may round differently from the whole one's, and the weights' gradients are summed
tile by tile), at the price of one more MLP forward.

Taken per call, only where it matters: a training call (grad enabled) whose ``tokens x intermediate`` elements
reach :data:`MIN_BYTES` (``"auto"``) or every training call (``True``). Modules taken: a block's ``mlp`` whose class
name ends in ``MLP`` (Llama, Mistral, Qwen2, Gemma, Phi-3, ... not mixture-of-experts blocks, which also return
router logits) with an ``intermediate_size``, and no active dropout inside (a recomputed tile would draw other
masks: LoRA's ``lora_dropout > 0`` keeps the MLP whole). The tiles' recompute calls the sub-modules' own forwards
(with their hooks) during backward, as gradient checkpointing's recompute does.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

__all__ = ["TiledMLP", "MIN_BYTES", "TILE_BYTES", "recompute_in_chunks"]

MIN_BYTES = 1 << 30  # "auto": an MLP call whose intermediate (tokens x intermediate_size) reaches this is tiled
TILE_BYTES = 256 << 20  # one tile's intermediate (tokens x intermediate_size) in the activations' dtype


def _tile_rows(tokens: int, intermediate: int, itemsize: int) -> int:
    return max(1, min(tokens, TILE_BYTES // max(1, intermediate * itemsize)))


class _Tiled(torch.autograd.Function):
    """``forward(x)`` of a token-wise module over row tiles of ``x`` (``(tokens, hidden)``), saving only ``x``;
    the module's trainable parameters are inputs, so that their gradient is one sum."""

    @staticmethod
    def forward(ctx, x, forward, rows: int, *params):
        with torch.no_grad():
            out = torch.cat([forward(x[s:s + rows]) for s in range(0, x.shape[0], rows)]) \
                if x.shape[0] > rows else forward(x)
        ctx.save_for_backward(x, *params)
        ctx.forward, ctx.rows = forward, rows
        return out

    @staticmethod
    def backward(ctx, grad):
        x, *params = ctx.saved_tensors
        dx, dparams = recompute_in_chunks(x, params, ctx.rows, lambda xt, s, e: ctx.forward(xt),
                                          lambda s, e: grad[s:e], ctx.needs_input_grad[0])
        return (dx, None, None, *dparams)


def recompute_in_chunks(x, params, rows: int, forward, grad_of, need_dx: bool):
    """The backward of a row-wise function recomputed one chunk of rows at a time: ``forward(xt, s, e)`` gives rows
    ``s:e``'s output from their input ``xt`` (a leaf), ``grad_of(s, e)`` its gradient. Returns the input's gradient
    (None unless ``need_dx``) and each of ``params``' gradient summed over the chunks (None where unused)."""
    dx = torch.empty_like(x) if need_dx else None
    dparams: list = [None] * len(params)
    for s in range(0, x.shape[0], rows):
        e = min(s + rows, x.shape[0])
        with torch.enable_grad():
            xt = x[s:e].detach().requires_grad_(need_dx)
            out = forward(xt, s, e)
            got = list(torch.autograd.grad(out, ([xt] if need_dx else []) + list(params), grad_of(s, e),
                                           allow_unused=True))
        if need_dx:
            dx[s:e] = got.pop(0)
        for i, g in enumerate(got):
            if g is not None:
                dparams[i] = g if dparams[i] is None else dparams[i].add_(g)
        del out, got, xt
    return dx, dparams


def _takes(block: nn.Module) -> nn.Module | None:
    mlp = getattr(block, "mlp", None)
    if not isinstance(mlp, nn.Module) or not type(mlp).__name__.endswith("MLP") or "forward" in mlp.__dict__:
        return None
    if not isinstance(getattr(mlp, "intermediate_size", None), int):
        return None
    return mlp


class TiledMLP:
    """Installs the tiled forward on the MLPs of ``blocks`` (see the module docstring); ``mode`` True or "auto"."""

    def __init__(self, mode="auto"):
        self.mode = mode
        self.modules: list[nn.Module] = []

    def install(self, blocks: Iterable[nn.Module]) -> int:
        """Returns how many MLPs were taken."""
        for b in blocks:
            mlp = _takes(b)
            if mlp is not None:
                mlp.__dict__["forward"] = self._forward_of(mlp)
                self.modules.append(mlp)
        return len(self.modules)

    def uninstall(self) -> None:
        for m in self.modules:
            m.__dict__.pop("forward", None)
        self.modules = []

    def active_for(self, mlp: nn.Module, tokens: int, itemsize: int) -> bool:
        """Whether a training call of ``mlp`` over ``tokens`` tokens runs tiled."""
        return self.mode is True or tokens * mlp.intermediate_size * itemsize >= MIN_BYTES

    def _forward_of(self, mlp: nn.Module):
        plain = type(mlp).forward.__get__(mlp)

        def forward(x: torch.Tensor, *args, **kwargs):
            if args or kwargs or not torch.is_grad_enabled() or x.dim() < 2:
                return plain(x, *args, **kwargs)
            tokens = x.numel() // x.shape[-1]
            if not self.active_for(mlp, tokens, x.element_size()) or any(
                    isinstance(m, nn.Dropout) and m.p > 0 and m.training for m in mlp.modules()):
                return plain(x)
            flat = x.reshape(tokens, x.shape[-1])
            params = [p for p in mlp.parameters() if p.requires_grad]
            out = _Tiled.apply(flat, plain, _tile_rows(tokens, mlp.intermediate_size, x.element_size()), *params)
            return out.reshape(*x.shape[:-1], out.shape[-1])
        return forward
