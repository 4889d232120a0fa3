"""QuantLinear (CPU): forward and dx against nn.Linear over the dequantized weight, per format and activation dtype;
frozen weight, bias, autocast, module casts, state_dict, bad input."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainstream_hf.quant import QuantLinear, dequantize, quantize

FORMATS = ["int8", "nf4", "fp8", "nvfp4"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# max |y - y_ref| / max |y_ref| for the activation-quantized paths against a float64 reference: the output's
# rounding to the activation dtype (half an ulp, relative: 2^-24 / 2^-8 / 2^-11) plus float32 accumulation error.
TOL = {torch.float32: 1e-6, torch.bfloat16: 2 ** -8 + 1e-5, torch.float16: 2 ** -11 + 1e-5}




def _linear(in_features, out_features, seed, bias=True, dtype=torch.float32):
    torch.manual_seed(seed)
    lin = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        lin.weight.view(-1)[:: max(1, lin.weight.numel() // 7)] *= 30.0  # a few outlier weights
        if bias:
            lin.bias.normal_()
    return lin.to(dtype)


def _act(shape, seed, dtype=torch.float32):
    """N(0, 1) activations with two channels scaled 20x (LLM-like outlier channels)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if shape[-1] >= 8:
        x[..., 3] *= 20.0
        x[..., -5] *= -20.0
    return x.to(dtype)


def _fake_quant(x, fmt):
    """The activations an activation-quantized path multiplies, via the *weight* quantizers of formats.py (per-row
    E4M3 for fp8, NVFP4 for nvfp4): an implementation independent of trainstream_hf.quant.matmul."""
    x2d = x.reshape(-1, x.shape[-1])
    return dequantize(quantize(x2d, fmt), torch.float32).double().view(x.shape)


SHAPES = [((3, 5), 64, 40), ((1,), 128, 3), ((2, 7), 256, 96)]  # (leading dims, in_features, out_features)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead,k,n", SHAPES)
def test_forward_backward_vs_dequantized_linear(fmt, dtype, lead, k, n):
    seed = FORMATS.index(fmt) * 100 + DTYPES.index(dtype) * 10 + SHAPES.index((lead, k, n))
    layer = QuantLinear.from_linear(_linear(k, n, seed, bias=False, dtype=dtype), fmt)
    ref = nn.Linear(k, n, bias=False, dtype=dtype)
    ref.weight.data = layer.dequantize_weight(dtype)
    x = _act((*lead, k), seed, dtype).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = layer(x), ref(x_ref)
    assert y.dtype == dtype and y.shape == (*lead, n)
    if layer.act_quant:
        assert fmt in ("fp8", "nvfp4")
        exact = _fake_quant(x.detach(), fmt) @ layer.dequantize_weight(torch.float32).double().t()
        assert float((y.detach().double() - exact).abs().max()) <= TOL[dtype] * float(exact.abs().max())
        assert not torch.equal(y, y_ref)  # it did quantize the activations
    else:
        assert torch.equal(y, y_ref)  # weight-only: nn.Linear over the dequantized weight, same kernel
    dy = _act(y.shape, seed + 1, dtype)
    y.backward(dy)
    y_ref.backward(dy)
    assert x.grad.dtype == dtype
    assert torch.equal(x.grad, x_ref.grad)  # dx = dy W_hat on every path (straight-through)


