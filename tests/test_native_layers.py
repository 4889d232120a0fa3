"""QuantLinear's autograd nodes in C++: the weight-only layer (csrc/autograd/dequant_linear.cpp, ops.dequant_linear,
every format) and the FP8 tensor-core layer (csrc/autograd/fp8_linear.cpp, ops.fp8_linear / fp8_linear_dgrad).

The weight-only node must give the bits of the Python autograd Function it replaces (same ops), forward and input
gradient, with its packed weight passing through saved-tensor hooks. For the FP8 node: on the CPU, torch._scaled_mm
runs too (float8 inputs, row-wise scales, torch 2.13), so the node is exercised here with the ``fp8_w8a8_scaled_mm``
path forced onto a CPU layer: its forward and input gradient must be the bits of the same maths written out op by
op, its saved tensors must pass through saved-tensor hooks (the engine's pager), and bad operands must raise clear
errors. tests/gpu/test_quant_fp8_cuda.py checks the path on CUDA.
"""
import pytest
import torch

from trainstream_hf import ops
from trainstream_hf.quant import QuantLinear, matmul, quantize


def _layer(n=32, k=64, seed=0, bias=False):
    torch.manual_seed(seed)
    w = torch.randn(n, k, dtype=torch.bfloat16)
    b = torch.randn(n, dtype=torch.bfloat16) if bias else None
    layer = QuantLinear(quantize(w, "fp8"), b, act_quant=True)
    layer._paths[(torch.device("cpu"), True)] = matmul.FP8_W8A8_SCALED_MM  # the CUDA sm_89+ path, forced
    return layer


def _reference(x2d, dy2d, q):
    """The path's maths op by op: forward y = x_q W_q^T scaled; dx = e4m3(dy * s_w) W_q with unit scale_b."""
    data, scale = q.tensors["data"], q.tensors["scale"]
    xq, sx = ops.quantize_rows_e4m3(x2d)
    y = torch._scaled_mm(xq, data.t(), scale_a=sx, scale_b=scale.view(1, -1), out_dtype=x2d.dtype)
    gq, sg = ops.quantize_rows_e4m3(dy2d, scale)
    w_col = data.view(torch.uint8).t().contiguous().view(data.dtype).t()  # column-major (N, K)
    dx = torch._scaled_mm(gq, w_col, scale_a=sg, scale_b=torch.ones(1, data.shape[1]), out_dtype=dy2d.dtype)
    return y, dx


@pytest.mark.parametrize("bias", [False, True])
def test_fused_layer_matches_the_maths_bit_for_bit(rowwise_scaled_mm, bias):
    layer = _layer(bias=bias)
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref, dx_ref = _reference(x.detach().reshape(-1, 64), dy.reshape(-1, 32), layer.weight)
    if bias:
        y_ref = y_ref + layer.bias
    assert torch.equal(y.detach().reshape(-1, 32), y_ref)
    assert torch.equal(x.grad.reshape(-1, 64), dx_ref)
    assert layer.weight_data.grad is None and layer.weight_scale.grad is None


def test_fused_layer_is_the_route_taken_and_matches_the_python_route(rowwise_scaled_mm, graph_names):
    """Without outliers the layer goes through ops.fp8_linear; the Python autograd Function (the outlier route's)
    gives the same bits."""
    layer = _layer(seed=1)
    x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    assert any("Fp8LinearFunction" in n for n in graph_names(y))  # the C++ node, under y's view
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    from trainstream_hf.quant.linear import _QuantLinearFunction
    y2 = _QuantLinearFunction.apply(x, matmul.FP8_W8A8_SCALED_MM, layer.fmt, (32, 64), layer.weight_dtype, 0, None,
                                    layer.weight_data, layer.weight_scale)
    assert y2.grad_fn.name() == "_QuantLinearFunctionBackward"
    (dx2,) = torch.autograd.grad(y2, x, dy)
    assert torch.equal(y, y2) and torch.equal(dx, dx2)


def test_saved_weights_pass_through_saved_tensor_hooks(rowwise_scaled_mm):
    layer = _layer(seed=2)
    x = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    packed, unpacked = [], []

    def pack(t):
        packed.append(t)
        return ("ref", t)

    def unpack(ref):
        unpacked.append(ref[1])
        return ref[1]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        y = layer(x)
    assert [t.data_ptr() for t in packed] == [layer.weight_data.data_ptr(), layer.weight_scale.data_ptr()]
    y.sum().backward()
    assert len(unpacked) == 2 and x.grad is not None


