"""Kernel-level profile of one block's quantized linear layers (forward + input gradient) on the GPU: where the
time goes per format. python3 scripts/profile_quant.py [fmt[:act_quant] ...]  (default: bf16 nf4 fp8:1 fp8:0)"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from trainstream_hf.bench import quant as bq
from trainstream_hf.quant import QuantLinear, quantize


def layers_for(spec, ws):
    if spec == "bf16":
        return [bq._dense(w) for w in ws]
    fmt, _, aq = spec.partition(":")
    return [QuantLinear(quantize(w, fmt), act_quant=bool(int(aq)) if aq else False) for w in ws]


def main():
    dev = torch.device("cuda")
    lin = bq.block_linears("llama3-8b")
    for spec in sys.argv[1:] or ["bf16", "nf4", "fp8:1", "fp8:0"]:
        layers = layers_for(spec, bq.block_weights(lin, dev))
        xs, leaves, grads = bq.block_inputs(lin, 2048, dev)
        step = bq.block_step(layers, xs, leaves, grads)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        print(f"\n===== {spec} (5 steps) =====")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
        del layers, xs, leaves, grads, step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
