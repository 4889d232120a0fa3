"""Micro-benchmarks of the foundation: arena copy bandwidth, pinning cost, CPU AdamW, staging pool.

``python -m trainstream_hf.bench micro [--quick] [--out DIR]``. Each row is measured in this run beside
its peer (torch's own pinned copies, torch's fused CPU AdamW, a single-threaded copy).
"""
from __future__ import annotations

import time

import torch

from trainstream_hf.bench.adamw import bench_adamw
from trainstream_hf.bench.common import markdown_table, median_time
from trainstream_hf.engine.arena import HostArena, pinning_supported
from trainstream_hf.engine.staging import StagingPool, StagingRing
from trainstream_hf.engine.streams import TransferStreams

MiB, GiB = 2**20, 2**30


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def copy_bandwidth(sizes, repeats: int) -> list[dict]:
    """H2D, D2H and both-at-once GB/s from arena tensors vs torch's pinned tensors (same streams)."""
    streams = TransferStreams("cuda")
    rows = []
    arena = HostArena(max(sizes) * 2 + 64 * MiB, pinned=True)
    for n in sizes:
        dev_a = torch.empty(n, dtype=torch.uint8, device="cuda")
        dev_b = torch.empty(n, dtype=torch.uint8, device="cuda")
        hosts = {"arena": (arena.empty([n], torch.uint8), arena.empty([n], torch.uint8)),
                 "torch pinned": (torch.empty(n, dtype=torch.uint8, pin_memory=True),
                                  torch.empty(n, dtype=torch.uint8, pin_memory=True))}
        for h in hosts.values():
            h[0].random_(0, 255)
        reps = repeats if n < 256 * MiB else max(3, repeats // 2)
        res = {}
        for name, (h_src, h_dst) in hosts.items():
            h2d = lambda: dev_a.copy_(h_src, non_blocking=True)  # noqa: E731
            d2h = lambda: h_dst.copy_(dev_b, non_blocking=True)  # noqa: E731

            def both():
                cur = torch.cuda.current_stream()
                streams.h2d.wait_stream(cur)
                streams.d2h.wait_stream(cur)
                with torch.cuda.stream(streams.h2d):
                    dev_a.copy_(h_src, non_blocking=True)
                with torch.cuda.stream(streams.d2h):
                    h_dst.copy_(dev_b, non_blocking=True)
                cur.wait_stream(streams.h2d)
                cur.wait_stream(streams.d2h)

            res[name] = {"h2d": _gbps(n, median_time(h2d, repeats=reps, cuda=True)),
                         "d2h": _gbps(n, median_time(d2h, repeats=reps, cuda=True)),
                         "both": _gbps(2 * n, median_time(both, repeats=reps, cuda=True))}
        a, t = res["arena"], res["torch pinned"]
        rows.append({"size_MiB": n / MiB, "arena_h2d": a["h2d"], "torch_h2d": t["h2d"],
                     "arena_d2h": a["d2h"], "torch_d2h": t["d2h"], "arena_both": a["both"],
                     "torch_both": t["both"],
                     "min_ratio": min(a[k] / t[k] for k in ("h2d", "d2h", "both"))})
        del hosts, dev_a, dev_b
    arena.close()
    return rows


def pinning_cost(nbytes: int) -> dict:
    """Seconds per GiB to pin: the arena's cudaHostAlloc slabs vs torch's pinned allocator."""
    arena = HostArena(0, pinned=True, slab_bytes=min(nbytes, GiB))
    arena.reserve(nbytes)
    ours = arena.pin_seconds
    arena.close()
    del arena
    t0 = time.perf_counter()
    t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    theirs = time.perf_counter() - t0
    del t
    return {"GiB": nbytes / GiB, "arena_s_per_GiB": ours / (nbytes / GiB),
            "torch_pin_s_per_GiB": theirs / (nbytes / GiB)}


def staging(nbytes: int, threads: int, repeats: int) -> list[dict]:
    """Pageable -> pinned copy GB/s with the staging pool, 1 thread vs ``threads``; plus, on CUDA,
    pageable -> device through the StagingRing vs torch's pageable ``.to('cuda')``."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    arena = HostArena("auto", slab_bytes=max(nbytes, 64 * MiB))
    dst = arena.empty([nbytes], torch.uint8)
    rows = []
    for n in sorted({1, threads}):
        pool = StagingPool(n)
        t = median_time(lambda: pool.copy_(dst, src), repeats=repeats)
        rows.append({"what": f"pageable->{'pinned' if arena.pinned else 'arena'} copy, {n} thread(s)",
                     "GB/s": _gbps(nbytes, t)})
        pool.close()
    assert torch.equal(dst, src)
    if torch.cuda.is_available() and pinning_supported():
        streams = TransferStreams("cuda")
        ring = StagingRing(streams, arena, num_threads=threads)
        out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        t_ring = median_time(lambda: ring.upload(src, out), repeats=repeats, cuda=True)
        assert torch.equal(out.cpu(), src)
        t_plain = median_time(lambda: out.copy_(src), repeats=repeats, cuda=True)
        rows.append({"what": f"pageable->device, StagingRing ({threads} threads)", "GB/s": _gbps(nbytes, t_ring)})
        rows.append({"what": "pageable->device, torch copy_", "GB/s": _gbps(nbytes, t_plain)})
        ring.close()
    del dst
    arena.close()
    return rows


def contention(numel: int, chunk_bytes: int, repeats: int) -> dict:
    """Does the CPU AdamW slow down while pinned copies run both ways, and the copies while it runs? (The plan's
    split of the offloaded optimizer between the CPU and the PCIe link assumes they do not: both read and write host
    memory.) AdamW over ``numel`` fp32 parameters with the bf16 copy, all threads, alone and beside H2D + D2H copies
    of ``chunk_bytes`` pinned chunks issued to last about as long; the copies alone and beside it."""
    from trainstream_hf import ops

    streams = TransferStreams("cuda")
    g = torch.Generator().manual_seed(0)
    p, grad = torch.randn(numel, generator=g), torch.randn(numel, generator=g)
    m, v, out16 = torch.zeros(numel), torch.zeros(numel), torch.empty(numel, dtype=torch.bfloat16)
    host_up = torch.empty(chunk_bytes, dtype=torch.uint8).pin_memory()
    host_down = torch.empty(chunk_bytes, dtype=torch.uint8).pin_memory()
    dev_up = torch.empty(chunk_bytes, dtype=torch.uint8, device="cuda")
    dev_down = torch.empty(chunk_bytes, dtype=torch.uint8, device="cuda")
    step = [0]

    def adam() -> float:
        step[0] += 1
        t0 = time.perf_counter()
        ops.adamw_step_(p, m, v, grad, lr=1e-3, weight_decay=0.01, step=step[0], param_bf16=out16)
        return time.perf_counter() - t0

    def copies(n: int):
        """n chunks each way, queued at once; returns (start, end) events over both streams."""
        start = torch.cuda.Event(enable_timing=True)
        start.record(streams.h2d)
        streams.d2h.wait_event(start)
        for _ in range(n):
            with torch.cuda.stream(streams.h2d):
                dev_up.copy_(host_up, non_blocking=True)
            with torch.cuda.stream(streams.d2h):
                host_down.copy_(dev_down, non_blocking=True)
        streams.h2d.wait_stream(streams.d2h)
        end = torch.cuda.Event(enable_timing=True)
        end.record(streams.h2d)
        return start, end

    adam()  # warm-up
    alone = sorted(adam() for _ in range(repeats))[repeats // 2]
    start, end = copies(4)
    end.synchronize()
    per_chunk = start.elapsed_time(end) / 1e3 / 4  # seconds per chunk each way, both directions at once
    n = max(4, int(alone / per_chunk))
    copy_alone = []
    for _ in range(repeats):
        start, end = copies(n)
        end.synchronize()
        copy_alone.append(2 * n * chunk_bytes / (start.elapsed_time(end) / 1e3) / 1e9)
    adam_beside, copy_beside = [], []
    for _ in range(repeats):
        start, end = copies(n)
        adam_beside.append(adam())
        end.synchronize()
        copy_beside.append(2 * n * chunk_bytes / (start.elapsed_time(end) / 1e3) / 1e9)
    mid = repeats // 2
    row = {"params": numel, "threads": torch.get_num_threads(), "chunk_MiB": chunk_bytes / MiB,
           "adamw_alone_Gps": numel / alone / 1e9, "adamw_beside_copies_Gps": numel / sorted(adam_beside)[mid] / 1e9,
           "copies_alone_GBps": sorted(copy_alone)[mid], "copies_beside_adamw_GBps": sorted(copy_beside)[mid]}
    row["adamw_slowdown"] = row["adamw_alone_Gps"] / row["adamw_beside_copies_Gps"]
    row["copies_slowdown"] = row["copies_alone_GBps"] / row["copies_beside_adamw_GBps"]
    return row


def run(quick: bool = False) -> tuple[dict, str]:
    """Runs every micro-benchmark; returns (JSON payload, markdown report)."""
    cuda = torch.cuda.is_available() and pinning_supported()
    threads = torch.get_num_threads()
    repeats = 3 if quick else 10
    payload: dict = {"suite": "micro", "quick": quick}
    md = []
    if cuda:
        sizes = [MiB, 16 * MiB] if quick else [MiB, 16 * MiB, 256 * MiB, GiB]
        payload["copy_bandwidth_GBps"] = copy_bandwidth(sizes, repeats)
        md += ["### Host<->device copies (GB/s): arena vs torch pinned, same streams",
               markdown_table(payload["copy_bandwidth_GBps"],
                              ["size_MiB", "arena_h2d", "torch_h2d", "arena_d2h", "torch_d2h",
                               "arena_both", "torch_both", "min_ratio"])]
        payload["pinning"] = pinning_cost(GiB if quick else 4 * GiB)
        md += ["### Pinning cost", markdown_table([payload["pinning"]], list(payload["pinning"]))]
        payload["contention"] = contention(8 << 20 if quick else 400_000_000, 64 * MiB if quick else 256 * MiB,
                                           3 if quick else 5)
        md += ["### CPU AdamW (+bf16) and pinned copies both ways, alone and at once",
               markdown_table([payload["contention"]], list(payload["contention"]))]
    else:
        payload["copy_bandwidth_GBps"] = "not run: no CUDA device (or CPU build)"
        payload["contention"] = "not run: no CUDA device (or CPU build)"
        md += ["Copy bandwidth, pinning and contention: not run (no CUDA device or CPU build)."]
    numel = 2_000_000 if quick else 50_000_000
    payload["adamw"] = bench_adamw(numel=numel, repeats=repeats)
    md += [f"### CPU AdamW, {numel:,} fp32 params (G params/s; +bf16 = also writes the bf16 copy)",
           markdown_table(payload["adamw"], list(payload["adamw"][0]))]
    nbytes = 32 * MiB if quick else GiB
    payload["staging"] = staging(nbytes, threads, repeats)
    md += [f"### Staging, {nbytes / MiB:.0f} MiB", markdown_table(payload["staging"], ["what", "GB/s"])]
    return payload, "\n\n".join(md)
