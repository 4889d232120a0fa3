"""The split-bf16 LoRA regime's output error on the GPU against float64, beside PEFT's float32 graph, under torch's
bf16 reduced-precision-reduction setting on and off (tests/gpu/test_lora_cuda.py::test_fused_lora_split_regime_cuda's
layer), and a plain bf16-output addmm of the same shape: which setting the error follows."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "quant"))
from test_lora import _exact_lora  # noqa: E402
from test_lora_cuda import _both, _layer  # noqa: E402

matmul = torch.backends.cuda.matmul
for allow in (True, False):
    matmul.allow_bf16_reduced_precision_reduction = allow
    layer = _layer("nf4", 32, bias=False)
    (fused, peft_), _, x0 = _both(layer, autocast=False)
    dy = torch.randn(2, 64, 192, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(2))
    exact = _exact_lora(layer, x0, dy)
    row = {}
    for got, want, ref, what in zip(fused[:2], peft_[:2], exact[:2], ("y", "dx")):
        row[what] = (float((got.double().reshape(ref.shape) - ref).abs().mean()),
                     float((want.double().reshape(ref.shape) - ref).abs().mean()))
    g = torch.Generator("cuda").manual_seed(5)
    c = torch.randn(128, 192, device="cuda", generator=g).bfloat16()
    a = torch.randn(128, 96, device="cuda", generator=g).bfloat16()
    b = torch.randn(96, 192, device="cuda", generator=g).bfloat16()
    ref = c.double() + 2 * a.double() @ b.double()
    got = c.clone().addmm_(a, b, alpha=2)
    row["addmm_128x96x192"] = float((got.double() - ref).abs().mean()), float((ref.bfloat16().double() - ref).abs().mean())
    print(f"allow_bf16_reduced_precision_reduction={allow}: (ours, peft) mean abs error vs float64 {row}")
