"""QuantLinear's FP8 transpose cache (trainstream_hf/quant/linear.py; ops.fp8_linear / fp8_linear_dgrad's ``w_t``).

On the CPU, torch._scaled_mm runs with row-wise scales (torch 2.13), so the FP8 tensor-core path is forced onto CPU
layers and its C++ node runs for real, as in tests/test_native_layers.py. Checked: the kept copy is used (no
``transpose_bytes`` in the second backward), the input gradient is the same bits with and without it, it is made again
after the weight changes (in place, or its storage swapped), the off switch, no copy where no backward follows, the
outlier route (outliers > 0) passing the same copy to its backward, none
for paged weights (a real WeightPager), and the op-level argument's checks. tests/gpu/test_fp8_speed_cuda.py checks
the same on CUDA, with memory and CUDA-graph capture.
"""
import copy
import io

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from trainstream_hf import ops
from trainstream_hf.engine.weights import PAGED_ATTR
from trainstream_hf.quant import QuantLinear, matmul, quantize
from tests.helpers import strided_outlier_weight


class _Ops(TorchDispatchMode):
    """Counts the trainstream ops dispatched while active, those the C++ backward calls included."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "trainstream":
            self.calls.append(func.__name__.split(".")[0])
            if self.calls[-1] == "fp8_linear_dgrad":
                self.w_t = args[3] if len(args) > 3 else None
        return func(*args, **(kwargs or {}))

    def count(self, name):
        return self.calls.count(name)


def _layer(n=48, k=64, seed=0, **kw):
    layer = QuantLinear(quantize(strided_outlier_weight(n, k, seed, every=37), "fp8"), act_quant=True, **kw)
    layer._paths[(torch.device("cpu"), True)] = matmul.FP8_W8A8_SCALED_MM  # the CUDA sm_89+ path, forced
    return layer


def _x(t, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g)
    x[:, torch.randperm(k, generator=g)[:2]] *= 50.0  # outlier channels
    x[1] = 0.0  # an all-zero token
    return x.to(torch.bfloat16).view(2, t // 2, k)


def _step(layer, x, dy):
    """Forward and input gradient, with the trainstream ops dispatched in each."""
    x = x.detach().requires_grad_()
    with _Ops() as fwd:
        y = layer(x)
    with _Ops() as bwd:
        (dx,) = torch.autograd.grad(y, x, dy)
    return y, dx, fwd, bwd


@pytest.fixture(autouse=True)
def _rowwise(rowwise_scaled_mm):
    matmul.forget_activation()


def test_kept_copy_is_used_and_gives_the_same_bits():
    layer, plain = _layer(seed=1), _layer(seed=1, fp8_transpose_cache=False)
    x, dy = _x(16, 64, 2), torch.randn(2, 8, 48, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    y, dx, fwd, bwd = _step(layer, x, dy)
    assert fwd.count("transpose_bytes") == 1 and bwd.count("transpose_bytes") == 0  # made once, in the forward
    assert layer._fp8_wt is not None
    kept = layer._fp8_wt[2]
    assert kept.shape == (64, 48) and kept.dtype == torch.float8_e4m3fn
    assert torch.equal(kept.view(torch.uint8), layer.weight_data.view(torch.uint8).t())
    for _ in range(2):  # later steps: no transpose at all
        y2, dx2, fwd, bwd = _step(layer, x, dy)
        assert fwd.count("transpose_bytes") == 0 and bwd.count("transpose_bytes") == 0
        assert layer._fp8_wt[2] is kept and torch.equal(y2, y) and torch.equal(dx2, dx)
    # Without the cache: one transpose per backward, in C++; the same bits.
    y3, dx3, fwd, bwd = _step(plain, x, dy)
    assert fwd.count("transpose_bytes") == 0 and bwd.count("transpose_bytes") == 1
    assert plain._fp8_wt is None
    assert torch.equal(y3, y) and torch.equal(dx3, dx)
    # And the op itself, given the copy or not.
    w, s = layer.weight_data, layer.weight_scale
    assert torch.equal(ops.fp8_linear_dgrad(dy.view(16, 48), w, s, kept), ops.fp8_linear_dgrad(dy.view(16, 48), w, s))
    assert torch.equal(dx.view(16, 64), ops.fp8_linear_dgrad(dy.view(16, 48), w, s))


def test_outlier_route_is_the_native_node_and_takes_the_kept_copy(graph_names):
    """outliers > 0 runs in the C++ node (fp8_linear splits the outlier channels off itself: no Python Function); its
    backward takes the same kept copy: no transpose after the first forward, and the same bits as the per-call
    transpose."""
    layer, plain = _layer(seed=5, outliers=0.05), _layer(seed=5, outliers=0.05, fp8_transpose_cache=False)
    x, dy = _x(16, 64, 6), torch.randn(2, 8, 48, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    y, dx, fwd, bwd = _step(layer, x, dy)
    assert "Fp8LinearFunction" in y.grad_fn.name() and "QuantLinearFunction" not in " ".join(graph_names(y))
    assert fwd.count("quantize_rows_e4m3") == 1  # of x with its outlier channels zeroed, inside the node
    assert fwd.count("transpose_bytes") == 1 and bwd.count("transpose_bytes") == 0  # made once, in the forward
    kept = layer._fp8_wt[2]
    y2, dx2, fwd, bwd = _step(layer, x, dy)
    assert fwd.count("transpose_bytes") == 0 and bwd.count("transpose_bytes") == 0  # the kept copy, not a new one
    assert layer._fp8_wt[2] is kept and torch.equal(y2, y) and torch.equal(dx2, dx)
    y3, dx3, fwd, bwd = _step(plain, x, dy)
    assert plain._fp8_wt is None and bwd.count("transpose_bytes") == 1  # transposed per call, in C++
    assert torch.equal(y3, y) and torch.equal(dx3, dx)


@pytest.mark.parametrize("k", [1, 3, 64])
def test_fp8_linear_outliers_is_the_outlier_decomposition(k):
    """ops.fp8_linear(..., outliers=k): the k channels of largest max |x| (select_outliers) zeroed in the quantized
    operand, x[:, I] W_hat[:, I]^T (the columns in bf16) added by addmm_ -- bit for bit; within bf16 rounding of the
    Python route (outlier_matmul, float32 columns); the input gradient is the plain layer's (the split does not change
    it)."""
    from trainstream_hf.quant.outliers import dequantize_columns, outlier_matmul, select_outliers

    q = quantize(strided_outlier_weight(48, 64, 8, every=37), "fp8")
    w, s = q.tensors["data"], q.tensors["scale"]
    x = _x(16, 64, 9)
    x2d = x.reshape(-1, 64)
    y = ops.fp8_linear(x, w, s, False, None, k)
    idx = select_outliers(x2d, k)
    rest = ops.fp8_linear(x2d.index_fill(1, idx, 0), w, s, False)
    want = rest.addmm(x2d.index_select(1, idx), dequantize_columns(q, idx, torch.bfloat16).t())
    assert y.shape == (2, 8, 48) and torch.equal(y.view(-1, 48), want)
    python_route = outlier_matmul(x2d, q, k, matmul.FP8_W8A8_SCALED_MM.forward)
    assert float((y.view(-1, 48).float() - python_route).abs().max() / python_route.abs().max()) < 2 ** -7
    dy = torch.randn(2, 8, 48, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    xs = [x.detach().clone().requires_grad_() for _ in range(2)]
    (dx,) = torch.autograd.grad(ops.fp8_linear(xs[0], w, s, False, None, k), xs[0], dy)
    (dx0,) = torch.autograd.grad(ops.fp8_linear(xs[1], w, s, False), xs[1], dy)
    assert torch.equal(dx, dx0)


def test_fp8_linear_outliers_keeps_no_quantization_and_checks_the_count():
    q = quantize(strided_outlier_weight(48, 64, 8, every=37), "fp8")
    w, s = q.tensors["data"], q.tensors["scale"]
    x = _x(16, 64, 9)
    ops.fp8_linear(x, w, s, True)  # kept: this x's quantization
    before = ops.fp8_activation_cache()
    ops.fp8_linear(x, w, s, True, None, 2)  # the split quantizes a temporary: neither kept nor reused (a miss)
    after = ops.fp8_activation_cache()
    assert before["kept"] and after == dict(before, misses=before["misses"] + 1)
    ops.fp8_linear(x, w, s, True)  # the kept one is still x's
    assert ops.fp8_activation_cache() == dict(after, hits=after["hits"] + 1)
    for bad in (-1, 65):
        with pytest.raises(ValueError, match="outliers must be a channel count in \\[0, 64\\]"):
            ops.fp8_linear(x, w, s, True, None, bad)


def test_made_again_after_the_weight_changes_in_place():
    layer = _layer(seed=4)
    x, dy = _x(8, 64, 5), torch.randn(2, 4, 48, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    _step(layer, x, dy)
    old = layer._fp8_wt[2]
    other = quantize(strided_outlier_weight(48, 64, 7, every=37), "fp8")
    with torch.no_grad():  # load_state_dict writes the same way (copy_ into the parameter: a version bump)
        layer.weight_data.copy_(other.tensors["data"])
        layer.weight_scale.copy_(other.tensors["scale"])
    _, dx, fwd, bwd = _step(layer, x, dy)
    assert fwd.count("transpose_bytes") == 1 and bwd.count("transpose_bytes") == 0
    assert layer._fp8_wt[2] is not old
    fresh = _layer(seed=7, fp8_transpose_cache=False)
    assert torch.equal(fresh.weight_data.view(torch.uint8), layer.weight_data.view(torch.uint8))
    assert torch.equal(_step(fresh, x, dy)[1], dx)
    # The same through load_state_dict, back to the first weight.
    layer.load_state_dict(_layer(seed=4).state_dict())
    _, dx_back, fwd, _ = _step(layer, x, dy)
    assert fwd.count("transpose_bytes") == 1
    assert torch.equal(dx_back, _step(_layer(seed=4, fp8_transpose_cache=False), x, dy)[1])


def test_made_again_when_the_storage_is_swapped():
    """``weight_data.data = ...`` keeps the version counter but changes the storage; ``.to()`` drops the copy."""
    layer = _layer(seed=8)
    x, dy = _x(8, 64, 9), torch.randn(2, 4, 48, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    _step(layer, x, dy)
    other = _layer(seed=11)
    layer.weight_data.data = other.weight_data.detach().clone()
    layer.weight_scale.data = other.weight_scale.detach().clone()
    _, dx, fwd, _ = _step(layer, x, dy)
    assert fwd.count("transpose_bytes") == 1
    assert torch.equal(dx, _step(_layer(seed=11, fp8_transpose_cache=False), x, dy)[1])
    layer.to(torch.bfloat16)  # a cast: the packed tensors are moved (here: kept), the copy goes with _apply
    assert layer._fp8_wt is None


def test_off_switch_and_calls_without_a_backward():
    layer = _layer(seed=12)
    x, dy = _x(8, 64, 13), torch.randn(2, 4, 48, generator=torch.Generator().manual_seed(14)).to(torch.bfloat16)
    with torch.no_grad(), _Ops() as mode:
        layer(x)
    layer(x.detach())  # no input gradient: no backward from this call
    assert layer._fp8_wt is None and mode.count("transpose_bytes") == 0
    _step(layer, x, dy)
    assert layer._fp8_wt is not None
    layer(x.detach())  # a call without a backward keeps the copy for the next one that has one
    assert layer._fp8_wt is not None
    layer.fp8_transpose_cache = False
    _, _, fwd, bwd = _step(layer, x, dy)
    assert layer._fp8_wt is None  # switched off: freed at the next call
    assert fwd.count("transpose_bytes") == 0 and bwd.count("transpose_bytes") == 1
    assert "fp8_transpose_cache=False" in repr(layer)
    layer.fp8_transpose_cache = True
    _step(layer, x, dy)
    layer.clear_fp8_transpose_cache()
    assert layer._fp8_wt is None


def test_emulated_path_keeps_nothing():
    x, dy = _x(8, 64, 16), torch.randn(2, 4, 48, generator=torch.Generator().manual_seed(17)).to(torch.bfloat16)
    # the CPU's own path
    emulated = QuantLinear(quantize(strided_outlier_weight(48, 64, 18, every=37), "fp8"), act_quant=True)
    assert emulated.matmul_path() is matmul.FP8_W8A8_EMULATED
    _step(emulated, x, dy)
    assert emulated._fp8_wt is None


def test_copies_and_pickles_do_not_share_the_copy():
    layer = _layer(seed=19)
    x, dy = _x(8, 64, 20), torch.randn(2, 4, 48, generator=torch.Generator().manual_seed(21)).to(torch.bfloat16)
    dx = _step(layer, x, dy)[1]
    buf = io.BytesIO()
    torch.save(layer, buf)  # pickles the module (a weak reference in its state would fail here)
    buf.seek(0)
    for clone in (copy.deepcopy(layer), torch.load(buf, weights_only=False)):
        assert clone._fp8_wt is None and clone.fp8_transpose_cache and not clone._paths
        clone._paths[(torch.device("cpu"), True)] = matmul.FP8_W8A8_SCALED_MM  # forced again
        _, dx2, fwd, _ = _step(clone, x, dy)
        assert fwd.count("transpose_bytes") == 1 and torch.equal(dx2, dx)


def test_paged_weights_get_no_copy():
    """A real WeightPager (CPU compute device) over fp8 QuantLinears on the tensor-core path: it marks the parameters
    it pages, the layers keep no copy (a slot is transient), and the gradients are those of the unpaged model; after
    unwrap the mark is gone and the layers keep copies again."""
    from trainstream_hf.engine.arena import HostArena
    from trainstream_hf.engine.blocks import Blocks
    from trainstream_hf.engine.hooks import BlockHooks
    from trainstream_hf.engine.streams import TransferStreams
    from trainstream_hf.engine.weights import WeightPager

    class Block(nn.Module):
        def __init__(self, seed):
            super().__init__()
            self.a, self.b = _layer(64, 64, seed), _layer(64, 64, seed + 1)

        def forward(self, h):
            return h + self.b(torch.relu(self.a(h)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Block(30 + 2 * i) for i in range(3))

        def forward(self, h):
            for block in self.layers:
                h = block(h)
            return h

    ref, net = Net(), Net()
    x = _x(8, 64, 22)
    quant = [m for m in net.modules() if isinstance(m, QuantLinear)]

    def grad(model):
        xx = x.detach().requires_grad_()
        (dx,) = torch.autograd.grad(model(xx).float().square().sum(), xx)
        return dx

    want = grad(ref)
    hooks = BlockHooks(Blocks(net, "layers", tuple(net.layers)))
    pager = WeightPager(hooks, TransferStreams(torch.device("cpu")), HostArena(slab_bytes="1MiB"), slots=2,
                        prefetch=1)
    try:
        assert all(getattr(m.weight_data, PAGED_ATTR, False) for m in quant)
        with _Ops() as mode:
            for _ in range(2):
                assert torch.equal(grad(net), want)
        assert all(m._fp8_wt is None for m in quant)
        assert mode.count("transpose_bytes") == 2 * len(quant)  # one per backward call, in C++
    finally:
        pager.unwrap()
        hooks.remove()
    assert not any(hasattr(m.weight_data, PAGED_ATTR) for m in quant)
    assert torch.equal(grad(net), want)
    assert all(m._fp8_wt is not None for m in quant)


def test_w_t_argument_checks():
    layer = _layer(seed=23)
    w, s = layer.weight_data, layer.weight_scale
    dy = torch.randn(4, 48).to(torch.bfloat16)
    x = torch.randn(4, 64).to(torch.bfloat16)
    w_t = ops.transpose_bytes(w)
    with pytest.raises(ValueError, match=r"w_t must be w transposed, \(64, 48\)"):
        ops.fp8_linear_dgrad(dy, w, s, w)
    with pytest.raises(TypeError, match="w_t must be float8_e4m3fn"):
        ops.fp8_linear_dgrad(dy, w, s, w_t.view(torch.uint8))
    with pytest.raises(ValueError, match=r"w_t must be w transposed"):
        ops.fp8_linear(x, w, s, True, w_t[:32])  # at the forward, not at the backward
    # A non-contiguous (K, N) view of the right values is copied, not misread.
    view = w.t()
    assert torch.equal(ops.fp8_linear_dgrad(dy, w, s, view), ops.fp8_linear_dgrad(dy, w, s, w_t))
    # Shapes for meta tensors and torch.compile.
    meta = ops.fp8_linear_dgrad(dy.to("meta"), w.to("meta"), s.to("meta"), w_t.to("meta"))
    assert meta.shape == (4, 64)


def test_cache_bytes_counted_by_the_planner_for_resident_blocks_only():
    from trainstream_hf.planner import BlockPlan, Plan, _kept_bytes

    layer = _layer(48, 64, 24)  # the tensor-core path, forced on the CPU
    assert layer.fp8_transpose_cache_bytes() == 48 * 64
    assert _kept_bytes(nn.Sequential(layer, _layer(32, 64, 25)), torch.device("cpu")) == (48 + 32) * 64
    fp8 = QuantLinear(quantize(strided_outlier_weight(48, 64, 26, every=37), "fp8"), act_quant=True)
    assert fp8.fp8_transpose_cache_bytes() == 0
    assert QuantLinear(quantize(strided_outlier_weight(48, 64, 27, every=37), "nf4")).fp8_transpose_cache_bytes() == 0
    layer.fp8_transpose_cache = False
    assert layer.fp8_transpose_cache_bytes() == 0
    blocks = [BlockPlan(i, weight_bytes=1000, trainable_numel=0, activation_bytes=0, kept_bytes=500) for i in range(3)]
    pl = Plan(budget=1 << 30, blocks=blocks, slots=2)
    assert pl.predicted_peak() == 3 * 1500
    blocks[0].weights = blocks[1].weights = "host"  # paged: weights in the slots, no kept copy
    assert pl.predicted_peak() == 1500 + 2 * 1000


@pytest.mark.parametrize("through", ["ops", "op_with_grad"])
def test_a_compiled_graph_never_reuses_a_quantization(through):
    """Inductor writes a freed buffer's next contents into the same tensor object without a version bump (``buf4 =
    buf0; del buf0  # reuse``): a kept quantization would be taken for the new contents. Under torch.compile nothing
    is kept or reused, whether the call comes through ops.fp8_linear (no autograd: the Python wrapper turns reuse off)
    or the op itself with reuse asked for and a gradient to trace (its C++ autograd node turns it off)."""
    q = quantize(strided_outlier_weight(64, 64, 3, every=37), "fp8")
    w, s = q.tensors["data"], q.tensors["scale"]
    call = ops.fp8_linear if through == "ops" else torch.ops.trainstream.fp8_linear.default

    def f(x):
        a = torch.sin(x).to(torch.bfloat16)
        y1 = call(a, w, s, True)
        # computed after y1 (it reads it), once a is dead: inductor writes it into a's buffer
        b = torch.cos(x + y1.float().sum(1, keepdim=True) * 0.0 + 1.0).to(torch.bfloat16)
        return y1, call(b, w, s, True)

    x = _x(32, 64, 11).float().requires_grad_(through == "op_with_grad")
    e1, e2 = f(x)
    torch._dynamo.reset()
    c1, c2 = torch.compile(f, backend="inductor")(x)
    assert not torch.equal(e1, e2)
    assert torch.equal(c1, e1) and torch.equal(c2, e2)
