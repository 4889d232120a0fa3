"""The chunked causal-LM loss: transformers' ForCausalLMLoss bit for bit, loss and logits gradient."""
import pytest
import torch
from transformers.loss.loss_utils import ForCausalLMLoss

from trainstream_hf.engine import head
from trainstream_hf.engine.head import chunked_causal_lm_loss


def _case(dtype, batch, seq, vocab, ignore_frac, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(batch, seq, vocab, generator=g)).to(dtype)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[torch.rand(batch, seq, generator=g) < ignore_frac] = -100
    return logits, labels


def _loss_and_grad(fn, logits, labels, **kw):
    x = logits.clone().requires_grad_(True)
    loss = fn(logits=x, labels=labels, vocab_size=logits.shape[-1], **kw)
    loss.backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("vocab", [97, 1000])
@pytest.mark.parametrize("items", [None, 37])
def test_matches_transformers_bit_for_bit(dtype, vocab, items, monkeypatch):
    monkeypatch.setattr(head, "CHUNK_BYTES", 16 * 4 * vocab)  # 16 rows a chunk: several chunks, a ragged last one
    logits, labels = _case(dtype, 3, 41, vocab, 0.2)
    kw = {} if items is None else {"num_items_in_batch": torch.tensor(items)}
    ref_loss, ref_grad = _loss_and_grad(ForCausalLMLoss, logits, labels, **kw)
    loss, grad = _loss_and_grad(chunked_causal_lm_loss, logits, labels, **kw)
    assert torch.equal(loss, ref_loss)
    assert grad.dtype == dtype and torch.equal(grad, ref_grad)


def test_shift_labels_all_ignored_and_no_grad():
    logits, labels = _case(torch.bfloat16, 2, 8, 50, 0.0)
    shift = torch.full((2, 8), -100)
    shift[0, 3] = 7
    ref = ForCausalLMLoss(logits=logits, labels=None, vocab_size=50, shift_labels=shift)
    assert torch.equal(chunked_causal_lm_loss(logits=logits, labels=None, vocab_size=50, shift_labels=shift), ref)
    none = torch.full((2, 8), -100)
    a = ForCausalLMLoss(logits=logits, labels=none, vocab_size=50)
    b = chunked_causal_lm_loss(logits=logits, labels=none, vocab_size=50)
    assert torch.isnan(a) and torch.isnan(b)  # mean over no tokens, as transformers gives
    with torch.no_grad():
        assert torch.equal(chunked_causal_lm_loss(logits=logits, labels=labels, vocab_size=50),
                           ForCausalLMLoss(logits=logits, labels=labels, vocab_size=50))


def test_keeps_the_logits_not_an_fp32_copy():
    """What autograd holds between forward and backward: the bf16 logits, not fp32 log-probabilities."""
    logits, labels = _case(torch.bfloat16, 1, 64, 512, 0.0)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    for fn in (ForCausalLMLoss, chunked_causal_lm_loss):
        saved.clear()
        x = logits.clone().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(logits=x, labels=labels, vocab_size=512)
        total = sum(saved.values())
        if fn is ForCausalLMLoss:
            assert total >= 64 * 512 * 4
        else:
            assert total <= 64 * 512 * 2 + 64 * 8 + 64


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=96))


def test_wrap_installs_it_only_over_transformers_own_loss():
    import trainstream_hf as ts

    model = _tiny_llama()
    model, _ = ts.wrap(model, None, vram_budget="64GiB", host_arena=None, fused_loss=False)
    assert model.loss_function is chunked_causal_lm_loss
    ts.unwrap(model)
    assert model.loss_function is ForCausalLMLoss
    model, _ = ts.wrap(model, None, vram_budget="64GiB", host_arena=None, chunked_loss=False, fused_loss=False)
    assert model.loss_function is ForCausalLMLoss
    ts.unwrap(model)
    # with the fused head (default "auto"), a call it does not take goes to the chunked loss, or with
    # chunked_loss=False to transformers' own
    for chunked, plain in ((True, chunked_causal_lm_loss), (False, ForCausalLMLoss)):
        model, _ = ts.wrap(model, None, vram_budget="64GiB", host_arena=None, chunked_loss=chunked)
        assert model.loss_function.__self__._plain_loss is plain
        ts.unwrap(model)
        assert model.loss_function is ForCausalLMLoss

    def mine(logits, labels, vocab_size, **kw):
        return logits.float().mean()

    model.loss_function = mine
    model, _ = ts.wrap(model, None, vram_budget="64GiB", host_arena=None)
    assert model.loss_function is mine
    ts.unwrap(model)
    assert model.loss_function is mine


def test_wrapped_model_trains_with_the_same_bits(train_side_by_side):
    """The engine's loss gives the unwrapped model's losses and gradients bit for bit (also covered by every
    exactness test of wrap, which now runs through it)."""
    import copy

    import trainstream_hf as ts

    ref = _tiny_llama()
    model = copy.deepcopy(ref)
    model, _ = ts.wrap(model, None, vram_budget="64GiB", host_arena=None)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(3))
    train_side_by_side(ref, model, None, None, [ids])
    ts.unwrap(model)
