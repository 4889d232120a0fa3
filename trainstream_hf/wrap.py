"""wrap(model, optimizer, **options): install the engine; the training loop stays as it was.

``wrap`` is a short pipeline: **prepare** (checks, quantizing the frozen base, the model's non-block parts onto
the compute device, the fused norms and cast hooks the measurement must see), **plan** (measure a block, make a
:class:`~trainstream_hf.planner.Plan` for the VRAM budget), **allocate** (streams, the pinned host arena, the
weight pager) and **install** (activation offloader, :class:`~trainstream_hf.engine.optimizer.OffloadedAdamW` in
place of the user's AdamW, recomputation, statistics). Every step registers its own undo on one
``contextlib.ExitStack`` that the :class:`Engine` owns: when a step fails the stack runs at once, in reverse, and
the model, its parameters, hooks and the optimizer are exactly as given; ``unwrap`` runs the same stack and leaves
an ordinary model holding the trained weights. A few changes are kept by ``unwrap`` but undone on failure (the
quantized layers, where parameters live): their undo holds the originals until ``wrap`` succeeds, then drops them.
:func:`plan` runs prepare and plan, then the whole stack, so it returns exactly the plan ``wrap`` would install.

One file, past 600 lines: the four steps share one setup record and one undo stack, and reading them in order is
reading what ``wrap`` does; splitting them would scatter the undo of a step from the step.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import os
import time
import warnings
import weakref
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from trainstream_hf import planner
from trainstream_hf.config import TrainStreamConfig, default_batch_shape, nearest_option, option_names, parse_bytes
from trainstream_hf.engine import distributed as data_parallel
from trainstream_hf.engine.activations import ActivationOffloader
from trainstream_hf.engine.allocator import enable_expandable_segments, wants_expandable_segments
from trainstream_hf.engine.arena import HostArena, host_memory_available
from trainstream_hf.engine.blocks import check_wrappable, find_blocks
from trainstream_hf.engine.casts import CastSources
from trainstream_hf.engine.compiled import CompiledBlocks, drop_cache, inductor_usable
from trainstream_hf.engine.embedding import HostEmbedding, hostable
from trainstream_hf.engine.gcstats import GcPauses
from trainstream_hf.engine.head import FusedHead, chunked_causal_lm_loss, fused_head_bytes
from trainstream_hf.engine.hooks import BlockHooks, BlockListener, forward_outside_compile, in_backward
from trainstream_hf.engine.norms import FusedNorms
from trainstream_hf.engine.optimizer import OffloadedAdamW, offload_refusal
from trainstream_hf.engine.peer import Peers
from trainstream_hf.engine.streams import TransferStreams
from trainstream_hf.engine.tiled import TiledMLP
from trainstream_hf.engine.trace import Timeline
from trainstream_hf.engine.weights import WeightPager, block_bytes, select_params
from trainstream_hf.quant import matmul
from trainstream_hf.quant.linear import QuantLinear
from trainstream_hf.quant.model import is_plain_linear, quantize_frozen_base

__all__ = ["wrap", "unwrap", "plan", "Engine", "engine_of"]

_ATTR = "_trainstream_engine"
_MISSING = object()


class _StepClock(BlockListener):
    """Marks the start of each step (forward of block 0) and, when tracing, each block's compute."""

    pack_priority = 100

    def __init__(self, engine: "Engine"):
        self.engine = engine

    def step_start(self) -> None:
        self.engine._begin_step()

    def forward_start(self, i: int) -> None:
        if self.engine.timeline is not None:
            self.engine.timeline.block("forward", i, end=False)

    def forward_end(self, i: int) -> None:
        if self.engine.timeline is not None:
            self.engine.timeline.block("forward", i, end=True)

    def backward_start(self, i: int) -> None:
        if self.engine.timeline is not None:
            self.engine.timeline.block("backward", i, end=False)


class _StepWaiter(BlockListener):
    """Before block i runs, waits for the overlapped optimizer step to have issued block i's new weights."""

    pack_priority = 90

    def __init__(self, optimizer: OffloadedAdamW, block_params: list[list[nn.Parameter]]):
        self.optimizer, self.block_params = optimizer, block_params

    def forward_start(self, i: int) -> None:
        self.optimizer.wait_for(self.block_params[i])


