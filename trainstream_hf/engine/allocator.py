"""The CUDA caching allocator's expandable segments, for plans that fill the budget.

A paged plan fills the budget to within its margin, and the caching allocator's fixed-size segments can hold
gigabytes free but split between live blocks: the 32B LoRA at 24 GiB (H200, 19b40ff, 2026-12-04:
benchmarks/results/engine-paged-h200-19b40ff.json, benchmarks/NOTES.md) ran out of memory with 21.4 GiB allocated
and 2.2 GiB reserved but free, asking for 594 MiB. Expandable segments map physical pages into one growing virtual
range per stream, so freed pages are reused for any size: fragmentation stops costing device memory. The setting
applies to segments created after it, process-wide; it cannot be undone for those, so wrap() turns it on only when
the plan fills the budget (``expandable_segments="auto"``, ``Plan.fills_budget``: paged weights, offloaded or
recomputed activations, the optimizer's device share, or a peak predicted within 10% of the budget; the device
share's 3B full fine-tune at 24 GiB ran out of memory with 3.2 GiB reserved but free: H200, 5cb2cc5,
engine-full-3b-h200-5cb2cc5.json) and the user has not chosen a setting in ``PYTORCH_CUDA_ALLOC_CONF``.
"""
from __future__ import annotations

import os
import warnings

import torch

__all__ = ["wants_expandable_segments", "enable_expandable_segments"]


def _user_chose(env: dict | None = None) -> bool:
    env = os.environ if env is None else env
    conf = env.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + env.get("PYTORCH_ALLOC_CONF", "")
    return "expandable_segments" in conf


def wants_expandable_segments(option, device: torch.device, fills: bool, env: dict | None = None) -> bool:
    """Whether wrap() should turn expandable segments on: ``option`` True, or ``"auto"`` on CUDA for a plan that
    fills the budget (``fills``: paged weights or a device share of the optimizer) and no ``expandable_segments``
    in ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF``. False never touches the allocator."""
    if option not in ("auto", True, False):
        raise ValueError(f"expandable_segments: 'auto', True or False, got {option!r}")
    if torch.device(device).type != "cuda" or option is False:
        return False
    return option is True or (fills and not _user_chose(env))


def enable_expandable_segments() -> bool:
    """Turns expandable segments on for segments allocated from now on, and releases the cached (unused)
    fixed-size segments so the plan's memory comes from the new kind. Returns False, with a warning, when this
    torch has no runtime setter."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        legacy = getattr(torch.cuda.memory, "_set_allocator_settings", None)
        if legacy is None:
            warnings.warn("trainstream_hf: this torch cannot switch the CUDA allocator to expandable segments at run "
                          "time; set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before starting, or the plan's "
                          "margin may be lost to fragmentation", RuntimeWarning, stacklevel=3)
            return False

        def setter(conf: str) -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                legacy(conf)
    setter("expandable_segments:True")
    torch.cuda.empty_cache()
    return True
