"""Gradient offload: the host copies of the gradients of offloaded parameters.

Two modes, chosen per optimizer (``OffloadedAdamW(grads=...)``):

* ``"device"``: ``p.grad`` stays on the device as autograd leaves it, so user code that reads or clips it
  (``torch.nn.utils.clip_grad_norm_``) works unchanged. :meth:`HostGradients.collect` copies every gradient
  device->host at the start of ``optimizer.step()``, all copies issued before the first is waited on.
* ``"host"``: a post-accumulate-grad hook copies each gradient device->host as soon as autograd has
  accumulated it and sets ``p.grad = None``, so the device never holds more than the gradients in flight.
  A bf16 gradient's first term is copied as it is into a bf16 host buffer (the AdamW kernel reads bf16, as in
  device mode), so a step without accumulation never converts on the host: converting every term in the hook
  path cost the backward's launching thread ~0.3 s on a 3B model (H200, 2026-12-03). Otherwise the host buffer is
  fp32; gradients of later micro-batches of the same step are added to it on the host (gradient accumulation;
  a bf16 first term is widened to fp32 then). A later gradient cannot be added until its copy is done, and waiting inside the
  backward hook would stall the host thread that launches backward kernels, so it is copied into a small
  ring of staging buffers and added when its ring slot comes round again (by then the copy has long
  finished) or when the step needs the sums. Folding is first-in first-out, so every parameter's sum is
  taken in the order autograd produced the terms, as torch's in-place accumulation does.

In host mode ``p.grad`` still shows each offloaded parameter's gradient: the parameter's class becomes a subclass
(:class:`HostGradParameter`) whose ``grad`` returns the host buffer (a CPU tensor shaped like the parameter, waited
for) when autograd's own slot is empty. So ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``, Accelerate's
and the Trainer's clipping, and code that reads gradients see every gradient, and scaling one in place scales what
the step applies; ``p.grad = None`` (``zero_grad``) drops it. Once ``optimizer.step()`` has taken the gradients
``p.grad`` is None (torch's would hold them until ``zero_grad``). The engine's hooks hold their owner weakly, so a
model dropped without ``unwrap`` frees everything (a hook on a parameter is held from C++, where Python's cyclic gc
cannot see it).

With ``single_term=True`` (the optimizer's ``optimizer_in_backward``) each parameter takes exactly one gradient per
step: every gradient, fp16 included, is copied as it is into a host buffer of its own dtype and the ring is never
used, so :meth:`HostGradients.take` of one parameter may run on another thread while backward fills the others.
"""
from __future__ import annotations

import weakref
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from trainstream_hf.engine.arena import HostArena
from trainstream_hf.engine.streams import Transfer, TransferStreams

__all__ = ["HostGradients", "HostGradParameter", "GRAD_MODES", "device_grad"]

GRAD_MODES = ("device", "host")
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_GRAD = torch._C.TensorBase.grad  # autograd's own .grad slot (the descriptor HostGradParameter overrides)
_OWNER = "_trainstream_host_grads"  # instance attribute: weakref to the HostGradients holding the host gradient


class HostGradParameter(nn.Parameter):
    """The class an offloaded parameter takes while its gradient lives in host RAM (host mode): ``grad`` returns
    autograd's device gradient when there is one (inside backward, before the engine's hook moves it), else the host
    gradient, a CPU tensor of the parameter's true shape (fp32, or bf16 for a single bf16 term); ``grad = None``
    drops the host gradient too. Everything else is ``nn.Parameter``'s; :meth:`HostGradients.remove_hooks` gives
    the parameter its class back."""

    @property
    def grad(self):
        g = _GRAD.__get__(self)
        if g is not None:
            return g
        ref = self.__dict__.get(_OWNER)
        owner = ref() if ref is not None else None
        return owner.visible_grad(self) if owner is not None else None

    @grad.setter
    def grad(self, value):
        _GRAD.__set__(self, value)
        if value is None:
            ref = self.__dict__.get(_OWNER)
            owner = ref() if ref is not None else None
            if owner is not None:
                owner.discard(self)


_SWAPPED: dict[type, type] = {nn.Parameter: HostGradParameter}


def _host_grad_class(cls: type) -> type | None:
    """The HostGradParameter flavour of parameter class ``cls`` (None: a class that defines its own ``grad``)."""
    if cls not in _SWAPPED:
        if not issubclass(cls, nn.Parameter) or any("grad" in vars(k) for k in cls.__mro__[:cls.__mro__.index(
                nn.Parameter)]):
            return None
        _SWAPPED[cls] = type(f"HostGrad{cls.__name__}", (HostGradParameter, cls), {})
    return _SWAPPED[cls]


