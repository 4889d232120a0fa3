"""bench host: the host side of a training step (Python, dispatch, autograd), measured on the CPU.

On a GPU an 8B LoRA step is partly host-bound: the host must queue each layer's kernels faster than the GPU runs
them (benchmarks/NOTES.md). This suite measures that host side alone, on the CPU, where shapes so small that the
kernels take about a microsecond leave little else in the time. CPU time of the calling thread
(``time.thread_time``), one torch thread, so other jobs on a shared machine count less. Two kinds of rows:

* ``step_*``: one LoRA training step of a deep, narrow Llama (32 decoder layers, hidden 64, 16 tokens, nf4 bases,
  LoRA r16 on every linear layer, bf16 autocast, float32 adapters, AdamW), milliseconds per step: the model alone
  (``step_plain``), wrapped by the engine with nothing to page (``step_wrap``), wrapped with paged weights and
  offloaded activations (``step_paged``), and wrapped with each block compiled (``step_compiled``; compiled in its
  warm-up steps).
* ``layer_*``: one linear layer's forward + input gradient (4 tokens, 16 x 16), microseconds per layer call:
  ``nn.Linear`` bf16 (the floor), the FP8 W8A8 path with ``torch._scaled_mm`` replaced by a stand-in that only
  allocates its output (``layer_fp8``; ``layer_fp8_qkv``: three layers reading one input, as q / k / v do), the
  weight-only paths (``layer_fp8_wo``, ``layer_nvfp4``), and an fp8 weight-only layer with a PEFT LoRA adapter
  through PEFT's own forward (``layer_lora_peft``) and through the native path (``layer_lora_native``,
  ``ops.lora_dequant_linear``).
"""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable, Optional

import torch
from torch import nn

from trainstream_hf.bench.common import markdown_table

STEP_ROWS = {"step_plain": None, "step_wrap": {},
             "step_paged": {"page_weights": True, "offload_activations": True, "min_activation_bytes": 0},
             "step_compiled": {"compile_blocks": True}}
# row -> (label, layer kind, layers per step, one input shared by the layers)
LAYER_ROWS = {
    "layer_bf16": ("nn.Linear bf16", "bf16", 1, False),
    "layer_fp8": ("fp8 W8A8 (scaled_mm), 1 layer", "fp8", 1, False),
    "layer_fp8_qkv": ("fp8 W8A8 (scaled_mm), q/k/v on one x", "fp8", 3, True),
    "layer_fp8_wo": ("fp8 weight-only (dequant)", "fp8_wo", 1, False),
    "layer_nvfp4": ("nvfp4 weight-only (dequant)", "nvfp4", 1, False),
    "layer_lora_peft": ("fp8 weight-only + LoRA r8, PEFT's forward", "lora_peft", 1, False),
    "layer_lora_native": ("fp8 weight-only + LoRA r8, native (one node)", "lora_native", 1, False),
}
ROWS = (*STEP_ROWS, *LAYER_ROWS)
T, K, N = 4, 16, 16  # a layer call's shape: CPU kernels about as short as a GPU launch's host side


def _thread_seconds(fn: Callable[[], None], calls: int, repeats: int) -> list[float]:
    """CPU seconds of this thread per call of ``fn``, one figure per run of ``calls`` calls."""
    runs = []
    for _ in range(repeats):
        t0 = time.thread_time()
        for _ in range(calls):
            fn()
        runs.append((time.thread_time() - t0) / calls)
    return runs


def _lora_llama(layers: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainstream_hf.quant import quantize_model
    from trainstream_hf.train import model as models

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=1, vocab_size=64, max_position_embeddings=64)
    model = quantize_model(LlamaForCausalLM(cfg).to(torch.bfloat16), "nf4")
    return models.add_lora(model, r=16, alpha=32, dropout=0.0, target_modules="all-linear")


def step_row(row: str, *, layers: int = 32, steps: int = 20, warmup: int = 3, repeats: int = 3) -> dict:
    """Milliseconds of host CPU per training step (median of ``repeats`` runs of ``steps`` steps)."""
    import trainstream_hf

    model = _lora_llama(layers)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    engine = STEP_ROWS[row]
    if engine is not None:
        model, opt = trainstream_hf.wrap(model, opt, device="cpu", vram_budget="8GiB", **engine)
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(1))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    try:
        for _ in range(warmup):
            step()
        runs = _thread_seconds(step, steps, repeats)
    finally:
        if engine is not None:
            trainstream_hf.unwrap(model)
    return {"row": row, "label": f"LoRA step, {layers} nf4 layers, {'no engine' if engine is None else row[5:]}",
            "unit": "ms per step", "min": min(runs) * 1e3, "median": statistics.median(runs) * 1e3}


