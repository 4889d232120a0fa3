"""optimizer_staleness=1 (opt-in approximation, the delayed parameter update): the CPU share's update from step N's
gradients runs during step N+1's forward and backward and reaches the device weights at step N+1's ``step()``.

The contract, tested against a hand-written reference built on torch.optim.AdamW: the masters are exact AdamW over
the gradients each step delivered; the weights the forward of step N+1 reads are the masters after update N-1; saving
or unwrapping the model gives the masters. CPU compute device; the worker thread is real (overlap_step=True)."""
import copy
import threading

import pytest
import torch
from transformers import get_linear_schedule_with_warmup

import trainstream_hf as ts
from trainstream_hf.engine import optimizer as opt_mod
from trainstream_hf.engine.arena import HostArena
from trainstream_hf.engine.optimizer import OffloadedAdamW
from trainstream_hf.engine.streams import TransferStreams
from tests.helpers import max_param_diff, micro_batches, step_batch, tiny_llama

STALE = dict(offload_optimizer=True, min_offload_numel=0, vram_budget="64GiB", host_arena=None,
             optimizer_staleness=1, overlap_step=True)
HP = dict(lr=1e-3, weight_decay=0.1)


def _llama(seed=0, dtype=torch.float32):
    return tiny_llama(3, vocab=128, positions=64, seed=seed, dtype=dtype)


_batch = step_batch


def _micro_batches(model, step, accumulation, losses, max_norm):
    """One step's forwards and backwards (the loss scaled per micro-batch), then the clip if any."""
    micro_batches(model, step, accumulation, losses)
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def _reference(init, steps, accumulation=1, max_norm=None):
    """Delayed AdamW by hand: forward/backward on ``model``; at each step the previous update is copied in, then
    torch's AdamW steps the masters with this step's gradients. Returns (model, masters, losses)."""
    model, masters = copy.deepcopy(init), copy.deepcopy(init)
    opt = torch.optim.AdamW(masters.parameters(), **HP)
    sched = get_linear_schedule_with_warmup(opt, 3, steps)
    pending, losses = None, []
    for s in range(steps):
        _micro_batches(model, s, accumulation, losses, max_norm)
        if pending is not None:
            with torch.no_grad():
                for p, v in zip(model.parameters(), pending):
                    p.copy_(v)
        for m, p in zip(masters.parameters(), model.parameters()):
            m.grad = p.grad.clone()
        opt.step()
        sched.step()
        pending = [m.detach().clone() for m in masters.parameters()]
        model.zero_grad()
    return model, masters, losses


def _train(model, opt, steps, accumulation=1, max_norm=None):
    sched = get_linear_schedule_with_warmup(opt, 3, steps)
    losses = []
    for s in range(steps):
        _micro_batches(model, s, accumulation, losses, max_norm)
        opt.step()
        sched.step()
        opt.zero_grad()
    return losses


@pytest.mark.parametrize("accumulation,max_norm", [(1, None), (3, 0.05)])  # 0.05: the clipping triggers
def test_follows_the_delayed_reference(accumulation, max_norm):
    init = _llama()
    ref_model, ref_masters, ref_losses = _reference(init, 12, accumulation, max_norm)
    model = copy.deepcopy(init)
    model, opt = ts.wrap(model, torch.optim.AdamW(model.parameters(), **HP), gradient_accumulation_steps=accumulation,
                         **STALE)
    assert isinstance(opt, OffloadedAdamW) and opt.staleness == 1 and opt.grads_mode == "device" and opt.overlap_step
    losses = _train(model, opt, 12, accumulation, max_norm)
    # every forward saw the reference's (delayed) weights
    assert max(abs(a.item() - b.item()) for a, b in zip(ref_losses, losses)) < 1e-5
    opt.synchronize()
    masters = opt.master_params()
    assert max((masters[p] - q).abs().max().item() for p, q in zip(model.parameters(), ref_masters.parameters())) < 1e-6
    # the device weights are one update behind the masters until saved
    assert max_param_diff(model, ref_model) < 1e-6
    assert max_param_diff(model, ref_masters) > 1e-5
    ts.unwrap(model)
    assert max_param_diff(model, ref_masters) < 1e-6
    assert max_param_diff(ref_masters, init) > 5e-3  # the run moved the weights: agreement means something


def test_differs_from_exact_adamw_and_exact_is_the_default():
    init = _llama()
    a = copy.deepcopy(init)
    a, oa = ts.wrap(a, torch.optim.AdamW(a.parameters(), **HP), offload_optimizer=True, min_offload_numel=0,
                    vram_budget="64GiB", host_arena=None, overlap_step=True)
    assert oa.staleness == 0
    b = copy.deepcopy(init)
    b, ob = ts.wrap(b, torch.optim.AdamW(b.parameters(), **HP), **STALE)
    la, lb = _train(a, oa, 4), _train(b, ob, 4)
    assert torch.equal(la[0], lb[0]) and torch.equal(la[1], lb[1])  # both forwards before any update land
    assert abs(la[2].item() - lb[2].item()) > 1e-6  # exact has applied two updates, delayed one


