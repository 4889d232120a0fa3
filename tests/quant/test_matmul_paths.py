"""Matmul path selection per (format, device capability, act_quant) with a faked CUDA capability, QuantLinear's
device-dependent act_quant default, and the FP8 tensor-core path's wiring (operand layouts, scales, fallbacks, the
FP8 backward's numerics) on the CPU, with torch._scaled_mm replaced by an emulation that enforces its contract."""
import warnings

import pytest
import torch
from torch import nn

from trainstream_hf import ops
from trainstream_hf.quant import QuantLinear, dequantize, get_format, quantize
from trainstream_hf.quant import matmul
from trainstream_hf.quant.linear import _QuantLinearFunction
from tests.helpers import outlier_channel_tokens, strided_outlier_weight

CUDA = torch.device("cuda")
FMTS = ["int8", "nf4", "fp8", "nvfp4"]


@pytest.fixture
def capability(monkeypatch):
    """Fakes torch.cuda.get_device_capability (no GPU needed: select_path only asks for the capability) and forgets
    the one-time warnings already given."""
    monkeypatch.setattr(matmul, "_WARNED", set())
    monkeypatch.setattr(matmul, "_CAPABILITY", {})

    def set_cap(cap):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    return set_cap


def _no_warnings(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn()


# ---------------------------------------------------------------------------------------------------------------
# select_path / default_act_quant
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cap,fp8_default", [((8, 0), matmul.DEQUANT), ((8, 9), matmul.FP8_W8A8_SCALED_MM),
                                             ((9, 0), matmul.FP8_W8A8_SCALED_MM),
                                             ((10, 0), matmul.FP8_W8A8_SCALED_MM)])
def test_defaults_per_capability(capability, cap, fp8_default):
    capability(cap)
    path = lambda name: _no_warnings(lambda: matmul.select_path(get_format(name), CUDA))  # noqa: E731
    assert path("fp8") is fp8_default
    assert matmul.default_act_quant(get_format("fp8"), CUDA) == (cap >= (8, 9))
    # nvfp4: no FP4 tensor-core path is implemented, so weight-only on every GPU (sm_90 has no FP4 tensor cores).
    assert path("nvfp4") is matmul.DEQUANT and not matmul.default_act_quant(get_format("nvfp4"), CUDA)
    assert path("int8") is matmul.DEQUANT and path("nf4") is matmul.DEQUANT


def test_cpu_defaults_unchanged():
    cpu = torch.device("cpu")
    for name in FMTS:
        assert matmul.default_act_quant(get_format(name), cpu) == (name in ("fp8", "nvfp4"))
        assert matmul.default_act_quant(get_format(name)) == (name in ("fp8", "nvfp4"))
    assert matmul.select_path(get_format("fp8"), cpu) is matmul.FP8_W8A8_EMULATED
    assert matmul.select_path(get_format("nvfp4"), cpu) is matmul.NVFP4_W4A4_EMULATED
    assert matmul.select_path(get_format("fp8"), cpu, True) is matmul.FP8_W8A8_EMULATED


@pytest.mark.parametrize("cap", [(8, 9), (9, 0), (12, 0)])
def test_fp8_act_quant_takes_scaled_mm(capability, cap):
    capability(cap)
    assert _no_warnings(lambda: matmul.select_path(get_format("fp8"), CUDA, True)) is matmul.FP8_W8A8_SCALED_MM
    assert matmul.select_path(get_format("fp8"), torch.device("cuda:0"), False) is matmul.DEQUANT


