"""Host-side (Python + dispatch) cost of one QuantLinear call, forward + input gradient, on the CPU.

python3 scripts/overhead_quant.py [--calls 1000] [--repeats 7] [--profile]

On the GPU the FP8 path's kernels are short enough (tens of microseconds per layer at 2048 tokens) that the host
side, which queues them, is about as long (benchmarks/NOTES.md, 2026-12-03 H200 quant profile). This measures that
host side alone: tiny layers (4 tokens, 16 x 16) whose kernels take about a microsecond, with ``torch._scaled_mm``
replaced by a fake that only allocates its output, and the CPU routed to the FP8 tensor-core path
(``fp8_w8a8_scaled_mm``). Rows:

* ``nn.Linear bf16``: the floor (autograd + one GEMM each way).
* ``fp8 W8A8 (scaled_mm), 1 layer``: one layer, a fresh input per call (no activation reuse).
* ``fp8 W8A8 (scaled_mm), q/k/v on one x``: three layers reading one input (per layer call).
* ``fp8 weight-only (dequant)`` and ``nvfp4 weight-only (dequant)``: the weight-only path.
* ``fp8 weight-only + LoRA r=8``: a PEFT LoRA layer over a QuantLinear (fp32 adapters, bf16 autocast, as the recipes
  train),
  through PEFT's own forward and through the native path (``ops.lora_dequant_linear``: base and adapter in one
  node; trainstream_hf/integrations/peft.py).

Prints CPU microseconds (``time.thread_time``, so that other jobs on a shared machine count less) per layer call
(forward + backward), min and median over ``--repeats`` runs of ``--calls`` calls. To compare with another version
of the package, run the script with ``PYTHONPATH`` pointing at that version's tree.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from trainstream_hf.quant import QuantLinear, matmul
from trainstream_hf.integrations.peft import QuantLoraLinear

T, K, N = 4, 16, 16  # small enough that the CPU kernels take about as long as a GPU launch's host side


def _fake_scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    return torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype)


class _PeftPath(nn.Module):
    """A QuantLoraLinear that always takes PEFT's own forward (the native paths switched off)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return super(type(self.layer), self.layer).forward(x)


def _lora_layers(count: int, native: bool) -> list[nn.Module]:
    from peft import LoraConfig, get_peft_model

    from trainstream_hf.integrations.peft import register_quant_lora
    out = []
    for _ in range(count):
        base = nn.Sequential(QuantLinear.from_linear(nn.Linear(K, N, bias=False, dtype=torch.bfloat16), "fp8",
                                                     act_quant=False))  # any base: the rows differ in LoRA only
        model = get_peft_model(base, register_quant_lora(LoraConfig(r=8, lora_alpha=16, target_modules=["0"])))
        layer = model.base_model.model[0]
        out.append(layer if native else _PeftPath(layer))
    return out


def _layers(kind: str, count: int) -> list[nn.Module]:
    torch.manual_seed(0)
    if kind in ("lora_peft", "lora_native"):
        return _lora_layers(count, kind == "lora_native")
    dense = [nn.Linear(K, N, bias=False, dtype=torch.bfloat16).requires_grad_(False) for _ in range(count)]
    if kind == "bf16":
        return dense
    fmt, act_quant = {"fp8": ("fp8", True), "fp8_wo": ("fp8", False), "nvfp4": ("nvfp4", False)}[kind]
    return [QuantLinear.from_linear(d, fmt, act_quant=act_quant) for d in dense]


def _time(step, calls: int, repeats: int, per: int) -> float:
    for _ in range(max(10, calls // 10)):
        step()
    runs = []
    for _ in range(repeats):
        t0 = time.thread_time()  # CPU time of this thread: robust to other jobs on a shared machine
        for _ in range(calls):
            step()
        runs.append((time.thread_time() - t0) / (calls * per))
    return min(runs) * 1e6, statistics.median(runs) * 1e6


def _step(layers, shared: bool):
    g = torch.randn(T, N, dtype=torch.bfloat16)
    x0 = torch.randn(T, K, dtype=torch.bfloat16)

    def step():
        # the LoRA rows under the recipes' mixed precision (their adapters are fp32); the others as they were
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=isinstance(layers[0], (_PeftPath, QuantLoraLinear))):
            if shared:
                x = x0.clone().requires_grad_()  # one input for all layers (q/k/v)
                ys = [layer(x) for layer in layers]
                torch.autograd.grad(ys, x, [g] * len(ys))
            else:
                for layer in layers:
                    x = x0.clone().requires_grad_()
                    torch.autograd.grad(layer(x), x, g)
    return step


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--profile", action="store_true", help="cProfile the fp8 scaled_mm row instead")
    p.add_argument("--ops", action="store_true", help="count the operators each row dispatches per layer call")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    torch._scaled_mm = _fake_scaled_mm
    matmul.ACT_QUANT_FORMATS["fp8"] = matmul.FP8_W8A8_SCALED_MM  # the CPU takes the tensor-core path's wiring
    rows = [("nn.Linear bf16", "bf16", 1, False), ("fp8 W8A8 (scaled_mm), 1 layer", "fp8", 1, False),
            ("fp8 W8A8 (scaled_mm), q/k/v on one x", "fp8", 3, True),
            ("fp8 weight-only (dequant)", "fp8_wo", 1, False), ("nvfp4 weight-only (dequant)", "nvfp4", 1, False),
            ("fp8 weight-only + LoRA r=8, PEFT's forward (fp32 adapters, autocast bf16)", "lora_peft", 1, False),
            ("fp8 weight-only + LoRA r=8, native (base and adapter in one node; fp32 adapters, autocast bf16)",
             "lora_native", 1, False)]
    if a.profile:
        import cProfile
        import pstats
        step = _step(_layers("fp8", 3), True)
        _time(step, 50, 1, 3)
        cProfile.runctx("for _ in range(a.calls): step()", globals(), {"step": step, "a": a}, "/tmp/ovh.prof")
        pstats.Stats("/tmp/ovh.prof").sort_stats("tottime").print_stats(25)
        return
    if a.ops:
        from torch.profiler import ProfilerActivity, profile
        print("| row | operators dispatched per layer call (fwd + bwd) |\n|---|---|")
        for name, kind, count, shared in rows:
            step = _step(_layers(kind, count), shared)
            step()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(10):
                    step()
            n = sum(e.count for e in prof.key_averages() if "::" in e.key)
            print(f"| {name} | {n / (10 * count):.1f} |")
        return
    print(f"CPU us per layer call (fwd + bwd), {T}x{K} @ {K}x{N}, {a.repeats} x {a.calls} calls")
    print("| row | min | median |\n|---|---|---|")
    for name, kind, count, shared in rows:
        lo, mid = _time(_step(_layers(kind, count), shared), a.calls, a.repeats, count)
        print(f"| {name} | {lo:.1f} | {mid:.1f} |")


if __name__ == "__main__":
    main()
