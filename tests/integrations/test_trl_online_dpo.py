"""TRL 1.16's experimental OnlineDPOTrainer with trainstream on the CPU: tiny Llama + LoRA, one model in memory (the
reference = the policy with its adapters disabled), reference log-probs by losses.token_logprobs, the engine installed
during training, generation through TrainStreamCache."""
import copy
import math
import warnings

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("peft")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import trainstream_hf as ts  # noqa: E402
from trainstream_hf.cache import TrainStreamCache  # noqa: E402
from trainstream_hf.config import TrainStreamConfig  # noqa: E402
from trainstream_hf.integrations.trl_online import (TrainStreamOnlineDPOConfig,  # noqa: E402
                                                    TrainStreamOnlineDPOTrainer, close_kept,
                                                    generation_through_cache)
from tests.helpers import randomize_lora_b  # noqa: E402
from tests.integrations.test_trl_grpo import (LORA, ENGINE, _base_model, _count_models, _prompts,  # noqa: E402
                                              _reward, _tokenizer)


def _args(tmp_path, cls=OnlineDPOConfig, **kw):
    base = dict(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, max_new_tokens=5,
                temperature=0.7, learning_rate=1e-2, beta=0.1, logging_steps=1, report_to=[], use_cpu=True,
                save_strategy="no", seed=0, bf16=False, dataloader_num_workers=0)
    return cls(**{**base, **kw})


def _trainer(tmp_path, tok, model, **kw):
    return TrainStreamOnlineDPOTrainer(model=model, reward_funcs=_reward, args=_args(tmp_path),
                                       train_dataset=_prompts(), processing_class=tok, **kw)


