"""TRL 1.16 GRPOTrainer with trainstream on the CPU: tiny Llama + LoRA, beta > 0, the reference = the same model with
its adapters off, scored by losses.token_logprobs; the engine installed during training and taken out at the end."""
import copy
import gc
import math

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("peft")
from datasets import Dataset  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import (HfArgumentParser, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast,  # noqa: E402
                          TrainerCallback)
from trl import DPOConfig, GRPOConfig, GRPOTrainer  # noqa: E402
from trl.trainer.utils import use_adapter  # noqa: E402

import trainstream_hf as ts  # noqa: E402
from trainstream_hf.cache import TrainStreamCache  # noqa: E402
from trainstream_hf.config import TrainStreamConfig  # noqa: E402
from trainstream_hf.integrations.transformers import TrainStreamCallback  # noqa: E402
from trainstream_hf.integrations.trl import (TrainStreamDPOConfig, TrainStreamGRPOConfig,  # noqa: E402
                                             TrainStreamGRPOTrainer)
from tests.helpers import randomize_lora_b  # noqa: E402

WORDS = ("the a cat dog sat ran on under mat rug big small red blue happy sad is was and then it "
         "yes no good bad fast slow").split()
LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
ENGINE = dict(vram_budget="64GiB", offload_optimizer=True, offload_activations=True, min_offload_numel=0,
              min_activation_bytes=0)
TEMPERATURE = 0.7


def _tokenizer():
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _base_model(tok):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=64, pad_token_id=tok.pad_token_id,
                                        eos_token_id=tok.eos_token_id, bos_token_id=None))


def _prompts():
    return Dataset.from_dict({"prompt": ["the cat sat on", "a dog ran under the", "big red mat is", "the blue rug"]})


def _reward(completions, **kwargs):
    """Deterministic: how many times "cat" appears, plus a little for each word."""
    return [c.split().count("cat") + 0.1 * len(c.split()) for c in completions]


def _args(tmp_path, cls=GRPOConfig, **kw):
    base = dict(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, num_generations=2,
                max_completion_length=6, temperature=TEMPERATURE, learning_rate=1e-2, beta=0.1, logging_steps=1,
                report_to=[], use_cpu=True, save_strategy="no", seed=0, bf16=False, dataloader_num_workers=0)
    return cls(**{**base, **kw})


def _scored_batch(tok, k=5):
    """Left-padded prompts + k completion tokens (some padded at the end), as GRPO builds prompt_completion_ids."""
    g = torch.Generator().manual_seed(7)
    prompt = tok(["the cat sat on", "a dog ran", "big red mat is", "the"], padding=True, padding_side="left",
                 return_tensors="pt")
    completion = torch.randint(3, len(tok), (4, k), generator=g)
    ids = torch.cat([prompt["input_ids"], completion], dim=1)
    attn = torch.cat([prompt["attention_mask"], torch.ones_like(completion)], dim=1)
    attn[1, -2:] = 0  # a completion that ended early
    ids[1, -2:] = tok.pad_token_id
    return ids, attn, k


def _naive_token_logps(model, ids, attn, k):
    """Full [B, T, V] logits, temperature-scaled, gathered at the next tokens: TRL's per-token layout [B, k]."""
    logits = model(input_ids=ids, attention_mask=attn).logits.float() / TEMPERATURE
    lp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return (lp * attn[:, 1:])[:, -k:]


def _count_models():
    gc.collect()
    return sum(isinstance(o, LlamaForCausalLM) for o in gc.get_objects())


