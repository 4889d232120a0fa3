"""The plan: where each block's weights, activations, gradients and optimizer state live for a VRAM budget.

``plan()`` takes, per block, the bytes of weights (in their device dtype), trainable parameters and saved
activations for one micro-batch (measured by :func:`measure_block` when ``wrap`` calls it; an analytic
estimate otherwise), then moves things off the device, cheapest first, until the predicted peak plus a
margin fits the budget:

1. optimizer state (fp32 master, exp_avg, exp_avg_sq) of large trainable parameters: no extra PCIe bytes
   beyond the gradient and the refreshed weight, but CPU AdamW time;
2. their gradients (device -> host as soon as each is accumulated);
3. saved activations: the last blocks keep theirs; before them every s-th block is offloaded, s chosen so
   one block's copy hides under the forward of s blocks (measured block forward time x PCIe bandwidth),
   and the others are checkpointed (one extra block forward each); as few as possible leave the device;
4. weights, block by block (up in forward and again in backward, less the blocks still resident).

``print(plan)`` shows the table and the predicted peak; the engine reports the measured peak beside it.

One file, past 600 lines: the memory model (:class:`Plan`'s moments), the measurements that feed it and the
decisions that move things off the device have to agree byte for byte; they are read and changed together.
"""
from __future__ import annotations

import copy
import math
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Sequence

import torch
from torch import nn

from trainstream_hf.config import parse_bytes
from trainstream_hf.engine.activations import Prefetch
from trainstream_hf.engine.device_adamw import DEFAULT_CHUNK_NUMEL
from trainstream_hf.engine.weights import block_bytes

__all__ = ["BlockPlan", "Plan", "BudgetError", "BlockMeasure", "plan", "resolve_budget", "measure_block", "head_weight",
           "measure_activation_bytes", "activation_bytes_per_token", "measure_head", "pages_param", "page_filter",
           "format_bytes", "measure_backward_extra"]

GiB = 2**30
# Parameters smaller than this stay with the device optimizer even when optimizer state is offloaded:
# LoRA adapters, norms and biases cost more in per-tensor overhead than they save.
MIN_OFFLOAD_NUMEL = 1 << 20
# Pinned copy bandwidth used for the plan's time estimates (GPU.md: 53-55 GB/s one way on PCIe Gen5 x16).
DEFAULT_PCIE_BPS = 50e9
DEFAULT_CPU_ADAM_PPS = 3.4e9
# Device memory kept free for cuBLAS / attention workspaces and allocator fragmentation.
DEFAULT_MARGIN = GiB
# The optimizer's device share fills what the plan leaves spare but this fraction of the budget: an error in the
# predicted peak then costs speed (a smaller share), not an out-of-memory error.
DEVICE_SHARE_RESERVE = 0.05


class BudgetError(MemoryError):
    """The model cannot be trained in the given VRAM budget even with everything in host RAM."""


def pages_param(p: nn.Parameter, min_offload_numel: int) -> bool:
    """Whether paging a block moves ``p`` to host RAM: every frozen parameter, and a trainable one of at least
    ``min_offload_numel`` elements. Smaller trainable ones (LoRA adapters, norms, biases) stay on the device with the
    device optimizer: paging them would save little and put them on the CPU optimizer. The weight pager also leaves
    a parameter shared beyond its block on the device (``engine.weights.select_params``)."""
    return not p.requires_grad or p.numel() >= min_offload_numel


def page_filter(min_offload_numel: int) -> Callable[[str, nn.Parameter], bool]:
    """:func:`pages_param` as the weight pager's ``param_filter(name, param)``."""
    return lambda name, p: pages_param(p, min_offload_numel)


@dataclass
class BlockPlan:
    """Placement of one block. Weights are on ``"device"`` or ``"host"``; activations on ``"device"``,
    ``"host"``, ``"recompute"`` (only the block's input is kept; the forward runs again in backward) or
    ``"recompute_host"`` (recomputed, and its input waits in host RAM: long sequences, where 32 blocks' inputs
    outgrow the GPU)."""

    index: int
    weight_bytes: int
    trainable_numel: int
    activation_bytes: int
    weights: str = "device"
    activations: str = "device"   # "device", "host" (offloaded), "recompute" (checkpointed) or "recompute_host"
    input_bytes: int = 0          # what a checkpointed block keeps: its input
    can_recompute: bool = False
    kept_bytes: int = 0           # held beside resident weights, none when paged (QuantLinear's transposed FP8 codes)
    # Paging moves only the parameters pages_param selects: their bytes in the pager's host buffer (its layout, with
    # aligned offsets; also a weight slot's size), and what the block's other parameters keep on the device.
    paged_bytes: int | None = None  # None: all of weight_bytes
    unpaged_bytes: int = 0

    def host_weight_bytes(self) -> int:
        """Bytes of this block's weights that live in host RAM once it is paged (the rest stays on the device)."""
        return self.weight_bytes if self.paged_bytes is None else self.paged_bytes

    def h2d_bytes(self) -> int:
        """Bytes this block sends up the link per step because of its placement: paged weights twice (forward,
        backward), activations in host RAM once (fetched for backward)."""
        return (2 * self.host_weight_bytes() if self.weights == "host" else 0) + self.host_activation_bytes()

    def pcie_bytes(self) -> int:
        """Bytes this block moves per step over PCIe because of its placement (not counting optimizer): what it
        sends up, and its activations' copy down in forward."""
        return self.h2d_bytes() + self.host_activation_bytes()

    def host_activation_bytes(self) -> int:
        """Bytes of this block's saved tensors that wait in host RAM (all of them, its input, or none)."""
        return self.activation_bytes if self.activations == "host" else \
            self.input_bytes if self.activations == "recompute_host" else 0


FILLS_BUDGET = 0.9  # a plan predicted (with its margin) at this fraction of its budget or more fills it


