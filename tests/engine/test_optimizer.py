"""OffloadedAdamW on the CPU compute device, against torch.optim.AdamW/Adam on an identical fp32 model."""
import copy
import io

import pytest
import torch
from torch import nn

from trainstream_hf.engine.arena import HostArena
from trainstream_hf.engine.grads import device_grad
from trainstream_hf.engine.optimizer import OffloadedAdamW
from trainstream_hf.engine.streams import TransferStreams

TOL = 1e-6  # the native kernel agrees with torch's AdamW to rounding; 20 steps must not drift past this
STEPS = 20
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8)




def make_model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 48), nn.GELU(), nn.Linear(48, 48), nn.LayerNorm(48),
                         nn.Linear(48, 8)).to(dtype)


def make_data(steps=STEPS, micro=1, seed=1):
    """Per step, ``micro`` micro-batches (x, y); about 2% of inputs are 30x outliers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, micro, 8, 16, generator=g)
    x = x * torch.where(torch.rand(x.shape, generator=g) < 0.02, 30.0, 1.0)
    y = torch.randn(steps, micro, 8, 8, generator=g) * 2 + 0.5
    return list(zip(x, y))


def backward(model, data_step):
    xs, ys = data_step
    dtype = next(model.parameters()).dtype
    for x, y in zip(xs, ys):
        (nn.functional.mse_loss(model(x.to(dtype)).float(), y) / len(xs)).backward()


def wrap(opt, offload, grads="device", **kw):
    return OffloadedAdamW(opt, offload, arena=HostArena(slab_bytes="4MiB"), streams=TransferStreams("cpu"),
                          grads=grads, **kw)


def train(model, opt, data, clip=None, sched=None):
    norms = []
    for d in data:
        opt.zero_grad()
        backward(model, d)
        if clip is not None:
            norms.append(clip(model, opt))
        opt.step()
        if sched is not None:
            sched.step()
    return norms


def max_diff(a, b):
    return max((p.detach().float() - q.detach().float()).abs().max().item()
               for p, q in zip(a.parameters(), b.parameters()))


def run_pair(grads="device", offload=lambda m: list(m.parameters()), cls=torch.optim.AdamW, micro=1, clip=None,
             ref_clip=None, hp=None, **kw):
    """Trains the reference (torch optimizer) and the offloaded model on the same data; returns both."""
    hp = {**HP, **(hp or {})}
    ref, model = make_model(), make_model()
    init = copy.deepcopy(ref)
    data = make_data(micro=micro)
    ref_norms = train(ref, cls(ref.parameters(), **hp), data, clip=ref_clip or clip)
    opt = wrap(cls(model.parameters(), **hp), offload(model), grads, **kw)
    norms = train(model, opt, data, clip=clip)
    assert max_diff(ref, init) > 1e-2  # the run moved the weights, so agreement means something
    return ref, model, opt, ref_norms, norms


def torch_clip(model, opt):
    return torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)


def own_clip(model, opt):
    return opt.clip_grad_norm_(0.3)


@pytest.mark.parametrize("grads", ["device", "host"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_matches_torch_adamw(grads, weight_decay):
    ref, model, *_ = run_pair(grads, hp=dict(weight_decay=weight_decay))
    assert max_diff(ref, model) < TOL


@pytest.mark.parametrize("cls,maximize", [(torch.optim.Adam, False), (torch.optim.Adam, True),
                                          (torch.optim.AdamW, True)])
def test_adam_l2_and_maximize(cls, maximize):
    ref, model, *_ = run_pair(cls=cls, hp=dict(weight_decay=0.1, maximize=maximize))
    assert max_diff(ref, model) < TOL


def test_clip_device_mode_with_torch_clip():
    ref, model, _, ref_norms, norms = run_pair("device", clip=torch_clip)
    assert max(n.item() for n in ref_norms) > 0.3  # clipping was active
    assert max_diff(ref, model) < TOL


@pytest.mark.parametrize("grads", ["device", "host"])
def test_clip_with_optimizer_clip(grads):
    # mixed offload: the norm spans device grads (biases, norm) and host grads (weights)
    def weights(m):
        return [p for n, p in m.named_parameters() if n.endswith("weight") and p.dim() == 2]

    ref, model, opt, ref_norms, norms = run_pair(grads, offload=weights, clip=own_clip, ref_clip=torch_clip)
    assert torch.equal(norms[0], ref_norms[0])  # same grads at step 1, same maths: bit-identical
    torch.testing.assert_close(torch.stack(norms), torch.stack(ref_norms), rtol=1e-5, atol=0)
    assert max(n.item() for n in ref_norms) > 0.3
    assert max_diff(ref, model) < TOL
    assert OffloadedAdamW.clip_grad_norm is OffloadedAdamW.clip_grad_norm_


def test_host_mode_frees_device_grads():
    model = make_model()
    offload = list(model.parameters())[:2]
    opt = wrap(torch.optim.AdamW(model.parameters(), **HP), offload, "host")
    backward(model, make_data(1)[0])
    # autograd's slot is freed; p.grad shows the host gradient (a CPU tensor shaped like p), so clipping sees it
    assert all(device_grad(p) is None for p in offload)
    assert all(p.grad is not None and p.grad.device.type == "cpu" and p.grad.shape == p.shape for p in offload)
    assert all(p.grad is not None for p in list(model.parameters())[2:])
    opt.step()
    assert all(p.grad is None for p in offload)  # the step took them


@pytest.mark.parametrize("grads,slots", [("device", 4), ("host", 2), ("host", 64)])
def test_gradient_accumulation(grads, slots):
    ref, model, *_ = run_pair(grads, micro=4, grad_staging_slots=slots)
    assert max_diff(ref, model) < TOL


@pytest.mark.parametrize("slots", [2, 64])
def test_host_accumulation_bit_exact(slots):
    """Host sums add the terms in autograd's order, as torch's accumulation does: same bits.

    2 slots: the ring wraps inside each micro-batch; 64: every term waits in the ring until the step.
    """
    ref, model = make_model(), make_model()
    opt = wrap(torch.optim.AdamW(model.parameters(), **HP), list(model.parameters()), "host",
               grad_staging_slots=slots)
    d = make_data(1, micro=4)[0]
    backward(ref, d)
    backward(model, d)
    host = opt.host_grads()
    assert all(torch.equal(host[p], q.grad) for p, q in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("grads", ["device", "host"])
@pytest.mark.parametrize("flags", [{}, {"foreach": False}, {"fused": True}])
def test_mixed_offload(grads, flags):
    ref, model, opt, *_ = run_pair(grads, offload=lambda m: [m[0].weight, m[2].weight, m[4].bias],
                                   hp=dict(weight_decay=0.05, **flags))
    assert max_diff(ref, model) < TOL
    assert opt.stats()["offloaded_params"] == 3 and opt.stats()["device_params"] == 5
    for k, v in flags.items():  # the user's kernel choice reaches the device optimizer
        assert opt._device_opt.defaults[k] == v


@pytest.mark.parametrize("dtype,grads", [(torch.bfloat16, "device"), (torch.bfloat16, "host"),
                                         (torch.float16, "device")])
def test_low_precision_device_params(dtype, grads):
    """Master weights track an fp32 AdamW fed the same gradients; the device copy is the rounded master."""
    model = make_model(dtype=dtype)
    ref = copy.deepcopy(model).float()
    ref_opt = torch.optim.AdamW(ref.parameters(), weight_decay=0.1, **HP)
    opt = wrap(torch.optim.AdamW(model.parameters(), weight_decay=0.1, **HP), list(model.parameters()), grads)
    for d in make_data():
        opt.zero_grad()
        backward(model, d)
        for p, q in zip(model.parameters(), ref.parameters()):
            q.grad = p.grad.float() if p.grad is not None else None
        if grads == "host":  # the hook moved them: read the host sums instead
            host = opt.host_grads()
            for p, q in zip(model.parameters(), ref.parameters()):
                q.grad = host[p].float()  # bf16 first terms stay bf16 on the host
        opt.step()
        ref_opt.step()
    master = opt.master_params()
    assert max((master[p] - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())) < TOL
    assert max_diff(ref, make_model()) > 1e-2
    for p in model.parameters():
        assert p.dtype == dtype and torch.equal(p.data, master[p].to(dtype))


@pytest.mark.parametrize("dtype,grads", [(torch.float32, "device"), (torch.bfloat16, "device"),
                                         (torch.bfloat16, "host")])
def test_param_sink(dtype, grads):
    """A pager owns the weights (empty placeholders while paged out, as the weight pager does): the step
    writes the sinks and never touches p.data."""
    model = make_model(dtype=dtype)
    ref = copy.deepcopy(model).float()
    ref_opt = torch.optim.AdamW(ref.parameters(), weight_decay=0.1, **HP)
    paged = [model[0].weight, model[2].weight, model[4].bias]
    sinks = {p: p.detach().clone() for p in paged}
    w = model[2].weight  # a strided sink: the bf16 path must fall back from the in-kernel write
    sinks[w] = torch.empty(w.shape[::-1], dtype=dtype).t().copy_(w.detach())

    def page_out():
        for p in paged:
            p.data = torch.empty(0, dtype=dtype)

    page_out()  # wrapped after the pager installed its placeholders
    opt = wrap(torch.optim.AdamW(model.parameters(), weight_decay=0.1, **HP), paged, grads, param_sink=sinks)
    for d in make_data():
        for p in paged:
            p.data = sinks[p].clone()
        opt.zero_grad()
        backward(model, d)
        page_out()
        host = opt.host_grads()
        for p, q in zip(model.parameters(), ref.parameters()):
            q.grad = host[p].float() if p in host else p.grad.float()
        opt.step()
        ref_opt.step()
        assert all(p.numel() == 0 for p in paged)
    master = opt.master_params()
    for p, q in zip(model.parameters(), ref.parameters()):
        if p in sinks:
            assert (master[p] - q).abs().max().item() < TOL
        elif dtype == torch.float32:  # bf16 device params are stepped in bf16 by torch: not comparable
            assert (p - q).abs().max().item() < TOL
    for p in paged:
        assert torch.equal(sinks[p], master[p].to(dtype))
    assert max_diff(ref, make_model()) > 1e-2
    assert opt.state_dict()["state"][0]["exp_avg"].shape == sinks[paged[0]].shape


@pytest.mark.parametrize("dtype,grads", [(torch.float32, "device"), (torch.float32, "host"),
                                         (torch.bfloat16, "device")])
def test_state_dict_round_trip(dtype, grads):
    """10 steps, save, load into a fresh wrap of a fresh model, 10 steps == 20 uninterrupted, bit for bit."""
    data = make_data()
    hp = dict(weight_decay=0.1, **HP)

    def offload(m):  # mixed, so the device optimizer's state travels too
        return [m[0].weight, m[2].weight, m[2].bias, m[4].weight]

    full = make_model(dtype=dtype)
    full_opt = wrap(torch.optim.AdamW(full.parameters(), **hp), offload(full), grads)
    train(full, full_opt, data, clip=own_clip)

    first = make_model(dtype=dtype)
    first_opt = wrap(torch.optim.AdamW(first.parameters(), **hp), offload(first), grads)
    train(first, first_opt, data[:10], clip=own_clip)
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "optim": first_opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)

    second = make_model(seed=5, dtype=dtype)
    second.load_state_dict(ckpt["model"])
    second_opt = wrap(torch.optim.AdamW(second.parameters(), **hp), offload(second), grads)
    second_opt.load_state_dict(ckpt["optim"])
    train(second, second_opt, data[10:], clip=own_clip)

    for p, q in zip(full.parameters(), second.parameters()):
        assert torch.equal(p, q)
    a, b = full_opt.state_dict(), second_opt.state_dict()
    assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        assert a["state"][i].keys() == b["state"][i].keys()
        assert all(torch.equal(a["state"][i][k].cpu(), b["state"][i][k].cpu()) for k in a["state"][i])
    # torch's layout: same indices and keys; 'master' only where the device dtype is not fp32
    ref = make_model(dtype=dtype)
    ref_opt = torch.optim.AdamW(ref.parameters(), **hp)
    train(ref, ref_opt, data[:1])
    r = ref_opt.state_dict()
    assert r["param_groups"] == b["param_groups"] and r["state"].keys() == b["state"].keys()
    off = {id(p) for p in offload(second)}
    for i, p in enumerate(second.parameters()):
        extra = {"master"} if id(p) in off and dtype != torch.float32 else set()
        assert b["state"][i].keys() == r["state"][i].keys() | extra
        if id(p) in off:
            assert b["state"][i]["exp_avg"].device.type == "cpu" and b["state"][i]["exp_avg"].shape == p.shape


@pytest.mark.parametrize("how", ["wrap_stepped", "load_torch_state"])
def test_continues_torch_adamw(how):
    """An optimizer trained by torch (wrapped afterwards, or its state dict loaded) continues seamlessly."""
    data = make_data()
    ref = make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), weight_decay=0.1, **HP)
    train(ref, ref_opt, data[:10])
    model = copy.deepcopy(ref)
    if how == "wrap_stepped":
        inner = torch.optim.AdamW(model.parameters(), weight_decay=0.1, **HP)
        inner.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # torch's load keeps the tensors
        opt = wrap(inner, [model[0].weight, model[2].weight])
    else:
        opt = wrap(torch.optim.AdamW(model.parameters(), weight_decay=0.1, **HP), [model[0].weight, model[2].weight])
        opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    train(ref, ref_opt, data[10:])
    train(model, opt, data[10:])
    assert max_diff(ref, model) < TOL


def test_is_an_optimizer_sharing_groups():
    model = make_model()
    inner = torch.optim.AdamW([{"params": list(model.parameters())[:4], "lr": 1e-3},
                               {"params": list(model.parameters())[4:], "weight_decay": 0.2}], **HP)
    opt = wrap(inner, list(model.parameters())[::2])
    assert isinstance(opt, torch.optim.Optimizer)
    assert all(a is b for a, b in zip(opt.param_groups, inner.param_groups)) and opt.defaults is inner.defaults
    before = [p.detach().clone() for p in model.parameters()]
    for g in inner.param_groups:  # a scheduler writing the shared dicts steers both halves
        g["lr"] = 0.0
    backward(model, make_data(1)[0])
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(NotImplementedError, match="before wrapping"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(3))]})


@pytest.mark.parametrize("grads", ["device", "host"])
def test_zero_grad_and_consumed_host_grads(grads):
    model = make_model()
    offload = list(model.parameters())[:4]
    opt = wrap(torch.optim.AdamW(model.parameters(), **HP), offload, grads)
    before = [p.detach().clone() for p in model.parameters()]
    backward(model, make_data(1)[0])
    opt.zero_grad()
    opt.step()  # nothing to apply
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert len(opt.state_dict()["state"]) == 0  # no step taken, as torch
    backward(model, make_data(1)[0])
    opt.step()
    after = [p.detach().clone() for p in offload]
    opt.step()  # device mode: p.grad is still there and applies again (as torch); host mode: consumed
    moved = [not torch.equal(a, p) for a, p in zip(after, offload)]
    assert all(moved) if grads == "device" else not any(moved)


@pytest.mark.parametrize("grads", ["device", "host"])
def test_stats_and_release(grads):
    model = make_model()
    offload = list(model.parameters())[:4]
    opt = wrap(torch.optim.AdamW(model.parameters(), **HP), offload, grads)
    train(model, opt, make_data(2, micro=2))
    n = sum(p.numel() for p in offload)
    s = opt.stats()
    assert s["step"] == 2 and s["d2h_bytes"] == 4 * n * (2 if grads == "host" else 1) and s["h2d_bytes"] == 4 * n
    assert s["adam_seconds"] > 0 and s["step_seconds"] >= s["adam_seconds"] and s["offloaded_numel"] == n
    with torch.no_grad():
        offload[0].zero_()  # release() must restore the master
    opt.release()
    master = opt.master_params()
    assert all(torch.equal(p, master[p]) for p in offload)
    backward(model, make_data(1)[0])
    assert all(p.grad is not None for p in offload)  # hooks are gone
    with pytest.raises(RuntimeError, match="after release"):
        opt.step()


def test_bad_input():
    model = make_model()
    ps = list(model.parameters())
    with pytest.raises(TypeError, match="torch.optim.AdamW or torch.optim.Adam"):
        wrap(torch.optim.SGD(ps, lr=0.1), ps)

    class MyAdamW(torch.optim.AdamW):
        pass

    with pytest.raises(TypeError, match="exactly"):
        wrap(MyAdamW(ps), ps)
    for flag in ("amsgrad", "capturable", "differentiable"):
        with pytest.raises(ValueError, match=f"{flag}=False"):
            wrap(torch.optim.AdamW(ps, **{flag: True}), ps)
    with pytest.raises(ValueError, match="grads must be"):
        wrap(torch.optim.AdamW(ps), ps, grads="gpu")
    with pytest.raises(ValueError, match="must be in the optimizer"):
        wrap(torch.optim.AdamW(ps[1:]), ps[:1])
    with pytest.raises(ValueError, match="param_sink"):
        wrap(torch.optim.AdamW(ps), ps[:1], param_sink={ps[0]: torch.randn(3)})

    # bad gradient: the step fails before anything (device or offloaded) changes
    opt = wrap(torch.optim.AdamW(ps, **HP), ps[2:])
    backward(model, make_data(1)[0])
    before = [p.detach().clone() for p in ps]
    bias = ps[3]
    bias.grad = bias.grad.to_sparse()
    with pytest.raises(ValueError, match="sparse"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, ps)) and not opt.state
    bad = opt.state_dict()
    bad["param_groups"][0]["amsgrad"] = True
    with pytest.raises(ValueError, match="amsgrad=False"):
        opt.load_state_dict(bad)
    assert opt.param_groups[0]["amsgrad"] is False


def test_tiny_llama_trainer_loop():
    """A real transformers model: host grads, accumulation, optimizer clipping, warmup schedule."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                   max_position_embeddings=64, attn_implementation="eager")

    def build():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(cfg)

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg.vocab_size, (STEPS, 2, 2, 16), generator=g)

    def run(model, opt, clip):
        sched = transformers.get_linear_schedule_with_warmup(opt, num_warmup_steps=4, num_training_steps=STEPS)
        lrs = []
        for step_ids in ids:
            for mb in step_ids:
                (model(input_ids=mb, labels=mb).loss / len(step_ids)).backward()
            clip(model, opt)
            opt.step()
            sched.step()
            opt.zero_grad()
            lrs.append(opt.param_groups[0]["lr"])
        return lrs

    hp = dict(lr=2e-3, weight_decay=0.01)
    ref = build()
    ref_lrs = run(ref, torch.optim.AdamW(ref.parameters(), **hp),
                  lambda m, o: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0))
    model = build()
    blocks = [p for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2]
    opt = wrap(torch.optim.AdamW(model.parameters(), **hp), blocks, "host")
    lrs = run(model, opt, lambda m, o: o.clip_grad_norm(1.0))
    assert lrs == ref_lrs and lrs[3] > lrs[0] > 0
    assert max_diff(ref, model) < TOL
    assert max_diff(ref, build()) > 1e-2