def test_grpo_lora_beta_single_model_reference_and_engine(tmp_path):
    tok = _tokenizer()
    base = _base_model(tok)
    base_copy = copy.deepcopy(base).eval()  # the naive reference: the base without adapters, a separate object
    models_before = _count_models()
    trainer = TrainStreamGRPOTrainer(model=base, reward_funcs=_reward, args=_args(tmp_path), train_dataset=_prompts(),
                                     processing_class=tok, peft_config=LoraConfig(**LORA), ref_chunk_tokens=3,
                                     trainstream_config=TrainStreamConfig(**ENGINE))
    assert trainer.ref_model is None and _count_models() == models_before  # one model: no reference copy
    assert any(isinstance(c, TrainStreamCallback) for c in trainer.callback_handler.callbacks)
    pm = trainer.model
    assert list(pm.peft_config) == ["default"]
    randomize_lora_b(pm)

    calls = []
    orig = trainer._ts_reference_token_logps

    def counting(*args, **kwargs):
        out = orig(*args, **kwargs)
        calls.append(out.shape)
        return out

    trainer._ts_reference_token_logps = counting

    # Exactness on one batch, through the call TRL 1.16 makes for the reference (adapters off, no grad): ours ==
    # TRL's own fused-head computation == naive full logits of the base copy.
    ids, attn, k = _scored_batch(tok)
    with torch.no_grad(), use_adapter(pm, adapter_name=None):
        ours, ent, aux = trainer._get_per_token_logps_and_entropies(pm, ids, attn, k, batch_size=3)
        trl, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, pm, ids, attn, k, batch_size=3)
    assert calls == [(4, k)] and ent is None and aux is None
    with torch.no_grad():
        naive = _naive_token_logps(base_copy, ids, attn, k)
        policy = _naive_token_logps(pm, ids, attn, k)  # adapters on
    assert ours.shape == (4, k) and (ours[1, -2:] == 0).all() and (ours[attn[:, -k:].bool()] < -0.5).all()
    assert torch.allclose(ours, naive, atol=1e-5, rtol=0)
    assert torch.allclose(ours, trl, atol=1e-5, rtol=0)
    assert (ours - policy).abs().max() > 1e-3  # the adapters really were off
    with torch.no_grad():  # adapters on: the policy's log-probs are TRL's own, not ours
        trainer._get_per_token_logps_and_entropies(pm, ids, attn, k)
    assert len(calls) == 1

    lora0 = {n: p.detach().clone() for n, p in pm.named_parameters() if p.requires_grad}
    base0 = {n: p.detach().clone() for n, p in pm.named_parameters() if not p.requires_grad}
    assert lora0 and all("lora_" in n for n in lora0)
    seen = []

    class Spy(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            seen.append(ts.engine_of(model) is not None or ts.engine_of(model.get_base_model()) is not None)

    trainer.add_callback(Spy())
    trainer.train()

    assert seen == [True, True, True]  # the engine was installed for every step ...
    assert ts.engine_of(pm) is None and ts.engine_of(pm.get_base_model()) is None  # ... and taken out at the end
    assert len(calls) == 4  # our reference path: once per generation (one per step here)
    assert trainer.ref_model is None and _count_models() == models_before
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3 and all(math.isfinite(h["loss"]) for h in logs)
    assert all(h["kl"] > 0 for h in logs)  # the KL term saw a reference that differs from the policy
    assert any("trainstream/arena_used_GiB" in h for h in trainer.state.log_history)
    params = dict(pm.named_parameters())
    assert all(not torch.equal(params[n], v) for n, v in lora0.items())  # LoRA trained
    assert all(torch.equal(params[n], v) for n, v in base0.items())  # base frozen
    with torch.no_grad(), use_adapter(pm, adapter_name=None):  # still the base after training
        after = trainer._get_per_token_logps_and_entropies(pm, ids, attn, k)[0]
    assert torch.allclose(after, naive, atol=1e-5, rtol=0)


def test_existing_adapter_uses_trl_ref_adapter(tmp_path):
    """A PeftModel with a trained adapter: TRL 1.16 copies it into a "ref" adapter; that is what we score."""
    tok = _tokenizer()
    model = get_peft_model(_base_model(tok), LoraConfig(**LORA))
    randomize_lora_b(model)
    trainer = TrainStreamGRPOTrainer(model=model, reward_funcs=_reward, args=_args(tmp_path), train_dataset=_prompts(),
                                     processing_class=tok, ref_chunk_tokens=4)
    pm = trainer.model
    assert trainer.ref_model is None and "ref" in pm.peft_config
    ids, attn, k = _scored_batch(tok)
    with torch.no_grad():
        before = _naive_token_logps(pm, ids, attn, k)  # "default" == "ref" before training
        with use_adapter(pm, adapter_name="ref"):
            ours = trainer._get_per_token_logps_and_entropies(pm, ids, attn, k)[0]
            trl = GRPOTrainer._get_per_token_logps_and_entropies(trainer, pm, ids, attn, k)[0]
    assert torch.allclose(ours, trl, atol=1e-5, rtol=0) and torch.allclose(ours, before, atol=1e-5, rtol=0)
    assert pm.active_adapter == "default"


def test_beta_without_peft_is_refused(tmp_path):
    tok = _tokenizer()
    models_before = _count_models()
    with pytest.raises(ValueError, match=r"beta=0.1 needs a reference.*second full copy.*peft_config=LoraConfig"):
        TrainStreamGRPOTrainer(_base_model(tok), _reward, _args(tmp_path), train_dataset=_prompts(),
                               processing_class=tok)
    assert _count_models() == models_before
    # beta = 0 needs no reference: a full fine-tune is allowed, and TRL keeps no ref_model either.
    trainer = TrainStreamGRPOTrainer(model=_base_model(tok), reward_funcs=_reward, args=_args(tmp_path, beta=0.0),
                                     train_dataset=_prompts(), processing_class=tok)
    assert trainer.ref_model is None and trainer._ts_callback is None


@pytest.mark.parametrize("trl_cls,ours", [(GRPOConfig, TrainStreamGRPOConfig), (DPOConfig, TrainStreamDPOConfig)])
def test_configs_keep_trl_defaults_and_add_trainstream_flags(tmp_path, trl_cls, ours):
    (args,) = HfArgumentParser(ours).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "true", "--trainstream", "on",
         "--trainstream_vram_budget", "8GiB", "--trainstream_offload_optimizer", "true"])
    plain = trl_cls(output_dir=str(tmp_path), use_cpu=True)
    for name in ("learning_rate", "logging_steps", "bf16", "gradient_checkpointing"):
        assert getattr(args, name) == getattr(plain, name), name  # TRL's defaults, not TrainingArguments'
    assert args.trainstream_enabled()
    cfg = args.trainstream_config()
    assert cfg.vram_budget == "8GiB" and cfg.offload_optimizer is True
    with pytest.raises(ValueError, match="trainstream"):
        ours(output_dir=str(tmp_path), use_cpu=True, trainstream="sometimes")


