import pytest
import torch

from trainstream_hf._C import StagingPool


def test_copy_and_async_tickets():
    g = torch.Generator().manual_seed(3)
    pool = StagingPool(2)
    src = torch.randint(0, 255, (3 * (1 << 20) + 7,), dtype=torch.uint8, generator=g)
    dst = torch.empty_like(src)
    pool.copy_(dst, src)
    assert torch.equal(dst, src)
    srcs = [torch.randn(100_000 + i, generator=g) for i in range(8)]
    dsts = [torch.empty_like(s) for s in srcs]
    tickets = [pool.copy_async(d, s) for d, s in zip(dsts, srcs)]
    pool.wait(tickets[-1])  # FIFO: the last done means all done
    assert all(pool.query(t) for t in tickets)
    for t in tickets:
        pool.wait(t)
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    with pytest.raises(RuntimeError, match="unknown ticket"):
        pool.wait(999)
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.copy_async(dsts[0], srcs[0])


def test_bad_pairs():
    pool = StagingPool(1)
    with pytest.raises(RuntimeError, match="elements"):
        pool.copy_(torch.empty(4), torch.randn(5))
    with pytest.raises(RuntimeError, match="dtype"):
        pool.copy_(torch.empty(4, dtype=torch.float64), torch.randn(4))
    with pytest.raises(RuntimeError, match="contiguous"):
        pool.copy_(torch.empty(4), torch.randn(8)[::2])
    with pytest.raises(RuntimeError, match="num_threads"):
        StagingPool(0)
