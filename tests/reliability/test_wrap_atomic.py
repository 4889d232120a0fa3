"""wrap is all or nothing: whatever step fails, the model, its parameters (values, classes, devices), hooks and the
optimizer are exactly as given, and a second wrap then works; unwrap after a success leaves an ordinary model."""
import copy

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import trainstream_hf as ts
from trainstream_hf import planner
from trainstream_hf.engine import activations, arena, optimizer as offloaded, weights
from trainstream_hf.wrap import Engine

IDS = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))


def _llama(layers=3):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=100))


def _lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"]))


def _snapshot(model, opt):
    """Everything a failed wrap must leave as it was."""
    hooks = {n: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks),
                 len(m._state_dict_hooks), len(m._load_state_dict_pre_hooks), sorted(m.__dict__))
             for n, m in model.named_modules()}
    return {
        "modules": [(n, type(m)) for n, m in model.named_modules()],
        "params": [(n, p, type(p), p.device, p.dtype, p.requires_grad, p.detach().clone())
                   for n, p in model.named_parameters()],
        "buffers": [(n, b.device, b.clone()) for n, b in model.named_buffers()],
        "hooks": hooks,
        "model_dict": sorted(model.__dict__),
        "groups": None if opt is None else [(list(g["params"]), {k: v for k, v in g.items() if k != "params"})
                                            for g in opt.param_groups],
        "state": None if opt is None else {p: {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
                                           for p, st in opt.state.items()},
        "loss": _loss(model),
    }


def _loss(model):
    with torch.no_grad():
        return model(input_ids=IDS, labels=IDS).loss


def _assert_same(before, after):
    assert after["modules"] == before["modules"]
    assert len(after["params"]) == len(before["params"])
    for (n, p, cls, dev, dt, rg, value), (n2, p2, cls2, dev2, dt2, rg2, value2) in zip(before["params"],
                                                                                        after["params"]):
        assert (n, cls, dev, dt, rg) == (n2, cls2, dev2, dt2, rg2) and p is p2, n
        assert torch.equal(value, value2), n
    for (n, dev, v), (n2, dev2, v2) in zip(before["buffers"], after["buffers"]):
        assert (n, dev) == (n2, dev2) and torch.equal(v, v2), n
    assert after["hooks"] == before["hooks"]
    assert after["model_dict"] == before["model_dict"]
    assert after["groups"] == before["groups"] if before["groups"] is None else all(
        [id(p) for p in a[0]] == [id(p) for p in b[0]] and a[1] == b[1]
        for a, b in zip(after["groups"], before["groups"]))
    if before["state"] is not None:
        assert after["state"].keys() == before["state"].keys()
        for p, st in before["state"].items():
            for k, v in st.items():
                assert torch.equal(after["state"][p][k], v) if torch.is_tensor(v) else after["state"][p][k] == v
    assert torch.equal(after["loss"], before["loss"])


def _trained_optimizer(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=IDS, labels=IDS).loss.backward()
    opt.step()
    opt.zero_grad()
    return opt


def test_failed_quantized_wrap_leaves_the_peft_model_as_given():
    """The issue's case: nf4 on a LoRA model, a budget nothing fits: BudgetError, the base is not left packed, and a
    retry with another format finds the frozen layers again."""
    model = _lora(_llama())
    opt = _trained_optimizer(model)
    before = _snapshot(model, opt)
    with pytest.raises(ts.BudgetError):
        ts.wrap(model, opt, quantize="nf4", vram_budget="1KiB", host_arena=None)
    _assert_same(before, _snapshot(model, opt))
    assert ts.engine_of(model) is None
    model, opt2 = ts.wrap(model, opt, quantize="int8", vram_budget="64GiB", host_arena=None)
    assert any(type(m).__name__ == "QuantLinear" for m in model.modules())
    model(input_ids=IDS, labels=IDS).loss.backward()
    opt2.step()
    ts.unwrap(model)


def _fail(monkeypatch, target, name):
    def boom(*args, **kwargs):
        raise RuntimeError(f"injected failure in {name}")
    monkeypatch.setattr(target, name, boom)


# One failure per pipeline step, from the first (prepare) to the last (install).
STEPS = {
    "measure": lambda mp: _fail(mp, planner, "measure_block"),
    "plan": lambda mp: _fail(mp, planner, "plan"),
    "arena": lambda mp: _fail(mp, arena.HostArena, "reserve"),
    "pager": lambda mp: _fail(mp, weights.WeightPager, "__init__"),
    "offloader": lambda mp: _fail(mp, activations.ActivationOffloader, "__init__"),
    "optimizer": lambda mp: _fail(mp, offloaded.OffloadedAdamW, "set_param_names"),
    "recompute": lambda mp: _fail(mp, Engine, "install_recompute"),
    "overlap": lambda mp: _fail(mp, Engine, "install_step_overlap"),
}
OPTIONS = dict(vram_budget="64GiB", batch_shape=(2, 16), page_weights=True, offload_activations=True,
               offload_optimizer=True, min_offload_numel=0, min_activation_bytes=0, recompute=False,
               host_arena="4MiB", pageable_fallback=True)


@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize("step", sorted(STEPS))
def test_a_failure_at_any_step_changes_nothing(monkeypatch, step, quantize):
    model = _llama() if quantize is None else _lora(_llama())
    opt = _trained_optimizer(model)
    before = _snapshot(model, opt)
    options = dict(OPTIONS, quantize=quantize)
    if step == "overlap":
        options.update(page_weights=False, overlap_step=True)
    with monkeypatch.context() as mp:
        STEPS[step](mp)
        with pytest.raises(RuntimeError, match="injected failure"):
            ts.wrap(model, opt, **options)
    _assert_same(before, _snapshot(model, opt))
    assert ts.engine_of(model) is None
    # and the same wrap works afterwards, training as a model that never saw the failure
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_opt.load_state_dict(opt.state_dict())
    model, opt = ts.wrap(model, opt, **options)
    ref, ref_opt = ts.wrap(ref, ref_opt, **options)
    for m, o in ((model, opt), (ref, ref_opt)):
        m(input_ids=IDS, labels=IDS).loss.backward()
        o.step()
        o.zero_grad()
    assert torch.equal(_loss(model), _loss(ref))
    ts.unwrap(model)
    ts.unwrap(ref)


def test_unwrap_leaves_an_ordinary_model():
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = _snapshot(model, opt)
    model, wrapped = ts.wrap(model, opt, **OPTIONS)
    model(input_ids=IDS, labels=IDS).loss.backward()
    wrapped.step()
    wrapped.zero_grad()
    ts.unwrap(model)
    after = _snapshot(model, None)
    assert after["modules"] == before["modules"] and after["hooks"] == before["hooks"]
    assert after["model_dict"] == before["model_dict"]
    assert all(type(p) is nn.Parameter and p.device.type == "cpu" and p.grad is None for p in model.parameters())
    assert not torch.equal(after["loss"], before["loss"])  # it trained, and kept what it learned


def test_forced_device_grads_with_paged_trainable_weights_is_refused():
    model = _llama()
    opt = torch.optim.AdamW(model.parameters())
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match="grads='auto'"):
        ts.wrap(model, opt, vram_budget="64GiB", page_weights=True, offload_optimizer=True, min_offload_numel=0,
                grads="device", host_arena=None)
    _assert_same(before, _snapshot(model, opt))


