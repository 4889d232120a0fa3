"""OffloadedAdamW.load_state_dict checks the whole state dict before it writes anything: a state dict that does not fit
(a moment of another shape, a 1-element one that ``copy_`` would broadcast, a missing key, a bad step, other group
sizes) is one ValueError naming the parameter and both shapes, and the optimizer is exactly as it was: every slot's
moments, master and step, the group hyper-parameters, the device optimizer's state, and the next step."""
import copy

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import trainstream_hf
from trainstream_hf.engine.arena import HostArena
from trainstream_hf.engine.optimizer import OffloadedAdamW
from trainstream_hf.engine.streams import TransferStreams

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def make_model(seed=0):
    # bf16: offloaded entries carry an fp32 'master' too
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 48), nn.GELU(), nn.Linear(48, 48), nn.LayerNorm(48),
                         nn.Linear(48, 8)).to(torch.bfloat16)


def make_opt(model, named=False):
    """Mixed: the first two matrices and the last bias on the host, the rest on the device optimizer."""
    params = model.named_parameters() if named else model.parameters()
    offload = [model[0].weight, model[2].weight, model[4].bias]
    return OffloadedAdamW(torch.optim.AdamW(params, **HP), offload, arena=HostArena(slab_bytes="4MiB"),
                          streams=TransferStreams("cpu"))


def train(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)
        x = x * torch.where(torch.rand(x.shape, generator=g) < 0.02, 30.0, 1.0)  # outlier inputs
        y = torch.randn(8, 8, generator=g) * 2 + 0.5
        nn.functional.mse_loss(model(x.to(torch.bfloat16)).float(), y).backward()
        opt.step()
        opt.zero_grad()


def snapshot(model, opt):
    """Copies of everything a load could change: each state entry (offloaded: moments, step, master; device: torch's
    entry), every master weight, the group hyper-parameters (ours and the device optimizer's) and the weights."""
    state = {i: {k: v.clone() for k, v in st.items()} for i, st in opt.state_dict()["state"].items()}
    return {"state": state,
            "masters": [m.clone() for m in opt.master_params().values()],
            "groups": [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups],
            "device_groups": [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                              for g in opt._device_opt.param_groups],
            "params": [p.detach().clone() for p in model.parameters()]}


def assert_same(a, b):
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        assert a["state"][i].keys() == b["state"][i].keys(), i
        for k in a["state"][i]:
            assert torch.equal(a["state"][i][k], b["state"][i][k]), (i, k)
    assert len(a["masters"]) == len(b["masters"]) == 3
    assert all(torch.equal(x, y) for x, y in zip(a["masters"], b["masters"]))
    assert a["groups"] == b["groups"] and a["device_groups"] == b["device_groups"]
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))


@pytest.fixture
def trained():
    """A model and optimizer 3 steps in, a twin trained identically (the reference for "unchanged"), and a state dict
    from another run (5 steps, other lr): loading a corrupted copy of it must not apply any of its entries."""
    model, twin, other = make_model(), make_model(), make_model(seed=1)
    opt, twin_opt, other_opt = make_opt(model), make_opt(twin), make_opt(other)
    train(model, opt, 3, seed=1)
    train(twin, twin_opt, 3, seed=1)
    train(other, other_opt, 5, seed=2)
    sd = copy.deepcopy(other_opt.state_dict())
    for g in sd["param_groups"]:
        g["lr"] = 1e-4
    return model, opt, twin, twin_opt, sd


# index in model.parameters(): 0 0.weight (16 -> 48, host), 1 0.bias (device), 2 2.weight (host), 3 2.bias (device),
# 4 3.weight, 5 3.bias (device), 6 4.weight (device), 7 4.bias (host). The bad entry is the last of its kind, after
# entries that a load applying as it goes would already have written.
def _exp_avg_1_element_host(sd):
    sd["state"][7]["exp_avg"] = sd["state"][7]["exp_avg"][:1].clone()  # (1,) against (8,): broadcast before
    return r"state\[7\]\['exp_avg'\] for parameter '4.bias' has shape \(1,\), the parameter has shape \(8,\)"


def _exp_avg_1_element_2d_host(sd):
    sd["state"][2]["exp_avg_sq"] = sd["state"][2]["exp_avg_sq"][:1, :1].clone()
    return r"state\[2\]\['exp_avg_sq'\] for parameter '2.weight' has shape \(1, 1\), the parameter has shape \(48, 48\)"


def _exp_avg_transposed_device(sd):
    sd["state"][6]["exp_avg"] = sd["state"][6]["exp_avg"].t().clone()
    return r"state\[6\]\['exp_avg'\] for parameter '4.weight' has shape \(48, 8\), the parameter has shape \(8, 48\)"


def _master_wrong_shape(sd):
    sd["state"][7]["master"] = torch.randn(9)
    return r"state\[7\]\['master'\] for parameter '4.bias' has shape \(9,\), the parameter has shape \(8,\)"


def _missing_exp_avg_sq_host(sd):
    del sd["state"][7]["exp_avg_sq"]
    return r"state\[7\] for parameter '4.bias' \(shape \(8,\)\) has no 'exp_avg_sq' \(its keys: 'step', 'exp_avg', "


def _missing_step_device(sd):
    del sd["state"][6]["step"]
    return r"state\[6\] for parameter '4.weight' \(shape \(8, 48\)\) has no 'step'"


def _negative_step(sd):
    sd["state"][7]["step"] = torch.tensor(-1.0)
    return r"state\[7\]\['step'\] for parameter '4.bias' is -1.0, not a finite non-negative number"