@pytest.mark.parametrize("micro", [1, 3])
def test_host_grads_bf16_first_term_unconverted(micro):
    """Host mode, bf16 parameters: one micro-batch leaves the gradient in bf16 on the host (no conversion in the hook
    path; the kernel reads bf16); more micro-batches sum in fp32, exactly the fp32 sum of the bf16 terms in order."""
    model = make_model(dtype=torch.bfloat16)
    ref = copy.deepcopy(model)
    opt = wrap(torch.optim.AdamW(model.parameters(), **HP), list(model.parameters()), "host")
    data = make_data(steps=1, micro=micro)[0]
    backward(model, data)
    host = opt.host_grads()
    expected = {}
    for x, y in zip(*data):  # the same terms, one at a time, summed in fp32 in autograd's order
        ref.zero_grad()
        (nn.functional.mse_loss(ref(x.to(torch.bfloat16)).float(), y) / micro).backward()
        for p in ref.parameters():
            expected[p] = expected[p] + p.grad.float() if p in expected else p.grad.float()
    for p, q in zip(model.parameters(), ref.parameters()):
        g = host[p].view(p.shape)
        assert g.dtype == (torch.bfloat16 if micro == 1 else torch.float32)
        want = expected[q].to(torch.bfloat16) if micro == 1 else expected[q]
        assert torch.equal(g, want)


