"""optimizer_in_backward: offloaded parameters are updated from backward's gradient hooks, with the same numbers as
torch.optim.AdamW and as the ordinary step; what cannot work that way (clipping, accumulation, dropping a backward)
raises. CPU compute device: the worker thread is real, the copies are synchronous."""
import copy
import threading

import pytest
import torch
from torch import nn
from transformers import get_linear_schedule_with_warmup

import trainstream_hf as ts
from trainstream_hf.engine import distributed
from trainstream_hf.engine import optimizer as opt_mod
from trainstream_hf.engine.arena import HostArena
from trainstream_hf.engine.optimizer import OffloadedAdamW
from trainstream_hf.engine.streams import TransferStreams
from tests.helpers import max_param_diff, tiny_llama

INBWD = dict(offload_optimizer=True, min_offload_numel=0, vram_budget="64GiB", host_arena=None,
             optimizer_in_backward=True)
HP = dict(lr=1e-3, weight_decay=0.1)


def _llama(seed=0, dtype=torch.float32):
    return tiny_llama(3, vocab=128, positions=64, seed=seed, dtype=dtype)


def _batch(step, b=2, t=16):
    return torch.randint(0, 128, (b, t), generator=torch.Generator().manual_seed(1000 + step))


def _train(model, opt, steps, *, sched=None, start=0):
    losses = []
    for s in range(start, start + steps):
        ids = _batch(s)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach().clone())
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
    return losses


def _sleepy_kernel(monkeypatch):
    """Every CPU update sleeps first: a forward that did not wait for its weights would read the old ones."""
    import time
    real = opt_mod.ops.adamw_step_

    def sleepy(*a, **k):
        time.sleep(0.002)
        return real(*a, **k)
    monkeypatch.setattr(opt_mod.ops, "adamw_step_", sleepy)


@pytest.mark.parametrize("min_offload_numel", [0, 4096])  # 4096: the norms stay on the device optimizer
@pytest.mark.parametrize("slow", [False, True])
def test_matches_torch_adamw_with_warmup(min_offload_numel, slow, monkeypatch):
    if slow:
        _sleepy_kernel(monkeypatch)
    ref = _llama()
    init = copy.deepcopy(ref)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    model, opt = ts.wrap(model, torch.optim.AdamW(model.parameters(), **HP),
                         **{**INBWD, "min_offload_numel": min_offload_numel})
    assert isinstance(opt, OffloadedAdamW) and opt.optimizer_in_backward
    assert opt.grads_mode == "host" and opt.overlap_step  # 'auto' resolved for it, on the CPU too
    assert (opt._device_opt is None) == (min_offload_numel == 0)
    la = _train(ref, ref_opt, 20, sched=get_linear_schedule_with_warmup(ref_opt, 5, 20))
    lb = _train(model, opt, 20, sched=get_linear_schedule_with_warmup(opt, 5, 20))
    assert opt._worker is not None
    ts.unwrap(model)
    assert max_param_diff(ref, model) < 1e-6
    assert max_param_diff(ref, init) > 5e-3  # the run moved the weights (5000x the tolerance): agreement means something
    assert max(abs(a.item() - b.item()) for a, b in zip(la, lb)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equal_to_the_ordinary_step(dtype):
    """The same wrapped model with and without the option (host grads, overlapped step): the same bits."""
    runs = []
    for extra in ({"optimizer_in_backward": True},
                  {"optimizer_in_backward": False, "grads": "host", "overlap_step": True}):
        model = _llama(dtype=dtype)
        opt = torch.optim.AdamW(model.parameters(), **HP)
        model, opt = ts.wrap(model, opt, **{**INBWD, **extra})
        assert ts.plan(model).in_backward == extra["optimizer_in_backward"]  # (what the plan weighs recomputation by)
        losses = _train(model, opt, 5, sched=get_linear_schedule_with_warmup(opt, 2, 5))
        sd = opt.state_dict()
        ts.unwrap(model)
        runs.append((model, losses, sd))
    (a, la, sa), (b, lb, sb) = runs
    assert all(torch.equal(x, y) for x, y in zip(la, lb))
    for p, q in zip(a.parameters(), b.parameters()):
        assert p.dtype == dtype and torch.equal(p, q)
    assert sa["state"].keys() == sb["state"].keys() and sa["param_groups"] == sb["param_groups"]
    for i in sa["state"]:
        assert all(torch.equal(sa["state"][i][k], sb["state"][i][k]) for k in sa["state"][i])


def _tiny(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 48), nn.GELU(), nn.Linear(48, 48), nn.LayerNorm(48), nn.Linear(48, 8))
    return model.to(dtype), nn.Parameter(torch.randn(5, 7).to(dtype))  # the second one never gets a gradient


