"""QuantLinear on CUDA: forward and dx against the CPU path for every format, activation dtype and outlier setting;
the activation quantizers and column decoder bit for bit against the CPU; the forward (outlier selection included)
without a host sync; quantize_model of a CPU-resident model on the GPU, one layer at a time.

The CUDA paths are held to the CPU numerics: fused dequantize kernels (bit-identical weights), the FP8 tensor-core
path (torch._scaled_mm: forward within the output's rounding of the CPU emulation; its FP8 backward within E4M3
rounding of the CPU's straight-through dx), the emulated W4A4 path. act_quant is explicit in the comparisons: its
default depends on the device (nvfp4 is weight-only by default on GPUs without an FP4 tensor-core path).
"""
import copy

import pytest
import torch
from torch import nn

from trainstream_hf.quant import QuantLinear, dequantize, quantize, quantize_model
from trainstream_hf.quant import matmul
from trainstream_hf.quant.outliers import dequantize_columns
from tests.helpers import bits, outlier_channel_tokens, rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")

FORMATS = ["int8", "nf4", "fp8", "nvfp4"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# max |y_cuda - y_cpu| / max |y_cpu|: two float32-accumulated results (different summation orders), each rounded to
# the activation dtype: up to one ulp apart (2^-7 bf16, 2^-10 fp16), plus accumulation-order noise in float32.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7 + 1e-4, torch.float16: 2 ** -10 + 1e-4}
# dx of the FP8 tensor-core path against the CPU's dy @ dequantize(W): dy is rounded to E4M3 (4 significant bits) per
# token. 0.017-0.024 measured on the CPU emulation of the same maths for these shapes; 2.5x margin.
FP8_DX_TOL = 0.06
# (format, act_quant) pairs: both settings of the formats that have an activation-quantized path.
CASES = [("int8", None), ("nf4", None), ("fp8", False), ("fp8", True), ("nvfp4", False), ("nvfp4", True)]


def _layer(fmt, k, n, seed, outliers=0.0, dtype=torch.float32, act_quant=None):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.view(-1)[:: 97] *= 30.0
        lin.bias.normal_()
    return QuantLinear.from_linear(lin.to(dtype), fmt, outliers, act_quant=act_quant)


@pytest.mark.parametrize("fmt,act_quant", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("outliers", [0.0, 0.01])
def test_cuda_matches_cpu(fmt, act_quant, dtype, outliers):
    cpu = _layer(fmt, 1024, 384, FORMATS.index(fmt), outliers, dtype, act_quant)
    gpu = copy.deepcopy(cpu).cuda()
    for n, p in gpu.named_parameters():  # .cuda() moved the packed tensors and kept their dtype and bits
        ref = getattr(cpu, n)
        assert p.is_cuda and p.dtype == ref.dtype
        assert torch.equal(bits(p.detach().cpu()), bits(ref.detach()))
    x = outlier_channel_tokens((4, 64, 1024), 1, dtype, zero_token=False)
    dy = outlier_channel_tokens((4, 64, 384), 2, dtype, zero_token=False)
    xc, xg = x.clone().requires_grad_(), x.cuda().requires_grad_()
    yc, yg = cpu(xc), gpu(xg)
    assert yg.dtype == dtype and yg.shape == yc.shape
    assert rel_err(yg.detach().cpu(), yc.detach()) <= TOL[dtype], gpu.matmul_path().name
    yc.backward(dy)
    yg.backward(dy.cuda())
    fp8_backward = gpu.matmul_path() is matmul.FP8_W8A8_SCALED_MM and dtype != torch.float32
    assert rel_err(xg.grad.cpu(), xc.grad) <= (FP8_DX_TOL if fp8_backward else TOL[dtype])
    assert all(p.grad is None for p in gpu.parameters())


def test_default_act_quant_on_this_gpu():
    """act_quant=None resolves per device: fp8 quantizes activations where FP8 tensor cores run it (sm_89+), nvfp4 is
    weight-only on every GPU (no FP4 tensor-core path is implemented); on the CPU both quantize."""
    fp8, nvfp4 = _layer("fp8", 256, 64, 0), _layer("nvfp4", 256, 64, 1)
    assert fp8.act_quant and nvfp4.act_quant
    fp8, nvfp4 = fp8.cuda(), nvfp4.cuda()
    fp8_cores = torch.cuda.get_device_capability() >= (8, 9)
    assert fp8.act_quant == fp8_cores
    assert fp8.matmul_path() is (matmul.FP8_W8A8_SCALED_MM if fp8_cores else matmul.DEQUANT)
    assert not nvfp4.act_quant and nvfp4.matmul_path() is matmul.DEQUANT


@pytest.mark.parametrize("dtype", DTYPES)
def test_activation_quantizers_match_cpu_bitwise(dtype):
    x = outlier_channel_tokens((64, 512), 3, dtype, zero_token=False)
    q, s = matmul.quantize_rows_e4m3(x)
    qg, sg = matmul.quantize_rows_e4m3(x.cuda())
    assert torch.equal(bits(qg.cpu()), bits(q)) and torch.equal(bits(sg.cpu()), bits(s))
    v, ts = matmul.quantize_nvfp4_activations(x)
    vg, tsg = matmul.quantize_nvfp4_activations(x.cuda())
    assert torch.equal(bits(vg.cpu()), bits(v)) and torch.equal(bits(tsg.cpu()), bits(ts))


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_columns_cuda(fmt):
    q = quantize(torch.randn(129, 320, generator=torch.Generator().manual_seed(4)), fmt).to("cuda")
    idx = torch.tensor([0, 1, 63, 319, 17, 18, 2], device="cuda")
    for dtype in DTYPES:
        assert torch.equal(bits(dequantize_columns(q, idx, dtype)), bits(dequantize(q, dtype)[:, idx]))


def _no_sync(fn):
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("fmt,act_quant", CASES)
@pytest.mark.parametrize("outliers", [0.0, 0.01])
def test_forward_has_no_host_sync(fmt, act_quant, outliers):
    """The forward, outlier selection (topk, gathers) included, never waits for the GPU. One warm-up call first: the
    first call on a device copies the NF4 code table there once (trainstream_hf.ops._on_device) and creates the
    cuBLAS handle."""
    layer = _layer(fmt, 1024, 256, 5, outliers, act_quant=act_quant).cuda()
    x = outlier_channel_tokens((2, 128, 1024), 6, torch.bfloat16, zero_token=False).cuda()
    layer(x)
    y = _no_sync(lambda: layer(x))
    assert y.shape == (2, 128, 256)


@pytest.mark.parametrize("fmt,act_quant", CASES)
def test_backward_has_no_host_sync(fmt, act_quant):
    layer = _layer(fmt, 1024, 256, 7, 0.01, act_quant=act_quant).cuda()
    x = outlier_channel_tokens((2, 128, 1024), 8, torch.bfloat16, zero_token=False).cuda().requires_grad_()
    dy = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16)
    layer(x).backward(dy)
    x.grad = None
    _no_sync(lambda: layer(x).backward(dy))
    assert x.grad is not None


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_model_on_gpu_one_layer_at_a_time(fmt):
    """A CPU-resident model quantized with device="cuda": the packed weights come back to the CPU, equal to a CPU
    quantization's bits, and the GPU never holds more than a few layers' worth at once."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(9)
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=16,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    linear_bytes = sum(m.weight.numel() * m.weight.element_size() for n, m in model.named_modules()
                       if type(m) is nn.Linear and n != "lm_head")
    reference = quantize_model(copy.deepcopy(model), fmt)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    quantize_model(model, fmt, device="cuda")
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < linear_bytes / 4, (peak, linear_bytes)
    for (n, p), (n_ref, p_ref) in zip(model.named_parameters(), reference.named_parameters()):
        assert n == n_ref and p.device.type == "cpu"
        assert torch.equal(bits(p.detach()), bits(p_ref.detach())), n
