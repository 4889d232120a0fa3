"""Dequant-ahead (trainstream_hf.quant.ahead) on the CPU, through the inline backend (decodes at once on the calling
thread): which weight is decoded ahead, hits and misses, stale entries after in-place or storage changes, what is
never decoded ahead (views of a shared buffer, placeholders, marked parameters), bit-exact forward + backward of
QuantLinear stacks with and without it (checkpointed too), and at most one decoded weight held."""
import gc
import os
import subprocess
import sys
import weakref

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainstream_hf.quant import QuantLinear, dequant_ahead_enabled, dequant_ahead_stats, quantize, set_dequant_ahead
from trainstream_hf.quant import ahead

CPU = torch.device("cpu")


@pytest.fixture
def inline(monkeypatch):
    """Dequant-ahead on, with the inline backend on the CPU; off and forgotten afterwards."""
    monkeypatch.setitem(ahead._BACKENDS, "cpu", ahead.InlineBackend)
    monkeypatch.setattr(ahead, "_CACHES", {})
    set_dequant_ahead(True)
    ahead.reset_dequant_ahead()
    yield ahead
    set_dequant_ahead(False)


def _cache():
    return ahead._CACHES[CPU]


def _layers(fmt, n=4, features=128, seed=0):
    """Square layers (a weight served to the wrong layer would go unnoticed by shape), with outlier weights."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        w = torch.randn(features, features, generator=g) * features ** -0.5
        w.view(-1)[:: 61] *= 25.0
        out.append(QuantLinear(quantize(w, fmt)))
    return out


def _x(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[..., 5] *= 30.0
    return x.to(dtype)


def _call(layers, order, x):
    with torch.no_grad():
        return [layers[i](x) for i in order]


def _held_weight():
    entry = _cache().entry
    return None if entry is None else entry.weight


def test_off_by_default_and_environment_switch():
    env = {k: v for k, v in os.environ.items() if k != "TRAINSTREAM_DEQUANT_AHEAD"}
    code = "import trainstream_hf.quant as q; print(q.dequant_ahead_enabled())"
    for value, want in ((None, "False"), ("1", "True"), ("0", "False")):
        e = dict(env) if value is None else dict(env, TRAINSTREAM_DEQUANT_AHEAD=value)
        out = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want, (value, out.stderr)
    if "TRAINSTREAM_DEQUANT_AHEAD" not in os.environ:
        assert not dequant_ahead_enabled()


def test_cpu_without_a_backend_is_a_no_op(monkeypatch):
    monkeypatch.setattr(ahead, "_CACHES", {})
    set_dequant_ahead(True)
    try:
        layers = _layers("nf4", 3)
        x = _x((5, 128), 1)
        for _ in range(3):
            ys = _call(layers, [0, 1, 2], x)
        assert ahead._CACHES == {CPU: None}
        assert dequant_ahead_stats()["requests"] == 0
        for layer, y in zip(layers, ys):
            assert torch.equal(y, x @ layer.dequantize_weight(torch.float32).t())
    finally:
        set_dequant_ahead(False)


def test_successor_is_decoded_ahead_and_served(inline):
    a, b, c = _layers("nf4", 3)
    x = _x((6, 128), 2)
    _call([a, b, c], [0, 1, 2], x)  # step 1: learns A -> B -> C
    s = dequant_ahead_stats()
    assert (s["requests"], s["hits"], s["misses"], s["prefetches"]) == (3, 0, 3, 0)
    # step 2: A's context (after C) is new; after B comes C (decoded ahead, served), after C comes A
    _call([a, b, c], [0, 1, 2], x)
    s = dequant_ahead_stats()
    assert (s["hits"], s["misses"], s["prefetches"], s["stale"]) == (1, 5, 2, 0)
    entry = _cache().entry
    assert entry.ref() is a and entry.dtype is torch.float32 and s["held"] == 1
    assert torch.equal(entry.weight, a.dequantize_weight(torch.float32))
    # from step 3 on every request is served
    for step in range(3):
        ys = _call([a, b, c], [0, 1, 2], x)
        s = dequant_ahead_stats()
        assert (s["hits"], s["misses"], s["stale"]) == (1 + 3 * (step + 1), 5, 0)
        for layer, y in zip((a, b, c), ys):
            assert torch.equal(y, x @ layer.dequantize_weight(torch.float32).t())


def test_changed_order_misses_and_stays_exact(inline):
    layers = _layers("int8", 4)
    x = _x((3, 128), 3)
    for _ in range(3):
        _call(layers, [0, 1, 2, 3], x)
    before = dequant_ahead_stats()
    ys = _call(layers, [0, 2, 1, 3], x)  # A is served; B was decoded ahead for the second request, which is C
    s = dequant_ahead_stats()
    assert s["hits"] - before["hits"] == 1 and s["stale"] - before["stale"] >= 1
    assert s["misses"] - before["misses"] == 3
    for i, y in zip([0, 2, 1, 3], ys):
        assert torch.equal(y, x @ layers[i].dequantize_weight(torch.float32).t())
    # a dtype the successor was not decoded in is a miss too
    before = dequant_ahead_stats()
    y = layers[0](x.bfloat16())
    assert torch.equal(y, nn.functional.linear(x.bfloat16(), layers[0].dequantize_weight(torch.bfloat16)))
    assert dequant_ahead_stats()["hits"] == before["hits"]


@pytest.mark.parametrize("change", ["in_place", "new_data"])
def test_stale_packed_tensor_is_detected(inline, change):
    a, b = _layers("nf4", 2, seed=4)
    x = _x((4, 128), 5)
    for _ in range(3):
        _call([a, b], [0, 1], x)
    assert _cache().entry.ref() is a  # A's weight decoded ahead for the next step
    old = a.dequantize_weight(torch.float32)
    with torch.no_grad():
        if change == "in_place":  # bumps the version counter, same memory
            a.weight_data[:8] = a.weight_data[:8].flip(0) ^ 0x5A
        else:  # same version, other memory
            a.weight_data.data = a.weight_data.data ^ 0x5A
    new = a.dequantize_weight(torch.float32)
    assert not torch.equal(new, old)
    before = dequant_ahead_stats()
    (y,) = _call([a], [0], x)
    assert torch.equal(y, x @ new.t())
    s = dequant_ahead_stats()
    assert s["stale"] - before["stale"] == 1 and s["hits"] == before["hits"]


def test_kept_weight_goes_stale(inline):
    """A layer's forward followed by its own backward keeps the weight, and so does the last backward for the next
    step's first forward; a storage swap in between (the one change autograd allows there) or an in-place write
    between steps is seen."""
    (a,) = _layers("int8", 1, seed=6)
    x = _x((4, 128), 7).requires_grad_()
    dy = _x((4, 128), 8)
    for _ in range(3):
        a(x).backward(dy)
    assert dequant_ahead_stats()["kept"] == 3  # step 2's backward, step 3's forward and backward
    x.grad = None
    y = a(x)
    assert _cache().entry is not None and _cache().entry.event is None  # kept for the backward
    a.weight_scale.data = a.weight_scale.data * 2.0  # same version, other memory
    before = dequant_ahead_stats()
    y.backward(dy)
    assert dequant_ahead_stats()["stale"] - before["stale"] == 1
    assert torch.equal(x.grad, dy @ a.dequantize_weight(torch.float32))
    assert _cache().entry.event is None  # kept for the next forward
    with torch.no_grad():
        a.weight_data.neg_()
    before = dequant_ahead_stats()
    y = a(x)
    assert dequant_ahead_stats()["stale"] - before["stale"] == 1
    assert torch.equal(y, x @ a.dequantize_weight(torch.float32).t())


def _oversized(layer):
    """Each packed tensor moved to the start of a buffer larger than itself (a slot sized for a larger block)."""
    bufs = []
    for n, p in layer.named_parameters():
        nbytes = p.numel() * p.element_size()
        buf = torch.zeros(nbytes + 256, dtype=torch.uint8)
        view = buf[:nbytes].view(p.dtype).view(p.shape)
        view.copy_(p.data)
        p.data = view
        bufs.append(buf)
    return bufs


def _slot_views(layer):
    """The layer's packed tensors moved into one shared flat buffer, as the engine's pager lays out a block."""
    params = [p for n, p in layer.named_parameters() if n.startswith("weight_")]
    total = sum(-(-p.numel() * p.element_size() // 256) * 256 for p in params)
    flat = torch.zeros(total, dtype=torch.uint8)
    off = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        view = flat[off:off + nbytes].view(p.dtype).view(p.shape)
        view.copy_(p.data)
        p.data = view
        off += -(-nbytes // 256) * 256
    return flat


@pytest.mark.parametrize("how", ["shared_buffer", "oversized_buffer", "marked", "placeholder"])
def test_never_decoded_ahead(inline, how):
    a, b, c = _layers("nf4", 3, seed=9)
    x = _x((4, 128), 10)
    handles = []
    if how == "shared_buffer":
        _slot_views(b)
    elif how == "oversized_buffer":
        _oversized(b)
    elif how == "marked":
        for p in b.parameters():
            ahead.mark_paged(p)
    else:  # B's tensors are empty placeholders until just before its call, as a paged block that is not resident
        saved = {}

        def evict(module, args):
            for n, p in b.named_parameters():
                saved[n] = p.data
                p.data = torch.empty(0, dtype=p.dtype)

        def restore(module, args):
            for n, p in b.named_parameters():
                p.data = saved[n]

        handles = [a.register_forward_pre_hook(evict), b.register_forward_pre_hook(restore)]
    for _ in range(4):
        ys = _call([a, b, c], [0, 1, 2], x)
    s = dequant_ahead_stats()
    # B never decoded ahead (after A, in steps 3 and 4); C and A are, from steps 2 and 3
    assert (s["skipped"], s["prefetches"], s["hits"]) == (2, 6, 5)
    for layer, y in zip((a, b, c), ys):
        assert torch.equal(y, x @ layer.dequantize_weight(torch.float32).t())
    for h in handles:
        h.remove()
    if how == "marked":  # unmarked, it is decoded ahead again
        for p in b.parameters():
            ahead.mark_paged(p, False)
        before = dequant_ahead_stats()
        _call([a, b, c], [0, 1, 2], x)
        assert dequant_ahead_stats()["hits"] - before["hits"] == 3


class _Stack(nn.Module):
    def __init__(self, layers, ckpt):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.ckpt = ckpt

    def _pair(self, i, x):
        return self.layers[i + 1](torch.tanh(self.layers[i](x)))

    def forward(self, x):
        if self.ckpt == "pairs":
            for i in range(0, len(self.layers), 2):
                x = checkpoint(self._pair, i, x, use_reentrant=False)
            return x
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.ckpt == "layers" else layer(x)
            x = torch.tanh(x)
        return x


def _train(fmt, ckpt, dtype, steps, enabled):
    """Forward + backward of a QuantLinear stack per step: outputs and input gradients, and the stats per step."""
    set_dequant_ahead(enabled)
    ahead.reset_dequant_ahead()
    model = _Stack(_layers(fmt, 4, seed=11), ckpt)
    outs, per_step = [], []
    for step in range(steps):
        x = _x((2, 5, 128), 20 + step, dtype).requires_grad_()
        dy = _x((2, 5, 128), 40 + step, dtype)
        y = model(x)
        y.backward(dy)
        outs.append((y.detach(), x.grad))
        per_step.append(dequant_ahead_stats())
        assert per_step[-1]["held"] <= 1
    return outs, per_step


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
@pytest.mark.parametrize("ckpt", [None, "layers", "pairs"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_steps_bit_exact(inline, fmt, ckpt, dtype):
    want, _ = _train(fmt, ckpt, dtype, 5, enabled=False)
    got, stats = _train(fmt, ckpt, dtype, 5, enabled=True)
    for (y0, g0), (y1, g1) in zip(want, got):
        assert torch.equal(y0, y1) and torch.equal(g0, g1)
    # forward 4 + backward 4 requests per step, plus 4 recomputes under checkpointing
    per_step = 8 if ckpt is None else 12
    assert stats[-1]["requests"] == 5 * per_step
    # From the third step every request is served: the order, recomputes included, is learned exactly.
    for prev, cur in zip(stats[2:], stats[3:]):
        assert cur["hits"] - prev["hits"] == per_step, (prev, cur)
        assert cur["stale"] == prev["stale"] and cur["skipped"] == prev["skipped"]
    assert stats[-1]["kept"] > 0 and stats[-1]["prefetches"] > 0


def test_at_most_one_weight_held_and_freed(inline):
    model = _Stack(_layers("nf4", 4, seed=12), "layers")
    seen = []

    def check(module, args, output):
        assert dequant_ahead_stats()["held"] <= 1

    for layer in model.layers:
        layer.register_forward_hook(check)
        layer.register_full_backward_hook(lambda m, gi, go: check(m, None, None))
    for step in range(12):
        x = _x((3, 128), step).requires_grad_()
        model(x).sum().backward()
        w = _held_weight()
        assert w is not None or step < 2  # once learned, layer 0's weight is kept for the next step's forward
        if w is not None:
            seen.append(weakref.ref(w))
        del w
    gc.collect()
    assert sum(r() is not None for r in seen) == 1  # only the one held now is alive: nothing piles up
    set_dequant_ahead(False)  # off drops it
    assert dequant_ahead_stats()["held"] == 0
    gc.collect()
    assert all(r() is None for r in seen)


def test_dead_module_is_skipped(inline):
    a, b = _layers("int8", 2, seed=13)
    x = _x((2, 128), 14)
    for _ in range(2):
        _call([a, b], [0, 1], x)
    ref = weakref.ref(b)
    del b
    gc.collect()
    assert ref() is None
    before = dequant_ahead_stats()
    (y,) = _call([a], [0], x)  # A was served; its successor (B) is gone
    assert dequant_ahead_stats()["skipped"] - before["skipped"] == 1
    assert torch.equal(y, x @ a.dequantize_weight(torch.float32).t())


class _FakeStream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_event(self, event):
        self.log.append(f"{self.name} waits {event.name}")


class _FakeEvent:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def record(self, stream):
        self.log.append(f"{stream.name} records {self.name}")


def test_cuda_lane_protocol_with_fake_streams(monkeypatch):
    """The CUDA backend's calls, in order, with torch.cuda's streams and events replaced by recorders: the side
    stream waits for the compute stream before decoding, the decode runs with the side stream current, and the compute
    stream waits for the decode's event before the weight is used, or before a stale one is let go."""
    log = []
    compute = _FakeStream("compute", log)
    names = iter(["ready", "done"])
    current = ["compute"]

    def set_stream(s):
        current[0] = s.name

    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: compute)
    monkeypatch.setattr(torch.cuda, "Stream", lambda index=None, priority=0: _FakeStream("side", log))
    monkeypatch.setattr(torch.cuda, "Event", lambda: _FakeEvent(next(names), log))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_stream", set_stream)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(ahead, "_RAW_STREAM", lambda index: 7)
    real = ahead.dequantize

    def decode(q, dtype):
        log.append(f"decode {names_of[id(q.tensors['data'])]} on {current[0]}")
        return real(q, dtype)

    monkeypatch.setattr(ahead, "dequantize", decode)
    monkeypatch.setitem(ahead._BACKENDS, "cpu", ahead._CudaBackend)
    monkeypatch.setattr(ahead, "_CACHES", {})
    layers = _layers("nf4", 3, seed=15)
    names_of = {id(layer.weight_data): n for layer, n in zip(layers, "ABC")}
    for layer, n in zip(layers, "ABC"):
        layer.register_forward_hook(lambda m, a, o, n=n: log.append(f"gemm {n}"))
    x = _x((4, 128), 16)
    set_dequant_ahead(True)
    try:
        for _ in range(3):
            log.clear()
            ys = _call(layers, [0, 1, 2], x)
        assert log == [
            "compute waits done", "compute records ready", "side waits ready", "decode B on side", "side records done",
            "gemm A",
            "compute waits done", "compute records ready", "side waits ready", "decode C on side", "side records done",
            "gemm B",
            "compute waits done", "compute records ready", "side waits ready", "decode A on side", "side records done",
            "gemm C"]
        assert current[0] == "compute"
        for layer, y in zip(layers, ys):
            assert torch.equal(y, x @ layer.dequantize_weight(torch.float32).t())
        log.clear()
        _call(layers, [1], x)  # A was decoded ahead: stale, the compute stream waits before letting it go
        assert log == ["compute waits done", "decode B on compute", "gemm B"]
        _call(layers, [0, 1, 2], x)
        assert dequant_ahead_stats()["held"] == 1
        log.clear()
        set_dequant_ahead(False)  # drops A, decoded ahead after C: waited for as well
        assert log == ["compute waits done"] and dequant_ahead_stats()["held"] == 0
    finally:
        set_dequant_ahead(False)


