"""Host time per training step of a deep, narrow Llama LoRA on the CPU: a proxy for the host side of the GPU step.

python3 scripts/host_engine.py [--layers 32] [--steps 20] [--peft-forward]

On the H200 the 8B nf4 LoRA step is partly host-bound (benchmarks/NOTES.md): Python, dispatch and autograd per layer
and per adapter. Here the same structure -- 32 decoder layers, nf4 bases, LoRA r=16 on every linear layer, bf16
autocast, fp32 adapters, AdamW -- is made so narrow (hidden 64, 16 tokens) that the CPU's kernels are short and the
step time is mostly that host side. Rows: the model alone (``plain``), wrapped by the engine with nothing to page
(``wrap``, the 8B config's plan at 24 GiB), and wrapped with paged weights and offloaded activations (``paged``).
``--peft-forward`` sends every adapter through PEFT's own forward instead of the native paths. Prints one JSON
object of CPU milliseconds per step (thread time, median of 3 runs of ``--steps``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import trainstream_hf
from trainstream_hf.quant import quantize_model
from trainstream_hf.integrations.peft import QuantLoraLinear
from trainstream_hf.train import model as models

ENGINE = {"plain": None, "wrap": {}, "paged": {"page_weights": True, "offload_activations": True,
                                               "min_activation_bytes": 0}}


def build(layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=1, vocab_size=64, max_position_embeddings=64)
    model = quantize_model(LlamaForCausalLM(cfg).to(torch.bfloat16), "nf4")
    return models.add_lora(model, r=16, alpha=32, dropout=0.0, target_modules="all-linear")


def step_ms(layers: int, steps: int, engine: dict | None) -> float:
    model = build(layers)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    if engine is not None:
        model, opt = trainstream_hf.wrap(model, opt, device="cpu", vram_budget="8GiB", **engine)
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(1))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    runs = []
    for _ in range(3):
        t0 = time.thread_time()
        for _ in range(steps):
            step()
        runs.append((time.thread_time() - t0) / steps * 1e3)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--peft-forward", action="store_true", help="adapters through PEFT's own forward")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.peft_forward:
        QuantLoraLinear._fast_adapter = lambda self, args, kwargs: None
    out = {"layers": a.layers, "adapters": "peft" if a.peft_forward else "native", "torch": torch.__version__}
    for name, engine in ENGINE.items():
        out[f"{name}_ms_per_step"] = round(step_ms(a.layers, a.steps, engine), 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
