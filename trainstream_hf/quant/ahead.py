"""Dequant-ahead: the next weight-only layer's dense weight is decoded on a side CUDA stream while the current
layer's GEMM runs.

Why: on the weight-only path every layer call decodes its packed weight (``dequantize``, memory-bound) and then runs
its GEMM (compute-bound), one after the other on the compute stream; in a Llama-3-8B block the 14 decodes of a
forward + input-gradient step are ~10% of it (benchmarks/NOTES.md). Issued one layer early on a second stream, a
decode overlaps the previous layer's GEMM instead. Off by default (:func:`set_dequant_ahead`, or
``TRAINSTREAM_DEQUANT_AHEAD=1`` in the environment at import) until it is measured on the GPU.

How. A *request* is "the dense weight of QuantLinear ``m`` in ``dtype``" (:func:`dense`, called by the weight-only
path in forward and by every path that decodes the weight in backward). Per device, the cache learns which request
follows which: the successor of a request is keyed by its *context*, the pair (previous request, this request), a
request being named by its module and whether it runs inside a backward pass (autograd's graph task: checkpoint
recomputes run there too). One module alone is not enough: with activation checkpointing a layer is asked for in the
forward, in its recompute and in its backward, each time followed by another request; the pairs tell those apart
(checkpointed ``A B``: forward ``A B``, backward ``A' B' B' A'``; with one layer per checkpoint, ``L3 L3' L3' L2'
L2' ...``: each pair has one successor). The order is learned afresh at every request (the last successor seen
wins), so a changed schedule costs one step of misses. On a request the cache

1. serves it from the entry it holds if that entry is for this module and dtype, was made for the current CUDA
   stream, and the module's packed tensors are the very memory (``data_ptr``) at the very version (``_version``, which
   every in-place write through torch bumps) that were decoded; else it drops the entry and decodes on the compute
   stream, as without the cache;
2. looks up the successor of the request's context and decodes it ahead: the side stream first waits for the compute
   stream (an event recorded now, so the packed tensors are ready), decodes, and records an event the compute stream
   waits on before the GEMM that uses it. Where the successor is this same request (a layer's forward followed by its
   own backward, the last backward followed by the next step's first forward) the weight just decoded is kept, and
   nothing is decoded again.

Exactness: a served weight is the same kernel on the same bytes as a fresh decode, so results are bit-identical. A
wrong prediction, a moved or modified weight, another stream: each is detected at use and costs the decode it would
have cost anyway. Memory: the cache holds at most one decoded weight per device (dropped when used or found stale),
which is the one extra dense weight a pipeline of depth one needs.

Stream safety (CUDA): the decoded tensor is allocated on the side stream (the dequantize kernels allocate their
output), read on the compute stream only after waiting on its event, and freed on the host right after its GEMM is
queued. The side stream allocates again only at the next prefetch, after waiting on an event of the compute stream
recorded after that GEMM, so a reused block is never written while it is read, and no ``record_stream`` is needed.
That argument needs the tensor to be read on one compute stream only: the cache keeps one side stream per compute
stream, and serves an entry only to its own stream. The entry holds references to the packed tensors it reads until
the compute stream has waited on its event, so they are not freed (and reused by the compute stream) under the
side-stream read.

What is never decoded ahead (the successor is *skipped*; nothing else changes): a module gone (weak references), a
packed tensor not on this device, empty (the weight pager's placeholder of a block not resident), not owning exactly
its storage (a view into the pager's device slot, which the pager overwrites from another stream without any version
bump; also FSDP's flat parameters), an inference tensor, or marked paged by :func:`mark_paged`. Nothing is kept or
served while a CUDA graph is being captured, under ``torch.compile`` tracing, or in inference mode (a weight decoded
there would be an inference tensor, which a later training step could not save for a double backward). Writes that bypass the version counter (through ``.data``, from
outside torch) between the decode ahead and its use (one layer) are not seen, as autograd does not see them either.
"""
from __future__ import annotations