def test_bench_row_counts_the_timed_steps(inline):
    """The quant suite's nf4_ahead row (with the inline backend, so the counters move on the CPU): every request of
    the timed steps served; the setting is restored afterwards and nothing held; other rows run without it."""
    from trainstream_hf.bench import quant

    linears = quant.block_linears("tiny")
    row = quant.quant_row("nf4_ahead", linears, 8, CPU, warmup=3, repeats=2)
    assert row["status"] == "ok" and row["path"] == "dequant"
    timed = row["dequant_ahead"]["timed_steps"]
    assert timed["requests"] == 2 * 2 * len(linears) and timed["hits"] == timed["requests"]
    assert row["ahead"] == f"{timed['requests']}/{timed['requests']} hits"
    assert row["dequant_ahead"]["all_steps"]["requests"] == 5 * 2 * len(linears)
    assert dequant_ahead_enabled() and dequant_ahead_stats()["held"] == 0  # as before the row, holding nothing
    plain = quant.quant_row("nf4", linears, 8, CPU, warmup=1, repeats=1)  # the plain row runs without it
    assert "dequant_ahead" not in plain and dequant_ahead_stats()["requests"] == 0
    assert dequant_ahead_enabled()


def test_inference_mode_bypasses_the_cache(inline):
    layers = _layers("int8", 2, seed=17)
    x = _x((2, 128), 18)
    for _ in range(3):
        _call(layers, [0, 1], x)
    before = dequant_ahead_stats()
    with torch.inference_mode():
        ys = [layer(x) for layer in layers]
    assert dequant_ahead_stats() == before  # neither served nor learned nor decoded ahead
    for layer, y in zip(layers, ys):
        assert torch.equal(y, x @ layer.dequantize_weight(torch.float32).t())
