import torch

from trainstream_hf.engine.arena import HostArena
from trainstream_hf.engine.staging import StagingRing
from trainstream_hf.engine.streams import TransferStreams


def test_ring_upload_exact_many_times():
    g = torch.Generator().manual_seed(2)
    arena = HostArena("auto", pinned=True, slab_bytes="64MiB")
    ring = StagingRing(TransferStreams("cuda"), arena, slot_bytes=4 << 20, num_slots=3, num_threads=4)
    for k in range(10):
        src = torch.randn(5 * (1 << 20) + 3 * k + 1, generator=g)  # ~20 MiB, odd sizes: 5+ slots
        out = ring.upload(src)
        assert torch.equal(out.cpu(), src)
    ring.close()
