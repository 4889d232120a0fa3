"""Dequant-ahead on CUDA, with its side stream: forward + backward of QuantLinear stacks bit-identical with and without
it (checkpointed too), every request served once the order is learned, the forward without a host sync, and the
stream ordering under stress: a slow side stream (the GEMM must wait for the decode), a slow compute stream writing the
next layer's weight (the decode must wait for the write), a second compute stream; device memory flat across steps.
"""
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainstream_hf.quant import QuantLinear, dequant_ahead_stats, quantize, set_dequant_ahead
from trainstream_hf.quant import ahead

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")

DEV = torch.device("cuda", 0)
FEATURES, TOKENS = 1024, 512


@pytest.fixture
def fresh():
    set_dequant_ahead(False)
    ahead.reset_dequant_ahead()
    yield
    set_dequant_ahead(False)
    ahead.reset_dequant_ahead()


def _layers(fmt, n=4, seed=0):
    """Square layers on the GPU (a weight served to the wrong layer would go unnoticed by shape)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        w = torch.randn(FEATURES, FEATURES, generator=g) * FEATURES ** -0.5
        w.view(-1)[:: 61] *= 25.0
        out.append(QuantLinear(quantize(w.to(DEV, torch.bfloat16), fmt)))
    return out


def _x(seed, shape=(TOKENS, FEATURES)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[..., 5] *= 30.0
    return x.to(DEV, torch.bfloat16)


class _Stack(nn.Module):
    def __init__(self, layers, ckpt=False):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.ckpt = ckpt

    def forward(self, x):
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.ckpt else layer(x)
            x = torch.tanh(x)
        return x


def _steps(model, steps, enabled, before_step=None):
    set_dequant_ahead(enabled)
    ahead.reset_dequant_ahead()
    outs, stats = [], []
    for step in range(steps):
        if before_step is not None:
            before_step(step)
        x = _x(100 + step).requires_grad_()
        y = model(x)
        y.backward(_x(200 + step))
        outs.append((y.detach().clone(), x.grad.clone()))
        stats.append(dequant_ahead_stats())
    torch.cuda.synchronize()
    return outs, stats


def _assert_equal(want, got):
    for step, ((y0, g0), (y1, g1)) in enumerate(zip(want, got)):
        assert torch.equal(y0, y1) and torch.equal(g0, g1), f"step {step} differs"


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
@pytest.mark.parametrize("ckpt", [False, True])
def test_bit_exact_and_served_from_the_side_stream(fresh, fmt, ckpt):
    model = _Stack(_layers(fmt, 4, seed=1), ckpt)
    want, _ = _steps(model, 5, enabled=False)
    got, stats = _steps(model, 5, enabled=True)
    _assert_equal(want, got)
    per_step = 12 if ckpt else 8
    for prev, cur in zip(stats[2:], stats[3:]):
        assert cur["hits"] - prev["hits"] == per_step, (prev, cur)
    assert stats[-1]["prefetches"] > 0 and stats[-1]["held"] <= 1
    lanes = ahead._CACHES[DEV].backend.lanes
    assert len(lanes) == 1  # one compute stream, one side stream
    (lane,) = lanes.values()
    assert lane.side.cuda_stream != torch.cuda.current_stream(DEV).cuda_stream


def test_forward_has_no_host_sync(fresh):
    model = _Stack(_layers("nf4", 4, seed=2))
    _steps(model, 3, enabled=True)  # learns the order and creates the side stream; stays enabled
    before = dequant_ahead_stats()
    x = _x(500).requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = model(x)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert dequant_ahead_stats()["hits"] - before["hits"] == 4
    y.backward(_x(501))
    torch.cuda.synchronize()


def test_gemm_waits_for_a_slow_side_stream(fresh, monkeypatch):
    """The decode ahead writes NaN into its output, waits ~10 ms, then the weight, all on the side stream: a GEMM that
    did not wait for the decode's event would read NaN."""
    model = _Stack(_layers("nf4", 4, seed=3))
    want, _ = _steps(model, 4, enabled=False)
    real = ahead.dequantize
    compute = torch.cuda.current_stream(DEV)

    def slow(q, dtype):
        if torch.cuda.current_stream(DEV) == compute:
            return real(q, dtype)
        out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEV)
        torch.cuda._sleep(20_000_000)
        return out.copy_(real(q, dtype))

    monkeypatch.setattr(ahead, "dequantize", slow)
    got, stats = _steps(model, 4, enabled=True)
    _assert_equal(want, got)
    assert stats[-1]["hits"] >= 8


def test_decode_waits_for_a_slow_write_of_the_next_weight(fresh):
    """Before each step, a delayed kernel on the compute stream rewrites layer 1's codes in place; layer 1's weight is
    decoded ahead during layer 0's request, so the side stream must wait for that write."""
    layers = _layers("nf4", 4, seed=4)
    model = _Stack(layers)
    codes = layers[1].weight_data.detach().clone()
    alt = [codes, codes.flip(0).contiguous()]

    def rewrite(module, args):
        torch.cuda._sleep(20_000_000)
        with torch.no_grad():
            layers[1].weight_data.copy_(alt[rewrite.step % 2])
        rewrite.step += 1

    rewrite.step = 0
    handle = layers[0].register_forward_pre_hook(rewrite)
    want, _ = _steps(model, 5, enabled=False)
    rewrite.step = 0
    got, stats = _steps(model, 5, enabled=True)
    handle.remove()
    _assert_equal(want, got)
    assert stats[-1]["prefetches"] > 0


def test_second_compute_stream(fresh):
    model = _Stack(_layers("int8", 4, seed=5))
    xs = [(_x(600 + i).requires_grad_(), _x(700 + i)) for i in range(6)]

    def run():
        outs = []
        for i, (x, dy) in enumerate(xs):
            x.grad = None
            if i < 3:
                y = model(x)
                y.backward(dy)
            else:
                other = torch.cuda.Stream(DEV)
                other.wait_stream(torch.cuda.current_stream(DEV))
                with torch.cuda.stream(other):
                    y = model(x)
                    y.backward(dy)
                torch.cuda.current_stream(DEV).wait_stream(other)
            outs.append((y.detach().clone(), x.grad.clone()))
        torch.cuda.synchronize()
        return outs

    set_dequant_ahead(False)
    want = run()
    set_dequant_ahead(True)
    ahead.reset_dequant_ahead()
    got = run()
    _assert_equal(want, got)
    assert len(ahead._CACHES[DEV].backend.lanes) >= 2


def test_device_memory_flat_across_steps(fresh):
    model = _Stack(_layers("nf4", 4, seed=6), ckpt=True)
    set_dequant_ahead(True)
    ahead.reset_dequant_ahead()
    mem = []
    for step in range(10):
        x = _x(800 + step).requires_grad_()
        model(x).backward(_x(900 + step))
        del x
        torch.cuda.synchronize()
        mem.append(torch.cuda.memory_allocated(DEV))
        assert dequant_ahead_stats()["held"] <= 1
    assert mem[-1] == mem[3], mem
    set_dequant_ahead(False)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated(DEV) < mem[-1]  # the held weight is let go
