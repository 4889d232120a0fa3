"""TRL 1.16 DPOTrainer with trainstream on the CPU: tiny Llama + LoRA, reference = same model with adapters off,
scored by sequence_logprobs; the engine installed during training and taken out at the end."""
import math

import pytest
import torch

pytest.importorskip("trl")
peft = pytest.importorskip("peft")
from datasets import Dataset  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback  # noqa: E402
from trl import DPOConfig, DPOTrainer  # noqa: E402

import trainstream_hf as ts  # noqa: E402
from trainstream_hf.config import TrainStreamConfig  # noqa: E402
from trainstream_hf.integrations.trl import TrainStreamDPOTrainer  # noqa: E402
from tests.helpers import randomize_lora_b  # noqa: E402

WORDS = ("the a cat dog sat ran on under mat rug big small red blue happy sad is was and then it "
         "yes no good bad fast slow").split()


def _tokenizer():
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _dataset(n=16):
    g = torch.Generator().manual_seed(0)

    def sentence(k):
        return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (k,), generator=g).tolist())

    rows = [{"prompt": sentence(4 + i % 3), "chosen": " " + sentence(3 + i % 4), "rejected": " " + sentence(2 + i % 5)}
            for i in range(n)]
    return Dataset.from_list(rows)


LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def _base_model(tok):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=64, pad_token_id=tok.pad_token_id,
                                        eos_token_id=tok.eos_token_id, bos_token_id=None))


def _args(tmp_path, **kw):
    return DPOConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2,
                     logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0,
                     dataloader_num_workers=0, beta=0.1, max_length=32, bf16=False, **kw)


def _naive_logps(model, batch):
    """Full-logits reference: log_softmax over [B, T, V], gathered at the next tokens, summed over completions."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    lp = logits[:, :-1].log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    mask = (batch["completion_mask"][:, 1:] * batch["attention_mask"][:, 1:]).bool()
    return (lp * mask).sum(1)


def test_dpo_with_engine_lora_three_steps(tmp_path):
    tok = _tokenizer()
    # A base model + peft_config: TRL 1.16 adds a fresh adapter, and its reference is the model with adapters off.
    trainer = TrainStreamDPOTrainer(
        model=_base_model(tok), args=_args(tmp_path), train_dataset=_dataset(), processing_class=tok,
        peft_config=LoraConfig(**LORA), ref_chunk_tokens=7,
        trainstream_config=TrainStreamConfig(vram_budget="64GiB", offload_optimizer=True,
                                             offload_activations=True, min_offload_numel=0,
                                             min_activation_bytes=0))
    assert trainer.ref_model is None  # one model in memory: the reference is the policy with adapters off
    pm = trainer.model
    assert list(pm.peft_config) == ["default"]
    randomize_lora_b(pm)

    # Exactness on one collated batch: ours == TRL's own computation == naive full logits (adapters off).
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    ours_c, ours_r = trainer.compute_ref_log_probs(pm, batch)
    trl_c, trl_r = DPOTrainer.compute_ref_log_probs(trainer, pm, batch)
    with torch.no_grad(), pm.disable_adapter():
        naive = _naive_logps(pm, batch)
    with torch.no_grad():
        policy = _naive_logps(pm, batch)  # adapters on
    ours = torch.cat([ours_c, ours_r])
    assert torch.allclose(ours, torch.cat([trl_c, trl_r]), atol=1e-5, rtol=0)
    assert torch.allclose(ours, naive, atol=1e-5, rtol=0)
    assert (ours - policy).abs().max() > 1e-3  # the adapters really were off

    lora0 = {n: p.detach().clone() for n, p in pm.named_parameters() if p.requires_grad}
    base0 = {n: p.detach().clone() for n, p in pm.named_parameters() if not p.requires_grad}
    assert lora0 and all("lora_" in n for n in lora0)

    seen = []
    calls = {"n": 0}
    orig = trainer._ts_reference_logps

    def counting(inputs):
        calls["n"] += 1
        return orig(inputs)

    trainer._ts_reference_logps = counting

    class Spy(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            seen.append(ts.engine_of(model) is not None or ts.engine_of(model.get_base_model()) is not None)

    trainer.add_callback(Spy())
    trainer.train()

    assert seen == [True, True, True]
    assert ts.engine_of(pm) is None and ts.engine_of(pm.get_base_model()) is None
    assert calls["n"] == 3  # our reference path, once per step
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert any("trainstream/arena_used_GiB" in h for h in trainer.state.log_history)
    params = dict(pm.named_parameters())
    assert all(not torch.equal(params[n], v) for n, v in lora0.items())
    assert all(torch.equal(params[n], v) for n, v in base0.items())
    assert not any(p.requires_grad for n, p in params.items() if "lora_" not in n)


def test_precompute_uses_chunked_reference(tmp_path):
    tok = _tokenizer()
    trainer = TrainStreamDPOTrainer(model=_base_model(tok), args=_args(tmp_path, precompute_ref_log_probs=True),
                                    train_dataset=_dataset(8), processing_class=tok, peft_config=LoraConfig(**LORA),
                                    ref_chunk_tokens=5)
    model = trainer.model
    ds = trainer.train_dataset
    batch = trainer.data_collator([ds[i] for i in range(len(ds))])
    with torch.no_grad(), model.disable_adapter():
        naive = _naive_logps(model, batch)
    pre = torch.cat([batch["ref_chosen_logps"], batch["ref_rejected_logps"]]).float()
    assert torch.allclose(pre, naive, atol=1e-5, rtol=0)
    trainer.args.max_steps = 1
    trainer.train()
    assert math.isfinite(trainer.state.log_history[-1]["train_loss"])


def test_existing_adapter_uses_trl_ref_adapter(tmp_path):
    """A PeftModel with a trained adapter: TRL 1.16 copies it into a "ref" adapter; we score with that one too."""
    tok = _tokenizer()
    model = get_peft_model(_base_model(tok), LoraConfig(**LORA))
    randomize_lora_b(model)
    trainer = TrainStreamDPOTrainer(model=model, args=_args(tmp_path), train_dataset=_dataset(4), processing_class=tok,
                                    ref_chunk_tokens=3)
    assert trainer.ref_model is None and "ref" in trainer.model.peft_config
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    ours = torch.cat(trainer.compute_ref_log_probs(trainer.model, batch))
    trl = torch.cat(DPOTrainer.compute_ref_log_probs(trainer, trainer.model, batch))
    with torch.no_grad():
        naive = _naive_logps(trainer.model, batch)  # "default" == "ref" before training
    assert torch.allclose(ours, trl, atol=1e-5, rtol=0) and torch.allclose(ours, naive, atol=1e-5, rtol=0)
    assert trainer.model.active_adapter == "default"
