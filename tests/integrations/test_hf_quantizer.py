"""The "trainstream" HfQuantizer (CPU, transformers 5.24): from_pretrained on a tiny checkpoint saved as safetensors
loads straight into QuantLinear, bit-identical to quantize_model on the same model loaded dense."""
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from trainstream_hf.integrations.huggingface import TrainStreamHfQuantizer, TrainStreamQuantizationConfig
from trainstream_hf.quant import QuantLinear, quantize_model

peft = pytest.importorskip("peft")
from peft import get_peft_model  # noqa: E402

from trainstream_hf.integrations.peft import quant_lora_config  # noqa: E402
from tests.helpers import scale_input_channels, tiny_llama  # noqa: E402



@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    model = tiny_llama(hidden=128, vocab=256, positions=64, tie_word_embeddings=False)
    scale_input_channels(model, every=29, factor=6.0)  # outlier input channels
    path = tmp_path_factory.mktemp("llama")
    model.to(torch.bfloat16).save_pretrained(path)
    assert (path / "model.safetensors").exists()
    return path


def _ids():
    return torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(5))


def _bytes(t):
    return t.detach().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("fmt", ["nf4", "fp8"])
def test_from_pretrained_quantizes_on_load_bit_identical_to_quantize_model(llama_dir, fmt):
    model, info = AutoModelForCausalLM.from_pretrained(
        llama_dir, dtype=torch.bfloat16, quantization_config=TrainStreamQuantizationConfig(quantize=fmt),
        output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert isinstance(model.hf_quantizer, TrainStreamHfQuantizer) and model.is_quantized
    quant = [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    assert len(quant) == 14 and all(model.get_submodule(n).fmt.name == fmt for n in quant)
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight.dtype == torch.bfloat16
    assert not any(type(m) is nn.Linear for n, m in model.named_modules() if n != "lm_head")

    ref = quantize_model(AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.bfloat16), fmt)
    got, want = model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for k in got:
        assert got[k].dtype == want[k].dtype and torch.equal(_bytes(got[k]), _bytes(want[k])), k
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_lora_trains_on_the_loaded_model_and_the_adapters_save(llama_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32,
                                                 quantization_config=TrainStreamQuantizationConfig(quantize="nf4"))
    model = get_peft_model(model, quant_lora_config(model, r=4, target_modules="all-linear"))
    model.train()
    ids = _ids()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(4):
        loss = model(ids, labels=ids).loss
        loss.backward()
        grads = [p.grad for n, p in model.named_parameters() if ".lora_B." in n]
        assert len(grads) == 14 and all(float(g.abs().sum()) > 0 for g in grads)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    model.save_pretrained(tmp_path / "adapters")
    assert (tmp_path / "adapters" / "adapter_model.safetensors").is_file()


def test_gpt2_conv1d_biases_and_tied_head(tmp_path):
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=128, n_layer=2, n_head=4, n_positions=64,
                                      bos_token_id=0, eos_token_id=0))
    with torch.no_grad():
        for m in gpt2.modules():
            if isinstance(getattr(m, "bias", None), torch.Tensor) and m.bias.ndim == 1:
                m.bias.normal_(0, 0.1)
    gpt2.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=TrainStreamQuantizationConfig(
        quantize="int8", skip=[]))
    ref = quantize_model(AutoModelForCausalLM.from_pretrained(tmp_path), "int8", skip=[])
    c_attn = model.transformer.h[0].attn.c_attn
    with pytest.raises(AttributeError, match="cannot be assigned"):
        c_attn.weight = torch.zeros(384, 128)
    assert isinstance(c_attn, QuantLinear) and (c_attn.in_features, c_attn.out_features) == (128, 384)
    assert torch.equal(c_attn.bias, ref.transformer.h[0].attn.c_attn.bias) and c_attn.bias.abs().sum() > 0
    assert model.lm_head.weight is model.transformer.wte.weight  # tied head: never quantized
    with torch.no_grad():
        assert torch.equal(model(_ids()).logits, ref(_ids()).logits)