def test_lr_set_after_load_state_dict_reaches_the_device_parameters():
    """A scheduler's lr after load_state_dict (Accelerate's prepare loads one into every Trainer's optimizer)
    reaches the parameters that stay on the device optimizer, not only the offloaded ones."""
    data = make_data(steps=6)
    models, opts = [], []
    for load in (False, True):
        m = make_model()
        opt = wrap(torch.optim.AdamW(m.parameters(), **HP), [m[0].weight, m[2].weight])
        if load:
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 10 * s))
        train(m, opt, data, sched=sched)
        models.append(m)
        opts.append(opt)
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)
    assert opts[1]._device_opt.param_groups[0]["lr"] < HP["lr"]  # the schedule reached the device optimizer


# -- the device share: resident and streamed parameters (engine/device_adamw.py) --------------------------------
def split(model):
    """Every parameter offloaded: first layer resident, second streamed, the rest on the CPU kernel."""
    ps = list(model.parameters())
    return ps, {"resident": ps[:2], "streamed": ps[2:4]}


def train_split(model, cls=torch.optim.AdamW, grads="device", micro=1, clip=own_clip, sched=True, hp=None,
                shares=split, **kw):
    hp = {**HP, **(hp or {})}
    offload, where = shares(model)
    opt = wrap(cls(model.parameters(), **hp), offload, grads, **where, **kw)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5)) if sched else None
    norms = train(model, opt, make_data(micro=micro), clip=clip, sched=schedule)
    return opt, norms


