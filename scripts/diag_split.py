"""How a bf16 addmm_ rounds on this GPU, and the split-bf16 LoRA regime's output error against float64 beside PEFT's
float32 graph (tests/gpu/test_lora_cuda.py::test_fused_lora_split_regime_cuda's layer).

For c (bf16) += alpha a b (bf16 operands, float32 accumulation) it prints, per alpha, torch's bf16 reduced-precision
reduction setting and BLAS backend: the mean abs error against float64, and the fraction of outputs equal to one
rounding, bf16(c + alpha a b), and to two, bf16(c + bf16(alpha a b)). On the H100 at b35d7c8
(2026-12-06, torch 2.11): two, for every output, every alpha, backend and setting
(benchmarks/results/gpu-round-h100-b35d7c8.txt).
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "quant"))
from test_lora import _exact_lora  # noqa: E402
from test_lora_cuda import _both, _layer  # noqa: E402

matmul = torch.backends.cuda.matmul


def addmm_rounding(m, k, n, alpha):
    g = torch.Generator("cuda").manual_seed(5)
    c = torch.randn(m, n, device="cuda", generator=g).bfloat16()
    a = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    b = torch.randn(k, n, device="cuda", generator=g).bfloat16()
    p = alpha * (a.double() @ b.double())
    one, two = (c.double() + p).bfloat16(), (c.double() + p.bfloat16().double()).bfloat16()
    got = c.clone().addmm_(a, b, alpha=alpha)
    err = float((got.double() - (c.double() + p)).abs().mean())
    best = float((one.double() - (c.double() + p)).abs().mean())
    return (f"err {err:.5f} (one rounding {best:.5f}), equal to one rounding {float((got == one).float().mean()):.3f}, "
            f"to two {float((got == two).float().mean()):.3f}")


for backend in ("cublas", "cublaslt"):
    torch.backends.cuda.preferred_blas_library(backend)
    for allow in (True, False):
        matmul.allow_bf16_reduced_precision_reduction = allow
        for shape in ((128, 96, 192), (2048, 96, 4096)):
            for alpha in (1.0, 2.0, 1.5):
                print(f"{backend} reduced={allow} addmm_ {shape} alpha={alpha}: {addmm_rounding(*shape, alpha)}")
torch.backends.cuda.preferred_blas_library("cublas")
matmul.allow_bf16_reduced_precision_reduction = True

for alpha in (32, 24):
    layer = _layer("nf4", alpha, bias=False)
    (fused, peft_), _, x0 = _both(layer, autocast=False)
    dy = torch.randn(2, 64, 192, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(2))
    exact = _exact_lora(layer, x0, dy)
    row = {}
    for got, want, ref, what in zip(fused[:2], peft_[:2], exact[:2], ("y", "dx")):
        row[what] = (round(float((got.detach().double().reshape(ref.shape) - ref).abs().mean()), 6),
                     round(float((want.detach().double().reshape(ref.shape) - ref).abs().mean()), 6))
    print(f"split regime, lora_alpha={alpha}: (ours, peft) mean abs error vs float64 {row}")
