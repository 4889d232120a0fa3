"""save_pretrained of a model loaded with TrainStreamQuantizationConfig: refused with one line that says why and what to
save instead (transformers' own refusal points at logged warnings that nobody logged), nothing written. The adapters
still save through PEFT, and a model given adapters through transformers' PEFT integration is not refused."""
import copy
import logging
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from trainstream_hf.integrations.huggingface import NOT_SERIALIZABLE, TrainStreamQuantizationConfig

peft = pytest.importorskip("peft")
from peft import get_peft_model  # noqa: E402

from trainstream_hf.integrations.peft import quant_lora_config  # noqa: E402

REASON = (r"^trainstream: save_pretrained cannot write this model: its linear layers are packed \(nf4\) in "
          r"trainstream_hf's own layout")
TO_DO = r"Save what was trained instead: the adapters \(peft_model.save_pretrained\(dir\)"


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         tie_word_embeddings=False))
    path = tmp_path_factory.mktemp("llama")
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                quantization_config=TrainStreamQuantizationConfig(quantize="nf4"))


def test_save_pretrained_says_why_and_what_to_do_and_writes_nothing(llama_dir, tmp_path):
    model = load(llama_dir)
    out = tmp_path / "packed"
    with pytest.raises(ValueError, match=REASON) as info:
        model.save_pretrained(out)
    message = str(info.value)
    assert "\n" not in message and "check out the warnings" not in message
    assert re.search(TO_DO, message) and "merge_and_unload()" in message
    assert message == NOT_SERIALIZABLE.format(fmt="nf4")
    assert not out.exists()


def test_the_base_of_a_peft_model_is_refused_the_adapters_save(llama_dir, tmp_path):
    base = load(llama_dir)
    model = get_peft_model(base, quant_lora_config(base, r=4, target_modules="all-linear"))
    with pytest.raises(ValueError, match=REASON):
        model.base_model.model.save_pretrained(tmp_path / "packed")
    model.save_pretrained(tmp_path / "adapters")
    assert (tmp_path / "adapters" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "packed").exists()


def test_adapters_added_through_transformers_are_not_refused(llama_dir):
    """transformers' PEFT integration (model.add_adapter) marks the model and save_pretrained then writes only the
    adapters: the quantizer answers False without raising, and transformers' refusal is skipped. (The flag is set by
    hand: transformers 5.25's add_adapter needs PEFT >= 0.22, newer than the one this environment pins.)"""
    model = load(llama_dir)
    with pytest.raises(ValueError, match=REASON):
        model.hf_quantizer.is_serializable()
    model._hf_peft_config_loaded = True
    assert model.hf_quantizer.is_serializable() is False


def test_a_copy_gets_the_reason_in_the_log_transformers_points_to(llama_dir, tmp_path, caplog):
    """A deep copy's quantizer is a copy too (it no longer knows its model): transformers refuses, and the reason is
    in the log its message points to."""
    model = copy.deepcopy(load(llama_dir))
    with caplog.at_level(logging.WARNING, logger="trainstream_hf"):
        with pytest.raises(ValueError, match="check out the warnings from the logger"):
            model.save_pretrained(tmp_path / "packed")
    logged = [r.getMessage() for r in caplog.records if r.name == "trainstream_hf"]
    assert logged == [NOT_SERIALIZABLE.format(fmt="nf4")]
    assert not (tmp_path / "packed").exists()
