"""Decoder families beyond the ones the engine's own tests are built around (tests/engine/test_paging.py,
tests/test_cache.py): each trains with every block's weights paged and its activations in host RAM, computing the
unwrapped model's loss and gradients bit for bit, and greedy generation through a half-resident TrainStreamCache gives
DynamicCache's tokens. Tiny random models, fp32, CPU."""
import copy
import warnings

import pytest
import torch
import transformers

import trainstream_hf as ts
from trainstream_hf.cache import cache_keyword

VOCAB = 128
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=VOCAB, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAMILIES = {  # config class, its own fields
    "qwen3": ("Qwen3Config", dict(head_dim=16)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)),
    "gpt_neox": ("GPTNeoXConfig", dict(rotary_pct=0.25)),
    "phi": ("PhiConfig", {}),
    "cohere": ("CohereConfig", {}),
    "olmo2": ("Olmo2Config", {}),
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                                     layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
}


def _model(family):
    name, extra = FAMILIES[family]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_config(getattr(transformers, name)(**BASE, **extra)).float()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_paged_and_offloaded_training_is_bit_exact_and_the_cache_generates_the_same(family):
    ref = _model(family).train()
    model = copy.deepcopy(ref)
    model, _ = ts.wrap(model, None, vram_budget="4GiB", batch_shape=(2, 24), page_weights=True,
                       offload_activations=True, min_offload_numel=0, min_activation_bytes=0)
    plan = model.trainstream_plan
    assert plan.paged_blocks == [0, 1, 2] and plan.offloaded_activation_blocks == [0, 1, 2]
    ids = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    loss, ref_loss = (m(input_ids=ids, labels=ids).loss for m in (model, ref))
    loss.backward()
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), name
    model = ts.unwrap(model).eval()
    prompt, mask = ids[:, :10], torch.ones(2, 10, dtype=torch.long)
    want = ref.eval().generate(prompt, attention_mask=mask, max_new_tokens=6, do_sample=False)
    got = model.generate(prompt, attention_mask=mask, max_new_tokens=6, do_sample=False,
                         **{cache_keyword(model): ts.TrainStreamCache(model, resident=0.5)})
    assert torch.equal(got, want)
