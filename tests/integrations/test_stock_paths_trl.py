"""TRL 1.16's documented QLoRA recipe with ``TrainStreamQuantizationConfig`` in place of ``BitsAndBytesConfig``: the
trainer gets the model's path, the quantization config through ``model_init_kwargs`` and
``peft_config=LoraConfig(target_modules="all-linear")``; nothing trainstream-specific besides the config (and, for our
subclasses, the class). ``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer``, ``TrainStreamDPOTrainer`` and
``TrainStreamGRPOTrainer`` (CPU, transformers 5.25, PEFT 0.21).

Each run is compared with the same run on the dequantized weights in float32: the model that ``model.dequantize()``
gives (every packed layer an ``nn.Linear`` holding ``QuantLinear.dequantize_weight()`` in fp32), passed to the same
trainer with the same arguments, seed and data.

The one difference TRL itself would make between the two: a loaded trainstream model carries ``is_loaded_in_8bit``
(what TRL's QLoRA branch tests), so TRL casts its LoRA adapters to bf16 after ``get_peft_model`` (the QLoRA paper's
recipe), while a dense model keeps fp32 adapters. The reference carries the same flag, so TRL takes the same branch for
it and both runs train bf16 adapters over an fp32 base: what is compared is then the quantized base alone (its packed
storage, the fused LoRA-over-quantized layers, the reference log-probs of DPO / GRPO with the adapters off), not a
change of adapter dtype the recipe makes on purpose. Against fp32 adapters the compared figures differ by up to 4e-3
(bf16 rounding of the adapters, not our code). Each test asserts that both runs did take that branch (bf16 adapters)
and that the quantized one trains ``QuantLoraLinear`` layers over the packed weights.

The bound, 1e-5 on every step's loss and on metrics that depend on the base weights (SFT's entropy, DPO's summed
log-probs, GRPO's KL and entropy), is one these tests can miss: run on the original unquantized weights instead, the
same figures differ by 1e-3 to 0.2. (On this CPU the two runs agreed bit for bit when written.)
"""
import pytest
import torch
from torch import nn

pytest.importorskip("trl")
pytest.importorskip("peft")
from datasets import Dataset  # noqa: E402
from peft.tuners.lora import Linear as LoraLinear  # noqa: E402
from peft.tuners.lora import LoraLayer  # noqa: E402
from peft import LoraConfig  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer  # noqa: E402

from trainstream_hf import TrainStreamDPOTrainer, TrainStreamGRPOTrainer, TrainStreamQuantizationConfig  # noqa: E402
from trainstream_hf.config import TrainStreamConfig  # noqa: E402
from trainstream_hf.quant import QuantLinear  # noqa: E402
from trainstream_hf.integrations.peft import QuantLoraLinear  # noqa: E402
from tests.integrations.test_stock_paths import ROOT, _load, llama_dir  # noqa: E402,F401 (llama_dir: a fixture)

TOL = 1e-5
STEPS = 3
ENGINE = dict(vram_budget="64GiB", offload_optimizer=True, offload_activations=True, min_offload_numel=0,
              min_activation_bytes=0)


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(ROOT / "data" / "tokenizer")


def _lora():
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")


def _quantized():
    """What the user puts in ``model_init_kwargs``: our config where bitsandbytes' would be."""
    return {"quantization_config": TrainStreamQuantizationConfig(quantize="nf4")}


def _dense_reference(path):
    """The same checkpoint quantized, then ``dequantize()``d: fp32 ``nn.Linear`` layers holding the decoded weights,
    flagged as TRL's QLoRA branch expects a k-bit model to be (see the module docstring)."""
    model = _load(path, "nf4").dequantize()
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    model.is_loaded_in_8bit = True
    return model


def _common(tmp_path, name):
    return dict(output_dir=str(tmp_path / name), max_steps=STEPS, learning_rate=1e-2, logging_steps=1, report_to=[],
                use_cpu=True, save_strategy="no", seed=0, bf16=False, dataloader_num_workers=0)


def _train(trainer, quantized):
    """Checks that the run took TRL's QLoRA branch (bf16 adapters on the 14 linear layers; over the packed layers
    when ``quantized``, over dense ones otherwise), trains it, and returns its per-step logs. Each trainer is trained
    as soon as it is built: TRL seeds in ``__init__``, and GRPO's sampling draws from the global generator."""
    layers = {n: m for n, m in trainer.model.named_modules() if isinstance(m, LoraLayer)}
    assert len(layers) == 14
    if quantized:
        assert all(type(m) is QuantLoraLinear and isinstance(m.base_layer, QuantLinear) for m in layers.values())
    else:
        assert all(type(m) is LoraLinear and type(m.base_layer) is nn.Linear for m in layers.values())
    assert getattr(trainer, "ref_model", None) is None  # DPO, GRPO: the reference is the policy, adapters off
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    assert len(trainable) == 28 and all(p.dtype == torch.bfloat16 for p in trainable)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == STEPS
    return logs