def test_grpo_config_installs_engine(tmp_path):
    tok = _tokenizer()
    args = _args(tmp_path, cls=TrainStreamGRPOConfig, max_steps=1, trainstream="on", trainstream_vram_budget="64GiB")
    trainer = TrainStreamGRPOTrainer(model=_base_model(tok), reward_funcs=_reward, args=args, train_dataset=_prompts(),
                                     processing_class=tok, peft_config=LoraConfig(**LORA))
    assert trainer._ts_callback is not None and trainer._ts_callback.config.vram_budget == "64GiB"
    trainer.train()
    assert any("trainstream/arena_used_GiB" in h for h in trainer.state.log_history)
    assert ts.engine_of(trainer.model) is None


def test_grpo_generates_through_the_paged_cache(tmp_path, monkeypatch):
    """A cache per generation, its pages (pinned on CUDA) kept with the model for the next step's cache and given
    back when train() ends."""
    from trainstream_hf import cache as cache_module
    from trainstream_hf.cache import TrainStreamCache

    monkeypatch.setattr(cache_module, "_pins_pages", lambda device: True)  # the pool, as on CUDA (pageable here)
    pooled = []
    real_take = cache_module._PagePool.take
    monkeypatch.setattr(cache_module._PagePool, "take", lambda pool: pooled.append(pool) or real_take(pool))
    tok = _tokenizer()
    trainer = TrainStreamGRPOTrainer(model=_base_model(tok), reward_funcs=_reward, args=_args(tmp_path, max_steps=2),
                                     train_dataset=_prompts(), processing_class=tok, peft_config=LoraConfig(**LORA),
                                     generation_cache=0.0)
    made, real_init = [], TrainStreamCache.__init__

    def counting(self, *a, **k):
        made.append(k.get("resident"))
        real_init(self, *a, **k)

    TrainStreamCache.__init__ = counting
    try:
        trainer.train()
    finally:
        TrainStreamCache.__init__ = real_init
    assert made == [0.0, 0.0] and "generate" not in trainer.model.__dict__
    assert pooled and len(set(map(id, pooled))) == 1  # both steps' caches took pages from one pool
    assert pooled[0].arena.closed and pooled[0] not in cache_module._PAGE_POOLS.values()  # given back at the end
    assert all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)
    with pytest.raises(ValueError, match="generation_cache: the fraction of layers"):
        TrainStreamGRPOTrainer(model=_base_model(tok), reward_funcs=_reward, args=_args(tmp_path),
                               train_dataset=_prompts(), processing_class=tok, peft_config=LoraConfig(**LORA),
                               generation_cache=2)


