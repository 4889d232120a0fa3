"""quantize_model (CPU) on tiny Llama and GPT-2 (Conv1D) built from configs: what is replaced, what is skipped, forward
and backward, loss against the unquantized model, one layer at a time, bad input."""
import copy
import weakref

import pytest
import torch
from torch import nn

from trainstream_hf.quant import QuantLinear, dequantize, quantize, quantize_model

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402

FORMATS = ["int8", "nf4", "fp8", "nvfp4"]
LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")




@pytest.fixture(scope="module")
def trained_llama(tiny_llama, token_ids):
    """A tiny Llama trained a few steps on one batch, so that its loss (~2.6, below ln 256 = 5.5) depends on its
    weights; a freshly initialised model predicts ~uniformly whatever its weights are."""
    model = tiny_llama().train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = token_ids()
    for _ in range(8):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def _names(model, cls):
    return {n for n, m in model.named_modules() if type(m) is cls}


@pytest.mark.parametrize("fmt", FORMATS)
def test_llama_every_linear_but_lm_head(fmt, tiny_llama, token_ids):
    model = tiny_llama()
    linears = _names(model, nn.Linear)
    assert quantize_model(model, fmt) is model
    quant = _names(model, QuantLinear)
    assert quant == linears - {"lm_head"} and len(quant) == 2 * len(LLAMA_LINEARS)
    assert type(model.lm_head) is nn.Linear
    for m in model.modules():
        if isinstance(m, QuantLinear):
            assert m.fmt.name == fmt and m.weight.dtype == torch.float32
    ids = token_ids()
    out = model(ids, labels=ids)
    out.loss.backward()
    assert model.model.embed_tokens.weight.grad is not None  # the gradient went through every QuantLinear
    assert float(model.model.embed_tokens.weight.grad.abs().sum()) > 0
    assert all(p.grad is None for n, p in model.named_parameters() if ".weight_" in n)


# Relative loss change and relative logits error (Frobenius) allowed after quantization; measured on the trained
# tiny Llama: int8 2.1e-5 / 0.0024, fp8 (W8A8) 2.5e-4 / 0.015. The bounds are ~6-10x those, far below what a wrong
# layer (a transposed or unscaled weight: logits error ~1) gives.
LOSS_TOL = {"int8": (2e-4, 0.015), "fp8": (3e-3, 0.1)}


@pytest.mark.parametrize("fmt", list(LOSS_TOL))
def test_loss_close_to_unquantized(fmt, trained_llama, token_ids):
    ids = token_ids()
    with torch.no_grad():
        ref = trained_llama(ids, labels=ids)
        out = quantize_model(copy.deepcopy(trained_llama), fmt)(ids, labels=ids)
    d_loss = abs(float(out.loss) - float(ref.loss)) / float(ref.loss)
    d_logits = float((out.logits - ref.logits).norm() / ref.logits.norm())
    print(f"{fmt}: loss {float(ref.loss):.4f} -> {float(out.loss):.4f} (rel {d_loss:.2e}), logits rel err "
          f"{d_logits:.4f}")
    assert float(ref.loss) < 3.5
    assert d_loss <= LOSS_TOL[fmt][0] and d_logits <= LOSS_TOL[fmt][1]


@pytest.mark.parametrize("fmt", FORMATS)
def test_gpt2_conv1d(fmt, tiny_gpt2, token_ids):
    model = tiny_gpt2()
    convs = _names(model, Conv1D)
    originals = {n: model.get_submodule(n).weight.detach().clone() for n in convs}
    ids = token_ids()
    with torch.no_grad():
        ref = model(ids).logits
    with pytest.warns(UserWarning, match="share their weight with another module"):
        quantize_model(model, fmt, skip=())  # lm_head is tied to wte: kept, with a warning
    assert _names(model, QuantLinear) == convs and len(convs) == 8 and not _names(model, Conv1D)
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.transformer.wte.weight
    for n, w in originals.items():  # Conv1D's (in, out) weight was transposed into (out, in)
        layer = model.get_submodule(n)
        assert (layer.in_features, layer.out_features) == (w.shape[0], w.shape[1])
        assert torch.equal(layer.dequantize_weight(torch.float32), dequantize(quantize(w.t(), fmt), torch.float32))
    out = model(ids, labels=ids)
    out.loss.backward()
    assert float(model.transformer.wte.weight.grad.abs().sum()) > 0
    rel = float((out.logits.detach() - ref).norm() / ref.norm())
    assert rel < {"int8": 0.02, "fp8": 0.1, "nf4": 0.25, "nvfp4": 0.3}[fmt], rel


def test_skip(tiny_llama):
    model = tiny_llama()
    quantize_model(model, "int8", skip=("down_proj", "model.layers.0.self_attn.q_proj", "lm_head"))
    kept = _names(model, nn.Linear)
    assert kept == {"lm_head", "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj",
                    "model.layers.1.mlp.down_proj"}
    model = tiny_llama()
    quantize_model(model, "int8", skip="q_proj")  # a single name; lm_head is then quantized (not tied here)
    assert _names(model, nn.Linear) == {"model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"}
    model = tiny_llama()
    quantize_model(model, "int8", skip=("proj", "lm_head"))  # whole components only, not substrings
    assert _names(model, nn.Linear) == {"lm_head"}