class Engine:
    """Everything ``wrap`` installed on one model; reach it with :func:`engine_of`.

    ``_undo`` is the stack of undos the install steps registered, in order; :meth:`unwrap` closes it.
    """

    def __init__(self, model: nn.Module, config: TrainStreamConfig, user_optimizer):
        self.model, self.config, self.user_optimizer = model, config, user_optimizer
        self.plan: planner.Plan | None = None
        self.streams = self.arena = self.hooks = self.pager = self.offloader = self.host_embedding = None
        self.casts = self.norms = self.loss_owner = self.fused_head = self.tiled = self.compiled = None
        self.optimizer = user_optimizer
        self.steps = 0
        self.expandable_segments = False  # wrap() switched the CUDA allocator to expandable segments
        self.shared_host = None  # the host copy of frozen paged weights shared with this host's other processes
        self.ddp_ignore = None
        self.timeline = None
        self._t0: float | None = None
        self._step_hook = None
        self._micro = 0  # training (grad-enabled) forwards in the current step
        self._accum_warned = False
        self.batch_shape: tuple[int, int] | None = None  # what the plan was made for
        self._tokens_fit = 0  # the most tokens a training forward carried that the plan was found to hold
        self._tokens_warned = False
        self._last: dict = {}
        self._counted: dict[str, dict] = {}  # the parts' cumulative counters at the end of the last step
        self._gc: GcPauses | None = None
        self._undo = contextlib.ExitStack()

    def _start_clock(self, undo: contextlib.ExitStack) -> None:
        """Per-step statistics: the step window, the timeline, Python's gc pauses."""
        # With an optimizer, a step is an optimizer step (all its micro-batches): the window opens at the first
        # forward and closes when step() returns. Without one, each forward pass starts a new window.
        if self.optimizer is not None and hasattr(self.optimizer, "register_step_post_hook"):
            self._step_hook = self.optimizer.register_step_post_hook(lambda *_: self._end_step())
            undo.callback(self._step_hook.remove)
        trace_path = os.environ.get("TRAINSTREAM_TRACE") or None
        self.timeline = Timeline(self.streams.device, trace_path) if (trace_path or self.config.timeline) else None
        self.streams.timeline = self.timeline
        undo.callback(setattr, self.streams, "timeline", None)
        self.hooks.add(_StepClock(self))
        # Python GC pauses per step (engine/gcstats.py). A model dropped without unwrap must not leave the counter in
        # gc.callbacks: it removes itself when the engine dies, in native code (a Python finalizer could run in the
        # middle of a step and swallow a Ctrl-C).
        self._gc = GcPauses().start(owner=self)
        undo.callback(self._gc.stop)

    # -- statistics -------------------------------------------------------------------------------
    def _begin_step(self) -> None:
        now = time.perf_counter()
        if self._t0 is not None:
            if self._step_hook is not None:  # the window is the optimizer step: further micro-batches belong to it
                if torch.is_grad_enabled():
                    self._micro += 1
                    self._check_accumulation()
                return
            self._close_step(now)
        self._t0 = now
        self._micro = int(torch.is_grad_enabled())  # training forwards in this step (not generation or scoring)
        self._gc.take()
        if self.streams.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.streams.device)
        if self.timeline is not None:
            self.timeline.start_step()

    def _check_accumulation(self) -> None:
        """Warns once when a step runs more micro-batches than the plan was made for and the plan, counting the
        gradients held beside the later forwards, would not fit them."""
        pl = self.plan
        if self._accum_warned or pl is None or self._micro <= pl.accumulation:
            return
        seen = replace(pl, accumulation=self._micro)  # the same plan, told the micro-batches run
        if not seen.fits():
            self._accum_warned = True
            warnings.warn(f"trainstream_hf: this optimizer step runs {self._micro} micro-batches but the plan was made "
                          f"for {pl.accumulation}; each forward after the first runs beside "
                          f"{seen.held_grad_bytes() / 2**30:.2f} GiB of held gradients, "
                          f"{seen.predicted_peak() / 2**30:.2f} GiB predicted against a "
                          f"{pl.budget / 2**30:.2f} GiB budget, "
                          "and may run out of device memory: pass gradient_accumulation_steps to wrap() (the "
                          "Trainer integration passes the Trainer's)", RuntimeWarning, stacklevel=2)

    def _check_tokens(self, module: nn.Module, args, kwargs) -> None:
        """Block 0's forward pre-hook: warns once when a training forward carries more tokens than the plan's
        ``batch_shape`` and the plan, with its activations, logits and backward scaled to them, would not fit."""
        if self._tokens_warned or not torch.is_grad_enabled() or in_backward() or torch.compiler.is_compiling():
            return
        x = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            return
        pl, shape = self.plan, self.batch_shape
        tokens, planned = x.shape[:-1].numel(), shape[0] * shape[1]
        if tokens <= max(planned, self._tokens_fit):  # (a length found to fit is not scaled again every step)
            return
        seen = pl.at_tokens(tokens / planned)
        if seen.fits():
            self._tokens_fit = tokens
            return
        self._tokens_warned = True
        dims = " x ".join(str(d) for d in x.shape[:-1])
        warnings.warn(f"trainstream_hf: this forward runs {dims} = {tokens} tokens but the plan was made for "
                      f"batch_shape={tuple(shape)} ({planned}); with its activations scaled to them the plan predicts "
                      f"{planner.format_bytes(seen.predicted_peak() + seen.margin)} against a "
                      f"{planner.format_bytes(pl.budget)} budget and may run out of device memory: pass the longest "
                      f"batch as batch_shape to wrap() (TrainStreamConfig(batch_shape=...) for the Trainer)",
                      RuntimeWarning, stacklevel=2)

    def _end_step(self) -> None:
        if self._t0 is not None:
            self._close_step(time.perf_counter())
            self._t0 = None

    def _close_step(self, now: float) -> None:
        dt = now - self._t0
        moved = self.streams.reset_counters()
        arena = self.arena.stats()
        s = {"step": self.steps, "step_seconds": dt, **moved,
             "h2d_GBps": moved["h2d_bytes"] / dt / 1e9 if dt > 0 else 0.0,
             "d2h_GBps": moved["d2h_bytes"] / dt / 1e9 if dt > 0 else 0.0,
             "arena_used_bytes": arena["used"], "arena_reserved_bytes": arena["reserved"],
             "host_shared_bytes": self.shared_host.nbytes if self.shared_host is not None else 0,
             "predicted_peak_bytes": self.plan.predicted_peak()}
        if self.streams.is_cuda:
            s["expandable_segments"] = self.expandable_segments
            s["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(self.streams.device)
            s["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(self.streams.device)
        s["overlap"] = None  # measured only with the timeline on (it costs a host sync per step)
        s["python_gc"] = self._gc.take()
        if self.timeline is not None:
            fig = self.timeline.close_step(self.steps)
            s.update({k: v for k, v in fig.items()})
        for name, part in (("weights", self.pager), ("activations", self.offloader), ("optimizer", self.optimizer)):
            if part is not None and hasattr(part, "stats"):
                s[name] = part.stats()
                if hasattr(part, "counters"):  # cumulative in the part: this step's share
                    now, before = part.counters(), self._counted.get(name, {})
                    s[name].update({k: v - before.get(k, 0) for k, v in now.items()})
                    self._counted[name] = now
        self._last = s
        self.steps += 1

    def stats(self) -> dict:
        """Figures of the last completed step (H2D / D2H bytes and GB/s, peak VRAM, arena use, per part: the pager's
        and the offloader's counters count that step alone).

        A step is an optimizer step: from the first forward after the previous ``optimizer.step()`` (every
        micro-batch of a gradient accumulation included) until ``step()`` returns; wrapped without an
        optimizer, from one forward of block 0 to the next. To report a per-step peak the engine resets CUDA's
        peak-memory statistics at each step start (``torch.cuda.reset_peak_memory_stats``)."""
        return dict(self._last)

    # -- checkpointed blocks -----------------------------------------------------------------------
    def install_recompute(self, blocks, indices, undo: contextlib.ExitStack) -> None:
        """Checkpoints (non-reentrant) the chosen blocks' ``forward`` in training, the module hooks staying outside
        the checkpoint (as transformers >= 5.24's ``GradientCheckpointingLayer`` does; earlier versions checkpoint
        ``__call__``), whatever the transformers version: the block hooks' saved-tensor context is then the one
        the checkpoint saves its inputs through, so a ``recompute_host`` block's input goes to host RAM. A cache
        passed to a checkpointed block is dropped with ``use_cache``, as transformers does (the recompute would
        write it twice). unwrap restores the forward."""
        from torch.utils.checkpoint import checkpoint

        for i in indices:
            layer = blocks[i]
            undo.callback(_restore_attr, layer, "forward", layer.__dict__.get("forward", _MISSING))
            inner = layer.__dict__.get("forward") or type(layer).forward.__get__(layer)
            layer.__dict__["forward"] = functools.partial(_checkpointed_forward, layer, inner, checkpoint)

    # -- overlapped optimizer step -------------------------------------------------------------------
    def install_step_overlap(self, blocks, undo: contextlib.ExitStack) -> None:
        """The next forward waits for each offloaded parameter's new value just before it is used: the
        non-block ones (embeddings, head) when the model's forward starts, block i's at block i. The end of
        the forward waits for the CPU step to finish, so backward never races it."""
        opt = self.optimizer
        block_params = [list(b.parameters()) for b in blocks]
        in_blocks = {id(p) for ps in block_params for p in ps}
        other = [p for p in self.model.parameters() if id(p) not in in_blocks]
        # Embeddings and head first (the forward needs the embedding before block 0), then block by block.
        opt.set_step_order(other + [p for ps in block_params for p in ps])
        for h in (self.model.register_forward_pre_hook(lambda m, a: opt.wait_for(other)),
                  self.model.register_forward_hook(lambda m, a, o: opt.forward_done(), always_call=True)):
            undo.callback(h.remove)
        self.hooks.add(_StepWaiter(opt, block_params))  # the block hooks' removal forgets it

    # -- removal ----------------------------------------------------------------------------------
    def unwrap(self) -> nn.Module:
        """Runs every install step's undo, last installed first; the model keeps its trained weights."""
        self._undo.close()
        return self.model


def _checkpointed_forward(layer: nn.Module, inner, checkpoint, *args, **kwargs):
    # Not twice: with the user's gradient checkpointing on, transformers checkpoints this layer itself.
    if not (layer.training and torch.is_grad_enabled()) or getattr(layer, "gradient_checkpointing", False):
        return inner(*args, **kwargs)
    args = drop_cache(layer, args, kwargs)
    return checkpoint(inner, *args, use_reentrant=False, **kwargs)


def _restore_attr(obj, name: str, old) -> None:
    if old is _MISSING:
        obj.__dict__.pop(name, None)
    else:
        setattr(obj, name, old)


def _own_loss_model(model: nn.Module) -> nn.Module | None:
    """The transformers model inside ``model`` when its loss is transformers' own ``ForCausalLMLoss`` (and no loss of
    the user's), else None: where the chunked loss and the fused head may go."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if "_loss_function" in base.__dict__ or not hasattr(type(base), "loss_function"):
        return None
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    return base if base.loss_function is ForCausalLMLoss else None


def _install_chunked_loss(model: nn.Module) -> nn.Module | None:
    """Sets the chunked loss on :func:`_own_loss_model`; returns that model, or None."""
    base = _own_loss_model(model)
    if base is not None:
        base.__dict__["_loss_function"] = chunked_causal_lm_loss
    return base


def _fused_head_applies(base: nn.Module, mode) -> bool:
    """Whether the fused head can serve ``base``: an output embedding with a 2-D weight, and (for ``"auto"``) no
    logit soft-capping or scaling in the config (those models change the logits between head and loss; forced
    with ``True`` they fail loudly at the first fused step)."""
    if planner.head_weight(base) is None:
        return False
    config = getattr(base, "config", None)
    if getattr(config, "vocab_size", None) is None:
        return False
    changes = any(getattr(config, k, None) not in (None, 1, 1.0) for k in ("final_logit_softcapping", "logit_scale"))
    return mode is True or not changes


def _remove_chunked_loss(base: nn.Module | None) -> None:
    if base is not None and base.__dict__.get("_loss_function") is chunked_causal_lm_loss:
        del base.__dict__["_loss_function"]


def engine_of(model: nn.Module) -> Engine | None:
    """The engine ``wrap`` installed on ``model`` (or on the model a PEFT wrapper holds), else None."""
    return model.__dict__.get(_ATTR)


def _compute_device(model: nn.Module) -> torch.device:
    devices = {p.device for p in model.parameters()}
    cuda = [d for d in devices if d.type == "cuda"]
    if len({d for d in cuda}) > 1:
        raise ValueError(f"wrap: the model spans several GPUs {sorted(map(str, cuda))}; wrap one model per GPU "
                         "(data parallel) instead")
    return cuda[0] if cuda else torch.device("cpu")


def _requested_device(spec: str) -> torch.device:
    """``device=`` checked before anything changes: a CUDA device this process can use, or the CPU, in one line."""
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={spec!r} is not a device: {e}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={spec!r}, but this PyTorch sees no CUDA device (torch.cuda.is_available() is "
                             "False): install a CUDA build of PyTorch, or leave device unset to train where the "
                             "model's parameters are")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"device={spec!r}, but this process sees {count} CUDA device(s), cuda:0 to "
                             f"cuda:{count - 1} (CUDA_VISIBLE_DEVICES renumbers them)")
        return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
    if device.type != "cpu":
        raise ValueError(f"device={spec!r}: the engine computes on a CUDA device or the CPU")
    return device


def _move_outside_blocks(model: nn.Module, block_modules: set[int], device: torch.device) -> None:
    """Moves the parameters and buffers of every module outside the blocks (embeddings, rotary tables,
    final norm, head) to ``device``, in place (parameter objects keep their identity for the optimizer)."""
    for m in model.modules():
        if id(m) in block_modules:
            continue
        for p in m.parameters(recurse=False):
            if p.device != device:
                p.data = p.data.to(device)
        for name, b in list(m._buffers.items()):
            if b is not None and b.device != device:
                m._buffers[name] = b.to(device)


def _maps_host_memory(device: torch.device) -> bool:
    """Whether ``device`` can read pinned host memory in place (a CUDA device: host_embedding)."""
    return device.type == "cuda"


def _plan_or_none(make_plan, activation_bytes):
    try:
        return make_plan(activation_bytes)
    except planner.BudgetError:
        return None


class _OnFailure:
    """An undo for a change that ``unwrap`` keeps (quantized layers, where parameters live): it runs only if wrap
    fails; :meth:`commit` (wrap succeeded) drops it, and with it what it held to put things back."""

    def __init__(self, undo: contextlib.ExitStack, put_back: Callable[[], None]):
        self._put_back = put_back
        undo.callback(self)

    def __call__(self) -> None:
        put_back, self._put_back = self._put_back, None
        if put_back is not None:
            put_back()

    def commit(self) -> None:
        self._put_back = None


@dataclass
class _Setup:
    """What the prepare and plan steps found, for the later steps."""

    model: nn.Module
    config: TrainStreamConfig
    has_optimizer: bool
    dp_group: object = None
    device: torch.device | None = None
    blocks: tuple = ()
    batch_shape: tuple[int, int] = (1, 1)
    casts: CastSources | None = None
    norms: FusedNorms | None = None
    loss_owner: nn.Module | None = None
    fused_head: FusedHead | None = None
    tiled: TiledMLP | None = None
    compiled: CompiledBlocks | None = None
    keep: list = None  # _OnFailure undos to commit when wrap succeeds
    host_embedding: nn.Embedding | None = None  # the input embedding the plan keeps in host RAM

    def drop_casts(self) -> None:
        if self.casts is not None:
            self.casts.uninstall()
            self.casts = None


def _configure(model: nn.Module, optimizer, config: TrainStreamConfig | None, options: dict):
    """Checks the arguments and resolves the options (the gradient mode data parallel and optimizer_in_backward
    need); changes nothing. Returns (config, the data-parallel group)."""
    data_parallel.check_not_ddp(model)
    if engine_of(model) is not None:
        raise RuntimeError("wrap: this model is already wrapped; call trainstream_hf.unwrap(model) first")
    check_wrappable(model)
    for name in options:
        if name not in option_names():
            near = nearest_option(name)
            raise TypeError(f"wrap: {name}= is not an option{f' (did you mean {near}=?)' if near else ''}; the "
                            f"options are TrainStreamConfig's fields: {', '.join(option_names())}")
    config = replace(config, **options) if config is not None else TrainStreamConfig(**options)
    if optimizer is not None:
        own = {id(p) for p in model.parameters()}
        foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in own)
        if foreign:
            raise ValueError(f"wrap: the optimizer holds {foreign} tensor(s) that are not parameters of this model; "
                             "build it from this model's parameters (e.g. model.parameters())")
        kind = offload_refusal(optimizer)
        if kind is not None:
            for flag, on in (("offload_optimizer", config.offload_optimizer is True),
                             ("optimizer_in_backward", config.optimizer_in_backward),
                             ("optimizer_staleness", bool(config.optimizer_staleness))):
                if on:
                    raise ValueError(f"wrap: {flag} runs the optimizer on the engine's AdamW, which takes "
                                     f"torch.optim.AdamW or torch.optim.Adam (amsgrad, capturable and differentiable "
                                     f"off); got {kind}: use one of them, or leave {flag} off (the optimizer then "
                                     "steps on the device as it is)")
            # 'auto' cannot choose host RAM for another optimizer's state: the plan keeps it on the device
            config = replace(config, offload_optimizer=False)
    # Several processes: DDP averages gradients on the device, so the plan counts them there (engine/distributed.py).
    dp_group = data_parallel.process_group(config.data_parallel, config.grads)
    if dp_group is not None and config.optimizer_in_backward:
        raise ValueError("optimizer_in_backward cannot be used with several processes (DistributedDataParallel): it "
                         "needs host gradients, which DDP's reducer would never see (engine/distributed.py); turn it "
                         "off (or data_parallel=False if the processes train independent models)")
    if config.outliers and config.quantize is None:
        raise ValueError(f"outliers={config.outliers} protects the input channels of quantized layers: "
                         "set quantize too")
    if dp_group is not None and config.grads == "auto":
        config = replace(config, grads="device")
    if config.optimizer_in_backward and config.grads == "auto":
        config = replace(config, grads="host")  # the updates start from the host-mode gradient hook
    if config.optimizer_staleness:
        # The gradients stay on the device (the delayed update reads their host copies during the next backward), and
        # no state is streamed: the CPU AdamW is off the critical path, the streamed share's copies would be on it.
        config = replace(config, grads="device" if config.grads == "auto" else config.grads,
                         optimizer_streamed=False if config.optimizer_streamed == "auto" else config.optimizer_streamed)
    return config, dp_group


def _quantize(s: _Setup, undo: contextlib.ExitStack) -> None:
    """Packs the frozen linear layers (a PEFT model's base; never a trainable layer or the output head) in place, one
    at a time, before the plan measures anything. Until wrap succeeds each original layer is kept, in host RAM
    (a copy of a device one), to be put back if a later step fails. Where those originals would take more than half
    of the host's available memory they are not kept: a failure then says that the base stays packed."""
    originals = []  # (parent, child name, original layer, [(tensor, its device)])
    frozen = sum(t.numel() * t.element_size() for m in s.model.modules() if is_plain_linear(m)
                 and not m.weight.requires_grad for t in m.parameters(recurse=False))
    available = host_memory_available()
    if available is not None and frozen > available // 2:
        def say() -> None:  # on failure, beside the error
            warnings.warn(f"wrap failed, and the frozen linear layers stay packed as quantize={s.config.quantize!r}: "
                          f"a copy of their {frozen / 2**30:.1f} GiB to put back did not fit in host RAM "
                          f"({available / 2**30:.1f} GiB available); load the model again to retry", RuntimeWarning)
        s.keep.append(_OnFailure(undo, say))
        quantize_frozen_base(s.model, s.config.quantize, s.config.outliers)
        return

    def keep(parent: nn.Module, child: str, old: nn.Module) -> None:
        moved = []
        for t in [*old.parameters(), *old.buffers()]:
            if t.device.type != "cpu":
                moved.append((t, t.device))
                t.data = t.data.to("cpu")
        originals.append((parent, child, old, moved))

    def put_back() -> None:
        for parent, child, old, moved in reversed(originals):
            for t, device in moved:
                t.data = t.data.to(device)
            setattr(parent, child, old)
        originals.clear()

    s.keep.append(_OnFailure(undo, put_back))
    quantize_frozen_base(s.model, s.config.quantize, s.config.outliers, replaced=keep)


def _keep_placement(s: _Setup, undo: contextlib.ExitStack) -> None:
    """Notes where every parameter and buffer is, to move them back if a later step fails (wrap moves them to the
    compute device; the pager moves paged ones to host RAM and ``unwrap`` back to the device)."""
    params = [(p, p.device) for p in s.model.parameters()]
    buffers = [(m, name, b.device) for m in s.model.modules() for name, b in m._buffers.items() if b is not None]

    def put_back() -> None:
        for p, device in params:
            if p.device != device:
                p.data = p.data.to(device)
        for m, name, device in buffers:
            b = m._buffers.get(name)
            if b is not None and b.device != device:
                m._buffers[name] = b.to(device)

    s.keep.append(_OnFailure(undo, put_back))


def _prepare(s: _Setup, undo: contextlib.ExitStack) -> None:
    """Quantization, the compute device, the blocks, and the patches the measurement must see."""
    model, config = s.model, s.config
    requested = _requested_device(config.device) if config.device is not None else None
    if config.quantize is not None:
        _quantize(s, undo)
    s.device = requested or _compute_device(model)
    s.blocks = find_blocks(model)
    s.batch_shape = config.batch_shape or default_batch_shape(model)
    _keep_placement(s, undo)
    _move_outside_blocks(model, {id(m) for b in s.blocks for m in b.modules()}, s.device)
    owner = _own_loss_model(model)
    if config.fused_loss and owner is not None and _fused_head_applies(owner, config.fused_loss):
        s.fused_head = FusedHead(model, owner, config.fused_loss, exact=config.chunked_loss).install()
        undo.callback(s.fused_head.uninstall)
    elif config.chunked_loss:
        s.loss_owner = _install_chunked_loss(model)
        undo.callback(_remove_chunked_loss, s.loss_owner)
    if config.tiled_mlp:  # before the block is measured: a tiled MLP saves its input alone
        s.tiled = TiledMLP(config.tiled_mlp)
        undo.callback(s.tiled.uninstall)
        s.tiled.install(s.blocks)
    if config.fused_norms:  # before the block is measured: the fused norm saves less
        s.norms = FusedNorms()
        undo.callback(s.norms.uninstall)
        s.norms.install(model.modules())
    compile_mode = _compile_mode(config.compile_blocks, s.blocks, s.device)
    # Inside a compiled block cast elision stands aside (the graph decides what it saves): under 'auto' it is not
    # installed there, since dropping it after the measurement would change the region and compile it again
    if config.elide_casts is True or config.elide_casts and not compile_mode:
        s.casts = CastSources()
        undo.callback(s.drop_casts)
        if not s.casts.install(m for b in s.blocks for m in b.modules()):
            s.drop_casts()
    if compile_mode:
        # Before the block is measured: the compiled region saves fewer tensors than the eager block (its partitioner
        # recomputes cheap elementwise results in backward). Measured eager, the plan of the 8B fp8 table row
        # recomputed 11 blocks and offloaded 4 for a predicted 22.9 GiB, and the step peaked at 13.6 GiB (H100,
        # table-llama3.1-8b-h100-4d3ed15.json). After the patches above, which are then inside the region; before
        # the checkpoints, which wrap the compiled forward.
        s.compiled = CompiledBlocks("inductor" if compile_mode is True else compile_mode,
                                    fallback=config.compile_blocks == "auto")
        undo.callback(s.compiled.uninstall)
        s.compiled.install(s.blocks)


def _compile_mode(option, blocks, device: torch.device):
    """What ``compile_blocks=option`` compiles with here: False, True (inductor) or a backend name. 'auto': inductor
    where it can generate kernels for ``device``. Over FP8 tensor-core layers on the GPU the compiled blocks do not
    yet train as eager (on the H100 the first update drops the loss 5-7x more, and eager matches the emulated W8A8
    maths; the CPU does not reproduce it: benchmarks/NOTES.md, 2026-12-07, tests/gpu/test_compiled_blocks_cuda.py):
    'auto' then stays eager, an explicit request compiles; both warn."""
    mode = inductor_usable(device) if option == "auto" else option
    if not mode or not _fp8_tensor_core_layers(blocks, device):
        return mode
    if option == "auto":
        warnings.warn("trainstream_hf: compile_blocks='auto' leaves blocks with FP8 tensor-core layers eager: "
                      "compiled, they do not yet follow eager's loss curve on the GPU", RuntimeWarning, stacklevel=4)
        return False
    warnings.warn("trainstream_hf: compile_blocks over FP8 tensor-core layers does not yet follow eager's loss curve "
                  "on the GPU (its first updates differ); compile_blocks=False gives eager's numbers", RuntimeWarning,
                  stacklevel=4)
    return mode


def _vocab(model: nn.Module) -> int:
    """The width of the model's logits: its output embedding's rows, else ``config.vocab_size`` (0: neither)."""
    weight = planner.head_weight(model)
    if weight is not None:
        return int(weight.shape[0])
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return int(getattr(getattr(base, "config", None), "vocab_size", 0) or 0)


def _fp8_tensor_core_layers(blocks, device: torch.device) -> bool:
    """Whether any of ``blocks`` holds a quantized layer that runs the FP8 tensor-core path on ``device``."""
    if device.type != "cuda":
        return False
    return any(isinstance(m, QuantLinear) and m.matmul_path(device) is matmul.FP8_W8A8_SCALED_MM
               for b in blocks for m in b.modules())


def _measure(s: _Setup, block: nn.Module) -> planner.BlockMeasure | None:
    """``planner.measure_block`` of ``block``, with the random number generators forked, so that the user's stream of
    random numbers (dropout's masks in the first steps) is the same as without the measurement; with compiled blocks,
    through the compiled region (which compiles here, for the measured batch shape, rather than at the first training
    step): the blocks run in training mode for it (only training calls are compiled)."""
    devices = [s.device] if s.device.type == "cuda" else []
    modes = [(b, b.training) for b in s.blocks] if s.compiled is not None else []
    try:
        with torch.random.fork_rng(devices=devices):
            for b, _ in modes:
                b.train()
            return planner.measure_block(s.model, block, s.batch_shape, s.device, casts=s.casts)
    finally:
        for b, mode in modes:
            b.train(mode)


def _make_plan(s: _Setup) -> planner.Plan:
    """Measures a block and plans for the budget (cast elision dropped where it saves nothing)."""
    model, config, blocks, device = s.model, s.config, s.blocks, s.device
    # The second block is measured (the forward runs up to its end): the first one's input needs no gradient
    # when the embedding is frozen, so it saves less than every later block. Measured, not estimated: the
    # analytic formula missed LoRA's and the norms' saved tensors by ~40% on the H200 (benchmarks/NOTES.md).
    probe = min(1, len(blocks) - 1)
    homes = [{p.device for p in b.parameters()} for b in blocks[:probe + 1]]
    for b, home in zip(blocks, homes):
        if home != {device}:
            b.to(device)  # for the measurement only; the plan decides where it lives
    m = _measure(s, blocks[probe])
    head = planner.measure_head(model, s.batch_shape, device, fused=s.fused_head)
    tokens = s.batch_shape[0] * s.batch_shape[1]
    if head is None and s.fused_head is not None and s.fused_head.active_for(tokens):
        # Unmeasured (off CUDA): the hidden states' gradient and a chunk's logits, fp32 log-probabilities and their
        # gradients, instead of the plan's whole-matrix formula.
        w = s.fused_head.head.weight
        head = fused_head_bytes(tokens, w.shape[1], w.shape[0], next(model.parameters()).element_size())
    for b, home in zip(blocks, homes):
        if home != {device}:
            b.to(next(iter(home)) if len(home) == 1 else "cpu")
    # Accelerate's mixed precision copies the returned logits to float32 after the forward (at 2048 tokens and a 128k
    # vocabulary 1 GiB beside the forward's peak): the 70B nf4 recipe ran out of memory there when it went uncounted.
    fp32_copy = 0
    if s.config.fp32_outputs and not (s.fused_head is not None and s.fused_head.active_for(tokens)):
        fp32_copy = tokens * _vocab(model) * 4

    cpu_adam_pps = None
    if device.type == "cuda" and s.has_optimizer and config.offload_optimizer is not False and \
            config.optimizer_streamed not in (False, 0) and config.optimizer_moments == "float32":
        # the CPU AdamW's rate on this host, with the threads the overlapped step leaves it, for the streamed split
        cpu_adam_pps = planner.measure_cpu_adam(max(1, torch.get_num_threads() - 1))

    host_budget = None
    if config.host_arena == "auto":
        # what the arena may pin: MemAvailable less a reserve for everything else the process and the host need
        # (10%, at least 4 GiB: at 65,536 tokens a plan that left 1 GiB free was killed by the kernel's OOM killer on
        # the H100 host at 5dedf68), plus the parameters now in host RAM, which the pager moves into it (or which go
        # to the device) block by block
        available = host_memory_available()
        if available is not None:
            host_budget = available - max(4 * 2**30, available // 10) + sum(
                p.numel() * p.element_size() for p in model.parameters() if p.device.type == "cpu")

    def make_plan(activation_bytes, host_embedding=None):
        return planner.plan(
            model, list(blocks), batch_shape=s.batch_shape, vram_budget=config.vram_budget, device=device,
            offload_optimizer=config.offload_optimizer if s.has_optimizer else False,
            grads=config.grads, offload_activations=config.offload_activations,
            page_weights=config.page_weights, slots=config.slots, prefetch=config.prefetch,
            min_offload_numel=config.min_offload_numel, recompute=config.recompute,
            activation_bytes=activation_bytes, activation_sizes=None if m is None else m.saved_sizes,
            min_activation_bytes=parse_bytes(config.min_activation_bytes),
            input_bytes=None if m is None else m.input_bytes,
            forward_seconds=None if m is None else m.forward_seconds, head_bytes=head,
            optimizer_resident=config.optimizer_resident, optimizer_streamed=config.optimizer_streamed,
            cpu_adam_pps=cpu_adam_pps, host_budget=host_budget, optimizer_moments=config.optimizer_moments,
            accumulation=config.gradient_accumulation_steps, optimizer_in_backward=config.optimizer_in_backward,
            host_embedding=host_embedding if host_embedding is not None else s.host_embedding,
            backward_extra_bytes=None if m is None else m.backward_extra, output_fp32_bytes=fp32_copy)

    # The input embedding that may go to pinned host RAM (host_embedding; engine/embedding.py), where 'auto' takes it
    # when memory is short: the plan does not fit, or moves anything else off the device.
    emb = hostable(model) if config.host_embedding is not False and _maps_host_memory(device) else None
    auto_emb = emb is not None and config.host_embedding == "auto" and s.dp_group is None
    used = None if m is None else m.activation_bytes
    try:
        pl = make_plan(used)
    except planner.BudgetError:
        if not auto_emb:
            raise
        s.host_embedding = emb
        pl = make_plan(used)  # with the table off the device (a BudgetError again: it does not fit either way)
    if config.elide_casts == "auto" and s.casts is not None and m is not None and \
            m.raw_activation_bytes <= m.activation_bytes:
        # Nothing to elide (no widening cast saved: bf16 autocast, or LoRA's native path, which saves the
        # narrow input itself): the hooks would cost a Python call per saved tensor for nothing.
        s.drop_casts()
    elif config.elide_casts == "auto" and s.casts is not None and m is not None:
        # Cast elision only saves memory, and costs a Python hook per saved tensor plus a cast per saved copy in
        # backward (8B nf4 LoRA on the H200: 256 casts and ~1500 hooked tensors per step, with 5.7 GiB of the
        # budget unused). Without it, if every block still keeps its activations and weights on the device.
        plain = _plan_or_none(make_plan, m.raw_activation_bytes)
        if plain is not None and not plain.moves_blocks and \
                (plain.offload_optimizer, plain.grads) == (pl.offload_optimizer, pl.grads):
            s.drop_casts()
            pl, used = plain, m.raw_activation_bytes
    if s.host_embedding is None and emb is not None and (
            config.host_embedding is True or auto_emb and (pl.moves_blocks or pl.offload_optimizer)):
        # memory is short (or asked): the plan is made again with the table's bytes off the device
        hosted = make_plan(used, emb) if config.host_embedding is True else _plan_or_none(
            lambda a: make_plan(a, emb), used)
        if hosted is not None:
            pl, s.host_embedding = hosted, emb
    elif emb is None and config.host_embedding is True:
        why = ("the compute device is the CPU: the table is in host RAM already" if not _maps_host_memory(device)
               else "only a frozen nn.Embedding that no other module shares (not tied to the output head), without "
                    "max_norm, can be kept in host RAM")
        warnings.warn(f"host_embedding=True: the input embedding stays where it is: {why}", RuntimeWarning,
                      stacklevel=3)
    if config.grads == "device" and pl.grads == "host" and s.dp_group is None:  # (DDP: its own refusal, later)
        raise ValueError(_STALE_PAGED if config.optimizer_staleness else _DEVICE_GRADS_PAGED)
    return pl


_STALE_PAGED = (
    "optimizer_staleness=1 cannot be honoured: the plan pages trainable weights (they do not fit the vram_budget), "
    "whose updates must be in their host copies before the next forward pages them in; raise vram_budget, set "
    "page_weights=False, or use optimizer_staleness=0")
_DEVICE_GRADS_PAGED = (
    "grads='device' cannot be honoured: the plan pages trainable weights, whose gradients go straight to their host "
    "copies (the weight is not on the device after its block has run); use grads='auto' (p.grad and "
    "torch.nn.utils.clip_grad_norm_ still see those host gradients), or page_weights=False / a larger vram_budget")


def _allocate(engine: Engine, s: _Setup, pl: planner.Plan, peers, undo: contextlib.ExitStack) -> None:
    """Streams, the host arena (pinned now, in one go), the block hooks and the weight pager."""
    blocks, device, config = s.blocks, s.device, s.config
    engine.streams = streams = TransferStreams(device)
    engine.arena = arena = HostArena(config.host_arena if config.host_arena not in (None, 0) else "auto",
                                     pinned=None if config.host_arena not in (None, 0) else False,
                                     slab_bytes=config.host_arena_slab, pageable_fallback=config.pageable_fallback)
    undo.callback(_close_arena, streams, arena)
    # Pin what the plan needs now, in one go: pinning is slow (~0.4 s/GiB on the H200 host) and a host too
    # small must be refused here, with needed vs available, not in the middle of a step.
    if arena.growable:
        # Paged weights that already sit in host RAM are moved block by block (each original freed once
        # copied), so their slabs are pinned as the pager goes, while the memory they replace is released.
        # Frozen paged weights shared with the other processes of this host (peer) go to shared memory instead.
        elsewhere = sum(p.numel() * p.element_size() for i in pl.paged_blocks for p in blocks[i].parameters()
                        if p.device.type == "cpu" or (peers is not None and peers.active and not p.requires_grad))
        arena.reserve(max(0, pl.host_bytes() - elsewhere))
    elif pl.host_bytes() > arena.stats()["reserved"] and not config.pageable_fallback:
        raise ValueError(f"host_arena={config.host_arena!r} reserves {arena.stats()['reserved']} bytes but the "
                         f"plan puts {pl.host_bytes()} bytes in host RAM; raise host_arena, use 'auto', or set "
                         "pageable_fallback=True")
    engine.hooks = hooks = BlockHooks(blocks)
    undo.callback(hooks.remove)
    # Fixed-size segments could lose a plan's margin to fragmentation (engine/allocator.py).
    engine.expandable_segments = (wants_expandable_segments(config.expandable_segments, device, pl.fills_budget())
                                  and enable_expandable_segments())
    # Small trainable parameters (LoRA adapters, norms of a full fine-tune) stay on the device with the device
    # optimizer (planner.pages_param): paging them would save little and put them on the CPU optimizer.
    paged_filter = planner.page_filter(pl.min_offload_numel)
    shared = None
    if peers is not None:
        # Every rank allocates (a collective), paging or not: a rank that planned differently gets no sharing
        # here and the plan check in the install step raises on all of them.
        sizes = {}
        if pl.paged_blocks:
            selected, _ = select_params(hooks, pl.paged_blocks, device, paged_filter)
            sizes = {i: block_bytes(ps) for i, ps in selected.items() if not any(p.requires_grad for p in ps)}
        shared = peers.allocate(sizes, pin=arena.pinned)
        engine.shared_host = shared
        undo.callback(setattr, engine, "shared_host", None)  # the segment is unmapped with its last view
    failure = None
    try:
        if pl.paged_blocks:
            pager = WeightPager(hooks, streams, arena, blocks=pl.paged_blocks, slots=pl.slots,
                                prefetch=pl.prefetch, param_filter=paged_filter,
                                host_buffers=shared.views if shared is not None else None,
                                fill_host_buffers=shared is None or shared.writer)
            engine.pager = pager
            undo.callback(pager.unwrap)  # host copies (updated by the optimizer through the sinks) -> device
    except BaseException as e:
        failure = e
    if peers is not None:
        peers.agree(failure)  # raises on every rank when the pager failed on one
    elif failure is not None:
        raise failure


def _close_arena(streams: TransferStreams, arena: HostArena) -> None:
    streams.synchronize()
    arena.close()  # pinned slabs go back once the last tensor in them (e.g. optimizer state) dies


def _install(engine: Engine, s: _Setup, pl: planner.Plan, peers, undo: contextlib.ExitStack) -> None:
    """The activation offloader, data parallel, the offloaded optimizer, recomputation, statistics."""
    model, config, blocks, device = s.model, s.config, s.blocks, s.device
    streams, arena, hooks, pager, shared = engine.streams, engine.arena, engine.hooks, engine.pager, engine.shared_host
    optimizer = engine.user_optimizer
    # Whatever the pager did not take (unpaged blocks, small trainable parameters, buffers) goes to the
    # compute device; paged parameters are device placeholders already, so .to() leaves them alone.
    for b in blocks:
        b.to(device)
    if s.host_embedding is not None:
        engine.host_embedding = HostEmbedding(s.host_embedding, device, arena)
        undo.callback(engine.host_embedding.close)
    if pl.offloaded_activation_blocks or s.casts is not None:
        engine.offloader = ActivationOffloader(hooks, streams, arena, blocks=pl.offloaded_activation_blocks,
                                               min_bytes=parse_bytes(config.min_activation_bytes), casts=s.casts,
                                               prefetch=pl.activation_prefetch())
        undo.callback(engine.offloader.close)
    names = dict((id(p), n) for n, p in model.named_parameters())
    paged = set(map(id, pager.paged_parameters())) if pager is not None else set()
    offload = []
    if optimizer is not None:
        wanted = set(pl.offload_optimizer)
        offload = [p for g in optimizer.param_groups for p in g["params"]
                   if names.get(id(p)) in wanted or (id(p) in paged and p.requires_grad)]
    if s.dp_group is not None:
        # Every rank checks the same plan first, so that a refusal below is raised on all of them at once; the
        # broadcast comes before the optimizer reads its fp32 masters from the parameters.
        paged_params = pager.paged_parameters() if pager is not None else []
        data_parallel.check_same_plan({"paged": sorted(names.get(id(p), "?") for p in paged_params),
                                       "offloaded": sorted(names.get(id(p), "?") for p in offload),
                                       "grads": pl.grads}, device, s.dp_group)
        data_parallel.check_no_trainable_paged(model, paged_params)
        # A process that maps a host copy another one fills (peer) does not write into it.
        host = [pager.host_tensor(p) for p in paged_params]
        reads = [shared is not None and not shared.writer and shared.holds(t) for t in host]
        data_parallel.broadcast_from_rank0(host + [p.data for p in offload], device, s.dp_group,
                                           write=[not r for r in reads] + [True] * len(offload))
        ddp_ignore = data_parallel.hide_frozen_from_ddp(model, paged_params, device, s.dp_group)
        engine.ddp_ignore = (ddp_ignore,)
        undo.callback(data_parallel.restore_ddp_ignore, model, ddp_ignore)
        if peers is not None:
            peers.barrier()  # the leaders' writes into shared host memory are done before any process reads
    if optimizer is not None and offload:
        sinks = {p: pager.host_tensor(p) for p in offload if id(p) in paged}
        kind = offload_refusal(optimizer)
        if kind is not None:
            raise ValueError(f"wrap: the plan pages {len(sinks)} trainable weights to host RAM, where the engine's "
                             f"AdamW updates them, and it takes torch.optim.AdamW or torch.optim.Adam only, with "
                             f"amsgrad, capturable and differentiable off (got {kind}): use one of them, set "
                             "page_weights=False, or raise vram_budget")
        if sinks and config.grads == "device" and s.dp_group is None:
            raise ValueError(_STALE_PAGED if config.optimizer_staleness else _DEVICE_GRADS_PAGED)
        if sinks and config.offload_optimizer is False:
            warnings.warn(f"offload_optimizer=False, but the plan pages trainable weights: the optimizer state of "
                          f"those {len(sinks)} parameters is in host RAM, updated there; set page_weights=False or "
                          "raise vram_budget to keep it on the device", RuntimeWarning, stacklevel=3)
        pl.grads = "host" if (pl.grads == "host" or sinks) else "device"
        overlap = config.overlap_step
        if overlap == "auto":
            # in backward, the updates run on the step's worker thread on the CPU device too
            overlap = (streams.is_cuda or config.optimizer_in_backward) and not sinks
        resident, streamed = set(pl.resident_optimizer), set(pl.streamed_optimizer)
        new_opt = OffloadedAdamW(optimizer, offload, arena=arena, streams=streams, grads=pl.grads,
                                 param_sink=sinks, overlap_step=bool(overlap),
                                 optimizer_in_backward=config.optimizer_in_backward, moments=config.optimizer_moments,
                                 staleness=config.optimizer_staleness, grads_fit_forward=pl.accumulation > 1,
                                 resident=[p for p in offload if names.get(id(p)) in resident and p not in sinks],
                                 streamed=[p for p in offload if names.get(id(p)) in streamed and p not in sinks])
        undo.callback(new_opt.release)  # fp32 masters -> sinks / device params, gradient hooks removed
        new_opt.set_param_names(model.named_parameters())
        engine.optimizer = new_opt
    elif optimizer is not None and config.optimizer_staleness:
        warnings.warn("optimizer_staleness=1 has nothing to delay: the plan keeps every parameter's optimizer state on "
                      "the device, so the step is exact AdamW as without it (offload_optimizer=True offloads it)",
                      RuntimeWarning, stacklevel=3)
    if pager is not None:
        pager.track_state_dict(model, engine.optimizer if isinstance(engine.optimizer, OffloadedAdamW) else None)
    if isinstance(engine.optimizer, OffloadedAdamW):
        _track_masters(model, engine.optimizer, undo)
    engine.plan, engine.batch_shape = pl, tuple(s.batch_shape)
    h = blocks[0].register_forward_pre_hook(engine._check_tokens, with_kwargs=True)
    undo.callback(h.remove)
    engine.casts, engine.norms, engine.loss_owner, engine.fused_head = s.casts, s.norms, s.loss_owner, s.fused_head
    engine.tiled, engine.compiled = s.tiled, s.compiled
    engine._start_clock(undo)
    engine.install_recompute(blocks, pl.recomputed_blocks, undo)
    if isinstance(engine.optimizer, OffloadedAdamW) and engine.optimizer.overlap_step:
        engine.install_step_overlap(blocks, undo)
    for name, value in ((_ATTR, engine), ("trainstream_stats", engine.stats), ("trainstream_plan", pl)):
        model.__dict__[name] = value
        undo.callback(model.__dict__.pop, name, None)
    _guard_layout(model, blocks, undo)
    if pager is not None:
        _count_paged_at_their_size(model, undo)
        if optimizer is None:
            _refuse_late_optimizers(engine, pager, undo)
    if pager is not None:  # last of the forwards' wrappers: a torch.compile of the whole model leaves the blocks out
        hooks.keep_out_of_enclosing_compile()
        undo.callback(hooks.keep_out_of_enclosing_compile, False)
        for layer in blocks:
            undo.callback(_restore_attr, layer, "forward", layer.__dict__.get("forward", _MISSING))
            inner = layer.__dict__.get("forward") or type(layer).forward.__get__(layer)
            layer.__dict__["forward"] = functools.partial(forward_outside_compile, inner)


def _count_paged_at_their_size(model: nn.Module, undo: contextlib.ExitStack) -> None:
    """transformers' ``num_parameters()`` counts ``numel()``, which is 0 for a paged parameter outside its block's use:
    while wrapped, the model's own method is wrapped to count those at their size (``ds_numel``, engine/weights.py)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    counted = getattr(type(base), "num_parameters", None)
    if counted is None or "num_parameters" in base.__dict__:
        return

    def num_parameters(only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        skip = {f"{n}.weight" for n, m in base.named_modules() if isinstance(m, nn.Embedding)} \
            if exclude_embeddings else set()
        return counted(base, only_trainable=only_trainable, exclude_embeddings=exclude_embeddings) + sum(
            p.ds_numel - p.numel() for n, p in base.named_parameters()
            if hasattr(p, "ds_numel") and n not in skip and (p.requires_grad or not only_trainable))

    base.__dict__["num_parameters"] = num_parameters
    undo.callback(base.__dict__.pop, "num_parameters", None)


def _refuse_late_optimizers(engine: Engine, pager: WeightPager, undo: contextlib.ExitStack) -> None:
    """wrap was given no optimizer: one made afterwards would step the paged weights' empty placeholders, so any
    optimizer's step over one of them is refused (their gradients may still be computed and read, as p.grad shows)."""
    paged = weakref.WeakValueDictionary((id(p), p) for p in pager.paged_parameters() if p.requires_grad)
    if paged:
        h = register_optimizer_step_pre_hook(lambda opt, *_: _refuse_step_of_paged(opt, paged))
        undo.callback(h.remove)
        weakref.finalize(engine, h.remove)  # (a wrapped model dropped without unwrap)


def _refuse_step_of_paged(optimizer: torch.optim.Optimizer, paged: weakref.WeakValueDictionary) -> None:
    if any(paged.get(id(p)) is p for g in optimizer.param_groups for p in g["params"]):
        raise RuntimeError("trainstream_hf: this optimizer steps weights the engine pages (outside their block's use "
                           "their data is an empty placeholder), but wrap() was given no optimizer: pass it, "
                           "wrap(model, optimizer, ...), and the engine updates them in host RAM; or page_weights=False")


def _guard_layout(model: nn.Module, blocks, undo: contextlib.ExitStack) -> None:
    """The plan placed every tensor of the model (device, host pages, dtype) and the engine holds views and copies of
    them: calls that would move, cast, resize, copy or (PEFT) merge the model are refused in one line saying what to do,
    instead of leaving a model whose next step fails far away (a dtype mismatch in a matmul, a paged placeholder) or
    trains a copy the engine does not see. A ``.to()`` that changes nothing (Accelerate's device placement on the same
    device) still passes."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    # the model, its PEFT base and every module holding the blocks (``model.model``, ``model.model.layers``)
    ids = {id(b) for b in blocks}
    names = [n for n, m in model.named_modules() if id(m) in ids]
    holders = {n.rsplit(".", i)[0] for n in names for i in range(1, n.count(".") + 1)}
    guarded = {id(model): model, id(base): base,
               **{id(m): m for n, m in model.named_modules() if n in holders}}
    for m in guarded.values():
        _set_instance_attr(m, "_apply", functools.partial(_refuse_apply, m, m._apply), undo)
        _set_instance_attr(m, "__deepcopy__", functools.partial(_refuse_deepcopy, m), undo)
    if hasattr(base, "resize_token_embeddings"):
        _set_instance_attr(base, "resize_token_embeddings", _refuse_resize, undo)
    if base is not model:  # PEFT: merging rewrites the base layers the engine pages and hooks
        tuner = getattr(model, "base_model", None)
        for m in (model, tuner):
            for name in ("merge_and_unload", "merge_adapter", "unload"):
                if m is not None and hasattr(m, name):
                    _set_instance_attr(m, name, functools.partial(_refuse_merge, name), undo)


def _set_instance_attr(obj, name: str, value, undo: contextlib.ExitStack) -> None:
    undo.callback(_restore_attr, obj, name, obj.__dict__.get(name, _MISSING))
    obj.__dict__[name] = value


def _refuse_apply(module: nn.Module, original, fn, *args, **kwargs):
    # A QuantLinear's packed codes and scales keep their dtype through a cast (QuantLinear._apply): only a move
    # changes them. So a model.to(its own dtype) passes, as it would unwrapped.
    packed = {id(getattr(m, n)) for m in module.modules() if isinstance(m, QuantLinear) for n in m._packed_names}
    kinds = {(t.dtype if id(t) not in packed else None, t.device)
             for t in itertools.chain(module.parameters(), module.buffers())}
    for dtype, device in kinds:
        probe = torch.empty(0, dtype=dtype or torch.uint8, device=device)  # uint8: no cast reaches it
        out = fn(probe)
        if not isinstance(out, torch.Tensor) or out.dtype != probe.dtype or out.device != device:
            raise RuntimeError(
                f"trainstream_hf: this model is wrapped, and moving or casting it ({probe.dtype} on {device} -> "
                f"{getattr(out, 'dtype', '?')} on {getattr(out, 'device', '?')}) would leave the engine's copies "
                "behind; call trainstream_hf.unwrap(model) first, or move or cast it before wrap()")
    return original(fn, *args, **kwargs)


def _refuse_deepcopy(module: nn.Module, memo):
    raise RuntimeError("trainstream_hf: a wrapped model cannot be deep-copied (its engine holds pinned host memory, "
                       "streams and hooks); copy it before wrap(), or call trainstream_hf.unwrap(model) first")


def _refuse_merge(name: str, *args, **kwargs):
    raise RuntimeError(f"trainstream_hf: {name}() on a wrapped model: merging rewrites the base layers the engine "
                       f"pages and hooks; call trainstream_hf.unwrap(model) first, then {name}()")


def _refuse_resize(*args, **kwargs):
    raise RuntimeError("trainstream_hf: resize_token_embeddings on a wrapped model: the plan placed the embeddings; "
                       "resize before wrap(), or unwrap, resize and wrap again")


def _track_masters(model: nn.Module, opt: OffloadedAdamW, undo: contextlib.ExitStack) -> None:
    """``state_dict()`` after the optimizer's step is in (an overlapped one included), and ``load_state_dict()``
    into the parameters that the optimizer keeps fp32 masters of makes it read them again: otherwise its next step
    would write the old weights back over the loaded ones (the Trainer's ``load_best_model_at_end``). Paged weights
    are read and written in their host copies by the pager's own hooks on their blocks
    (``WeightPager.track_state_dict``), which run inside these."""
    ref = weakref.ref(opt)  # the model's hook dicts must not keep the optimizer alive
    named = list(model.named_parameters())
    loading: list = []

    def before_save(module, prefix, keep_vars):
        if (o := ref()) is not None:
            o.publish()  # (optimizer_staleness=1: the update still pending goes into the weights first)

    def before_load(module, state_dict, prefix, *args):
        if (o := ref()) is not None:
            o.synchronize()
        loading[:] = [p for n, p in named if prefix + n in state_dict]

    def after_load(module, incompatible_keys):
        params, loading[:] = list(loading), []
        if (o := ref()) is not None and params:
            o.reload_masters(params)

    for h in (model.register_state_dict_pre_hook(before_save), model.register_load_state_dict_pre_hook(before_load),
              model.register_load_state_dict_post_hook(after_load)):
        undo.callback(h.remove)


def wrap(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
         config: TrainStreamConfig | None = None, **options):
    """Installs the offload engine on ``model`` (and ``optimizer``); the training loop stays unchanged.

    All or nothing: if any step fails, everything done so far is undone before the error propagates, and the
    model (its layers, parameters and where they live, hooks) and the optimizer are exactly as given.

    Args:
        model: a transformers causal LM (or a PEFT model around one) on its compute device (a GPU, or
            ``cpu``), or in host RAM with ``device="cuda"`` when it is larger than the GPU. Its repeated
            blocks are found automatically.
        optimizer: the user's ``torch.optim.AdamW`` / ``Adam`` over the model's parameters, or None.
        config: a :class:`TrainStreamConfig`; ``options`` override its fields (or build one).
        **options: any :class:`TrainStreamConfig` field, e.g. ``vram_budget="24GiB"``.

    Returns:
        ``(model, optimizer)``: the same model object with the engine's hooks, and the optimizer to use from
        now on (an :class:`OffloadedAdamW` sharing the user's param groups when the plan offloads optimizer
        state, else the user's optimizer). ``model.trainstream_stats()`` gives the last step's figures and
        ``model.trainstream_plan`` the plan.

    ``optimizer`` may be the optimizer an earlier ``wrap`` returned whose model was unwrapped since: the user's
    optimizer behind it is wrapped again and goes on from that engine's state (moments, step counts), as the plain
    optimizer used again would.

    Raises:
        RuntimeError: the model is already wrapped.
        ValueError: the optimizer an earlier ``wrap`` returned while its model is still wrapped; a model the engine
            does not train (encoder-decoder, no repeated blocks, weights on ``meta``);
            ``grads="device"`` when the plan pages trainable weights; (several processes) the model is already
            inside DistributedDataParallel, ``grads="host"``, ``optimizer_in_backward``, trainable paged weights,
            or the processes planned differently (``engine/distributed.py``); ``optimizer_in_backward`` with
            paged trainable weights.
        BudgetError: the model cannot be trained within ``vram_budget``.
        HostMemoryError: the host cannot hold what the plan puts there (checked before pinning).
    """
    carried = None
    if isinstance(optimizer, OffloadedAdamW):
        if not optimizer.released:
            raise ValueError("wrap: this optimizer is the one an earlier wrap returned, and its model is still "
                             "wrapped; unwrap that model first, or pass a torch.optim optimizer")
        optimizer, carried = optimizer.handed_back()
    config, dp_group = _configure(model, optimizer, config, options)
    # peer: one host copy of a frozen paged base per host (engine/peer.py); a collective, on every rank of the group
    peers = Peers.find(dp_group, config.peer)
    engine = Engine(model, config, optimizer)
    s = _Setup(model, config, optimizer is not None, dp_group, keep=[])
    with contextlib.ExitStack() as undo:
        _prepare(s, undo)
        pl = _make_plan(s)
        _allocate(engine, s, pl, peers, undo)
        _install(engine, s, pl, peers, undo)
        if carried is not None:
            if not isinstance(engine.optimizer, OffloadedAdamW):  # (the fp32 masters are the engine's alone)
                carried = {**carried, "state": {k: {n: v for n, v in st.items() if n != "master"}
                                                for k, st in carried["state"].items()}}
            engine.optimizer.load_state_dict(carried)
        for k in s.keep:
            k.commit()  # wrap succeeded: the quantized layers and the new placement stay
        engine._undo = undo.pop_all()
    return model, engine.optimizer


def plan(model: nn.Module, batch_shape: tuple[int, int] | None = None, config: TrainStreamConfig | None = None,
         **options) -> planner.Plan:
    """The plan :func:`wrap` would install for ``model`` with an optimizer, from the same steps (the block is
    measured, quantization applied); everything is undone before it returns, so the model is as given.

    Args:
        model: as for :func:`wrap`.
        batch_shape: (batch, sequence) to plan for; default the config's, else (1, the model's context up to 2048).
        config, **options: as for :func:`wrap`.

    On a wrapped model, with no other argument: the plan installed (``model.trainstream_plan``).
    """
    engine = engine_of(model)
    if engine is not None:
        if batch_shape is None and config is None and not options:
            return engine.plan
        raise RuntimeError("plan: this model is wrapped, and its plan is model.trainstream_plan (trainstream_hf.plan("
                           "model) gives it too); to plan it with other options, call trainstream_hf.unwrap(model) "
                           "first")
    if batch_shape is not None:
        options = {**options, "batch_shape": tuple(batch_shape)}
    config, dp_group = _configure(model, None, config, options)
    s = _Setup(model, config, True, dp_group, keep=[])
    with contextlib.ExitStack() as undo:
        _prepare(s, undo)
        return _make_plan(s)


def unwrap(model: nn.Module) -> nn.Module:
    """Removes the engine from ``model``: every parameter back on the device with its trained value.

    The optimizer returned by :func:`wrap` must not be stepped afterwards.
    """
    engine = engine_of(model)
    if engine is None:
        raise RuntimeError("unwrap: this model was not wrapped by trainstream_hf.wrap")
    return engine.unwrap()