def _compare(run, path, keys):
    """``run(model, **args)`` builds a trainer. Trains the recipe (the path, our config in ``model_init_kwargs``) and
    the dense fp32 reference; every step's loss (and the given metrics) within TOL, and the loss moved."""
    logs_q = _train(run(str(path), model_init_kwargs=_quantized()), quantized=True)
    logs_r = _train(run(_dense_reference(path)), quantized=False)
    for key in ("loss", *keys):
        got, want = torch.tensor([h[key] for h in logs_q]), torch.tensor([h[key] for h in logs_r])
        torch.testing.assert_close(got, want, rtol=0, atol=TOL, msg=lambda m: f"{key}: {m}")
    losses = [h["loss"] for h in logs_q]
    assert len(set(losses)) == STEPS, losses  # the adapters trained: every step saw a different model
    return logs_q


def _counted(trainer, name, calls):
    """Appends ``name`` to ``calls`` each time the trainer's method ``name`` runs (our reference path)."""
    inner = getattr(trainer, name)

    def counting(*args, **kwargs):
        calls.append(name)
        return inner(*args, **kwargs)

    setattr(trainer, name, counting)
    return trainer


def _ours_ran(logs, calls):
    """Our subclass trained both runs with the engine installed and answered the reference itself each step."""
    assert len(calls) == 2 * STEPS, calls
    assert all("trainstream/arena_used_GiB" in h for h in logs)


# -- SFT ------------------------------------------------------------------------------------------------------------
def _sft_data(tok):
    rows = torch.randint(3, len(tok), (12, 16), generator=torch.Generator().manual_seed(7))
    return Dataset.from_list([{"input_ids": r.tolist()} for r in rows])


def test_sft_trainer(llama_dir, tok, tmp_path):
    def run(model, **kw):
        args = SFTConfig(**_common(tmp_path, "sft"), per_device_train_batch_size=4, **kw)
        return SFTTrainer(model=model, args=args, processing_class=tok, train_dataset=_sft_data(tok),
                          peft_config=_lora())

    _compare(run, llama_dir, keys=("entropy", "mean_token_accuracy"))


# -- DPO ------------------------------------------------------------------------------------------------------------
WORDS = "the a cat dog sat ran on under mat rug big red blue is was and then yes no".split()


def _dpo_data(n=8):
    g = torch.Generator().manual_seed(0)

    def words(k):
        return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (k,), generator=g).tolist())

    return Dataset.from_list([{"prompt": words(2), "chosen": " " + words(2), "rejected": " " + words(1 + i % 2)}
                              for i in range(n)])


@pytest.mark.parametrize("cls", [DPOTrainer, TrainStreamDPOTrainer])
def test_dpo_trainer(llama_dir, tok, tmp_path, cls):
    ours, calls = cls is TrainStreamDPOTrainer, []

    def run(model, **kw):
        args = DPOConfig(**_common(tmp_path, "dpo"), per_device_train_batch_size=4, beta=0.1, max_length=32, **kw)
        if not ours:
            return cls(model=model, args=args, processing_class=tok, train_dataset=_dpo_data(), peft_config=_lora())
        trainer = cls(model=model, args=args, processing_class=tok, train_dataset=_dpo_data(), peft_config=_lora(),
                      trainstream_config=TrainStreamConfig(**ENGINE), ref_chunk_tokens=7)
        return _counted(trainer, "_ts_reference_logps", calls)

    logs = _compare(run, llama_dir, keys=("logps/chosen", "logps/rejected", "rewards/margins"))
    if ours:
        _ours_ran(logs, calls)


# -- GRPO -----------------------------------------------------------------------------------------------------------
def _prompts():
    return Dataset.from_dict({"prompt": ["the cat", "a dog ran", "big red", "the rug"]})


def _reward(completions, **kwargs):
    """Deterministic: how many "a" characters, plus a little per character."""
    return [c.count("a") + 0.1 * len(c) for c in completions]


@pytest.mark.parametrize("cls", [GRPOTrainer, TrainStreamGRPOTrainer])
def test_grpo_trainer(llama_dir, tok, tmp_path, cls):
    ours, calls = cls is TrainStreamGRPOTrainer, []

    def run(model, **kw):
        args = GRPOConfig(**_common(tmp_path, "grpo"), per_device_train_batch_size=4, num_generations=2,
                          max_completion_length=6, temperature=0.7, beta=0.1, **kw)
        common = dict(model=model, reward_funcs=_reward, args=args, processing_class=tok, train_dataset=_prompts(),
                      peft_config=_lora())
        if not ours:
            return cls(**common)
        trainer = cls(**common, trainstream_config=TrainStreamConfig(**ENGINE), ref_chunk_tokens=3)
        return _counted(trainer, "_ts_reference_token_logps", calls)

    # GRPO's loss is small here (~1e-3, mostly beta * kl): kl and entropy are the sharper comparisons
    logs = _compare(run, llama_dir, keys=("kl", "reward", "entropy"))
    assert all(h["kl"] > 0 for h in logs[1:])  # the KL term saw a reference that differs from the policy
    if ours:
        _ours_ran(logs, calls)