def test_the_next_forward_does_not_wait_for_the_update(monkeypatch):
    """The update of step 0 is held until the forward and backward of step 1 have run: they must not wait for it."""
    gate, ran_after_gate = threading.Event(), []
    real = opt_mod.ops.adamw_step_

    def gated(*a, **k):
        ran_after_gate.append(gate.wait(timeout=10))
        return real(*a, **k)
    monkeypatch.setattr(opt_mod.ops, "adamw_step_", gated)
    model = _llama()
    model, opt = ts.wrap(model, torch.optim.AdamW(model.parameters(), **HP), **STALE)
    for s in range(2):
        ids = _batch(s)
        model(input_ids=ids, labels=ids).loss.backward()
        if s == 0:
            opt.step()
            opt.zero_grad()
    gate.set()
    opt.step()
    opt.synchronize()
    assert ran_after_gate and all(ran_after_gate)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saving_the_model_publishes_the_masters(dtype):
    model = _llama(dtype=dtype)
    model, opt = ts.wrap(model, torch.optim.AdamW(model.parameters(), **HP), **STALE)
    _train(model, opt, 3)
    masters = opt.master_params()
    names = {id(p): n for n, p in model.named_parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    sd = model.state_dict()
    changed = 0
    for p, m in masters.items():
        n = names[id(p)]
        assert torch.equal(sd[n], m.to(dtype)), n
        changed += not torch.equal(before[n], sd[n])
    # the pending update was not in the weights before the save (in bf16 a norm's small step may round away)
    assert changed == len(masters) if dtype == torch.float32 else changed > len(masters) // 2
    # training goes on from the published weights: nothing is published twice
    _train(model, opt, 2)
    ts.unwrap(model)


def test_loading_model_weights_drops_the_pending_update():
    model = _llama()
    model, opt = ts.wrap(model, torch.optim.AdamW(model.parameters(), **HP), **STALE)
    _train(model, opt, 2)
    fresh = _llama(seed=5).state_dict()
    model.load_state_dict(fresh)
    ids = _batch(0)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()  # publishes nothing: the loaded weights stay for this step's forward
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), fresh[n]), n
    ts.unwrap(model)


@pytest.mark.parametrize("options,match", [
    (dict(optimizer_staleness=2), "optimizer_staleness: 0"),
    (dict(optimizer_staleness=True), "optimizer_staleness: 0"),
    (dict(optimizer_staleness=1, optimizer_in_backward=True), "optimizer_in_backward=True consumes"),
    (dict(optimizer_staleness=1, grads="host"), "grads='host' consumes"),
])
def test_bad_config_raises(options, match):
    with pytest.raises(ValueError, match=match):
        ts.TrainStreamConfig(**options)


def test_offloaded_adamw_refuses_what_cannot_be_delayed():
    p = torch.nn.Parameter(torch.randn(64, 64))
    arena, streams = HostArena(slab_bytes="4MiB"), TransferStreams("cpu")
    with pytest.raises(ValueError, match="grads='host'"):
        OffloadedAdamW(torch.optim.AdamW([p]), [p], arena=arena, streams=streams, grads="host", staleness=1)
    with pytest.raises(ValueError, match="staleness: 0"):
        OffloadedAdamW(torch.optim.AdamW([p]), [p], arena=arena, streams=streams, staleness=3)


def test_paged_trainable_weights_are_refused():
    model = _llama()
    with pytest.raises(ValueError, match="staleness=1"):
        ts.wrap(model, torch.optim.AdamW(model.parameters(), **HP), **{**STALE, "page_weights": True})


def test_nothing_to_delay_warns():
    model = _llama()
    with pytest.warns(RuntimeWarning, match="optimizer_staleness=1 has nothing to delay"):
        model, opt = ts.wrap(model, torch.optim.AdamW(model.parameters(), **HP), optimizer_staleness=1,
                             offload_optimizer=False, vram_budget="64GiB", host_arena=None)
    assert type(opt) is torch.optim.AdamW
    ts.unwrap(model)


def test_resume_from_a_saved_pair_continues_as_the_uninterrupted_run():
    """Model and optimizer saved together (the model's state_dict publishes the pending update, as a Trainer checkpoint
    does) and loaded into a fresh wrapped pair: the next steps are the uninterrupted run's, with the delay restarting
    from the saved masters (nothing pending from before the load is ever applied)."""
    init = _llama()
    a = copy.deepcopy(init)
    a, oa = ts.wrap(a, torch.optim.AdamW(a.parameters(), **HP), **STALE)
    _train(a, oa, 3)
    model_sd = {k: v.clone() for k, v in a.state_dict().items()}  # publishes
    opt_sd = copy.deepcopy(oa.state_dict())
    b = _llama(seed=9)
    b, ob = ts.wrap(b, torch.optim.AdamW(b.parameters(), **HP), **STALE)
    _train(b, ob, 2)  # its own pending update, which the load must drop
    b.load_state_dict(model_sd)
    ob.load_state_dict(opt_sd)
    la, lb = _train(a, oa, 3), _train(b, ob, 3)
    assert all(torch.equal(x, y) for x, y in zip(la, lb))
    ts.unwrap(a)
    ts.unwrap(b)
    assert max_param_diff(a, b) == 0.0