def _fake_scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    return torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype)


class _PeftForward(nn.Module):
    """A QuantLoraLinear that always takes PEFT's own forward (the native paths bypassed)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return super(type(self.layer), self.layer).forward(x)


def _layers(kind: str, count: int) -> list[nn.Module]:
    from trainstream_hf.integrations.peft import QuantLoraLinear
    from trainstream_hf.quant import QuantLinear

    torch.manual_seed(0)
    if kind in ("lora_peft", "lora_native"):
        from peft import LoraConfig, get_peft_model

        out = []
        for _ in range(count):
            base = nn.Sequential(QuantLinear.from_linear(nn.Linear(K, N, bias=False, dtype=torch.bfloat16), "fp8",
                                                         act_quant=False))
            layer = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["0"])).base_model.model[0]
            if not isinstance(layer, QuantLoraLinear):
                raise RuntimeError(f"bench host: PEFT made a {type(layer).__name__}, not a QuantLoraLinear")
            out.append(layer if kind == "lora_native" else _PeftForward(layer))
        return out
    dense = [nn.Linear(K, N, bias=False, dtype=torch.bfloat16).requires_grad_(False) for _ in range(count)]
    if kind == "bf16":
        return dense
    fmt, act_quant = {"fp8": ("fp8", True), "fp8_wo": ("fp8", False), "nvfp4": ("nvfp4", False)}[kind]
    return [QuantLinear.from_linear(d, fmt, act_quant=act_quant) for d in dense]


@contextlib.contextmanager
def _cpu_takes_the_fp8_tensor_core_path():
    """The CPU routed to the FP8 W8A8 path's wiring with ``torch._scaled_mm`` a stand-in (restored after)."""
    from trainstream_hf.quant import matmul

    saved_mm, saved_path = torch._scaled_mm, matmul.ACT_QUANT_FORMATS["fp8"]
    torch._scaled_mm = _fake_scaled_mm
    matmul.ACT_QUANT_FORMATS["fp8"] = matmul.FP8_W8A8_SCALED_MM
    try:
        yield
    finally:
        torch._scaled_mm, matmul.ACT_QUANT_FORMATS["fp8"] = saved_mm, saved_path


def layer_row(row: str, *, calls: int = 1000, repeats: int = 7) -> dict:
    """Microseconds of host CPU per layer call, forward + input gradient (min and median of ``repeats`` runs)."""
    label, kind, count, shared = LAYER_ROWS[row]
    with _cpu_takes_the_fp8_tensor_core_path():
        layers = _layers(kind, count)
        g = torch.randn(T, N, dtype=torch.bfloat16)
        x0 = torch.randn(T, K, dtype=torch.bfloat16)
        lora = kind.startswith("lora")

        def step():
            # the LoRA rows under the recipes' mixed precision (float32 adapters, bf16 autocast)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=lora):
                if shared:
                    x = x0.clone().requires_grad_()
                    ys = [layer(x) for layer in layers]
                    torch.autograd.grad(ys, x, [g] * len(ys))
                else:
                    for layer in layers:
                        x = x0.clone().requires_grad_()
                        torch.autograd.grad(layer(x), x, g)

        for _ in range(max(10, calls // 10)):
            step()
        runs = [s / count for s in _thread_seconds(step, calls, repeats)]
    return {"row": row, "label": label, "unit": "us per layer call", "min": min(runs) * 1e6,
            "median": statistics.median(runs) * 1e6}


def run(*, quick: bool = False, rows: Optional[list[str]] = None) -> tuple[dict, str]:
    """Runs ``rows`` (default all of :data:`ROWS`) on the CPU with one torch thread; returns (payload, markdown).

    Raises:
        ValueError: an unknown row name (the message lists the known ones).
    """
    rows = list(ROWS) if rows is None else rows
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise ValueError(f"bench host: unknown row(s) {unknown}; choose from {', '.join(ROWS)}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = [step_row(r, layers=4 if quick else 32, steps=2 if quick else 20, warmup=1 if quick else 3,
                            repeats=2 if quick else 3) if r in STEP_ROWS else
                   layer_row(r, calls=20 if quick else 1000, repeats=2 if quick else 7) for r in rows]
    finally:
        torch.set_num_threads(threads)
    payload = {"suite": "host", "quick": quick, "torch_threads": 1, "results": results}
    return payload, "Host CPU time (thread time, one torch thread)\n\n" + markdown_table(
        results, ("label", "unit", "min", "median"))
