"""The FP8 layer's speed work on CUDA (branch fp8-speed): QuantLinear's kept transposed FP8 codes (the backward takes
them instead of transposing the weight per call), the GEMM setting (cuBLASLt by default on sm_90, read once), and the
cuBLASLt GEMM's algorithm timed once per shape (csrc/cuda/fp8_gemm.cu).

Exactness is tested as exactness: the kept copy gives the same bits as the per-call transpose; a shape's algorithm is
fixed for the process, so repeated calls, and a CUDA graph's replay against eager calls, give the same bits.
``pytest -s`` prints the plans the GEMM chose (algorithm index, candidates, the kept and the heuristic's first time).
"""
import pytest
import torch

from trainstream_hf import ops
from trainstream_hf.quant import QuantLinear, matmul, quantize
from tests.helpers import outlier_channel_tokens, strided_outlier_weight

requires_fp8 = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
    reason="requires sm_89+ (FP8 tensor cores)")


def _layer(n, k, seed, **kw):
    layer = QuantLinear(quantize(strided_outlier_weight(n, k, seed), "fp8"), **kw).cuda()
    assert layer.matmul_path() is matmul.FP8_W8A8_SCALED_MM
    return layer


def _tokens(t, k, seed):
    return outlier_channel_tokens((t, k), seed, torch.bfloat16).cuda()


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


# ---------------------------------------------------------------------------------------------------------------
# The cuBLASLt GEMM's algorithm, timed once per shape
# ---------------------------------------------------------------------------------------------------------------

def _operands(m, n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = (torch.randn(m, k, device="cuda", generator=g) * 4).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, device="cuda", generator=g) * 4).to(torch.float8_e4m3fn)
    return a, b, torch.rand(m, device="cuda", generator=g) + 0.5, torch.rand(n, device="cuda", generator=g) + 0.5


def _plan(m, n, k, dtype="BFloat16"):
    rows = [p for p in ops.fp8_gemm_plans() if (p["m"], p["n"], p["k"], p["out_dtype"]) == (m, n, k, dtype)]
    assert len(rows) == 1, rows  # one alignment class per shape here (fresh allocations)
    return rows[0]


def _needs_cublaslt():
    if not ops.has_kernel("fp8_gemm_rowwise", "cuda"):
        pytest.skip("this build has no cuBLASLt GEMM")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("row-wise FP8 cuBLASLt is used on sm_90")


@requires_fp8
@pytest.mark.parametrize("m, n, k", [(2048, 4096, 4096), (2048, 1024, 4096), (2048, 14336, 4096),
                                     (2048, 4096, 14336), (2048, 4096, 1024)])
def test_gemm_tuned_once_per_shape_and_deterministic(m, n, k):
    """The first call times the heuristic's candidates and keeps the fastest (printed); every later call gives the
    same bits; the result is torch._scaled_mm's within a rounding."""
    _needs_cublaslt()
    a, b, sa, sb = _operands(m, n, k, m + n + k)
    first = ops.fp8_gemm_rowwise(a, b, sa, sb, torch.bfloat16)
    plan = _plan(m, n, k)
    print(f"fp8_gemm_rowwise {m}x{n}x{k}: {plan}")
    assert 1 <= plan["candidates"] <= 8 and 0 <= plan["chosen"] < plan["candidates"]
    if plan["tuned"]:
        assert 0 <= plan["ms_chosen"] <= plan["ms_first"] or plan["ms_first"] < 0
    for _ in range(3):
        assert torch.equal(ops.fp8_gemm_rowwise(a, b, sa, sb, torch.bfloat16), first)
    assert _plan(m, n, k) == plan  # not chosen again
    want = torch._scaled_mm(a, b.t(), scale_a=sa.view(-1, 1), scale_b=sb.view(1, -1), out_dtype=torch.bfloat16)
    rel = float((first.double() - want.double()).abs().max() / want.double().abs().max())
    assert rel <= 2 ** -7 + 1e-4


@requires_fp8
def test_gemm_first_called_inside_a_capture_keeps_the_heuristic_choice():
    """A shape first seen while a graph is being captured is not timed (no sync in a capture): the heuristic's first
    algorithm is kept, and eager calls after the capture use it too, so the replay and eager calls agree bit for
    bit."""
    _needs_cublaslt()
    m, n, k = 1536, 2048, 3072  # a shape no other test uses
    a, b, sa, sb = _operands(m, n, k, 17)
    ops.fp8_gemm_rowwise(a[:16], b, sa[:16], sb, torch.bfloat16)  # warm-up of the handle on another shape
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ops.fp8_gemm_rowwise(a, b, sa, sb, torch.bfloat16)
    plan = _plan(m, n, k)
    assert not plan["tuned"] and plan["chosen"] == 0
    g.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    assert torch.equal(ops.fp8_gemm_rowwise(a, b, sa, sb, torch.bfloat16), replayed)
    assert _plan(m, n, k) == plan


@requires_fp8
def test_block_step_plans_are_printed(gemm_setting):
    """The Llama-3-8B block's 7 layers, forward + input gradients (bench quant's block_step), on the default GEMM:
    the plans chosen for its shapes, printed for the record (pytest -s)."""
    _needs_cublaslt()
    from trainstream_hf.bench.quant import block_inputs, block_linears, block_step, block_weights

    ops.set_fp8_gemm("auto")
    dev = torch.device("cuda")
    linears = block_linears("llama3-8b")
    layers = [QuantLinear(quantize(w, "fp8"), act_quant=True) for w in block_weights(linears, dev, 0)]
    xs, leaves, grads = block_inputs(linears, 2048, dev, 1)
    step = block_step(layers, xs, leaves, grads)
    first = step()
    for _ in range(2):
        assert all(torch.equal(a, b) for a, b in zip(step(), first))
    for p in ops.fp8_gemm_plans():
        if p["m"] == 2048:
            print(p)
    assert all(layer._fp8_wt is not None for layer in layers)
