"""The benchmark harness's step timing on CUDA: work a step leaves running for the next one is charged."""
import torch

from trainstream_hf.bench.common import median_time


def test_pipelined_timing_charges_work_carried_into_the_next_step():
    """A step whose tail runs on a side stream that the next step waits for (as an overlapped optimizer step's
    copies and CPU updates are): synchronising before each run hides the tail, the pipelined timing does not."""
    side = torch.cuda.Stream()
    a = torch.randn(4096, 4096, device="cuda")

    def step():
        torch.cuda.current_stream().wait_stream(side)  # the previous step's tail first
        a @ a
        with torch.cuda.stream(side):
            for _ in range(20):
                a @ a

    pipelined = median_time(step, repeats=5, warmup=2, cuda=True, pipelined=True)
    synced = median_time(step, repeats=5, warmup=2, cuda=True)
    assert pipelined > 5 * synced


def test_contention_row_measures_both_sides():
    from trainstream_hf.bench.micro import contention

    row = contention(1 << 22, 8 << 20, 3)
    assert row["adamw_alone_Gps"] > 0 and row["adamw_beside_copies_Gps"] > 0
    assert row["copies_alone_GBps"] > 1 and row["copies_beside_adamw_GBps"] > 1
    assert row["adamw_slowdown"] > 0 and row["copies_slowdown"] > 0
