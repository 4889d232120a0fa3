"""wrap(model, optimizer, **options): install the engine; the training loop stays as it was.

``wrap`` finds the model's blocks, makes a :class:`~trainstream_hf.planner.Plan` for the VRAM budget, and
installs what the plan asks for: a weight pager and an activation offloader on the blocks (sharing one set
of block hooks), and an :class:`~trainstream_hf.engine.optimizer.OffloadedAdamW` in place of the user's
AdamW. ``unwrap`` takes it all out again and leaves an ordinary model holding the trained weights.
"""
from __future__ import annotations

import os
import time
import weakref
from dataclasses import replace

import torch
from torch import nn

from trainstream_hf import planner
from trainstream_hf.config import TrainStreamConfig, parse_bytes
from trainstream_hf.engine import distributed as data_parallel
from trainstream_hf.engine.activations import ActivationOffloader
from trainstream_hf.engine.allocator import enable_expandable_segments, wants_expandable_segments
from trainstream_hf.engine.arena import HostArena
from trainstream_hf.engine.casts import CastSources
from trainstream_hf.engine.norms import FusedNorms
from trainstream_hf.engine.gcstats import GcPauses
from trainstream_hf.engine.head import chunked_causal_lm_loss
from trainstream_hf.engine.blocks import find_blocks
from trainstream_hf.engine.hooks import BlockHooks, BlockListener
from trainstream_hf.engine.optimizer import OffloadedAdamW
from trainstream_hf.engine.peer import Peers
from trainstream_hf.engine.streams import TransferStreams
from trainstream_hf.engine.trace import Timeline
from trainstream_hf.engine.weights import WeightPager, block_bytes, select_params
from trainstream_hf.quant.model import quantize_frozen_base