def device_grad(p: torch.Tensor) -> torch.Tensor | None:
    """Autograd's own gradient of ``p`` (what AccumulateGrad wrote), never the host gradient ``p.grad`` shows."""
    return _GRAD.__get__(p)


def _weak_hook(method):
    """A post-accumulate-grad hook calling the bound ``method`` through a weak reference to its object."""
    ref = weakref.WeakMethod(method)

    def hook(p):
        m = ref()
        if m is not None:
            m(p)
    return hook


class _GradBuffer:
    """The host gradient of one parameter: ``host`` holds it once ``transfer`` (if any) is done. With a ``low``
    buffer (host mode, bf16), the fp32 accumulator ``host`` is allocated by ``accumulator()`` when a second term
    first needs it: a run without gradient accumulation never holds it (4 bytes a parameter: an 8B full fine-tune's
    32 GB)."""

    __slots__ = ("host", "low", "in_low", "transfer", "filled", "_make")

    def __init__(self, host: torch.Tensor | None, low: torch.Tensor | None = None, make=None):
        self.host = host
        self._make = make  # () -> the fp32 accumulator, when host is None
        self.low = low  # host mode, bf16 parameters: the first term, unconverted
        self.in_low = False  # this step's gradient is (only) in ``low``
        self.transfer: Transfer | None = None
        self.filled = False  # host (or low) holds (or will, once transfer is done) this step's gradient

    def wait(self) -> None:
        if self.transfer is not None:
            self.transfer.synchronize()
            self.transfer = None

    def accumulator(self) -> torch.Tensor:
        if self.host is None:
            self.host = self._make()
        return self.host


