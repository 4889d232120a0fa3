import pytest
import torch

from trainstream_hf.engine.arena import HostArena
from trainstream_hf.engine.staging import StagingRing
from trainstream_hf.engine.streams import TransferStreams


def test_ring_upload_cpu_exact():
    g = torch.Generator().manual_seed(1)
    arena = HostArena("auto", pinned=False, slab_bytes="8MiB")
    ring = StagingRing(TransferStreams("cpu"), arena, slot_bytes=1 << 20, num_slots=2, num_threads=2)
    src = torch.randn(3 * (1 << 18) + 77, generator=g).to(torch.bfloat16)  # not a multiple of the slot
    out = ring.upload(src)
    assert torch.equal(out, src)
    ring.close()


def test_ring_rejects_bad_setup():
    arena = HostArena("auto", pinned=False, slab_bytes="8MiB")
    with pytest.raises(ValueError, match="num_slots"):
        StagingRing(TransferStreams("cpu"), arena, num_slots=1)
    ring = StagingRing(TransferStreams("cpu"), arena, slot_bytes=1 << 20, num_slots=2)
    with pytest.raises(ValueError, match="contiguous"):
        ring.upload(torch.randn(8, 8).t())
    ring.close()
