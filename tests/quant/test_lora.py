"""PEFT LoRA over QuantLinear (CPU): PEFT's own dispatch wraps it in QuantLoraLinear (register_quant_lora gives the
same layer), the LoRA adapters train and the quantized base stays frozen."""
import pytest
import torch

peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402

from trainstream_hf.quant import QuantLinear, quantize_model  # noqa: E402
from trainstream_hf.integrations.peft import QuantLoraLinear, register_quant_lora  # noqa: E402


LLAMA_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]




def test_peft_wraps_quant_linear_in_quant_lora_linear_out_of_the_box(tiny_llama, token_ids):
    """No registration: QuantLinear is an nn.Linear to PEFT's dispatch, and PEFT's lora.Linear becomes a QuantLoraLinear
    as it takes one as its base; the same layer as through register_quant_lora, with the same outputs."""
    assert isinstance(QuantLinear.from_linear(torch.nn.Linear(64, 8), "nf4"), torch.nn.Linear)
    ids = token_ids()
    outputs = []
    for config in (LoraConfig(r=4, target_modules=["q_proj", "down_proj"]),
                   register_quant_lora(LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))):
        torch.manual_seed(0)
        model = get_peft_model(quantize_model(tiny_llama(), "nf4"), config)
        layers = [m for m in model.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
        assert len(layers) == 4 and all(type(m) is QuantLoraLinear for m in layers)
        with torch.no_grad():
            for m in layers:
                m.lora_B["default"].weight.normal_(std=0.1)
        outputs.append(model(ids).logits)
    assert torch.equal(*outputs)


def test_only_peft_lora_linear_over_a_quant_linear_switches():
    """The switch happens for PEFT's exact lora.Linear taking a QuantLinear base, nowhere else."""
    from peft.tuners.lora.layer import Linear as PeftLoraLinear

    quant = QuantLinear.from_linear(torch.nn.Linear(64, 8), "int8")
    dense = PeftLoraLinear(torch.nn.Linear(64, 8), "default", config=LoraConfig(r=2), r=2)
    assert type(dense) is PeftLoraLinear
    holder = torch.nn.Module()
    holder.base_layer = quant  # not a PEFT layer
    assert type(holder) is torch.nn.Module

    class OtherLora(PeftLoraLinear):  # PEFT's bitsandbytes / torchao layers are subclasses: left as they are
        pass

    assert type(OtherLora(quant, "default", config=LoraConfig(r=2), r=2)) is OtherLora
    assert type(PeftLoraLinear(quant, "default", config=LoraConfig(r=2), r=2)) is QuantLoraLinear


def test_packing_and_unpacking_the_base_of_a_peft_model_switches_the_layer_both_ways(tiny_llama, token_ids):
    """quantize_frozen_base packs the bases of existing LoRA layers: they become QuantLoraLinear; putting the dense
    layers back (what wrap does when it fails after packing) gives PEFT's lora.Linear again, as before."""
    from peft.tuners.lora.layer import Linear as PeftLoraLinear

    from trainstream_hf.quant import quantize_frozen_base

    torch.manual_seed(0)
    model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    ids = token_ids()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(std=0.1)
        before = model(ids).logits
    lora = [m for m in model.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    assert len(lora) == 4 and all(type(m) is PeftLoraLinear for m in lora)
    originals = []
    quantize_frozen_base(model, "nf4", replaced=lambda parent, child, old: originals.append((parent, child, old)))
    assert len(originals) == 14  # every frozen linear layer, the LoRA layers' bases among them
    assert all(type(m) is QuantLoraLinear and isinstance(m.base_layer, QuantLinear) for m in lora)
    with torch.no_grad():
        assert not torch.allclose(model(ids).logits, before, atol=1e-4)
    for parent, child, old in originals:
        setattr(parent, child, old)
    assert all(type(m) is PeftLoraLinear and type(m.base_layer) is torch.nn.Linear for m in lora)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


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


@pytest.mark.parametrize("register", [False, True])
def test_dense_weight_features_are_refused_and_orthogonal_init_works(tiny_llama, register):
    model = quantize_model(tiny_llama(), "nf4")
    lora = (lambda **kw: register_quant_lora(LoraConfig(**kw))) if register else LoraConfig
    with pytest.raises(NotImplementedError, match=r"DoRA \(use_dora=True\) needs the dense base weight"):
        get_peft_model(model, lora(r=4, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(NotImplementedError, match="init_lora_weights='pissa' reads the dense base weight"):
        get_peft_model(model, lora(r=4, target_modules=["q_proj"], init_lora_weights="pissa"))
    peft_model = get_peft_model(quantize_model(tiny_llama(), "nf4"), lora(r=4, target_modules=["q_proj"]))
    with pytest.raises(NotImplementedError, match="init_lora_weights='olora' reads the dense base weight"):
        peft_model.add_adapter("second", lora(r=4, target_modules=["q_proj"], init_lora_weights="olora"))
    config = LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights="orthogonal")
    model = get_peft_model(quantize_model(tiny_llama(), "nf4"), register_quant_lora(config))
    assert float(model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight.abs().sum()) > 0


# ---------------------------------------------------------------------------------------------------------------
# The native path (ops.lora_add): PEFT's numbers, one autograd node
# ---------------------------------------------------------------------------------------------------------------

def _one_layer(fmt="nf4", dropout=0.0, adapter_dtype=torch.float32, seed=0, alpha=16):
    torch.manual_seed(seed)
    base = QuantLinear.from_linear(torch.nn.Linear(64, 48, bias=True), fmt)
    model = torch.nn.Sequential(base)
    model = get_peft_model(model, register_quant_lora(LoraConfig(r=8, lora_alpha=alpha, lora_dropout=dropout,
                                                                 target_modules=["0"])))
    layer = model.base_model.model[0]
    assert isinstance(layer, QuantLoraLinear)
    with torch.no_grad():  # B starts at zero; give both adapters values so every gradient is non-trivial
        layer.lora_A["default"].weight.normal_()
        layer.lora_B["default"].weight.normal_(std=0.1)
    layer.lora_A["default"].to(adapter_dtype)
    layer.lora_B["default"].to(adapter_dtype)
    return layer


def _run(layer, x, dy, native: bool, autocast: bool):
    """Output and the gradients of x, A and B, through the native path or PEFT's own forward."""
    x = x.detach().clone().requires_grad_()
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    forward = layer.forward if native else (lambda t: super(QuantLoraLinear, layer).forward(t))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = forward(x)
    grads = torch.autograd.grad(y, (x, a, b), dy)
    return (y, *grads), y.grad_fn.name()


@pytest.mark.parametrize("x_dtype, adapter_dtype, autocast", [
    (torch.float32, torch.float32, False),
    (torch.bfloat16, torch.float32, False),   # x cast to the adapters' dtype, the sum promoted, back to bf16
    (torch.bfloat16, torch.float32, True),    # the recipes' case: matmuls in bf16 under autocast, fp32 adapters
    (torch.bfloat16, torch.bfloat16, False),
])
@pytest.mark.parametrize("alpha", [16, 4, 12])  # scaling 2 and 0.5 (folded into B), 1.5 (multiplied as PEFT does)
def test_native_lora_gives_peft_numbers_bit_for_bit(x_dtype, adapter_dtype, autocast, alpha):
    layer = _one_layer(adapter_dtype=adapter_dtype, alpha=alpha)
    assert layer.scaling["default"] == alpha / 8
    if x_dtype != torch.float32:
        layer.base_layer.to(x_dtype)
    torch.manual_seed(1)
    x = torch.randn(2, 5, 64).to(x_dtype)
    out_dtype = torch.bfloat16 if autocast or x_dtype == torch.bfloat16 else torch.float32
    dy = torch.randn(2, 5, 48).to(out_dtype)
    native, node = _run(layer, x, dy, native=True, autocast=autocast)
    peft_, peft_node = _run(layer, x, dy, native=False, autocast=autocast)
    assert "LoraAddFunction" in node and "LoraAddFunction" not in peft_node  # one node here; PEFT: its own ops
    assert native[0].dtype == peft_[0].dtype == out_dtype
    for got, want, what in zip(native, peft_, ("y", "dx", "dA", "dB")):
        assert got.dtype == want.dtype and torch.equal(got, want), what
    assert native[2].abs().sum() > 0 and native[3].abs().sum() > 0


def test_native_lora_is_skipped_where_peft_does_more():
    """Dropout on, adapters disabled, a hook on an adapter module, a second active adapter: PEFT's own forward."""
    x = torch.randn(3, 64)
    layer = _one_layer(dropout=0.1)
    assert layer._fast_adapter((), {}) is None
    layer = _one_layer()
    assert layer._fast_adapter((), {}) == "default"
    assert "LoraAddFunction" in layer(x).grad_fn.name()
    layer.enable_adapters(False)
    assert layer._fast_adapter((), {}) is None
    assert torch.equal(layer(x), layer.base_layer(x))
    layer.enable_adapters(True)
    seen = []
    handle = layer.lora_A["default"].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    layer(x)
    assert seen == [(3, 8)]  # PEFT's path called the module, so its hook ran
    handle.remove()
    layer.update_layer("other", r=4, lora_alpha=8, config=LoraConfig(r=4, lora_alpha=8))
    layer.set_adapter(["default", "other"])
    assert layer._fast_adapter((), {}) is None


def test_native_lora_bad_operands():
    from trainstream_hf import ops
    x, result = torch.randn(3, 64), torch.randn(3, 48)
    a, b = torch.randn(8, 64), torch.randn(48, 8)
    with pytest.raises(ValueError, match=r"x must be \(\.\.\., 64\)"):
        ops.lora_add(result, x[:, :32], a, b, 2.0)
    with pytest.raises(ValueError, match="result must be"):
        ops.lora_add(result[:2], x, a, b, 2.0)
    with pytest.raises(ValueError, match="lora_a must be"):
        ops.lora_add(result, x, a, b.t(), 2.0)
    with pytest.raises(TypeError, match="adapters of one dtype"):
        ops.lora_add(result, x, a, b.double(), 2.0)


def test_native_lora_saves_the_narrow_input_not_a_widened_copy():
    """bf16 x with fp32 adapters outside autocast: PEFT's graph saves an fp32 copy of x for dA (the engine's cast
    elision exists for it); the native node saves x itself and widens it again in backward (exact)."""
    layer = _one_layer()
    layer.base_layer.to(torch.bfloat16)
    x = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = ops_lora_add(layer, x)
    inputs = [t for t in saved if t.shape == (4, 64)]
    assert inputs
    assert {t.dtype for t in inputs} == {torch.bfloat16}  # and the widened fp32 copy of x is not among them
    y.sum().backward()
    assert x.grad is not None and layer.lora_A["default"].weight.grad.abs().sum() > 0


def ops_lora_add(layer, x):
    from trainstream_hf import ops
    return ops.lora_add(layer.base_layer(x), x, layer.lora_A["default"].weight, layer.lora_B["default"].weight,
                        layer.scaling["default"])


# ---------------------------------------------------------------------------------------------------------------
# The fused path (ops.lora_dequant_linear): weight-only base and adapter in one node, sums inside the GEMMs
# ---------------------------------------------------------------------------------------------------------------

def _fused_layer(fmt="nf4", alpha=16, seed=0):
    torch.manual_seed(seed)
    base = QuantLinear.from_linear(torch.nn.Linear(128, 64, bias=False), fmt, act_quant=False)
    model = get_peft_model(torch.nn.Sequential(base), register_quant_lora(
        LoraConfig(r=8, lora_alpha=alpha, target_modules=["0"])))
    layer = model.base_model.model[0]
    with torch.no_grad():
        layer.lora_A["default"].weight.normal_()
        layer.lora_B["default"].weight.normal_(std=0.1)
    return layer


@pytest.mark.parametrize("fmt", ["nf4", "int8", "nvfp4"])
@pytest.mark.parametrize("alpha", [16, 12])
def test_fused_lora_matches_peft_in_fp32(fmt, alpha):
    """fp32 throughout (the issue's check: 1e-5 of PEFT): the same maths as PEFT's graph, summed in the GEMMs."""
    layer = _fused_layer(fmt, alpha)
    x = torch.randn(2, 5, 128)
    dy = torch.randn(2, 5, 64)
    fused, node = _run(layer, x, dy, native=True, autocast=False)
    peft_, _ = _run(layer, x, dy, native=False, autocast=False)
    assert "LoraDequantLinearFunction" in node
    for got, want, what in zip(fused, peft_, ("y", "dx", "dA", "dB")):
        assert got.dtype == want.dtype == torch.float32
        err = float((got - want).abs().max() / want.abs().max())
        assert err < 1e-6, (what, err)


def test_fused_lora_under_autocast_is_as_close_to_exact_as_peft():
    """bf16 autocast, fp32 adapters (the recipes): one rounding fewer than PEFT's graph, so not its bits, but no
    further from the float64 result than PEFT is (and within bf16 rounding of PEFT)."""
    layer = _fused_layer()
    layer.base_layer.to(torch.bfloat16)
    torch.manual_seed(3)
    x = torch.randn(4, 16, 128).to(torch.bfloat16)
    dy = torch.randn(4, 16, 64).to(torch.bfloat16)
    fused, node = _run(layer, x, dy, native=True, autocast=True)
    peft_, _ = _run(layer, x, dy, native=False, autocast=True)
    assert "LoraDequantLinearFunction" in node and fused[0].dtype == peft_[0].dtype == torch.bfloat16
    # float64 reference on the bf16-rounded operands both paths multiply
    a = layer.lora_A["default"].weight.detach().to(torch.bfloat16).double()
    b = layer.lora_B["default"].weight.detach().to(torch.bfloat16).double()
    w = layer.base_layer.dequantize_weight().to(torch.bfloat16).double()
    xd, s = x.double().reshape(-1, 128), layer.scaling["default"]
    y_exact = xd @ w.t() + s * (xd @ a.t()) @ b.t()
    for got, want in ((fused[0], peft_[0]),):
        e_fused = float((got.double().reshape(-1, 64) - y_exact).abs().mean())
        e_peft = float((want.double().reshape(-1, 64) - y_exact).abs().mean())
        assert e_fused <= e_peft * 1.02, (e_fused, e_peft)
    for got, want, what in zip(fused, peft_, ("y", "dx", "dA", "dB")):
        err = float((got.double() - want.double()).abs().max() / want.double().abs().max())
        assert err < 2 ** -6, (what, err)


def _exact_lora(layer, x, dy):
    """float64 y, dx, dA, dB of the layer on x (its bf16 values), the adapters as they are (float32), the base's
    dequantized weight in x's dtype: what PEFT's float32 adapter graph approximates."""
    a = layer.lora_A["default"].weight.detach().double()
    b = layer.lora_B["default"].weight.detach().double()
    w = layer.base_layer.dequantize_weight().to(x.dtype).double()
    s = layer.scaling["default"]
    xd, g = x.double().reshape(-1, a.shape[1]), dy.double().reshape(-1, b.shape[0])
    h = xd @ a.t()
    return xd @ w.t() + s * h @ b.t(), g @ w + s * (g @ b) @ a, s * (g @ b).t() @ xd, s * g.t() @ h


def check_split_regime(fused, peft_, exact, y_model=None):
    """The split regime against PEFT's float32 graph: the float32 adapter gradients agree to float32 rounding; y and
    dx (bf16) are within bf16 rounding of PEFT's and no further from float64 than PEFT's. ``y_model`` (CUDA, where
    cuBLAS rounds the adapter's term before adding it: csrc/autograd/dequant_linear.cpp): y is held to that rounding
    model's error instead of PEFT's."""
    for got, want, what in zip(fused, peft_, ("y", "dx", "dA", "dB")):
        assert got.dtype == want.dtype, what
        err = float((got.double() - want.double()).abs().max() / want.double().abs().max())
        assert err < (2 ** -7 if got.dtype == torch.bfloat16 else 1e-5), (what, err)
    for got, want, ref, what in zip(fused[:2], peft_[:2], exact[:2], ("y", "dx")):
        e_fused = float((got.double().reshape(ref.shape) - ref).abs().mean())
        e_peft = float((want.double().reshape(ref.shape) - ref).abs().mean())
        if what == "y" and y_model is not None:
            e_model = float((y_model.reshape(ref.shape) - ref).abs().mean())
            assert e_fused <= e_model * 1.02, (what, e_fused, e_model, e_peft)
        else:
            assert e_fused <= e_peft * 1.02, (what, e_fused, e_peft)
    for got, ref, what in zip(fused[2:], exact[2:], ("dA", "dB")):
        err = float((got.double() - ref).abs().max() / ref.abs().max())
        assert err < 1e-5, (what, err)


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
@pytest.mark.parametrize("alpha", [16, 12])
def test_fused_lora_bf16_x_float32_adapters_without_autocast(fmt, alpha):
    """PEFT's default (bf16 model, adapters upcast to float32, no autocast): PEFT widens x to float32; the fused node
    splits the float32 operands into bf16 parts instead (ops.split_bf16), nothing activation-sized widened."""
    layer = _fused_layer(fmt, alpha)
    layer.base_layer.to(torch.bfloat16)
    assert layer.lora_A["default"].weight.dtype == torch.float32
    torch.manual_seed(5)
    x = torch.randn(4, 16, 128).to(torch.bfloat16)
    dy = torch.randn(4, 16, 64).to(torch.bfloat16)
    fused, node = _run(layer, x, dy, native=True, autocast=False)
    peft_, _ = _run(layer, x, dy, native=False, autocast=False)
    assert "LoraDequantLinearFunction" in node
    assert [t.dtype for t in fused] == [torch.bfloat16, torch.bfloat16, torch.float32, torch.float32]
    check_split_regime(fused, peft_, _exact_lora(layer, x, dy))


def test_fused_lora_split_regime_saves_no_widened_input():
    layer = _fused_layer()
    layer.base_layer.to(torch.bfloat16)
    x = torch.randn(6, 128, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = layer(x)
    assert "LoraDequantLinearFunction" in y.grad_fn.name()
    assert [t.dtype for t in saved if t.shape == (6, 128)] == [torch.bfloat16]
    assert sum(t.numel() * t.element_size() for t in saved if t.dtype == torch.float32 and t.dim() == 2 and t.shape[0] == 6) \
        == 6 * 8 * 4  # the float32 x A^T, (tokens, r)


def test_split_bf16():
    from trainstream_hf import ops
    torch.manual_seed(0)
    t = torch.randn(5, 7) * torch.logspace(-20, 20, 7)
    parts = ops.split_bf16(t, [0, 1, 2], 0)
    assert parts.shape == (15, 7) and parts.dtype == torch.bfloat16
    p0, p1, p2 = parts.view(3, 5, 7).double()
    assert torch.equal(p0 + p1 + p2, t.double())  # exact in bf16's normal range
    assert torch.equal(parts[:5], t.to(torch.bfloat16))
    cols = ops.split_bf16(t, [0, 0, 2, 1], 1)
    assert cols.shape == (5, 28)
    for j, k in enumerate([0, 0, 2, 1]):
        assert torch.equal(cols[:, 7 * j:7 * (j + 1)], parts[5 * k:5 * (k + 1)])
    with pytest.raises(TypeError, match="t must be float32"):
        ops.split_bf16(t.double(), [0], 0)
    with pytest.raises(ValueError, match="pattern entries must be 0, 1 or 2"):
        ops.split_bf16(t, [3], 0)
    with pytest.raises(ValueError, match="dim must be 0"):
        ops.split_bf16(t, [0], 2)
    with pytest.raises(ValueError, match="1 to 8 parts"):
        ops.split_bf16(t, [0] * 9, 0)


def test_fused_lora_is_taken_only_where_it_applies():
    """A bias, an activation-quantized base (fp8 W8A8), fp16 x with fp32 adapters outside autocast, or a hook on the
    base: the base and the adapter run apart (lora_add, PEFT's bits)."""
    x = torch.randn(3, 128)
    assert "LoraDequantLinearFunction" in _fused_layer()(x).grad_fn.name()
    with_bias = _one_layer()  # bias=True
    assert "LoraAddFunction" in with_bias(torch.randn(3, 64)).grad_fn.name()
    w8a8 = _fused_layer(fmt="fp8")
    w8a8.base_layer.act_quant = True
    assert w8a8.base_layer.fused_lora_operands(x, w8a8.lora_A["default"].weight) is None
    mixed = _fused_layer()
    mixed.base_layer.to(torch.float16)  # fp32 split into fp16 parts would fall below fp16's range: not split
    assert "LoraAddFunction" in mixed(x.to(torch.float16)).grad_fn.name()
    mixed.base_layer.to(torch.bfloat16)
    assert "LoraDequantLinearFunction" in mixed(x.to(torch.bfloat16)).grad_fn.name()
    hooked = _fused_layer()
    seen = []
    hooked.base_layer.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    assert "LoraAddFunction" in hooked(x).grad_fn.name() and seen == [(3, 64)]  # the base was called: its hook ran


def test_fused_lora_bad_operands():
    from trainstream_hf import ops
    layer = _fused_layer()
    packed, fmt = layer.base_layer.fused_lora_operands(torch.randn(2, 128), layer.lora_A["default"].weight)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    with pytest.raises(ValueError, match=r"x must be \(\.\.\., 128\)"):
        ops.lora_dequant_linear(torch.randn(2, 64), packed, fmt, a, b, 2.0)
    with pytest.raises(ValueError, match="lora_a must be"):
        ops.lora_dequant_linear(torch.randn(2, 128), packed, fmt, a[:, :64], b, 2.0)
    with pytest.raises(TypeError, match="must share a dtype"):
        ops.lora_dequant_linear(torch.randn(2, 128, dtype=torch.float16), packed, fmt, a, b, 2.0)
    with pytest.raises(ValueError, match="takes 4 packed tensors"):
        ops.lora_dequant_linear(torch.randn(2, 128), packed[:2], fmt, a, b, 2.0)