def _engine_run(dtype, cls, in_backward, steps=6):
    model, unused = _tiny(dtype)
    params = list(model.parameters()) + [unused]
    # mixed, the rest on the device optimizer; fp16: all (torch's fp16 AdamW turns eps=1e-8 into 0 and NaNs)
    offload = params if dtype == torch.float16 else [params[0], params[2], params[5], params[6], unused]
    opt = OffloadedAdamW(cls(params, lr=3e-3, weight_decay=0.1), offload,
                         arena=HostArena(slab_bytes="4MiB"), streams=TransferStreams("cpu"), grads="host",
                         overlap_step=in_backward, optimizer_in_backward=in_backward)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
        opt.synchronize()  # without wrap's hooks, the forward must wait for the previous step itself
        nn.functional.mse_loss(model(x.to(dtype)).float(), y).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    return params, opt, unused


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])  # Adam: the L2 term goes through scratch
def test_engine_level_equal_and_skips_parameters_without_gradient(dtype, cls):
    """fp16 gradients go to the host unconverted as bf16 ones do (never through the staging ring); a parameter
    without a gradient is skipped, step count and state included, as torch does."""
    pa, oa, unused = _engine_run(dtype, cls, True)
    pb, ob, _ = _engine_run(dtype, cls, False)
    assert all(torch.equal(p, q) for p, q in zip(pa, pb))
    ma, mb = oa.master_params(), ob.master_params()
    assert all(torch.equal(ma[p], mb[q]) for p, q in zip(pa, pb) if p in ma)
    assert torch.equal(unused, _tiny(dtype)[1]) and len(oa.state_dict()["state"]) == len(pa) - 1
    assert not torch.equal(pa[0], _tiny(dtype)[0][0].weight)
    s = oa.stats()
    n = sum(p.numel() for p in (pa[:-1] if dtype == torch.float16 else (pa[0], pa[2], pa[5], pa[6])))
    size = torch.tensor([], dtype=dtype).element_size()
    assert s["step"] == 6 and s["d2h_bytes"] == size * n and s["h2d_bytes"] == size * n and s["adam_seconds"] > 0


def test_updates_start_during_backward(monkeypatch):
    """Counted, not timed: while backward is still running (in a gradient hook on the embedding output, which
    fires near its very end), a CPU update has already started; when backward returns, before step(), every
    offloaded parameter's update is queued, and they all complete without step() being called."""
    real = opt_mod.ops.adamw_step_
    started, calls = threading.Event(), []

    def counting(*a, **k):
        calls.append(1)
        started.set()
        return real(*a, **k)
    monkeypatch.setattr(opt_mod.ops, "adamw_step_", counting)
    model = _llama()
    model, opt = ts.wrap(model, torch.optim.AdamW(model.parameters(), **HP), **INBWD)
    seen = []

    def on_embedding(module, args, out):
        out.register_hook(lambda g: seen.append(started.wait(timeout=60)))
    model.model.embed_tokens.register_forward_hook(on_embedding)
    ids = _batch(0)
    model(input_ids=ids, labels=ids).loss.backward()
    assert seen == [True]  # an update ran inside backward
    n = len(opt._slots)
    assert n == len(list(model.parameters())) and len(opt._in_backward) == n
    opt._worker.submit(lambda: None).result()  # the worker's queue, drained without calling step()
    assert len(calls) == n and opt.stats().get("step") is None
    opt.step()
    opt.zero_grad()
    opt.synchronize()
    assert len(calls) == n and opt.stats()["step"] == 1
    ts.unwrap(model)


def test_queued_updates_run_in_the_next_forwards_order(monkeypatch):
    """Updates that queue up behind a busy worker run in the order the next forward needs them (embedding, block 0,
    block 1, ...), not in the order backward delivered their gradients (last block first)."""
    real = opt_mod.ops.adamw_step_
    order = []
    model = _llama()
    model, opt = ts.wrap(model, torch.optim.AdamW(model.parameters(), **HP), **INBWD)
    slot_of = {id(s.master): s.param for s in opt._slots.values()}

    def recording(master, *a, **k):
        order.append(slot_of[id(master)])
        return real(master, *a, **k)
    monkeypatch.setattr(opt_mod.ops, "adamw_step_", recording)
    gate = threading.Event()
    opt._executor().submit(gate.wait, 60)  # the worker is busy until backward has queued every update
    _backward(model)
    gate.set()
    opt.step()
    opt.synchronize()
    expected = [s.param for s in opt._step_order]
    assert order == expected
    blocks = list(model.model.layers)
    first = {id(p) for p in blocks[0].parameters()}
    last = {id(p) for p in blocks[-1].parameters()}
    place = {id(p): k for k, p in enumerate(order)}
    assert place[id(model.model.embed_tokens.weight)] == 0
    assert max(place[i] for i in first) < min(place[i] for i in last)
    opt.zero_grad()
    ts.unwrap(model)