def test_online_dpo_single_model_reference_engine_and_cache(tmp_path):
    tok = _tokenizer()
    base = _base_model(tok)
    base_copy = copy.deepcopy(base).eval()
    before = _count_models()
    trainer = _trainer(tmp_path, tok, base, peft_config=LoraConfig(**LORA), ref_chunk_tokens=2, generation_cache=0.5,
                       trainstream_config=TrainStreamConfig(**ENGINE))
    assert trainer.ref_model is None and _count_models() == before
    pm = trainer.model
    randomize_lora_b(pm)

    # The reference call TRL 1.16 makes (adapters disabled, no grad) against full logits of the base copy, and TRL's
    # own _forward on the same call; the policy call (adapters on, grad) stays TRL's.
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, len(tok), (2, 4), generator=g)
    completion = torch.randint(3, len(tok), (2, 5), generator=g)
    pmask, cmask = torch.ones_like(prompt), torch.ones_like(completion)
    cmask[1, -2:] = 0
    calls = []
    orig = trainer._ts_is_reference_call
    trainer._ts_is_reference_call = lambda *a: calls.append(orig(*a)) or calls[-1]
    with torch.no_grad(), pm.disable_adapter():
        ours = trainer._forward(pm, prompt, pmask, completion, cmask)
        trl = OnlineDPOTrainer._forward(trainer, pm, prompt, pmask, completion, cmask)
        naive = OnlineDPOTrainer._forward(trainer, base_copy, prompt, pmask, completion, cmask)
    assert calls == [True] and ours.shape == (2, 5)
    assert torch.allclose(ours, trl, atol=1e-5, rtol=0) and torch.allclose(ours, naive, atol=1e-5, rtol=0)
    policy = trainer._forward(pm, prompt, pmask, completion, cmask)
    assert calls == [True, False] and policy.requires_grad and (policy - ours).abs().max() > 1e-3

    made = []
    real_init = TrainStreamCache.__init__

    def counting(self, *a, **k):
        made.append(k.get("resident"))
        real_init(self, *a, **k)

    seen = []

    class Spy(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            seen.append(ts.engine_of(model) is not None or ts.engine_of(model.get_base_model()) is not None)

    trainer.add_callback(Spy())
    lora0 = {n: p.detach().clone() for n, p in pm.named_parameters() if p.requires_grad}
    TrainStreamCache.__init__ = counting
    try:
        trainer.train()
    finally:
        TrainStreamCache.__init__ = real_init
    assert seen == [True, True, True] and ts.engine_of(pm) is None
    assert made == [0.5, 0.5, 0.5]  # one paged cache per generation
    assert "generate" not in pm.__dict__  # TRL's generate given back after each step
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3 and all(math.isfinite(h["loss"]) for h in logs)
    assert any("trainstream/arena_used_GiB" in h for h in trainer.state.log_history)
    params = dict(pm.named_parameters())
    assert all(not torch.equal(params[n], v) for n, v in lora0.items())
    assert trainer.ref_model is None and _count_models() == before


def test_a_peft_model_policy_gets_no_copy(tmp_path):
    """TRL 1.16 deep-copies a PeftModel given without peft_config; here its reference is the same model."""
    tok = _tokenizer()
    pm = get_peft_model(_base_model(tok), LoraConfig(**LORA))
    before = _count_models()
    trainer = _trainer(tmp_path, tok, pm)
    assert trainer.ref_model is None and _count_models() == before
    assert OnlineDPOTrainer.__init__ is not None  # TRL's own module is left as it was:
    from trl.experimental.online_dpo import online_dpo_trainer
    assert online_dpo_trainer.create_reference_model.__name__ == "create_reference_model"


def test_a_policy_without_adapters_is_refused_unless_a_reference_is_given(tmp_path):
    tok = _tokenizer()
    with pytest.raises(ValueError, match="Online DPO needs a reference policy.*peft_config=LoraConfig"):
        _trainer(tmp_path, tok, _base_model(tok))
    ref = _base_model(tok)
    trainer = _trainer(tmp_path, tok, _base_model(tok), ref_model=ref)
    assert trainer.ref_model is not None


@pytest.mark.parametrize("bad", [-0.1, 1.5, True, "half"])
def test_generation_cache_is_a_fraction(tmp_path, bad):
    tok = _tokenizer()
    with pytest.raises(ValueError, match="generation_cache: the fraction of layers"):
        _trainer(tmp_path, tok, _base_model(tok), peft_config=LoraConfig(**LORA), generation_cache=bad)


def test_generation_through_cache_decodes_what_the_dynamic_cache_decodes():
    tok = _tokenizer()
    model = _base_model(tok).eval()
    ids = torch.randint(3, len(tok), (2, 6), generator=torch.Generator().manual_seed(5))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    with generation_through_cache(model, 0.0):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    assert torch.equal(out, ref) and "generate" not in model.__dict__


def test_generation_through_cache_decodes_right_when_the_config_turns_the_cache_off():
    """TRL's generation config says use_cache=False under gradient checkpointing; the cache given is used anyway."""
    from transformers import GenerationConfig

    tok = _tokenizer()
    model = _base_model(tok).eval()
    ids = torch.randint(3, len(tok), (2, 6), generator=torch.Generator().manual_seed(5))
    config = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None, use_cache=False)
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (the cache warns when it is given the whole sequence again)
        for keep in (None, {}):
            with generation_through_cache(model, 0.5, keep):
                out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            assert torch.equal(out, ref)
            if keep is not None:
                close_kept(keep)


def test_online_dpo_config_adds_trainstream_flags(tmp_path):
    cfg = TrainStreamOnlineDPOConfig(output_dir=str(tmp_path), trainstream="on", trainstream_vram_budget="8GiB",
                                     report_to=[], use_cpu=True, bf16=False)
    trl = OnlineDPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    assert (cfg.beta, cfg.learning_rate, cfg.max_new_tokens) == (trl.beta, trl.learning_rate, trl.max_new_tokens)
    assert cfg.trainstream == "on" and cfg.trainstream_vram_budget == "8GiB"
    assert ts.TrainStreamOnlineDPOTrainer is TrainStreamOnlineDPOTrainer


def test_checkpointing_toggles_leave_one_input_grad_hook(tmp_path):
    """With gradient checkpointing on, each generation's off-and-on adds an input-embedding hook in transformers that
    nothing removes (14 after 4 steps): the stale ones are dropped after each step."""
    tok = _tokenizer()
    trainer = TrainStreamOnlineDPOTrainer(model=_base_model(tok), reward_funcs=_reward,
                                          args=_args(tmp_path, max_steps=4, gradient_checkpointing=True),
                                          train_dataset=_prompts(), processing_class=tok,
                                          peft_config=LoraConfig(**LORA), generation_cache=0.5)
    trainer.train()
    assert len(trainer.model.get_base_model().get_input_embeddings()._forward_hooks) <= 1
