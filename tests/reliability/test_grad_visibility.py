"""torch's own clipping over ``model.parameters()`` sees every gradient, those kept in host RAM included (paged
trainable weights, offloaded optimizer state with grads='host'), and clipping then stepping trains as the plain
model does; a forced grads='device' the plan cannot honour is refused, never silently overridden."""
import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import trainstream_hf as ts
from trainstream_hf.engine.grads import device_grad

IDS = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
CASES = {
    "paged trainable weights": dict(page_weights=True, offload_optimizer=True, min_offload_numel=0),
    "host grads": dict(offload_optimizer=True, min_offload_numel=0, grads="host"),
    "host grads, accumulation": dict(offload_optimizer=True, min_offload_numel=0, grads="host"),
}


def _llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=100))


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("max_norm", [1e6, 0.5])
def test_torch_clip_grad_norm_sees_every_gradient(case, max_norm):
    micro = 2 if "accumulation" in case else 1
    ref = _llama()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    model, opt = ts.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), vram_budget="64GiB",
                         batch_shape=(2, 16), host_arena=None, **CASES[case])
    host_held = [p for p in model.parameters() if device_grad(p) is None]
    for step in range(3):
        for m in (ref, model):
            for k in range(micro):
                m(input_ids=IDS.roll(step + k, 1), labels=IDS.roll(step + k, 1)).loss.backward()
        if step == 0:
            assert host_held and all(device_grad(p) is None and p.grad is not None for p in host_held)
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        got = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
        assert all(p.grad is None for p in model.parameters())
    for p, q in zip(ts.unwrap(model).parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_zero_grad_drops_host_gradients():
    model = _llama()
    before = [p.detach().clone() for p in model.parameters()]
    model, opt = ts.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), vram_budget="64GiB",
                         batch_shape=(2, 16), host_arena=None, **CASES["paged trainable weights"])
    model(input_ids=IDS, labels=IDS).loss.backward()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    opt.step()  # nothing to apply
    ts.unwrap(model)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_forced_device_grads_that_cannot_hold_is_an_error():
    model = _llama()
    with pytest.raises(ValueError, match="grads='device' cannot be honoured.*grads='auto'"):
        ts.wrap(model, torch.optim.AdamW(model.parameters()), vram_budget="64GiB", host_arena=None,
                grads="device", **CASES["paged trainable weights"])
    assert ts.engine_of(model) is None


@pytest.mark.parametrize("case", ["paged trainable weights", "host grads"])
def test_manual_grad_scaler_unscales_skips_and_steps_as_plain(case):
    """A hand-written loop with torch.amp.GradScaler (fp32 weights, scaled loss): ``unscale_`` reaches the host-held
    gradients, an overflowing scale skips the step (no weight and no optimizer state moves) and the scaled steps
    after it give the plain model's weights."""
    ref = _llama()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    model, opt = ts.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), vram_budget="64GiB",
                         batch_shape=(2, 16), host_arena=None, **CASES[case])
    scalers = {id(m): torch.amp.GradScaler("cpu", init_scale=2.0 ** 127, growth_interval=1000) for m in (ref, model)}
    weights = lambda: [v.clone() for v in model.state_dict().values()]  # noqa: E731 (paged ones are empty outside use)
    start = weights()
    for step in range(12):
        for m, o in ((ref, ref_opt), (model, opt)):
            s = scalers[id(m)]
            s.scale(m(input_ids=IDS.roll(step, 1), labels=IDS.roll(step, 1)).loss).backward()
            s.unscale_(o)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            s.step(o)
            s.update()
            o.zero_grad()
        if step == 0:  # the loss times 2**127 overflows float32: the step was skipped
            assert scalers[id(model)].get_scale() == 2.0 ** 126
            assert all(torch.equal(p, q) for p, q in zip(weights(), start))
    assert scalers[id(model)].get_scale() == scalers[id(ref)].get_scale() > 2.0 ** 114  # later steps were taken
    assert not all(torch.equal(p, q) for p, q in zip(weights(), start))
    for p, q in zip(ts.unwrap(model).parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
