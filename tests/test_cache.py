"""PagedKVCache / TrainStreamCache on the CPU compute device, bit-exact against transformers' DynamicCache.

Tiny models of five families are built from configs (no hub): Llama and Qwen2 (full attention), Mistral
(every layer a sliding window of 8, shorter than the sequences, so the window path is exercised), Gemma2
(alternating sliding / full layers, soft-capping) and Gemma4 (KV sharing between layers). Greedy
``generate`` must return the same token ids, and a manual forward loop the same logits (``torch.equal``),
for every split of the layers between resident and offloaded. Counters check that the paging really
happened (host pages, H2D copies issued ahead of use), so that a cache that silently kept everything
resident would fail.
"""
import inspect
import math
import warnings

import pytest
import torch
import transformers
from transformers import DynamicCache

from trainstream_hf.cache import PagedKVCache, TrainStreamCache
from trainstream_hf.engine.arena import HostArena

transformers.logging.set_verbosity_error()

# transformers 5.24 models and generate() take the cache as ``cache=`` (``past_key_values=`` is deprecated there);
# 5.17 takes ``past_key_values=`` only (a ``cache=`` would not reach the attention layers).
_FORWARD_ARGS = inspect.signature(transformers.LlamaForCausalLM.forward).parameters
CACHE_KW = "cache" if "cache" in _FORWARD_ARGS else "past_key_values"

VOCAB, HIDDEN, LAYERS = 128, 64, 4


def _kwargs():
    return dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                num_attention_heads=4, num_key_value_heads=2, head_dim=HIDDEN // 4, max_position_embeddings=128,
                pad_token_id=0, bos_token_id=1, eos_token_id=2)


FAMILIES = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**_kwargs())),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_kwargs())),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**_kwargs(), sliding_window=8)),
    "gemma2": lambda: transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(**_kwargs(), query_pre_attn_scalar=HIDDEN // 4, sliding_window=8)),
    # KV sharing: of 6 layers, 2 and 3 store K/V that 4 and 5 reuse (4 and 5 have no cache of their own)
    "gemma4": lambda: transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(
        **{**_kwargs(), "num_hidden_layers": 6}, global_head_dim=HIDDEN // 4, sliding_window=8,
        num_kv_shared_layers=2, layer_types=["sliding_attention", "full_attention"] * 3,
        vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16)),
}


