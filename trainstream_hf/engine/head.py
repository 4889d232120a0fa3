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

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from trainstream_hf.engine.tiled import recompute_in_chunks

__all__ = ["chunked_causal_lm_loss", "CHUNK_BYTES", "FusedHead", "fused_head_bytes", "fused_head_loss",
           "FUSED_MIN_BYTES"]

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


# --------------------------------------------------------------------------------------------------------------
# The fused head: LM head and loss together, in row chunks, never holding every token's logits.
#
# A causal LM's forward computes ``logits = lm_head(hidden)`` for every token, then the loss. At long sequences the
# logits alone outgrow the GPU (Llama-3's 128256-token vocabulary: 0.5 GiB of bf16 at 2048 tokens, 38 GiB at 160k),
# before any fp32 the loss adds. With the fused head, a training forward with ``labels`` hands the model a stand-in
# for the logits (one element, expanded to their shape) and keeps the head's input; the loss function then runs
# head and cross-entropy per chunk of rows (forward without saving anything but that input; backward recomputes
# each chunk's logits and takes its gradient), so the head's peak is a few chunks. The result is the same maths,
# not the same bits as the whole-matrix loss (the loss is summed chunk by chunk, and a chunk's GEMM may round
# differently from the full one); the returned ``logits`` is None (a training output has none to read).
#
# Where a model changes its logits between the head and the loss (logit soft-capping, scaling), the loss receives
# something other than the stand-in and the step fails with an error naming ``fused_loss=False``: never a loss
# computed on the stand-in.

FUSED_MIN_BYTES = 1 << 30   # fused_loss="auto": logits of at least this many bytes take the fused head
FUSED_CHUNK_BYTES = 256 << 20  # fp32 bytes of one chunk's log-probabilities