def _nan_step_device(sd):
    sd["state"][6]["step"] = torch.tensor(float("nan"))
    return r"state\[6\]\['step'\] for parameter '4.weight' is nan, not a finite non-negative number"


def _vector_step(sd):
    sd["state"][7]["step"] = torch.tensor([5.0, 5.0])
    return r"state\[7\]\['step'\] for parameter '4.bias' is a tensor of shape \(2,\), not a finite non-negative"


def _string_step(sd):
    sd["state"][7]["step"] = "5"
    return r"state\[7\]\['step'\] for parameter '4.bias' is '5', not a finite non-negative number"


def _integer_moment(sd):
    sd["state"][7]["exp_avg"] = torch.zeros(8, dtype=torch.int64)
    return r"state\[7\]\['exp_avg'\] for parameter '4.bias' is a torch.int64 tensor, expected a floating-point tensor "


def _group_one_short(sd):
    sd["param_groups"][0]["params"] = sd["param_groups"][0]["params"][:-1]
    return r"param groups of sizes \[7\], this optimizer \[8\]"


def _two_groups(sd):
    g = sd["param_groups"][0]
    sd["param_groups"] = [{**g, "params": g["params"][:4]}, {**g, "params": g["params"][4:]}]
    return r"param groups of sizes \[4, 4\], this optimizer \[8\]"


CORRUPTIONS = [_exp_avg_1_element_host, _exp_avg_1_element_2d_host, _exp_avg_transposed_device, _master_wrong_shape,
               _missing_exp_avg_sq_host, _missing_step_device, _negative_step, _nan_step_device, _vector_step,
               _string_step, _integer_moment, _group_one_short, _two_groups]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__.strip("_"))
def test_bad_state_dict_is_refused_and_changes_nothing(trained, corrupt):
    model, opt, twin, twin_opt, sd = trained
    opt.set_param_names(model.named_parameters())
    want = corrupt(sd)
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=want) as info:
        opt.load_state_dict(sd)
    assert str(info.value).startswith("OffloadedAdamW.load_state_dict: ") and "\n" not in str(info.value)
    assert "; load " in str(info.value)  # says what to do
    assert_same(snapshot(model, opt), before)
    # and it trains on exactly as the twin that never saw the bad load (the device optimizer's groups included)
    train(model, opt, 2, seed=3)
    train(twin, twin_opt, 2, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


def test_the_uncorrupted_state_dict_loads(trained):
    """The fixture's state dict is a good one: loaded whole, the model trains on as the run that saved it would."""
    model, opt, _, _, sd = trained
    opt.load_state_dict(sd)
    assert all(g["lr"] == 1e-4 for g in opt.param_groups) and all(g["lr"] == 1e-4 for g in opt._device_opt.param_groups)
    got = opt.state_dict()["state"]
    for i, st in sd["state"].items():
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got[i][k].to(st[k].dtype), st[k]), (i, k)
    assert torch.equal(got[7]["master"], sd["state"][7]["master"])


def test_without_names_the_parameter_is_named_by_place_or_by_the_groups_names(trained):
    model, opt, _, _, sd = trained
    _exp_avg_1_element_host(sd)
    with pytest.raises(ValueError, match=r"state\[7\]\['exp_avg'\] for parameter param_groups\[0\]\['params'\]\[7\] "
                                         r"has shape \(1,\), the parameter has shape \(8,\)"):
        opt.load_state_dict(sd)
    named = make_model()
    named_opt = make_opt(named, named=True)  # torch keeps the names in the group ('param_names')
    with pytest.raises(ValueError, match=r"state\[7\]\['exp_avg'\] for parameter '4.bias' has shape \(1,\)"):
        named_opt.load_state_dict(sd)


def test_not_a_state_dict():
    model = make_model()
    opt = make_opt(model)
    with pytest.raises(ValueError, match=r"expected an optimizer state dict .*got \['0.bias', '0.weight'"):
        opt.load_state_dict(model.state_dict())


def test_wrapped_tiny_llama_names_the_parameter_and_keeps_its_state():
    """Through trainstream_hf.wrap (every matrix's optimizer state offloaded): the model's own parameter name, and the
    state stays as it was."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100)
    model = LlamaForCausalLM(cfg)
    model, opt = trainstream_hf.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), offload_optimizer=True,
                                     min_offload_numel=0, vram_budget="64GiB")
    try:
        assert isinstance(opt, OffloadedAdamW)
        ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        names = [n for n, _ in model.named_parameters()]
        k = names.index("model.layers.1.mlp.down_proj.weight")
        sd = copy.deepcopy(opt.state_dict())
        sd["state"][k]["exp_avg"] = sd["state"][k]["exp_avg"][:1, :1].clone()
        sd["state"][0]["exp_avg"].add_(1.0)  # applied first by a load that writes as it goes
        before = {i: {key: v.clone() for key, v in st.items()} for i, st in opt.state_dict()["state"].items()}
        with pytest.raises(ValueError, match=rf"state\[{k}\]\['exp_avg'\] for parameter "
                                             r"'model.layers.1.mlp.down_proj.weight' has shape \(1, 1\), the "
                                             r"parameter has shape \(64, 128\)"):
            opt.load_state_dict(sd)
        after = opt.state_dict()["state"]
        assert before.keys() == after.keys()
        assert all(torch.equal(before[i][key], after[i][key]) for i in before for key in before[i])
    finally:
        trainstream_hf.unwrap(model)