__all__ = ["wrap", "unwrap", "Engine", "engine_of"]

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
    """Everything ``wrap`` installed on one model; reach it with :func:`engine_of`."""

    def __init__(self, model: nn.Module, config: TrainStreamConfig, plan: planner.Plan, *, streams, arena,
                 hooks, pager, offloader, optimizer, user_optimizer):
        self.model, self.config, self.plan = model, config, plan
        self.streams, self.arena, self.hooks = streams, arena, hooks
        self.pager, self.offloader, self.optimizer = pager, offloader, optimizer
        self.user_optimizer = user_optimizer
        self.steps = 0
        self.expandable_segments = False  # wrap() switched the CUDA allocator to expandable segments
        self.shared_host = None  # the host copy of frozen paged weights shared with this host's other processes
        self._t0: float | None = None
        # With an optimizer, a step is an optimizer step (all its micro-batches): the window opens at the first
        # forward and closes when step() returns. Without one, each forward pass starts a new window.
        self._step_hook = None
        if optimizer is not None and hasattr(optimizer, "register_step_post_hook"):
            self._step_hook = optimizer.register_step_post_hook(lambda *_: self._end_step())
        self._last: dict = {}
        trace_path = os.environ.get("TRAINSTREAM_TRACE") or None
        self.timeline = Timeline(streams.device, trace_path) if (trace_path or config.timeline) else None
        streams.timeline = self.timeline
        hooks.add(_StepClock(self))
        self._gc = GcPauses().start()  # Python GC pauses per step (engine/gcstats.py)
        # A model dropped without unwrap must not leave the counter in gc.callbacks for the life of the process.
        weakref.finalize(self, self._gc.stop)

    # -- statistics -------------------------------------------------------------------------------
    def _begin_step(self) -> None:
        now = time.perf_counter()
        if self._t0 is not None:
            if self._step_hook is not None:
                return  # the window is the optimizer step: further micro-batches belong to it
            self._close_step(now)
        self._t0 = now
        self._gc.take()
        if self.streams.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.streams.device)
        if self.timeline is not None:
            self.timeline.start_step()

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
        self._last = s
        self.steps += 1

    def stats(self) -> dict:
        """Figures of the last completed step (H2D / D2H bytes and GB/s, peak VRAM, arena use, per part).

        A step is an optimizer step: from the first forward after the previous ``optimizer.step()`` (every
        micro-batch of a gradient accumulation included) until ``step()`` returns; wrapped without an
        optimizer, from one forward of block 0 to the next. To report a per-step peak the engine resets CUDA's
        peak-memory statistics at each step start (``torch.cuda.reset_peak_memory_stats``)."""
        return dict(self._last)

    # -- checkpointed blocks -----------------------------------------------------------------------
    def install_recompute(self, blocks, indices) -> None:
        """Turns on transformers' own gradient checkpointing (non-reentrant) for the chosen blocks only, the
        way ``model.gradient_checkpointing_enable()`` does for all of them (``GradientCheckpointingLayer``'s
        ``gradient_checkpointing`` flag and ``_gradient_checkpointing_func``); unwrap restores them."""
        import functools

        from torch.utils.checkpoint import checkpoint

        self._recompute_saved = []
        for i in indices:
            layer = blocks[i]
            self._recompute_saved.append((layer, layer.__dict__.get("gradient_checkpointing", _MISSING),
                                          layer.__dict__.get("_gradient_checkpointing_func", _MISSING)))
            layer.gradient_checkpointing = True
            layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)

    def _restore_recompute(self) -> None:
        for layer, flag, func in getattr(self, "_recompute_saved", []):
            for name, old in (("gradient_checkpointing", flag), ("_gradient_checkpointing_func", func)):
                if old is _MISSING:
                    layer.__dict__.pop(name, None)
                else:
                    setattr(layer, name, old)
        self._recompute_saved = []

    # -- overlapped optimizer step -------------------------------------------------------------------
    def install_step_overlap(self, blocks) -> None:
        """The next forward waits for each offloaded parameter's new value just before it is used: the
        non-block ones (embeddings, head) when the model's forward starts, block i's at block i. The end of
        the forward waits for the CPU step to finish, so backward never races it."""
        opt = self.optimizer
        block_params = [list(b.parameters()) for b in blocks]
        in_blocks = {id(p) for ps in block_params for p in ps}
        other = [p for p in self.model.parameters() if id(p) not in in_blocks]
        # Embeddings and head first (the forward needs the embedding before block 0), then block by block.
        opt.set_step_order(other + [p for ps in block_params for p in ps])
        self._overlap_handles = [
            self.model.register_forward_pre_hook(lambda m, a: opt.wait_for(other)),
            self.model.register_forward_hook(lambda m, a, o: opt.synchronize(), always_call=True)]
        self._step_waiter = _StepWaiter(opt, block_params)
        self.hooks.add(self._step_waiter)

    # -- removal ----------------------------------------------------------------------------------
    def unwrap(self) -> nn.Module:
        if isinstance(self.optimizer, OffloadedAdamW):
            self.optimizer.release()  # fp32 masters -> sinks / device params
        if self.pager is not None:
            self.pager.unwrap()  # host copies (updated by the optimizer through the sinks) -> device
        self.shared_host = None  # the shared segment is unmapped with its last view
        if getattr(self, "ddp_ignore", None) is not None:
            data_parallel.restore_ddp_ignore(self.model, self.ddp_ignore[0])
        if self.offloader is not None:
            self.offloader.close()
        if getattr(self, "casts", None) is not None:
            self.casts.uninstall()
        if getattr(self, "norms", None) is not None:
            self.norms.uninstall()
        _remove_chunked_loss(getattr(self, "loss_owner", None))
        for h in getattr(self, "_overlap_handles", []):
            h.remove()
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        self._gc.stop()
        self._restore_recompute()
        self.hooks.remove()
        self.streams.timeline = None
        self.streams.synchronize()
        self.arena.close()  # pinned slabs go back once the last tensor in them (e.g. optimizer state) dies
        for name in (_ATTR, "trainstream_stats", "trainstream_plan"):
            self.model.__dict__.pop(name, None)
        return self.model