@pytest.mark.parametrize("grads,micro", [("device", 1), ("host", 1), ("device", 2), ("host", 3)])
@pytest.mark.parametrize("chunk", [1 << 20, 100])
def test_device_share_matches_torch_adamw(grads, micro, chunk):
    """Resident, streamed and CPU-stepped parameters together: torch.optim.AdamW's result to < 1e-6 after 20 steps
    with weight decay, clipping that triggers, a warm-up schedule and accumulation; chunk 100: parameters span
    several chunks and the ring of 3 buffers wraps."""
    hp = dict(weight_decay=0.1)
    ref = make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP, **hp)
    sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: min(1.0, (s + 1) / 5))
    ref_norms = train(ref, ref_opt, make_data(micro=micro), clip=torch_clip, sched=sched)
    model = make_model()
    opt, norms = train_split(model, grads=grads, micro=micro, hp=hp, device_chunk_numel=chunk)
    assert max(n.item() for n in ref_norms) > 0.3  # clipping was active
    assert max_diff(ref, model) < TOL
    st = opt.stats()
    assert st["resident_numel"] == 16 * 48 + 48 and st["streamed_numel"] == 48 * 48 + 48
    assert st["device_state_bytes"] >= 12 * st["resident_numel"]
    assert st["h2d_bytes"] >= 12 * st["streamed_numel"] and st["d2h_bytes"] >= 12 * st["streamed_numel"]