def _model(family, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    model = FAMILIES[family]().to(dtype).eval()
    with torch.no_grad():  # outlier channels, as trained models have
        model.get_input_embeddings().weight[:, [3, 17]] *= 25
    return model


def _prompt(batch=2, length=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding on one row: the masks must be sized from the cache too
    ids[0, :2] = 0
    return ids, mask


def _generate(model, ids, mask, cache=None, new=20, **kw):
    extra = {} if cache is None else {CACHE_KW: cache}
    return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=None,
                          pad_token_id=0, **extra, **kw)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("resident", [0.0, 0.5, 1.0])
def test_generate_matches_dynamic_cache(family, resident):
    model = _model(family)
    ids, mask = _prompt()
    ref = _generate(model, ids, mask)
    cache = TrainStreamCache(model, resident=resident, chunk=8)  # 7 + 20 tokens: grows three times
    out = _generate(model, ids, mask, cache)
    assert torch.equal(out, ref)
    assert cache.get_seq_length() == ids.shape[1] + 20 - 1  # the last token is never fed back

    n_off = LAYERS - math.floor(resident * LAYERS)
    if family == "gemma4":  # the two KV-sharing producers stay resident: a later layer reads their K/V
        n_off = min(n_off, 2)
        assert set(cache.offloaded_layers) <= {0, 1} and all(cache.is_dummy[4:])
    assert len(cache.offloaded_layers) == n_off
    mem, stats = cache.memory(), cache.stats()
    per_layer = 2 * cache.capacity * 2 * 2 * (HIDDEN // 4) * 4  # K+V, batch 2, 2 KV heads, fp32
    assert mem["host"] == n_off * per_layer
    assert mem["device"] == (LAYERS - n_off) * per_layer + (2 * per_layer if n_off else 0)
    assert stats["growths"] == 3
    if n_off > 2:  # more offloaded layers than slots: every decode step streams them back
        assert stats["loads_ahead"] >= 19 * (n_off - 1) and stats["h2d_bytes"] > 0
    if n_off == 0:
        assert stats["h2d_bytes"] == stats["d2h_bytes"] == 0


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("resident,slots,prefetch", [(0.0, 2, 1), (0.5, 2, 1), (0.0, 3, 2), (0.25, 1, 0)])
def test_forward_loop_logits_exact(family, dtype, resident, slots, prefetch):
    model = _model(family, dtype)
    ids, mask = _prompt(length=6)
    g = torch.Generator().manual_seed(2)
    # prefill, single tokens, a 3-token chunk, single tokens: 6 + 5 + 3 + 4 = 18 > 16, so one growth too
    chunks = [ids] + [torch.randint(3, VOCAB, (2, q), generator=g) for q in (1, 1, 1, 1, 1, 3, 1, 1, 1, 1)]
    ref_cache = DynamicCache(config=model.config)
    cache = PagedKVCache(model, resident=resident, slots=slots, prefetch=prefetch, max_cache_len=16, chunk=4)
    with torch.no_grad():
        for step, x in enumerate(chunks):
            mask = torch.cat([mask, torch.ones_like(x)], 1) if step else mask
            want = model(input_ids=x, attention_mask=mask, **{CACHE_KW: ref_cache}, use_cache=True).logits
            got = model(input_ids=x, attention_mask=mask, **{CACHE_KW: cache}, use_cache=True).logits
            assert torch.equal(got, want), f"step {step}"
    assert cache.get_seq_length() == ref_cache.get_seq_length() == 18
    assert cache.stats()["growths"] == 1 and cache.capacity == 20
    if prefetch:  # after the prefill, a copy is only made on demand right after a growth
        assert cache.stats()["loads_on_demand"] <= 1


def test_mlp_only_layers_hold_no_cache():
    """Attention-free ("mlp" / "moe") decoder layers get no cache layer (transformers 5.24's DummyLayer; a stand-in
    on 5.17, whose own DynamicCache gives them a linear-attention layer) and are skipped when offloading."""
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(
        **{k: v for k, v in _kwargs().items() if k not in ("max_position_embeddings", "bos_token_id", "eos_token_id")},
        layer_types=["full_attention", "mlp", "full_attention", "moe"], n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=1, moe_shared_expert_intermediate_size=32)).eval()
    ids, mask = _prompt()
    ref = _generate(model, ids, mask, new=10)
    cache = TrainStreamCache(model, resident=0.0, chunk=4)
    assert cache.is_dummy == [False, True, False, True] and cache.offloaded_layers == [0, 2]
    assert torch.equal(_generate(model, ids, mask, cache, new=10), ref)
    assert cache.get_seq_length() == ids.shape[1] + 10 - 1 and cache.stats()["h2d_bytes"] > 0


def test_past_key_values_kwarg_and_arena_pages():
    """The ``past_key_values=`` spelling works (deprecated in transformers 5.24, the only one in 5.17), and pages
    can come from a HostArena."""
    model = _model("qwen2")
    ids, mask = _prompt()
    ref = _generate(model, ids, mask)
    arena = HostArena("auto", pinned=False, slab_bytes="1MiB")
    cache = TrainStreamCache(model, resident_layers=1, max_cache_len=27, arena=arena)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=20, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    assert torch.equal(out, ref)
    assert arena.stats()["used"] >= cache.memory()["host"] > 0
    cache.close()
    assert cache.memory()["host"] == 0 and arena.stats()["live_allocations"] == 0  # pages handed back


@pytest.mark.parametrize("resident", [0.0, 0.5])
def test_no_per_token_allocations_without_growth(resident):
    """With max_cache_len covering the generation, pages and slots are allocated once, at the prefill, and
    every copy back to the device is issued ahead of its layer (none on demand)."""
    model = _model("llama")
    ids, mask = _prompt()
    ref = _generate(model, ids, mask)
    cache = TrainStreamCache(model, resident=resident, max_cache_len=27)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **{CACHE_KW: cache}, use_cache=True)
    ptrs = [(layer.k.data_ptr(), layer.v.data_ptr()) for layer in cache.layers]
    slots = [t.data_ptr() for t in cache._slot_k + cache._slot_v]
    cache.reset()
    assert torch.equal(_generate(model, ids, mask, cache), ref)
    assert [(layer.k.data_ptr(), layer.v.data_ptr()) for layer in cache.layers] == ptrs
    assert [t.data_ptr() for t in cache._slot_k + cache._slot_v] == slots
    stats = cache.stats()
    assert stats["growths"] == 0 and cache.capacity == 27 and stats["loads_on_demand"] == 0
    if resident == 0.0:  # 4 offloaded layers cycle through 2 slots: every decode step copies all back
        assert stats["loads_ahead"] >= 19 * 3


def test_inference_mode_then_reuse():
    """Buffers allocated (and grown) under inference_mode stay normal tensors: the cache is reusable."""
    model = _model("qwen2")
    ids, mask = _prompt()
    ref = _generate(model, ids, mask)
    cache = TrainStreamCache(model, resident=0.5, chunk=8)
    with torch.inference_mode():
        assert torch.equal(_generate(model, ids, mask, cache), ref)
    cache.reset()
    assert torch.equal(_generate(model, ids, mask, cache), ref)