import os
import weakref
from typing import Callable

import torch

from trainstream_hf.quant.formats import QuantizedTensor, dequantize

__all__ = ["set_dequant_ahead", "dequant_ahead_enabled", "dequant_ahead_stats", "reset_dequant_ahead", "dense",
           "mark_paged", "PAGED_ATTR", "STAT_KEYS"]

# Attribute a parameter carries (True) while something else owns its device memory and rewrites it outside the
# compute stream's order (the engine's weight pager); its module is then never decoded ahead.
PAGED_ATTR = "_trainstream_paged"

STAT_KEYS = ("requests", "hits", "misses", "prefetches", "kept", "stale", "skipped")
_MAX_CONTEXTS = 1 << 16  # successor map size past which it is rebuilt (modules created and dropped repeatedly)

_ENABLED = os.environ.get("TRAINSTREAM_DEQUANT_AHEAD", "0").strip().lower() in ("1", "true", "yes", "on")
_CACHES: dict[torch.device, "_Cache | None"] = {}

_GRAPH_TASK = getattr(torch._C, "_current_graph_task_id", None)  # -1 outside a backward pass (what checkpoint uses)
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _in_backward() -> bool:
    return _GRAPH_TASK is not None and _GRAPH_TASK() != -1


def set_dequant_ahead(enabled: bool) -> None:
    """Turns dequant-ahead on or off for every device (the environment's ``TRAINSTREAM_DEQUANT_AHEAD=1`` sets the
    default at import). Either way the learned order and any decoded weight are dropped; the counters are kept.

    Args:
        enabled: decode the predicted next weight on a side CUDA stream (weight-only QuantLinear paths).
    """
    global _ENABLED
    _ENABLED = bool(enabled)
    for cache in _CACHES.values():
        if cache is not None:
            cache.clear()


def dequant_ahead_enabled() -> bool:
    return _ENABLED


def dequant_ahead_stats() -> dict[str, int]:
    """Counters summed over devices since the last :func:`reset_dequant_ahead`.

    Returns:
        ``requests`` (dense weights asked for while enabled), ``hits`` (served from the cache), ``misses`` (decoded on
        the compute stream), ``prefetches`` (decodes issued ahead on a side stream), ``kept`` (a weight kept for its
        own next request), ``stale`` (decoded or kept weights dropped unused), ``skipped`` (predicted successors not
        eligible), and ``held``: decoded weights the cache holds now (at most one per device).
    """
    out = dict.fromkeys(STAT_KEYS, 0)
    held = 0
    for cache in _CACHES.values():
        if cache is not None:
            for k in STAT_KEYS:
                out[k] += cache.stats[k]
            held += cache.entry is not None
    out["held"] = held
    return out


def reset_dequant_ahead() -> None:
    """Drops every device's learned order and decoded weight, and zeroes the counters."""
    for cache in _CACHES.values():
        if cache is not None:
            cache.clear()
            cache.stats = dict.fromkeys(STAT_KEYS, 0)


def mark_paged(param: torch.Tensor, paged: bool = True) -> None:
    """Marks (or unmarks) a parameter whose device memory is managed outside the compute stream's order, so that the
    module holding it is never decoded ahead. For the engine's weight pager; the storage check in the module
    docstring catches its slots already, this makes the exclusion explicit."""
    if paged:
        setattr(param, PAGED_ATTR, True)
    elif hasattr(param, PAGED_ATTR):
        delattr(param, PAGED_ATTR)


