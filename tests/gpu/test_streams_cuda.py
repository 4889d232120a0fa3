"""Producer/consumer across the compute, H2D and D2H streams: exact every time thanks to the events.

Each round reuses the same device slot and host buffer. Without the guards the H2D copy of round k+1
would overwrite the slot while the compute stream still reads round k (a long matmul chain delays it),
and the host would read the D2H buffer before the copy landed.
"""
import torch

from trainstream_hf.engine.arena import HostArena
from trainstream_hf.engine.streams import TransferStreams


def test_slot_reuse_and_readback_stay_exact():
    torch.manual_seed(0)
    s = TransferStreams("cuda")
    arena = HostArena("auto", pinned=True, slab_bytes="64MiB")
    n = 1 << 22
    hosts = [arena.empty([n], torch.float32) for _ in range(2)]
    back = arena.empty([n], torch.float32)
    slot = torch.empty(n, device="cuda")
    slow = torch.randn(2048, 2048, device="cuda")
    for k in range(60):
        h = hosts[k % 2]
        h.fill_(float(k))
        t = s.to_device(h, slot)  # waits for the compute stream's reads of the previous round
        x = t.wait()
        for _ in range(4):
            slow = torch.tanh(slow @ slow)  # keeps the compute stream busy behind the read below
        y = x * 2 + 1
        r = s.to_host(y, back)  # waits for y; y may be freed at once
        del y
        r.synchronize()
        assert torch.equal(back, torch.full_like(back, 2.0 * k + 1)), f"stale data in round {k}"
    s.synchronize()


def test_fresh_device_tensor_recorded_on_consumer():
    torch.manual_seed(1)
    s = TransferStreams("cuda")
    src = torch.randn(1 << 20).pin_memory()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        t = s.to_device(src)
        out = t.wait() * 3  # consumer is the side stream
    side.synchronize()
    assert torch.equal(out.cpu(), src * 3)
