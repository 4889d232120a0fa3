"""PEFT round trip for LoRA over QuantLinear (CPU, peft 0.21): the same numerics as PEFT's own lora.Linear over the
dequantized weight, disable_adapter, save_pretrained / load_quant_lora, merge_and_unload to dense nn.Linear."""
import pytest
import torch
from torch import nn

peft = pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

from trainstream_hf.integrations.peft import load_quant_lora, quant_lora_config  # noqa: E402
from trainstream_hf.quant import QuantLinear, quantize_model  # noqa: E402
from trainstream_hf.integrations.peft import QuantLoraLinear  # noqa: E402
from tests.helpers import scale_input_channels  # noqa: E402

LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]



def _llama(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    # realistic outliers: a few large input channels per weight
    return scale_input_channels(LlamaForCausalLM(cfg).eval(), every=37, factor=8.0)


def _ids(seed=1, batch=2):
    return torch.randint(0, 256, (batch, 24), generator=torch.Generator().manual_seed(seed))


def _randomize_lora(model, seed=3):
    """LoRA B starts at zero; give it (and A) fresh values so that the adapter changes the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_A." in n or ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g) * (0.05 if ".lora_B." in n else 0.2))


def _dense_twin(quantized):
    """The unquantized model with every QuantLinear's decoded weight in a plain nn.Linear."""
    dense = _llama()
    with torch.no_grad():
        for name, m in quantized.named_modules():
            if isinstance(m, QuantLinear):
                dense.get_submodule(name.replace(".base_layer", "")).weight.copy_(m.dequantize_weight(torch.float32))
    return dense


def _quant_peft(seed=3, **lora):
    model = quantize_model(_llama(), "nf4")
    model = get_peft_model(model, quant_lora_config(r=8, lora_alpha=16, target_modules=LINEARS, **lora))
    _randomize_lora(model, seed)
    return model


def test_loss_and_lora_grads_match_peft_lora_over_dequantized_linear():
    quant = _quant_peft(lora_dropout=0.0)
    ref = get_peft_model(_dense_twin(quant.base_model.model),
                         LoraConfig(r=8, lora_alpha=16, target_modules=LINEARS, lora_dropout=0.0))
    _randomize_lora(ref)
    assert isinstance(ref.base_model.model.model.layers[0].self_attn.q_proj.base_layer, nn.Linear)
    quant.train()
    ref.train()
    ids = _ids()
    loss_q = quant(ids, labels=ids).loss
    loss_r = ref(ids, labels=ids).loss
    loss_q.backward()
    loss_r.backward()
    torch.testing.assert_close(loss_q, loss_r, rtol=1e-5, atol=0)
    grads_q = {n: p.grad for n, p in quant.named_parameters() if p.requires_grad}
    grads_r = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    assert grads_q.keys() == grads_r.keys() and len(grads_q) == 4 * len(LINEARS)
    for n in grads_q:
        assert float(grads_q[n].abs().sum()) > 0, n
        torch.testing.assert_close(grads_q[n], grads_r[n], rtol=1e-5, atol=1e-7, msg=n)


def test_disable_adapter_gives_the_base_outputs():
    ids = _ids()
    with torch.no_grad():
        base = quantize_model(_llama(), "nf4")(ids).logits
        model = _quant_peft().eval()
        adapted = model(ids).logits
        with model.disable_adapter():
            disabled = model(ids).logits
        again = model(ids).logits
    assert torch.equal(disabled, base)
    assert not torch.allclose(adapted, base, atol=1e-3)
    assert torch.equal(again, adapted)  # the context manager switches the adapters back on


def test_all_linear_targets_quant_linear_but_not_the_lm_head():
    model = quantize_model(_llama(), "nf4")
    with pytest.raises(ValueError, match="needs the model"):
        quant_lora_config(target_modules="all-linear")
    model = get_peft_model(model, quant_lora_config(model, r=4, target_modules="all-linear"))
    wrapped = [n for n, m in model.named_modules() if isinstance(m, QuantLoraLinear)]
    assert len(wrapped) == 2 * len(LINEARS)
    assert type(model.base_model.model.lm_head) is nn.Linear


def test_save_pretrained_and_load_quant_lora_round_trip(tmp_path):
    ids = _ids()
    model = _quant_peft().eval()
    with torch.no_grad():
        expected = model(ids).logits
    model.save_pretrained(tmp_path)

    # PEFT's plain loader: its LoraConfig has no custom dispatch, and PEFT's own gives the same layers.
    plain = PeftModel.from_pretrained(quantize_model(_llama(), "nf4"), tmp_path)
    assert sum(isinstance(m, QuantLoraLinear) for m in plain.modules()) == 2 * len(LINEARS)
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, expected)

    loaded = load_quant_lora(quantize_model(_llama(), "nf4"), tmp_path)
    layers = [m for m in loaded.modules() if isinstance(m, QuantLoraLinear)]
    assert len(layers) == 2 * len(LINEARS) and all(isinstance(m.base_layer, QuantLinear) for m in layers)
    assert not any(p.requires_grad for p in loaded.parameters())  # inference mode, as PeftModel.from_pretrained
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, expected)

    trainable = load_quant_lora(quantize_model(_llama(), "nf4"), tmp_path, is_trainable=True)
    names = {n for n, p in trainable.named_parameters() if p.requires_grad}
    assert len(names) == 4 * len(LINEARS) and all(".lora_" in n for n in names)
    trainable.train()
    trainable(ids, labels=ids).loss.backward()
    assert all(float(p.grad.abs().sum()) > 0 for n, p in trainable.named_parameters() if n in names)

    # a second adapter onto an existing PeftModel
    both = load_quant_lora(loaded, tmp_path, adapter_name="again")
    assert set(both.peft_config) == {"default", "again"}
    assert isinstance(both.base_model.model.model.layers[1].mlp.down_proj.lora_A["again"], nn.Linear)