def test_in_features_not_a_multiple_of_the_block_is_rejected_before_anything_changes(tiny_llama):
    model = tiny_llama(hidden=96)  # 96 % 64 != 0; the MLP's down_proj has in_features 256
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"nf4 needs in_features to be a multiple of 64; these layers are not: "
                                         r"model\.layers\.0\.self_attn\.q_proj \(in_features=96\), .*Nothing was "
                                         r"converted"):
        quantize_model(model, "nf4")
    assert not _names(model, QuantLinear)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    quantize_model(model, "nf4", skip=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "lm_head"))
    assert _names(model, QuantLinear) == {"model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"}
    quantize_model(tiny_llama(hidden=96), "nvfp4")  # 96 % 16 == 0


def test_bad_arguments(tiny_llama):
    for kw, msg in [({"quantize": "int4"}, "unknown quantization format 'int4'"),
                    ({"outliers": 0.7}, r"outliers must be .* in \[0, 0.5\]"),
                    ({"outliers": -0.01}, r"outliers must be .* in \[0, 0.5\]")]:
        model = tiny_llama()
        with pytest.raises(ValueError, match=msg):
            quantize_model(model, **kw)
        assert not _names(model, QuantLinear)


def test_one_layer_at_a_time(monkeypatch, tiny_llama):
    """Each original layer is released as soon as its replacement is in place (by reference counting, no garbage
    collection needed): when layer i is quantized, the weights of the i layers before it are already gone, so no
    second copy of the model is ever held."""
    model = tiny_llama()
    refs = [weakref.ref(m.weight) for n, m in model.named_modules() if type(m) is nn.Linear and n != "lm_head"]
    alive_at_call = []
    real = QuantLinear.from_linear.__func__

    def spy(cls, linear, *args, **kwargs):
        alive_at_call.append(sum(r() is not None for r in refs))
        return real(cls, linear, *args, **kwargs)

    monkeypatch.setattr(QuantLinear, "from_linear", classmethod(spy))
    quantize_model(model, "nf4")
    n = len(refs)
    assert alive_at_call == list(range(n, 0, -1))
    assert all(r() is None for r in refs)


def test_leaves_other_modules_alone():
    mha = nn.MultiheadAttention(64, 4)
    model = nn.Sequential(nn.Linear(64, 64), mha, QuantLinear.from_linear(nn.Linear(64, 64), "int8"))
    shared = nn.Linear(64, 64)
    model.append(shared)
    model.append(shared)  # one module under two names: converted once, both names see the same QuantLinear
    quantize_model(model, "int8", skip=())
    assert type(model[0]) is QuantLinear and type(mha.out_proj) is not QuantLinear
    assert type(model[3]) is QuantLinear and model[3] is model[4]
    single = quantize_model(nn.Linear(64, 32), "fp8")
    assert isinstance(single, QuantLinear) and single.out_features == 32


def test_quantize_frozen_base_accepts_a_base_packed_in_the_same_format():
    """The option passes through every step that takes it: a base already packed in that format is left as it is;
    another format (or other outliers) is an error naming the layer."""
    import pytest
    import torch
    from torch import nn

    from trainstream_hf.quant import QuantLinear
    from trainstream_hf.quant.model import quantize_frozen_base

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    model[0].weight.requires_grad_(False)
    model[0].bias.requires_grad_(False)
    assert quantize_frozen_base(model, "nf4") == ["0"]
    layer = model[0]
    assert quantize_frozen_base(model, "nf4") == [] and model[0] is layer and isinstance(layer, QuantLinear)
    with pytest.raises(ValueError, match=r"layer 0 is already packed as 'nf4' with outliers=0.0"):
        quantize_frozen_base(model, "int8")
    with pytest.raises(ValueError, match="already packed"):
        quantize_frozen_base(model, "nf4", outliers=0.01)


def test_quantize_frozen_base_names_conv1d_projections_it_does_not_pack(tiny_gpt2):
    """GPT-2's projections are Conv1D: a LoRA model over them has no frozen nn.Linear to pack (PEFT merges Conv1D
    adapters transposed, fan_in_fan_out), and the refusal says so rather than that every linear layer trains."""
    from trainstream_hf.quant.model import quantize_frozen_base

    model = tiny_gpt2()
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match=r"frozen projections are transformers' Conv1D \(GPT-2 style, e\.g\. "
                                         r"transformer\.h\.0\.attn\.c_attn\), which it does not pack"):
        quantize_frozen_base(model, "nf4")
    assert not _names(model, QuantLinear)


def test_quantize_frozen_base_keeps_layers_too_narrow_for_the_format_and_says_so():
    """wrap(quantize=...) has no skip list: a frozen layer whose in_features the format cannot take stays in its
    dtype, named in a warning, and the rest are packed; a model with no layer the format takes is an error."""
    import warnings

    import pytest
    import torch
    from torch import nn

    from trainstream_hf.quant import QuantLinear
    from trainstream_hf.quant.model import quantize_frozen_base

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 160), nn.Linear(160, 64), nn.Linear(64, 8))
    for p in model.parameters():
        p.requires_grad_(False)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert quantize_frozen_base(model, "nf4") == ["0", "2"]
    assert [type(m) for m in model] == [QuantLinear, nn.Linear, QuantLinear]
    assert len(said) == 1 and "1 of 3 frozen linear layers stay in their dtype: nf4 needs in_features to be a " \
        "multiple of 64, and theirs are not (1 (160)); int8 and fp8 take any width" in str(said[0].message)
    narrow = nn.Sequential(nn.Linear(96, 64)).requires_grad_(False)
    with pytest.raises(ValueError, match=r"no frozen linear layer of this model has one \(e.g. 0, in_features=96\)"):
        quantize_frozen_base(narrow, "nf4")
    assert type(narrow[0]) is nn.Linear