@pytest.mark.parametrize("fmt,cap,msg", [
    ("nvfp4", (9, 0), "FP4 tensor cores need sm_100\\+ and this GPU is sm_90"),
    ("nvfp4", (10, 0), "the nvfp4 tensor-core path is not implemented yet"),
    ("fp8", (8, 0), "FP8 tensor cores need sm_89\\+ and this GPU is sm_80"),
])
def test_explicit_act_quant_without_tensor_cores_warns_once(capability, fmt, cap, msg):
    capability(cap)
    with pytest.warns(RuntimeWarning, match=msg):
        path = matmul.select_path(get_format(fmt), CUDA, True)
    assert path is matmul.ACT_QUANT_FORMATS[fmt]
    assert _no_warnings(lambda: matmul.select_path(get_format(fmt), CUDA, True)) is path  # once


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_act_quant_on_weight_only_formats_raises_on_cuda_too(capability, fmt):
    capability((9, 0))
    with pytest.raises(ValueError, match=f"{fmt} is weight-only"):
        matmul.select_path(get_format(fmt), CUDA, True)


# ---------------------------------------------------------------------------------------------------------------
# QuantLinear: act_quant=None follows the device it runs on
# ---------------------------------------------------------------------------------------------------------------

def _layer(fmt, k=64, n=32, act_quant=None, seed=0):
    torch.manual_seed(seed)
    return QuantLinear.from_linear(nn.Linear(k, n), fmt, act_quant=act_quant)


def test_quant_linear_default_follows_device(capability):
    capability((9, 0))
    nvfp4, fp8 = _layer("nvfp4"), _layer("fp8")
    assert nvfp4.act_quant and fp8.act_quant  # on the CPU, where the weights are
    assert nvfp4.matmul_path() is matmul.NVFP4_W4A4_EMULATED
    assert _no_warnings(lambda: nvfp4.matmul_path("cuda")) is matmul.DEQUANT
    assert fp8.matmul_path("cuda") is matmul.FP8_W8A8_SCALED_MM
    assert "act_quant=True (device default)" in repr(nvfp4)
    explicit = _layer("nvfp4", act_quant=True)
    assert "(device default)" not in repr(explicit)
    with pytest.warns(RuntimeWarning, match="FP4 tensor cores need sm_100"):
        assert explicit.matmul_path("cuda") is matmul.NVFP4_W4A4_EMULATED
    assert _layer("fp8", act_quant=False).matmul_path("cuda") is matmul.DEQUANT


def test_quant_linear_act_quant_setter():
    layer = _layer("fp8")
    layer.act_quant = False
    assert layer.act_quant is False and layer.matmul_path() is matmul.DEQUANT
    layer.act_quant = None
    assert layer.act_quant is True
    int8 = _layer("int8")
    assert int8.act_quant is False
    with pytest.raises(ValueError, match="int8 is weight-only"):
        int8.act_quant = True
    assert int8.act_quant is False


# ---------------------------------------------------------------------------------------------------------------
# The FP8 tensor-core path, with torch._scaled_mm emulated
# ---------------------------------------------------------------------------------------------------------------

def _fake_scaled_mm(calls):
    """torch._scaled_mm's row-wise contract (torch 2.11-2.14, sm_89+: aten/src/ATen/native/cuda/Blas.cpp), asserted,
    then its maths: ``dtype((a @ b) * scale_a * scale_b)`` with float32 accumulation."""

    def scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
        assert a.dtype == torch.float8_e4m3fn and b.dtype == torch.float8_e4m3fn
        (m, k), (k2, n) = a.shape, b.shape
        assert k == k2
        assert a.stride() == (k, 1), "a must be row-major"
        assert b.stride() == (1, k), "b must be column-major"
        assert k % 16 == 0 and n % 16 == 0, "dimensions must be multiples of 16"
        assert a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
        assert scale_a.dtype == torch.float32 and scale_a.shape == (m, 1) and scale_a.is_contiguous()
        assert scale_b.dtype == torch.float32 and scale_b.shape == (1, n) and scale_b.is_contiguous()
        assert out_dtype in (torch.bfloat16, torch.float16) and bias is None and not use_fast_accum
        calls.append((m, k, n))
        return ((a.float() @ b.float()) * scale_a * scale_b).to(out_dtype)

    return scaled_mm