@dataclass
class Plan:
    """What wrap() installs. ``str(plan)`` is a readable table."""

    budget: int
    blocks: list[BlockPlan]
    offload_optimizer: list[str] = field(default_factory=list)  # parameter names
    grads: str = "device"
    slots: int = 0
    prefetch: int = 0
    fixed_bytes: int = 0          # non-block weights + device optimizer state: held for the whole step
    grad_bytes: int = 0           # gradients on the device at the end of backward
    # of grad_bytes, the host-gradient mode's allowance for gradients in flight to the host (one block's, or one
    # large non-block tensor's); the rest stay on the device until step(), across the micro-batches of a step
    inflight_grad_bytes: int = 0
    accumulation: int = 1         # micro-batches per optimizer step (gradient accumulation)
    logits_bytes: int = 0
    margin: int = DEFAULT_MARGIN
    pcie_bps: float = DEFAULT_PCIE_BPS
    cpu_adam_pps: float = DEFAULT_CPU_ADAM_PPS
    offload_numel: int = 0
    # of the offloaded parameters, those stepped on the device (engine/device_adamw.py): fp32 state resident there,
    # or kept in host RAM and streamed through a ring of device buffers; the rest are stepped on the CPU
    resident_optimizer: list[str] = field(default_factory=list)
    streamed_optimizer: list[str] = field(default_factory=list)
    resident_numel: int = 0
    streamed_numel: int = 0
    moment_bytes: int = 4  # per moment element on the host: 4 (float32) or 2 (bfloat16, optimizer_moments)
    # host bytes of the offloaded optimizer, counted per parameter from its dtype and placement (see
    # _optimizer_host_bytes); None: estimated from the element counts alone
    optimizer_host_bytes: int | None = None
    min_offload_numel: int = MIN_OFFLOAD_NUMEL
    forward_seconds: float | None = None  # one block's measured forward time
    # the optimizer steps each parameter as its gradient lands (optimizer_in_backward): the CPU share runs beside the
    # rest of the backward, recomputed forwards included
    in_backward: bool = False
    # the frozen input embedding's table kept in pinned host RAM, its rows read there by the device (host_embedding):
    # off the device, on the host
    host_embedding_bytes: int = 0
    # device bytes a block's backward allocates beyond what it had when it began (its saved tensors, its output's
    # gradient), at its worst moment, measured on CUDA (measure_block): the gradients of its intermediates, the
    # attention kernel's workspace, a tiled MLP's tile; 0 where unmeasured (the CPU). History: the 8B nf4 LoRA plan
    # undercounted its peak by 1.6 GiB at 32768 tokens and ran out of memory at 49152 and 65536 on an H100
    # (table-longest-llama3.1-8b-h100-84d38cc.json).
    backward_extra: int = 0

    # -- predictions ----------------------------------------------------------------------------
    @property
    def paged_blocks(self) -> list[int]:
        return [b.index for b in self.blocks if b.weights == "host"]

    @property
    def offloaded_activation_blocks(self) -> list[int]:
        """Blocks whose saved tensors go to host RAM (all of them, or a checkpointed block's input)."""
        return [b.index for b in self.blocks if b.activations in ("host", "recompute_host")]

    def _activation_rows(self) -> tuple[list[int], list[int]]:
        """Per block: the saved bytes that stay on the device from its forward until its backward (kept
        activations; a checkpointed block's input; nothing for an offloaded block), and the extra bytes while
        its backward runs (the recomputed or fetched activations)."""
        resident = [b.activation_bytes if b.activations == "device" else
                    b.input_bytes if b.activations == "recompute" else 0 for b in self.blocks]
        current = [0 if b.activations == "device" else
                   b.activation_bytes + (b.input_bytes if b.activations == "recompute_host" else 0)
                   for b in self.blocks]
        return resident, current

    def forward_backlog(self) -> int:
        """Bytes of offloaded activations still on the device at the end of the forward pass: the last
        offloaded block's, when the blocks after it run for less than its copy takes (unknown forward time:
        none)."""
        host = [b for b in self.blocks if b.host_activation_bytes()]
        if not host or self.forward_seconds is None:
            return 0
        last = host[-1]
        after = (len(self.blocks) - 1 - last.index) * self.forward_seconds * COPY_WINDOW
        return last.host_activation_bytes() if after < last.host_activation_bytes() / self.pcie_bps else 0

    def _moments(self) -> tuple[int, int, int]:
        """Activation-and-gradient bytes at the three moments that can be the peak: the end of the forward
        pass (beside the logits), the worst block of the backward pass, and the end of backward."""
        kept = sum(b.activation_bytes for b in self.blocks if b.activations == "device")
        one_host = max((b.host_activation_bytes() for b in self.blocks), default=0)
        rc_inputs = sum(b.input_bytes for b in self.blocks if b.activations == "recompute")
        # Forward: kept blocks come last; an offloaded block's activations are on the device while it computes
        # and while its copy runs (the plan spaces offloaded blocks so one copy is in flight at a time).
        forward = max(kept + rc_inputs + self.forward_backlog(), rc_inputs + 2 * one_host) + self.logits_bytes
        if self.accumulation > 1:  # from the second micro-batch on, the gradients held until step() are there too
            forward += self.held_grad_bytes()
        # Backward, block i: what lower blocks still hold, block i's own activations (recomputed or fetched),
        # block i-1's when offloaded (always fetched one block ahead; deeper prefetch stays within this bound),
        # and the gradients so far (bounded by all of them). The logits are gone by then.
        # Each block's backward also allocates backward_extra beyond what it held when it began.
        resident, current = self._activation_rows()
        extra = self.backward_extra
        backward, run = 0, 0
        if any(current):
            for i, (r, c) in enumerate(zip(resident, current)):
                run += r
                below = self.blocks[i - 1] if i else None
                nxt = below.host_activation_bytes() if below is not None else 0
                backward = max(backward, run + c + nxt + extra)
            backward += self.grad_bytes
        elif extra:  # every block's activations on the device: the last block's backward, the logits gone
            backward = sum(resident) + extra
        one_block = max((b.activation_bytes for b in self.blocks), default=0)
        return forward, backward, self.grad_bytes + one_block + extra

    def predicted_peak(self) -> int:
        """Predicted peak device bytes allocated during one training step (``max_memory_allocated``).

        Weights, slots and device optimizer state are held throughout; on top, the largest of the moments of
        :meth:`_moments`.
        """
        resident_w = sum(b.weight_bytes + b.kept_bytes if b.weights == "device" else b.unpaged_bytes
                         for b in self.blocks)
        paged = [b.host_weight_bytes() for b in self.blocks if b.weights == "host"]
        slot_bytes = self.slots * max(paged, default=0)
        return self.fixed_bytes + resident_w + slot_bytes + max(self._moments())

    def at_tokens(self, factor: float) -> "Plan":
        """This plan's placements with ``factor`` times the tokens per micro-batch it was made for: every block's
        activations and input, the logits and the backward's extra scaled by it (linear in the tokens, as with
        SDPA or flash attention; eager attention's scores grow faster). Weights, gradients and optimizer state do
        not change. What a forward longer than ``batch_shape`` would need, to warn before it runs out of memory."""
        blocks = [replace(b, activation_bytes=int(b.activation_bytes * factor), input_bytes=int(b.input_bytes * factor))
                  for b in self.blocks]
        return replace(self, blocks=blocks, logits_bytes=int(self.logits_bytes * factor),
                       backward_extra=int(self.backward_extra * factor))

    def held_grad_bytes(self) -> int:
        """Device bytes of the gradients that stay until ``step()``: all of them in device mode; in host mode, those of
        the parameters stepped on the device (its optimizer's, and the optimizer's device share)."""
        return self.grad_bytes - self.inflight_grad_bytes

    def activation_prefetch(self) -> Prefetch:
        """How far ahead backward may fetch offloaded activations without passing the predicted peak."""
        resident, current = self._activation_rows()
        return Prefetch(resident=resident, current=current, limit=max(self._moments()), grads=self.grad_bytes)

    def fits(self) -> bool:
        return self.predicted_peak() + self.margin <= self.budget

    def fills_budget(self) -> bool:
        """Whether the plan fills its budget: by design when it moves any block's weights or activations off the
        device (paged, offloaded or recomputed: made because the budget is short, and their step allocates
        blocks of changing sizes; at 65536 tokens an 8B LoRA plan predicted at 83% of 24 GiB ran out of memory
        with 1.81 GiB reserved but free, asking for 1 GiB: table-longest-llama3.1-8b-h100-2f4a7fd.json) or steps
        optimizer state on the device, or predicted (with its margin) at :data:`FILLS_BUDGET` of it or more (GRPO's
        alternating generation and training reached a 24 GiB cap in reserved memory at 94% predicted:
        recipes/grpo-llama3-8b-trainstream-h200-5cb2cc5.json)."""
        return self.moves_blocks or bool(self.resident_numel or self.streamed_numel) or \
            self.predicted_peak() + self.margin >= FILLS_BUDGET * self.budget

    def paged_bytes(self) -> int:
        """Host bytes of the paged blocks' weights, as the weight pager lays them out (its ``stats()['paged_bytes']``,
        which ``model.trainstream_stats()['weights']`` reports)."""
        return sum(b.host_weight_bytes() for b in self.blocks if b.weights == "host")

    def pcie_bytes(self) -> int:
        return sum(b.pcie_bytes() for b in self.blocks)

    def host_bytes(self) -> int:
        """Host RAM the plan puts in the arena: paged weights, every offloaded block's activations (all
        are on the host at the end of the forward pass) and, per offloaded parameter, the fp32 master,
        both moments and the fp32 gradient buffer (16 bytes) plus a 2-byte copy in the device dtype."""
        if self.optimizer_host_bytes is not None:
            optimizer = self.optimizer_host_bytes
        else:
            cpu = self.offload_numel - self.resident_numel - self.streamed_numel  # streamed: state only, 12 bytes
            per_cpu = 4 + 2 * self.moment_bytes + 4 + 2  # master, moments, the gradient buffer and the weight copy
            optimizer = per_cpu * cpu + 12 * self.streamed_numel + (2 * cpu if self.grads == "host" else 0)
        return (self.paged_bytes() + sum(b.host_activation_bytes() for b in self.blocks) + optimizer
                + self.host_embedding_bytes)

    @property
    def recomputed_blocks(self) -> list[int]:
        return [b.index for b in self.blocks if b.activations in ("recompute", "recompute_host")]

    @property
    def moves_blocks(self) -> bool:
        """Whether any block's weights or activations leave the device (paged, offloaded or recomputed)."""
        return any(b.weights != "device" or b.activations != "device" for b in self.blocks)

    def predicted_step_floor(self) -> float:
        """Lower bound on the step time from PCIe traffic and the CPU optimizer (seconds); a streamed parameter
        moves 12 bytes each way."""
        cpu = self.offload_numel - self.resident_numel - self.streamed_numel
        return max((self.pcie_bytes() + 12 * self.streamed_numel) / self.pcie_bps, cpu / self.cpu_adam_pps)

    def recompute_seconds(self) -> float | None:
        """Extra compute of the checkpointed blocks (one forward each), when the forward time is known."""
        if self.forward_seconds is None:
            return None
        return len(self.recomputed_blocks) * self.forward_seconds

    def __str__(self) -> str:
        mib = 2**20
        lines = [f"TrainStream plan: budget {self.budget / GiB:.2f} GiB, predicted peak "
                 f"{self.predicted_peak() / GiB:.2f} GiB, {len(self.paged_blocks)} blocks paged "
                 f"({format_bytes(self.paged_bytes())}), "
                 f"{self.slots} weight slots, prefetch {self.prefetch}, "
                 f"gradients on {self.grads}, {len(self.offloaded_activation_blocks)} blocks' activations in host RAM, "
                 f"{len(self.recomputed_blocks)} blocks recomputed, optimizer state of "
                 f"{len(self.offload_optimizer)} parameters "
                 f"({self.offload_numel / 1e6:.1f} M) offloaded"
                 + (f" (stepped on the device: {self.resident_numel / 1e6:.1f} M resident, "
                    f"{self.streamed_numel / 1e6:.1f} M streamed)" if self.resident_numel or self.streamed_numel
                    else "")
                 + (f", {self.accumulation} micro-batches per step" if self.accumulation > 1 else "")
                 + (f", input embedding in host RAM ({format_bytes(self.host_embedding_bytes)})"
                    if self.host_embedding_bytes else ""),
                 "| block | weights | MiB | activations | MiB | PCIe MiB/step | est. ms |",
                 "|---|---|---|---|---|---|---|"]
        for b in self.blocks:
            lines.append(f"| {b.index} | {b.weights} | {b.weight_bytes / mib:.1f} | {b.activations} | "
                         f"{b.activation_bytes / mib:.1f} | {b.pcie_bytes() / mib:.1f} | "
                         f"{1e3 * b.pcie_bytes() / self.pcie_bps:.2f} |")
        lines.append(f"non-block weights and device optimizer: {self.fixed_bytes / GiB:.2f} GiB; gradients "
                     f"{self.grad_bytes / GiB:.2f} GiB; logits "
                     f"{self.logits_bytes / GiB:.2f} GiB; backward extra {self.backward_extra / GiB:.2f} GiB; margin "
                     f"{self.margin / GiB:.2f} GiB; PCIe "
                     f"{self.pcie_bytes() / GiB:.2f} GiB/step; step floor {self.predicted_step_floor():.3f} s")
        return "\n".join(lines)


