"""Every op of ``torch.ops.trainstream`` against its pure-PyTorch reference (trainstream_hf/ops/reference/) on the CPU:
the forward and, where the op is differentiable, the gradients (``torch.autograd.grad`` of op and reference).

``torch.equal`` where the op computes the reference's bits; elsewhere a tolerance, relative to the reference's
largest value (``rel_err``), whose reason is given where it is defined. ``fp8_gemm_rowwise`` has no CPU kernel
(cuBLASLt only): here its reference is checked against ``torch._scaled_mm`` and a float64 computation, and
tests/gpu/test_ops_reference_cuda.py checks the kernel against the reference. The references of the formats, of
``quantize_rows_e4m3``, ``transpose_bytes`` and ``adamw_step_`` are compared with their ops in
tests/test_quant_kernels.py, tests/quant/ and tests/test_ops.py; here only their presence is checked.
"""
import pytest
import torch

from trainstream_hf import ops
from trainstream_hf.quant import quantize
from tests.helpers import rel_err as _rel_err

# One rounding of the output dtype moved (by a float32 sum taken in another order, or one rounding more or fewer):
# one ulp at the top of the output's range, relative to its largest value (a bf16 ulp is 2^-8 to 2^-7 of its value).
ULP = {torch.float32: 2 ** -23, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}
# Two such roundings (e.g. a gradient term rounded before a sum in one and not the other), and float32 results whose
# sums of up to a few hundred terms run in another order (error grows with the terms' count, far below 1e-5).
TWO_ULPS = {torch.float32: 1e-5, torch.bfloat16: 2 ** -6, torch.float16: 2 ** -9}


def rel_err(a, b):
    """tests.helpers.rel_err of tensors that may require grad."""
    return _rel_err(a.detach(), b.detach())


def _grads(out, inputs, dy):
    return torch.autograd.grad(out, inputs, dy)


def _packed(fmt, n, k, seed):
    torch.manual_seed(seed)
    q = quantize(torch.randn(n, k), fmt)
    return [q.tensors[name] for name in q.fmt.tensor_names]


def test_every_op_has_a_reference_and_every_public_name_is_exported():
    names = sorted(n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("trainstream::"))
    assert len(names) >= 19
    refs = [f"{n.rstrip('_')}_reference" for n in names]  # adamw_step_ -> adamw_step_reference
    missing = [r for r in refs if r not in ops.__all__ or not callable(getattr(ops, r))]
    assert not missing
    assert len(set(ops.__all__)) == len(ops.__all__) and all(hasattr(ops, n) for n in ops.__all__)
    public = {n for n, v in vars(ops).items() if not n.startswith("_") and not isinstance(v, type(ops))}
    assert public - {"annotations"} == set(ops.__all__)


# ---------------------------------------------------------------------------------------------------------------
# split_bf16: the op's bits (one float32 difference and one cast per part, the same on every device)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("pattern", [[0], [0, 1, 2], [0, 0, 0, 1, 2, 1], [2, 1, 0, 2, 1, 0, 1, 2]])
def test_split_bf16(dim, pattern):
    torch.manual_seed(0)
    t = torch.randn(9, 13) * torch.logspace(-3, 3, 13)  # a few binades per row
    ref = ops.split_bf16_reference(t, pattern, dim)
    assert torch.equal(ops.split_bf16(t, pattern, dim), ref) and ref.dtype == torch.bfloat16
    # the reference's maths on its own: the three parts sum to t exactly, the first is t rounded
    parts = ops.split_bf16_reference(t, [0, 1, 2], 0).double().view(3, *t.shape)
    assert torch.equal(parts.sum(0), t.double()) and torch.equal(parts[0], t.to(torch.bfloat16).double())


# ---------------------------------------------------------------------------------------------------------------
# dequant_linear: the op's bits, forward and input gradient (the dequantize references are the kernels' bits, the
# GEMMs the same torch calls)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["int8", "nf4", "fp8", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequant_linear(fmt, dtype):
    packed = _packed(fmt, 24, 128, seed=1)
    x = torch.randn(2, 5, 128, dtype=dtype, requires_grad=True)
    y, ref = ops.dequant_linear(x, packed, fmt), ops.dequant_linear_reference(x, packed, fmt)
    assert torch.equal(y, ref)
    dy = torch.randn_like(ref)
    assert torch.equal(_grads(y, x, dy)[0], _grads(ref, x, dy)[0])


