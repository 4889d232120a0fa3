"""The FP8 layer's speed work on CUDA (branch fp8-speed): QuantLinear's kept transposed FP8 codes (the backward takes
them instead of transposing the weight per call) and the GEMM setting (cuBLASLt by default on sm_90, read once).

Exactness is tested as exactness: the kept copy gives the same bits as the per-call transpose.
"""
import pytest
import torch

from trainstream_hf import ops
from trainstream_hf.quant import QuantLinear, matmul, quantize

requires_fp8 = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
    reason="requires sm_89+ (FP8 tensor cores)")


def _weight(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w.view(-1)[:: 97] *= 30.0  # outlier weights
    return w


def _layer(n, k, seed, **kw):
    layer = QuantLinear(quantize(_weight(n, k, seed), "fp8"), **kw).cuda()
    assert layer.matmul_path() is matmul.FP8_W8A8_SCALED_MM
    return layer


def _tokens(t, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g)
    x[:, torch.randperm(k, generator=g)[: max(1, k // 100)]] *= 50.0  # outlier channels
    x[1] = 0.0
    return x.to(torch.bfloat16).cuda()


def _transposes(fn):
    """fn's result and the number of trainstream::transpose_bytes calls it made, on any thread (the autograd
    engine's device thread runs the C++ backward)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
        torch.cuda.synchronize()
    return out, sum(e.count for e in prof.key_averages() if e.key == "trainstream::transpose_bytes")


def _grad(layer, x, dy):
    x = x.detach().requires_grad_()
    y = layer(x)
    (dx,) = torch.autograd.grad(y, x, dy)
    return y, dx


@pytest.fixture
def gemm_setting():
    """Gives the GEMM setting back as it was."""
    before = ops.set_fp8_gemm(None)
    ops.set_fp8_gemm(before)
    yield
    ops.set_fp8_gemm(before)


# ---------------------------------------------------------------------------------------------------------------
# The kept transposed FP8 codes
# ---------------------------------------------------------------------------------------------------------------

@requires_fp8
@pytest.mark.parametrize("gemm", ["torch", "cublaslt"])
def test_transpose_cache_same_bits_and_no_transpose(gemm, gemm_setting):
    if gemm == "cublaslt" and not ops.has_kernel("fp8_gemm_rowwise", "cuda"):
        pytest.skip("this build has no cuBLASLt GEMM")
    ops.set_fp8_gemm(gemm)
    cached, plain = _layer(1024, 4096, 1), _layer(1024, 4096, 1, fp8_transpose_cache=False)
    x, dy = _tokens(512, 4096, 2).view(2, 256, 4096), _tokens(512, 1024, 3).view(2, 256, 1024)
    (y0, dx0), n = _transposes(lambda: _grad(plain, x, dy))
    assert n == 1  # per backward call, in C++
    (y1, dx1), n = _transposes(lambda: _grad(cached, x, dy))
    assert n == 1 and cached._fp8_wt is not None  # made once, in the forward
    (y2, dx2), n = _transposes(lambda: _grad(cached, x, dy))
    assert n == 0
    assert torch.equal(y1, y0) and torch.equal(dx1, dx0) and torch.equal(y2, y0) and torch.equal(dx2, dx0)


@requires_fp8
def test_transpose_cache_memory_is_one_byte_per_weight_element():
    n, k = 1024, 4096
    cached, plain = _layer(n, k, 4), _layer(n, k, 4, fp8_transpose_cache=False)
    x, dy = _tokens(256, k, 5), _tokens(256, n, 6)
    _grad(plain, x, dy)  # warm-up: the unit scales for this K, cuBLAS workspaces
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    _grad(plain, x, dy)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before  # the per-call copy went with the call
    _grad(cached, x, dy)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before == n * k  # the kept copy (a multiple of the allocator's 512 B)
    cached.fp8_transpose_cache = False
    _grad(cached, x, dy)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


@requires_fp8
def test_transpose_cache_made_again_after_an_in_place_write():
    layer = _layer(512, 1024, 7)
    x, dy = _tokens(64, 1024, 8), _tokens(64, 512, 9)
    _grad(layer, x, dy)
    other = _layer(512, 1024, 10)
    with torch.no_grad():
        layer.weight_data.copy_(other.weight_data)
        layer.weight_scale.copy_(other.weight_scale)
    (_, dx), n = _transposes(lambda: _grad(layer, x, dy))
    assert n == 1
    assert torch.equal(dx, _grad(_layer(512, 1024, 10, fp8_transpose_cache=False), x, dy)[1])


@requires_fp8
def test_transpose_cache_under_cuda_graph_capture():
    """A layer whose copy exists replays it from the graph; a layer first called inside a capture makes none (it
    would live in the graph's pool) and transposes inside the graph. Replays give the eager bits."""
    warm, cold = _layer(1024, 2048, 11), _layer(1024, 2048, 11)
    x = _tokens(256, 2048, 12).requires_grad_()
    dy = _tokens(256, 1024, 13)

    def step(layer):
        return torch.autograd.grad(layer(x), x, dy)[0]

    want = step(_layer(1024, 2048, 11, fp8_transpose_cache=False))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(warm)
    torch.cuda.current_stream().wait_stream(side)
    kept = warm._fp8_wt[2]
    graphs, outs = [], []
    for layer in (warm, cold):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs.append(step(layer))
        graphs.append(g)
    assert warm._fp8_wt[2] is kept and cold._fp8_wt is None
    for g, out in zip(graphs, outs):
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


# ---------------------------------------------------------------------------------------------------------------
# The GEMM setting
# ---------------------------------------------------------------------------------------------------------------

@requires_fp8
def test_auto_takes_cublaslt_on_sm90_where_built(gemm_setting):
    ops.set_fp8_gemm("auto")
    built = ops.has_kernel("fp8_gemm_rowwise", "cuda")
    want = "cublaslt" if built and torch.cuda.get_device_capability()[0] == 9 else "torch"
    assert ops.fp8_gemm("cuda") == want
    print(f"auto on {torch.cuda.get_device_name()}: {want} (cuBLASLt GEMM built: {built})")
    layer = _layer(1024, 4096, 14)
    x, dy = _tokens(256, 4096, 15), _tokens(256, 1024, 16)
    y_auto, dx_auto = _grad(layer, x, dy)
    ops.set_fp8_gemm(want)  # the explicit choice gives the same bits (the same GEMM, the same plan)
    y, dx = _grad(layer, x, dy)
    assert torch.equal(y, y_auto) and torch.equal(dx, dx_auto)