@pytest.mark.parametrize("cls,maximize,dtype", [(torch.optim.Adam, False, torch.float32),
                                                (torch.optim.Adam, True, torch.bfloat16),
                                                (torch.optim.AdamW, True, torch.float16),
                                                (torch.optim.AdamW, False, torch.bfloat16)])
def test_device_share_same_bits_as_cpu_share(cls, maximize, dtype):
    """Whichever share steps a parameter, it ends with the same bits (weights, masters, moments): the device share
    calls the same op (here its CPU kernel; tests/gpu/test_adamw_cuda.py compares the CUDA kernel)."""
    hp = dict(weight_decay=0.1, maximize=maximize)
    host, dev = make_model(dtype=dtype), make_model(dtype=dtype)
    host_opt, _ = train_split(host, cls, hp=hp, shares=lambda m: (list(m.parameters()), {}))
    dev_opt, _ = train_split(dev, cls, hp=hp, device_chunk_numel=64)
    for p, q in zip(host.parameters(), dev.parameters()):
        assert torch.equal(p, q)
    a, b = host_opt.state_dict(), dev_opt.state_dict()
    for i in a["state"]:
        assert a["state"][i].keys() == b["state"][i].keys()
        assert all(torch.equal(a["state"][i][k], b["state"][i][k]) for k in a["state"][i])