def _install_chunked_loss(model: nn.Module) -> nn.Module | None:
    """Sets the chunked loss on the transformers model inside ``model`` when it uses transformers' own
    ``ForCausalLMLoss`` (and no loss of the user's); returns that model, or None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if "_loss_function" in base.__dict__ or not hasattr(type(base), "loss_function"):
        return None
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    if base.loss_function is not ForCausalLMLoss:
        return None
    base.__dict__["_loss_function"] = chunked_causal_lm_loss
    return base


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


def _default_batch_shape(model: nn.Module) -> tuple[int, int]:
    cfg = getattr(model, "config", None)
    return (1, min(2048, getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", 2048)))


def _plan_or_none(make_plan, activation_bytes):
    try:
        return make_plan(activation_bytes)
    except planner.BudgetError:
        return None


def wrap(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
         config: TrainStreamConfig | None = None, **options):
    """Installs the offload engine on ``model`` (and ``optimizer``); the training loop stays unchanged.

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

    Raises:
        RuntimeError: the model is already wrapped.
        ValueError: (several processes) the model is already inside DistributedDataParallel, ``grads="host"``,
            ``optimizer_in_backward``, trainable paged weights, or the processes planned differently
            (``engine/distributed.py``); ``optimizer_in_backward`` with paged trainable weights.
        BudgetError: the model cannot be trained within ``vram_budget``.
        HostMemoryError: the host cannot hold what the plan puts there (checked before pinning).
    """
    data_parallel.check_not_ddp(model)
    if engine_of(model) is not None:
        raise RuntimeError("wrap: this model is already wrapped; call trainstream_hf.unwrap(model) first")
    config = replace(config, **options) if config is not None else TrainStreamConfig(**options)
    if optimizer is not None:
        own = {id(p) for p in model.parameters()}
        foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in own)
        if foreign:
            raise ValueError(f"wrap: the optimizer holds {foreign} tensor(s) that are not parameters of this model; "
                             "build it from this model's parameters (e.g. model.parameters())")
    # Several processes: DDP averages gradients on the device, so the plan counts them there (engine/distributed.py).
    dp_group = data_parallel.process_group(config.data_parallel, config.grads)
    if dp_group is not None and config.optimizer_in_backward:
        raise ValueError("optimizer_in_backward cannot be used with several processes (DistributedDataParallel): it "
                         "needs host gradients, which DDP's reducer would never see (engine/distributed.py); turn it "
                         "off (or data_parallel=False if the processes train independent models)")
    # peer: one host copy of a frozen paged base per host (engine/peer.py); a collective, on every rank of the group
    peers = Peers.find(dp_group, config.peer)
    if dp_group is not None and config.grads == "auto":
        config = replace(config, grads="device")
    if config.optimizer_in_backward and config.grads == "auto":
        config = replace(config, grads="host")  # the updates start from the host-mode gradient hook
    if config.outliers and config.quantize is None:
        raise ValueError(f"outliers={config.outliers} protects the input channels of quantized layers: "
                         "set quantize too")
    if config.quantize is not None:
        # The frozen linear layers (a PEFT model's base; never a trainable layer or the output head) are packed in
        # place, one at a time, before the plan measures anything. This is not undone if wrap fails later.
        quantize_frozen_base(model, config.quantize, config.outliers)
    device = _compute_device(model)
    if config.device is not None:
        device = torch.device(config.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    blocks = find_blocks(model)
    batch_shape = config.batch_shape or _default_batch_shape(model)
    block_set = {id(m) for b in blocks for m in b.modules()}
    _move_outside_blocks(model, block_set, device)
    # The second block is measured (the forward runs up to its end): the first one's input needs no gradient
    # when the embedding is frozen, so it saves less than every later block. Measured, not estimated: the
    # analytic formula missed LoRA's and the norms' saved tensors by ~40% on the H200 (benchmarks/NOTES.md).
    probe = min(1, len(blocks) - 1)
    homes = [{p.device for p in b.parameters()} for b in blocks[:probe + 1]]
    for b, home in zip(blocks, homes):
        if home != {device}:
            b.to(device)  # for the measurement only; the plan decides where it lives
    loss_owner = _install_chunked_loss(model) if config.chunked_loss else None
    norms = None
    if config.fused_norms:  # before the block is measured: the fused norm saves less
        norms = FusedNorms()
        try:
            norms.install(model.modules())
        except BaseException:
            norms.uninstall()
            _remove_chunked_loss(loss_owner)
            raise
    casts = None
    if config.elide_casts:
        casts = CastSources()
        if not casts.install(m for b in blocks for m in b.modules()):
            casts = None
    try:
        m = planner.measure_block(model, blocks[probe], batch_shape, device, casts=casts)
        head = planner.measure_head(model, batch_shape, device)
        for b, home in zip(blocks, homes):
            if home != {device}:
                b.to(next(iter(home)) if len(home) == 1 else "cpu")

        def make_plan(activation_bytes):
            return planner.plan(
                model, list(blocks), batch_shape=batch_shape, vram_budget=config.vram_budget, device=device,
                offload_optimizer=config.offload_optimizer if optimizer is not None else False,
                grads=config.grads, offload_activations=config.offload_activations,
                page_weights=config.page_weights, slots=config.slots, prefetch=config.prefetch,
                min_offload_numel=config.min_offload_numel, recompute=config.recompute,
                activation_bytes=activation_bytes, input_bytes=None if m is None else m.input_bytes,
                forward_seconds=None if m is None else m.forward_seconds, head_bytes=head)

        pl = make_plan(None if m is None else m.activation_bytes)
        if config.elide_casts == "auto" and casts is not None and m is not None and \
                m.raw_activation_bytes <= m.activation_bytes:
            # Nothing to elide (no widening cast saved: bf16 autocast, or LoRA's native path, which saves the
            # narrow input itself): the hooks would cost a Python call per saved tensor for nothing.
            casts.uninstall()
            casts = None
        elif config.elide_casts == "auto" and casts is not None and m is not None:
            # Cast elision only saves memory, and costs a Python hook per saved tensor plus a cast per saved copy in
            # backward (8B nf4 LoRA on the H200: 256 casts and ~1500 hooked tensors per step, with 5.7 GiB of the
            # budget unused). Without it, if every block still keeps its activations and weights on the device.
            plain = _plan_or_none(make_plan, m.raw_activation_bytes)
            if plain is not None and not (plain.paged_blocks or plain.offloaded_activation_blocks
                                          or plain.recomputed_blocks) and \
                    (plain.offload_optimizer, plain.grads) == (pl.offload_optimizer, pl.grads):
                casts.uninstall()
                casts, pl = None, plain
        streams = TransferStreams(device)
        arena = HostArena(config.host_arena if config.host_arena not in (None, 0) else "auto",
                          pinned=None if config.host_arena not in (None, 0) else False,
                          slab_bytes=config.host_arena_slab, pageable_fallback=config.pageable_fallback)
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
            arena.close()
            raise ValueError(f"host_arena={config.host_arena!r} reserves {arena.stats()['reserved']} bytes but the "
                             f"plan puts {pl.host_bytes()} bytes in host RAM; raise host_arena, use 'auto', or set "
                             "pageable_fallback=True")
    except BaseException:
        if casts is not None:
            casts.uninstall()
        if norms is not None:
            norms.uninstall()
        _remove_chunked_loss(loss_owner)
        raise
    hooks = BlockHooks(blocks)
    pager = offloader = shared = None
    new_opt = optimizer
    ddp_hidden, ddp_ignore = False, None  # whether (and over what) hide_frozen_from_ddp set DDP's ignore list
    try:
        expandable = (wants_expandable_segments(config.expandable_segments, device, bool(pl.paged_blocks))
                      and enable_expandable_segments())
        # Small trainable parameters (LoRA adapters, norms of a full fine-tune) stay on the device with the
        # device optimizer: paging them would save little and put them on the CPU optimizer.
        paged_filter = lambda n, p: not p.requires_grad or p.numel() >= pl.min_offload_numel  # noqa: E731
        if peers is not None:
            # Every rank allocates (a collective), paging or not: a rank that planned differently gets no sharing
            # here and the plan check below raises on all of them.
            sizes = {}
            if pl.paged_blocks:
                selected, _ = select_params(hooks, pl.paged_blocks, device, paged_filter)
                sizes = {i: block_bytes(ps) for i, ps in selected.items() if not any(p.requires_grad for p in ps)}
            shared = peers.allocate(sizes, pin=arena.pinned)
        failure = None
        try:
            if pl.paged_blocks:
                pager = WeightPager(hooks, streams, arena, blocks=pl.paged_blocks, slots=pl.slots,
                                    prefetch=pl.prefetch, param_filter=paged_filter,
                                    host_buffers=shared.views if shared is not None else None,
                                    fill_host_buffers=shared is None or shared.writer)
        except BaseException as e:
            failure = e
        if peers is not None:
            peers.agree(failure)  # raises on every rank when the pager failed on one
        elif failure is not None:
            raise failure
        # Whatever the pager did not take (unpaged blocks, small trainable parameters, buffers) goes to the
        # compute device; paged parameters are device placeholders already, so .to() leaves them alone.
        for b in blocks:
            b.to(device)
        if pl.offloaded_activation_blocks or casts is not None:
            offloader = ActivationOffloader(hooks, streams, arena, blocks=pl.offloaded_activation_blocks,
                                            min_bytes=parse_bytes(config.min_activation_bytes), casts=casts,
                                            prefetch=pl.activation_prefetch())
        names = dict((id(p), n) for n, p in model.named_parameters())
        paged = set(map(id, pager.paged_parameters())) if pager is not None else set()
        offload = []
        if optimizer is not None:
            wanted = set(pl.offload_optimizer)
            offload = [p for g in optimizer.param_groups for p in g["params"]
                       if names.get(id(p)) in wanted or (id(p) in paged and p.requires_grad)]
        if dp_group is not None:
            # Every rank checks the same plan first, so that a refusal below is raised on all of them at once; the
            # broadcast comes before the optimizer reads its fp32 masters from the parameters.
            paged_params = pager.paged_parameters() if pager is not None else []
            data_parallel.check_same_plan({"paged": sorted(names.get(id(p), "?") for p in paged_params),
                                           "offloaded": sorted(names.get(id(p), "?") for p in offload),
                                           "grads": pl.grads}, device, dp_group)
            data_parallel.check_no_trainable_paged(model, paged_params)
            # A process that maps a host copy another one fills (peer) does not write into it.
            host = [pager.host_tensor(p) for p in paged_params]
            reads = [shared is not None and not shared.writer and shared.holds(t) for t in host]
            data_parallel.broadcast_from_rank0(host + [p.data for p in offload], device, dp_group,
                                               write=[not r for r in reads] + [True] * len(offload))
            ddp_ignore = data_parallel.hide_frozen_from_ddp(model, paged_params, device, dp_group)
            ddp_hidden = True
            if peers is not None:
                peers.barrier()  # the leaders' writes into shared host memory are done before any process reads
        if optimizer is not None:
            if offload:
                sinks = {p: pager.host_tensor(p) for p in offload if id(p) in paged}
                grads_mode = "host" if (pl.grads == "host" or sinks) else "device"
                pl.grads = grads_mode
                overlap = config.overlap_step
                if overlap == "auto":
                    # in backward, the updates run on the step's worker thread on the CPU device too
                    overlap = (streams.is_cuda or config.optimizer_in_backward) and not sinks
                new_opt = OffloadedAdamW(optimizer, offload, arena=arena, streams=streams, grads=grads_mode,
                                         param_sink=sinks, overlap_step=bool(overlap),
                                         optimizer_in_backward=config.optimizer_in_backward)
    except BaseException:
        # Nothing half-installed survives a failed wrap: the model goes back to how it came in.
        if ddp_hidden:
            data_parallel.restore_ddp_ignore(model, ddp_ignore)
        if pager is not None:
            pager.unwrap()
        if offloader is not None:
            offloader.close()
        if casts is not None:
            casts.uninstall()
        if norms is not None:
            norms.uninstall()
        _remove_chunked_loss(loss_owner)
        hooks.remove()
        arena.close()
        raise
    engine = Engine(model, config, pl, streams=streams, arena=arena, hooks=hooks, pager=pager,
                    offloader=offloader, optimizer=new_opt, user_optimizer=optimizer)
    engine.casts = casts
    engine.norms = norms
    engine.shared_host = shared
    engine.ddp_ignore = (ddp_ignore,) if ddp_hidden else None  # unwrap puts DDP's ignore list back
    engine.expandable_segments = expandable
    engine.loss_owner = loss_owner
    engine.install_recompute(blocks, pl.recomputed_blocks)
    if isinstance(new_opt, OffloadedAdamW) and new_opt.overlap_step:
        engine.install_step_overlap(blocks)
    model.__dict__[_ATTR] = engine
    model.__dict__["trainstream_stats"] = engine.stats
    model.__dict__["trainstream_plan"] = pl
    return model, new_opt


def unwrap(model: nn.Module) -> nn.Module:
    """Removes the engine from ``model``: every parameter back on the device with its trained value.

    The optimizer returned by :func:`wrap` must not be stepped afterwards.
    """
    engine = engine_of(model)
    if engine is None:
        raise RuntimeError("unwrap: this model was not wrapped by trainstream_hf.wrap")
    return engine.unwrap()
