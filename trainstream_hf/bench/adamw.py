"""CPU AdamW throughput: our fused kernel (with the bf16 copy in the same pass) vs torch's fused CPU AdamW
followed by the separate bf16 copy the engine would then need."""
from __future__ import annotations

import torch

from trainstream_hf import ops
from trainstream_hf.bench.common import median_time


def bench_adamw(numel: int = 50_000_000, threads=(1, None), repeats: int = 5) -> list[dict]:
    """Median params/s per variant at each thread count (None = all of torch's threads)."""
    saved = torch.get_num_threads()
    g = torch.Generator().manual_seed(0)
    p = torch.randn(numel, generator=g)
    grad = torch.randn(numel, generator=g)
    m, v = torch.zeros(numel), torch.zeros(numel)
    out16 = torch.empty(numel, dtype=torch.bfloat16)
    tp = torch.nn.Parameter(p.clone())
    tp.grad = grad.clone()
    opt = torch.optim.AdamW([tp], lr=1e-3, weight_decay=0.01, fused=True)
    rows = []
    try:
        for t in threads:
            n = saved if t is None else t
            torch.set_num_threads(n)
            step = [0]

            def ours(bf16: bool):
                step[0] += 1
                ops.adamw_step_(p, m, v, grad, lr=1e-3, weight_decay=0.01, step=step[0],
                                param_bf16=out16 if bf16 else None)

            def torch_fused(bf16: bool):
                opt.step()
                if bf16:
                    out16.copy_(tp.detach())

            row = {"threads": n}
            for name, fn in (("ours+bf16", lambda: ours(True)), ("ours", lambda: ours(False)),
                             ("torch_fused+bf16", lambda: torch_fused(True)),
                             ("torch_fused", lambda: torch_fused(False))):
                row[name] = numel / median_time(fn, repeats=repeats, warmup=1) / 1e9
            row["speedup_with_bf16"] = row["ours+bf16"] / row["torch_fused+bf16"]
            rows.append(row)
    finally:
        torch.set_num_threads(saved)
    return rows
