"""Activation offload: tensors autograd saves inside chosen blocks wait for backward in the host arena.

In the forward pass, a saved tensor of a chosen block that is on the compute device, at least
``min_bytes`` large, not a parameter (nor a view of one) and non-overlapping-and-dense is copied
device->host into an arena tensor on the D2H stream. The stream records the source (``record_stream``), so
its device memory goes back to the caching allocator once autograd drops it and the copy's event has
passed. Everything else stays on the device untouched.

Exact widening casts (:mod:`trainstream_hf.engine.casts`, e.g. PEFT's fp32 copy of a bf16 LoRA input) are
saved as their narrow source in every block, offloaded or not, and converted again in backward.

In the backward pass the copies come back ahead of use, on the H2D stream into buffers allocated on the
compute stream (one memory pool: buffers on a stream of their own could not reuse what backward frees, and
the capped allocator would release and re-map segments, synchronising, every step). When block ``i``'s
backward begins, every chosen block ``>= i - 1`` is fetched, and chosen blocks further below in order while
the bytes fetched ahead stay within the allowance of :class:`Prefetch`: what the plan's predicted peak
leaves beside the lower blocks' saved tensors, the current block's and the gradients (the logits and every
block above ``i`` are gone by then). unpack makes the compute stream wait for the copy's event (no host sync).

Bit-exact: dtype, shape and strides are kept exactly (the device buffer is made with the original strides),
and so is the address's alignment modulo 64 bytes (kernels may choose code paths by alignment). A tensor
saved several times (the normed hidden state feeds q, k and v) is copied once, and so is a storage saved through
several views that each cover it (a norm's input and its reshaped view, q and its heads-first view): the later
ones come back as views of the one copy, sharing its memory on the device as they did in forward (copied per
view, the 8B LoRA block moved ~40% more bytes than its storages hold).
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
from torch import nn

from trainstream_hf.engine.arena import HostArena
from trainstream_hf.engine.casts import CastOf, CastSources
from trainstream_hf.engine.hooks import BlockHooks, BlockListener, is_dense
from trainstream_hf.engine.streams import Transfer, TransferStreams

__all__ = ["ActivationOffloader", "Prefetch"]

# Alignment (bytes) of the original address that the host and device copies reproduce. 64 is the CPU
# allocator's alignment; device allocations are 512-aligned, the arena 256-aligned.
_ALIGN = 64


class _Offloaded:
    """One offloaded tensor: its host copy, the D2H copy writing it, and (in backward) the device copy."""

    __slots__ = ("host", "d2h", "size", "stride", "pad", "h2d", "__weakref__")

    def __init__(self, host: torch.Tensor, d2h: Transfer, size, stride, pad: int):
        self.host = host
        self.d2h = d2h
        self.size = size
        self.stride = stride
        self.pad = pad
        self.h2d: Transfer | None = None


class _View:
    """A saved tensor served by another one's copy of the same storage range: its own shape and strides over it."""

    __slots__ = ("rec", "size", "stride")

    def __init__(self, rec: _Offloaded, size, stride):
        self.rec, self.size, self.stride = rec, size, stride


def _is_parameter(t) -> bool:
    # Most saved tensors are plain torch.Tensor: skip Parameter's Python-level isinstance hook for them (a few us
    # each, thousands of saves per step).
    return t is not None and type(t) is not torch.Tensor and isinstance(t, nn.Parameter)


@dataclass
class Prefetch:
    """How far ahead backward may fetch offloaded activations (see the module docstring).

    Args:
        resident: per block, saved bytes on the device from its forward until its backward (kept activations,
            a checkpointed block's input; 0 for an offloaded block). Empty: only one block ahead.
        current: per block, extra bytes while its backward runs (recomputed or fetched activations).
        limit: the plan's bound on activation and gradient bytes (its predicted peak's moving part).
        grads: gradient bytes backward accumulates on the device, counted whole from the start.
    """

    resident: Sequence[int] = field(default_factory=tuple)
    current: Sequence[int] = field(default_factory=tuple)
    limit: int = 0
    grads: int = 0

    def __post_init__(self) -> None:
        self._below = list(itertools.accumulate(self.resident))  # resident bytes of blocks 0..i, per i

    def allowance(self, i: int) -> int:
        """Bytes that may be on their way for blocks below ``i`` when block ``i``'s backward starts: what the
        bound leaves beside the lower blocks' resident bytes, block ``i``'s own and the gradients. (Block
        ``i-1`` is fetched then whatever this says: it is needed next.)"""
        if not self.resident:
            return 0
        used = self._below[i] + self.current[i] + self.grads
        return self.limit - used