class HostGradients:
    """Host gradient buffers of the offloaded parameters and the copies that fill them.

    Args:
        params: the offloaded parameters.
        arena: where the host buffers live (pinned when CUDA, so the copies are asynchronous).
        streams: the device's transfer streams; copies run on the D2H stream.
        mode: ``"device"`` or ``"host"`` (see the module docstring).
        staging_slots: host mode only: size of the staging ring. The backward hook blocks the host only
            when it reuses a slot whose copy, issued ``staging_slots`` hooks earlier, is still running.
        shapes: the true shape of parameters whose ``data`` may be an empty placeholder (paged weights);
            default ``p.shape``.
        single_term: host mode: at most one gradient per parameter between two :meth:`consume` calls (the
            caller enforces it; a second one raises), never staged (see the module docstring).
        hook: host mode: called with ``p`` by the post-accumulate-grad hook instead of :meth:`add`; it must
            call :meth:`add` itself (the optimizer's ``optimizer_in_backward`` queues the update after it).
    """

    def __init__(self, params: Sequence[nn.Parameter], *, arena: HostArena, streams: TransferStreams,
                 mode: str = "device", staging_slots: int = 4,
                 shapes: Mapping[nn.Parameter, torch.Size] | None = None, single_term: bool = False,
                 hook: Callable[[nn.Parameter], None] | None = None):
        if mode not in GRAD_MODES:
            raise ValueError(f"grads must be one of {GRAD_MODES}, got {mode!r}")
        if staging_slots < 1:
            raise ValueError(f"staging_slots must be >= 1, got {staging_slots}")
        self.mode = mode
        self.single_term = bool(single_term)
        self.arena = arena
        self.streams = streams
        self.d2h_bytes = 0
        self._params = list(params)
        self._shapes = {p: torch.Size(shapes[p]) if shapes and p in shapes else p.shape for p in self._params}
        # device mode copies the gradient as it is (the kernel reads bf16 directly); host mode sums in fp32, in an
        # accumulator made on first need where the first term has a buffer of its own dtype
        self._bufs = {}
        for p in self._params:
            n = self._shapes[p].numel()
            if self._low_dtype(p, mode, self.single_term):
                self._bufs[p] = _GradBuffer(None, arena.empty([n], p.dtype),
                                            make=lambda n=n: arena.empty([n], torch.float32))
            else:
                self._bufs[p] = _GradBuffer(arena.empty([n], p.dtype if mode == "device" else torch.float32))
        self._ring_bytes = max((self._shapes[p].numel() * p.element_size() for p in self._params), default=0)
        self._ring: list[torch.Tensor] = []  # allocated on first use: not every run accumulates
        self._ring_size = staging_slots
        self._pending: list[tuple[_GradBuffer, torch.Tensor, Transfer] | None] = [None] * staging_slots
        self._next = 0
        self._hooks = []
        self._classes: dict[nn.Parameter, type] = {}  # host mode: parameters given HostGradParameter, their class
        # host mode: called before a host gradient is shown through ``p.grad``; returns False while the
        # gradients belong to a running step (then ``p.grad`` is None), raises where they cannot be shown
        self.before_read: Callable[[], bool] | None = None
        if mode == "host":
            self._hooks = [p.register_post_accumulate_grad_hook(_weak_hook(hook or self._on_grad))
                           for p in self._params]
            for p in self._params:
                cls = _host_grad_class(type(p))
                if cls is not None:
                    self._classes[p] = type(p)
                    p.__class__ = cls
                    p.__dict__[_OWNER] = weakref.ref(self)

    @staticmethod
    def _low_dtype(p: nn.Parameter, mode: str, single_term: bool) -> bool:
        """Whether ``p`` gets a host buffer of its own dtype for an unconverted first term (host mode)."""
        return mode == "host" and (p.dtype == torch.bfloat16 or (single_term and p.dtype == torch.float16))

    @staticmethod
    def host_bytes_needed(numels: Mapping[nn.Parameter, int], mode: str, single_term: bool = False) -> list[int]:
        """Byte counts of the buffers the constructor allocates (for ``HostArena.reserve_for``); a host-mode bf16
        parameter's fp32 accumulator is made only when a second gradient term comes (not counted)."""
        return [2 * n if HostGradients._low_dtype(p, mode, single_term) else
                n * (p.element_size() if mode == "device" else 4) for p, n in numels.items()]

    # -- validation -----------------------------------------------------------------------------
    def check(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        """Raises ValueError when ``grad`` cannot be offloaded as the gradient of ``p``."""
        if grad.is_sparse:
            raise ValueError("OffloadedAdamW does not support sparse gradients (neither does torch's AdamW)")
        if grad.dtype not in _SUPPORTED_DTYPES or grad.shape != self._shapes[p]:
            raise ValueError(f"gradient of an offloaded parameter must be float32, bfloat16 or float16 with the "
                             f"parameter's shape {tuple(self._shapes[p])}, got {grad.dtype} {tuple(grad.shape)}")

    def check_device_grads(self) -> None:
        """Validates every device gradient of an offloaded parameter (called before anything mutates)."""
        for p in self._params:
            if (g := device_grad(p)) is not None:
                self.check(p, g)

    # -- filling --------------------------------------------------------------------------------
    def _copy(self, grad: torch.Tensor, out: torch.Tensor) -> Transfer:
        self.d2h_bytes += grad.numel() * grad.element_size()
        return self.streams.to_host(grad.detach().reshape(-1), out)

    def collect(self) -> None:
        """Issues the device->host copies of every device gradient (step start).

        Device mode: ``p.grad`` is copied and left in place. Host mode: a gradient that did not come
        through the hook (assigned by hand, or produced while hooks were off) is added to the host sum and
        freed, as the hook would have done.
        """
        for p in self._params:
            g = device_grad(p)
            if g is None:
                continue
            if self.mode == "device":
                buf = self._bufs[p]
                buf.transfer = self._copy(g, buf.host)
                buf.filled = True
            else:
                self._on_grad(p)

    def add(self, p: nn.Parameter) -> None:
        """Host mode: issues the copy of ``p.grad`` to the host (added to its sum) and sets ``p.grad = None``,
        as the post-accumulate-grad hook does. Never waits for the copy."""
        self._on_grad(p)

    def _on_grad(self, p: nn.Parameter) -> None:
        grad = device_grad(p)
        if grad is None:
            return
        self.check(p, grad)
        buf = self._bufs[p]
        low = buf.low is not None and grad.dtype == buf.low.dtype
        if not buf.filled and (grad.dtype == torch.float32 or low):
            # first term: copy straight into the fp32 accumulator or the low buffer, no staging, no conversion
            buf.in_low = low
            buf.transfer = self._copy(grad, buf.low if buf.in_low else buf.accumulator())
            buf.filled = True
        elif self.single_term:
            raise RuntimeError(f"HostGradients(single_term=True): a {'second ' if buf.filled else ''}{grad.dtype} "
                               f"gradient for a {p.dtype} parameter cannot be taken without staging")
        else:
            self._widen(buf)
            i = self._next
            self._next = (i + 1) % self._ring_size
            self._fold(i)
            if not self._ring:
                self._ring = [self.arena.empty([self._ring_bytes], torch.uint8) for _ in range(self._ring_size)]
            stage = self._ring[i][: grad.numel() * grad.element_size()].view(grad.dtype)
            self._pending[i] = (buf, stage, self._copy(grad, stage))
        # the copy has recorded grad's memory on the D2H stream, so the allocator keeps it until it is done
        _GRAD.__set__(p, None)  # autograd's slot only: the host gradient just filled stays

    def _fold(self, i: int) -> None:
        entry = self._pending[i]
        if entry is None:
            return
        buf, stage, transfer = entry
        transfer.synchronize()
        buf.wait()  # (a bf16 first term was widened before this term was staged, in _on_grad)
        if buf.filled:
            buf.accumulator().add_(stage)
        else:
            buf.accumulator().copy_(stage)
            buf.filled = True
        self._pending[i] = None

    @staticmethod
    def _widen(buf: _GradBuffer) -> None:
        """A second term is coming: the bf16 first term moves into the fp32 accumulator (exactly)."""
        if buf.in_low:
            buf.wait()
            buf.accumulator().copy_(buf.low)
            buf.in_low = False

    def _drain(self) -> None:
        # oldest first, so each parameter's terms are summed in the order autograd produced them
        for k in range(self._ring_size):
            self._fold((self._next + k) % self._ring_size)

    # -- reading --------------------------------------------------------------------------------
    def take(self, p: nn.Parameter) -> torch.Tensor | None:
        """The host gradient of ``p`` (flat, contiguous), waiting for its copies; None if it has none.

        The caller may modify it in place: it is consumed by the step.
        """
        if not self.single_term:  # single-term gradients are never staged (and this may run off the hook thread)
            self._drain()
        buf = self._bufs[p]
        if not buf.filled:
            return None
        buf.wait()
        return buf.low if buf.in_low else buf.host

    def host_grads(self) -> dict[nn.Parameter, torch.Tensor]:
        """Every host gradient that holds a value, after all copies are done (for norms and clipping)."""
        if self.mode == "device":
            return {}
        self.collect()
        return {p: g for p in self._params if (g := self.take(p)) is not None}

    def visible_grad(self, p: nn.Parameter) -> torch.Tensor | None:
        """``p.grad`` of a host-mode parameter whose device slot is empty: its host gradient shaped like ``p``
        (waited for), or None when it has none or a running step owns it (see :attr:`before_read`)."""
        if self.before_read is not None and not self.before_read():
            return None
        buf = self._bufs.get(p)
        if buf is None or (not buf.filled and not any(e is not None and e[0] is buf for e in self._pending)):
            return None
        g = self.take(p)
        return None if g is None else g.view(self._shapes[p])

    def discard(self, p: nn.Parameter) -> None:
        """``p.grad = None`` on a host-mode parameter: its host gradient (pending terms included) is dropped."""
        if self.before_read is not None and not self.before_read():
            return  # a running step owns (and consumes) it
        buf = self._bufs.get(p)
        if buf is None:
            return
        if any(e is not None and e[0] is buf for e in self._pending):
            self._drain()
        buf.wait()
        buf.filled = buf.in_low = False

    # -- life cycle -----------------------------------------------------------------------------
    def consume(self) -> None:
        """Marks every host gradient empty (after the step used them, or on ``zero_grad``).

        The D2H stream is in order, so a later copy into a buffer cannot overtake one still in flight;
        only host reads need a wait, and nothing reads an empty buffer.
        """
        for buf in self._bufs.values():
            buf.filled = buf.in_low = False
            buf.transfer = None
        self._pending = [None] * self._ring_size

    def remove_hooks(self) -> None:
        """Removes the gradient hooks and gives every parameter its own class back."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for p, cls in self._classes.items():
            p.__class__ = cls
            p.__dict__.pop(_OWNER, None)
        self._classes = {}

    def nbytes(self) -> int:
        """Host bytes held by the gradient buffers and the staging ring."""
        return (sum((0 if b.host is None else b.host.numel() * b.host.element_size())
                    + (0 if b.low is None else 2 * b.low.numel())
                    for b in self._bufs.values())
                + len(self._ring) * self._ring_bytes)
