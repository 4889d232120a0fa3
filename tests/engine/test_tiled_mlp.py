"""Token-tiled MLPs: the MLP's output and every gradient as the whole-sequence MLP's (fp32), taken only where asked."""
import pytest
import torch
from peft import LoraConfig, get_peft_model

import trainstream_hf as ts
from trainstream_hf.engine import tiled
from trainstream_hf.engine.tiled import TiledMLP
from trainstream_hf.wrap import engine_of
from tests.reliability.tiny import tiny_llama


def _count_tiled(monkeypatch) -> list:
    calls = []
    apply = tiled._Tiled.apply

    def counting(x, forward, rows, *params):
        calls.append((x.shape[0], rows))
        return apply(x, forward, rows, *params)
    monkeypatch.setattr(tiled._Tiled, "apply", counting)
    return calls


def _lora(dropout=0.0):
    model = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                                                    target_modules=["gate_proj", "up_proj", "down_proj", "q_proj"]))
    with torch.no_grad():  # B starts at zero: give it values, so that every LoRA gradient is non-trivial
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(hash(n) % 1000))
    return model


def _batch(seq=16):
    ids = torch.randint(0, 100, (2, seq), generator=torch.Generator().manual_seed(5))
    return {"input_ids": ids, "labels": ids.clone()}


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_tiles_give_the_whole_mlps_loss_and_gradients(monkeypatch):
    monkeypatch.setattr(tiled, "TILE_BYTES", 5 * 128 * 4)  # 5 rows a tile: 7 tiles of 32 tokens, a ragged last one
    calls = _count_tiled(monkeypatch)
    ref = _lora()
    loss = ref(**_batch()).loss
    loss.backward()
    model = _lora()
    t = TiledMLP(True)
    assert t.install(model.get_base_model().model.layers) == 2
    got = model(**_batch()).loss
    got.backward()
    assert calls == [(32, 5), (32, 5)]
    torch.testing.assert_close(got, loss, rtol=1e-6, atol=0)
    a, b = _grads(model), _grads(ref)
    assert a.keys() == b.keys() and len(a) == 16
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=1e-5, atol=1e-8)
    t.uninstall()
    assert all("forward" not in layer.mlp.__dict__ for layer in model.get_base_model().model.layers)


def test_taken_only_in_training_above_the_threshold_and_without_dropout(monkeypatch):
    calls = _count_tiled(monkeypatch)
    model = _lora()
    model, _ = ts.wrap(model, None, device="cpu", vram_budget="8GiB", batch_shape=(2, 16))
    t = engine_of(model).tiled
    assert t is not None and t.mode == "auto" and len(t.modules) == 2
    edge = tiled.MIN_BYTES // (128 * 4)
    mlp = t.modules[0]
    assert not t.active_for(mlp, edge - 1, 4) and t.active_for(mlp, edge, 4)
    model(**_batch()).loss.backward()
    assert calls == []  # 32 tokens: the MLP runs whole
    ts.unwrap(model)
    model, _ = ts.wrap(model, None, device="cpu", vram_budget="8GiB", batch_shape=(2, 16), tiled_mlp=True)
    calls.clear()  # (the plan's block measurement runs the tiled MLP too)
    model(**_batch()).loss.backward()
    assert calls == [(32, 32), (32, 32)]
    with torch.no_grad():
        model(**_batch())
    assert len(calls) == 2  # no gradient: nothing to save, the MLP runs whole
    ts.unwrap(model)
    dropped = _lora(dropout=0.1)
    dropped, _ = ts.wrap(dropped, None, device="cpu", vram_budget="8GiB", batch_shape=(2, 16), tiled_mlp=True)
    calls.clear()
    dropped(**_batch()).loss.backward()
    assert calls == []  # LoRA dropout in the MLP: a recomputed tile would draw other masks
    ts.unwrap(dropped)


@pytest.mark.parametrize("recompute", [True, False])
def test_under_the_engine_with_recompute_and_offload(recompute, monkeypatch):
    """wrap(tiled_mlp=True) with checkpointed or offloaded blocks trains as the plain model does."""
    monkeypatch.setattr(tiled, "TILE_BYTES", 6 * 128 * 4)
    ref = _lora()
    losses_ref = []
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        loss = ref(**_batch()).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses_ref.append(loss.item())
    model = _lora()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = ts.wrap(model, opt, device="cpu", vram_budget="8GiB", batch_shape=(2, 16), tiled_mlp=True,
                         recompute=recompute, offload_activations=not recompute, min_activation_bytes=0)
    losses = []
    for _ in range(3):
        loss = model(**_batch()).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses == pytest.approx(losses_ref, rel=1e-5)
    ts.unwrap(model)