def test_compiled_generation_traces_the_decode_step_without_a_break(tmp_path):
    """compiled_generation: TRL's generate() runs with a static cache and transformers' compiled decode step (here
    the "eager" backend on the CPU: traced, not code-generated; a GPU gets inductor and CUDA graphs), the engine's block
    hooks standing aside in that no-grad trace: one graph, no break, and training goes on through the hooks."""
    from torch._dynamo.utils import counters
    from transformers.generation.configuration_utils import CompileConfig

    tok = _tokenizer()
    cfg = TrainStreamConfig(**ENGINE, quantize="nf4")  # (packed: the model gets transformers' quantizer attributes)
    trainer = TrainStreamGRPOTrainer(model=_base_model(tok), reward_funcs=_reward, args=_args(tmp_path, max_steps=2),
                                     train_dataset=_prompts(), processing_class=tok, peft_config=LoraConfig(**LORA),
                                     trainstream_config=cfg, compiled_generation=True)
    assert trainer.generation_config.cache_implementation == "static"
    assert not trainer.generation_config.disable_compile
    compile_config = CompileConfig(backend="eager", mode=None)
    compile_config._compile_all_devices = True  # (transformers compiles generate() on accelerators only)
    trainer.generation_config.compile_config = compile_config
    torch._dynamo.reset()
    counters.clear()
    try:
        trainer.train()
        assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"], dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    # paged block weights: a traced decode step could not fetch them, so generation stays eager, said once
    paged = TrainStreamGRPOTrainer(model=_base_model(tok), reward_funcs=_reward, args=_args(tmp_path, max_steps=1),
                                   train_dataset=_prompts(), processing_class=tok, peft_config=LoraConfig(**LORA),
                                   trainstream_config=TrainStreamConfig(**ENGINE, page_weights=True),
                                   compiled_generation=True)
    with pytest.warns(RuntimeWarning, match="compiled_generation: the plan pages 2 blocks' weights"):
        paged.train()
    assert paged.generation_config.disable_compile


def test_compiled_generation_through_a_static_trainstream_cache(tmp_path):
    """compiled_generation with generation_cache: the decode step is compiled over a TrainStreamCache(static=True), one
    kept across the steps (reset, not rebuilt, so the compiled step finds the same buffers) and closed when train()
    returns; the graph breaks at the offloaded layer's update, and the later steps compile nothing new."""
    from torch._dynamo.utils import counters
    from transformers.generation.configuration_utils import CompileConfig

    tok = _tokenizer()
    trainer = TrainStreamGRPOTrainer(model=_base_model(tok), reward_funcs=_reward, args=_args(tmp_path, max_steps=3),
                                     train_dataset=_prompts(), processing_class=tok, peft_config=LoraConfig(**LORA),
                                     trainstream_config=TrainStreamConfig(**ENGINE), generation_cache=0.5,
                                     compiled_generation=True)
    assert trainer.generation_config.cache_implementation is None and not trainer.generation_config.disable_compile
    compile_config = CompileConfig(backend="eager", mode=None)
    compile_config._compile_all_devices = True
    trainer.generation_config.compile_config = compile_config
    made, graphs = [], []
    real_init = TrainStreamCache.__init__

    def recording(self, *a, **k):
        made.append(k)
        real_init(self, *a, **k)

    class Graphs(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            graphs.append(counters["stats"]["unique_graphs"])

    trainer.add_callback(Graphs())
    torch._dynamo.reset()
    counters.clear()
    TrainStreamCache.__init__ = recording
    try:
        trainer.train()
        breaks = dict(counters["graph_break"])
    finally:
        TrainStreamCache.__init__ = real_init
        torch._dynamo.reset()
    assert len(made) == 1 and made[0]["static"] and made[0]["resident"] == 0.5  # one cache for the three steps
    assert made[0]["max_cache_len"] >= 6  # the prompt plus max_completion_length
    # (transformers' make_inputs_require_grads hook on the embedding may break the graph too, once a forward)
    assert any("_update_offloaded_static" in reason for reason in breaks), breaks
    assert graphs[0] > 1 and graphs[1:] == [graphs[0]] * 2  # nothing compiled after the first step
    assert trainer._ts_kept_cache == {}  # released when train() returned
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)


