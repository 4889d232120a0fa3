"""OffloadedAdamW: the user's Adam/AdamW, with the state of chosen parameters kept and stepped on the host.

For each offloaded parameter the fp32 master weight and both moments live in the host arena and are updated
on the CPU by the native SIMD kernel (:func:`trainstream_hf.ops.adamw_step_`); the device keeps only the
parameter in its own dtype. The other parameters (LoRA adapters, norms the plan keeps resident) are stepped
on the device by an ordinary torch optimizer with the same hyper-parameters.

One step on CUDA (the device work of the next forward only waits where it must)::

    host  | issue all grad D2H | device opt step (queued) | wait g0, adam p0, issue H2D p0 | wait g1, adam p1, ...
    D2H   | g0 g1 g2 ...
    H2D   |                                                   p0 ........          p1 ........
    main  | ... backward | device opt kernels | (waits for H2D stream) next forward

With ``optimizer_in_backward`` (torchtune's ``optimizer_in_bwd``) each parameter's CPU update is queued on the
worker as soon as its gradient's copy has been issued, in backward, so the CPU AdamW overlaps the rest of backward
and its copies instead of starting at ``step()``::

    main  | backward: ... block 2, hook(p2) | block 1, hook(p1) | ... | step(): device opt, bookkeeping (queued)
    D2H   |                g2                  g1
    work  |                  wait g2, adam p2, issue H2D p2 | wait g1, adam p1, ...

The object *is* a ``torch.optim.Optimizer`` sharing the user's param-group dicts, so LR schedulers,
``state_dict()`` consumers and Trainer code treat it as the optimizer it wraps.

One file, past 600 lines: the host step, its ordering against the device streams and the optimizer's state-dict
and parameter-group bookkeeping act on the same per-parameter records; a split would pass those records around.
"""
from __future__ import annotations

import heapq
import inspect
import itertools
import threading
import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable

import torch
from torch import nn

from trainstream_hf import ops
from trainstream_hf.engine.arena import HostArena
from trainstream_hf.engine.device_adamw import DEFAULT_CHUNK_NUMEL, DeviceSteps
from trainstream_hf.engine.grads import GRAD_MODES, HostGradients, _weak_hook, device_grad
from trainstream_hf.engine.streams import Transfer, TransferStreams

__all__ = ["OffloadedAdamW"]

OFFLOADABLE = (torch.optim.AdamW, torch.optim.Adam)  # the optimizers OffloadedAdamW takes (exactly)
_UNSUPPORTED_FLAGS = ("amsgrad", "capturable", "differentiable")  # settings of theirs it does not implement


def offload_refusal(optimizer: torch.optim.Optimizer) -> str | None:
    """What keeps :class:`OffloadedAdamW` from taking ``optimizer`` (``'torch.optim.sgd.SGD'``, ``'torch.optim.AdamW
    with amsgrad=True'``), or None when it takes it."""
    if type(optimizer) not in OFFLOADABLE:
        return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    for group in optimizer.param_groups:
        for flag in _UNSUPPORTED_FLAGS:
            if group.get(flag, False):
                return f"torch.optim.{type(optimizer).__name__} with {flag}=True"
    return None


_MOMENTS = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _Slot:
    """Host state of one offloaded parameter (all buffers flat, contiguous, in the arena)."""

    __slots__ = ("param", "shape", "group", "master", "exp_avg", "exp_avg_sq", "step", "out", "sink", "last_h2d",
                 "ready", "where", "seed", "unpublished")

    def __init__(self, param: nn.Parameter, group: int, arena: HostArena, sink: torch.Tensor | None,
                 where: str = "host", moments: torch.dtype = torch.float32, seed: int = 0):
        # a paged parameter's data may be an empty placeholder: its sink has the true shape
        self.shape = sink.shape if sink is not None else param.shape
        n = self.shape.numel()
        self.param = param
        self.group = group
        self.where = where  # "host" (CPU kernel), "streamed" (host state, device kernel) or "resident" (device both)
        if where == "resident":
            self.master, self.exp_avg, self.exp_avg_sq = (
                torch.empty(n, dtype=torch.float32, device=param.device) for _ in range(3))
        else:
            self.master = arena.empty([n], torch.float32)
            self.exp_avg = arena.empty([n], moments)  # bfloat16: stochastically rounded (ops.adamw_step_sr_)
            self.exp_avg_sq = arena.empty([n], moments)
        self.seed = seed  # of the stochastic rounding: the slot's place in the user's parameter order
        self.step = torch.tensor(0.0, dtype=torch.float32)  # as torch's non-fused, non-capturable Adam keeps it
        self.sink = sink
        # the H2D source in the device dtype; an fp32 parameter is copied straight from the master. A device-stepped
        # parameter is written on the device.
        self.out = arena.empty([n], param.dtype) if sink is None and param.dtype != torch.float32 and \
            where == "host" else None
        self.last_h2d: Transfer | None = None  # the copy that may still read master / out
        self.ready = threading.Event()  # set once this step's new weight is written / its copy issued
        self.ready.set()
        self.unpublished = False  # staleness 1: master / out hold an update not yet copied to the device weight
        self.reset()

    def reset(self) -> None:
        self.exp_avg.zero_()
        self.exp_avg_sq.zero_()
        self.step.fill_(0.0)
        self.read_param()

    def read_param(self) -> None:
        """master <- the parameter's current value (from its sink when a pager owns it)."""
        self.wait_h2d()
        src = self.sink if self.sink is not None else self.param.detach()
        self.master.copy_(src.reshape(-1))
        self.unpublished = False

    def wait_h2d(self) -> None:
        if self.last_h2d is not None:
            self.last_h2d.synchronize()
            self.last_h2d = None

    def state_view(self) -> dict[str, torch.Tensor]:
        """The entry torch.optim.AdamW would have in ``state`` (views, not copies), plus the master."""
        shape = self.shape
        st = {"step": self.step, "exp_avg": self.exp_avg.view(shape), "exp_avg_sq": self.exp_avg_sq.view(shape)}
        if self.param.dtype != torch.float32:
            st["master"] = self.master.view(shape)
        return st


def _hyper(optimizer_cls: type, group: dict) -> dict:
    """The group's hyper-parameters as the CPU kernel takes them, validated."""
    for flag in _UNSUPPORTED_FLAGS:
        if group.get(flag, False):
            raise ValueError(f"OffloadedAdamW supports Adam/AdamW with {flag}=False only, got {flag}=True")
    beta1, beta2 = (float(b) for b in group["betas"])
    decoupled = optimizer_cls is torch.optim.AdamW or bool(group.get("decoupled_weight_decay", False))
    return {"lr": float(group["lr"]), "beta1": beta1, "beta2": beta2, "eps": float(group["eps"]),
            "weight_decay": float(group["weight_decay"]), "maximize": bool(group.get("maximize", False)),
            "decoupled": decoupled}


