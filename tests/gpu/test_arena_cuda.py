"""Pinned arena on a real GPU: page-locked, truly asynchronous, and released on close/gc."""
import gc

import torch

from trainstream_hf import _C
from trainstream_hf.engine.arena import HostArena

MiB = 2**20


def test_pinned_tensors_are_pinned_and_copy_exact():
    a = HostArena("64MiB", pinned=True, slab_bytes="32MiB")
    assert a.pinned and a.stats()["pinned"]
    g = torch.Generator().manual_seed(0)
    x = a.empty([3, 1 << 20], torch.float32)
    assert x.is_pinned()
    x.copy_(torch.randn(3, 1 << 20, generator=g))
    d = x.to("cuda", non_blocking=True)
    y = a.empty_like(x)
    y.copy_(d, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(y, x)


def test_nothing_stays_pinned():
    gc.collect()  # arenas of earlier tests
    base = _C.pinned_bytes()
    a = HostArena("64MiB", pinned=True, slab_bytes="32MiB")
    t = a.empty([MiB], torch.uint8)
    assert _C.pinned_bytes() == base + 64 * MiB
    a.close()
    assert _C.pinned_bytes() == base + 64 * MiB  # a live tensor keeps its slabs
    del t
    gc.collect()
    assert _C.pinned_bytes() == base
    b = HostArena("32MiB", pinned=True, slab_bytes="32MiB")
    del b
    gc.collect()
    assert _C.pinned_bytes() == base