def test_input_without_grad_and_no_grad_mode(rowwise_scaled_mm):
    layer = _layer(seed=3)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    y = layer(x)
    assert not y.requires_grad
    with torch.no_grad():
        assert torch.equal(layer(x.requires_grad_()), y)


def test_bad_operands_raise_clear_errors():
    q = quantize(torch.randn(32, 64), "fp8")
    data, scale = q.tensors["data"], q.tensors["scale"]
    dy = torch.randn(4, 32, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        ops.fp8_linear_dgrad(dy, data.view(torch.uint8), scale)
    with pytest.raises(ValueError, match="one scale per row"):
        ops.fp8_linear_dgrad(dy, data, scale[:5])
    with pytest.raises(ValueError, match="dy must be"):
        ops.fp8_linear_dgrad(dy[:, :16], data, scale)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"x must be \(\.\.\., 64\)"):
        ops.fp8_linear(x[:, :32], data, scale)
    with pytest.raises(TypeError, match="x must be bfloat16 or float16, got Float"):
        ops.fp8_linear(x.float(), data, scale)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        ops.fp8_linear(x, data.view(torch.uint8), scale)


# ---------------------------------------------------------------------------------------------------------------
# The weight-only node (all formats)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["int8", "nf4", "fp8", "nvfp4"])
def test_dequant_node_matches_the_python_function(fmt, dtype, graph_names):
    from trainstream_hf.quant.linear import _QuantLinearFunction
    torch.manual_seed(4)
    layer = QuantLinear(quantize(torch.randn(48, 128), fmt), torch.randn(48), act_quant=False)
    assert layer.matmul_path().name == "dequant"
    x = torch.randn(2, 5, 128, dtype=dtype, requires_grad=True)
    y = layer(x)
    assert any("DequantLinearFunction" in n for n in graph_names(y))  # the C++ node (under the view, bias add)
    assert not any("_QuantLinearFunction" in n for n in graph_names(y))
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    y2 = _QuantLinearFunction.apply(x, matmul.DEQUANT, layer.fmt, (48, 128), layer.weight_dtype, 0, None,
                                    *[getattr(layer, "weight_" + n) for n in layer.fmt.tensor_names])
    y2 = y2 + layer.bias.to(y2.dtype)
    (dx2,) = torch.autograd.grad(y2, x, dy)
    assert torch.equal(y, y2) and torch.equal(dx, dx2)


def test_dequant_node_saves_the_packed_weight_through_hooks():
    layer = QuantLinear(quantize(torch.randn(32, 64), "nf4"))
    x = torch.randn(3, 64, requires_grad=True)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (packed.append(t), t)[1], lambda t: t):
        y = layer(x)
    names = layer.fmt.tensor_names
    assert [t.data_ptr() for t in packed] == [getattr(layer, "weight_" + n).data_ptr() for n in names]
    y.sum().backward()
    assert x.grad.shape == x.shape and all(getattr(layer, "weight_" + n).grad is None for n in names)


def test_dequant_node_bad_input():
    q = quantize(torch.randn(32, 64), "int8")
    packed = [q.tensors[n] for n in q.fmt.tensor_names]
    with pytest.raises(ValueError, match="unknown format"):
        ops.dequant_linear(torch.randn(2, 64), packed, "int4")
    with pytest.raises(ValueError, match="takes 4 packed tensors"):
        ops.dequant_linear(torch.randn(2, 64), packed, "nf4")
    with pytest.raises(ValueError, match=r"x must be \(\.\.\., 64\)"):
        ops.dequant_linear(torch.randn(2, 32), packed, "int8")
    with pytest.raises(ValueError, match="got a scalar"):
        ops.dequant_linear(torch.randn(()), packed, "int8")


def test_dequant_node_takes_any_leading_dimensions_without_view_nodes(graph_names):
    """(..., K) in, (..., N) out, the reshapes inside the node: the output's grad_fn is the C++ node itself (no
    ViewBackward on either side), and the numbers are those of the 2-D call."""
    layer = QuantLinear(quantize(torch.randn(32, 64), "nf4"), act_quant=False)
    x = torch.randn(2, 3, 64, requires_grad=True)
    y = layer(x)
    assert y.shape == (2, 3, 32) and "DequantLinearFunction" in y.grad_fn.name()
    assert all("View" not in n for n in graph_names(y))
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    x2 = x.detach().reshape(6, 64).requires_grad_()
    y2 = layer(x2)
    (dx2,) = torch.autograd.grad(y2, x2, dy.reshape(6, 32))
    assert torch.equal(y.detach().reshape(6, 32), y2) and torch.equal(dx.reshape(6, 64), dx2)
    # a single token (1-D) too; a one-row GEMM may round differently from a six-row one (another kernel path)
    torch.testing.assert_close(layer(x.detach()[0, 0]), y2[0].detach(), rtol=1e-5, atol=1e-5)


