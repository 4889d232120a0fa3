"""The native LoRA path (ops.lora_add) on the GPU: PEFT's numbers bit for bit, as on the CPU
(tests/quant/test_lora.py), with cuBLAS in deterministic mode (scripts/gpu_check.sh sets CUBLAS_WORKSPACE_CONFIG)."""
import pytest
import torch

peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402

from trainstream_hf.quant import QuantLinear  # noqa: E402
from trainstream_hf.quant.lora import QuantLoraLinear, register_quant_lora  # noqa: E402


@pytest.mark.parametrize("fmt", ["nf4", "fp8"])
@pytest.mark.parametrize("autocast", [True, False])
@pytest.mark.parametrize("alpha", [32, 24])  # scaling 2 (folded into B) and 1.5 (multiplied as PEFT does)
def test_native_lora_gives_peft_numbers_bit_for_bit_cuda(fmt, autocast, alpha):
    torch.manual_seed(0)
    base = QuantLinear.from_linear(torch.nn.Linear(256, 192, bias=False), fmt).to("cuda", torch.bfloat16)
    model = get_peft_model(torch.nn.Sequential(base), register_quant_lora(
        LoraConfig(r=16, lora_alpha=alpha, target_modules=["0"])))
    layer = model.base_model.model[0]
    with torch.no_grad():
        layer.lora_A["default"].weight.normal_()
        layer.lora_B["default"].weight.normal_(std=0.1)
    assert layer.lora_A["default"].weight.dtype == torch.float32  # PEFT's autocast_adapter_dtype upcast
    x0 = torch.randn(2, 64, 256, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(2, 64, 192, device="cuda", dtype=torch.bfloat16)
    runs = []
    for native in (True, False):
        x = x0.clone().requires_grad_()
        forward = layer.forward if native else (lambda t: super(QuantLoraLinear, layer).forward(t))
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            y = forward(x)
        assert ("LoraAddFunction" in y.grad_fn.name()) == native
        runs.append((y, *torch.autograd.grad(y, (x, layer.lora_A["default"].weight,
                                                 layer.lora_B["default"].weight), dy)))
    for got, want, what in zip(*runs, ("y", "dx", "dA", "dB")):
        assert got.dtype == want.dtype and torch.equal(got, want), what
