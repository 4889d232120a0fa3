"""The Python face of the host arena: MemAvailable check, growth, exhaustion, fallback, release."""
import gc
import warnings

import pytest
import torch

from trainstream_hf import _C
from trainstream_hf.engine import arena as arena_mod
from trainstream_hf.engine.arena import ArenaExhaustedError, HostArena, HostMemoryError, host_memory_available

MiB = 2**20


def test_mem_available_parsed(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       32000000 kB\nMemFree:  1000 kB\nMemAvailable:   2048 kB\n")
    assert host_memory_available(str(f)) == 2048 * 1024
    assert host_memory_available(str(tmp_path / "missing")) is None
    assert host_memory_available() > 0  # the real one


def test_reserve_checks_available_memory(monkeypatch):
    monkeypatch.setattr(arena_mod, "host_memory_available", lambda: 64 * MiB)
    before = _C.host_bytes_reserved()
    with pytest.raises(HostMemoryError, match=r"only 67108864 bytes .* available"):
        HostArena("1GiB", pinned=False, slab_bytes="256MiB", memory_margin=0)
    assert _C.host_bytes_reserved() == before  # nothing was reserved


def test_fixed_arena_exhaustion_then_fallback():
    a = HostArena(4 * MiB, pinned=False, slab_bytes=4 * MiB)
    x = a.empty([MiB], torch.float32)  # 4 MiB: the whole slab
    with pytest.raises(ArenaExhaustedError):
        a.empty([16], torch.float32)
    b = HostArena(4 * MiB, pinned=False, slab_bytes=4 * MiB, pageable_fallback=True)
    y = b.empty([MiB], torch.float32)
    with pytest.warns(RuntimeWarning, match="pageable"):
        z = b.empty([1000], torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b.empty([10], torch.float32)  # warned once only
    assert z.shape == (1000,)
    del x, y, z


def test_auto_arena_grows_and_reserve_for():
    a = HostArena("auto", pinned=False, slab_bytes=4 * MiB)
    assert a.stats()["reserved"] == 0
    ts = [a.empty([3 * MiB // 4], torch.float32) for _ in range(3)]  # 3 MiB each: a slab each
    s = a.stats()
    assert s["num_slabs"] == 3 and s["live_allocations"] == 3
    big = a.empty([10 * MiB], torch.uint8)  # larger than a slab: a slab of its own
    assert a.stats()["reserved"] >= 22 * MiB
    src = torch.randn(7, 5)
    assert torch.equal(a.copy_of(src), src)
    a.reserve_for([torch.empty(8 * MiB, dtype=torch.uint8), 1000])
    assert a.stats()["reserved"] - a.stats()["used"] >= 8 * MiB
    del ts, big


def test_close_and_gc_release_everything():
    gc.collect()
    base = _C.host_bytes_reserved()
    a = HostArena("8MiB", pinned=False, slab_bytes=8 * MiB)
    t = a.empty([1000], torch.float64)
    t.copy_(torch.randn(1000, dtype=torch.float64))
    keep = t.clone()
    a.close()
    assert a.closed
    with pytest.raises(RuntimeError, match="closed"):
        a.empty([1], torch.float32)
    assert torch.equal(t, keep)  # live tensors stay valid after close
    assert _C.host_bytes_reserved() > base
    del t
    gc.collect()
    assert _C.host_bytes_reserved() == base
    b = HostArena("8MiB", pinned=False, slab_bytes=8 * MiB)
    assert _C.host_bytes_reserved() == base + 8 * MiB
    del b
    gc.collect()
    assert _C.host_bytes_reserved() == base


@pytest.mark.skipif(arena_mod.pinning_supported(), reason="checks the error where pinning is impossible")
def test_pinned_without_cuda_is_a_clear_error():
    with pytest.raises(RuntimeError, match="pinned=False"):
        HostArena("4MiB", pinned=True)