def _digits(v: float) -> int:
    return 2 if v < 9.995 else 1 if v < 99.95 else 0


def format_bytes(n: int, up: bool = False) -> str:
    """``n`` bytes for a reader, in the largest unit it reaches: '0 B', '900 B', '145 KiB', '1.50 MiB', '24.0 GiB'.
    ``up``: rounded up at the digits shown, never down (a least amount to ask for: 1.0001 GiB is '1.01 GiB')."""
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            v = n / size
            digits = _digits(v)
            if up:  # in integers (no float noise); 9.996 rounds up to 10.00, which is shown with one digit: 10.0
                digits = _digits(-(-n * 10**digits // size) / 10**digits)
                v = -(-n * 10**digits // size) / 10**digits
            return f"{v:.{digits}f} {unit}"
    return f"{n} B"


def resolve_budget(vram_budget, device: torch.device) -> int:
    """Bytes of device memory the plan may use.

    Args:
        vram_budget: bytes, a string such as ``"24GiB"``, a float fraction of the device's memory, or
            ``"auto"`` (free memory now; on the CPU, MemAvailable).
        device: the compute device.
    """
    if isinstance(vram_budget, float) and not isinstance(vram_budget, bool):
        return int(vram_budget * _device_total(device))
    if vram_budget == "auto":
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return int(free + torch.cuda.memory_allocated(device))
        return _device_total(device)
    return parse_bytes(vram_budget, name="vram_budget")


def _device_total(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    from trainstream_hf.engine.arena import host_memory_available
    return host_memory_available() or 64 * GiB


def activation_bytes_per_token(config, dtype_bytes: int) -> int:
    """Saved-for-backward bytes per token of one decoder block (no gradient checkpointing).

    Counted for a pre-norm block with SDPA attention and a gated MLP (Llama, Qwen2, Mistral, Gemma, Phi3):
    norm inputs and outputs (4h) + q, k, v and the attention output (h + 2 kv + h) + o_proj input (h) +
    gate, up, act(gate) and act*up (4 i) in the compute dtype, plus two fp32 rms statistics. GPT-2's MLP is
    not gated (3 i); the difference is within the margin.
    """
    h = getattr(config, "hidden_size", None) or getattr(config, "n_embd")
    i = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * h
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head")
    kv = (getattr(config, "num_key_value_heads", None) or heads) * (h // heads)
    elems = 7 * h + 2 * kv + 4 * i
    return elems * dtype_bytes + 8


def _can_recompute(block: nn.Module) -> bool:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(block, GradientCheckpointingLayer)


class _Stop(Exception):
    """Ends the measuring forward pass after the first block."""


@dataclass
class BlockMeasure:
    """One block on one micro-batch: saved-tensor bytes, input bytes and forward seconds."""

    activation_bytes: int
    input_bytes: int
    forward_seconds: float
    raw_activation_bytes: int = 0  # the same without cast elision (each saved widened copy counted as itself)
    saved_sizes: tuple[int, ...] = ()  # bytes of each saved storage counted in activation_bytes
    backward_extra: int | None = None  # Plan.backward_extra, measured (CUDA); None: not measured


def measure_block(model: nn.Module, block: nn.Module, batch_shape: tuple[int, int], device: torch.device,
                  *, repeats: int = 2, casts=None, backward: bool = True) -> BlockMeasure | None:
    """Measures ``block`` on a random batch of ``batch_shape``, the way the model will run it.

    Measure a block that is not the first when the model has several (``wrap`` measures the second): the first
    block of a model with a frozen embedding (LoRA) gets an input that needs no gradient and saves less than
    every later block (its first norm's input: 12% of a small LoRA model's block on the CPU, 330 vs 362 MiB for
    the 8B LoRA block on the H200).

    Runs the model's forward pass on random token ids only as far as the end of ``block`` (a forward hook
    stops it there), counting every saved tensor that is not a parameter once per storage, the bytes of the
    block's first tensor input, and the block's forward time (CUDA events on CUDA; the last of ``repeats``
    passes, so one-time initialisation is not counted). Costs the embedding and one block's activations of
    device memory, for a moment. With ``casts`` (a :class:`~trainstream_hf.engine.casts.CastSources`
    installed on the model), a saved widened copy counts as its source, as the engine will save it
    (``raw_activation_bytes`` counts it as itself: the bytes without elision). With ``backward`` on CUDA, also
    what the block's backward allocates beyond what it holds when it begins (:func:`measure_backward_extra`).
    Returns None when the model takes no ``input_ids`` (no ``config.vocab_size``).
    """
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if not vocab:
        return None
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    raw: dict[int, int] = {}
    held: list[torch.Tensor] = []
    found = {"input": 0, "t": 0.0}
    cuda = device.type == "cuda"

    def pack(t: torch.Tensor):
        if t.device.type != "meta":
            found = casts.source(t) if casts is not None else None
            kept = found[0] if found is not None else t
            ptr = kept.untyped_storage().data_ptr()
            if ptr not in params:
                seen[ptr] = kept.untyped_storage().nbytes()
            own = t.untyped_storage().data_ptr()
            if own not in params:
                raw[own] = t.untyped_storage().nbytes()
            # alive until the block ends, as in training (else its memory is reused: miscounted)
            held.extend((kept, t) if kept is not t else (kept,))
        # Not the tensor: this forward never runs backward, and a node holding its own output through a pack
        # hook is a reference cycle through C++ that Python's gc cannot see. Returning t leaked every measured
        # forward's activations (two forwards of two blocks: ~1.3 GiB on the 8B LoRA, an OOM on the H200).
        return None

    def unpack(_):
        raise RuntimeError("measure_block: its forward pass is not differentiable")

    ctx = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
    entered = []
    marks = {}

    def now():
        if cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def pre(module, args, kwargs):
        first = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)), None)
        found["input"] = first.numel() * first.element_size() if first is not None else 0
        seen.clear()
        raw.clear()
        ctx.__enter__()
        entered.append(True)
        marks["start"] = now()

    def post(module, args, out):
        marks["end"] = now()
        entered.pop()
        ctx.__exit__(None, None, None)
        raise _Stop

    ids = torch.randint(0, int(vocab), tuple(batch_shape), device=device,
                        generator=torch.Generator(device=device).manual_seed(0))
    handles = [block.register_forward_pre_hook(pre, with_kwargs=True), block.register_forward_hook(post)]
    try:
        for _ in range(max(1, repeats)):
            try:
                with torch.enable_grad():
                    model(input_ids=ids)
            except _Stop:
                pass
            held.clear()
            if cuda:
                marks["end"].synchronize()
                found["t"] = marks["start"].elapsed_time(marks["end"]) / 1e3
            else:
                found["t"] = marks["end"] - marks["start"]
    finally:
        for h in handles:
            h.remove()
        if entered:  # the block raised (e.g. out of memory): don't leave `pack` on every later backward
            ctx.__exit__(None, None, None)
        held.clear()
    extra = measure_backward_extra(model, block, ids) if backward and cuda else None
    return BlockMeasure(sum(seen.values()), found["input"], found["t"], sum(raw.values()), tuple(seen.values()),
                        extra)


def measure_backward_extra(model: nn.Module, block: nn.Module, ids: torch.Tensor, memory=None) -> int | None:
    """CUDA: device bytes ``block``'s backward allocates beyond those allocated when it begins, at its worst moment
    (``max_memory_allocated`` over the backward less ``memory_allocated`` before it): the gradients of its
    intermediates, the attention kernel's workspace, a tiled MLP's tile, less what it frees of its saved tensors
    on the way. The forward runs on ``ids`` as far as the end of ``block``, whose input is cut from the graph
    before it (the backward stops there) and needs a gradient, as in training; the output's gradient is random.
    Parameters' gradients are left as they were, and the random number generators too (forked: the user's stream of
    random numbers, e.g. dropout's, is the same as without the measurement). None off CUDA, and where the block's
    backward does not fit now (out of memory: the plan then counts nothing; the step will tell).

    ``memory``: ``(synchronize, allocated, reset_peak, peak)``, functions of the device (default: torch.cuda's; the
    CPU tests give their own)."""
    if memory is None:
        if ids.device.type != "cuda":
            return None
        memory = (torch.cuda.synchronize, torch.cuda.memory_allocated, torch.cuda.reset_peak_memory_stats,
                  torch.cuda.max_memory_allocated)
    synchronize, allocated, reset_peak, peak = memory
    got: dict = {}

    def pre(module, args, kwargs):
        if args and isinstance(args[0], torch.Tensor):
            return (args[0].detach().requires_grad_(),) + tuple(args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            return args, {**kwargs, "hidden_states": kwargs["hidden_states"].detach().requires_grad_()}
        return None

    def post(module, args, out):
        got["out"] = out[0] if isinstance(out, (tuple, list)) else out
        raise _Stop

    grads = {p: p.grad for p in model.parameters() if p.requires_grad}
    handles = [block.register_forward_pre_hook(pre, with_kwargs=True), block.register_forward_hook(post)]
    device = ids.device
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            try:
                with torch.enable_grad():
                    model(input_ids=ids)
            except _Stop:
                pass
        out = got.pop("out", None)
        if not isinstance(out, torch.Tensor) or not out.requires_grad:
            return None
        grad = torch.randn(out.shape, dtype=out.dtype, device=device,
                           generator=torch.Generator(device=device).manual_seed(0))
        synchronize(device)
        before = allocated(device)
        reset_peak(device)
        torch.autograd.backward(out, grad)
        synchronize(device)
        return max(0, peak(device) - before)
    except torch.OutOfMemoryError:
        return None
    finally:
        for h in handles:
            h.remove()
        got.clear()
        for p, g in grads.items():
            p.grad = g


# Fraction of the measured forward time counted as room for activation copies: offloaded blocks are spaced
# so that one block's copy fits under the forward of the blocks up to the next offloaded one. The one-off
# measured forward can run slow, which would space them too tightly and leave copies (and their device memory)
# queued. History: spacing nothing and offloading the first 13 of an 8B LoRA's 32 blocks exposed their copies
# on the H200 (0.464 s/step against 0.373 s for checkpointing every block, benchmarks/NOTES.md).
COPY_WINDOW = 0.8


def head_weight(model: nn.Module) -> torch.Tensor | None:
    """The 2-D weight of the model's output embedding (through a PEFT wrapper), or None where it has none."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    return weight if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


def measure_head(model: nn.Module, batch_shape: tuple[int, int], device: torch.device, fused=None) -> int | None:
    """Peak device bytes of the model's head for one micro-batch, measured on CUDA: final norm, LM head and loss on
    random hidden states, then the gradient back to those hidden states (the moment the plan calls "logits").

    The analytic ``tokens * vocab * (dtype + 4 + 4)`` missed the loss's own float32 temporaries: the plan's
    peak came out 13% low on the H200 (tests/gpu/test_plan_cuda.py, 2026-12-03). Returns None off CUDA (no
    allocator statistics) or when the model has no recognisable head (no output embeddings, no
    ``loss_function``); the plan then keeps the formula. Resets the device's peak-memory statistics. Logit
    soft-capping or scaling inside the model's forward (Gemma 2, Cohere) is not run here. ``fused``: the engine's
    :class:`~trainstream_hf.engine.head.FusedHead`; where it serves this batch shape, its chunked head and loss are
    what is measured.
    """
    if torch.device(device).type != "cuda":
        return None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    loss_fn = getattr(base, "loss_function", None)
    vocab = getattr(getattr(base, "config", None), "vocab_size", None)
    weight = head_weight(model)
    if weight is None or loss_fn is None or not vocab or weight.device != torch.device(device):
        return None
    head = base.get_output_embeddings()
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    norm = next((getattr(decoder, n) for n in ("norm", "final_layernorm", "ln_f")
                 if isinstance(getattr(decoder, n, None), nn.Module)), None)
    b, t = batch_shape
    dtype = weight.dtype if weight.dtype.is_floating_point else torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    torch.cuda.synchronize(device)
    with torch.enable_grad():
        hidden = torch.randn(b, t, weight.shape[1], device=device, dtype=dtype, generator=g, requires_grad=True)
        labels = torch.randint(0, int(vocab), (b, t), device=device, generator=g)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        x = norm(hidden) if norm is not None else hidden
        if fused is not None and fused.active_for(b * t):
            loss = fused.loss_for(x, labels)
        else:
            loss = loss_fn(logits=head(x), labels=labels, vocab_size=int(vocab))
        torch.autograd.grad(loss, [hidden])  # no parameter gradients: the plan counts those separately
        del x, loss
        peak = torch.cuda.max_memory_allocated(device) - start
    return int(peak)


def measure_activation_bytes(model: nn.Module, block: nn.Module, batch_shape: tuple[int, int],
                             device: torch.device) -> int | None:
    """Saved-tensor bytes of ``block`` for one micro-batch (see :func:`measure_block`)."""
    m = measure_block(model, block, batch_shape, device, repeats=1, backward=False)
    return None if m is None else m.activation_bytes


def _kept_bytes(block: nn.Module, device: torch.device) -> int:
    """Device bytes the block's layers keep beside their parameters while its weights are resident: QuantLinear's
    transposed FP8 codes (trainstream_hf/quant/linear.py), 1 byte per weight element of its FP8 tensor-core layers."""
    return sum(m.fp8_transpose_cache_bytes(device) for m in block.modules() if hasattr(m, "fp8_transpose_cache_bytes"))


def _numel_bytes(params: Iterable[nn.Parameter]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _offload_checkpoint_inputs(pl: Plan) -> None:
    """Before paging weights: every block recomputed with its input in host RAM (what long sequences need: at 160k
    tokens a Llama-3-8B block's input is 1.3 GB, 42 GB for 32 blocks, and one block's other saved tensors are more
    than a 24 GiB budget can hold beside them), then the last blocks' inputs back on the device while it fits (less
    traffic). A block's input is a small part of its weights' bytes at ordinary lengths (16 MiB against 436 MiB for
    Llama-3-8B at 2048 tokens), so this moves far less than paging would. Left as it was when it does not fit."""
    before = [b.activations for b in pl.blocks]
    takers = [b for b in pl.blocks if b.can_recompute]
    for b in takers:
        b.activations = "recompute_host"
    if not pl.fits():
        for b, a in zip(pl.blocks, before):
            b.activations = a
        return
    for b in reversed(takers):
        b.activations = "recompute"
        if not pl.fits():
            b.activations = "recompute_host"
            break


def _prefer_recompute_when_paging(pl: Plan, page, inputs_to_host: bool = False) -> None:
    """Once weights are paged, the H2D link carries every paged block twice per step and is the bottleneck: an
    offloaded block's activations would queue behind the weights (up in backward), while recomputing it costs
    GPU time that waits on the link anyway, and its smaller footprint leaves room for more resident weights
    (each one 2 x its bytes less traffic per step). So the activation layout is redone for paging: recompute
    every block that can be, then page as few blocks as fit, then give the slack back to the last blocks'
    activations (kept: no recompute, no traffic). Kept only if it sends fewer bytes up the link (:func:`_h2d_bytes`)
    than the layout chosen before paging, which spaced offloaded blocks by their copy time and never recomputed when
    one copy hides under one block's forward (at a tight budget recomputing can even avoid paging altogether).

    With ``inputs_to_host`` the same is tried with every recomputed block's input in host RAM first (fewer blocks
    paged; the slack goes back to the last blocks' inputs, then to their activations), and the layout that sends
    fewer bytes up the link is taken.

    History: the 32B LoRA at 24 GiB offloaded 21 blocks' activations, 13.6 GB of its 107 GB H2D per step, and ran
    out of memory; with this layout it trains at 89% of the link (benchmarks/NOTES.md, 2026-12-04;
    benchmarks/results/engine-paged-h200-19b40ff.json and engine-paged-h200-ffeb4e4.json). An 8B nf4 LoRA planned at
    Unsloth checkpointing's 6.53 GiB recomputed every block with its input on the device and paged 12 blocks: 0.355 s
    against 0.165 s unconstrained (table-llama3.1-8b-at-ckpt-peak-h100-84d38cc.json); its inputs are 0.5 GiB."""
    before = [(b.activations, b.weights) for b in pl.blocks]
    fitted, moved, peak = pl.fits(), _h2d_bytes(pl), pl.predicted_peak()
    layouts = []  # (fits, key, layout) per kind tried
    for kind in ("recompute", "recompute_host") if inputs_to_host else ("recompute",):
        for b, (a, _) in zip(pl.blocks, before):
            b.activations = kind if b.can_recompute else a
        page()
        if pl.fits():
            for give, to in (("recompute_host", "recompute"), ("recompute", "device")):
                for b in reversed(pl.blocks):
                    if b.activations != give:
                        continue
                    b.activations = to
                    if not pl.fits():
                        b.activations = give
                        break
        key = (_h2d_bytes(pl), pl.pcie_bytes()) if pl.fits() else (pl.predicted_peak(),)
        layouts.append((pl.fits(), key, [(b.activations, b.weights) for b in pl.blocks]))
    ok, _, layout = min(layouts, key=lambda x: (not x[0], x[1]))
    for b, (a, w) in zip(pl.blocks, layout):
        b.activations, b.weights = a, w
    if ok:
        better = not fitted or _h2d_bytes(pl) < moved
    else:  # neither fits: keep the lower peak, so that the error states the true minimum
        better = not fitted and pl.predicted_peak() < peak
    if not better:
        for b, (a, w) in zip(pl.blocks, before):
            b.activations, b.weights = a, w


def _h2d_bytes(pl: Plan) -> int:
    """Bytes a step sends up the link for its blocks: paged weights twice (forward, backward), offloaded activations
    once (fetched for backward). The copies down (activations in forward) take the link's other direction, which
    carries nothing else while weights are paged, so a paged step's copies take at least this over the H2D rate."""
    return sum(b.h2d_bytes() for b in pl.blocks)


def _warn_unpaged(blocks: Sequence[nn.Module], block_plans: list[BlockPlan], min_offload_numel: int) -> None:
    """page_weights=True asked for every block: say which ones paging cannot move, why, and what to change."""
    unpaged = [b.index for b in block_plans if not b.paged_bytes]
    if not unpaged:
        return
    small = [i for i in unpaged
             if any(p.requires_grad and p.numel() < min_offload_numel for p in blocks[i].parameters())]
    what = (f"no block is paged (all {len(block_plans)} stay on the device)" if len(unpaged) == len(block_plans) else
            f"{len(unpaged)} of {len(block_plans)} blocks stay on the device ({_ranges(unpaged)})")
    if small:
        why = (f"min_offload_numel={min_offload_numel} leaves every trainable parameter smaller than that on the "
               f"device and block(s) {_ranges(small)} have nothing else to page; lower min_offload_numel (e.g. 0) to "
               "page them, or leave page_weights='auto'")
    else:
        why = (f"block(s) {_ranges(unpaged)} hold no parameter of their own to page (none, or only weights shared "
               "with other modules); leave page_weights='auto'")
    warnings.warn(f"page_weights=True, but {what}: {why}", RuntimeWarning, stacklevel=3)


def _activations_movable(activation_sizes: Sequence[int] | None, activation_bytes: int | None,
                         min_activation_bytes: int) -> bool:
    """Whether offloading a block's activations moves anything: the offloader keeps saved tensors smaller than
    ``min_activation_bytes`` on the device. Unknown sizes (nothing measured): assumed to."""
    if activation_sizes is not None:
        return any(n >= max(min_activation_bytes, 1) for n in activation_sizes)
    return activation_bytes is None or activation_bytes > 0


def _warn_activations_unmoved(activation_sizes: Sequence[int] | None, min_activation_bytes: int) -> None:
    """offload_activations=True asked for every block, but the offloader would move nothing."""
    if activation_sizes:
        why = (f"every saved tensor of a block is smaller than min_activation_bytes={min_activation_bytes} (the "
               f"largest: {max(activation_sizes)} bytes), and smaller ones stay on the device; lower "
               "min_activation_bytes to offload them")
    else:
        why = "the blocks save no activations for backward (nothing trains through them)"
    warnings.warn(f"offload_activations=True, but no activation would move to the host: {why}; the plan keeps them on "
                  "the device (offload_activations='auto' decides by itself)", RuntimeWarning, stacklevel=3)


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    parts, start = [], None
    for k, i in enumerate(indices):
        if start is None:
            start = i
        if k + 1 == len(indices) or indices[k + 1] != i + 1:
            parts.append(str(start) if start == i else f"{start}-{i}")
            start = None
    return ", ".join(parts)


def plan(model: nn.Module, blocks: Sequence[nn.Module], *, batch_shape: tuple[int, int], vram_budget,
         device: torch.device | str | None = None, offload_optimizer="auto", grads="auto",
         offload_activations="auto", page_weights="auto", slots: int = 2, prefetch: int = 1,
         margin: int = DEFAULT_MARGIN, min_offload_numel: int = MIN_OFFLOAD_NUMEL,
         activation_bytes: int | None = None, input_bytes: int | None = None,
         forward_seconds: float | None = None, recompute="auto", head_bytes: int | None = None,
         activation_sizes: Sequence[int] | None = None, min_activation_bytes: int = 0,
         optimizer_resident="auto", optimizer_streamed="auto", cpu_adam_pps: float | None = None,
         device_chunk_numel: int = DEFAULT_CHUNK_NUMEL, host_budget: int | None = None,
         optimizer_moments: str = "float32", accumulation: int = 1, optimizer_in_backward: bool = False,
         host_embedding: nn.Module | None = None, backward_extra_bytes: int | None = None,
         output_fp32_bytes: int = 0) -> Plan:
    """Decides placements for a VRAM budget (see the module docstring for the order).

    Args:
        model: the model (its ``config`` gives the activation estimate when it has one).
        blocks: its repeated layers, in forward order.
        batch_shape: (batch size, sequence length) of one micro-batch.
        vram_budget: see :func:`resolve_budget`.
        device: the compute device (default: the model's).
        offload_optimizer, grads, offload_activations, page_weights: ``"auto"`` lets the plan decide;
            ``True`` / ``False`` (``"host"`` / ``"device"`` for grads) force a placement.
        slots, prefetch: device slots of the weight ring and how many blocks ahead they are filled.
        margin: device bytes kept free for workspaces.
        min_offload_numel: trainable parameters smaller than this keep their optimizer on the device.
        activation_bytes: saved-tensor bytes of one block for one micro-batch, measured (see
            :func:`measure_block`); None: the analytic estimate.
        input_bytes: bytes of one block's input (what a checkpointed block keeps); None: tokens x hidden.
        forward_seconds: one block's forward time, measured; decides how many blocks' activation copies
            hide under compute. None: unknown, the plan offloads before it recomputes.
        recompute: ``"auto"`` (checkpoint blocks whose activations cannot move to the host for free),
            ``True`` (every block that supports it) or ``False``. Only transformers'
            ``GradientCheckpointingLayer`` blocks can be recomputed.
        head_bytes: peak bytes of the head (norm, LM head, loss and their backward), measured (see
            :func:`measure_head`); None: ``tokens x vocab x (dtype + 8)``.
        output_fp32_bytes: bytes of the float32 copy of the forward's outputs made after it returns (Accelerate's
            mixed precision: the logits, ``tokens x vocab x 4``), counted beside the logits at the end of the
            forward.
        activation_sizes: bytes of each of one block's saved tensors (``BlockMeasure.saved_sizes``); with
            ``min_activation_bytes`` (the activation offloader keeps smaller ones on the device) it tells whether
            offloading a block's activations moves anything. None: unknown, assumed to.
        min_activation_bytes: the offloader's ``min_bytes`` (``TrainStreamConfig.min_activation_bytes``).
        optimizer_resident: of the offloaded parameters (not paged ones), keep the fp32 state of as many as the
            memory left over allows on the device, in forward order (the next forward needs them first): ``"auto"``
            (on CUDA), True (any device) or False.
        optimizer_streamed: of the offloaded parameters left, the share (by elements) whose host state is streamed
            through the device and stepped there, beside the CPU's share: ``"auto"`` (on CUDA: split so the PCIe
            link, 12 bytes each way per element, and the CPU AdamW at ``cpu_adam_pps`` finish together), True (that
            split on any device), a fraction in [0, 1], or False. Each streamed parameter keeps its gradient on the
            device until the step: as many as fit.
        cpu_adam_pps: the CPU AdamW's elements per second, measured (``measure_cpu_adam``); None: a default.
        device_chunk_numel: elements per chunk of the streamed ring (3 chunks of 12 bytes an element).
        optimizer_moments: ``"float32"`` or ``"bfloat16"`` (the CPU share's moments, half the bytes; no device share
            then: its kernel takes float32).
        accumulation: micro-batches per optimizer step. From the second on, each forward runs beside the gradients
            held until ``step()`` (all of them with device gradients), and a bf16 parameter's host gradient gets its
            fp32 accumulator.
        optimizer_in_backward: the optimizer steps each parameter as its gradient lands (``wrap``'s option): a
            recomputed forward then runs while the CPU steps the later blocks, which decides whether recomputing
            blocks to hold more optimizer state on the device pays (``_recompute_for_device_share``).
        host_budget: host RAM the plan may fill (None: unlimited). When offloaded activations would pass it (long
            sequences), blocks that can be recomputed keep only their input in host RAM (``recompute_host``), first
            block first, as long as the device still fits.
        host_embedding: the input embedding module whose table ``wrap`` keeps in pinned host RAM
            (``host_embedding``; the device reads its rows there): its bytes leave the device's fixed bytes and
            count in the host's.
        backward_extra_bytes: what one block's backward allocates beyond what it held when it began
            (:attr:`BlockMeasure.backward_extra`, measured on CUDA); None: 0.

    Warns:
        RuntimeWarning: a forced ``page_weights=True`` or ``offload_activations=True`` that cannot move anything
            (or, for weights, some blocks): the plan says so (those blocks stay ``"device"``) and the warning says
            which option to change.

    Raises:
        BudgetError: when even the most offloaded plan does not fit, with the minimum it needs.
    """
    device = torch.device(device) if device is not None else next(model.parameters()).device
    budget = resolve_budget(vram_budget, device)
    block_ids = {id(p) for b in blocks for p in b.parameters()}
    named = list(model.named_parameters())
    trainable = [(n, p) for n, p in named if p.requires_grad]
    big = [(n, p) for n, p in trainable if p.numel() >= min_offload_numel]
    if offload_optimizer is True and trainable and not big:
        warnings.warn(f"offload_optimizer=True, but no trainable parameter has min_offload_numel={min_offload_numel} "
                      f"elements or more (the largest: {max(p.numel() for _, p in trainable)}), and smaller ones keep "
                      "their optimizer state on the device: nothing is offloaded; lower min_offload_numel to offload "
                      "them", RuntimeWarning, stacklevel=3)
    # Activations are in the parameters' dtype (under autocast they are smaller: the estimate errs high).
    act_dtype_bytes = next(model.parameters()).element_size()
    config = getattr(model, "config", None)
    tokens = int(batch_shape[0]) * int(batch_shape[1])
    if config is not None and (getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)):
        per_block_act = activation_bytes_per_token(config, act_dtype_bytes) * tokens
        vocab = getattr(config, "vocab_size", 0) or 0
    else:
        per_block_act, vocab = 0, 0
    if activation_bytes is not None:
        per_block_act = int(activation_bytes)
    if input_bytes is None:
        h = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None) or 0
        input_bytes = tokens * h * act_dtype_bytes
    # As the weight pager selects and lays them out (engine.weights.select_params, block_bytes): a parameter reachable
    # twice stays on the device; each paged one starts at an aligned offset of its block's host buffer.
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    block_plans = []
    for i, b in enumerate(blocks):
        params = list(b.parameters())
        paged = [p for p in params if pages_param(p, min_offload_numel) and uses.get(id(p), 0) <= 1]
        paged_ids = {id(p) for p in paged}
        block_plans.append(BlockPlan(i, _numel_bytes(params), sum(p.numel() for p in params if p.requires_grad),
                                     per_block_act, input_bytes=int(input_bytes),
                                     can_recompute=_can_recompute(b), kept_bytes=_kept_bytes(b, device),
                                     paged_bytes=block_bytes(paged) if paged else 0,
                                     unpaged_bytes=_numel_bytes(p for p in params if id(p) not in paged_ids)))
    # Logits in the compute dtype, their fp32 upcast in the loss and its gradient.
    logits = tokens * vocab * (act_dtype_bytes + 4 + 4) if head_bytes is None else int(head_bytes)
    logits += int(output_fp32_bytes)
    hosted = {id(p) for p in host_embedding.parameters()} if host_embedding is not None else set()
    nonblock_w = _numel_bytes(p for n, p in named if id(p) not in block_ids and id(p) not in hosted)

    def nbytes(params) -> int:
        return sum(p.numel() * p.element_size() for p in params)

    if int(accumulation) < 1:
        raise ValueError(f"gradient_accumulation_steps: at least 1 micro-batch per optimizer step, got "
                         f"{accumulation!r}")
    pl = Plan(budget=budget, blocks=block_plans, slots=0, prefetch=0, logits_bytes=logits, margin=margin,
              min_offload_numel=min_offload_numel, forward_seconds=forward_seconds,
              moment_bytes=2 if optimizer_moments == "bfloat16" else 4, accumulation=int(accumulation),
              in_backward=bool(optimizer_in_backward), backward_extra=int(backward_extra_bytes or 0),
              host_embedding_bytes=_numel_bytes(host_embedding.parameters()) if host_embedding is not None else 0)

    def settle(offload_opt: bool, grads_host: bool, only: list[tuple[str, nn.Parameter]] | None = None) -> None:
        """Optimizer state of every big trainable parameter (``only``: of these) on the host, or of none."""
        off = (big if only is None else only) if offload_opt else []
        off_params, off_ids = [p for _, p in off], {id(p) for _, p in off}
        pl.offload_optimizer = [n for n, _ in off]
        pl.offload_numel = sum(p.numel() for p in off_params)
        pl.grads = "host" if (grads_host and off_params) else "device"
        device_trainable = [p for _, p in trainable if id(p) not in off_ids]
        # The device optimizer keeps exp_avg and exp_avg_sq in the parameter's dtype.
        pl.fixed_bytes = nonblock_w + 2 * nbytes(device_trainable)
        grads_b = nbytes(device_trainable)
        if off_params:
            # host grads: at most one block's worth in flight, or one whole non-block tensor (embedding,
            # head); device grads: all of them until step().
            per_block = max((nbytes(p for p in b.parameters() if p.requires_grad) for b in blocks), default=0)
            nonblock_big = max((p.numel() * p.element_size() for p in off_params if id(p) not in block_ids),
                               default=0)
            pl.inflight_grad_bytes = max(per_block, nonblock_big) if grads_host else 0
            grads_b += pl.inflight_grad_bytes if grads_host else nbytes(off_params)
        else:
            pl.inflight_grad_bytes = 0
        pl.grad_bytes = grads_b

    choices_opt = [False, True] if offload_optimizer == "auto" else [bool(offload_optimizer)]
    choices_grads = {"auto": [False, True], "device": [False], "host": [True]}[grads]
    for opt in choices_opt:
        for gh in (choices_grads if opt else [False]):
            settle(opt, gh)
            if pl.fits():
                break
        else:
            continue
        break
    if recompute is True:
        for b in block_plans:
            if b.can_recompute:
                b.activations = "recompute"
    # An offloaded block whose saved tensors all stay on the device (below min_activation_bytes) saves nothing.
    movable = _activations_movable(activation_sizes, activation_bytes, min_activation_bytes)
    if offload_activations is True:
        if movable or recompute is True:
            for b in block_plans:
                # with recompute=True too: checkpointed, and what a checkpointed block keeps (its input) offloaded
                b.activations = "recompute_host" if recompute is True and b.can_recompute else \
                    "host" if movable else b.activations
        else:
            _warn_activations_unmoved(activation_sizes, min_activation_bytes)
    elif offload_activations == "auto" and not pl.fits():
        # Keep the last blocks' activations (they are used first in backward and never move); of the blocks
        # before them offload every s-th, where s blocks' forward covers one block's copy, and checkpoint the
        # others (one block forward each); a block with fewer than s blocks after it is not offloaded (its copy
        # would outlast the forward pass). Keep as many as fit. Unknown forward time: offload them all (s = 1).
        n, a = len(block_plans), max(per_block_act, 1)
        s = 1
        if forward_seconds and recompute is not False:
            s = max(1, math.ceil(a / pl.pcie_bps / (COPY_WINDOW * forward_seconds)))
        for keep in range(n - 1, -1, -1):
            for b in block_plans:
                if recompute is True and b.can_recompute:
                    b.activations = "recompute"  # asked for every block that can be
                elif b.index >= n - keep:
                    b.activations = "device"
                elif not movable:
                    b.activations = "recompute" if b.can_recompute and recompute is not False else "device"
                elif (b.index % s == 0 and b.index + s <= n) or not b.can_recompute or recompute is False:
                    b.activations = "host"
                else:
                    b.activations = "recompute"
            if pl.fits():
                break
        if not pl.fits() and recompute is not False and input_bytes >= min_activation_bytes:
            _offload_checkpoint_inputs(pl)
    if page_weights is True or (page_weights == "auto" and not pl.fits()):
        if prefetch >= slots:
            raise ValueError(f"prefetch ({prefetch}) must be below slots ({slots}): a slot is refilled only "
                             "after the block in it has run")
        pl.slots, pl.prefetch = slots, prefetch

        def page() -> None:
            for b in block_plans:
                b.weights = "device"
            for b in block_plans:
                if page_weights == "auto" and pl.fits():
                    break
                if b.paged_bytes:  # a block whose every parameter stays on the device is not paged
                    b.weights = "host"

        page()
        if page_weights == "auto" and offload_activations == "auto" and recompute == "auto":
            _prefer_recompute_when_paging(pl, page, inputs_to_host=input_bytes >= max(min_activation_bytes, 1))
        if page_weights is True:
            _warn_unpaged(blocks, block_plans, min_offload_numel)
        if not pl.paged_blocks:
            pl.slots, pl.prefetch = 0, 0
    # wrap() steps paged trainable weights on the host whatever the plan chose (the optimizer writes their host
    # copies) and sends their gradients straight there (the weight is not on the device after its block has run):
    # the plan counts their optimizer state and gradients on the host, as model.trainstream_stats() will report.
    in_host_blocks = {id(q) for b in block_plans if b.weights == "host" for q in blocks[b.index].parameters()
                      if pages_param(q, min_offload_numel) and uses.get(id(q), 0) <= 1}
    paged_trainable = [(n, p) for n, p in big if id(p) in in_host_blocks]
    if paged_trainable and not pl.offload_optimizer and offload_optimizer == "auto":
        settle(True, True, only=paged_trainable)
    elif paged_trainable and pl.offload_optimizer and pl.grads == "device":
        settle(True, True)
    by_name = dict(big)
    pl.optimizer_host_bytes = _optimizer_host_bytes(pl, by_name, in_host_blocks)
    if host_budget is not None and pl.host_bytes() > host_budget:
        _fit_host(pl, int(host_budget))
    if not pl.fits():
        need = pl.predicted_peak() + pl.margin
        raise BudgetError(
            f"vram_budget {format_bytes(budget)} is below the minimum this model needs with as much in host RAM as "
            f"the options allow: {format_bytes(need, up=True)} ({format_bytes(pl.predicted_peak(), up=True)} "
            f"predicted peak plus {format_bytes(pl.margin)} kept free for workspaces); raise vram_budget to at least "
            f"{format_bytes(need, up=True)}, or shorten the batch (batch_shape) -- that plan:\n{pl}")
    if cpu_adam_pps:
        pl.cpu_adam_pps = float(cpu_adam_pps)
    if pl.offload_optimizer and optimizer_moments == "float32":
        cuda = device.type == "cuda"
        offloaded = set(pl.offload_optimizer)
        # not the paged ones: their weights live in host copies that the CPU share writes
        candidates = [(n, p) for n, p in big if n in offloaded and id(p) not in in_host_blocks]
        share = dict(resident=optimizer_resident is True or (optimizer_resident == "auto" and cuda),
                     streamed=_streamed_fraction(optimizer_streamed, cuda), chunk_numel=device_chunk_numel)
        before = copy.deepcopy(pl) if recompute == "auto" and share["resident"] else None
        _device_share(pl, candidates, **share)
        if before is not None:
            pl = _recompute_for_device_share(pl, before, candidates, share)
        pl.optimizer_host_bytes = _optimizer_host_bytes(pl, by_name, in_host_blocks)
    return pl


