"""PagedKVCache(static=True) on the CPU: a fixed capacity returned whole and masked, as transformers' StaticCache, so
that generate() can compile the decode step with some layers' K/V in host pages. The logits equal StaticCache's
(``torch.equal``) for every split of the layers; a compiled decode step (dynamo, the eager backend) breaks its graph
at the offloaded layers only, gives the same tokens (logits within rounding: the traced mask is built by another path)
and compiles nothing more on the next generate()."""
import pytest
import torch
from torch._dynamo.utils import counters
from transformers import StaticCache
from transformers.generation.configuration_utils import CompileConfig

from tests.test_cache import CACHE_KW, _model
from trainstream_hf.cache import TrainStreamCache

PROMPT, NEW = 10, 12


def _ids(seed=3, batch=2):
    return torch.randint(3, 128, (batch, PROMPT), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, cache, **kw):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None,
                         **{CACHE_KW: cache}, **kw)
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("resident", [1.0, 0.5, 0.0])
def test_static_logits_are_static_caches(family, resident):
    model = _model(family)
    ids = _ids()
    ref_tokens, ref_logits = _generate(model, ids, StaticCache(config=model.config, max_cache_len=PROMPT + NEW),
                                       disable_compile=True)
    cache = TrainStreamCache(model, resident=resident, static=True, max_cache_len=PROMPT + NEW)
    assert cache.is_compileable and len(cache.offloaded_layers) == round((1 - resident) * 4)
    tokens, logits = _generate(model, ids, cache, disable_compile=True)
    assert torch.equal(tokens, ref_tokens) and torch.equal(logits, ref_logits)
    stats = cache.stats()
    if resident < 1.0:  # the offloaded layers' new tokens went to host pages
        assert stats["d2h_bytes"] > 0
    if resident == 0.0:  # four offloaded layers through two slots: each came back from its pages, ahead of use
        assert stats["loads_ahead"] > 0 and stats["h2d_bytes"] > 0
    assert int(cache.get_seq_length()) == PROMPT + NEW - 1  # (the last token is not fed back)
    # reset and reuse: the same logits again
    cache.reset()
    assert torch.equal(_generate(model, ids, cache, disable_compile=True)[1], ref_logits)


def test_compiled_decode_breaks_only_at_offloaded_layers_and_gives_the_same_tokens():
    model = _model("llama")
    ids = _ids(5)
    eager_tokens, eager_logits = _generate(model, ids, TrainStreamCache(model, resident=0.5, static=True,
                                                                         max_cache_len=PROMPT + NEW),
                                           disable_compile=True)
    compile_config = CompileConfig(backend="eager", mode=None)
    compile_config._compile_all_devices = True  # (transformers compiles generate() on accelerators only)
    torch._dynamo.reset()
    counters.clear()
    runs = []
    for _ in range(2):
        cache = TrainStreamCache(model, resident=0.5, static=True, max_cache_len=PROMPT + NEW)
        runs.append(_generate(model, ids, cache, disable_compile=False, compile_config=compile_config))
        graphs = counters["stats"]["unique_graphs"]
        if len(runs) == 1:
            first = graphs
    assert counters["stats"]["calls_captured"] > 0 and first > 1  # compiled, in pieces
    assert graphs == first  # the second generate() compiled nothing
    breaks = dict(counters["graph_break"])
    assert breaks and all("_update_offloaded_static" in reason for reason in breaks), breaks
    for tokens, logits in runs:  # (traced, the mask is built by another path: the logits may differ in rounding)
        assert torch.equal(tokens, eager_tokens) and torch.allclose(logits, eager_logits, atol=1e-5, rtol=0)
    assert torch.equal(runs[0][1], runs[1][1])
    assert cache.stats()["d2h_bytes"] > 0


def test_every_resident_layer_compiles_as_one_graph():
    model = _model("llama")
    ids = _ids(7)
    compile_config = CompileConfig(backend="eager", mode=None)
    compile_config._compile_all_devices = True
    torch._dynamo.reset()
    counters.clear()
    cache = TrainStreamCache(model, resident=1.0, static=True, max_cache_len=PROMPT + NEW)
    tokens, _ = _generate(model, ids, cache, disable_compile=False, compile_config=compile_config)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    ref, _ = _generate(model, ids, StaticCache(config=model.config, max_cache_len=PROMPT + NEW), disable_compile=True)
    assert torch.equal(tokens, ref)


def test_static_needs_a_capacity_and_full_attention():
    with pytest.raises(ValueError, match="static=True\\) needs max_cache_len"):
        TrainStreamCache(_model("llama"), resident=0.5, static=True)
    with pytest.raises(ValueError, match="full attention layers only"):
        TrainStreamCache(_model("mistral"), resident=0.5, static=True, max_cache_len=64)


def test_tokens_past_the_capacity_are_refused_in_one_line():
    model = _model("llama")
    ids = _ids()
    with pytest.raises(ValueError, match="a prompt of 10 tokens does not fit max_cache_len=8"):
        _generate(model, ids, TrainStreamCache(model, resident=0.5, static=True, max_cache_len=8),
                  disable_compile=True)
    for resident in (0.0, 0.5, 1.0):  # an offloaded layer's decode, and a resident one's (layer 0 at 0.5 and 1.0)
        cache = TrainStreamCache(model, resident=resident, static=True, max_cache_len=PROMPT + 2)
        with pytest.raises(ValueError, match="13 tokens do not fit max_cache_len=12.*cache.reset()"):
            _generate(model, ids, cache, disable_compile=True)
        cache.close()
    cache = TrainStreamCache(model, resident=1.0, static=True, max_cache_len=PROMPT + NEW)
    first = _generate(model, ids, cache, disable_compile=True)[0]
    cache.reset()  # (without it, transformers' generate() slices the prompt by the tokens held, as for StaticCache)
    assert torch.equal(_generate(model, ids, cache, disable_compile=True)[0], first)


def test_crop_and_reorder_act_on_the_tensor_lengths():
    model = _model("llama")
    ids = _ids()
    cache = TrainStreamCache(model, resident=0.5, static=True, max_cache_len=PROMPT + NEW)
    _generate(model, ids, cache, disable_compile=True)
    n = PROMPT + NEW - 1
    cache.crop(-3)
    assert [layer.tokens() for layer in cache.layers] == [n - 3] * 4
    assert int(cache.get_seq_length()) == n - 3
    cache.crop(-100)
    assert [layer.tokens() for layer in cache.layers] == [0] * 4
