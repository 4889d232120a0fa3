"""PEFT LoRA over QuantLinear (CPU): PEFT does not wrap it out of the box; with register_quant_lora it does, the LoRA
adapters train and the quantized base stays frozen."""
import pytest
import torch

peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402

from trainstream_hf.quant import QuantLinear, quantize_model  # noqa: E402
from trainstream_hf.quant.lora import QuantLoraLinear, register_quant_lora  # noqa: E402


LLAMA_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]




def test_peft_does_not_wrap_quant_linear_out_of_the_box(tiny_llama):
    model = quantize_model(tiny_llama(), "nf4")
    with pytest.raises(ValueError, match="is not supported"):
        get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"]))


@pytest.mark.parametrize("fmt", ["nf4", "fp8"])
def test_lora_over_quant_linear_trains(fmt, tiny_llama, token_ids):
    model = quantize_model(tiny_llama(), fmt)
    ids = token_ids()
    with torch.no_grad():
        base_logits = model(ids).logits
    packed = {n: p.detach().clone() for n, p in model.named_parameters() if ".weight_" in n}
    model = get_peft_model(model, register_quant_lora(LoraConfig(r=8, lora_alpha=16,
                                                                 target_modules=LLAMA_LINEARS)))
    wrapped = [m for m in model.modules() if isinstance(m, QuantLoraLinear)]
    assert len(wrapped) == 2 * len(LLAMA_LINEARS)
    assert all(isinstance(m.base_layer, QuantLinear) for m in wrapped)
    assert all(m.lora_A["default"].weight.dtype == torch.float32 for m in wrapped)  # the base's weight.dtype
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)

    model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, base_logits)  # lora_B starts at zero
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(6):
        loss = model(ids, labels=ids).loss
        loss.backward()
        grads = {n: float(p.grad.abs().sum()) for n, p in model.named_parameters() if p.requires_grad}
        b = [g for n, g in grads.items() if ".lora_B." in n]
        a = [g for n, g in grads.items() if ".lora_A." in n]
        assert all(g > 0 for g in b)
        if step > 0:  # A's gradient is B^T (...): zero until B has moved
            assert all(g > 0 for g in a)
        assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.05, losses
    for n, p in model.named_parameters():  # the packed base is untouched
        if ".weight_" in n:
            key = n.replace("base_model.model.", "").replace(".base_layer", "")
            assert torch.equal(p.reshape(-1).view(torch.uint8), packed[key].reshape(-1).view(torch.uint8))


def test_lora_on_quantized_gpt2_conv1d_forces_fan_in_fan_out_off(tiny_gpt2, token_ids):
    model = quantize_model(tiny_gpt2(), "int8")
    config = register_quant_lora(LoraConfig(r=4, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True))
    with pytest.warns(UserWarning, match="setting fan_in_fan_out to False"):
        model = get_peft_model(model, config)
    layer = model.base_model.model.transformer.h[0].attn.c_attn
    assert isinstance(layer, QuantLoraLinear) and not layer.fan_in_fan_out
    assert (layer.in_features, layer.out_features) == (128, 384)
    ids = token_ids()
    model(ids, labels=ids).loss.backward()
    assert float(layer.lora_B["default"].weight.grad.abs().sum()) > 0


@pytest.mark.parametrize("autocast_adapter_dtype", [True, False])
def test_bf16_base_adapter_dtype_as_for_nn_linear_and_merge_is_refused(autocast_adapter_dtype, tiny_llama,
                                                                        token_ids):
    """PEFT sizes adapters by ``base_layer.weight.dtype`` (bf16 here), then by default upcasts bf16 adapters to fp32
    (``autocast_adapter_dtype``): the same as for an unquantized bf16 nn.Linear."""
    config = dict(r=4, target_modules=["q_proj", "v_proj"])
    plain = get_peft_model(tiny_llama().to(torch.bfloat16), LoraConfig(**config),
                           autocast_adapter_dtype=autocast_adapter_dtype)
    expected = plain.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight.dtype
    assert expected == (torch.float32 if autocast_adapter_dtype else torch.bfloat16)
    model = quantize_model(tiny_llama().to(torch.bfloat16), "nvfp4")
    model = get_peft_model(model, register_quant_lora(LoraConfig(**config)),
                           autocast_adapter_dtype=autocast_adapter_dtype)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.base_layer.weight.dtype == torch.bfloat16
    assert layer.lora_A["default"].weight.dtype == expected
    assert model(token_ids()).logits.dtype == torch.bfloat16
    with pytest.raises(NotImplementedError, match="re-quantize"):
        model.merge_adapter()


def test_dense_weight_features_are_refused_and_orthogonal_init_works(tiny_llama):
    model = quantize_model(tiny_llama(), "nf4")
    with pytest.raises(ValueError, match="unsupported variant"):
        get_peft_model(model, register_quant_lora(LoraConfig(r=4, target_modules=["q_proj"], use_dora=True)))
    with pytest.raises(NotImplementedError, match="init_lora_weights='pissa' reads the dense base weight"):
        get_peft_model(model, register_quant_lora(LoraConfig(r=4, target_modules=["q_proj"],
                                                             init_lora_weights="pissa")))
    config = LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights="orthogonal")
    model = get_peft_model(quantize_model(tiny_llama(), "nf4"), register_quant_lora(config))
    assert float(model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight.abs().sum()) > 0