@pytest.fixture
def scaled_mm(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "_scaled_mm", _fake_scaled_mm(calls))
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scaled_mm_forward_is_the_emulated_maths(scaled_mm, dtype):
    q = quantize(strided_outlier_weight(48, 128, 1), "fp8")
    x = outlier_channel_tokens((37, 128), 2, dtype)
    y = matmul.FP8_W8A8_SCALED_MM.forward(x, q)
    assert scaled_mm == [(37, 128, 48)] and y.dtype == dtype
    # Same float32 operations as the emulation (the real kernel differs only in summation order).
    assert torch.equal(y, matmul.FP8_W8A8_EMULATED.forward(x, q).to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scaled_mm_backward_numerics(rowwise_scaled_mm, dtype):
    """dx = dtype((e4m3(dy * s_w / s_g) @ W_q) * s_g): that formula computed independently (up to the CPU kernel's
    summation order and one rounding), and within FP8 rounding of the straight-through dx = dy @ dequantize(W). The
    backward is one native op (ops.fp8_linear_dgrad) calling the real torch._scaled_mm."""
    q = quantize(strided_outlier_weight(64, 96, 3), "fp8")
    dy = outlier_channel_tokens((41, 64), 4, dtype)
    dx = matmul.FP8_W8A8_SCALED_MM.backward(dy, q)
    assert dx.dtype == dtype and dx.shape == (41, 96)
    g = dy.float() * q.tensors["scale"]
    s = g.abs().amax(dim=1, keepdim=True) / 448.0
    g_q = torch.where(s > 0, g / torch.where(s > 0, s, 1.0), 0.0).clamp(-448, 448).to(torch.float8_e4m3fn)
    expect = ((g_q.float() @ q.tensors["data"].float()) * s).to(dtype)
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    assert ((dx.float() - expect.float()).abs() <= ulp * expect.float().abs()).all()
    exact = dy.double() @ dequantize(q, torch.float32).double()
    err = (dx.double() - exact).norm() / exact.norm()
    # E4M3 keeps 4 significant bits: a relative rounding error up to 2^-4 per element, about 0.025 in RMS for Gaussian
    # values (measured); independent errors keep dx's relative error in norm about that of dy, less here where a few
    # outlier channels (rounded like the rest, relatively) dominate the norm. Bounded above at 2.4x the Gaussian
    # figure; bounded below to show that dy was quantized at all.
    assert 1e-3 < err < 0.06, float(err)
    assert float((dx[1].float()).abs().max()) == 0.0  # the zero token


def test_scaled_mm_falls_back_where_it_cannot_run(scaled_mm):
    """float32 activations, or K / N not multiples of 16: the emulated forward and the dequant backward, same bits."""
    q = quantize(strided_outlier_weight(48, 128, 5), "fp8")
    x = outlier_channel_tokens((9, 128), 6, torch.float32)
    assert torch.equal(matmul.FP8_W8A8_SCALED_MM.forward(x, q), matmul.FP8_W8A8_EMULATED.forward(x, q))
    dy = outlier_channel_tokens((9, 48), 7, torch.float32)
    assert torch.equal(matmul.FP8_W8A8_SCALED_MM.backward(dy, q), matmul.DEQUANT.backward(dy, q))
    for n, k in ((40, 128), (48, 120)):
        q = quantize(strided_outlier_weight(n, k, 8), "fp8")
        x = outlier_channel_tokens((9, k), 9, torch.bfloat16)
        assert torch.equal(matmul.FP8_W8A8_SCALED_MM.forward(x, q), matmul.FP8_W8A8_EMULATED.forward(x, q))
        dy = outlier_channel_tokens((9, n), 10, torch.bfloat16)
        assert torch.equal(matmul.FP8_W8A8_SCALED_MM.backward(dy, q), matmul.DEQUANT.backward(dy, q))
    assert scaled_mm == []


def test_scaled_mm_copies_misaligned_weights(scaled_mm):
    """A weight view at an odd address (a paged slot, say) is copied to an aligned one rather than handed to cuBLAS."""
    q = quantize(strided_outlier_weight(32, 64, 11), "fp8")
    raw = torch.empty(q.data.numel() + 1, dtype=torch.uint8)
    raw[1:].copy_(q.data.view(torch.uint8).view(-1))
    odd = raw[1:].view(torch.float8_e4m3fn).view(32, 64)
    assert odd.data_ptr() % 16 != 0
    q_odd = type(q)(q.fmt, q.shape, {"data": odd, "scale": q.tensors["scale"]}, q.dtype)
    x = outlier_channel_tokens((5, 64), 12, torch.bfloat16)
    assert torch.equal(matmul.FP8_W8A8_SCALED_MM.forward(x, q_odd), matmul.FP8_W8A8_SCALED_MM.forward(x, q))
    # The backward is the native fp8_linear_dgrad, which calls ATen's _scaled_mm itself (not the fake above): on the
    # CPU that needs row-wise scaling there, which torch 2.11's CPU kernel lacks (the GPU machine's torch).
    if _cpu_rowwise_scaled_mm():
        dy = outlier_channel_tokens((5, 32), 13, torch.bfloat16)
        assert torch.equal(matmul.FP8_W8A8_SCALED_MM.backward(dy, q_odd), matmul.FP8_W8A8_SCALED_MM.backward(dy, q))


_REAL_SCALED_MM = torch._scaled_mm  # before any test's fake replaces it


def _cpu_rowwise_scaled_mm() -> bool:
    a = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    try:
        _REAL_SCALED_MM(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("k_outliers", [0, 3])
def test_scaled_mm_path_through_the_autograd_function(rowwise_scaled_mm, scaled_mm, k_outliers):
    """QuantLinear's autograd.Function with the tensor-core path: forward (with outlier channels split off) and
    dx through the FP8 backward, only the packed weight saved."""
    lin = nn.Linear(128, 64, bias=False)
    layer = QuantLinear.from_linear(lin, "fp8")
    packed = [layer.weight_data, layer.weight_scale]
    x = outlier_channel_tokens((2 * 8, 128), 14, torch.bfloat16).view(2, 8, 128).requires_grad_()
    y = _QuantLinearFunction.apply(x, matmul.FP8_W8A8_SCALED_MM, layer.fmt, (64, 128), torch.float32, k_outliers,
                                   None, *packed)
    assert y.shape == (2, 8, 64) and y.dtype == torch.bfloat16
    ref = layer(x.detach())  # the CPU path: the emulated forward, same maths
    assert float((y.detach().float() - ref.float()).abs().max()) <= 2 ** -7 * float(ref.float().abs().max())
    dy = outlier_channel_tokens((16, 64), 15, torch.bfloat16).view(2, 8, 64)
    y.backward(dy)
    assert torch.equal(x.grad.view(16, 128), matmul.FP8_W8A8_SCALED_MM.backward(dy.view(16, 64), layer.weight))
    assert len(scaled_mm) == 1  # the forward (the backward's is made by the native op, with the real kernel)


def test_quantize_rows_e4m3_reference_matches_fp8_weight_quantizer():
    """The activation quantizer is the fp8 weight quantizer applied per token (scales kept (T, 1))."""
    x = outlier_channel_tokens((9, 80), 16, torch.bfloat16)
    q, s = ops.quantize_rows_e4m3_reference(x)
    ref = quantize(x, "fp8").tensors
    assert torch.equal(q.view(torch.uint8), ref["data"].view(torch.uint8))
    assert torch.equal(s.view(-1), ref["scale"])


# ---------------------------------------------------------------------------------------------------------------
# One quantized activation for the layers that read the same x (matmul.quantize_activation)
# ---------------------------------------------------------------------------------------------------------------

class _Quantizations:
    """How many activations the forwards quantized since the fixture began: the Python paths' quantize_rows_e4m3
    calls without a column scale (the FP8 backward's calls carry one), and the tensor-core layer's quantizations in C++
    (ops.fp8_activation_cache misses)."""

    def __init__(self):
        self.python = []
        self.native = ops.fp8_activation_cache()["misses"]

    def __len__(self):
        return len(self.python) + ops.fp8_activation_cache()["misses"] - self.native


@pytest.fixture
def quantized(monkeypatch):
    """A :class:`_Quantizations`, with no kept quantization before or after the test."""
    counts = _Quantizations()
    real = matmul.quantize_rows_e4m3

    def counting(x, col_scale=None):
        if col_scale is None:
            counts.python.append(tuple(x.shape))
        return real(x, col_scale)

    monkeypatch.setattr(matmul, "quantize_rows_e4m3", counting)
    matmul.forget_activation()
    yield counts
    matmul.forget_activation()


def _kept() -> bool:
    """Whether a quantization is kept for reuse (the Python paths' or the tensor-core layer's)."""
    return matmul._LAST is not None or ops.fp8_activation_cache()["kept"]


@pytest.fixture
def tensor_cores(monkeypatch, rowwise_scaled_mm, scaled_mm):
    """fp8 QuantLinears on the CPU take the tensor-core path (torch._scaled_mm emulated, its contract asserted, where
    Python calls it; the C++ node calls the real CPU kernel)."""
    monkeypatch.setitem(matmul.ACT_QUANT_FORMATS, "fp8", matmul.FP8_W8A8_SCALED_MM)
    return scaled_mm


def _qkv(k=128, outs=(64, 32, 32), outliers=0.0, seed=20):
    """q / k / v-like fp8 layers: one in_features, several out_features."""
    torch.manual_seed(seed)
    return [QuantLinear.from_linear(nn.Linear(k, n, bias=False), "fp8", outliers=outliers) for n in outs]


def _fresh(layer, x):
    """layer's output for x, quantized afresh: the W8A8 maths written out for the emulated path; for the tensor-core
    path without outliers (the C++ node, which calls the real CPU torch._scaled_mm), the native op on a fresh
    quantization."""
    t = layer.weight.tensors
    x2d = x.detach().reshape(-1, layer.in_features)
    xq, sx = ops.quantize_rows_e4m3(x2d)
    if layer.matmul_path() is matmul.FP8_W8A8_SCALED_MM and not layer.outliers:
        y = ops.fp8_linear(x2d, t["data"], t["scale"], reuse=False)
    else:
        y = ((xq.float() @ t["data"].float().t()) * sx * t["scale"]).to(x.dtype)
    return y.view(*x.shape[:-1], layer.out_features)


@pytest.mark.parametrize("route", ["tensor_cores", "emulated"])
def test_layers_reading_one_x_quantize_it_once(quantized, request, route):
    if route == "tensor_cores":
        request.getfixturevalue("tensor_cores")
    layers = _qkv()
    assert layers[0].matmul_path() is (matmul.FP8_W8A8_SCALED_MM if route == "tensor_cores"
                                       else matmul.FP8_W8A8_EMULATED)
    x = outlier_channel_tokens((16, 128), 21, torch.bfloat16).view(2, 8, 128).requires_grad_()
    ys = [layer(x) for layer in layers]
    assert len(quantized) == 1
    for layer, y in zip(layers, ys):
        assert torch.equal(y, _fresh(layer, x))
    # The same step with reuse switched off between the layers: same outputs and input gradient, bit for bit.
    x2 = x.detach().clone().requires_grad_()
    ys2 = []
    for layer in layers:
        matmul.forget_activation()
        ys2.append(layer(x2))
    assert len(quantized) == 4
    dys = [outlier_channel_tokens((16, layer.out_features), 22 + i, torch.bfloat16).view(2, 8, -1)
           for i, layer in enumerate(layers)]
    dx, = torch.autograd.grad(ys, x, dys)
    dx2, = torch.autograd.grad(ys2, x2, dys)
    assert all(torch.equal(a, b) for a, b in zip(ys, ys2)) and torch.equal(dx, dx2)


def test_an_x_written_in_place_is_quantized_again(quantized, tensor_cores):
    a, b, c = _qkv()
    x = outlier_channel_tokens((16, 128), 23, torch.bfloat16)
    a(x)
    x.view(-1)[5] = 7.0  # through a view: views share x's version counter
    y = b(x)
    assert len(quantized) == 2 and torch.equal(y, _fresh(b, x))
    with torch.no_grad():
        x[3].mul_(-3.0)  # grad mode does not matter to the version counter
    y = c(x)
    assert len(quantized) == 3 and torch.equal(y, _fresh(c, x))
    y = a(x)  # unchanged since: reused
    assert len(quantized) == 3 and torch.equal(y, _fresh(a, x))
    # storage swapped without a version bump: data_ptr changed
    x.data = outlier_channel_tokens((16, 128), 24, torch.bfloat16)
    y = b(x)
    assert len(quantized) == 4 and torch.equal(y, _fresh(b, x))


def test_a_tensor_at_the_same_address_is_not_the_same_x(quantized, tensor_cores):
    """Two tensors on one storage, same address, version, shape and stride, different values over time: reuse is
    keyed by the tensor object, never by its address; a dead tensor's quantization is never reused (the tensor-core
    layer drops it at its next call)."""
    a, b, _ = _qkv()
    storage = torch.empty(16 * 128, dtype=torch.bfloat16).untyped_storage()

    def tensor_on_storage(seed):
        t = torch.empty(0, dtype=torch.bfloat16).set_(storage, 0, (16, 128), (128, 1))
        return t.copy_(outlier_channel_tokens((16, 128), seed, torch.bfloat16))

    x = tensor_on_storage(25)
    a(x)
    ptr, version = x.data_ptr(), x._version
    x2 = tensor_on_storage(26)  # x is alive, and now reads x2's values
    assert (x2.data_ptr(), x2._version, x2.shape, x2.stride()) == (ptr, version, x.shape, x.stride())
    y = b(x2)
    assert len(quantized) == 2 and torch.equal(y, _fresh(b, x2))
    del x, x2
    x3 = tensor_on_storage(27)
    assert (x3.data_ptr(), x3._version) == (ptr, version)
    y = a(x3)
    assert len(quantized) == 3 and torch.equal(y, _fresh(a, x3))


def test_what_is_never_shared(quantized, tensor_cores):
    """Outlier layers (each quantizes its own x with the outlier channels zeroed), inference-mode tensors, x after an
    in-place write, and anything after a backward through the C++ node (the forward is over: the copy goes)."""
    layers = _qkv(outliers=0.05)
    x = outlier_channel_tokens((16, 128), 28, torch.bfloat16)
    for layer in layers:
        layer(x)
    assert len(quantized) == 3 and not _kept()
    plain = _qkv()
    with torch.inference_mode():
        xi = outlier_channel_tokens((16, 128), 29, torch.bfloat16)
        ys = [layer(xi) for layer in plain]
    assert len(quantized) == 6 and not _kept()
    assert all(torch.equal(y, _fresh(layer, xi)) for layer, y in zip(plain, ys))
    x = x.requires_grad_()
    y = plain[0](x)
    assert _kept()
    x.detach().mul_(1.0)  # an in-place write (through a view sharing the version counter)
    y2 = plain[1](x)
    assert len(quantized) == 8 and _kept() and torch.equal(y2, _fresh(plain[1], x))
    y.backward(torch.ones_like(y))
    assert not _kept()
    plain[2](x)
    assert len(quantized) == 9


def test_path_is_looked_up_per_device_and_act_quant(quantized, tensor_cores):
    """QuantLinear keeps the path it selected per (device, act_quant): changing act_quant takes effect at once."""
    layer = _qkv()[0]
    x = outlier_channel_tokens((16, 128), 30, torch.bfloat16)
    layer(x)
    assert len(quantized) == 1 and layer._paths == {(torch.device("cpu"), None): matmul.FP8_W8A8_SCALED_MM}
    layer.act_quant = False
    matmul.forget_activation()
    assert torch.equal(layer(x), matmul.DEQUANT.forward(x, layer.weight))
    assert len(quantized) == 1