# ---------------------------------------------------------------------------------------------------------------
# lora_add: PEFT's graph, whose bits the op keeps (a power-of-two scaling folded into B commutes with every rounding)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("x_dtype,adapter_dtype,scaling,autocast", [
    (torch.bfloat16, torch.float32, 2.0, False),   # PEFT's default: bf16 model, float32 adapters
    (torch.bfloat16, torch.bfloat16, 0.7, False),  # a scaling that is not a power of two
    (torch.float16, torch.float32, 1.5, False),
    (torch.float32, torch.float32, 0.25, False),
    (torch.float32, torch.float32, 2.0, True),     # under bf16 autocast: both matmuls in bf16
])
def test_lora_add(x_dtype, adapter_dtype, scaling, autocast):
    torch.manual_seed(2)
    x = torch.randn(3, 4, 32, dtype=x_dtype, requires_grad=True)
    a = (torch.randn(8, 32) * 0.2).to(adapter_dtype).requires_grad_()
    b = (torch.randn(16, 8) * 0.2).to(adapter_dtype).requires_grad_()
    result = torch.randn(3, 4, 16, dtype=x_dtype, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = ops.lora_add(result, x, a, b, scaling)
        ref = ops.lora_add_reference(result, x, a, b, scaling)
    assert torch.equal(out, ref) and out.dtype == result.dtype
    dy = torch.randn_like(ref)
    for got, want in zip(_grads(out, (result, x, a, b), dy), _grads(ref, (result, x, a, b), dy)):
        assert got.dtype == want.dtype and torch.equal(got, want)


# ---------------------------------------------------------------------------------------------------------------
# lora_dequant_linear: the maths within TWO_ULPS of the compute dtype. Forward: the adapter's float32 term is summed
# in another order (the bf16 split keeps the terms above 2^-24), which can move the one rounding of y. Gradients: the
# op rounds g B and g^T (x A^T) before scaling and the input gradient once, the reference's autograd scales in float32
# and rounds the base's and the adapter's input-gradient terms before adding them: up to two roundings apart.
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["int8", "nf4", "fp8", "nvfp4"])
@pytest.mark.parametrize("x_dtype,adapter_dtype,autocast", [
    (torch.bfloat16, torch.float32, False),   # the split regime: float32 adapters over bf16 x, nothing widened
    (torch.bfloat16, torch.bfloat16, False),
    (torch.float16, torch.float16, False),
    (torch.float32, torch.float32, False),
    (torch.float32, torch.float32, True),     # bf16 autocast: weight, x and adapters in bf16
])
def test_lora_dequant_linear(fmt, x_dtype, adapter_dtype, autocast):
    packed = _packed(fmt, 32, 64, seed=3)
    torch.manual_seed(4)
    x = torch.randn(2, 5, 64, dtype=x_dtype, requires_grad=True)
    a = (torch.randn(4, 64) * 0.3).to(adapter_dtype).requires_grad_()
    b = (torch.randn(32, 4) * 0.3).to(adapter_dtype).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = ops.lora_dequant_linear(x, packed, fmt, a, b, 1.5)
        ref = ops.lora_dequant_linear_reference(x, packed, fmt, a, b, 1.5)
    assert y.dtype == ref.dtype and rel_err(y, ref) <= TWO_ULPS[ref.dtype]
    dy = torch.randn_like(ref)
    for got, want in zip(_grads(y, (x, a, b), dy), _grads(ref, (x, a, b), dy)):
        # under autocast the float32 leaves' gradients come from bf16 products: bf16's bound
        assert got.dtype == want.dtype and rel_err(got, want) <= TWO_ULPS[ref.dtype if autocast else want.dtype]


# ---------------------------------------------------------------------------------------------------------------
# rms_norm and its kernels: the rounding points of transformers' LlamaRMSNorm, the row sums reduced in another order
# (and 1 / sqrt for rsqrt): a few float32 ulps in rstd, which can move a rounding to x's dtype by one ulp (two for
# float16's weight gradient, a sum over the rows) -- tests/test_norm.py's bound.
# ---------------------------------------------------------------------------------------------------------------

