"""On CUDA: torch's clip_grad_norm_ over a model whose paged trainable weights keep their gradients in host RAM
(CPU tensors beside CUDA ones) gives the plain model's norm; a failed quantized wrap puts the device originals back."""
import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import trainstream_hf as ts
from trainstream_hf.engine.grads import device_grad

DEV = "cuda"


def _llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=256)).to(DEV)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(False)


def test_clip_grad_norm_over_paged_trainable_weights_matches_the_plain_model():
    ids = torch.randint(0, 256, (2, 32), device=DEV, generator=torch.Generator(DEV).manual_seed(0))
    ref = _llama()
    model = copy.deepcopy(ref)
    model, opt = ts.wrap(model, torch.optim.AdamW(model.parameters()), vram_budget="64GiB", batch_shape=(2, 32),
                         page_weights=True, offload_optimizer=True, min_offload_numel=0)
    ref(input_ids=ids, labels=ids).loss.backward()
    model(input_ids=ids, labels=ids).loss.backward()
    host = [p for p in model.parameters() if device_grad(p) is None]
    assert host and all(p.grad is not None and p.grad.device.type == "cpu" for p in host)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    got = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-5, atol=0)
    opt.step()
    ts.unwrap(model)


def test_failed_quantized_wrap_leaves_the_device_model_as_given():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    before = {n: (p.device, p.detach().clone()) for n, p in model.named_parameters()}
    types = [type(m) for m in model.modules()]
    allocated = torch.cuda.memory_allocated()
    with pytest.raises(ts.BudgetError):
        ts.wrap(model, None, quantize="nf4", vram_budget="1KiB")
    assert [type(m) for m in model.modules()] == types
    for n, p in model.named_parameters():
        assert p.device == before[n][0] and torch.equal(p, before[n][1]), n
    assert torch.cuda.memory_allocated() <= allocated
