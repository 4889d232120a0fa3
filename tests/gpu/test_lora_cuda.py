"""The native LoRA paths on the GPU, as on the CPU (tests/quant/test_lora.py), cuBLAS in deterministic mode
(scripts/gpu_check.sh sets CUBLAS_WORKSPACE_CONFIG): ops.lora_add gives PEFT's numbers bit for bit; the fused
ops.lora_dequant_linear (one rounding fewer) stays within bf16 rounding of PEFT and no further from float64."""
import pytest
import torch

peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402

from trainstream_hf.quant import QuantLinear  # noqa: E402
from trainstream_hf.integrations.peft import QuantLoraLinear, register_quant_lora  # noqa: E402


def _layer(fmt, alpha, bias, b_std=0.1):
    torch.manual_seed(0)
    base = QuantLinear.from_linear(torch.nn.Linear(256, 192, bias=bias), fmt, act_quant=False)
    base = base.to("cuda", torch.bfloat16)
    model = get_peft_model(torch.nn.Sequential(base), register_quant_lora(
        LoraConfig(r=16, lora_alpha=alpha, target_modules=["0"])))
    layer = model.base_model.model[0]
    with torch.no_grad():
        layer.lora_A["default"].weight.normal_()
        layer.lora_B["default"].weight.normal_(std=b_std)
    assert layer.lora_A["default"].weight.dtype == torch.float32  # PEFT's autocast_adapter_dtype upcast
    return layer


def _both(layer, autocast):
    x0 = torch.randn(2, 64, 256, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(1))
    dy = torch.randn(2, 64, 192, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(2))
    runs, names = [], []
    for native in (True, False):
        x = x0.clone().requires_grad_()
        forward = layer.forward if native else (lambda t: super(QuantLoraLinear, layer).forward(t))
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            y = forward(x)
        names.append(y.grad_fn.name())
        runs.append((y, *torch.autograd.grad(y, (x, layer.lora_A["default"].weight,
                                                 layer.lora_B["default"].weight), dy)))
    return runs, names, x0


@pytest.mark.parametrize("fmt", ["nf4", "fp8"])
@pytest.mark.parametrize("autocast", [True, False])
@pytest.mark.parametrize("alpha", [32, 24])  # scaling 2 (folded into B) and 1.5 (multiplied as PEFT does)
def test_lora_add_gives_peft_numbers_bit_for_bit_cuda(fmt, autocast, alpha):
    layer = _layer(fmt, alpha, bias=True)  # a bias: the adapter is added apart from the base (lora_add)
    (native, peft_), (node, peft_node), _ = _both(layer, autocast)
    assert "LoraAddFunction" in node and "LoraAddFunction" not in peft_node
    for got, want, what in zip(native, peft_, ("y", "dx", "dA", "dB")):
        assert got.dtype == want.dtype and torch.equal(got, want), what


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_fused_lora_cuda_close_to_peft_and_to_float64(fmt):
    layer = _layer(fmt, 32, bias=False)
    (fused, peft_), (node, _), x0 = _both(layer, autocast=True)
    assert "LoraDequantLinearFunction" in node
    for got, want, what in zip(fused, peft_, ("y", "dx", "dA", "dB")):
        err = float((got.double() - want.double()).abs().max() / want.double().abs().max())
        assert err < 2 ** -6, (what, err)
    a = layer.lora_A["default"].weight.detach().to(torch.bfloat16).double()
    b = layer.lora_B["default"].weight.detach().to(torch.bfloat16).double()
    w = layer.base_layer.dequantize_weight().to(torch.bfloat16).double()
    xd = x0.double().reshape(-1, 256)
    exact = xd @ w.t() + 2.0 * (xd @ a.t()) @ b.t()
    e_fused = float((fused[0].double().reshape(-1, 192) - exact).abs().mean())
    e_peft = float((peft_[0].double().reshape(-1, 192) - exact).abs().mean())
    assert e_fused <= e_peft * 1.02, (e_fused, e_peft)


def _two_roundings(layer, x0):
    """float64 bf16(bf16(x W^T) + bf16(s x A^T B^T)): y as the split regime computes it on CUDA."""
    a = layer.lora_A["default"].weight.detach().double()
    b = layer.lora_B["default"].weight.detach().double()
    w = layer.base_layer.dequantize_weight().to(torch.bfloat16).double()
    xd = x0.double().reshape(-1, a.shape[1])
    t = layer.scaling["default"] * (xd @ a.t()) @ b.t()
    return ((xd @ w.t()).bfloat16().double() + t.bfloat16().double()).bfloat16().double()


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_fused_lora_split_regime_small_adapter_cuda(fmt):
    """With the adapter's term small beside the base's (B of std 1e-4: here ~2% of the base's term; LoRA's B starts at
    zero), its extra rounding vanishes in y's own: y no further from float64 than PEFT's (the CPU's contract)."""
    from tests.quant.test_lora import _exact_lora, check_split_regime

    layer = _layer(fmt, 32, bias=False, b_std=1e-4)
    (fused, peft_), _, x0 = _both(layer, autocast=False)
    dy = torch.randn(2, 64, 192, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(2))
    check_split_regime(fused, peft_, _exact_lora(layer, x0, dy))


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
@pytest.mark.parametrize("alpha", [32, 24])
def test_fused_lora_split_regime_cuda(fmt, alpha):
    """bf16 x, float32 adapters, no autocast (the bench's PEFT setting): the fused node's split-bf16 GEMMs (mm with a
    float32 output on cuBLAS) against PEFT's float32 graph and float64, as tests/quant/test_lora.py on the CPU. y is
    held to the error of bf16(bf16(x W^T) + bf16(t)), t the adapter's term: cuBLAS rounds t before adding it (see
    csrc/autograd/dequant_linear.cpp; this layer's adapter term dominates its output, the worst case for that)."""
    from tests.quant.test_lora import _exact_lora, check_split_regime

    layer = _layer(fmt, alpha, bias=False)
    (fused, peft_), (node, _), x0 = _both(layer, autocast=False)
    assert "LoraDequantLinearFunction" in node
    dy = torch.randn(2, 64, 192, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(2))
    check_split_regime(fused, peft_, _exact_lora(layer, x0, dy), y_model=_two_roundings(layer, x0))
    # the same bits as the CPU kernel for the split itself
    from trainstream_hf import ops
    t = layer.lora_B["default"].weight.detach()
    assert torch.equal(ops.split_bf16(t, [0, 1, 2, 0], 1).cpu(), ops.split_bf16(t.cpu(), [0, 1, 2, 0], 1))