def test_fp8_gemm_rowwise_is_cuda_only_and_traceable():
    """The cuBLASLt GEMM has a CUDA kernel only (tests/gpu checks its numbers); its fake kernel gives shapes to meta
    tensors and torch.compile."""
    a = torch.empty(6, 32, dtype=torch.float8_e4m3fn, device="meta")
    b = torch.empty(48, 32, dtype=torch.float8_e4m3fn, device="meta")
    out = ops.fp8_gemm_rowwise(a, b, torch.empty(6, device="meta"), torch.empty(48, device="meta"), torch.float16)
    assert out.shape == (6, 48) and out.dtype == torch.float16
    with pytest.raises(NotImplementedError, match="CPU"):
        ops.fp8_gemm_rowwise(torch.zeros(6, 32, dtype=torch.float8_e4m3fn),
                             torch.zeros(48, 32, dtype=torch.float8_e4m3fn), torch.ones(6), torch.ones(48))


# ---------------------------------------------------------------------------------------------------------------
# The FP8 layer's GEMM setting (TRAINSTREAM_FP8_GEMM, read once; ops.set_fp8_gemm)
# ---------------------------------------------------------------------------------------------------------------


def test_fp8_gemm_setting_is_read_once_and_set_at_run_time(monkeypatch, gemm_setting):
    monkeypatch.setenv("TRAINSTREAM_FP8_GEMM", " CUBLASLT ")
    ops.set_fp8_gemm(None)  # read the variable again
    assert ops.fp8_gemm() == "cublaslt"
    monkeypatch.setenv("TRAINSTREAM_FP8_GEMM", "torch")
    assert ops.fp8_gemm() == "cublaslt"  # not read per call
    assert ops.set_fp8_gemm(None) == "cublaslt" and ops.fp8_gemm() == "torch"
    monkeypatch.delenv("TRAINSTREAM_FP8_GEMM")
    ops.set_fp8_gemm(None)
    assert ops.fp8_gemm() == "auto"  # the default
    assert ops.set_fp8_gemm("torch") == "auto" and ops.fp8_gemm() == "torch"
    assert ops.fp8_gemm("cpu") == "torch"  # the CPU has torch._scaled_mm only
    for choice in ops.FP8_GEMMS:
        ops.set_fp8_gemm(choice)
        assert ops.fp8_gemm() == choice and ops.fp8_gemm("cpu") == "torch"
    if not ops.built_with_cuda():
        ops.set_fp8_gemm("auto")
        assert ops.fp8_gemm("cuda:0") == "torch"  # no cuBLASLt GEMM in a CPU build: auto takes torch


def test_fp8_gemm_setting_refuses_unknown_values(monkeypatch, gemm_setting):
    with pytest.raises(ValueError, match="expected auto, cublaslt or torch"):
        ops.set_fp8_gemm("cutlass")
    ops.set_fp8_gemm("torch")
    monkeypatch.setenv("TRAINSTREAM_FP8_GEMM", "cublas")
    with pytest.raises(ValueError, match="TRAINSTREAM_FP8_GEMM='cublas': expected auto, cublaslt or torch"):
        ops.set_fp8_gemm(None)
    assert ops.fp8_gemm() == "torch"  # left as it was


def test_fp8_layer_runs_under_every_gemm_setting_on_the_cpu(rowwise_scaled_mm, gemm_setting):
    """The CPU takes torch._scaled_mm whatever the setting: the same bits."""
    layer = _layer(seed=5)
    x = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    outs = []
    for choice in ops.FP8_GEMMS:
        ops.set_fp8_gemm(choice)
        y = layer(x)
        outs.append((y, torch.autograd.grad(y.sum(), x)[0]))
    assert all(torch.equal(a, outs[0][0]) and torch.equal(b, outs[0][1]) for a, b in outs)


def test_fp8_gemm_plans_empty_without_the_cublaslt_gemm():
    """The cuBLASLt GEMM's plan table (tests/gpu/test_fp8_speed_cuda.py fills and prints it): rows only where the
    build has the GEMM, none in a CPU build."""
    plans = ops.fp8_gemm_plans()
    assert isinstance(plans, list)
    if not ops.built_with_cuda():
        assert plans == [] and ops.fp8_gemm_plans(clear=True) == []