def test_merge_and_unload_gives_dense_linears_equal_to_peft_merge_of_the_dequantized_weight():
    ids = _ids()
    quant = _quant_peft().eval()
    with torch.no_grad():
        adapted = quant(ids).logits
    with pytest.raises(NotImplementedError, match="re-quantize"):
        quant.merge_adapter()
    ref = get_peft_model(_dense_twin(quant.base_model.model), LoraConfig(r=8, lora_alpha=16, target_modules=LINEARS))
    _randomize_lora(ref)
    ref_merged = ref.merge_and_unload()

    former = [n for n, m in quant.base_model.model.named_modules() if isinstance(m, QuantLoraLinear)]
    assert len(former) == 2 * len(LINEARS)
    merged = quant.merge_and_unload()
    assert not any(isinstance(m, (QuantLinear, QuantLoraLinear)) for m in merged.modules())
    for name in former:
        layer = merged.get_submodule(name)
        assert type(layer) is nn.Linear and layer.weight.dtype == torch.float32
        assert not layer.weight.requires_grad
    for (n, p), (n_r, p_r) in zip(merged.named_parameters(), ref_merged.named_parameters()):
        assert n == n_r
        assert torch.equal(p, p_r), n  # PEFT's own merge arithmetic, on the decoded weight
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted, rtol=1e-4, atol=1e-4)


def test_unload_gives_the_quant_linear_back_and_merge_handles_bias_and_conv1d():
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=128, n_layer=2, n_head=4, n_positions=64,
                                      bos_token_id=0, eos_token_id=0)).eval()
    with torch.no_grad():
        for m in gpt2.modules():
            if hasattr(m, "bias") and isinstance(m.bias, torch.Tensor) and m.bias.ndim == 1:
                m.bias.normal_(0, 0.1)
    config = dict(r=4, target_modules=["c_attn", "c_fc", "c_proj"], lora_bias=True)
    model = get_peft_model(quantize_model(gpt2, "int8"), quant_lora_config(**config))
    _randomize_lora(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n and n.endswith(".bias"):
                p.normal_(0, 0.1)
    model.eval()
    ids = _ids()
    with torch.no_grad():
        adapted = model(ids).logits
    merged = model.merge_and_unload()
    c_attn = merged.transformer.h[0].attn.c_attn
    assert type(c_attn) is nn.Linear and c_attn.bias is not None
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted, rtol=1e-4, atol=1e-4)

    model = get_peft_model(quantize_model(GPT2LMHeadModel(gpt2.config).eval(), "int8"), quant_lora_config(**config))
    assert isinstance(model.unload().transformer.h[0].attn.c_attn, QuantLinear)
