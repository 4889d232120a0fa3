"""Where one Llama-3-8B block's linear layers spend their time, per format, on the GPU (the bench quant row's step).

python3 scripts/profile_quant.py [row ...]   (default: bf16 fp8 nf4; rows of trainstream_hf.bench.quant)

For each row: the block's 7 layers over 2048 bf16 tokens, forward + input gradients (bench quant's block_step), timed
(median of 20 after 5), then 5 steps under torch.profiler: every CUDA kernel's total time and count, the GPU's busy
time against the wall time, and the CPU ops. Issue 4's FP8 target is 0.75x bf16; the FP8 row ran 0.95x on the H200
at d554c81 (benchmarks/results/quant-ahead-h200-d554c81.json): this splits its time between the FP8 GEMMs
(torch._scaled_mm), the activation / gradient quantization and the weight transpose of the backward; the host's
enqueue time per step (GPU kept busy) tells whether the step is host-bound, and `host` (an extra argument) prints the
enqueue time of each op of the FP8 path. Chrome traces go to $OUT/profile-quant-<row>.json.gz when OUT is set.
"""
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from trainstream_hf.bench.quant import (QUANT_ROWS, _dense, block_inputs, block_linears, block_step,
                                        block_weights)
from trainstream_hf.quant import QuantLinear
from trainstream_hf.quant.formats import quantize

from profiling import busy_time_us, enqueue_seconds, export_trace  # scripts/profiling.py


def layers_for(row: str, linears, device):
    ws = block_weights(linears, device, 0)
    if row == "bf16":
        return [_dense(w) for w in ws]
    fmt, act_quant, outliers, _ = QUANT_ROWS[row]
    return [QuantLinear(quantize(w, fmt), act_quant=act_quant, outliers=outliers) for w in ws]


def host_costs(dev) -> None:
    """Enqueue time of each piece of one FP8 layer call (4096 x 4096 weight, 2048 tokens) beside nn.Linear's."""
    from trainstream_hf import ops
    from trainstream_hf.quant import matmul
    x = torch.randn(2048, 4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(2048, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    dense = _dense(w)
    q = QuantLinear(quantize(w, "fp8"), act_quant=True)
    xq, sx = ops.quantize_rows_e4m3(x.detach())
    wd, ws = q.weight_data, q.weight_scale.view(1, -1)
    rows = {
        "torch.mm bf16": lambda: torch.mm(x.detach(), w.t()),
        "torch._scaled_mm": lambda: torch._scaled_mm(xq, wd.t(), scale_a=sx, scale_b=ws, out_dtype=torch.bfloat16),
        "ops.quantize_rows_e4m3": lambda: ops.quantize_rows_e4m3(x.detach()),
        "ops.transpose_bytes": lambda: ops.transpose_bytes(wd),
        "torch.ones (1, K)": lambda: torch.ones(1, 4096, device=dev),
        "fp8 path forward (no autograd)": lambda: matmul.FP8_W8A8_SCALED_MM.forward(x.detach(), q.weight, None),
        "fp8 path backward (no autograd)": lambda: matmul.FP8_W8A8_SCALED_MM.backward(dy, q.weight),
        "nn.Linear forward": lambda: dense(x),
        "QuantLinear fp8 forward": lambda: q(x),
        "nn.Linear forward + grad": lambda: torch.autograd.grad(dense(x), x, dy),
        "QuantLinear fp8 forward + grad": lambda: torch.autograd.grad(q(x), x, dy),
    }
    print("\n===== host enqueue time per call (GPU busy), us")
    for name, fn in rows.items():
        print(f"  {1e6 * enqueue_seconds(fn, 50):8.1f}  {name}")


def main():
    dev = torch.device("cuda")
    out = os.environ.get("OUT")
    linears = block_linears("llama3-8b")
    args = sys.argv[1:] or ["bf16", "fp8", "nf4"]
    if "host" in args:
        host_costs(dev)
        args = [a for a in args if a != "host"]
    for row in args:
        layers = layers_for(row, linears, dev)
        xs, leaves, grads = block_inputs(linears, 2048, dev, 1)
        step = block_step(layers, xs, leaves, grads)
        for _ in range(5):
            step()
        times = []
        for _ in range(20):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        print(f"\n===== {row}: median {1e3 * statistics.median(times):.3f} ms per block step")
        # Host time per step: the CPU's enqueue time while the GPU is kept busy; a step is host-bound when this is
        # above its kernels' time. 5 steps: 20 FP8 steps (~55 launches each) overflowed the pending-launch queue.
        host = enqueue_seconds(step, 5)
        print(f"host (enqueue) time per step: {1e3 * host:.3f} ms")
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(5):
                step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e6 / 5
        kernels = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                k = kernels.setdefault(e.name, [0.0, 0])
                k[0] += e.time_range.elapsed_us() / 5
                k[1] += 1
        busy = busy_time_us(prof.events()) / 5
        print(f"per step: wall {wall / 1e3:.3f} ms, kernels {busy / 1e3:.3f} ms ({100 * busy / wall:.0f}% busy)")
        for name, (t, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:15]:
            print(f"  {t / 1e3:8.3f} ms  x{n // 5:<3d} {name[:110]}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=50))
        export_trace(prof, out, f"profile-quant-{row}")
        del layers, xs, leaves, grads, step, prof
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