@pytest.mark.parametrize("grads", ["device", "host"])
def test_device_share_state_dict_resume_bit_identical(grads):
    data, hp = make_data(), dict(weight_decay=0.1, **HP)

    def build(seed=0):
        m = make_model(seed=seed, dtype=torch.bfloat16)
        offload, where = split(m)
        return m, wrap(torch.optim.AdamW(m.parameters(), **hp), offload, grads, **where, device_chunk_numel=100)

    full, full_opt = build()
    train(full, full_opt, data, clip=own_clip)
    first, first_opt = build()
    train(first, first_opt, data[:10], clip=own_clip)
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "optim": first_opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)
    assert {"master", "exp_avg", "exp_avg_sq", "step"} == set(ckpt["optim"]["state"][0])  # resident: master kept
    second, second_opt = build(seed=5)
    second.load_state_dict(ckpt["model"])
    second_opt.load_state_dict(ckpt["optim"])
    train(second, second_opt, data[10:], clip=own_clip)
    for p, q in zip(full.parameters(), second.parameters()):
        assert torch.equal(p, q)
    a, b = full_opt.state_dict(), second_opt.state_dict()
    for i in a["state"]:
        assert all(torch.equal(a["state"][i][k], b["state"][i][k]) for k in a["state"][i])


def test_device_share_with_optimizer_in_backward():
    """The CPU share updates in backward; resident and streamed parameters at step(), their gradients untouched."""
    ref = make_model()
    train(ref, torch.optim.AdamW(ref.parameters(), **HP), make_data())
    model = make_model()
    offload, where = split(model)
    opt = wrap(torch.optim.AdamW(model.parameters(), **HP), offload, "host", overlap_step=True,
               optimizer_in_backward=True, **where)
    for d in make_data():
        opt.zero_grad()
        backward(model, d)
        opt.step()
        opt.synchronize()  # the CPU share's worker is done before the next forward reads (wrap's hooks wait per block)
    assert max_diff(ref, model) < TOL


