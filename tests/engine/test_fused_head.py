"""The fused head (LM head and loss in row chunks, no full logits): transformers' loss and gradients, as maths."""
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Gemma2Config, Gemma2ForCausalLM
from transformers.loss.loss_utils import ForCausalLMLoss

import trainstream_hf as ts
from trainstream_hf.engine import head as head_mod
from trainstream_hf.engine.head import FusedHead, fused_head_loss
from tests.reliability.tiny import tiny_llama


def _case(vocab=100, hidden=32, batch=2, seq=23, ignore_frac=0.2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, hidden, generator=g)
    lin = torch.nn.Linear(hidden, vocab, bias=False)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[torch.rand(batch, seq, generator=g) < ignore_frac] = -100
    return x, lin, labels


@pytest.mark.parametrize("items", [None, 29])
@pytest.mark.parametrize("trainable_head", [False, True])
def test_loss_and_gradients_match_transformers(items, trainable_head, monkeypatch):
    monkeypatch.setattr(head_mod, "FUSED_CHUNK_BYTES", 16 * 4 * 100)  # 16 rows a chunk: several, a ragged last one
    x, lin, labels = _case()
    lin.weight.requires_grad_(trainable_head)
    kw = {} if items is None else {"num_items_in_batch": torch.tensor(items)}
    a = x.clone().requires_grad_(True)
    ref = ForCausalLMLoss(logits=lin(a), labels=labels, vocab_size=100, **kw)
    ref.backward()
    ref_w = None if not trainable_head else lin.weight.grad.clone()
    lin.weight.grad = None
    b = x.clone().requires_grad_(True)
    got = fused_head_loss(b, lin, labels, 100, params=list(lin.parameters()), **kw)
    got.backward()
    # fp32 throughout (transformers upcasts the logits): the loss is summed chunk by chunk, so equal to rounding
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-8)
    if trainable_head:
        torch.testing.assert_close(lin.weight.grad, ref_w, rtol=1e-5, atol=1e-8)
    with torch.no_grad():  # evaluation: no gradient machinery, same value
        torch.testing.assert_close(fused_head_loss(x, lin, labels, 100, **kw), ref.detach(), rtol=1e-6, atol=0)


def _batch(seq=16, seed=3):
    ids = torch.randint(0, 100, (2, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def test_wrapped_training_forward_uses_it_and_trains_the_same():
    """fused_loss=True under wrap: the loss and every LoRA gradient as without it (fp32), logits None in training,
    real logits in evaluation, and unwrap takes it all away."""
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    ref_model = get_peft_model(tiny_llama(), cfg)
    model = get_peft_model(tiny_llama(), cfg)
    model.load_state_dict(ref_model.state_dict())
    batch = _batch()
    ref = ref_model(**batch)
    ref.loss.backward()
    model, _ = ts.wrap(model, None, device="cpu", vram_budget="8GiB", fused_loss=True, batch_shape=(2, 16))
    out = model(**batch)
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=0)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    ref_grads = {n: p.grad for n, p in ref_model.named_parameters() if p.requires_grad}
    assert grads.keys() == ref_grads.keys() and len(grads) == 12
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        ev = model(**batch)
    assert ev.logits is not None and ev.logits.shape == (2, 16, 100)
    model.eval()
    assert model(**batch).logits is not None  # eval mode: the plain path
    model.train()
    tup = model(**batch, return_dict=False)
    assert tup[1] is None and torch.is_tensor(tup[0])
    base = model.get_base_model()
    ts.unwrap(model)
    assert "forward" not in base.lm_head.__dict__ and "_loss_function" not in base.__dict__
    assert model(**batch).logits is not None


def test_auto_takes_it_only_for_large_logits():
    model = tiny_llama()
    model, _ = ts.wrap(model, None, device="cpu", vram_budget="8GiB", batch_shape=(2, 16))
    from trainstream_hf.wrap import engine_of
    fused = engine_of(model).fused_head
    assert fused is not None and fused.mode == "auto"
    itemsize = model.lm_head.weight.element_size()
    edge = head_mod.FUSED_MIN_BYTES // (100 * itemsize)
    assert not fused.active_for(edge - 1) and fused.active_for(edge + 1)
    assert model(**_batch()).logits is not None  # 32 tokens: far below the threshold, the exact path
    ts.unwrap(model)


def _gemma2(softcap):
    torch.manual_seed(0)
    return Gemma2ForCausalLM(Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=100,
                                          max_position_embeddings=32, final_logit_softcapping=softcap))


def test_a_model_that_changes_its_logits_is_left_alone_or_fails_loudly():
    from trainstream_hf.wrap import engine_of

    model, _ = ts.wrap(_gemma2(30.0), None, device="cpu", vram_budget="8GiB", batch_shape=(2, 16))
    assert engine_of(model).fused_head is None  # auto: soft-capping, so not installed
    assert model(**_batch()).logits is not None
    ts.unwrap(model)
    model, _ = ts.wrap(_gemma2(30.0), None, device="cpu", vram_budget="8GiB", batch_shape=(2, 16), fused_loss=True)
    with pytest.raises(RuntimeError, match="changes its logits between the LM head and the loss.*fused_loss=False"):
        model(**_batch())
    with torch.no_grad():  # the failed call left nothing behind
        assert model(**_batch()).logits is not None
    ts.unwrap(model)


def test_the_plan_counts_chunks_not_the_logits(monkeypatch):
    from trainstream_hf.wrap import engine_of

    monkeypatch.setattr(head_mod, "FUSED_CHUNK_BYTES", 64 * 4 * 100)  # 64 rows a chunk

    model, _ = ts.wrap(tiny_llama(), None, device="cpu", vram_budget="8GiB", batch_shape=(1, 4096), fused_loss=True)
    pl = engine_of(model).plan
    assert pl.logits_bytes == head_mod.fused_head_bytes(4096, 64, 100, 4) == 4096 * 64 * 4 + 4 * 64 * 100 * 4
    ts.unwrap(model)
    model, _ = ts.wrap(tiny_llama(), None, device="cpu", vram_budget="8GiB", batch_shape=(1, 4096), fused_loss=False)
    assert engine_of(model).plan.logits_bytes == 4096 * 100 * (4 + 4 + 4)
    ts.unwrap(model)