class OffloadedAdamW(torch.optim.Optimizer):
    """Adam/AdamW whose offloaded parameters keep fp32 master weights and moments in host memory.

    Args:
        optimizer: the user's ``torch.optim.AdamW`` or ``torch.optim.Adam`` (Adam's ``weight_decay`` is an
            L2 term added to the gradient, as torch does; ``decoupled_weight_decay=True`` makes it AdamW).
            Its param-group dicts are shared, not copied; use this object, not ``optimizer``, from now on.
        offload: parameters to update on the host; every other parameter of ``optimizer`` is updated on
            its device by an internal optimizer of the same class and settings (foreach/fused included).
        arena: host arena for master weights, moments and gradient buffers.
        streams: transfer streams of the compute device (``cpu`` runs everything synchronously).
        grads: ``"device"`` (``p.grad`` stays on the device, copied at step time) or ``"host"`` (moved to
            the host during backward, freeing device memory; clip with :meth:`clip_grad_norm_`).
        param_sink: for parameters paged from host by the weight pager: a host tensor of the parameter's
            dtype and numel that receives the updated weight instead of ``p.data``, which is never touched.
        grad_staging_slots: host mode: staging ring size for accumulated gradients (see ``grads.py``).
        overlap_step: ``step()`` returns once the gradients' copies and the device optimizer are queued;
            a background thread runs the CPU updates in parameter order while the next forward starts. The
            consumer must call :meth:`wait_for` before a parameter is used (``wrap`` installs hooks that do)
            and :meth:`synchronize` before reading weights on the host. Not with ``param_sink`` (a pager
            would copy a sink before the thread writes it).
        optimizer_in_backward: needs ``grads="host"`` and ``overlap_step``, not ``param_sink``. The hook that
            moves an offloaded parameter's gradient to the host also queues its update on the worker thread (with
            the group's hyper-parameters at that moment: a scheduler steps after ``step()``, so they are this
            step's), which waits for the copy; ``step()`` then steps the device parameters and queues the
            bookkeeping. The same numbers as without it, but the gradients are consumed in backward, so: no
            clipping or reading them (:meth:`clip_grad_norm_` and :meth:`host_grads` raise), no gradient
            accumulation (a second gradient before ``step()`` raises), no skipped steps (``zero_grad()`` after a
            backward without ``step()`` raises: its updates are applied), and an offloaded parameter's value is
            undefined between its gradient and the next forward (which waits for it, as with ``overlap_step``).
            Resident and streamed parameters start their device update from the same hook, on the device share's
            own streams, while backward goes on.
        resident: offloaded parameters whose fp32 master and moments live on the device and are stepped there
            (``engine/device_adamw.py``): no PCIe traffic and no CPU time, 12 bytes of device memory each.
        streamed: offloaded parameters whose state stays in the arena but is stepped on the device, copied over in
            chunks and back at ``step()`` (12 bytes each way per element, no CPU time). Resident and streamed
            parameters keep their gradients on the device (``p.grad``, in either ``grads`` mode), need no sink, and
            get the same bits as if the CPU had stepped them (the same op's CUDA kernel).
        device_chunk_numel: elements per streamed chunk (the device ring holds 3 chunks of 12 bytes an element).
        moments: ``"float32"`` (exact AdamW) or ``"bfloat16"``: the CPU share's moments stored in bf16 by stochastic
            rounding (:func:`trainstream_hf.ops.adamw_step_sr_`), 4 bytes per parameter instead of 8 in host RAM; an
            approximation, opt-in. Not with resident or streamed parameters (the device kernel takes float32).
        staleness: ``0`` (exact) or ``1``: the CPU share's update from the gradients of step N runs on the worker
            during step N+1's forwards and backwards and is copied into the device weights at step N+1's ``step()``;
            so those forwards use weights one update behind (ZeRO-Offload's delayed parameter update), and the CPU
            AdamW leaves the critical path when a step's forwards and backwards take longer than it. The masters and
            moments follow exact AdamW over the gradients each step delivers; resident and streamed parameters are
            not delayed. An opt-in approximation; needs ``grads="device"``, not ``optimizer_in_backward`` or
            ``param_sink``. The model's ``state_dict`` and :meth:`release` publish the pending update first
            (:meth:`publish`), so a saved model holds the masters.
        grads_fit_forward: device gradients: the device has room for every gradient beside the next forward's
            activations (a plan for gradient accumulation counts them there), so ``step()`` does not wait for their
            copies to the host before it returns; the CPU share waits for each copy itself.

    Raises:
        TypeError: ``optimizer`` is not exactly ``torch.optim.AdamW`` or ``torch.optim.Adam``.
        ValueError: amsgrad, capturable or differentiable is set; an offloaded parameter is not in
            ``optimizer``, does not require grad, is not floating point, or lives on another device; a sink
            does not match its parameter; ``optimizer_in_backward`` without its requirements.

    A step validates every input before it changes anything. If the native kernel itself fails midway (a
    bug, not bad input), the parameters before the failing one are already updated; the error says which.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, offload: Iterable[nn.Parameter], *, arena: HostArena,
                 streams: TransferStreams, grads: str = "device",
                 param_sink: dict[nn.Parameter, torch.Tensor] | None = None, grad_staging_slots: int = 4,
                 overlap_step: bool = False, optimizer_in_backward: bool = False,
                 resident: Iterable[nn.Parameter] = (), streamed: Iterable[nn.Parameter] = (),
                 device_chunk_numel: int = DEFAULT_CHUNK_NUMEL, moments: str = "float32", staleness: int = 0,
                 grads_fit_forward: bool = False):
        if type(optimizer) not in OFFLOADABLE:
            raise TypeError(f"OffloadedAdamW wraps torch.optim.AdamW or torch.optim.Adam (exactly), got "
                            f"{type(optimizer).__module__}.{type(optimizer).__qualname__}")
        if grads not in GRAD_MODES:
            raise ValueError(f"grads must be one of {GRAD_MODES}, got {grads!r}")
        if optimizer_in_backward:
            if param_sink:
                raise ValueError("optimizer_in_backward cannot be combined with param_sink (trainable paged weights): "
                                 "the pager copies a sink ahead of use, before an update in backward would have "
                                 "written it; do not page trainable weights (page_weights=False, or a larger "
                                 "vram_budget) or turn optimizer_in_backward off")
            if grads != "host" or not overlap_step:
                raise ValueError(f"optimizer_in_backward needs grads='host' and overlap_step=True (the update starts "
                                 f"from the gradient hook of backward, on the step's worker thread), got "
                                 f"grads={grads!r}, overlap_step={overlap_step!r}")
        if isinstance(staleness, bool) or staleness not in (0, 1):
            raise ValueError(f"staleness: 0 (exact AdamW) or 1 (the CPU share's update applied one step late), got "
                             f"{staleness!r}")
        if staleness:
            clash = [what for what, bad in (("optimizer_in_backward", optimizer_in_backward),
                                            ("param_sink (paged trainable weights)", bool(param_sink)),
                                            (f"grads={grads!r}", grads != "device")) if bad]
            if clash:
                raise ValueError(f"staleness=1 keeps each step's gradients on the device until step() and updates "
                                 f"during the next step's forwards; it cannot be combined with {', '.join(clash)}: use "
                                 "grads='device', no paged trainable weights and optimizer_in_backward=False, or "
                                 "staleness=0")
        for g in optimizer.param_groups:
            _hyper(type(optimizer), g)
        self._cls = type(optimizer)
        self._user_optimizer = optimizer
        self._ready = False
        # same dicts, so a scheduler writing group["lr"] here is seen by both; torch's add_param_group keeps
        # the dict objects and only re-lists group["params"] with the same tensors
        super().__init__(optimizer.param_groups, optimizer.defaults)

        params = [p for g in self.param_groups for p in g["params"]]
        group_of = {p: i for i, g in enumerate(self.param_groups) for p in g["params"]}
        offload = list(dict.fromkeys(offload))
        sinks = dict(param_sink or {})
        self._check_offload(offload, group_of, sinks, streams)
        offloaded = set(offload)
        where = self._check_device_share(resident, streamed, offloaded, sinks)
        if moments not in _MOMENTS:
            raise ValueError(f"moments: 'float32' (exact AdamW) or 'bfloat16' (stochastically rounded, half the host "
                             f"bytes), got {moments!r}")
        if moments != "float32" and where:
            raise ValueError("moments='bfloat16' is for parameters stepped on the CPU; resident and streamed "
                             "parameters keep float32 moments (the device kernel): pass neither, or float32 moments")
        moment_dtype = _MOMENTS[moments]
        order = [p for p in params if p in offloaded]  # step order = the user's parameter order

        numel = {p: sinks[p].numel() if p in sinks else p.numel() for p in order}
        on_host = {p: n for p, n in numel.items() if where.get(p) != "resident"}
        on_cpu = {p: n for p, n in numel.items() if p not in where}  # stepped by the CPU kernel
        if arena.growable:  # pin everything now, in slabs, rather than block by block during the first step
            mb = moment_dtype.itemsize
            arena.reserve_for([k * n for n in on_host.values() for k in (4, mb, mb)]
                              + [n * p.element_size() for p, n in on_cpu.items()
                                 if p not in sinks and p.dtype != torch.float32]
                              + HostGradients.host_bytes_needed(on_cpu, grads, optimizer_in_backward))
        self.arena, self.streams, self.grads_mode = arena, streams, grads
        self._slots = {p: _Slot(p, group_of[p], arena, sinks.get(p), where.get(p, "host"), moment_dtype, seed=k + 1)
                       for k, p in enumerate(order)}
        self.moments = moments
        # the CPU share (its own gradients, hooks and worker) and the device share, each in the user's order for now
        self._host_slots = {p: s for p, s in self._slots.items() if s.where == "host"}
        self._device_slots = [s for s in self._slots.values() if s.where != "host"]
        self._device_steps = DeviceSteps(streams.device, chunk_numel=device_chunk_numel) \
            if self._device_slots else None
        self._scratch: torch.Tensor | None = None  # fp32 work buffer for fp16 grads and Adam's L2 term
        self._device_opt, self._device_groups = self._build_device_optimizer(
            [p for p in params if p not in offloaded])
        if overlap_step and sinks:
            raise ValueError("overlap_step cannot be combined with param_sink: paged weights are copied from "
                             "their sinks ahead of use, before an overlapped update would have written them")
        self.overlap_step = bool(overlap_step)
        # On the worker, the update runs while the Python thread launches the GPU's kernels: leave that thread a
        # core. H200 host, 16 cores, 3B full FT in backward: 16 threads 0.826 s of Adam and 1.01 s per step, 15
        # threads 0.712 s and 0.847 s (OMP_NUM_THREADS, two processes of one call, benchmarks/NOTES.md).
        self._adam_threads = max(1, torch.get_num_threads() - 1) if self.overlap_step else 0
        self.optimizer_in_backward = bool(optimizer_in_backward)
        self.staleness = int(staleness)
        self.grads_fit_forward = bool(grads_fit_forward)
        self._published = False  # staleness 1: H2D copies of delayed updates issued (the forwards wait for them)
        self._in_backward: dict[nn.Parameter, None] = {}  # parameters whose update was queued since the last step
        self._in_backward_error: tuple[int, BaseException] | None = None
        self._step_order: list[_Slot] | None = None  # of the CPU share
        self._device_live = False  # device-share updates issued that the next forward has not waited for yet
        self._device_mark = (0, 0)  # the device share's byte counters at the end of the last step
        self._rank: dict[int, int] = {}  # id(slot) -> its place in the step order (in-backward priority)
        # Updates queued in backward, most urgent first: (rank, arrival, slot, hyper, compute_done). One worker
        # task per entry; each task pops the most urgent one, not its own.
        self._urgent: list = []
        self._urgent_lock = threading.Lock()
        self._arrival = itertools.count()
        self._worker: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._released = False
        self._steps = 0
        self._h2d_bytes = self._d2h_mark = 0
        self._adam_seconds = 0.0
        self._last_stats: dict = {}
        for p, st in optimizer.state.items():  # a partly trained optimizer keeps its state
            if p in offloaded and st:
                self._load_slot(self._slots[p], st)
            elif st and self._device_opt is not None:
                self._device_opt.state[p] = st
        # last: it registers the host-mode hooks, which must not outlive a constructor that failed
        self._grads = HostGradients(list(self._host_slots), arena=arena, streams=streams, mode=grads,
                                    staging_slots=grad_staging_slots, shapes={p: s.shape for p, s in sinks.items()},
                                    single_term=self.optimizer_in_backward,
                                    hook=self._grad_in_backward if self.optimizer_in_backward else None)
        self._grads.before_read = self._grads_readable
        self._device_hooks = [s.param.register_post_accumulate_grad_hook(_weak_hook(self._device_grad_in_backward))
                              for s in self._device_slots] if self.optimizer_in_backward else []
        self._sync_state()
        self._ready = True

    # -- construction ---------------------------------------------------------------------------
    @staticmethod
    def _check_offload(offload, group_of, sinks, streams) -> None:
        for p in offload:
            if p not in group_of:
                raise ValueError("every parameter in `offload` must be in the optimizer's param_groups; "
                                 f"got one of shape {tuple(p.shape)} that is not")
            if not p.requires_grad or p.dtype not in _FLOAT_DTYPES:
                raise ValueError("offloaded parameters must require grad and be float32/bfloat16/float16, got "
                                 f"requires_grad={p.requires_grad} dtype={p.dtype}")
            if p not in sinks and (p.device != streams.device or not p.is_contiguous()):
                raise ValueError(f"an offloaded parameter without a sink must be contiguous and on the "
                                 f"streams' device {streams.device}, got one on {p.device}")
        offloaded = set(offload)
        for p, s in sinks.items():
            if p not in offloaded:
                raise ValueError("param_sink keys must be offloaded parameters")
            # numel 0: the pager has already swapped in its empty placeholder
            if s.device.type != "cpu" or s.dtype != p.dtype or p.numel() not in (0, s.numel()):
                raise ValueError(f"param_sink: a sink must be a host tensor of its parameter's dtype {p.dtype} "
                                 f"and numel {p.numel()}, got {s.dtype} numel {s.numel()} on {s.device}")

    @staticmethod
    def _check_device_share(resident, streamed, offloaded, sinks) -> dict[nn.Parameter, str]:
        """{parameter: "resident" | "streamed"} of the device share, checked."""
        where: dict[nn.Parameter, str] = {}
        for kind, ps in (("resident", resident), ("streamed", streamed)):
            for p in ps:
                if p not in offloaded:
                    raise ValueError(f"{kind} parameters must be offloaded ones (in `offload`); got one of shape "
                                     f"{tuple(p.shape)} that is not")
                if p in sinks:
                    raise ValueError(f"a {kind} parameter cannot have a param_sink: its weight must live on the "
                                     "device, where its update writes it")
                if where.setdefault(p, kind) != kind:
                    raise ValueError(f"a parameter of shape {tuple(p.shape)} is both resident and streamed; "
                                     "choose one")
        return where

    def _build_device_optimizer(self, params: list[nn.Parameter]):
        if not params:
            return None, []
        keep = set(params)
        pairs = [(g, [p for p in g["params"] if p in keep]) for g in self.param_groups]
        pairs = [(g, ps) for g, ps in pairs if ps]
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": ps} for g, ps in pairs]
        # the constructor arguments decide fused/foreach validation and AMP support, so pass them through
        sig = inspect.signature(self._cls.__init__).parameters
        kwargs = {k: v for k, v in self.defaults.items() if k in sig and k != "params"}
        opt = self._cls(groups, **kwargs)
        return opt, [(g, dg) for (g, _), dg in zip(pairs, opt.param_groups)]

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_ready", False):
            raise NotImplementedError("OffloadedAdamW: add every param group to the optimizer before wrapping")
        super().add_param_group(param_group)

    def _sync_state(self) -> None:
        """Points ``self.state`` at the live state: slot views and the device optimizer's entries."""
        self.state.clear()
        for p in (q for g in self.param_groups for q in g["params"]):
            if p in self._slots:
                if self._slots[p].step.item() > 0:
                    self.state[p] = self._slots[p].state_view()
            elif self._device_opt is not None and self._device_opt.state.get(p):
                self.state[p] = self._device_opt.state[p]

    # -- the step -------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """Updates every parameter that has a gradient, as torch.optim.AdamW/Adam would.

        Returns:
            The closure's loss, if a closure was given.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._released:
            raise RuntimeError("OffloadedAdamW.step() after release()")
        # An LR scheduler built on the user's optimizer before wrapping watches *its* step() (torch marks
        # `_opt_called`); this step stands for it.
        self._user_optimizer._opt_called = True
        self.synchronize()  # an overlapped previous step must be complete (and its error raised)
        hyper = [_hyper(self._cls, g) for g in self.param_groups]
        self._grads.check_device_grads()  # nothing below runs on bad input
        device_work = [(slot, device_grad(slot.param), hyper[slot.group]) for slot in self._device_slots
                       if slot.param not in self._in_backward]  # (optimizer_in_backward: stepped from its hook)
        for slot, grad, _ in device_work:
            DeviceSteps.check(slot, grad)
        t_step = time.perf_counter()
        if self.optimizer_in_backward:
            self._step_in_backward(t_step, device_work)
            return loss
        self._h2d_bytes, self._adam_seconds = 0, 0.0
        cuda = self.streams.is_cuda
        compute_done = sink_free = None
        if cuda:
            # every forward/backward read of p.data is queued before this event; H2D writes go after it
            compute_done = torch.cuda.current_stream(self.streams.device).record_event()
            if any(s.sink is not None for s in self._slots.values()):
                # a pager prefetch may still read a sink; our host writes must not race it
                sink_free = self.streams.h2d.record_event()
        if self.staleness:
            self._publish(compute_done)  # the previous step's update, before this one overwrites its buffers
        self._grads.collect()  # all D2H copies are in flight before the first is waited on
        if cuda and self.overlap_step and self.grads_mode == "device" and not self.grads_fit_forward:
            # The next forward must not start allocating while every device gradient is still held for its copy
            # (they would sit beside its activations: measured out of memory on the H200). Wait for the copies;
            # 'host' gradients avoid this wait by leaving during backward, and a plan for gradient accumulation
            # has room for them beside a forward (each later micro-batch's).
            self.streams.d2h.synchronize()
        self._step_device()
        self._step_device_share(device_work, compute_done)
        if self.overlap_step:
            for slot in self._host_slots.values():
                slot.ready.clear()
            self._pending = self._executor().submit(self._host_steps, hyper, compute_done, sink_free, t_step)
        else:
            self._host_steps(hyper, compute_done, sink_free, t_step)
        return loss

    def _step_device(self) -> None:
        if self._device_opt is not None:
            for g, dg in self._device_groups:
                dg.update({k: v for k, v in g.items() if k != "params"})
            self._device_opt.step()

    def _step_device_share(self, work, compute_done) -> None:
        """Issues the resident and streamed updates (in the step order): on the device's own streams, after
        ``compute_done``; the next forward waits for each weight (:meth:`wait_for`), or for all of them at once
        (a step that does not overlap)."""
        if self._device_steps is None:
            return
        self._device_steps.step(work, compute_done)
        if self.overlap_step:
            self._device_live = True
        else:
            self._device_steps.wait_all()

    def _executor(self) -> ThreadPoolExecutor:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="trainstream-adamw")
        return self._worker

    def _host_steps(self, hyper, compute_done, sink_free, t_step) -> None:
        """The CPU updates of every offloaded parameter, in order (inline, or on the worker thread)."""
        cuda = self.streams.is_cuda
        done = 0
        try:
            for done, slot in enumerate(self._step_order or self._host_slots.values()):
                grad = self._grads.take(slot.param)
                if grad is not None:  # torch skips a parameter without a gradient, step count included
                    if sink_free is not None and slot.sink is not None:
                        sink_free.synchronize()
                        sink_free = None
                    self._step_slot(slot, grad, hyper[slot.group], compute_done)
                slot.ready.set()
            done = len(self._host_slots)
        except Exception as e:
            raise RuntimeError(f"OffloadedAdamW.step failed on offloaded parameter {done} of {len(self._host_slots)} "
                               "stepped on the CPU; "
                               "the offloaded parameters before it and the device parameters were already "
                               "updated") from e
        finally:
            for slot in self._host_slots.values():
                slot.ready.set()  # waiters must not hang on an error; synchronize() re-raises it
            if cuda and not self.overlap_step:
                # the next forward reads the new weights: order it after the copies, without a host sync
                torch.cuda.current_stream(self.streams.device).wait_stream(self.streams.h2d)
            self._end_step(t_step)

    def _end_step(self, t_step: float) -> None:
        """Step bookkeeping once every host update of the step is done: gradients consumed, counters, state."""
        self._grads.consume()
        self._steps += 1
        dev = self._device_steps
        dev_h2d, dev_d2h = (dev.h2d_bytes - self._device_mark[0], dev.d2h_bytes - self._device_mark[1]) \
            if dev is not None else (0, 0)
        if dev is not None:
            self._device_mark = (dev.h2d_bytes, dev.d2h_bytes)
        self._last_stats = {
            # host mode copies during backward, so count from the end of the previous step
            "step": self._steps, "d2h_bytes": self._grads.d2h_bytes - self._d2h_mark + dev_d2h,
            "h2d_bytes": self._h2d_bytes + dev_h2d, "adam_seconds": self._adam_seconds,
            "step_seconds": time.perf_counter() - t_step}
        self._d2h_mark = self._grads.d2h_bytes
        self._h2d_bytes, self._adam_seconds = 0, 0.0  # (in backward, the next step's updates count from here)
        self._sync_state()

    # -- optimizer in backward ------------------------------------------------------------------
    def _grad_in_backward(self, p: nn.Parameter) -> None:
        """The post-accumulate-grad hook with ``optimizer_in_backward``: issues the gradient's copy to the host and
        queues the parameter's update on the worker thread; never waits for either (it runs on the thread that
        launches backward's kernels)."""
        if self._pending is not None:
            # the previous step's bookkeeping (and its updates) still owns the gradient buffers; wrap's hook at the
            # end of every forward has normally waited for it already
            self.synchronize()
        self._refuse_second_gradient(p)
        slot = self._slots[p]
        h = _hyper(self._cls, self.param_groups[slot.group])  # this step's lr: schedulers step after step()
        self._grads.add(p)
        compute_done = None
        if self.streams.is_cuda:
            # autograd has run every node that reads p (its gradient is complete), but their kernels are only
            # queued: the new weight's H2D copy must come after them
            compute_done = torch.cuda.current_stream(self.streams.device).record_event()
        self._in_backward[p] = None
        slot.ready.clear()
        with self._urgent_lock:
            heapq.heappush(self._urgent, (self._rank.get(id(slot), len(self._rank)), next(self._arrival), slot, h,
                                          compute_done))
        self._executor().submit(self._update_most_urgent)

    def _refuse_second_gradient(self, p: nn.Parameter) -> None:
        if p in self._in_backward:
            raise RuntimeError("OffloadedAdamW(optimizer_in_backward=True): an offloaded parameter received a second "
                               "gradient before optimizer.step() (gradient accumulation, or a second backward). Its "
                               "update was already applied from the first one in backward; accumulation needs "
                               "optimizer_in_backward=False")

    def _device_grad_in_backward(self, p: nn.Parameter) -> None:
        """The post-accumulate-grad hook of a resident or streamed parameter with ``optimizer_in_backward``: queues its
        device update on the device share's streams behind the kernels backward has queued so far (its gradient is
        complete); the host never waits."""
        self._refuse_second_gradient(p)
        slot = self._slots[p]
        grad = device_grad(p)
        DeviceSteps.check(slot, grad)
        h = _hyper(self._cls, self.param_groups[slot.group])  # this step's lr: schedulers step after step()
        compute_done = torch.cuda.current_stream(self.streams.device).record_event() if self.streams.is_cuda \
            else None
        self._in_backward[p] = None
        self._device_steps.step([(slot, grad, h)], compute_done)
        self._device_live = True

    def _update_most_urgent(self) -> None:
        """A worker task of backward: updates the queued parameter the next forward needs first (lowest place in the
        step order), not the oldest. Backward delivers block 0's gradients last while the CPU AdamW lags behind it
        (3B full FT on the H200: Adam 0.82 s against ~0.2 s of backward), so in arrival order the next forward waits
        for every update; in step order it starts once the embedding and block 0 are done and then follows the
        updates block by block. Each parameter's arithmetic is the same in any order."""
        with self._urgent_lock:
            _, _, slot, h, compute_done = heapq.heappop(self._urgent)
        self._update_in_backward(slot, h, compute_done)

    def _update_in_backward(self, slot: _Slot, h: dict, compute_done) -> None:
        """One parameter's update, on the worker: waits for its gradient's copy, steps it, issues its H2D copy."""
        try:
            if self._in_backward_error is None:  # after a failure, the step stops as the ordinary one does
                grad = self._grads.take(slot.param)
                if grad is not None:
                    self._step_slot(slot, grad, h, compute_done)
        except Exception as e:
            self._in_backward_error = (next(i for i, q in enumerate(self._slots) if q is slot.param), e)
        finally:
            slot.ready.set()

    def _step_in_backward(self, t_step: float, device_work) -> None:
        for p in self._host_slots:  # gradients that did not come through the hook (assigned by hand): none normally
            if device_grad(p) is not None:
                self._grad_in_backward(p)
        self._in_backward = {}
        self._step_device()
        compute_done = torch.cuda.current_stream(self.streams.device).record_event() if self.streams.is_cuda \
            else None
        self._step_device_share(device_work, compute_done)
        # behind every update queued in backward (one worker, first in first out)
        self._pending = self._executor().submit(self._finish_in_backward, t_step)

    def _finish_in_backward(self, t_step: float) -> None:
        error, self._in_backward_error = self._in_backward_error, None
        try:
            if error is not None:
                raise RuntimeError(f"OffloadedAdamW (optimizer_in_backward) failed on offloaded parameter {error[0]} "
                                   f"of {len(self._slots)}; the offloaded parameters whose update ran before it in "
                                   "backward and the device parameters were already updated") from error[1]
        finally:
            self._end_step(t_step)

    def _drain(self) -> None:
        """Waits for every queued host update, those of a backward not yet stepped included (``synchronize`` waits
        only for a stepped one), before the host state is read or written."""
        if self._worker is not None:
            self._worker.submit(lambda: None).result()
        self.synchronize()
        if self._device_steps is not None:  # the device share's writes, host state included
            self._device_steps.synchronize()

    # -- overlapped steps -------------------------------------------------------------------------
    def set_step_order(self, params: Iterable[nn.Parameter]) -> None:
        """Updates offloaded parameters in this order (the order the next forward uses them), so that an
        overlapped step has block 0 ready first. Parameters not listed follow in their own order."""
        listed = [self._slots[p] for p in dict.fromkeys(params) if p in self._slots]
        seen = {id(s) for s in listed}
        order = listed + [s for s in self._slots.values() if id(s) not in seen]
        self._step_order = [s for s in order if s.where == "host"]
        self._device_slots = [s for s in order if s.where != "host"]
        self._rank = {id(s): k for k, s in enumerate(self._step_order)}

    def wait_for(self, params: Iterable[nn.Parameter]) -> None:
        """Makes the current stream wait for the new values of ``params`` (offloaded ones; others are
        ignored). Blocks the host only until the worker has issued their copies, never for the copies."""
        if self.staleness:
            if not (self._published or self._device_live):
                return
        elif self._pending is None and not self._in_backward and not self._device_live:
            return
        for p in params:
            slot = self._slots.get(p)
            if slot is None:
                continue
            if not self.staleness:  # (delayed: the running update writes host buffers only; its copies are waited)
                slot.ready.wait()
            h2d = slot.last_h2d
            if h2d is not None and h2d.event is not None:
                torch.cuda.current_stream(self.streams.device).wait_event(h2d.event)
        if self._pending is not None and self._pending.done():
            self.synchronize()

    def synchronize(self) -> None:
        """Waits for an overlapped step to finish on the host and re-raises its error, if any. The next
        forward still needs :meth:`wait_for` (or a stream wait) for the device copies."""
        pending, self._pending = self._pending, None
        if self._device_live:  # (no host wait: the current stream waits for the device share's weights)
            self._device_live = False
            self._device_steps.wait_all()
        if pending is not None:
            pending.result()
            if self.streams.is_cuda:
                torch.cuda.current_stream(self.streams.device).wait_stream(self.streams.h2d)

    def forward_done(self) -> None:
        """The end of a training forward (wrap's hook): waits for an overlapped step, so backward never races its
        weight copies. With ``staleness=1`` the running update writes host buffers only, so it keeps running (its
        error, if any, is raised here once it has ended, or at the next ``step()``)."""
        if self.staleness and self._pending is not None and not self._pending.done():
            return
        self.synchronize()

    def publish(self) -> None:
        """``staleness=1``: waits for the pending update and copies it into the device weights now, so the model
        holds the masters (before saving or evaluating it); the current stream waits for the copies. Without
        staleness, :meth:`synchronize`."""
        self.synchronize()
        if self.staleness and any(s.unpublished for s in self._host_slots.values()):
            cuda = self.streams.is_cuda
            after = torch.cuda.current_stream(self.streams.device).record_event() if cuda else None
            self._publish(after)
            if cuda:
                torch.cuda.current_stream(self.streams.device).wait_stream(self.streams.h2d)

    def _publish(self, compute_done) -> None:
        """Issues the H2D copy of each delayed update into its device weight, after ``compute_done`` (every read of
        the old weights), in the step order; each slot's next update waits for its copy before it writes."""
        for slot in self._step_order or self._host_slots.values():
            if not slot.unpublished:
                continue
            p = slot.param
            src = slot.master if slot.out is None else slot.out
            self._h2d_bytes += src.numel() * src.element_size()
            slot.last_h2d = self.streams.to_device(src.view(p.shape), out=p.data, after=compute_done)
            slot.unpublished = False
            self._published = True
        if self._published and self.streams.is_cuda and not self.overlap_step:
            torch.cuda.current_stream(self.streams.device).wait_stream(self.streams.h2d)

    def _step_slot(self, slot: _Slot, grad: torch.Tensor, h: dict, compute_done) -> None:
        p, n = slot.param, slot.master.numel()
        wd = h["weight_decay"]
        l2 = wd != 0 and not h["decoupled"]
        if grad.dtype == torch.float16 or (l2 and grad.dtype != torch.float32):
            if self._scratch is None or self._scratch.numel() < n:
                self._scratch = self.arena.empty([max(s.master.numel() for s in self._host_slots.values())])
            grad = self._scratch[:n].copy_(grad)
        slot.wait_h2d()  # the previous step's H2D copy may still read master / out
        if l2:
            # torch's Adam: g = (maximize ? -grad : grad) + wd * p; the kernel negates after, so subtract
            grad.add_(slot.master, alpha=-wd if h["maximize"] else wd)
        slot.step += 1
        bf16_out = None
        if p.dtype == torch.bfloat16:
            target = slot.sink if slot.sink is not None else slot.out
            if target.is_contiguous():
                bf16_out = target.view(-1)
        t0 = time.perf_counter()
        kw = dict(lr=h["lr"], beta1=h["beta1"], beta2=h["beta2"], eps=h["eps"],
                  weight_decay=wd if h["decoupled"] else 0.0, step=int(slot.step.item()), maximize=h["maximize"],
                  param_bf16=bf16_out, num_threads=self._adam_threads)
        if slot.exp_avg.dtype == torch.bfloat16:
            ops.adamw_step_sr_(slot.master, slot.exp_avg, slot.exp_avg_sq, grad, seed=slot.seed, **kw)
        else:
            ops.adamw_step_(slot.master, slot.exp_avg, slot.exp_avg_sq, grad, **kw)
        self._adam_seconds += time.perf_counter() - t0
        if slot.sink is not None:
            if bf16_out is None:
                slot.sink.copy_(slot.master.view(slot.sink.shape))
            return
        if p.dtype == torch.float16:
            slot.out.copy_(slot.master)
        if self.staleness:  # copied into p.data at the next step() (_publish)
            slot.unpublished = True
            return
        src = slot.master if slot.out is None else slot.out
        self._h2d_bytes += src.numel() * src.element_size()
        slot.last_h2d = self.streams.to_device(src.view(p.shape), out=p.data, after=compute_done)

    # -- gradients ------------------------------------------------------------------------------
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """Clips the gradients of all parameters, on the device and on the host, by their total norm.

        The maths is ``torch.nn.utils.clip_grad_norm_``'s: total = norm of the per-tensor norms,
        coef = clamp(max_norm / (total + 1e-6), max=1), every gradient multiplied by coef. Works in both
        gradient modes; in host mode it is the only way to clip (``p.grad`` is None there).

        Returns:
            The total norm before clipping, on the device of the first gradient.

        Raises:
            RuntimeError: with ``optimizer_in_backward``: the updates were made in backward, before any norm.
        """
        self._refuse_in_backward("clip_grad_norm_", "clip the gradients")
        self.synchronize()
        host = self._grads.host_grads()
        tensors = [host[p] if p in host else device_grad(p) for g in self.param_groups for p in g["params"]
                   if p in host or device_grad(p) is not None]
        total = torch.nn.utils.get_total_norm(tensors, norm_type, error_if_nonfinite, foreach)
        if not tensors:
            return total
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        by_device: dict = defaultdict(list)
        for t in tensors:
            by_device[(t.device, t.dtype)].append(t)
        for (device, _), ts in by_device.items():
            torch._foreach_mul_(ts, coef.to(device))
        return total

    def host_grads(self) -> dict[nn.Parameter, torch.Tensor]:
        """Host gradients of offloaded parameters, in host mode (fp32 views shaped like each parameter;
        scale them in place to change what the step applies). Device mode: empty, see ``p.grad``."""
        self._refuse_in_backward("host_grads", "read the gradients")
        return {p: g.view(self._slots[p].shape) for p, g in self._grads.host_grads().items()}

    clip_grad_norm = clip_grad_norm_  # the name some trainers look for on the optimizer

    def _grads_readable(self) -> bool:
        """Whether host gradients may be shown through ``p.grad`` now (:class:`HostGradParameter`): not while an
        overlapped step owns them (they are None then, as consumed); an error between a backward and ``step()``
        with ``optimizer_in_backward``, whose updates already consumed them (a clip would silently see none)."""
        if self._in_backward:
            raise RuntimeError("p.grad of an offloaded parameter: with optimizer_in_backward=True its gradient was "
                               "consumed by its update during backward, so it cannot be read or clipped; turn "
                               "optimizer_in_backward off to clip (or set max_grad_norm=0 / do not clip)")
        return self._pending is None

    def _refuse_in_backward(self, what: str, to: str) -> None:
        if self.optimizer_in_backward:
            raise RuntimeError(f"OffloadedAdamW.{what}: with optimizer_in_backward=True each offloaded gradient is "
                               f"consumed by its parameter's update during backward, before it could be used; to {to}, "
                               "turn optimizer_in_backward off")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Resets device gradients as torch does and marks host gradients empty.

        Does not wait for an overlapped step (the usual ``step(); zero_grad()`` must not block): its
        gradients were copied before ``step()`` returned, and it consumes them itself when done.

        Raises:
            RuntimeError: with ``optimizer_in_backward``, after a backward whose updates are already applied but
                not stepped: they cannot be discarded. Nothing changes; ``step()`` still completes the step.
        """
        if self._in_backward:
            raise RuntimeError(f"OffloadedAdamW.zero_grad() after a backward without step(): with "
                               f"optimizer_in_backward=True the updates of its {len(self._in_backward)} offloaded "
                               "parameter(s) were already applied during backward and cannot be discarded. Call "
                               "step() to complete the step, or turn optimizer_in_backward off to drop a backward "
                               "(e.g. to skip a step on a non-finite loss)")
        super().zero_grad(set_to_none)
        if self._pending is None:
            self._grads.consume()

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """torch.optim.AdamW's layout: ``state`` keyed by parameter index ('step', 'exp_avg',
        'exp_avg_sq'), plus 'master' (fp32) for offloaded parameters whose device dtype is not fp32.

        Offloaded entries are CPU views of the live host state, as torch returns live tensors.
        """
        self._drain()
        self._sync_state()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a state dict of this class or of torch.optim.AdamW/Adam over the same parameters.

        Group hyper-parameters are updated in the shared group dicts (they stay the same objects). An
        offloaded parameter without 'master' takes its master weight from its current value, so load the
        model weights first.

        Raises:
            ValueError: the groups differ in number or size, a hyper-parameter is unsupported, or an entry of
                ``state`` does not fit its parameter (a moment or master of another shape, a step that is not a
                non-negative scalar, a missing key); the message names the parameter (see
                :meth:`set_param_names`) and both shapes. Everything is checked before anything is written, so
                on error the optimizer is exactly as it was.
        """
        self._drain()
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
            got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(f"OffloadedAdamW.load_state_dict: expected an optimizer state dict (keys 'state' and "
                             f"'param_groups'), got {got}; pass optimizer.state_dict(), not the model's")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
                len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups)):
            raise ValueError("OffloadedAdamW.load_state_dict: the state dict has param groups of sizes "
                             f"{[len(s['params']) for s in saved_groups]}, this optimizer "
                             f"{[len(g['params']) for g in self.param_groups]}; load one saved for this model and "
                             "optimizer (same parameters, same groups)")
        for s, g in zip(saved_groups, self.param_groups):
            _hyper(self._cls, {**g, **s})  # validate before anything changes
        index = {i: p for s, g in zip(saved_groups, self.param_groups) for i, p in zip(s["params"], g["params"])}
        # An absent or empty entry: a parameter not stepped yet (its state starts afresh).
        saved = {i: st for i, st in state_dict["state"].items() if not (st is None or isinstance(st, dict) and not st)}
        for i, p in index.items():
            if i in saved:
                self._check_entry(i, p, saved[i])
        # Nothing below raises on input that passed the checks above.
        for s, g in zip(saved_groups, self.param_groups):
            g.update({k: v for k, v in s.items() if k != "params"})
        for i, p in index.items():
            if p in self._slots:
                if i in saved:
                    self._load_slot(self._slots[p], saved[i], index=i)
                else:
                    self._slots[p].reset()
        if self._device_opt is not None:
            dev_index = {p: j for j, p in enumerate(q for g in self._device_opt.param_groups for q in g["params"])}
            dev_groups = []
            for g, dg in self._device_groups:
                dg.update({k: v for k, v in g.items() if k != "params"})
                dev_groups.append({**{k: v for k, v in dg.items() if k != "params"},
                                   "params": [dev_index[p] for p in dg["params"]]})
            self._device_opt.load_state_dict({
                "state": {dev_index[p]: st for i, p in index.items() if p in dev_index and (st := saved.get(i))},
                "param_groups": dev_groups})
            # torch's load_state_dict replaces the group dicts: pair ours with the new ones, or every later lr
            # (a scheduler's) would go to the old dicts and the device parameters would keep the loaded lr.
            self._device_groups = [(g, dg) for (g, _), dg in zip(self._device_groups, self._device_opt.param_groups)]
        self._sync_state()

    def set_param_names(self, named_parameters: Iterable[tuple[str, nn.Parameter]]) -> None:
        """Names the parameters in this optimizer's error messages (e.g. ``model.named_parameters()``).

        Without it, a parameter is named from its group's ``param_names`` (an optimizer built over
        ``model.named_parameters()``), else by its place, ``param_groups[g]['params'][k]``.
        """
        mine = {p for g in self.param_groups for p in g["params"]}
        self._param_names = {p: n for n, p in named_parameters if p in mine}

    def _label(self, p: nn.Parameter) -> str:
        name = getattr(self, "_param_names", {}).get(p)
        if name is not None:
            return f"parameter {name!r}"
        for g, group in enumerate(self.param_groups):
            for k, q in enumerate(group["params"]):
                if q is p:
                    names = group.get("param_names")
                    if isinstance(names, (list, tuple)) and len(names) == len(group["params"]):
                        return f"parameter {names[k]!r}"
                    return f"parameter param_groups[{g}]['params'][{k}]"
        return "a parameter"

    def _check_entry(self, index, p: nn.Parameter, st) -> None:
        """Raises a one-line ValueError unless ``st`` is an Adam state entry that fits ``p`` (shape of each moment
        and master, step a non-negative scalar); writes nothing.

        Shapes are compared exactly: ``copy_`` into the flat host buffers would broadcast a 1-element moment over
        the whole parameter, and torch's own ``load_state_dict`` takes any shape and fails at the next step.
        """
        slot = self._slots.get(p)
        # an offloaded parameter's data may be the pager's empty placeholder: its slot has the true shape
        shape = tuple(slot.shape) if slot is not None else tuple(p.shape)
        where = "OffloadedAdamW.load_state_dict: " + ("the optimizer's state" if index is None else f"state[{index!r}]")
        fix = "load a state dict saved for this model and optimizer (same parameters, same order)"
        if not isinstance(st, dict):
            raise ValueError(f"{where} for {self._label(p)} (shape {shape}) is a {type(st).__name__}, expected a "
                             f"dict with 'step', 'exp_avg' and 'exp_avg_sq'; {fix}")
        keys = ("exp_avg", "exp_avg_sq") + (("master",) if slot is not None and "master" in st else ())
        for key in ("step",) + keys[:2]:
            if key not in st:
                raise ValueError(f"{where} for {self._label(p)} (shape {shape}) has no {key!r} "
                                 f"(its keys: {', '.join(map(repr, st)) or 'none'}); {fix}")
        step = st["step"]
        if isinstance(step, torch.Tensor):
            ok = step.numel() == 1 and not step.is_complex() and step.dtype != torch.bool
            value = float(step.reshape(-1)[0]) if ok else None
        else:
            ok = isinstance(step, (int, float)) and not isinstance(step, bool)
            value = float(step) if ok else None
        if not ok or not 0 <= value < float("inf"):
            what = (f"a tensor of shape {tuple(step.shape)}" if isinstance(step, torch.Tensor) and not ok else
                    repr(value) if ok else repr(step))
            raise ValueError(f"{where}['step'] for {self._label(p)} is {what}, not a finite non-negative number (a "
                             f"one-element tensor or a float); {fix}")
        if slot is None and p.numel() == 0:
            return  # a frozen parameter paged to host: its placeholder has no shape to check against
        for key in keys:
            t = st[key]
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                got = f"a {t.dtype} tensor" if isinstance(t, torch.Tensor) else f"a {type(t).__name__}"
                raise ValueError(f"{where}[{key!r}] for {self._label(p)} is {got}, expected a floating-point tensor "
                                 f"of shape {shape}; {fix}")
            if tuple(t.shape) != shape:
                raise ValueError(f"{where}[{key!r}] for {self._label(p)} has shape {tuple(t.shape)}, the parameter "
                                 f"has shape {shape}; {fix}")

    def _load_slot(self, slot: _Slot, st: dict, index=None) -> None:
        self._check_entry(index, slot.param, st)  # before the first write: a bad entry changes nothing
        slot.wait_h2d()
        slot.exp_avg.copy_(st["exp_avg"].reshape(-1))
        slot.exp_avg_sq.copy_(st["exp_avg_sq"].reshape(-1))
        slot.step.fill_(float(st["step"]))
        if "master" in st:
            slot.master.copy_(st["master"].reshape(-1))
            slot.unpublished = False  # (a delayed update of the state replaced is dropped with it)
        else:
            slot.read_param()

    # -- weights --------------------------------------------------------------------------------
    def master_params(self) -> dict[nn.Parameter, torch.Tensor]:
        """The fp32 master weight of each offloaded parameter (a host view shaped like it; live)."""
        self._drain()
        return {p: s.master.view(s.shape) for p, s in self._slots.items()}

    @torch.no_grad()
    def load_master_from_params(self) -> None:
        """Re-reads every master weight from its parameter (or sink): call after loading model weights
        into an already-wrapped model, or the next step would write the old weights back."""
        self._drain()
        for s in self._slots.values():
            s.read_param()

    @torch.no_grad()
    def reload_masters(self, params: Iterable[nn.Parameter]) -> None:
        """:meth:`load_master_from_params` for ``params`` only (those not offloaded are ignored): after new values
        were written into some parameters or their sinks (a pager's ``load_state_dict``)."""
        self._drain()
        for p in params:
            slot = self._slots.get(p)
            if slot is not None:
                slot.read_param()

    @torch.no_grad()
    def release(self) -> None:
        """Writes the fp32 masters into the parameters (or sinks), cast to their dtype, and removes the
        gradient hooks. The optimizer cannot step afterwards; host gradients not yet stepped are dropped."""
        self._drain()
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None
        for p, s in self._slots.items():
            s.wait_h2d()
            dst = s.sink if s.sink is not None else p.data
            dst.copy_(s.master.view(dst.shape))  # (a delayed update still pending included)
            s.unpublished = False
        self._grads.remove_hooks()
        for h in self._device_hooks:
            h.remove()
        self._device_hooks = []
        self._grads.consume()
        self._released = True

    unwrap = release

    @property
    def released(self) -> bool:
        return self._released

    def handed_back(self) -> tuple[torch.optim.Optimizer, dict]:
        """After :meth:`release`: the user's optimizer this one stood for and this one's state dict (its host state
        stays readable until this object is dropped). A later wrap of the same model over that optimizer continues
        where this one stopped with ``new.load_state_dict(state)``, as a plain optimizer used again would (the
        Trainer's second ``train()``)."""
        if not self._released:
            raise RuntimeError("OffloadedAdamW.handed_back() before release(): use state_dict()")
        return self._user_optimizer, self.state_dict()

    def stats(self) -> dict:
        """Counters of the last step (bytes each way, seconds in the CPU kernel and in ``step``) and sizes."""
        on_host = [s for s in self._slots.values() if s.where != "resident"]
        return {**self._last_stats, "grads": self.grads_mode, "offloaded_params": len(self._slots),
                "offloaded_numel": sum(s.master.numel() for s in self._slots.values()),
                "resident_numel": sum(s.master.numel() for s in self._slots.values() if s.where == "resident"),
                "streamed_numel": sum(s.master.numel() for s in self._slots.values() if s.where == "streamed"),
                "device_state_bytes": 12 * sum(s.master.numel() for s in self._slots.values()
                                               if s.where == "resident")
                + (self._device_steps.buffer_bytes() if self._device_steps is not None else 0),
                "device_params": sum(len(g["params"]) for g in (self._device_opt.param_groups
                                                                  if self._device_opt else [])),
                "moments": self.moments,
                "host_bytes": sum(s.master.numel() * (4 + 2 * s.exp_avg.element_size()) for s in on_host)
                + self._grads.nbytes()
                + sum(s.out.numel() * s.out.element_size() for s in self._slots.values() if s.out is not None)}