def test_checkpointing_toggles_leave_one_input_grad_hook_and_compile_once(tmp_path):
    """TRL's default gradient_checkpointing=True turns checkpointing off and on around every generation, and each turn
    on adds an input-embedding hook in transformers without removing the last: the stale ones are dropped after each
    step, so the hooks stay bounded and a compiled decode step stops recompiling after the first steps."""
    from torch._dynamo.utils import counters
    from transformers.generation.configuration_utils import CompileConfig

    tok = _tokenizer()
    trainer = TrainStreamGRPOTrainer(model=_base_model(tok), reward_funcs=_reward,
                                     args=_args(tmp_path, max_steps=4, gradient_checkpointing=True),
                                     train_dataset=_prompts(), processing_class=tok, peft_config=LoraConfig(**LORA),
                                     trainstream_config=TrainStreamConfig(**ENGINE), compiled_generation=True)
    compile_config = CompileConfig(backend="eager", mode=None)
    compile_config._compile_all_devices = True
    trainer.generation_config.compile_config = compile_config
    emb = trainer.model.get_base_model().get_input_embeddings()
    seen = []

    class Count(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            seen.append((len(emb._forward_hooks), counters["stats"]["unique_graphs"]))

    trainer.add_callback(Count())
    torch._dynamo.reset()
    counters.clear()
    try:
        trainer.train()
    finally:
        torch._dynamo.reset()
    hooks, graphs = zip(*seen)
    assert max(hooks) <= 1, seen  # (without the cleanup: 2, 4, 6, 8)
    assert graphs[-1] == graphs[-2] == graphs[-3], seen



def test_out_of_memory_beside_a_kept_static_cache_says_what_is_outside_the_plan(tmp_path):
    """A training step that runs out of device memory while compiled generation keeps its static TrainStreamCache
    raises torch's OutOfMemoryError still, its message leading with the cache's device bytes (outside the engine's
    plan) and what to do; the cache is released. Without a kept cache torch's error passes unchanged."""
    from transformers.generation.configuration_utils import CompileConfig

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 68.00 MiB.")

    tok = _tokenizer()
    for cache in (0.5, None):
        trainer = TrainStreamGRPOTrainer(model=_base_model(tok), reward_funcs=_reward,
                                         args=_args(tmp_path / str(cache), max_steps=2), train_dataset=_prompts(),
                                         processing_class=tok, peft_config=LoraConfig(**LORA),
                                         trainstream_config=TrainStreamConfig(**ENGINE), generation_cache=cache,
                                         compiled_generation=cache is not None)  # (no cache: nothing kept either way)
        compile_config = CompileConfig(backend="eager", mode=None)
        compile_config._compile_all_devices = True
        trainer.generation_config.compile_config = compile_config
        trainer.compute_loss = oom  # after the step's generation
        torch._dynamo.reset()
        try:
            with pytest.raises(torch.OutOfMemoryError) as info:
                trainer.train()
        finally:
            torch._dynamo.reset()
        message = str(info.value)
        if cache is None:
            assert message == "CUDA out of memory. Tried to allocate 68.00 MiB."
        else:
            assert "\n" not in message and message.startswith("TrainStreamGRPOTrainer: out of device memory")
            assert "GiB on the device" in message and "vram_budget" in message
            assert message.endswith("(CUDA out of memory. Tried to allocate 68.00 MiB.)")
            assert trainer._ts_kept_cache == {}
