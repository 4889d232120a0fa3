"""Subclasses of nn.Linear that compute the plain linear map (Falcon's FalconLinear) are packed as nn.Linear is; other
subclasses (a router, MultiheadAttention's out_proj) are left alone."""
import pytest
import torch
from torch import nn

import trainstream_hf as ts
from trainstream_hf.quant import QuantLinear, quantize_model
from trainstream_hf.quant.model import is_plain_linear

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _falcon():
    torch.manual_seed(0)
    config = transformers.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=256,
                                       ffn_hidden_size=128)
    return transformers.FalconForCausalLM(config).eval()


def test_falcon_linear_is_plain_and_a_router_is_not():
    from transformers.models.falcon.modeling_falcon import FalconLinear

    assert is_plain_linear(FalconLinear(64, 64)) and is_plain_linear(nn.Linear(4, 4))
    assert not is_plain_linear(nn.MultiheadAttention(8, 2).out_proj)

    class Router(nn.Linear):
        def forward(self, x):
            return super().forward(x).softmax(-1)

    assert not is_plain_linear(Router(4, 4))


def test_falcon_packs_and_gives_the_dense_models_logits_within_int8_rounding():
    model = _falcon()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        quantize_model(model, "int8")
        got = model(input_ids=ids).logits
    layers = [m for m in model.transformer.h.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 4 * 2  # query_key_value, dense, dense_h_to_4h, dense_4h_to_h per block
    assert (got - want).abs().max() <= 0.05 * want.abs().max()


def test_falcon_lora_over_an_nf4_base_trains_through_wrap():
    model = peft.get_peft_model(_falcon().train(), peft.LoraConfig(r=8, target_modules="all-linear"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = ts.wrap(model, opt, device="cpu", vram_budget="8GiB", host_arena=None, quantize="nf4",
                         batch_shape=(2, 16))
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 8
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    losses = []
    for _ in range(4):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