def test_device_share_release_and_master_params():
    model = make_model(dtype=torch.bfloat16)
    opt, _ = train_split(model, clip=None, sched=False)
    masters = opt.master_params()
    p0 = list(model.parameters())[0]
    assert masters[p0].dtype == torch.float32 and torch.equal(masters[p0].to(torch.bfloat16), p0.detach())
    opt.release()
    assert torch.equal(p0.detach(), masters[p0].to(torch.bfloat16))


@pytest.mark.parametrize("case,msg", [
    ("not_offloaded", "must be offloaded ones"), ("both", "both resident and streamed"),
    ("sink", "cannot have a param_sink"), ("grad", "gradient of a device-stepped parameter"),
])
def test_device_share_bad_input(case, msg):
    model = make_model()
    ps = list(model.parameters())
    kw = dict(resident=ps[:2], streamed=ps[2:4])
    offload = ps
    if case == "not_offloaded":
        offload = ps[1:]
    elif case == "both":
        kw["streamed"] = ps[1:4]
    elif case == "sink":
        kw["param_sink"] = {ps[0]: torch.zeros_like(ps[0])}
    if case != "grad":
        with pytest.raises(ValueError, match=msg):
            wrap(torch.optim.AdamW(model.parameters(), **HP), offload, **kw)
        return
    opt = wrap(torch.optim.AdamW(model.parameters(), **HP), offload, **kw)
    before = [p.detach().clone() for p in ps]
    backward(model, make_data(1)[0])
    ps[2].grad = torch.zeros(48, 48).to_sparse()  # (torch refuses a wrong shape or dtype itself)
    with pytest.raises(ValueError, match=msg):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(ps, before))  # nothing stepped