RMS_TOL = {torch.float32: 1e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -9}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 7, 256), (1, 1, 64)])
def test_rms_norm(dtype, shape):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(5)
    x = (torch.randn(*shape) * 3).to(dtype).requires_grad_()
    w = torch.randn(shape[-1]).mul_(0.2).add_(1.0).to(dtype).requires_grad_()
    y, ref = ops.rms_norm(x, w, 1e-6), ops.rms_norm_reference(x, w, 1e-6)
    dy = torch.randn_like(ref)
    assert rel_err(y, ref) <= RMS_TOL[dtype]
    ref_grads = _grads(ref, (x, w), dy)
    for got, want in zip(_grads(y, (x, w), dy), ref_grads):
        assert rel_err(got, want) <= RMS_TOL[dtype]
    # the reference is the module, op for op
    m = LlamaRMSNorm(shape[-1], eps=1e-6).to(dtype)
    with torch.no_grad():
        m.weight.copy_(w)
    ym = m(x)
    assert torch.equal(ym, ref)
    assert all(torch.equal(p, q) for p, q in zip(_grads(ym, (x, m.weight), dy), ref_grads))
    # the two kernels under the op's node
    x2d, w0, dy2d = x.detach().reshape(-1, shape[-1]), w.detach(), dy.reshape(-1, shape[-1])
    yk, rstd = torch.ops.trainstream.rms_norm_fwd(x2d, w0, 1e-6)
    yr, rstd_r = ops.rms_norm_fwd_reference(x2d, w0, 1e-6)
    assert torch.equal(yr, ref.detach().view_as(yr)) and rel_err(rstd, rstd_r) <= 1e-6
    assert rel_err(yk, yr) <= RMS_TOL[dtype]
    dxk = torch.ops.trainstream.rms_norm_bwd(dy2d, x2d, w0, rstd)
    assert rel_err(dxk, ops.rms_norm_bwd_reference(dy2d, x2d, w0, rstd)) <= RMS_TOL[dtype]


# ---------------------------------------------------------------------------------------------------------------
# The FP8 path: the row-wise scaled GEMM, the layer (straight-through backward), its input gradient. The kernels
# accumulate the same exact E4M3 products in float32 in another order and may apply the scales in another order:
# within ULP of the output dtype (on the CPU torch._scaled_mm gives the reference's bits for these shapes, but no
# order is promised).
# ---------------------------------------------------------------------------------------------------------------

def _fp8_operands(dtype, seed):
    torch.manual_seed(seed)
    w, w_scale = ops.quantize_fp8_reference(torch.randn(32, 64))
    x = torch.randn(2, 8, 64, dtype=dtype)
    x[..., 5] *= 30  # an outlier channel
    return x, w, w_scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_gemm_rowwise_reference(dtype):
    """No CPU kernel: the reference against torch._scaled_mm on the CPU (row-wise scales from torch 2.13) and against
    float64 from the decoded operands, both within one rounding of the output dtype."""
    assert not ops.has_kernel("fp8_gemm_rowwise", "cpu")
    x, w, w_scale = _fp8_operands(dtype, 6)
    a, sa = ops.quantize_rows_e4m3_reference(x.reshape(-1, 64))
    ref = ops.fp8_gemm_rowwise_reference(a, w, sa, w_scale, dtype)
    assert ref.shape == (16, 32) and ref.dtype == dtype
    exact = (a.double() @ w.double().t()) * sa.double() * w_scale.double()[None, :]
    assert rel_err(ref, exact.to(dtype)) <= ULP[dtype]
    try:
        mm = torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=w_scale.view(1, -1), out_dtype=dtype)
    except RuntimeError as e:  # torch before 2.13: CPU _scaled_mm takes per-tensor scales only
        assert "scale" in str(e).lower()
    else:
        assert rel_err(mm, ref) <= ULP[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("outliers", [0, 3])
@pytest.mark.parametrize("with_w_t", [False, True])
def test_fp8_linear_and_dgrad(rowwise_scaled_mm, dtype, outliers, with_w_t):
    x, w, w_scale = _fp8_operands(dtype, 7)
    x.requires_grad_()
    w_t = ops.transpose_bytes_reference(w) if with_w_t else None
    y = ops.fp8_linear(x, w, w_scale, False, w_t, outliers)
    ref = ops.fp8_linear_reference(x, w, w_scale, False, w_t, outliers)
    assert y.shape == ref.shape and y.dtype == ref.dtype and rel_err(y, ref) <= ULP[dtype]
    dy = torch.randn_like(ref)
    dx, dx_ref = _grads(y, x, dy)[0], _grads(ref, x, dy)[0]
    assert dx.dtype == dx_ref.dtype and rel_err(dx, dx_ref) <= ULP[dtype]
    dy2d = dy.reshape(-1, 32)
    assert torch.equal(dx_ref.reshape(-1, 64), ops.fp8_linear_dgrad_reference(dy2d, w, w_scale, w_t))
    assert rel_err(ops.fp8_linear_dgrad(dy2d, w, w_scale, w_t), dx_ref.reshape(-1, 64)) <= ULP[dtype]
    # the straight-through estimator: dx is dy W_hat with dy rounded to E4M3 per row (2^-4 relative per element at
    # most, a few percent of the largest)
    w_hat = w.double() * w_scale.double()[:, None]
    assert rel_err(dx_ref.reshape(-1, 64), dy2d.double() @ w_hat) <= 0.1
