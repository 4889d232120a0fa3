"""Pinned host arena: page-locked memory reserved in a few large slabs, sub-allocated for the whole run.

Pinning is slow (about 0.64 s per GiB on the reference host, shared/GPU.md), so the engine pins once at
wrap time and hands out tensors from the slabs; a tensor's block returns to the arena when the tensor is
freed. Without CUDA (CPU build, or no GPU) the same API hands out ordinary aligned memory, so every layer
above runs in CI.
"""
from __future__ import annotations

import os
import time
import warnings
from typing import Iterable, Sequence

import torch

from trainstream_hf import ops
from trainstream_hf._C import HostArena as _NativeArena
from trainstream_hf.config import parse_bytes

__all__ = ["HostArena", "ArenaExhaustedError", "HostMemoryError", "host_memory_available",
           "pinning_supported"]

_MEMINFO = "/proc/meminfo"


class ArenaExhaustedError(MemoryError):
    """Raised when a fixed-size arena has no free block large enough (and no pageable fallback)."""


class HostMemoryError(MemoryError):
    """Raised before pinning when the host does not have the memory the arena would need."""


def host_memory_available(meminfo: str = _MEMINFO) -> int | None:
    """Bytes of host RAM available to new allocations (Linux MemAvailable), or None if unknown."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def pinning_supported() -> bool:
    """True when page-locked memory can be had: a CUDA build of the extension and a visible GPU."""
    return ops.built_with_cuda() and torch.cuda.is_available()


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()


class HostArena:
    """Host memory reserved in slabs and sub-allocated as CPU tensors.

    Args:
        size: ``"auto"`` reserves as the caller asks (``reserve`` / ``reserve_for``, and slab by slab when
            ``empty`` runs out); a byte count or a string like ``"48GiB"`` reserves that much now and never
            grows; ``0`` / ``None`` reserves nothing now and grows like ``"auto"``.
        pinned: page-locked memory (``cudaHostAlloc``). ``None`` = pinned when :func:`pinning_supported`.
        slab_bytes: size of each slab.
        alignment: block alignment in bytes (power of two, >= 256).
        pageable_fallback: when a fixed-size arena is exhausted, return an ordinary pageable tensor and warn
            once, instead of raising :class:`ArenaExhaustedError`.
        memory_margin: bytes of MemAvailable that must stay free after a reservation.
    """

    def __init__(self, size: int | str | None = "auto", *, pinned: bool | None = None,
                 slab_bytes: int | str = "1GiB", alignment: int = 256, pageable_fallback: bool = False,
                 memory_margin: int | str = "1GiB"):
        if pinned is None:
            pinned = pinning_supported()
        elif pinned and not pinning_supported():
            why = "the extension was built without CUDA" if not ops.built_with_cuda() else "no GPU is visible"
            raise RuntimeError(f"HostArena(pinned=True): page-locked memory needs CUDA, but {why}; "
                               "use pinned=False (pageable, aligned memory)")
        self.pinned = bool(pinned)
        if self.pinned:
            # torch answers is_pinned() (and so picks truly asynchronous copies) only once its CUDA state is
            # initialised; our cudaHostAlloc does not do that for it.
            torch.cuda.init()
        self.slab_bytes = parse_bytes(slab_bytes, name="slab_bytes")
        self.memory_margin = parse_bytes(memory_margin, name="memory_margin")
        self.growable = size in ("auto", None, 0)
        self.pageable_fallback = pageable_fallback
        self.pin_seconds = 0.0
        self._warned_fallback = False
        self._native = _NativeArena(self.slab_bytes, self.pinned, alignment)
        if not self.growable:
            self.reserve(parse_bytes(size, name="host_arena"))

    # -- reservation ----------------------------------------------------------------------------
    def reserve(self, nbytes: int, *, contiguous: bool = False) -> None:
        """Adds slabs holding at least ``nbytes`` more, after checking the host can afford them.

        Args:
            nbytes: bytes to add, in slabs of ``slab_bytes``.
            contiguous: one slab of ``nbytes`` (room for a single block larger than a slab).
        """
        if nbytes <= 0:
            return
        available = host_memory_available()
        if available is not None and nbytes + self.memory_margin > available:
            gib = 2**30
            raise HostMemoryError(
                f"host arena: reserving {nbytes} bytes ({nbytes / gib:.2f} GiB) would leave less than "
                f"{self.memory_margin / gib:.2f} GiB free, but only {available} bytes "
                f"({available / gib:.2f} GiB) are available (MemAvailable); lower host_arena, free host "
                "memory, or page fewer tensors")
        t0 = time.perf_counter()
        if contiguous:
            self._native.add_slab(int(nbytes))
        else:
            self._native.reserve(int(nbytes))
        self.pin_seconds += time.perf_counter() - t0

    def reserve_for(self, tensors_or_sizes: Iterable[torch.Tensor | int]) -> None:
        """Reserves room for the given tensors (or byte counts) beyond what is free now."""
        align = self._native.stats()["alignment"]
        need = 0
        for t in tensors_or_sizes:
            n = t.numel() * t.element_size() if isinstance(t, torch.Tensor) else int(t)
            need += -(-n // align) * align
        s = self._native.stats()
        self.reserve(max(0, need - (s["reserved"] - s["used"])))

    # -- allocation -----------------------------------------------------------------------------
    def empty(self, shape: Sequence[int] | torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A contiguous, uninitialised CPU tensor in the arena (pinned when the arena is)."""
        shape = [int(s) for s in shape]
        out = self._native.empty(shape, dtype)
        if isinstance(out, torch.Tensor):
            return out
        if self.growable and not self.closed:
            need = _nbytes(shape, dtype)
            self.reserve(max(self.slab_bytes, need), contiguous=True)
            out = self._native.empty(shape, dtype)
            if isinstance(out, torch.Tensor):
                return out
        if not self.pageable_fallback:
            raise ArenaExhaustedError(out[1])
        if not self._warned_fallback:
            warnings.warn("host arena exhausted: handing out pageable memory (slower copies); raise "
                          "host_arena to keep every transfer pinned", RuntimeWarning, stacklevel=2)
            self._warned_fallback = True
        return torch.empty(shape, dtype=dtype)

    def empty_like(self, t: torch.Tensor) -> torch.Tensor:
        return self.empty(t.shape, t.dtype)

    def copy_of(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` (any device) in the arena."""
        out = self.empty(t.shape, t.dtype)
        out.copy_(t)
        return out

    # -- life cycle -----------------------------------------------------------------------------
    def stats(self) -> dict:
        """reserved / used / peak / largest_free bytes, slabs, live allocations, pinning time."""
        s = dict(self._native.stats())
        s["pin_seconds"] = self.pin_seconds
        return s

    @property
    def closed(self) -> bool:
        return bool(self._native.closed)

    def close(self) -> None:
        """No more allocations; slabs are released once no tensor from the arena is alive."""
        self._native.close()

    def __enter__(self) -> "HostArena":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self._native.stats()
        return (f"HostArena(pinned={self.pinned}, reserved={s['reserved']}, used={s['used']}, "
                f"peak={s['peak']}, slabs={s['num_slabs']})")


def default_staging_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))
