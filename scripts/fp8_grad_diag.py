"""Where the FP8 tensor-core path's gradients part from exact maths, block by block.

The 8B table's fp8 rows learn on another loss curve than the bf16 and nf4 rows on the GPU (benchmarks/NOTES.md,
2026-12-07), while on the CPU the same maths (``ops.fp8_linear``'s FP8 input gradient, emulated) follows bf16. This
runs a stack of decoder blocks of a model shape (random weights, fp8 base, LoRA r16 on every linear layer with
non-zero B so that every adapter has a gradient) through one forward and backward per variant, the same input and
output gradient each time, and compares every LoRA gradient and the input's gradient with the emulated W8A8 path
(float32 maths on the GPU: the reference) and with the weight-only path (dequantized weight, bf16 GEMM):

  emulated    W8A8, quantized activations, exact dequantized-weight backward (the reference)
  dequant     weight-only: dequantize, bf16 GEMM
  tc          the tensor-core path as the engine runs it (TRAINSTREAM_FP8_GEMM as set: cuBLASLt on sm_90)
  tc_nocache  the same without the kept transposed codes (the backward transposes per call)
  tc_torch    the tensor-core path through torch._scaled_mm instead of cuBLASLt
  tc_compiled the tensor-core path inside torch.compile'd blocks (as compile_blocks runs them)

Per variant: cosine similarity and norm ratio against the reference, for the first and last block's adapters and
the input gradient. JSON with --out. On a CPU (``--small``) it runs the emulated, dequant and tc variants (tc through
the op's CPU kernel), which is how tests/test_fp8_grad_diag.py checks the script itself.

    python scripts/fp8_grad_diag.py --shape llama3.1-8b --blocks 4 --tokens 2048 --out fp8-grad-diag.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys

import torch
from torch import nn


def _blocks(shape: str, n: int, small: bool):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    if small:
        cfg = LlamaConfig(hidden_size=128, intermediate_size=352, num_attention_heads=4, num_key_value_heads=2,
                          num_hidden_layers=n, vocab_size=256)
    else:
        from trainstream_hf.bench.models import model_config
        cfg = model_config(shape)  # a Llama-family shape: the blocks are built as LlamaDecoderLayer
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    blocks = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(n)).to(torch.bfloat16)
    return cfg, blocks, LlamaRotaryEmbedding(cfg)


@contextlib.contextmanager
def _path(name):
    """Forces every fp8 QuantLinear onto one matmul path for the duration (the tc variants: the tensor-core path, which
    on a CPU runs ops.fp8_linear's CPU kernel: the same maths)."""
    from trainstream_hf.quant import matmul

    forced = {"emulated": matmul.FP8_W8A8_EMULATED, "dequant": matmul.DEQUANT}.get(name, matmul.FP8_W8A8_SCALED_MM)
    original = matmul.select_path
    if forced is not None:
        matmul.select_path = lambda fmt, device, act_quant=None: forced
    try:
        yield
    finally:
        matmul.select_path = original


def run(shape="llama3.1-8b", blocks=4, tokens=2048, device=None, small=False, variants=None) -> dict:
    from peft import LoraConfig, get_peft_model

    import trainstream_hf.integrations.peft  # noqa: F401  (PEFT's LoRA over QuantLinear bases)
    from trainstream_hf import ops
    from trainstream_hf.quant.linear import QuantLinear
    from trainstream_hf.quant.model import quantize_model

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    variants = variants or (["emulated", "dequant", "tc", "tc_nocache", "tc_torch", "tc_compiled"] if cuda
                            else ["emulated", "dequant", "tc"])
    cfg, stack, rope = _blocks(shape, blocks, small)
    quantize_model(stack, "fp8", act_quant=True, skip=())
    holder = nn.Module()
    holder.layers = stack
    holder.config = cfg
    model = get_peft_model(holder, LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear"))
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # non-zero B: every adapter, A included, gets a gradient
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.02)
    model = model.to(device)
    x0 = torch.randn(1, tokens, cfg.hidden_size, generator=g).to(device, torch.bfloat16)
    dy = torch.randn(1, tokens, cfg.hidden_size, generator=g).to(device, torch.bfloat16) * 1e-3
    pos = torch.arange(tokens, device=device)[None]
    pe = rope.to(device)(x0, pos)
    lora = [n for n, p in model.named_parameters() if p.requires_grad]
    first = [n for n in lora if ".layers.0." in n]
    last = [n for n in lora if f".layers.{blocks - 1}." in n]

    def forward(layers, x):
        for b in layers:
            x = b(x, position_embeddings=pe, position_ids=pos)
            x = x[0] if isinstance(x, tuple) else x
        return x

    named = dict(model.named_parameters())
    quants = [mod for mod in model.modules() if isinstance(mod, QuantLinear)]
    layers = list(model.base_model.model.layers)
    grads = {}
    for v in variants:
        for p in named.values():
            p.grad = None
        for q in quants:
            q.fp8_transpose_cache = v != "tc_nocache"
            q.clear_fp8_transpose_cache()
            q._paths = {}  # the path chosen for the last variant goes
        run_layers = [torch.compile(b) for b in layers] if v == "tc_compiled" else layers
        if cuda:
            ops.set_fp8_gemm("torch" if v == "tc_torch" else None)
        x = x0.clone().requires_grad_()
        with _path(v):
            forward(run_layers, x).backward(dy)
        grads[v] = {"input": x.grad.float().flatten(),
                    "first": torch.cat([named[n].grad.float().flatten() for n in first]),
                    "last": torch.cat([named[n].grad.float().flatten() for n in last])}
        if cuda:
            ops.set_fp8_gemm(None)
    ref = grads[variants[0]]
    rows = {}
    for v, gv in grads.items():
        rows[v] = {k: {"cosine": float(torch.nn.functional.cosine_similarity(gv[k].double(), ref[k].double(), dim=0)),
                       "norm_ratio": float(gv[k].double().norm() / ref[k].double().norm())} for k in ref}
    return {"shape": "small" if small else shape, "blocks": blocks, "tokens": tokens, "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if cuda else None, "reference": variants[0], "rows": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3.1-8b")
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--small", action="store_true", help="a tiny block shape (CPU check of the script)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    result = run(a.shape, a.blocks, a.tokens, small=a.small)
    from trainstream_hf.bench.common import environment
    result["environment"] = environment(" ".join(["python", "scripts/fp8_grad_diag.py"] + (argv or sys.argv[1:])))
    for v, r in result["rows"].items():
        print(f"{v:12s} " + "  ".join(f"{k}: cos {x['cosine']:.4f} norm {x['norm_ratio']:.3f}" for k, x in r.items()))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