def dense(q: QuantizedTensor, dtype: torch.dtype, key=None) -> torch.Tensor:
    """``dequantize(q, dtype)``, served from or feeding the dequant-ahead cache where it is enabled.

    Args:
        q: the packed weight, built around the module's packed tensors (or their saved copies in backward).
        dtype: float32, bfloat16 or float16.
        key: the :class:`~trainstream_hf.quant.linear.QuantLinear` that ``q`` belongs to (its identity keys the
            cache), or None: decode without the cache.

    Returns:
        The (out_features, in_features) weight; read-only (it may be the cache's tensor).
    """
    if key is None or not _ENABLED or torch.is_inference_mode_enabled() or torch.compiler.is_compiling():
        return dequantize(q, dtype)
    device = q.tensors["data"].device
    cache = _CACHES.get(device, _UNSET)
    if cache is _UNSET:
        backend = _BACKENDS.get(device.type)
        cache = _CACHES[device] = None if backend is None else _Cache(device, backend(device))
    if cache is None:
        return dequantize(q, dtype)
    return cache.request(q, dtype, key)


_UNSET = object()


# --------------------------------------------------------------------------------------------------------------
# Streams: where a decode ahead runs and how its consumer waits. Pluggable, so the bookkeeping runs on the CPU too.
# --------------------------------------------------------------------------------------------------------------

class _CudaLane:
    """One compute stream of a device, its side stream, and the two events between them (reused: one decode ahead is
    in flight per lane, and a wait binds to the record that precedes it)."""

    __slots__ = ("index", "compute", "side", "ready", "done")

    def __init__(self, index: int):
        self.index = index
        self.compute = torch.cuda.current_stream(index)
        # High priority: the decode is what the next GEMM waits for, so its blocks go first as the current GEMM's
        # retire; and torch's pool of high-priority streams is not the one the engine's copy streams come from.
        self.side = torch.cuda.Stream(index, priority=-1)
        self.ready = torch.cuda.Event()
        self.done = torch.cuda.Event()

    def run(self, fn: Callable, *args) -> tuple[torch.Tensor, torch.cuda.Event]:
        self.ready.record(self.compute)  # the packed tensors are written, and earlier reads queued, up to here
        self.side.wait_event(self.ready)
        if torch.cuda.current_device() == self.index:  # the common case, without StreamContext's bookkeeping
            torch.cuda.set_stream(self.side)
            try:
                out = fn(*args)
            finally:
                torch.cuda.set_stream(self.compute)
        else:
            with torch.cuda.stream(self.side):
                out = fn(*args)
        self.done.record(self.side)
        return out, self.done

    def wait(self, event) -> None:
        self.compute.wait_event(event)


class _CudaBackend:
    """Lanes of one CUDA device, one per compute stream (created on first use)."""

    def __init__(self, device: torch.device):
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.lanes: dict[int, _CudaLane] = {}

    def lane(self) -> _CudaLane | None:
        if torch.cuda.is_current_stream_capturing():
            return None
        sid = _RAW_STREAM(self.index) if _RAW_STREAM is not None else torch.cuda.current_stream(self.index).cuda_stream
        lane = self.lanes.get(sid)
        if lane is None:
            lane = self.lanes[sid] = _CudaLane(self.index)
        return lane


class InlineLane:
    """A lane that decodes at once, on the calling thread (for the CPU tests of the bookkeeping)."""

    def run(self, fn: Callable, *args):
        return fn(*args), None

    def wait(self, event) -> None:
        pass


class InlineBackend:
    """Backend of :class:`InlineLane`: install it for the CPU with ``_BACKENDS["cpu"] = InlineBackend`` (tests)."""

    def __init__(self, device: torch.device):
        self._lane = InlineLane()

    def lane(self) -> InlineLane:
        return self._lane


# device type -> backend class. The CPU has none: there a decode ahead would only run earlier, on the same cores.
_BACKENDS: dict[str, type] = {"cuda": _CudaBackend}


# --------------------------------------------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------------------------------------------

