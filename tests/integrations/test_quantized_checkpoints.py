"""Quantized checkpoints through the stock calls (CPU, transformers 5.25, PEFT 0.21): ``save_pretrained`` of a
trainstream-quantized model writes the packed tensors and ``quantization_config``; ``from_pretrained(dir)`` reads them
back bit for bit without quantizing anything; ``dequantize()`` gives dense layers equal to the decoded weights; PEFT's
``merge_and_unload()`` then ``save_pretrained`` gives a plain checkpoint."""
import json

import pytest
import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel
from transformers.pytorch_utils import Conv1D

import trainstream_hf.integrations.huggingface as hf
import trainstream_hf.quant.formats as formats
from trainstream_hf.integrations.huggingface import LoadedQuantLinear, TrainStreamQuantizationConfig
from trainstream_hf.quant import QuantLinear
from tests.integrations.test_stock_paths import LINEARS, _bytes, _ids, _load, llama_dir  # noqa: F401

peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402

from tests.integrations.test_peft import _randomize_lora  # noqa: E402

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
PACKED = [f"model.layers.{i}.{'self_attn' if p in ATTENTION else 'mlp'}.{p}" for i in range(2) for p in LINEARS]


def _config(path):
    return json.loads((path / "config.json").read_text())


def _keys(path):
    with safe_open(path / "model.safetensors", "pt") as f:
        return set(f.keys())


def _no_quantizing(monkeypatch):
    """Any quantization from here on is an error: a reload must read the packed tensors, not make them again."""
    def refuse(*args, **kwargs):
        raise AssertionError("quantized again")
    monkeypatch.setattr(hf, "quantize", refuse)
    monkeypatch.setattr(formats, "quantize", refuse)
    monkeypatch.setattr(QuantLinear, "from_linear", classmethod(refuse))


def _same_state(a, b, requires_grad=True):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and sa[k].shape == sb[k].shape, k
        assert torch.equal(_bytes(sa[k]), _bytes(sb[k])), k
    if requires_grad:  # packed tensors frozen as QuantLinear builds them, the rest as transformers loads it
        ra = {n: p.requires_grad for n, p in a.named_parameters()}
        assert ra == {n: p.requires_grad for n, p in b.named_parameters()}


@pytest.mark.parametrize("fmt,outliers", [("int8", 0.05), ("nf4", 0.0), ("nf4", 0.05), ("fp8", 0.05),
                                          ("nvfp4", 0.05)])
def test_save_pretrained_and_from_pretrained_round_trip_bit_for_bit(llama_dir, tmp_path, monkeypatch, fmt, outliers):
    model = AutoModelForCausalLM.from_pretrained(
        llama_dir, quantization_config=TrainStreamQuantizationConfig(quantize=fmt, outliers=outliers))
    model.save_pretrained(tmp_path)

    saved = _config(tmp_path)["quantization_config"]
    assert saved == {"quant_method": "trainstream", "quantize": fmt, "outliers": outliers, "act_quant": None,
                     "skip": ["lm_head"], "modules": sorted(PACKED)}
    keys = _keys(tmp_path)
    names = formats.get_format(fmt).tensor_names
    assert {f"{m}.weight_{n}" for m in PACKED for n in names} <= keys
    assert not any(f"{m}.weight" in keys for m in PACKED) and "lm_head.weight" in keys

    _no_quantizing(monkeypatch)
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert loaded.hf_quantizer.pre_quantized and loaded.is_quantized and loaded.is_loaded_in_8bit
    assert all(type(loaded.get_submodule(m)) is LoadedQuantLinear for m in PACKED)
    layer = loaded.get_submodule(PACKED[0])
    assert (layer.fmt.name, layer.outliers, layer.weight_dtype) == (fmt, outliers, torch.float32)
    _same_state(model, loaded)
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_dequantize_gives_dense_linears_of_the_decoded_weights_and_a_plain_checkpoint(llama_dir, tmp_path):
    model = _load(llama_dir, "nf4")
    decoded = {m: model.get_submodule(m).dequantize_weight() for m in PACKED}
    assert model.dequantize() is model
    for m in PACKED:
        layer = model.get_submodule(m)
        assert type(layer) is nn.Linear and torch.equal(layer.weight, decoded[m])
        assert layer.weight.dtype == torch.float32 and layer.weight.requires_grad
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    assert not model.is_quantized and not hasattr(model.config, "quantization_config")
    assert not getattr(model, "is_loaded_in_8bit", False)

    model.save_pretrained(tmp_path)
    assert "quantization_config" not in _config(tmp_path)
    assert {f"{m}.weight" for m in PACKED} <= _keys(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert getattr(plain, "hf_quantizer", None) is None and not getattr(plain, "is_quantized", False)
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, model(ids).logits)


