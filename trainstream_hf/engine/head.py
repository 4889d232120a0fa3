"""The causal-LM loss in row chunks: the same bits as transformers' ``ForCausalLMLoss``, a third of the memory.

transformers upcasts the logits to fp32 and calls ``cross_entropy``, which saves the fp32 log-softmax of every
token over the whole vocabulary for backward, then backward makes two more fp32 tensors of that size. For an
8B Llama at 2048 tokens (vocabulary 128256) that is about 3 GiB at the peak, as much as nine blocks' saved
activations under the engine. :func:`chunked_causal_lm_loss` saves the logits as they are (the model's dtype)
and works on row chunks of at most ``CHUNK_BYTES`` of fp32 at a time, forward and backward.

Bit for bit the same loss and logits gradient: every operation that touches a row is the one transformers runs
(``log_softmax``, ``nll_loss`` backward, ``_log_softmax_backward_data``, the cast back), each row is computed
independently of the others, chunks start at multiples of 16 rows (so rows keep their address alignment modulo
64 bytes), and the loss itself is reduced by ``nll_loss`` over one picked log-probability per row, which reads
the same values in the same order as ``nll_loss`` over the whole matrix. Tested against transformers with
``torch.equal`` (tests/engine/test_head.py, and tests/gpu on CUDA).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["chunked_causal_lm_loss", "CHUNK_BYTES"]

CHUNK_BYTES = 64 << 20   # fp32 bytes of one chunk of rows (the backward holds four such tensors at a time)
_ROW_ALIGN = 16
_REDUCTION = {"none": 0, "mean": 1, "sum": 2}


def _rows(n: int, vocab: int) -> int:
    rows = max(_ROW_ALIGN, (CHUNK_BYTES // max(1, 4 * vocab)) // _ROW_ALIGN * _ROW_ALIGN)
    return min(rows, max(n, 1))


class _ChunkedCrossEntropy(torch.autograd.Function):
    """``cross_entropy(logits.float(), target, ignore_index, reduction)`` for 2-D ``logits``, saving only
    ``logits`` and ``target``."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index: int, reduction: str):
        n, vocab = logits.shape
        rows = _rows(n, vocab)
        ignored = target == ignore_index
        safe = target.masked_fill(ignored, 0).unsqueeze(1)
        picked = torch.empty(n, 1, dtype=torch.float32, device=logits.device)
        for s in range(0, n, rows):
            lp = torch.log_softmax(logits[s:s + rows].float(), dim=1)
            torch.gather(lp, 1, safe[s:s + rows], out=picked[s:s + rows])
        # One column per row, target 0 (ignore_index stays): nll_loss reduces the same values, in the same
        # order, as it would over the full matrix.
        column = torch.zeros_like(target).masked_fill_(ignored, ignore_index)
        loss, total_weight = torch.ops.aten.nll_loss_forward(picked, column, None, _REDUCTION[reduction],
                                                             ignore_index)
        ctx.save_for_backward(logits, target, total_weight)
        ctx.ignore_index, ctx.reduction = ignore_index, reduction
        return loss

    @staticmethod
    def backward(ctx, grad):
        logits, target, total_weight = ctx.saved_tensors
        n, vocab = logits.shape
        rows = _rows(n, vocab)
        out = torch.empty_like(logits)
        for s in range(0, n, rows):
            lp = torch.log_softmax(logits[s:s + rows].float(), dim=1)
            g = torch.ops.aten.nll_loss_backward(grad, lp, target[s:s + rows], None, _REDUCTION[ctx.reduction],
                                                 ctx.ignore_index, total_weight)
            g = torch.ops.aten._log_softmax_backward_data(g, lp, 1, torch.float32)
            out[s:s + rows] = g  # the cast back to the logits' dtype (the backward of ``.float()``)
            del lp, g
        return out, None, None, None


def chunked_causal_lm_loss(logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100,
                           shift_labels=None, **kwargs):
    """Drop-in for transformers' ``ForCausalLMLoss`` (same arguments, same result bit for bit)."""
    if shift_labels is None:
        labels = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    flat = logits.reshape(-1, vocab_size)
    target = shift_labels.reshape(-1).to(flat.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    if flat.requires_grad and torch.is_grad_enabled():
        loss = _ChunkedCrossEntropy.apply(flat, target, ignore_index, reduction)
    else:
        loss = _ChunkedCrossEntropy.forward(_NoCtx(), flat, target, ignore_index, reduction)
    if reduction == "sum":
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


class _NoCtx:
    """Stands in for autograd's ctx when nothing needs a gradient (evaluation)."""

    def save_for_backward(self, *tensors):
        pass