@pytest.mark.parametrize("fmt", FORMATS)
def test_weight_gets_no_gradient_and_is_not_trainable(fmt):
    layer = QuantLinear.from_linear(_linear(64, 32, 1), fmt)
    assert all(not p.requires_grad for p in layer.parameters())
    x = _act((4, 64), 2).requires_grad_()
    layer(x).square().sum().backward()
    assert all(p.grad is None for p in layer.parameters())
    assert x.grad is not None and float(x.grad.abs().sum()) > 0


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
def test_bias_kept_in_its_dtype_and_trainable_on_request(fmt, bias_dtype):
    lin = _linear(64, 24, 3)
    lin.bias.data = lin.bias.data.to(bias_dtype)
    layer = QuantLinear.from_linear(lin, fmt)
    assert layer.bias.dtype == bias_dtype and not layer.bias.requires_grad
    assert layer.bias.data_ptr() == lin.bias.data_ptr()  # shared, not copied
    layer.bias.requires_grad_(True)
    x = _act((2, 3, 64), 4, torch.bfloat16).requires_grad_()
    y = layer(x)
    assert y.dtype == torch.bfloat16
    no_bias = QuantLinear(layer.weight, None, act_quant=layer.act_quant)
    assert torch.equal(y.detach(), no_bias(x.detach()) + layer.bias.detach().to(torch.bfloat16))
    dy = _act(y.shape, 5, torch.bfloat16)
    y.backward(dy)
    assert layer.bias.grad.dtype == bias_dtype
    torch.testing.assert_close(layer.bias.grad, dy.float().sum((0, 1)).to(bias_dtype), rtol=2e-2, atol=2e-2)
    assert all(p.grad is None for n, p in layer.named_parameters() if n != "bias")


@pytest.mark.parametrize("fmt", FORMATS)
def test_autocast_cpu_bfloat16(fmt):
    layer = QuantLinear.from_linear(_linear(128, 48, 6), fmt)
    x = _act((2, 5, 128), 7).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    x_bf = x.detach().to(torch.bfloat16).requires_grad_()
    y_bf = layer(x_bf)
    assert torch.equal(y, y_bf)
    dy = _act(y.shape, 8, torch.bfloat16)
    y.backward(dy)
    y_bf.backward(dy)
    assert x.grad.dtype == torch.float32 and torch.equal(x.grad, x_bf.grad.float())


def test_autocast_off_inside_and_fp16_autocast():
    """Under fp16 autocast the layer computes in fp16; the matmul inside is not re-cast by autocast."""
    layer = QuantLinear.from_linear(_linear(64, 16, 9), "nf4")
    x = _act((3, 64), 10)
    with torch.autocast("cpu", dtype=torch.float16):
        y = layer(x)
    assert y.dtype == torch.float16 and torch.equal(y, layer(x.half()))


@pytest.mark.parametrize("fmt", FORMATS)
def test_weight_introspection_does_not_decode(fmt):
    lin = _linear(128, 40, 11, dtype=torch.bfloat16)
    layer = QuantLinear.from_linear(lin, fmt)
    w = layer.weight
    assert (layer.in_features, layer.out_features) == (128, 40)
    assert tuple(w.shape) == (40, 128) and w.dtype == torch.bfloat16 and w.device == torch.device("cpu")
    assert w.fmt.name == fmt and w.nbytes == sum(p.numel() * p.element_size() for n, p in layer.named_parameters()
                                                 if n.startswith("weight_"))
    assert all(t.data_ptr() == getattr(layer, "weight_" + n).data_ptr() for n, t in w.tensors.items())
    assert torch.equal(layer.dequantize_weight(), dequantize(quantize(lin.weight.detach(), fmt), torch.bfloat16))
    assert layer.dequantize_weight(torch.float32).dtype == torch.float32
    with pytest.raises(AttributeError, match="cannot be assigned"):
        layer.weight = torch.zeros(40, 128)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("cast", ["to_bf16", "half", "float", "double"])
