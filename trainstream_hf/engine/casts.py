"""Exact widening casts that autograd saves: keep the narrow source instead, cast again in backward.

PEFT's LoRA layers cast their input to the adapters' dtype (``_cast_input_dtype``; fp32 adapters over a bf16
base is PEFT's default), and autograd saves that fp32 copy for the ``lora_A`` weight gradient. In a Llama
block these copies are about half of all saved bytes (q, k and v each save their own fp32 copy of the same
normed input). A bf16 -> fp32 (or fp16 -> fp32) conversion is exact, so the block can keep the bf16 source
(half the bytes, one copy for q, k and v) and convert it again when backward needs it: the same values bit
for bit, for the cost of one elementwise kernel per saved copy.

:class:`CastSources` remembers, for each cast output still alive, its source and both tensors' version
counters. Casts are recorded by wrapping ``_cast_input_dtype`` on the modules that have one (duck-typed:
PEFT's tuner layers; nothing here imports PEFT). :meth:`CastSources.source` answers, for a tensor autograd
is saving (the cast output or a view of it), the source to keep, or None when the tensor is not such a cast
or either tensor changed since (version counters).
"""
from __future__ import annotations

import weakref
from typing import Iterable

import torch
from torch import nn

from trainstream_hf.engine.hooks import is_dense

_PRUNE_AT = 1024  # entries in the cast map before its dead ones are first dropped

__all__ = ["CastSources", "CastOf"]

_METHOD = "_cast_input_dtype"


class CastOf:
    """A saved tensor replaced by its source: ``inner`` (the source, or a listener's payload for it),
    rebuilt as ``source.to(dtype)`` viewed with the saved tensor's size, stride and offset."""

    __slots__ = ("inner", "source", "source_version", "dtype", "size", "stride", "offset")

    def __init__(self, inner, source: torch.Tensor, dtype: torch.dtype, view: torch.Tensor):
        self.inner = inner
        # Weak: when the source is offloaded, holding it would keep its device memory. While it is alive its
        # version is checked again in backward (an in-place write after the save would change the values).
        self.source = weakref.ref(source)
        self.source_version = source._version
        self.dtype = dtype
        self.size = view.size()
        self.stride = view.stride()
        self.offset = view.storage_offset()

    def rebuild(self, source_value: torch.Tensor) -> torch.Tensor:
        src = self.source()
        if src is not None and src._version != self.source_version:
            raise RuntimeError(
                "trainstream: a tensor whose widened copy autograd saved was modified by an inplace operation "
                f"after the save (version {self.source_version} -> {src._version}); the copy's values are gone. "
                "Wrap with elide_casts=False for this model.")
        full = source_value.to(self.dtype)
        return full.as_strided(self.size, self.stride, self.offset)


class CastSources:
    """Cast outputs of the current step -> their sources (all weak)."""

    def __init__(self):
        # id(out) -> (weakref(out), out version, weakref(src), src version)
        self._map: dict[int, tuple[weakref.ref, int, weakref.ref, int]] = {}
        self._prune_at = _PRUNE_AT
        self._patched: list[nn.Module] = []
        self.recorded = 0

    def __len__(self) -> int:
        """Live entries (recorded cast outputs still alive)."""
        return sum(1 for e in self._map.values() if e[0]() is not None)

    # -- recording ------------------------------------------------------------------------------
    def record(self, src, out) -> None:
        """Remembers that ``out`` is ``src.to(out.dtype)`` (only exact widening casts of dense tensors that
        kept ``src``'s strides, under grad mode: nothing else could be rebuilt bit for bit)."""
        if not (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor)) or out is src:
            return
        if torch.compiler.is_compiling():  # a compiled block: its graph decides what it saves (and reads no versions)
            return
        if not torch.is_grad_enabled() or src.device != out.device or src.layout != torch.strided:
            return
        if not (src.dtype.is_floating_point and out.dtype.is_floating_point):
            return
        if out.element_size() <= src.element_size():  # a wider float format holds every narrower value exactly
            return
        if out._base is not None or out.storage_offset() != 0 or out.size() != src.size() \
                or out.stride() != src.stride() or not is_dense(src):
            return
        # No weakref callback to drop the entry when ``out`` dies: it would run Python code wherever the tensor is
        # freed (inside backward), where a Ctrl-C raised in it is printed and lost. Dead entries are pruned here
        # instead, whenever the map has doubled (``source`` checks that an entry's tensor is still the one asked).
        if len(self._map) >= self._prune_at:
            self._map = {k: e for k, e in self._map.items() if e[0]() is not None}
            self._prune_at = max(_PRUNE_AT, 2 * len(self._map))
        self._map[id(out)] = (weakref.ref(out), out._version, weakref.ref(src), src._version)
        self.recorded += 1

    def source(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(source, cast output)`` when ``t`` is a recorded cast output or a view of one, both unchanged
        since the cast; else None (always while torch.compile traces: nothing is recorded there)."""
        if torch.compiler.is_compiling():
            return None
        base = t if t._base is None else t._base
        e = self._map.get(id(base))
        if e is None:
            return None
        out_ref, out_version, src_ref, src_version = e
        if out_ref() is not base or base._version != out_version:
            return None
        src = src_ref()
        if src is None or src._version != src_version:
            return None
        return src, base

    def clear(self) -> None:
        self._map.clear()

    # -- installing -----------------------------------------------------------------------------
    def install(self, modules: Iterable[nn.Module]) -> int:
        """Wraps ``_cast_input_dtype`` of every module that has one (an instance attribute shadowing the
        class's method; :meth:`uninstall` removes it). Returns how many were wrapped."""
        for m in modules:
            if m in self._patched or not callable(getattr(type(m), _METHOD, None)) or _METHOD in m.__dict__:
                continue
            orig = getattr(m, _METHOD)

            def cast(x, dtype, _orig=orig, _record=self.record):
                out = _orig(x, dtype)
                if out is not x:
                    _record(x, out)
                return out

            m.__dict__[_METHOD] = cast
            self._patched.append(m)
        return len(self._patched)

    def uninstall(self) -> None:
        for m in self._patched:
            m.__dict__.pop(_METHOD, None)
        self._patched = []
        self._map.clear()
