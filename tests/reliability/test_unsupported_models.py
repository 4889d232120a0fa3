"""Models the engine cannot train are refused up front, each with its own one-line message saying what is supported
and what to do, and left exactly as they came: a model without repeated blocks (``nn.Sequential``), an
encoder-decoder (T5) and a model whose weights are on the ``meta`` device. ``wrap`` and ``plan`` alike."""
import re

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, T5Config, T5ForConditionalGeneration

import trainstream_hf

LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=100)


def sequential():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8))


def t5():
    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(vocab_size=100, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                               num_decoder_layers=2, num_heads=4))


def meta_llama():
    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(**LLAMA))


# model, what the message must say (its own reason, then what is supported / what to do)
CASES = {
    "sequential": (sequential, [r"^Sequential has no repeated blocks \(no nn.ModuleList of two or more same-class "
                                r"layers\); trainstream_hf supports decoder-only causal LMs",
                                r"AutoModelForCausalLM.from_pretrained", r"hold your own layers in an nn.ModuleList"]),
    "t5": (t5, [r"^T5ForConditionalGeneration is an encoder-decoder model, which trainstream_hf does not support",
                r"decoder-only causal LMs", r"use a decoder-only model"]),
    "meta": (meta_llama, [r"^LlamaForCausalLM has \d+ parameter\(s\) or buffer\(s\) on the meta device, which hold "
                          r"no values \(first: model.embed_tokens.weight\)", r"trainstream_hf trains a model whose "
                          r"weights are loaded", r"model.to_empty\(device='cpu'\) and load_state_dict"]),
}


def fingerprint(model: nn.Module) -> dict:
    """Everything a refused wrap could have touched: the module tree, each parameter and buffer (the same object, its
    device, dtype, shape, requires_grad and value), every hook dict, and the attributes wrap sets on the model."""
    def tensors(named):
        return [(n, id(t), t.device, t.dtype, tuple(t.shape), t.requires_grad,
                 None if t.is_meta else t.detach().clone()) for n, t in named]
    hooks = [(n, k, len(getattr(m, k))) for n, m in model.named_modules() for k in
             ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
              "_state_dict_hooks", "_load_state_dict_pre_hooks")]
    return {"modules": [(n, type(m), id(m)) for n, m in model.named_modules()],
            "params": tensors(model.named_parameters()), "buffers": tensors(model.named_buffers()),
            "hooks": hooks, "attrs": sorted(model.__dict__), "training": model.training}


def assert_unchanged(model, before):
    after = fingerprint(model)
    for key in ("modules", "hooks", "attrs", "training"):
        assert after[key] == before[key], key
    for key in ("params", "buffers"):
        assert len(after[key]) == len(before[key]), key
        for a, b in zip(after[key], before[key]):
            assert a[:6] == b[:6], a[0]
            assert (a[6] is None) == (b[6] is None) and (a[6] is None or torch.equal(a[6], b[6])), a[0]
    assert trainstream_hf.engine_of(model) is None


def check_message(message: str, wanted: list[str]):
    assert "\n" not in message
    assert "path=" not in message  # an option that does not exist
    for w in wanted:
        assert re.search(w, message), (w, message)


@pytest.mark.parametrize("case", CASES)
def test_wrap_refuses_with_its_own_message_and_changes_nothing(case):
    make, wanted = CASES[case]
    model = make()
    params = [p for p in model.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3) if case != "meta" else None
    before = fingerprint(model)
    with pytest.raises(ValueError) as info:
        trainstream_hf.wrap(model, opt, vram_budget="8GiB")
    check_message(str(info.value), wanted)
    assert_unchanged(model, before)
    if opt is not None:
        assert opt.param_groups[0]["params"] == params and not opt.state


@pytest.mark.parametrize("case", CASES)
def test_plan_refuses_with_the_same_message_and_changes_nothing(case):
    make, wanted = CASES[case]
    model = make()
    before = fingerprint(model)
    with pytest.raises(ValueError) as info:
        trainstream_hf.plan(model, (1, 16), vram_budget="8GiB")
    check_message(str(info.value), wanted)
    assert_unchanged(model, before)


def test_the_messages_differ():
    """Three causes, three messages (not one generic refusal)."""
    seen = set()
    for make, _ in CASES.values():
        with pytest.raises(ValueError) as info:
            trainstream_hf.wrap(make(), None, vram_budget="8GiB")
        seen.add(str(info.value).split(";")[0])
    assert len(seen) == 3


def test_the_supported_model_is_accepted():
    """The refusals are not over-broad: the same tiny Llama, with its weights, wraps, trains a step and unwraps."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    model, opt = trainstream_hf.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), vram_budget="8GiB")
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    trainstream_hf.unwrap(model)