class ActivationOffloader(BlockListener):
    """Moves large saved activations of the chosen blocks to host memory between forward and backward.

    Args:
        hooks: the model's :class:`BlockHooks` (shared with the weight pager).
        streams: transfer streams of the compute device (``cpu`` copies synchronously).
        arena: host arena that receives the copies.
        blocks: indices of the blocks whose activations are offloaded (default: all; may be empty when only
            ``casts`` is wanted).
        min_bytes: smaller saved tensors stay on the device (copy overhead beats the memory saved).
        casts: exact widening casts to save as their source, in every block (None: off).
        prefetch: the backward fetch allowance (default: one block ahead).
    """

    pack_priority = 50

    def __init__(self, hooks: BlockHooks, streams: TransferStreams, arena: HostArena, *,
                 blocks: Iterable[int] | None = None, min_bytes: int = 1 << 20, casts: CastSources | None = None,
                 prefetch: Prefetch | None = None):
        if min_bytes < 0:
            raise ValueError(f"ActivationOffloader: min_bytes must be >= 0, got {min_bytes}")
        self.hooks = hooks
        self.streams = streams
        self.arena = arena
        self.device = streams.device
        self.min_bytes = int(min_bytes)
        self.casts = casts
        self.prefetch = prefetch if prefetch is not None else Prefetch()
        self._order = sorted(set(range(len(hooks)) if blocks is None else blocks))
        if any(not 0 <= i < len(hooks) for i in self._order):
            raise ValueError(f"ActivationOffloader: block indices must be in [0, {len(hooks)}), got {self._order}")
        if self.prefetch.resident and not len(self.prefetch.resident) == len(self.prefetch.current) == len(hooks):
            raise ValueError(f"ActivationOffloader: prefetch has {len(self.prefetch.resident)} / "
                             f"{len(self.prefetch.current)} entries for {len(hooks)} blocks")
        self._chosen = set(self._order)
        self._desc = self._order[::-1]  # backward order
        self._next = 0                  # index into _desc of the next block to fetch
        self._block_bytes: dict[int, int] = {}
        self._records: dict[int, list[weakref.ref]] = {}
        # id(tensor) -> (tensor, its version, its record), all weak: a record lives exactly as long as autograd
        # holds it, so its host block and device copy are released as soon as the backward has used it.
        self._seen: dict[int, tuple[weakref.ref, int, weakref.ref]] = {}
        # storage address -> (its version, storage offset, numel, dtype, the record of the copy covering that range,
        # the storage): while that storage lives (its Python object is kept as long as any tensor uses it), the
        # address is still its own, not a later allocation's
        self._storages: dict[int, tuple[int, int, int, torch.dtype, weakref.ref, weakref.ref]] = {}
        self._param_ptrs: tuple[int, set[int]] = (-1, set())
        self._block_tensors: dict[int, tuple[torch.Tensor, ...]] = {}
        self._stats = {"offloaded": 0, "d2h_bytes": 0, "h2d_bytes": 0, "deduplicated": 0, "kept_small": 0,
                       "kept_small_bytes": 0, "kept_layout": 0, "casts_elided": 0, "cast_bytes_elided": 0}
        self.closed = False
        hooks.add(self)

    def counters(self) -> dict:
        """The cumulative counters of :meth:`stats` alone (the engine reports their growth per step)."""
        return dict(self._stats)

    def stats(self) -> dict:
        """Cumulative counters: tensors offloaded, bytes each way, saves served by an earlier copy, tensors
        kept on the device for being small (and their bytes) or not dense, and widened copies saved as their source
        (count and bytes not held); ``live``: offloaded tensors of this step that autograd still holds."""
        live = {id(r) for refs in self._records.values() for ref in refs if (r := ref()) is not None}
        return dict(self._stats, live=len(live))

    def close(self) -> None:
        """Stops offloading (detaches from the hooks). Tensors already offloaded still come back."""
        self.hooks.discard(self)
        self.closed = True

    # -- listener -------------------------------------------------------------------------------
    def step_start(self) -> None:
        self._records = {}
        self._seen = {}
        self._storages = {}
        self._block_bytes = {}
        self._next = 0

    def forward_start(self, i: int) -> None:
        if i in self._chosen:
            tensors = self._block_tensors.get(i)
            if tensors is None:
                # The module walk is cached (it was ~6% of a CPU step); the storages are read each time, since
                # the pager swaps them.
                block = self.hooks.layers[i]
                tensors = self._block_tensors[i] = (*block.parameters(), *block.buffers())
            ptrs = {t.untyped_storage().data_ptr() for t in tensors}
            ptrs.discard(0)
            self._param_ptrs = (i, ptrs)

    def backward_start(self, i: int) -> None:
        # Every chosen block from i up is needed now (normally already on its way), block i-1 next; further
        # below, fetch ahead in backward order while the bytes fetched for blocks not yet reached fit the
        # allowance.
        while self._next < len(self._desc):
            j = self._desc[self._next]
            if j < i - 1:
                ahead = sum(self._block_bytes.get(k, 0) for k in self._desc[:self._next] if k < i)
                if ahead + self._block_bytes.get(j, 0) > self.prefetch.allowance(i):
                    break
            self._fetch_block(j)
            self._next += 1

    def pack(self, i: int, t: torch.Tensor):
        if t.device != self.device or t.layout != torch.strided:
            return None
        if self.casts is not None:
            found = self.casts.source(t)
            if found is not None:
                src, _ = found
                inner = self._offload(i, src) if i in self._chosen else None
                self._stats["casts_elided"] += 1
                self._stats["cast_bytes_elided"] += t.numel() * t.element_size()
                return CastOf(src if inner is None else inner, src, t.dtype, t)
        if i not in self._chosen:
            return None
        return self._offload(i, t)

    def _offload(self, i: int, t: torch.Tensor) -> _Offloaded | None:
        nbytes = t.numel() * t.element_size()
        if nbytes < self.min_bytes or nbytes == 0:
            self._stats["kept_small"] += 1
            self._stats["kept_small_bytes"] += nbytes  # (views of one storage counted each: an upper bound)
            return None
        if _is_parameter(t) or (t.is_leaf and t.requires_grad) or _is_parameter(t._base):
            return None
        if self._param_ptrs[0] == i and t.untyped_storage().data_ptr() in self._param_ptrs[1]:
            return None  # aliases a parameter or buffer (e.g. a .detach() view): copying saves nothing
        if not is_dense(t):
            self._stats["kept_layout"] += 1
            return None
        seen = self._seen.get(id(t))
        rec = seen[2]() if seen is not None and seen[0]() is t and seen[1] == t._version else None
        view = storage = None
        if rec is not None:
            self._stats["deduplicated"] += 1
        else:
            storage = t.untyped_storage()
            same = self._storages.get(storage.data_ptr())
            if same is not None and same[:4] == (t._version, t.storage_offset(), t.numel(), t.dtype) and \
                    same[5]() is storage:
                rec = same[4]()
            if rec is not None:  # another view covering the same range of the same storage: its copy serves
                self._stats["deduplicated"] += 1
                view = _View(rec, t.size(), t.stride())
        if rec is None:
            pad = (t.data_ptr() % _ALIGN) // t.element_size()
            flat = self.arena.empty((t.numel() + pad,), t.dtype)
            host = flat.as_strided(t.size(), t.stride(), pad)
            # detach: the copy must not join the graph. to_host records t on the D2H stream, so its device
            # memory is reused only after the copy has read it.
            rec = _Offloaded(host, self.streams.to_host(t.detach(), host), t.size(), t.stride(), pad)
            self._seen[id(t)] = (weakref.ref(t), t._version, weakref.ref(rec))
            self._storages[storage.data_ptr()] = (t._version, t.storage_offset(), t.numel(), t.dtype, weakref.ref(rec),
                                                  weakref.ref(storage))
            self._stats["offloaded"] += 1
            self._stats["d2h_bytes"] += nbytes
            self._block_bytes[i] = self._block_bytes.get(i, 0) + nbytes
        records = self._records.setdefault(i, [])
        if not any(r() is rec for r in records[-8:]):
            records.append(weakref.ref(rec))
        return rec if view is None else view

    def unpack(self, payload) -> torch.Tensor:
        if isinstance(payload, CastOf):
            inner = payload.inner
            return payload.rebuild(self._unpack_record(inner) if isinstance(inner, (_Offloaded, _View)) else inner)
        return self._unpack_record(payload)

    def _unpack_record(self, rec: _Offloaded | _View) -> torch.Tensor:
        if isinstance(rec, _View):
            dev = self._unpack_record(rec.rec)
            return dev.as_strided(rec.size, rec.stride, dev.storage_offset())
        if rec.h2d is None:
            self._fetch(rec)
        return rec.h2d.wait()

    def _fetch_block(self, j: int) -> None:
        for ref in self._records.get(j, ()):
            rec = ref()
            if rec is not None and rec.h2d is None:
                self._fetch(rec)

    def _fetch(self, rec: _Offloaded) -> None:
        numel = rec.host.numel() + rec.pad
        # On the compute stream, so the buffer comes from (and returns to) the pool backward frees into; the copy
        # waits for the compute stream's queued work (the memory's previous users) and for the D2H copy.
        flat = torch.empty(numel, dtype=rec.host.dtype, device=self.device)
        dev = flat.as_strided(rec.size, rec.stride, rec.pad)
        rec.h2d = self.streams.to_device(rec.host, out=dev, after=rec.d2h.event, wait_current=True)
        self._stats["h2d_bytes"] += rec.host.numel() * rec.host.element_size()