def test_beam_search_reorders():
    model = _model("llama")
    ids, mask = _prompt()
    ref = _generate(model, ids, mask, new=10, num_beams=3)
    cache = TrainStreamCache(model, resident=0.5, chunk=8)
    assert torch.equal(_generate(model, ids, mask, cache, new=10, num_beams=3), ref)


def test_crop_matches_dynamic_cache():
    """Crops back into the prefill and into the last forward, as assisted decoding does (a crop after every forward
    while recording: transformers 5.17's sliding DynamicCache layers need it, 5.24's no longer do)."""
    model = _model("mistral")
    ids, _ = _prompt(length=12)
    ref_cache, cache = DynamicCache(config=model.config), TrainStreamCache(model, resident=0.0, chunk=4)
    ref_cache.activate_past_recording()  # lets DynamicCache crop sliding layers back, as assisted decoding does
    cache.activate_past_recording()  # a no-op for PagedKVCache, which keeps every layer's history
    with torch.no_grad():
        for c in (ref_cache, cache):
            model(input_ids=ids, **{CACHE_KW: c}, use_cache=True)
        ref_cache.crop(-3)  # 12 -> 9 tokens: the window of the next query starts before what the slots held
        cache.crop(-3)
        x = ids[:, 4:8]  # 4 candidate tokens, 3 of them rejected below
        assert torch.equal(model(input_ids=x, **{CACHE_KW: cache}).logits,
                           model(input_ids=x, **{CACHE_KW: ref_cache}).logits)
        ref_cache.crop(-3)
        cache.crop(-3)
        x = ids[:, 8:10]
        assert torch.equal(model(input_ids=x, **{CACHE_KW: cache}).logits,
                           model(input_ids=x, **{CACHE_KW: ref_cache}).logits)
    assert cache.get_seq_length() == ref_cache.get_seq_length() == 12


def test_batch_size_change():
    model = _model("llama")
    cache = TrainStreamCache(model, resident=0.5)
    with torch.no_grad():
        model(input_ids=torch.randint(3, VOCAB, (2, 5)), **{CACHE_KW: cache})
        with pytest.raises(ValueError, match="batch size changed mid-generation"):
            model(input_ids=torch.randint(3, VOCAB, (3, 1)), **{CACHE_KW: cache})
        cache.reset()  # an empty cache takes a new batch size
        ids = torch.randint(3, VOCAB, (3, 5))
        got = model(input_ids=ids, **{CACHE_KW: cache}).logits
    assert torch.equal(got, model(input_ids=ids).logits)


