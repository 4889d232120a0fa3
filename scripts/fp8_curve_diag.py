"""Why the fp8 rows of the benchmark table learn on another loss curve: training runs of one model per variant.

On the GPU the table's fp8 rows (eager and compiled) train on another curve than the bf16 and nf4 rows (Llama-3.1-8B
shape, the same batch every step: 9.2 against 8.45 after 13 steps), while the warm-up steps' gradient norms agree to
0.5% and scripts/fp8_grad_diag.py finds every adapter's gradient of 4 blocks within cosine 0.9994 of exact W8A8
maths (benchmarks/NOTES.md, 2026-12-07). The same rows on the CPU follow bf16. So the difference grows over steps,
from the forward's response to the adapters' updates or from state kept between steps. This trains one model per
variant from the same seed and batch (LoRA r16 on every linear layer, AdamW lr 1e-4, as the table), and then loads
the bf16 run's trained adapters into each variant's model and evaluates the loss, without autograd and then in a
training call (compiled blocks run compiled only in training calls): a variant that computes the forward of the same
weights differently shows there, one that trains differently only in its curve.

  bf16          no quantization (the reference)
  nf4           nf4 base (the table's row that follows bf16)
  fp8           fp8 base, its default path (W8A8 on tensor cores on sm_89+), no engine
  fp8_emulated  W8A8 in float32 maths (quantized activations, exact dequantized-weight backward)
  fp8_dequant   weight-only: dequantized fp8 weight, bf16 GEMM
  fp8_peft      the default path with PEFT's own LoRA forward instead of the fused adapter op
  fp8_noreuse   the default path quantizing each layer's activations afresh (no reuse between q/k/v, gate/up)
  fp8_wrap      the default path under the engine (wrap with the table's 24 GiB budget)
  fp8_compiled  the same with compile_blocks=True
  fp8_compiled_peft  fp8_compiled with PEFT's own LoRA forward (no fused adapter op in the compiled blocks)
  fp8_compiled_aot  compiled by dynamo and AOTAutograd without inductor (compile_blocks='aot_eager'): follows eager
                if inductor's generated code is what differs, else the tracing does

The FP8 GEMM's plans (cuBLASLt's algorithm per shape and operand alignment) are printed and kept in the JSON, so
a compiled call that got an algorithm of its own (another alignment of an operand) would show there.

    python scripts/fp8_curve_diag.py --shape llama3.1-8b --layers 8 --steps 6 --out fp8-curve-diag.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile

import torch

VARIANTS = ("bf16", "nf4", "fp8", "fp8_emulated", "fp8_dequant", "fp8_peft", "fp8_noreuse", "fp8_wrap",
            "fp8_compiled", "fp8_compiled_peft", "fp8_compiled_aot")
ENGINE = ("fp8_wrap", "fp8_compiled", "fp8_compiled_peft", "fp8_compiled_aot")  # the variants wrapped by the engine


@contextlib.contextmanager
def _variant(name: str):
    """The code path of ``name`` forced for the duration (nothing for the plain variants)."""
    from trainstream_hf.integrations.peft import QuantLoraLinear
    from trainstream_hf.quant import matmul

    undo = contextlib.ExitStack()
    forced = {"fp8_emulated": matmul.FP8_W8A8_EMULATED, "fp8_dequant": matmul.DEQUANT}.get(name)
    if forced is not None:
        original = matmul.select_path
        matmul.select_path = lambda fmt, device, act_quant=None: forced
        undo.callback(setattr, matmul, "select_path", original)
    if name in ("fp8_peft", "fp8_compiled_peft"):
        fast = QuantLoraLinear._fast_adapter
        QuantLoraLinear._fast_adapter = lambda self, args, kwargs: None
        undo.callback(setattr, QuantLoraLinear, "_fast_adapter", fast)
    if name == "fp8_noreuse":
        quantize = matmul.quantize_activation
        matmul.quantize_activation = lambda x, src=None: quantize(x, None)
        undo.callback(setattr, matmul, "quantize_activation", quantize)
        layer = matmul._fp8_scaled_mm_layer
        matmul._fp8_scaled_mm_layer = lambda x, q, w_t=None, outliers=0: None if not matmul._scaled_mm_ok(
            x.dtype, q) else matmul.ops.fp8_linear(x, q.tensors["data"], q.tensors["scale"], False, w_t, outliers)
        undo.callback(setattr, matmul, "_fp8_scaled_mm_layer", layer)
    with undo:
        yield


def _shape(shape: str, layers: int | None, small: bool, folder: str) -> str:
    """``shape`` as a config folder with ``layers`` decoder blocks (a tiny Llama with ``small``)."""
    from transformers import LlamaConfig

    from trainstream_hf.bench.models import model_config

    cfg = LlamaConfig(hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=2, vocab_size=512) if small else model_config(shape)
    if layers:
        cfg.num_hidden_layers = layers
    cfg.save_pretrained(folder)
    return folder


def _lora_state(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def run(shape="llama3.1-8b", layers=None, steps=6, tokens=2048, device=None, small=False, variants=None) -> dict:
    import trainstream_hf as ts
    from trainstream_hf.bench.engine import _built_in_place
    from trainstream_hf.bench.models import make_batch, model_config
    from trainstream_hf.bench.peers import LORA
    from trainstream_hf.train.model import add_lora

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    variants = list(variants or VARIANTS)
    if variants[0] != "bf16":
        variants = ["bf16"] + [v for v in variants if v != "bf16"]
    with tempfile.TemporaryDirectory() as folder:
        spec = _shape(shape, layers, small, folder)
        batch = make_batch(1, tokens, model_config(spec).vocab_size, device, 0)
        runs, reference = {}, None
        for v in variants:
            quantize = None if v == "bf16" else "nf4" if v == "nf4" else "fp8"
            with _variant(v):
                model = add_lora(_built_in_place(spec, device, 0, home=device, quantize=quantize), r=LORA["r"],
                                 alpha=LORA["lora_alpha"], dropout=LORA["lora_dropout"],
                                 target_modules=LORA["target_modules"])
                opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=cuda)
                if v in ENGINE:
                    compiled = "aot_eager" if v == "fp8_compiled_aot" else v.startswith("fp8_compiled")
                    model, opt = ts.wrap(model, opt, vram_budget="24GiB" if cuda else "8GiB",
                                         batch_shape=(1, tokens), compile_blocks=compiled)
                start = _lora_state(model)
                losses, norms = [], []
                for _ in range(steps):
                    loss = model(**batch).loss
                    loss.backward()
                    norms.append(float(torch.stack([p.grad.float().norm() for p in model.parameters()
                                                    if p.grad is not None]).norm()))
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    losses.append(float(loss.detach()))
                moved = _lora_state(model)
                update = float(torch.stack([(moved[n].float() - start[n].float()).norm() for n in moved]).norm())
                if reference is None:
                    reference = moved
                # the bf16 run's trained adapters in this variant's model: the loss of the same weights
                with torch.no_grad():
                    params = dict(model.named_parameters())
                    for n, t in reference.items():
                        params[n].data.copy_(t)
                    same_weights = float(model(**batch).loss)
                # the same with autograd on: a training call (compiled blocks run compiled only there)
                train_same = model(**batch).loss
                train_same.backward()
                opt.zero_grad(set_to_none=True)
                runs[v] = {"losses": losses, "grad_norms": norms, "update_norm": update,
                           "loss_at_bf16_adapters": same_weights, "train_loss_at_bf16_adapters": float(train_same)}
                if v in ENGINE:
                    ts.unwrap(model)
                del model, opt
                if cuda:
                    torch.cuda.empty_cache()
    from trainstream_hf import ops
    return {"shape": "small" if small else shape, "layers": layers, "steps": steps, "tokens": tokens,
            "device": str(device), "gpu": torch.cuda.get_device_name(device) if cuda else None, "runs": runs,
            "fp8_gemm": ops.fp8_gemm(device) if cuda else "torch", "fp8_gemm_plans": ops.fp8_gemm_plans()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3.1-8b")
    ap.add_argument("--layers", type=int, default=None, help="decoder blocks (default: the shape's)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--small", action="store_true", help="a tiny Llama (CPU check of the script)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    result = run(a.shape, a.layers, a.steps, a.tokens, small=a.small, variants=a.variants.split(","))
    from trainstream_hf.bench.common import environment
    result["environment"] = environment(" ".join(["python", "scripts/fp8_curve_diag.py"] + (argv or sys.argv[1:])))
    for v, r in result["runs"].items():
        print(f"{v:17s} losses {' '.join(f'{x:.3f}' for x in r['losses'])}  grad {r['grad_norms'][0]:.3f}  "
              f"update {r['update_norm']:.4f}  loss at bf16's adapters {r['loss_at_bf16_adapters']:.4f} "
              f"(training call {r['train_loss_at_bf16_adapters']:.4f})", flush=True)
    for p in result["fp8_gemm_plans"]:
        print(f"plan m={p['m']} n={p['n']} k={p['k']} align={p.get('alignments', '')} chosen={p['chosen']} of "
              f"{p['candidates']} tuned={p['tuned']} ms {p['ms_chosen']:.3f} / first {p['ms_first']:.3f}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
