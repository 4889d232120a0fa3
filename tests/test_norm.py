"""Fused RMSNorm (ops.rms_norm, engine/norms.py, wrap(fused_norms=True)) on the CPU: the maths of transformers'
LlamaRMSNorm, within the rounding of a reduction taken in another order."""
import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import trainstream_hf as ts
from trainstream_hf import ops
from trainstream_hf.engine.norms import FusedNorms
from tests.helpers import rel_err

TOL = {torch.float32: 1e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -9}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 7, 256), (5, 4096), (1, 1, 64)])
def test_rms_norm_matches_the_module(dtype, shape):
    torch.manual_seed(0)
    m = LlamaRMSNorm(shape[-1], eps=1e-6).to(dtype)
    with torch.no_grad():
        m.weight.normal_(1.0, 0.2)
    x = (torch.randn(*shape) * 3).to(dtype).requires_grad_()
    y = m(x)
    dy = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, m.weight), dy)
    x2 = x.detach().clone().requires_grad_()
    y2 = ops.rms_norm(x2, m.weight, 1e-6)
    assert "RmsNormFunction" in y2.grad_fn.name() and y2.dtype == y.dtype and y2.shape == y.shape
    dx2, dw2 = torch.autograd.grad(y2, (x2, m.weight), dy)
    for got, want, what in ((y2, y, "y"), (dx2, dx, "dx"), (dw2, dw, "dw")):
        assert rel_err(got, want) <= TOL[dtype], (what, rel_err(got, want))


def test_rms_norm_frozen_weight_and_no_grad():
    m = LlamaRMSNorm(64).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(3, 64, dtype=torch.bfloat16, requires_grad=True)
    y = ops.rms_norm(x, m.weight, m.variance_epsilon)
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert dx.shape == x.shape and m.weight.grad is None
    with torch.no_grad():
        assert torch.equal(ops.rms_norm(x, m.weight, m.variance_epsilon), y.detach())


def test_rms_norm_bad_input():
    w = torch.ones(64)
    with pytest.raises(ValueError, match=r"x must be \(\.\.\., 64\)"):
        ops.rms_norm(torch.randn(3, 32), w, 1e-6)
    with pytest.raises(TypeError, match="weight must have x's dtype"):
        ops.rms_norm(torch.randn(3, 64, dtype=torch.bfloat16), w, 1e-6)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        ops.rms_norm(torch.randn(3, 64, dtype=torch.float64), w.double(), 1e-6)


class LookAlikeRMSNorm(nn.Module):
    """Gemma's maths (x * (1 + weight)) under a listed class name: must not be taken."""

    def __init__(self, k):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(k))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        v = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(v + self.variance_epsilon) * (1.0 + self.weight.float())).to(x.dtype)


LookAlikeRMSNorm.__name__ = "MistralRMSNorm"


def _llama(layers=2):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def test_fused_norms_install_and_uninstall():
    model = _llama()
    norms = [m for m in model.modules() if isinstance(m, LlamaRMSNorm)]
    fused = FusedNorms()
    assert fused.install(model.modules()) == len(norms) == 2 * 2 + 1
    x = torch.randn(2, 5, 64)
    assert "RmsNormFunction" in norms[0](x.requires_grad_()).grad_fn.name()
    odd = LookAlikeRMSNorm(64)
    with pytest.warns(RuntimeWarning, match="does not match the fused RMSNorm"):
        assert FusedNorms().install([odd]) == 0
    assert "forward" not in odd.__dict__
    fused.uninstall()
    assert all("forward" not in m.__dict__ for m in norms)
    assert "RmsNormFunction" not in norms[0](x).grad_fn.name()


def test_wrap_with_fused_norms_trains_like_the_module():
    """wrap(fused_norms=True): every norm fused, losses within float32 rounding of the unfused run over 3 steps of
    AdamW, and unwrap gives the modules their own forwards back."""
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = {}
    for fused in (False, True):
        model = _llama()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = ts.wrap(model, opt, device="cpu", vram_budget="8GiB", host_arena=None, fused_norms=fused)
        eng = ts.engine_of(model)
        assert (eng.norms is not None and len(eng.norms.modules) == 5) == fused
        run = []
        for _ in range(3):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.item())
        losses[fused] = run
        model = ts.unwrap(model)
        assert all("forward" not in m.__dict__ for m in model.modules())
    assert max(abs(a - b) for a, b in zip(losses[True], losses[False])) < 1e-5, losses


def test_fused_norms_option():
    with pytest.raises(ValueError, match="fused_norms: True or False"):
        ts.TrainStreamConfig(fused_norms="auto")
