"""TRL 1.16's experimental OnlineDPOTrainer through trainstream on the GPU: a Llama over an NF4 base with LoRA, bf16,
the engine installed for the training steps, completions sampled through TrainStreamCache with three of the four layers'
K/V in host pages (more than its two device slots, so they come back every token), the reference the same model with
its adapters off. It trains (finite losses, adapters move), the cache streamed its offloaded layers, and the engine's
figures reach the logs; the run's time and peak are printed (``pytest -s``)."""
import math
import time
import warnings

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("peft")
pytest.importorskip("datasets")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from trl.experimental.online_dpo import OnlineDPOConfig  # noqa: E402
from peft import LoraConfig  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import trainstream_hf as ts  # noqa: E402
from trainstream_hf.cache import TrainStreamCache  # noqa: E402
from trainstream_hf.config import TrainStreamConfig  # noqa: E402
from trainstream_hf.integrations.trl_online import TrainStreamOnlineDPOTrainer  # noqa: E402
from tests.integrations.test_trl_grpo import _prompts, _reward, _tokenizer  # noqa: E402


def test_online_dpo_trains_on_cuda_with_nf4_engine_and_paged_cache(tmp_path):
    tok = _tokenizer()
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512,
                                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=128, pad_token_id=tok.pad_token_id,
                                        eos_token_id=tok.eos_token_id, bos_token_id=None)).to("cuda", torch.bfloat16)
    args = OnlineDPOConfig(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, max_new_tokens=16,
                           temperature=0.7, learning_rate=1e-3, beta=0.1, logging_steps=1, report_to=[],
                           save_strategy="no", seed=0, bf16=True, dataloader_num_workers=0)
    caches = []
    real_init = TrainStreamCache.__init__

    def recording(self, *a, **k):
        real_init(self, *a, **k)
        caches.append(self)

    trainer = TrainStreamOnlineDPOTrainer(
        model=base, reward_funcs=_reward, args=args, train_dataset=_prompts(), processing_class=tok,
        peft_config=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear",
                               task_type="CAUSAL_LM"),
        generation_cache=0.25, trainstream_config=TrainStreamConfig(quantize="nf4", vram_budget="8GiB"))
    pm = trainer.model
    assert trainer.ref_model is None
    lora0 = {n: p.detach().clone() for n, p in pm.named_parameters() if p.requires_grad}
    TrainStreamCache.__init__ = recording
    t0 = time.perf_counter()
    try:
        trainer.train()
    finally:
        TrainStreamCache.__init__ = real_init
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 4 and all(math.isfinite(h["loss"]) for h in logs)
    params = dict(pm.named_parameters())
    assert all(not torch.equal(params[n], v) for n, v in lora0.items())
    assert any("trainstream/arena_used_GiB" in h for h in trainer.state.log_history)
    assert len(caches) == 4 and all(c.offloaded_layers for c in caches)
    # the new tokens went to the pages, and the three offloaded layers took turns in the two slots
    assert all(c.stats()["h2d_bytes"] > 0 and c.stats()["d2h_bytes"] > 0 for c in caches)
    assert ts.engine_of(pm) is None  # taken out at the end
    print(f"\nonline DPO on {torch.cuda.get_device_name(0)}: 4 steps in {seconds:.2f} s, losses "
          f"{[round(h['loss'], 4) for h in logs]}, peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, "
          f"cache copies {caches[-1].stats()}")
