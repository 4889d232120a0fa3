"""``wrap(quantize=...)`` over PEFT options that keep more than the adapters trainable: the biases PEFT trains
(``bias="all"`` / ``"lora_only"``) still train, and the head PEFT copies for ``modules_to_save`` stays unpacked in its
wrapper (the model with adapters off, TRL's reference, runs the original head)."""
import pytest
import torch

import trainstream_hf as ts
from trainstream_hf.quant import QuantLinear

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _llama(**kw):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, **kw))


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_the_biases_peft_trains_still_train_over_a_packed_base(bias):
    model = peft.get_peft_model(_llama(attention_bias=True, mlp_bias=True),
                                peft.LoraConfig(r=8, target_modules="all-linear", bias=bias))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = ts.wrap(model, opt, device="cpu", vram_budget="8GiB", host_arena=None, quantize="nf4",
                         batch_shape=(2, 16))
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert all(id(p) in held for p in model.parameters() if p.requires_grad)
    q = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    assert isinstance(q, QuantLinear) and q.bias.requires_grad
    before = q.bias.detach().clone()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert not torch.equal(before, q.bias)


def test_the_head_kept_by_modules_to_save_is_not_packed():
    dense = _llama()
    model = peft.get_peft_model(dense, peft.LoraConfig(r=8, target_modules="all-linear", modules_to_save=["lm_head"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = ts.wrap(model, opt, device="cpu", vram_budget="8GiB", host_arena=None, quantize="nf4",
                         batch_shape=(2, 16))
    head = model.base_model.model.lm_head
    assert type(head.original_module) is torch.nn.Linear
    assert not any(isinstance(m, QuantLinear) for m in head.modules())
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 7 * 2


def test_dora_is_refused_in_one_line_either_way_in():
    from trainstream_hf.quant import quantize_model

    model = peft.get_peft_model(_llama(), peft.LoraConfig(r=8, target_modules="all-linear", use_dora=True))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    with pytest.raises(ValueError, match=r"DoRA adapters \(use_dora=True.*use_dora=False"):
        ts.wrap(model, opt, device="cpu", vram_budget="8GiB", host_arena=None, quantize="nf4", batch_shape=(2, 16))
    assert not any(isinstance(m, QuantLinear) for m in model.modules())  # wrap changed nothing
    with pytest.raises(NotImplementedError, match=r"DoRA \(use_dora=True\).*use_dora=False"):
        peft.get_peft_model(quantize_model(_llama(), "nf4"), peft.LoraConfig(r=8, target_modules="all-linear",
                                                                             use_dora=True))