def test_module_casts_keep_packed_bits(fmt, cast):
    layer = QuantLinear.from_linear(_linear(64, 8, 12), fmt)
    before = {n: p.detach().clone() for n, p in layer.named_parameters() if n.startswith("weight_")}
    x = _act((2, 64), 13)
    y_before = layer(x)
    {"to_bf16": lambda: layer.to(torch.bfloat16), "half": layer.half, "float": layer.float,
     "double": layer.double}[cast]()
    expected = {"to_bf16": torch.bfloat16, "half": torch.float16, "float": torch.float32, "double": torch.float64}
    assert layer.bias.dtype == expected[cast]
    assert layer.weight.dtype == (torch.float32 if cast == "double" else expected[cast])
    for n, t in before.items():
        p = getattr(layer, n)
        assert p.dtype == t.dtype and torch.equal(p.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
    if cast == "float":
        assert torch.equal(layer(x), y_before)
    layer.to("cpu")  # a plain move leaves everything alone
    assert all(getattr(layer, n).dtype == t.dtype for n, t in before.items())


@pytest.mark.parametrize("fmt", FORMATS)
def test_state_dict_round_trip(fmt):
    a = QuantLinear.from_linear(_linear(64, 8, 14), fmt)
    b = QuantLinear.from_linear(_linear(64, 8, 15), fmt)
    sd = a.state_dict()
    assert set(sd) == {"bias"} | {"weight_" + n for n in a.fmt.tensor_names}
    b.load_state_dict(sd)
    x = _act((3, 64), 16)
    assert torch.equal(a(x), b(x))


def test_conv1d_layout():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(17)
    conv = Conv1D(48, 64)  # nx=64 in, nf=48 out; weight (64, 48)
    with torch.no_grad():
        conv.bias.normal_()
    layer = QuantLinear.from_linear(conv, "int8")
    assert (layer.in_features, layer.out_features) == (64, 48)
    assert torch.equal(layer.dequantize_weight(torch.float32),
                       dequantize(quantize(conv.weight.detach().t().contiguous(), "int8"), torch.float32))
    x = _act((2, 3, 64), 18)
    torch.testing.assert_close(layer(x), F.linear(x, layer.dequantize_weight(torch.float32), conv.bias))


@pytest.mark.parametrize("fmt", FORMATS)
def test_empty_batch(fmt):
    layer = QuantLinear.from_linear(_linear(64, 8, 19), fmt, outliers=0.1)
    x = torch.zeros(0, 64, requires_grad=True)
    y = layer(x)
    assert y.shape == (0, 8)
    y.sum().backward()
    assert x.grad.shape == (0, 64)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_act_quant_off_is_weight_only(fmt):
    lin = _linear(64, 16, 20, bias=False)
    layer = QuantLinear.from_linear(lin, fmt, act_quant=False)
    assert layer.matmul_path().name == "dequant" and not layer.matmul_path().quantizes_activations
    x = _act((5, 64), 21)
    assert torch.equal(layer(x), F.linear(x, layer.dequantize_weight(torch.float32)))


def test_saved_tensors_are_the_packed_weight():
    """The backward keeps only the packed tensors (seen by saved-tensor hooks, as the engine's pager needs), never a
    decoded 16-bit weight."""
    layer = QuantLinear.from_linear(_linear(128, 64, 22), "nvfp4")
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(_act((4, 128), 23).requires_grad_())
    ptrs = {p.data_ptr() for n, p in layer.named_parameters() if n.startswith("weight_")}
    assert {t.data_ptr() for t in saved} == ptrs


# --------------------------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------------------------

def test_bad_construction():
    lin = _linear(64, 8, 24)
    with pytest.raises(ValueError, match="unknown quantization format 'int4'"):
        QuantLinear.from_linear(lin, "int4")
    for p in (-0.1, 0.6, float("nan"), True):
        with pytest.raises(ValueError, match=r"outliers must be .* in \[0, 0.5\]"):
            QuantLinear.from_linear(lin, "fp8", outliers=p)
    for fmt in ("int8", "nf4"):
        with pytest.raises(ValueError, match=f"act_quant=True needs .*; {fmt} is weight-only"):
            QuantLinear.from_linear(lin, fmt, act_quant=True)
    with pytest.raises(ValueError, match="in_features must be a multiple of 64, got 72"):
        QuantLinear.from_linear(_linear(72, 8, 25), "nf4")
    with pytest.raises(TypeError, match="expected nn.Linear or transformers' Conv1D, got Conv2d"):
        QuantLinear.from_linear(nn.Conv2d(3, 3, 1), "int8")
    with pytest.raises(TypeError, match="must be a QuantizedTensor"):
        QuantLinear(lin.weight)
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        QuantLinear(quantize(lin.weight.detach(), "int8"), torch.zeros(9))


def test_bad_input():
    layer = QuantLinear.from_linear(_linear(64, 8, 26), "nvfp4")
    with pytest.raises(TypeError, match="input must be float32, bfloat16 or float16, got torch.float64"):
        layer(torch.randn(2, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match="last dimension must be in_features=64"):
        layer(torch.randn(2, 63))
    assert math.isfinite(float(layer(torch.randn(2, 64)).abs().sum()))
