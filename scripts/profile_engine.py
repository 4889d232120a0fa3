"""Where the 8B LoRA step's time goes under the engine, on the GPU.

python3 scripts/profile_engine.py [variant ...]   (default: all; nf4 = the ts_nf4 row, peft = stock bf16 + PEFT)

Each variant wraps the benchmark's Llama-3-8B LoRA model (bf16 base, r=16, 1 x 2048 tokens) under a 24 GiB cap
with different activation options, prints the plan, times 5 steps, then profiles 2 steps: the top kernels and
CPU ops, the compute stream's busy time against the wall time (what is exposed), and the engine's own stats.
A Chrome trace of the profiled steps goes to $OUT/profile-engine-<variant>.json.gz when OUT is set.
"""
import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import trainstream_hf as ts
from trainstream_hf.bench.engine import _built_in_place, _lora_model
from trainstream_hf.bench.harness import vram_cap
from trainstream_hf.bench.peers import LORA, _batch, _plain_step
from trainstream_hf.train.model import add_lora

from profiling import busy_time_us, export_trace  # scripts/profiling.py

VARIANTS = {
    "default": {},
    "nf4": {"quantize": "nf4"},                          # the ts_nf4 row: NF4 base built packed, LoRA r16
    "nf4_fused_norms": {"quantize": "nf4", "fused_norms": True},  # the ts_nf4_fused_norms row
    "peft": {"wrap": False},                             # stock bf16 + PEFT, unwrapped, no cap (36.5 GiB)
    "recompute_only": dict(offload_activations=False),   # the plan may only keep or recompute
    "offload_only": dict(recompute=False),               # the plan may only keep or offload
}


def main():
    dev = torch.device("cuda")
    out = os.environ.get("OUT")
    names = sys.argv[1:] or list(VARIANTS)
    for name in names:
        opts = dict(VARIANTS[name])
        wrap, quantize = opts.pop("wrap", True), opts.pop("quantize", None)
        with vram_cap(24 * 2**30 if wrap else None, dev):
            if quantize:
                model = add_lora(_built_in_place("llama3-8b", dev, 0, home=dev, quantize=quantize), r=LORA["r"],
                                 alpha=LORA["lora_alpha"], dropout=LORA["lora_dropout"],
                                 target_modules=LORA["target_modules"])
            else:
                model = _lora_model("llama3-8b", dev, 0)
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
            print(f"\n===== {name} {VARIANTS[name]} =====")
            if wrap:
                model, opt = ts.wrap(model, opt, vram_budget=24 * 2**30, batch_shape=(1, 2048), **opts)
                pl = ts.engine_of(model).plan
                print(pl)
                print(f"measured block forward {pl.forward_seconds}, activation bytes "
                      f"{pl.blocks[0].activation_bytes / 2**20:.1f} MiB, moments {pl._moments()}")
            step = _plain_step(model, opt, _batch("llama3-8b", 1, 2048, dev, 0))
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                step()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            print(f"step s: {[round(t, 4) for t in times]}  peak alloc {torch.cuda.max_memory_allocated() / 2**30:.2f}"
                  f" GiB reserved {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB")
            if wrap:
                print("stats:", json.dumps(model.trainstream_stats(), default=str)[:1500])
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                for _ in range(2):
                    step()
                torch.cuda.synchronize()
                wall = (time.perf_counter() - t0) * 1e6
            ev = prof.events()
            busy = busy_time_us(ev)
            print(f"profiled 2 steps: wall {wall / 1e3:.1f} ms, GPU kernels busy {busy / 1e3:.1f} ms "
                  f"({100 * busy / wall:.0f}%), idle {(wall - busy) / 1e3:.1f} ms")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
            export_trace(prof, out, f"profile-engine-{name}")
            if wrap:
                ts.unwrap(model)
            del model, opt, step, prof
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