def test_a_reloaded_checkpoint_dequantizes_too(llama_dir, tmp_path):
    model = _load(llama_dir, "nvfp4")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).dequantize(dtype=torch.bfloat16)
    for m in PACKED:
        w = loaded.get_submodule(m).weight
        assert w.dtype == torch.bfloat16 and torch.equal(w, model.get_submodule(m).dequantize_weight(torch.bfloat16))


def test_gpt2_conv1d_round_trips_and_dequantizes_to_conv1d(tmp_path):
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=64, n_layer=1, n_head=4, n_positions=32,
                                      bos_token_id=0, eos_token_id=0))
    with torch.no_grad():
        gpt2.transformer.h[0].attn.c_attn.bias.normal_(0, 0.1)
    gpt2.save_pretrained(tmp_path / "dense")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", quantization_config=TrainStreamQuantizationConfig(
        quantize="int8", skip=[]))
    model.save_pretrained(tmp_path / "packed")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "packed")
    _same_state(model, loaded)
    c_attn = loaded.transformer.h[0].attn.c_attn
    assert isinstance(c_attn, QuantLinear) and (c_attn.in_features, c_attn.out_features) == (64, 192)
    want = c_attn.dequantize_weight()
    loaded.dequantize()
    c_attn = loaded.transformer.h[0].attn.c_attn
    assert type(c_attn) is Conv1D and torch.equal(c_attn.weight, want.t())
    assert torch.equal(c_attn.bias, model.transformer.h[0].attn.c_attn.bias)
    loaded.save_pretrained(tmp_path / "plain")
    assert "quantization_config" not in _config(tmp_path / "plain")
    AutoModelForCausalLM.from_pretrained(tmp_path / "plain")  # shapes as GPT-2's own: (in, out)


def test_merge_and_unload_then_save_pretrained_is_a_plain_checkpoint(llama_dir, tmp_path):
    model = get_peft_model(_load(llama_dir, "nf4"), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    _randomize_lora(model)
    merged = model.merge_and_unload()
    assert not any(isinstance(m, QuantLinear) for m in merged.modules())
    merged.save_pretrained(tmp_path)
    assert "quantization_config" not in _config(tmp_path)
    assert not merged.is_quantized and not getattr(merged, "is_loaded_in_8bit", False)
    assert not any("weight_data" in k or "lora" in k for k in _keys(tmp_path))
    plain = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert getattr(plain, "hf_quantizer", None) is None and not getattr(plain, "is_quantized", False)
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, merged(ids).logits)


def test_a_partial_merge_saves_the_merged_layers_dense_and_the_rest_packed(llama_dir, tmp_path, monkeypatch):
    model = get_peft_model(_load(llama_dir, "fp8"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    _randomize_lora(model)
    merged = model.merge_and_unload()
    merged.save_pretrained(tmp_path)
    still_packed = sorted(m for m in PACKED if not m.endswith(("q_proj", "v_proj")))
    assert _config(tmp_path)["quantization_config"]["modules"] == still_packed
    _no_quantizing(monkeypatch)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded.model.layers[1].self_attn.q_proj) is nn.Linear
    assert all(type(loaded.get_submodule(m)) is LoadedQuantLinear for m in still_packed)
    _same_state(merged, loaded, requires_grad=False)  # PEFT froze the merged model's base
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, merged(ids).logits)


def test_a_checkpoint_that_names_no_linear_layer_is_an_error(llama_dir, tmp_path):
    model = _load(llama_dir, "int8")
    model.save_pretrained(tmp_path)
    config = _config(tmp_path)
    config["quantization_config"]["modules"].append("model.layers.0.input_layernorm")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="not linear layers of LlamaForCausalLM: model.layers.0.input_layernorm"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