def test_plan_is_wraps_plan_and_changes_nothing():
    """plan() runs wrap's own planning (recompute included) and undoes it."""
    model = _lora(_llama())
    before = _snapshot(model, None)
    options = dict(vram_budget="64GiB", recompute=True, quantize="nf4", offload_optimizer=True)
    pl = ts.plan(model, (2, 16), **options)
    _assert_same(before, _snapshot(model, None))
    assert pl.recomputed_blocks == [0, 1, 2]
    model, opt = ts.wrap(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]),
                         batch_shape=(2, 16), **options)
    assert str(model.trainstream_plan) == str(pl)
    ts.unwrap(model)


def test_originals_too_large_to_keep_are_not_kept_and_a_failure_says_so(monkeypatch):
    """Keeping a copy of the frozen base must not exhaust host RAM: past half of what is available it is not kept,
    and a failed wrap warns that the base stays packed."""
    import importlib

    monkeypatch.setattr(importlib.import_module("trainstream_hf.wrap"), "host_memory_available", lambda: 1 << 10)
    model = _lora(_llama())
    with pytest.warns(RuntimeWarning, match="stay packed as quantize='nf4'.*load the model again"):
        with pytest.raises(ts.BudgetError):
            ts.wrap(model, None, quantize="nf4", vram_budget="1KiB", host_arena=None)
    assert any(type(m).__name__ == "QuantLinear" for m in model.modules())
    assert ts.engine_of(model) is None
