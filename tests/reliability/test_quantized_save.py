"""save_pretrained of a model loaded with TrainStreamQuantizationConfig writes a checkpoint that loads back, and loses
nothing on the way: the saved model is unchanged and still quantized, a copy saves the same bytes, and a save that
cannot be loaded back (packed layers still wrapped in PEFT LoRA layers) is refused with what to do, no file written.
The adapters still save through PEFT."""
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers import tiny_llama
from trainstream_hf.integrations.huggingface import TrainStreamQuantizationConfig
from trainstream_hf.quant import QuantLinear

peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    model = tiny_llama(hidden=128, vocab=256, positions=64, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("llama")
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                quantization_config=TrainStreamQuantizationConfig(quantize="nf4"))


def _ids():
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))


def _files(path):
    return sorted(p.name for p in path.iterdir()) if path.exists() else []


def test_save_pretrained_writes_a_checkpoint_and_leaves_the_model_as_it_was(llama_dir, tmp_path):
    model = load(llama_dir)
    ids = _ids()
    with torch.no_grad():
        before = model(ids).logits
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.save_pretrained(tmp_path / "packed")
    assert {"config.json", "model.safetensors"} <= set(_files(tmp_path / "packed"))
    assert model.is_quantized and sum(isinstance(m, QuantLinear) for m in model.modules()) == 14
    after = model.state_dict()
    assert all(torch.equal(after[k].view(torch.uint8), v.view(torch.uint8)) for k, v in state.items() if v.dim())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "packed")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before) and torch.equal(reloaded(ids).logits, before)


def test_a_copy_saves_the_same_bytes(llama_dir, tmp_path):
    model = load(llama_dir)
    model.save_pretrained(tmp_path / "a")
    copy.deepcopy(model).save_pretrained(tmp_path / "b")
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_the_wrapped_base_of_a_peft_model_is_refused_the_adapters_and_the_merge_save(llama_dir, tmp_path):
    model = get_peft_model(load(llama_dir), LoraConfig(r=4, target_modules="all-linear"))
    with pytest.raises(ValueError, match=r"packed layers are wrapped in PEFT LoRA layers .* peft_model.save_pretrained"
                                         r"\(dir\), or merge them first"):
        model.base_model.model.save_pretrained(tmp_path / "wrapped")
    assert _files(tmp_path / "wrapped") == []
    model.save_pretrained(tmp_path / "adapters")
    assert (tmp_path / "adapters" / "adapter_model.safetensors").is_file()
    model.merge_and_unload().save_pretrained(tmp_path / "merged")
    assert "model.safetensors" in _files(tmp_path / "merged")
