"""generate() with a static cache and transformers' compiled decode step (torch.compile "reduce-overhead": CUDA graphs)
on a wrapped LoRA model over an NF4 base: the engine's block hooks stand aside in the traced no-grad forward, the tokens
are eager's, and training goes on afterwards (TrainStreamGRPOTrainer(compiled_generation=True))."""
import torch
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM

import trainstream_hf as ts


def test_compiled_greedy_decode_gives_eager_tokens_then_trains():
    from trainstream_hf.quant import quantize_model
    from trainstream_hf.train.model import add_lora

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = add_lora(quantize_model(LlamaForCausalLM(cfg).to("cuda", torch.bfloat16), "nf4"), r=8, alpha=16,
                     dropout=0.0, target_modules="all-linear")
    model, opt = ts.wrap(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3),
                         vram_budget="8GiB")
    ids = torch.randint(0, 256, (4, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        eager = model.generate(**kw, disable_compile=True)
        torch._dynamo.reset()
        counters.clear()
        compiled = [model.generate(**kw, cache_implementation="static", disable_compile=False) for _ in range(3)]
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"], dict(counters["graph_break"])
    assert all(torch.equal(out, compiled[0]) for out in compiled)  # the replays agree
    # with eager on the first new tokens (a bf16 near-tie may flip a later argmax: the static cache's masked attention
    # sums over more positions)
    assert torch.equal(compiled[0][:, :20], eager[:, :20])
    model(input_ids=ids, labels=ids).loss.backward()  # the hooks act again in a training forward
    opt.step()
    ts.unwrap(model)


def test_compiled_decode_through_a_static_trainstream_cache_with_offloaded_layers():
    """TrainStreamCache(static=True), half the layers' K/V in pinned host pages: transformers compiles the decode step
    ("reduce-overhead": CUDA graphs between the offloaded layers' copies), the tokens are the eager static cache's and
    the replays agree; the offloaded layers really went through their pages."""
    from trainstream_hf.cache import TrainStreamCache, cache_keyword

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, 256, (4, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, pad_token_id=0)
    key = cache_keyword(model)
    with torch.no_grad():
        eager_cache = TrainStreamCache(model, resident=0.5, static=True, max_cache_len=40)
        eager = model.generate(**kw, **{key: eager_cache}, disable_compile=True)
        torch._dynamo.reset()
        counters.clear()
        cache = TrainStreamCache(model, resident=0.5, static=True, max_cache_len=40)
        compiled = []
        for _ in range(3):
            cache.reset()
            compiled.append(model.generate(**kw, **{key: cache}, disable_compile=False))
    assert counters["stats"]["unique_graphs"] > 1
    assert all(torch.equal(out, compiled[0]) for out in compiled)
    assert torch.equal(compiled[0][:, :28], eager[:, :28])  # (a bf16 near-tie may flip a later argmax)
    assert cache.stats()["h2d_bytes"] > 0 and cache.stats()["d2h_bytes"] > 0
    cache.close()