def test_a_weight_missing_from_the_checkpoint_is_quantized_after_loading(llama_dir, tmp_path):
    state = load_file(llama_dir / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((llama_dir / "config.json").read_text())
    with pytest.warns(UserWarning, match="quantized as initialised: model.layers.1.mlp.up_proj"):
        model, info = AutoModelForCausalLM.from_pretrained(
            tmp_path, dtype=torch.bfloat16, quantization_config=TrainStreamQuantizationConfig(quantize="nf4"),
            output_loading_info=True)
    assert set(info["missing_keys"]) == {"model.layers.1.mlp.up_proj.weight"}
    assert isinstance(model.model.layers[1].mlp.up_proj, QuantLinear)


def test_bad_options_and_widths_are_errors(tmp_path):
    with pytest.raises(ValueError, match="choose one of"):
        TrainStreamQuantizationConfig(quantize="int4")
    with pytest.raises(ValueError, match="unknown options"):
        TrainStreamQuantizationConfig(quantize="nf4", group_size=32)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=96, intermediate_size=192, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="multiple of 64"):
        AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=TrainStreamQuantizationConfig("nf4"))
    cfg = TrainStreamQuantizationConfig.from_dict(TrainStreamQuantizationConfig("fp8", outliers=0.01).to_dict())
    assert (cfg.quantize, cfg.outliers, cfg.skip, cfg.modules) == ("fp8", 0.01, ["lm_head"], None)
    cfg = TrainStreamQuantizationConfig.from_dict(TrainStreamQuantizationConfig("nf4", modules=["a.b"]).to_dict())
    assert cfg.modules == ["a.b"]


def test_packed_layers_are_nn_linear_that_nothing_re_initialises_or_re_quantizes(llama_dir):
    """QuantLinear is an nn.Linear subclass (for PEFT's dispatch) without a dense weight: transformers' weight init
    skips it, quantize_model leaves it alone, nn.Linear's reset_parameters and from_linear refuse it."""
    model = quantize_model(AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32), "nf4")
    quant = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert len(quant) == 14 and all(isinstance(m, nn.Linear) for m in quant.values())
    before = {k: _bytes(v).clone() for k, v in model.state_dict().items()}
    model.initialize_weights()  # transformers' _init_weights over every module not flagged as initialised
    quantize_model(model, "int8")
    assert {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)} == quant
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(_bytes(after[k]), before[k]) for k in before)
    layer = quant["model.layers.0.self_attn.q_proj"]
    with pytest.raises(NotImplementedError, match="cannot be re-initialised"):
        layer.reset_parameters()
    with pytest.raises(TypeError, match="already quantized"):
        QuantLinear.from_linear(layer, "int8")


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_the_loaded_model_carries_the_kbit_flag_peft_and_trl_read(llama_dir, fmt):
    plain = AutoModelForCausalLM.from_pretrained(llama_dir)
    assert not getattr(plain, "is_loaded_in_8bit", False) and not getattr(plain, "is_loaded_in_4bit", False)
    model = AutoModelForCausalLM.from_pretrained(llama_dir, quantization_config=TrainStreamQuantizationConfig(fmt))
    assert model.is_loaded_in_8bit is True and not getattr(model, "is_loaded_in_4bit", False)
    assert model.num_parameters() > 0  # transformers imports bitsandbytes here for is_loaded_in_4bit models
    model.hf_quantizer.remove_quantization_config(model)  # what dequantize() ends with
    assert not hasattr(model, "is_loaded_in_8bit") and not model.is_quantized


def test_a_packed_model_lets_generate_compile_its_decode_step(tmp_path):
    """transformers compiles generate()'s decode step only when the model's quantizer says it can (HfQuantizer's
    default says no): a model loaded packed through TrainStreamQuantizationConfig compiles, with the eager tokens."""
    from torch._dynamo.utils import counters
    from transformers.generation.configuration_utils import CompileConfig

    tiny_llama(2, vocab=128).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=TrainStreamQuantizationConfig("nf4"))
    assert model.hf_quantizer.is_compileable
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, pad_token_id=0,
              cache_implementation="static")
    eager = model.generate(ids, disable_compile=True, **kw)
    compile_config = CompileConfig(backend="eager", mode=None)
    compile_config._compile_all_devices = True  # (transformers compiles generate() on accelerators only)
    torch._dynamo.reset()
    counters.clear()
    compiled = model.generate(ids, disable_compile=False, compile_config=compile_config, **kw)
    assert counters["stats"]["unique_graphs"] >= 1 and torch.equal(compiled, eager)
    torch._dynamo.reset()