# A plan that recomputes blocks to hold more optimizer state on the device is kept only if its predicted step is this
# much shorter: the cost model (step floor + one forward per recomputed block) is a bound, not a measurement.
RECOMPUTE_GAIN = 0.95


def _recompute_for_device_share(pl: Plan, before: Plan, candidates, share: dict) -> Plan:
    """``pl``, or a plan that checkpoints some of the blocks whose activations stay on the device, when the memory
    that frees holds enough more resident optimizer state (12 bytes an element, no CPU or PCIe time) to shorten the
    step: predicted as the step floor (the CPU AdamW or the link, whichever ends last) plus one forward per recomputed
    block and micro-batch (at 8 micro-batches the 3B plan recomputed every block for ~0.1 s less floor and its step
    went from 1.63 to 2.19 s: H100, engine-full-3b-accum8-h100-70fdb04.json). With ``in_backward``: the forward plus
    the longer of the floor and the backward with its recomputed forwards, since the CPU works beside the backward
    (at 3B that plan, forced to recompute every block, took 0.535 s against 0.635 s without: H100,
    engine-full-3b-h100-70fdb04.json). A full fine-tune's optimizer step outlasts its forward and backward (3B at 24
    GiB: ~0.4 s of CPU and PCIe work against ~0.15 s of compute on an H100), so a block's activations are worth more
    as optimizer state there.
    ``before``: ``pl`` before its device share was chosen. Needs the measured forward time."""
    takers = [b.index for b in before.blocks if b.activations == "device" and b.can_recompute]
    if before.forward_seconds is None or not takers:
        return pl

    def cost(p: Plan) -> float:  # per optimizer step: each micro-batch recomputes its blocks
        extra = (p.recompute_seconds() or 0.0) * p.accumulation
        if p.in_backward:
            # The CPU steps each block's parameters as its gradients land, so the backward (about two forwards a
            # block) and the recomputed forwards in it run beside the CPU share; the forward runs before it.
            forward = p.forward_seconds * len(p.blocks)
            return forward + max(2 * forward + extra, p.predicted_step_floor())
        return p.predicted_step_floor() + extra

    best, best_cost = pl, cost(pl)
    n = len(takers)
    for k in sorted({max(1, n * q // 4) for q in (1, 2, 3, 4)}):
        alt, chosen = copy.deepcopy(before), set(takers[:k])
        for b in alt.blocks:
            if b.index in chosen:
                b.activations = "recompute"
        _device_share(alt, candidates, **share)
        if alt.fits() and cost(alt) < RECOMPUTE_GAIN * best_cost:
            best, best_cost = alt, cost(alt)
    return best


def _optimizer_host_bytes(pl: Plan, by_name: dict, paged_ids: set) -> int:
    """Host bytes of the offloaded optimizer as ``OffloadedAdamW`` allocates them: per CPU-stepped parameter the fp32
    master and both moments, its gradient buffer (device gradients: the parameter's dtype; host gradients: bf16 for a
    bf16 parameter, whose fp32 accumulator is made only under gradient accumulation, else fp32) and the weight copy
    sent up after the step (none for a paged weight, whose host copy is counted with the paged blocks, or an fp32
    one); per streamed parameter its master and moments (12 bytes); nothing for a resident one."""
    resident, streamed = set(pl.resident_optimizer), set(pl.streamed_optimizer)
    total = 0
    for name in pl.offload_optimizer:
        p = by_name[name]
        n = p.numel()
        if name in resident:
            continue
        if name in streamed:
            total += 12 * n
            continue
        total += n * (4 + 2 * pl.moment_bytes)
        if pl.grads == "host":
            total += n * (2 if p.dtype == torch.bfloat16 else 4)
            if pl.accumulation > 1 and p.dtype == torch.bfloat16:
                total += 4 * n  # the fp32 accumulator of the second and later terms
        else:
            total += n * p.element_size()
        if id(p) not in paged_ids and p.dtype != torch.float32:
            total += n * p.element_size()
    return total


def _fit_host(pl: Plan, host_budget: int) -> None:
    """Offloaded blocks become checkpointed ones whose input alone waits in host RAM, first block first, until the
    plan's host bytes fit ``host_budget`` (a block whose change would pass the device budget stays as it is)."""
    for b in pl.blocks:
        if pl.host_bytes() <= host_budget:
            return
        if b.activations == "host" and b.can_recompute:
            b.activations = "recompute_host"
            if not pl.fits():
                b.activations = "host"


def _streamed_fraction(option, cuda: bool) -> float | None:
    """``optimizer_streamed`` as a fraction of the elements, or None for the balanced split."""
    if option is False or (option == "auto" and not cuda):
        return 0.0
    if option is True or option == "auto":
        return None
    return float(option)


def _device_share(pl: Plan, candidates: list[tuple[str, nn.Parameter]], *, resident: bool, streamed: float | None,
                  chunk_numel: int) -> None:
    """Moves offloaded parameters' AdamW onto the device while the plan still fits: first resident ones in forward
    order (12 bytes each of fp32 state, plus the gradient when gradients would otherwise leave during backward),
    then streamed ones (the ring once, plus the gradient), chosen in forward order so that the CPU and the PCIe link
    finish together (``streamed`` None) or up to the fraction ``streamed`` of the elements."""
    grad_host = pl.grads == "host"
    margin = pl.margin
    pl.margin += int(DEVICE_SHARE_RESERVE * pl.budget)
    try:
        _fill_device_share(pl, candidates, resident, streamed, chunk_numel, grad_host)
    finally:
        pl.margin = margin


def _fill_device_share(pl, candidates, resident, streamed, chunk_numel, grad_host) -> None:
    def grad_bytes(p: nn.Parameter) -> int:
        return p.numel() * p.element_size() if grad_host else 0

    def add(p: nn.Parameter, state: int) -> bool:
        pl.fixed_bytes += state
        pl.grad_bytes += grad_bytes(p)
        if pl.fits():
            return True
        pl.fixed_bytes -= state
        pl.grad_bytes -= grad_bytes(p)
        return False

    def split(cands) -> list[tuple[str, nn.Parameter]]:
        """The parameters to stream, in forward order: each goes where the work so far ends first (the link at 12
        bytes an element, or the CPU), or up to the fraction ``streamed`` of the elements."""
        total, taken, t_cpu, t_link, out = sum(p.numel() for _, p in cands), 0, 0.0, 0.0, []
        for name, p in cands:
            n = p.numel()
            if streamed is None:
                take = t_link + 12 * n / pl.pcie_bps <= t_cpu + n / pl.cpu_adam_pps
            else:
                take = taken + n <= streamed * total + 0.5 * n
            if take:
                out.append((name, p))
                taken += n
                t_link += 12 * n / pl.pcie_bps
            else:
                t_cpu += n / pl.cpu_adam_pps
        return out

    ring = 3 * 12 * chunk_numel
    # A streamed element costs at most its gradient's 2 bytes of device memory, a resident one 12 more: hold what the
    # streamed share would need while the resident share takes the rest, so the memory goes first where it saves most.
    want = split(candidates) if streamed != 0.0 else []
    hold_f, hold_g = (ring if want else 0), sum(grad_bytes(p) for _, p in want)
    pl.fixed_bytes += hold_f
    pl.grad_bytes += hold_g
    if not pl.fits():
        pl.fixed_bytes -= hold_f
        pl.grad_bytes -= hold_g
        hold_f = hold_g = 0
    rest = []
    for name, p in candidates:
        if resident and add(p, 12 * p.numel()):
            pl.resident_optimizer.append(name)
            pl.resident_numel += p.numel()
        else:
            rest.append((name, p))
    pl.fixed_bytes -= hold_f
    pl.grad_bytes -= hold_g
    if not rest or streamed == 0.0:
        return
    pl.fixed_bytes += ring
    if not pl.fits():
        pl.fixed_bytes -= ring
        return
    for name, p in split(rest):
        if add(p, 0):
            pl.streamed_optimizer.append(name)
            pl.streamed_numel += p.numel()
    if not pl.streamed_optimizer:
        pl.fixed_bytes -= ring


def measure_cpu_adam(threads: int | None = None, numel: int = 16 << 20) -> float:
    """Elements per second of the CPU AdamW kernel (bf16 gradients, bf16 copy out, ``threads`` threads), the best of
    three passes over ``numel`` elements (the first also faults the pages in). 16 Mi elements (~260 MB) are well
    past a CPU's caches, as a model's state is: at 4 Mi the 3B plan expected 0.30 s of CPU AdamW where the step took
    0.43 s (H100 host, 5dedf68)."""
    from trainstream_hf import ops

    p, m, v = (torch.zeros(numel) for _ in range(3))
    g = torch.zeros(numel, dtype=torch.bfloat16)
    out = torch.empty(numel, dtype=torch.bfloat16)
    best = float("inf")
    for step in range(1, 4):
        t0 = time.perf_counter()
        ops.adamw_step_(p, m, v, g, lr=1e-3, step=step, param_bf16=out, num_threads=threads or 0)
        best = min(best, time.perf_counter() - t0)
    return numel / best