@pytest.mark.parametrize("kwargs,match", [
    (dict(resident=-0.1), "fraction in"), (dict(resident=1.5), "fraction in"),
    (dict(resident=float("nan")), "fraction in"), (dict(resident=True), "fraction in"),
    (dict(resident="half"), "fraction in"),
    (dict(resident_layers=5), r"int in \[0, 4\]"), (dict(resident=0.5, resident_layers=1), "not both"),
    (dict(slots=0), "slots >= 1"), (dict(slots=2, prefetch=2), "prefetch <= slots - 1"),
    (dict(chunk=0), "chunk"), (dict(max_cache_len=0), "max_cache_len"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PagedKVCache(_model("llama"), **kwargs)


def test_unsupported_models():
    with pytest.raises(ValueError, match="no attention layers"):
        PagedKVCache(transformers.LlamaConfig(**{**_kwargs(), "num_hidden_layers": 0}))
    with pytest.raises(ValueError, match=r"layer types \['linear_attention'\] are not supported"):
        PagedKVCache(transformers.MambaConfig(num_hidden_layers=2))
    with pytest.raises(ValueError, match="encoder-decoder"):
        PagedKVCache(transformers.T5Config())
    with pytest.raises(ValueError, match="not a transformers model"):
        PagedKVCache(torch.nn.Linear(2, 2))


def test_misuse_errors():
    model = _model("llama")
    cache = PagedKVCache(model)
    k = torch.randn(2, 2, 3, HIDDEN // 4, requires_grad=True)
    with pytest.raises(ValueError, match="torch.no_grad"):
        cache.update(k, k, 0)
    with torch.no_grad():
        cache.update(k, k, 0)
        with pytest.raises(ValueError, match="mid-generation"):
            cache.update(k.double(), k.double(), 1)
    with pytest.raises(ValueError, match="negative"):
        cache.crop(2)
    with pytest.raises(NotImplementedError, match="batch size is fixed"):
        cache.batch_repeat_interleave(2)
    with pytest.raises(NotImplementedError, match="batch size is fixed"):
        cache.batch_select_indices(torch.tensor([0]))


def test_resident_layers_are_head_major_offloaded_pages_token_major():
    """A resident layer's K/V reach attention as contiguous rows per head (StaticCache's layout); an offloaded
    layer's host page keeps a step's new tokens in one contiguous block (one copy to the host)."""
    cfg = transformers.LlamaConfig(**_kwargs())
    cache = PagedKVCache(cfg, resident=0.5, max_cache_len=64)
    k = torch.randn(2, 2, 5, HIDDEN // 4)
    with torch.no_grad():
        for i in range(LAYERS):
            keys, values = cache.update(k, k + 1, i)
            assert torch.equal(keys, k) and torch.equal(values, k + 1)
            layer = cache.layers[i]
            if layer.resident:
                assert keys.stride(-2) == HIDDEN // 4 and keys.stride(1) == 64 * HIDDEN // 4  # [B, H, T, D] rows
            else:
                assert layer.k.is_contiguous() and layer.k[0:5].is_contiguous()  # token-major host page
    assert sum(layer.resident for layer in cache.layers) == LAYERS // 2


def test_a_whole_sequence_given_again_is_refused_and_new_tokens_are_not():
    """With use_cache off (model.config.use_cache=False, as training scripts often leave it) generate() feeds the whole
    sequence at every step and a given cache would take it all again (wrong output): refused, saying what to do. A
    chunk of new tokens one longer than what is held is no such thing and decodes as DynamicCache does."""
    model = _model("llama")
    ids, mask = _prompt()
    model.config.use_cache = model.generation_config.use_cache = False
    for resident in (0.0, 1.0):
        with pytest.raises(ValueError, match=r"holds 7 tokens and is given them again.*use_cache=True"):
            _generate(model, ids, mask, TrainStreamCache(model, resident=resident), new=3)
    later = torch.randint(3, VOCAB, (ids.shape[0], ids.shape[1] + 1), generator=torch.Generator().manual_seed(9))
    both = torch.cat([mask, torch.ones_like(later)], 1)
    with torch.no_grad():
        for resident in (0.0, 0.5):
            ref, cache = DynamicCache(config=model.config), TrainStreamCache(model, resident=resident)
            for c in (ref, cache):
                model(input_ids=ids, attention_mask=mask, **{CACHE_KW: c}, use_cache=True)
            want = model(input_ids=later, attention_mask=both, **{CACHE_KW: ref}, use_cache=True).logits
            got = model(input_ids=later, attention_mask=both, **{CACHE_KW: cache}, use_cache=True).logits
            assert torch.equal(got, want)
            cache.close()




def test_pinned_pages_are_kept_with_the_model_for_its_next_cache(monkeypatch):
    """Pinning costs ~0.4 s per GiB: the pages an offloading cache took go back to a pool kept with the model (its
    config) when the cache is closed or dropped, and the model's next cache takes them again without reserving more.
    The pool goes with the model, or at release_host_pages. (Pinned only on CUDA; here the pool's arena is pageable,
    the same bookkeeping.)"""
    import gc

    from trainstream_hf import cache as cache_module

    monkeypatch.setattr(cache_module, "_pins_pages", lambda device: True)
    model = _model("llama")
    ids, mask = _prompt()
    want = _generate(model, ids, mask)
    first = TrainStreamCache(model, resident=0.5)
    assert torch.equal(_generate(model, ids, mask, first), want)
    pool = cache_module._PAGE_POOLS[id(model.config)]
    reserved = pool.arena.stats()["reserved"]
    assert reserved > 0 and pool.arena.stats()["used"] > 0
    first.close()
    assert pool.arena.stats()["used"] == 0  # back in the pool
    second = TrainStreamCache(model, resident=0.5)
    assert torch.equal(_generate(model, ids, mask, second), want)
    del second  # dropped without close: the pages go back all the same
    gc.collect()
    assert pool.arena.stats()["used"] == 0
    third = TrainStreamCache(model, resident=0.5)
    assert torch.equal(_generate(model, ids, mask, third), want)
    assert pool.arena.stats()["reserved"] == reserved  # three generations, one reservation
    other = _model("qwen2")  # another model: a pool of its own
    _generate(other, ids, mask, TrainStreamCache(other, resident=0.5), new=2)
    assert cache_module._PAGE_POOLS[id(other.config)] is not pool
    key = id(other.config)
    del other
    gc.collect()
    assert key not in cache_module._PAGE_POOLS  # it went with its model
    third.close()
    assert cache_module.release_host_pages(model) == reserved and id(model.config) not in cache_module._PAGE_POOLS
    fourth = TrainStreamCache(model, resident=0.5)  # after a release: a new pool
    assert torch.equal(_generate(model, ids, mask, fourth), want)
    assert cache_module._PAGE_POOLS[id(model.config)] is not pool
    fourth.close()