def test_device_share_in_backward_refuses_a_second_gradient():
    model = make_model()
    offload, where = split(model)
    opt = wrap(torch.optim.AdamW(model.parameters(), **HP), offload, "host", overlap_step=True,
               optimizer_in_backward=True, resident=where["resident"], streamed=where["streamed"])
    d = make_data(1, micro=2)[0]
    x, y = d[0][0], d[1][0]
    nn.functional.mse_loss(model(x), y).backward()
    step0 = [s.step.item() for s in opt._device_slots]
    assert step0 == [1.0] * 4  # the device share stepped from its hooks, in backward
    with pytest.raises(RuntimeError, match="second gradient before optimizer.step"):
        nn.functional.mse_loss(model(x), y).backward()


# -- moments="bfloat16": the CPU share's moments stochastically rounded (opt-in approximation) --------------------
def test_bf16_moments_track_exact_adamw_and_halve_the_moment_bytes():
    """Contract: every offloaded parameter's moments are bf16 (state_dict shows them so), the stochastic rounding
    seeded per parameter; after 20 steps with clipping and weight decay the weights stay within 2% of the update
    they made under exact AdamW, and resuming from a state dict is bit-identical."""
    hp = dict(weight_decay=0.1, **HP)
    data = make_data()
    init, exact, approx = make_model(), make_model(), make_model()
    train(exact, wrap(torch.optim.AdamW(exact.parameters(), **hp), list(exact.parameters())), data, clip=own_clip)
    opt = wrap(torch.optim.AdamW(approx.parameters(), **hp), list(approx.parameters()), moments="bfloat16")
    train(approx, opt, data, clip=own_clip)
    moved = max_diff(exact, init)
    assert 0 < max_diff(exact, approx) < 0.02 * moved
    st = opt.state_dict()["state"]
    assert all(e["exp_avg"].dtype == torch.bfloat16 == e["exp_avg_sq"].dtype for e in st.values())
    exact_bytes = wrap(torch.optim.AdamW(init.parameters(), **hp), list(init.parameters())).stats()["host_bytes"]
    numel = sum(p.numel() for p in init.parameters())
    assert exact_bytes - opt.stats()["host_bytes"] == 4 * numel and opt.stats()["moments"] == "bfloat16"

    def run(steps, ckpt=None):
        m = make_model()
        o = wrap(torch.optim.AdamW(m.parameters(), **hp), list(m.parameters()), moments="bfloat16")
        if ckpt is not None:
            m.load_state_dict(ckpt[0])
            o.load_state_dict(ckpt[1])
        train(m, o, steps, clip=own_clip)
        return m, o

    full, _ = run(data)
    first, first_opt = run(data[:10])
    buf = io.BytesIO()
    torch.save((first.state_dict(), first_opt.state_dict()), buf)
    buf.seek(0)
    second, _ = run(data[10:], torch.load(buf))
    assert all(torch.equal(p, q) for p, q in zip(full.parameters(), second.parameters()))


def test_bf16_moments_refuse_the_device_share_and_unknown_names():
    model = make_model()
    ps = list(model.parameters())
    with pytest.raises(ValueError, match="moments='bfloat16' is for parameters stepped on the CPU"):
        wrap(torch.optim.AdamW(model.parameters(), **HP), ps, moments="bfloat16", resident=ps[:1])
    with pytest.raises(ValueError, match="moments: 'float32' .* or 'bfloat16'"):
        wrap(torch.optim.AdamW(model.parameters(), **HP), ps, moments="fp8")


def test_host_mode_bf16_accumulator_only_when_a_second_term_comes():
    """Host gradients of bf16 parameters: the first term waits in a bf16 buffer; the fp32 accumulator (4 bytes a
    parameter) is made only when gradient accumulation brings a second term."""
    model = make_model(dtype=torch.bfloat16)
    ps = list(model.parameters())
    numel = sum(p.numel() for p in ps)
    opt = wrap(torch.optim.AdamW(model.parameters(), **HP), ps, "host")
    assert opt._grads.nbytes() == 2 * numel
    backward(model, make_data(1)[0])
    opt.step()
    assert opt._grads.nbytes() == 2 * numel  # one micro-batch: never made
    opt.zero_grad()
    backward(model, make_data(1, micro=2)[0])
    opt.step()
    assert opt._grads.nbytes() >= 6 * numel  # accumulation: made (plus the staging ring)