def _wrapped():
    model = _llama()
    return ts.wrap(model, torch.optim.AdamW(model.parameters(), **HP), **INBWD)


def _backward(model, step=0):
    ids = _batch(step)
    model(input_ids=ids, labels=ids).loss.backward()


def test_clipping_and_reading_gradients_raise():
    model, opt = _wrapped()
    _backward(model)
    with pytest.raises(RuntimeError, match="consumed by its parameter's update during backward.*turn "
                                           "optimizer_in_backward off"):
        opt.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match="optimizer_in_backward"):
        opt.clip_grad_norm(1.0)
    with pytest.raises(RuntimeError, match="optimizer_in_backward"):
        opt.host_grads()
    opt.step()
    ts.unwrap(model)


def test_gradient_accumulation_raises():
    model, opt = _wrapped()
    _backward(model, 0)
    with pytest.raises(RuntimeError, match="second gradient before optimizer.step.*optimizer_in_backward=False"):
        _backward(model, 1)
    ts.unwrap(model)


def test_zero_grad_without_step_raises_and_step_completes():
    """A backward's updates are applied in backward: zero_grad() cannot drop them, so it refuses (changing nothing)
    and step() completes the step; training then goes on exactly as if zero_grad had not been called."""
    ref, ref_opt = _wrapped()
    _train(ref, ref_opt, 3)
    model, opt = _wrapped()
    _backward(model, 0)
    with pytest.raises(RuntimeError, match="zero_grad.*without step.*cannot be discarded"):
        opt.zero_grad()
    opt.step()
    opt.zero_grad()
    _train(model, opt, 2, start=1)
    for m in (ref, model):
        ts.unwrap(m)
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), model.parameters()))


@pytest.mark.parametrize("options,match", [
    ({"grads": "device"}, "needs host gradients.*grads='device'"),
    ({"overlap_step": False}, "overlapped step.*overlap_step=False"),
    ({"offload_optimizer": False}, "offloaded optimizer state.*offload_optimizer=False"),
    ({"optimizer_in_backward": "yes"}, "True or False"),
])
def test_bad_config_raises(options, match):
    with pytest.raises(ValueError, match=match):
        ts.TrainStreamConfig(**{"optimizer_in_backward": True, **options})
    model = _llama()
    with pytest.raises(ValueError, match=match):
        ts.wrap(model, torch.optim.AdamW(model.parameters()), **{**INBWD, **options})
    assert ts.engine_of(model) is None


def test_paged_trainable_weights_and_data_parallel_are_refused(monkeypatch):
    model = _llama()
    with pytest.raises(ValueError, match="optimizer_in_backward cannot be combined with param_sink"):
        ts.wrap(model, torch.optim.AdamW(model.parameters()), **INBWD, page_weights=True)
    assert ts.engine_of(model) is None
    monkeypatch.setattr(distributed, "process_group", lambda *a: object())  # as if under torchrun
    with pytest.raises(ValueError, match="optimizer_in_backward cannot be used with several processes"):
        ts.wrap(model, torch.optim.AdamW(model.parameters()), **INBWD)
    assert ts.engine_of(model) is None


def test_offloaded_adamw_refuses_missing_requirements():
    model, _ = _tiny(torch.float32)
    ps = list(model.parameters())
    kw = dict(arena=HostArena(slab_bytes="4MiB"), streams=TransferStreams("cpu"), optimizer_in_backward=True)
    for bad in ({"grads": "device", "overlap_step": True}, {"grads": "host", "overlap_step": False}):
        with pytest.raises(ValueError, match="optimizer_in_backward needs grads='host' and overlap_step=True"):
            OffloadedAdamW(torch.optim.AdamW(ps), ps, **kw, **bad)
    with pytest.raises(ValueError, match="param_sink"):
        OffloadedAdamW(torch.optim.AdamW(ps), ps[:1], **kw, grads="host", overlap_step=True,
                       param_sink={ps[0]: ps[0].detach().clone()})