class _Entry:
    """A decoded weight waiting for its request: what it was decoded from, and the event to wait on before use."""

    __slots__ = ("ref", "dtype", "lane", "marks", "weight", "event", "packed")

    def __init__(self, ref: weakref.ref, dtype, lane, packed, weight, event, hold: bool):
        self.ref = ref
        self.dtype = dtype
        self.lane = lane
        self.marks = tuple((t.data_ptr(), t._version) for t in packed)
        self.weight = weight
        self.event = event
        self.packed = packed if hold else None  # read on the side stream: alive until the compute stream waited

    def matches(self, module, dtype, lane, packed) -> bool:
        if self.ref() is not module or self.dtype is not dtype or self.lane is not lane:
            return False
        if len(packed) != len(self.marks):
            return False
        for t, (ptr, version) in zip(packed, self.marks):
            if t.data_ptr() != ptr or t.is_inference() or t._version != version:
                return False
        return True

    def release(self) -> torch.Tensor:
        if self.event is not None:
            self.lane.wait(self.event)
        return self.weight


def _eligible(packed, device: torch.device) -> bool:
    """Whether packed tensors may be read on a side stream: see the module docstring."""
    for t in packed:
        if t is None or t.device != device:
            return False
        n = t.numel()
        if not n or t.storage_offset() or t.is_inference() or getattr(t, PAGED_ATTR, False):
            return False
        if t.untyped_storage().nbytes() != n * t.element_size():
            return False
    return True


class _Cache:
    """One device's learned request order and its (at most one) decoded weight."""

    def __init__(self, device: torch.device, backend):
        self.device = device
        self.backend = backend
        self.stats = dict.fromkeys(STAT_KEYS, 0)
        self.entry: _Entry | None = None
        self.clear()

    def clear(self) -> None:
        entry, self.entry = self.entry, None
        if entry is not None:
            entry.release()  # the compute stream waits for its decode before the packed tensors are let go
        self.successor: dict[tuple, tuple] = {}  # context -> (weak reference to the module, dtype)
        self.context: tuple | None = None  # the previous request's
        self.previous = 0  # the previous request's id(module) << 1 | inside a backward pass

    def request(self, q: QuantizedTensor, dtype: torch.dtype, module) -> torch.Tensor:
        lane = self.backend.lane()
        if lane is None:
            return dequantize(q, dtype)
        stats = self.stats
        stats["requests"] += 1
        ref = weakref.ref(module)  # CPython hands back the module's one plain weak reference: no allocation
        successor = self.successor
        if self.context is not None:
            successor[self.context] = (ref, dtype)
            if len(successor) > _MAX_CONTEXTS:
                successor.clear()
        me = id(module) << 1 | _in_backward()
        context = self.context = (self.previous, me)
        self.previous = me

        packed = tuple(q.tensors.values())
        weight = None
        entry, self.entry = self.entry, None
        if entry is not None:
            if entry.matches(module, dtype, lane, packed):
                weight = entry.release()
                stats["hits"] += 1
            else:
                entry.release()
                stats["stale"] += 1
            entry = None
        if weight is None:
            weight = dequantize(q, dtype)
            stats["misses"] += 1

        nxt = successor.get(context)
        if nxt is not None:
            self._ahead(nxt, lane, module, dtype, packed, weight)
        return weight

    def _ahead(self, nxt: tuple, lane, module, dtype, packed, weight) -> None:
        ref, next_dtype = nxt
        target = ref()
        if target is module and next_dtype is dtype:
            # The next request is this one again: keep the weight just served (same bytes as decoding again).
            if _eligible(packed, self.device):
                self.entry = _Entry(ref, dtype, lane, packed, weight, None, hold=False)
                self.stats["kept"] += 1
            else:
                self.stats["skipped"] += 1
            return
        if target is None:
            self.stats["skipped"] += 1
            return
        q = target.weight  # its current packed tensors
        nxt_packed = tuple(q.tensors.values())
        if not _eligible(nxt_packed, self.device):
            self.stats["skipped"] += 1
            return
        try:
            out, event = lane.run(dequantize, q, next_dtype)
        except torch.OutOfMemoryError:  # a spare weight does not fit now: decode it when it is asked for
            self.stats["skipped"] += 1
            return
        self.entry = _Entry(ref, next_dtype, lane, nxt_packed, out, event, hold=True)
        self.stats["prefetches"] += 1
