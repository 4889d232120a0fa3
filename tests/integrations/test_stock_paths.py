"""The stock Hugging Face calls on a trainstream-quantized base (CPU, transformers 5.25, PEFT 0.21, TRL 1.16): a QLoRA
user swaps ``BitsAndBytesConfig`` for ``TrainStreamQuantizationConfig`` and changes nothing else. No
``register_quant_lora``, ``quant_lora_config`` or ``load_quant_lora`` anywhere in this file."""
import json
from pathlib import Path

import pytest
import torch
from torch import nn

peft = pytest.importorskip("peft")
from peft import (  # noqa: E402
    AutoPeftModelForCausalLM,
    LoraConfig,
    PeftModel,
    get_peft_model,
    prepare_model_for_kbit_training,
)
from peft.tuners.lora import LoraLayer  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from trainstream_hf.integrations.huggingface import TrainStreamQuantizationConfig  # noqa: E402
from trainstream_hf.quant import QuantLinear  # noqa: E402
from trainstream_hf.integrations.peft import QuantLoraLinear  # noqa: E402
from tests.helpers import scale_input_channels, tiny_llama  # noqa: E402
from tests.integrations.test_peft import _randomize_lora

ROOT = Path(__file__).resolve().parents[2]
LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # 2 layers: 14 in all


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny Llama (hidden 64, untied lm_head) saved as safetensors, as a hub checkpoint would be."""
    model = scale_input_channels(tiny_llama(), every=13, factor=6.0)  # a few outlier input channels
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return path


def _load(path, fmt, **kw):
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=TrainStreamQuantizationConfig(quantize=fmt),
                                                **kw)


def _ids(seed=5):
    return torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(seed))


def _bytes(t):
    return t.detach().reshape(-1).view(torch.uint8)


def _lora_layers(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


@pytest.mark.parametrize("fmt", ["nf4", "fp8"])
@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"]])
def test_get_peft_model_wraps_the_packed_layers_in_quant_lora_linear(llama_dir, fmt, targets, graph_names):
    model = get_peft_model(_load(llama_dir, fmt), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    layers = _lora_layers(model)
    wanted = LINEARS if targets == "all-linear" else targets
    assert sorted(n.rpartition(".")[2] for n in layers) == sorted(wanted * 2)
    assert all(type(m) is QuantLoraLinear and isinstance(m.base_layer, QuantLinear) for m in layers.values())
    assert type(model.base_model.model.lm_head) is nn.Linear  # all-linear leaves the output head alone

    model.train()
    ids = _ids()
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    lora = {n for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n}
    assert {n for n, p in model.named_parameters() if p.grad is not None} == lora
    assert all(p.requires_grad == (n in lora) for n, p in model.named_parameters())
    for n, p in model.named_parameters():
        if n in lora:
            assert torch.isfinite(p.grad).all(), n
            if ".lora_B." in n:  # A's gradient is B^T (...): zero while B is
                assert float(p.grad.abs().sum()) > 0, n
    if fmt == "nf4":  # weight-only base, x in the adapters' dtype: base and adapter in one native node
        assert "LoraDequantLinear" in " ".join(graph_names(loss)), graph_names(loss)


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_saved_adapter_loads_with_peft_model_and_auto_peft_model(llama_dir, fmt, tmp_path):
    model = get_peft_model(_load(llama_dir, fmt), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    _randomize_lora(model)
    model.eval()
    ids = _ids()
    with torch.no_grad():
        expected = model(ids).logits
        with model.disable_adapter():
            base = model(ids).logits
    assert not torch.allclose(expected, base, atol=1e-3)  # the adapters matter
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(llama_dir)

    loaded = PeftModel.from_pretrained(_load(llama_dir, fmt), tmp_path)
    assert len(_lora_layers(loaded)) == 14
    assert all(type(m) is QuantLoraLinear for m in _lora_layers(loaded).values())
    auto = AutoPeftModelForCausalLM.from_pretrained(tmp_path,
                                                    quantization_config=TrainStreamQuantizationConfig(quantize=fmt))
    assert all(type(m) is QuantLoraLinear for m in _lora_layers(auto).values()) and len(_lora_layers(auto)) == 14
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, expected)
        assert torch.equal(auto(ids).logits, expected)


@pytest.mark.parametrize("fmt", ["nf4", "nvfp4", "int8", "fp8"])
def test_prepare_model_for_kbit_training_turns_on_checkpointing_and_trains(llama_dir, fmt):
    model = _load(llama_dir, fmt, dtype=torch.bfloat16)
    # what PEFT's prepare_model_for_kbit_training and TRL's QLoRA branches test
    assert model.is_loaded_in_8bit and model.is_quantized and model.quantization_method == "trainstream"
    packed = {n: p.detach().clone() for n, p in model.named_parameters() if ".weight_" in n}
    assert len(packed) >= 28
    model = prepare_model_for_kbit_training(model)
    assert model.is_gradient_checkpointing
    for n, p in model.named_parameters():  # the packed tensors keep their dtype and bits; the rest is upcast
        if n in packed:
            assert p.dtype == packed[n].dtype and torch.equal(_bytes(p), _bytes(packed[n])), n
        else:
            assert p.dtype == torch.float32, n
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    assert len(_lora_layers(model)) == 14
    assert all(type(m) is QuantLoraLinear for m in _lora_layers(model).values())

    calls = []  # a checkpointed decoder layer runs its modules again in the backward (its own hooks stay outside)
    model.base_model.model.model.layers[0].input_layernorm.register_forward_pre_hook(lambda *_: calls.append(1))
    model.train()
    ids = _ids()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(2):
        calls.clear()
        loss = model(ids, labels=ids).loss
        loss.backward()
        assert len(calls) == 2
        grads = [p.grad for n, p in model.named_parameters() if ".lora_B." in n]
        assert len(grads) == 14 and all(torch.isfinite(g).all() and float(g.abs().sum()) > 0 for g in grads)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert all(0 < v < 10 for v in losses) and losses[1] < losses[0], losses  # finite, and the step helped


def test_merge_and_unload_gives_dense_linears(llama_dir):
    model = get_peft_model(_load(llama_dir, "nf4"), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    _randomize_lora(model)
    model.eval()
    ids = _ids()
    with torch.no_grad():
        adapted = model(ids).logits
    names = [n.replace("base_model.model.", "", 1) for n in _lora_layers(model)]
    merged = model.merge_and_unload()
    assert len(names) == 14 and all(type(merged.get_submodule(n)) is nn.Linear for n in names)
    assert not any(isinstance(m, (QuantLinear, LoraLayer)) for m in merged.modules())
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted, rtol=1e-4, atol=1e-4)


def test_trl_sft_trainer_takes_its_qlora_branch(llama_dir, tmp_path):
    """TRL 1.16's SFTTrainer given the path, our config in model_init_kwargs and peft_config: its QLoRA branch (taken
    for is_loaded_in_8bit / is_loaded_in_4bit models) keeps the adapters in bf16, and the run trains."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ROOT / "data" / "tokenizer")
    rows = torch.randint(3, len(tok), (8, 16), generator=torch.Generator().manual_seed(7))
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2,
                         logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", bf16=False,
                         model_init_kwargs={"quantization_config": TrainStreamQuantizationConfig(quantize="nf4")})
    trainer = trl.SFTTrainer(model=str(llama_dir), args=args, processing_class=tok,
                             train_dataset=Dataset.from_list([{"input_ids": r.tolist()} for r in rows]),
                             peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    layers = _lora_layers(trainer.model)
    assert len(layers) == 14 and all(type(m) is QuantLoraLinear for m in layers.values())
    assert all(p.dtype == torch.bfloat16 for n, p in trainer.model.named_parameters() if p.requires_grad)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(0 < v < 10 for v in losses), losses
