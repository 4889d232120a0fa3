"""Matmul paths (CPU): the on-the-fly activation quantizers equal the formats' reference quantizers bit for bit, the
E2M1 decoder, and the path table."""
import pytest
import torch

from trainstream_hf import ops
from trainstream_hf.quant import get_format, quantize
from trainstream_hf.quant import matmul
from tests.helpers import bits


def _act(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[:, 5] *= 60.0  # an outlier channel
    x[1] = 0.0  # an all-zero token
    x[2, :16] = 0.0  # an all-zero NVFP4 block
    x[3] *= 1e-30  # a token near the bottom of float32 (subnormal scales)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_rows_e4m3_equals_fp8_weight_quantizer(dtype):
    x = _act((9, 80), 1, dtype)
    q, s = matmul.quantize_rows_e4m3(x)
    ref = quantize(x, "fp8").tensors
    assert q.dtype == torch.float8_e4m3fn and s.shape == (9, 1)
    assert torch.equal(bits(q), bits(ref["data"])) and torch.equal(bits(s.flatten()), bits(ref["scale"]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_nvfp4_activations_equals_reference(dtype):
    x = _act((9, 96), 2, dtype)
    v, ts = matmul.quantize_nvfp4_activations(x)
    data, block_scale, ref_ts = ops.quantize_nvfp4_reference(x)
    assert torch.equal(bits(ts), bits(ref_ts))
    ref_v = ops.dequantize_nvfp4_reference(data, block_scale, torch.ones(()), dtype=torch.float32)
    assert torch.equal(bits(v), bits(ref_v))  # codes x block scales, -0.0 included


def test_e2m1_decode():
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(bits(matmul.e2m1_decode(codes)), bits(ops.E2M1_VALUES))


def test_select_path_table():
    cpu = torch.device("cpu")
    for name in ("int8", "nf4", "fp8", "nvfp4"):
        assert matmul.select_path(get_format(name), cpu, False) is matmul.DEQUANT
    assert matmul.select_path(get_format("fp8"), cpu, True) is matmul.FP8_W8A8_EMULATED
    assert matmul.select_path(get_format("nvfp4"), cpu, True) is matmul.NVFP4_W4A4_EMULATED
    assert [n for n in ("int8", "nf4", "fp8", "nvfp4") if matmul.default_act_quant(get_format(n))] == ["fp8", "nvfp4"]
    with pytest.raises(ValueError, match="nf4 is weight-only"):
        matmul.select_path(get_format("nf4"), cpu, True)


@pytest.mark.parametrize("path", [matmul.FP8_W8A8_EMULATED, matmul.NVFP4_W4A4_EMULATED])
def test_emulated_paths_handle_zero_and_tiny_tokens(path):
    fmt = "fp8" if path is matmul.FP8_W8A8_EMULATED else "nvfp4"
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(3))
    x = _act((6, 64), 4)
    y = path.forward(x, quantize(w, fmt))
    assert bool(torch.isfinite(y).all())
    assert torch.equal(y[1], torch.zeros(24))
