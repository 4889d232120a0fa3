"""The CUDA kernels against their pure-PyTorch references (trainstream_hf/ops/reference/), the reference run on the
GPU on the same inputs, as tests/test_ops_reference.py does on the CPU. ``fp8_gemm_rowwise`` (cuBLASLt, no CPU
kernel) is compared with its reference here only. Tolerances as on the CPU, relative to the reference's largest value:
one rounding of the output dtype where the kernel sums the same float32 terms in another order, two where it also
rounds in one place more (cuBLAS' bf16 addmm rounds the added product first, csrc/autograd/dequant_linear.cpp)."""
import pytest
import torch

from trainstream_hf import ops
from trainstream_hf.quant import quantize
from tests.helpers import rel_err as _rel_err

ULP = {torch.float32: 2 ** -23, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}
TWO_ULPS = {torch.float32: 1e-5, torch.bfloat16: 2 ** -6, torch.float16: 2 ** -9}
RMS_TOL = {torch.float32: 1e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -9}
CUDA = "cuda"

requires_fp8 = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
    reason="requires sm_89+ (FP8 tensor cores)")


def rel_err(a, b):
    return _rel_err(a.detach(), b.detach())


def _packed(fmt, n, k, seed):
    torch.manual_seed(seed)
    q = quantize(torch.randn(n, k, device=CUDA), fmt)
    return [q.tensors[name] for name in q.fmt.tensor_names]


def test_fp8_gemm_rowwise_matches_reference():
    if not ops.has_kernel("fp8_gemm_rowwise", CUDA):
        pytest.skip("this build has no cuBLASLt GEMM (cuBLAS older than 12.9)")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("row-wise FP8 cuBLASLt is used on sm_90")
    torch.manual_seed(0)
    a, sa = ops.quantize_rows_e4m3_reference(torch.randn(48, 256, device=CUDA))
    b, sb = ops.quantize_fp8_reference(torch.randn(64, 256, device=CUDA))
    for dtype in (torch.bfloat16, torch.float16):
        out = ops.fp8_gemm_rowwise(a, b, sa.view(-1), sb, dtype)
        ref = ops.fp8_gemm_rowwise_reference(a, b, sa, sb, dtype)
        assert out.dtype == ref.dtype and rel_err(out, ref) <= ULP[dtype]


@requires_fp8
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("outliers", [0, 3])
def test_fp8_linear_and_dgrad_match_reference(dtype, outliers):
    torch.manual_seed(1)
    w, w_scale = ops.quantize_fp8_reference(torch.randn(64, 128, device=CUDA))
    x = torch.randn(2, 16, 128, device=CUDA, dtype=dtype)
    x[..., 5] *= 30
    x.requires_grad_()
    y = ops.fp8_linear(x, w, w_scale, False, None, outliers)
    ref = ops.fp8_linear_reference(x, w, w_scale, False, None, outliers)
    # with outliers cuBLAS rounds the outlier product to x's dtype before adding it: one rounding more
    assert rel_err(y, ref) <= (TWO_ULPS if outliers else ULP)[dtype]
    dy = torch.randn_like(ref)
    dx, dx_ref = torch.autograd.grad(y, x, dy)[0], torch.autograd.grad(ref, x, dy)[0]
    assert rel_err(dx, dx_ref) <= ULP[dtype]
    dy2d = dy.reshape(-1, 64)
    dx2d = ops.fp8_linear_dgrad(dy2d, w, w_scale)
    assert rel_err(dx2d, ops.fp8_linear_dgrad_reference(dy2d, w, w_scale)) <= ULP[dtype]


@pytest.mark.parametrize("dim", [0, 1])
def test_split_bf16_matches_reference(dim):
    torch.manual_seed(2)
    t = torch.randn(33, 70, device=CUDA) * torch.logspace(-3, 3, 70, device=CUDA)
    pattern = [0, 0, 0, 1, 2, 1]
    assert torch.equal(ops.split_bf16(t, pattern, dim), ops.split_bf16_reference(t, pattern, dim))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_matches_reference(dtype):
    torch.manual_seed(3)
    x = (torch.randn(4, 9, 512, device=CUDA) * 3).to(dtype).requires_grad_()
    w = torch.randn(512, device=CUDA).mul_(0.2).add_(1.0).to(dtype).requires_grad_()
    y, ref = ops.rms_norm(x, w, 1e-6), ops.rms_norm_reference(x, w, 1e-6)
    assert rel_err(y, ref) <= RMS_TOL[dtype]
    dy = torch.randn_like(ref)
    for got, want in zip(torch.autograd.grad(y, (x, w), dy), torch.autograd.grad(ref, (x, w), dy)):
        assert rel_err(got, want) <= RMS_TOL[dtype]


@pytest.mark.parametrize("fmt", ["int8", "nf4", "fp8", "nvfp4"])
def test_weight_only_layers_match_reference(fmt):
    """dequant_linear (the same cuBLAS GEMM over the kernel's bits: within a rounding, the GEMM's algorithm may differ
    with the call's shape), lora_add (PEFT's graph) and lora_dequant_linear (split regime: float32 adapters over bf16
    x; cuBLAS' addmm rounds the adapter's term first)."""
    packed = _packed(fmt, 64, 128, seed=4)
    torch.manual_seed(5)
    x = torch.randn(2, 8, 128, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    a = (torch.randn(8, 128, device=CUDA) * 0.3).requires_grad_()
    b = (torch.randn(64, 8, device=CUDA) * 0.3).requires_grad_()
    y, ref = ops.dequant_linear(x, packed, fmt), ops.dequant_linear_reference(x, packed, fmt)
    assert rel_err(y, ref) <= ULP[torch.bfloat16]
    result = y.detach()
    out, out_ref = ops.lora_add(result, x, a, b, 2.0), ops.lora_add_reference(result, x, a, b, 2.0)
    assert out.dtype == out_ref.dtype and rel_err(out, out_ref) <= ULP[torch.bfloat16]
    y = ops.lora_dequant_linear(x, packed, fmt, a, b, 1.5)
    ref = ops.lora_dequant_linear_reference(x, packed, fmt, a, b, 1.5)
    assert rel_err(y, ref) <= TWO_ULPS[torch.bfloat16]
    dy = torch.randn_like(ref)
    for got, want in zip(torch.autograd.grad(y, (x, a, b), dy), torch.autograd.grad(ref, (x, a, b), dy)):
        assert got.dtype == want.dtype and rel_err(got, want) <= TWO_ULPS[want.dtype]
