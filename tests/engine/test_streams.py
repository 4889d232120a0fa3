"""TransferStreams on the CPU compute device: same API, synchronous copies."""
import pytest
import torch

from trainstream_hf.engine.streams import TransferStreams


def test_cpu_round_trip_and_counters():
    g = torch.Generator().manual_seed(0)
    s = TransferStreams("cpu")
    src = torch.randn(1000, 3, generator=g)
    t = s.to_device(src)
    assert t.done() and torch.equal(t.wait(), src) and t.tensor.data_ptr() != src.data_ptr()
    slot = torch.empty_like(src)
    assert s.to_device(src, slot).wait() is slot and torch.equal(slot, src)
    back = torch.empty_like(src)
    s.to_host(slot * 2, back).synchronize()
    assert torch.equal(back, src * 2)
    assert s.reset_counters() == {"h2d_bytes": 2 * src.numel() * 4, "d2h_bytes": src.numel() * 4}


def test_bad_arguments():
    s = TransferStreams("cpu")
    x = torch.randn(4)
    with pytest.raises(ValueError, match="out must be"):
        s.to_device(x, torch.empty(5))
    with pytest.raises(ValueError, match="out is"):
        s.to_host(x, torch.empty(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="cuda or cpu"):
        TransferStreams("meta")