def _fused_rows(n: int, vocab: int) -> int:
    rows = max(_ROW_ALIGN, (FUSED_CHUNK_BYTES // max(1, 4 * vocab)) // _ROW_ALIGN * _ROW_ALIGN)
    return min(rows, max(n, 1))


def fused_head_bytes(tokens: int, hidden: int, vocab: int, itemsize: int) -> int:
    """Device bytes the fused head adds at its peak (an estimate, for plans made off CUDA): the hidden states'
    gradient and, per chunk, the logits, their fp32 log-probabilities and those two's gradients."""
    return tokens * hidden * itemsize + 4 * _fused_rows(tokens, vocab) * vocab * 4


class _FusedHeadLoss(torch.autograd.Function):
    """Sum over rows of ``cross_entropy(head(hidden).float(), target, ignore_index)``, chunk by chunk; saves only
    ``hidden`` (and the head's trainable parameters, inputs here so that their gradient is one sum)."""

    @staticmethod
    def forward(ctx, hidden, target, head, vocab: int, ignore_index: int, *params):
        n, rows = hidden.shape[0], _fused_rows(hidden.shape[0], vocab)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.no_grad():
            for s in range(0, n, rows):
                logits = head(hidden[s:s + rows])
                total += F.cross_entropy(logits.float(), target[s:s + rows], ignore_index=ignore_index,
                                         reduction="sum")
                del logits
        ctx.save_for_backward(hidden, target, *params)
        ctx.head, ctx.ignore_index, ctx.rows = head, ignore_index, rows
        return total

    @staticmethod
    def backward(ctx, grad):
        hidden, target, *params = ctx.saved_tensors
        d_hidden, d_params = recompute_in_chunks(
            hidden, params, ctx.rows,
            lambda h, s, e: F.cross_entropy(ctx.head(h).float(), target[s:e], ignore_index=ctx.ignore_index,
                                            reduction="sum"),
            lambda s, e: grad, ctx.needs_input_grad[0])
        return (d_hidden, None, None, None, None, *d_params)


def fused_head_loss(hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], labels: torch.Tensor,
                    vocab_size: int, *, params: Sequence[torch.Tensor] = (), num_items_in_batch=None,
                    ignore_index: int = -100, shift_labels=None) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss(head(hidden), labels, vocab_size, ...)`` without the full logits (see above).

    Args:
        hidden: the head's input, ``(..., hidden_size)``.
        head: computes a chunk's logits, ``(rows, hidden_size) -> (rows, vocab_size)``.
        params: the tensors ``head`` reads that need a gradient (a trainable LM head's weight).
    """
    if shift_labels is None:
        labels = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    flat = hidden.reshape(-1, hidden.shape[-1])
    target = shift_labels.reshape(-1).to(flat.device)
    params = [p for p in params if p.requires_grad] if torch.is_grad_enabled() else []
    if torch.is_grad_enabled() and (flat.requires_grad or params):
        total = _FusedHeadLoss.apply(flat, target, head, int(vocab_size), ignore_index, *params)
    else:
        total = _FusedHeadLoss.forward(_NoCtx(), flat, target, head, int(vocab_size), ignore_index)
    if num_items_in_batch is None:
        return total / (target != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


class FusedHead:
    """The fused head on a transformers causal LM whose loss is transformers' ``ForCausalLMLoss``.

    ``mode``: True (every training forward with ``labels``) or ``"auto"`` (those whose logits would take at least
    :data:`FUSED_MIN_BYTES`). A forward pre-hook on ``top`` (the model the user calls: a PEFT wrapper calls the
    inner model's ``forward`` directly, past its hooks) decides per call: ``labels`` given as a keyword, grad
    enabled, training mode. The head's forward then returns the stand-in and keeps its input; the inner model's
    ``_loss_function`` computes :func:`fused_head_loss` from it (and otherwise :func:`chunked_causal_lm_loss`, or with
    ``exact=False`` transformers' own ``ForCausalLMLoss``); a
    forward hook on ``top`` that runs even when the forward fails clears the state and puts None where the output
    holds the stand-in. The chunks run the head's own forward (hooks registered on the head are not called for
    them)."""

    def __init__(self, top: torch.nn.Module, base: torch.nn.Module, mode="auto", exact: bool = True):
        from transformers.loss.loss_utils import ForCausalLMLoss

        self.top, self.base, self.mode = top, base, mode
        self._plain_loss = chunked_causal_lm_loss if exact else ForCausalLMLoss
        self.head = base.get_output_embeddings()
        self.vocab = int(base.config.vocab_size)
        self._had = self.head.__dict__.get("forward")  # set on the instance (accelerate's hooks): stays in use
        self._forward = self._had if self._had is not None else type(self.head).forward.__get__(self.head)
        self._pending = False
        self._stand_in = self._input = None
        self._handles: list = []

    def active_for(self, tokens: int) -> bool:
        """Whether a training forward over ``tokens`` tokens (with labels) takes the fused head."""
        itemsize = self.head.weight.element_size() if self.head.weight.dtype.is_floating_point else 2
        return self.mode is True or tokens * self.vocab * itemsize >= FUSED_MIN_BYTES

    def install(self) -> "FusedHead":
        self._handles = [self.top.register_forward_pre_hook(self._pre, with_kwargs=True),
                         self.top.register_forward_hook(self._post, always_call=True)]
        self.head.__dict__["forward"] = self._head_forward
        self.base.__dict__["_loss_function"] = self.loss
        return self

    def uninstall(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.head.__dict__.get("forward") == self._head_forward:
            if self._had is None:
                del self.head.__dict__["forward"]
            else:
                self.head.__dict__["forward"] = self._had
        if self.base.__dict__.get("_loss_function") == self.loss:
            del self.base.__dict__["_loss_function"]
        self._pending, self._stand_in, self._input = False, None, None

    def loss_for(self, hidden: torch.Tensor, labels: torch.Tensor, **kwargs) -> torch.Tensor:
        """:func:`fused_head_loss` of this model's head (what a fused training forward computes)."""
        return fused_head_loss(hidden, self._forward, labels, self.vocab, params=list(self.head.parameters()),
                               **kwargs)

    def _pre(self, module, args, kwargs):
        labels = kwargs.get("labels")
        self._pending = bool(torch.is_tensor(labels) and module.training and torch.is_grad_enabled()
                             and self.active_for(labels.numel()))
        self._stand_in = self._input = None

    def _head_forward(self, x):
        if not self._pending or self._stand_in is not None:
            return self._forward(x)
        self._input = x
        self._stand_in = x.new_empty(()).expand(*x.shape[:-1], self.vocab)
        return self._stand_in

    def loss(self, logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100,
             shift_labels=None, **kwargs):
        if not self._pending:
            return self._plain_loss(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels,
                                    **kwargs)
        if logits is not self._stand_in:
            self._pending = False
            raise RuntimeError(
                f"{type(self.base).__name__} changes its logits between the LM head and the loss (soft-capping or "
                "scaling?), so trainstream's fused head loss cannot apply: pass fused_loss=False to wrap")
        hidden, self._input = self._input, None
        return self.loss_for(hidden, labels, num_items_in_batch=num_items_in_batch, ignore_index=ignore_index,
                             shift_labels=shift_labels)

    def _post(self, module, args, output):
        stand_in, pending = self._stand_in, self._pending
        self._pending, self._stand_in, self._input = False, None, None
        if not pending or stand_in is None:
            return output
        if getattr(output, "logits", None) is stand_in:
            output.logits = None
        elif isinstance(output, tuple):
            output = type(output)(None if o is stand_in else o for o in output)
        return output
