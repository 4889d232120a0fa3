"""Weights the packers never take (mixture-of-experts weights held as 3-D tensors, as transformers 5 stores them) stay
in their dtype; every way in that packs a base says so in one warning with their share of the model, and a model
made only of linear layers gets no such warning."""
import tempfile
import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

import trainstream_hf as ts

KW = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
          vocab_size=128)


def _mixtral():
    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(**KW, num_local_experts=4, num_experts_per_tok=2))


def _dense_warnings(record):
    return [str(w.message) for w in record if "packs nn.Linear layers only" in str(w.message)]


def _expert_share(model):
    total = sum(p.numel() for p in model.parameters())
    return round(100 * sum(p.numel() for p in model.parameters() if p.dim() >= 3) / total)


def test_wrap_names_the_experts_left_dense_with_their_share():
    model = _mixtral()
    share = _expert_share(model)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model, opt = ts.wrap(model, opt, quantize="nf4", vram_budget="4GiB", batch_shape=(1, 16))
    (msg,) = _dense_warnings(record)
    assert "4 weight tensors of three or more dimensions" in msg and f"{share}% of the model" in msg
    assert "mlp.experts.gate_up_proj (4, 256, 64) float32" in msg
    experts = model.get_submodule("base_model.model.model.layers.0.mlp.experts")
    assert experts.gate_up_proj.dtype == torch.float32  # left as it was, as the warning says
    assert isinstance(model.get_submodule("base_model.model.model.layers.0.self_attn.q_proj.base_layer"),
                      ts.QuantLinear)
    ids = torch.randint(0, 128, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()  # and it trains
    ts.unwrap(model)


def test_from_pretrained_and_quantize_model_warn_once():
    with tempfile.TemporaryDirectory() as d:
        _mixtral().save_pretrained(d)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            AutoModelForCausalLM.from_pretrained(d, quantization_config=ts.TrainStreamQuantizationConfig("int8"))
        assert len(_dense_warnings(record)) == 1 and "quantize='int8'" in _dense_warnings(record)[0]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ts.quantize_model(_mixtral(), "nf4")
    assert len(_dense_warnings(record)) == 1


@pytest.mark.parametrize("way", ["wrap", "quantize_model"])
def test_a_model_of_linear_layers_gets_no_such_warning(way):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**KW))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        if way == "wrap":
            model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
            ts.unwrap(ts.wrap(model, opt, quantize="nf4", vram_budget="4GiB", batch_shape=(1, 16))[0])
        else:
            ts.quantize_model(model, "nf4")
    assert not _dense_warnings(record)


def test_experts_page_and_offload_bit_for_bit():
    """A mixture-of-experts model (3-D expert weights, a router) with its blocks paged and their activations in host
    RAM computes the unwrapped model's loss and gradients bit for bit, and AdamW (the paged weights stepped on the
    host) keeps it within 1e-6 of torch's."""
    ref, model = _mixtral(), _mixtral()
    ref_opt, opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, model))
    model, opt = ts.wrap(model, opt, vram_budget="4GiB", batch_shape=(2, 16), page_weights=True,
                         offload_activations=True, min_offload_numel=0, min_activation_bytes=0)
    plan = model.trainstream_plan
    assert plan.paged_blocks == [0, 1] and plan.offloaded_activation_blocks
    for step in range(3):
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(step))
        loss, ref_loss = (m(input_ids=ids, labels=ids).loss for m in (model, ref))
        loss.backward()
        ref_loss.backward()
        if step == 0:
            assert torch.equal(loss, ref_loss)
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                assert torch.equal(p.grad, q.grad), name
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    model = ts.unwrap(model)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p - q).abs().max().item() < 1e-6, name
