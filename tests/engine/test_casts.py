"""Exact widening casts saved as their narrow source (engine/casts.py) and the offloader's backward prefetch."""
import copy

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import trainstream_hf as ts
from trainstream_hf import planner
from trainstream_hf.engine.activations import ActivationOffloader, Prefetch
from trainstream_hf.engine.arena import HostArena
from trainstream_hf.engine.casts import CastSources
from trainstream_hf.engine.hooks import BlockHooks
from trainstream_hf.engine.streams import TransferStreams

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora_llama(layers=3, seed=0):
    """bf16 Llama with PEFT LoRA: PEFT upcasts the adapters to fp32 (its default), so every LoRA layer saves an
    fp32 copy of its bf16 input."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    model = get_peft_model(LlamaForCausalLM(cfg).to(torch.bfloat16), LoraConfig(r=4, target_modules=TARGETS))
    for n, p in model.named_parameters():
        if "lora_B" in n:  # non-zero B, so the adapters' input gradients are non-trivial too
            nn.init.normal_(p, std=0.02)
    return model


def _ids(step, b=2, t=16):
    return torch.randint(0, 128, (b, t), generator=torch.Generator().manual_seed(100 + step))


def _lora_opt(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


# -- CastSources ------------------------------------------------------------------------------------
def test_records_only_exact_widening_casts_under_grad():
    cs = CastSources()
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    wide = x.float()
    cs.record(x, wide)
    assert cs.source(wide)[0] is x
    narrow = torch.randn(4, 8).bfloat16()
    cs.record(wide, narrow)                       # narrowing: not exact
    assert cs.source(narrow) is None
    t = torch.randn(8, 4, dtype=torch.bfloat16).t()
    cs.record(t[::2], t[::2].float())             # not dense
    ints = torch.arange(8, dtype=torch.int32)
    cs.record(ints, ints.to(torch.int64))         # not floating
    with torch.no_grad():
        y = x.float()
        cs.record(x, y)                           # nothing is saved without grad
    assert cs.source(y) is None and len(cs) == 1
    del wide
    assert len(cs) == 0                           # entries die with their cast output


def test_the_cast_map_stays_bounded_without_weakref_callbacks():
    """Dead entries are pruned as the map grows (no Python callback runs where a tensor is freed)."""
    cs = CastSources()
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    kept = []
    for i in range(20000):
        y = x.float()
        cs.record(x, y)
        if i % 1000 == 0:
            kept.append(y)
    del y
    assert len(cs) == len(kept) and len(cs._map) <= 2048
    assert all(cs.source(y)[0] is x and cs.source(y)[1] is y for y in kept)


def test_source_resolves_views_and_rejects_changed_tensors():
    cs = CastSources()
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    wide = x.float()
    cs.record(x, wide)
    view = wide.view(-1, 8)[2:]
    src, base = cs.source(view)
    assert src is x and base is wide
    wide2 = x.float()
    cs.record(x, wide2)
    wide2.add_(1)                                 # the copy changed: it is no longer x's cast
    assert cs.source(wide2) is None
    x.mul_(2)                                     # the source changed: neither copy is its cast any more
    assert cs.source(wide) is None


def test_install_wraps_cast_input_dtype_and_uninstall_restores():
    model = _lora_llama(layers=1)
    cs = CastSources()
    n = cs.install(model.modules())
    assert n == len(TARGETS)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert "_cast_input_dtype" in layer.__dict__
    x = torch.randn(2, 64, dtype=torch.bfloat16, requires_grad=True)
    y = layer._cast_input_dtype(x, torch.float32)
    assert cs.source(y)[0] is x
    cs.uninstall()
    assert "_cast_input_dtype" not in layer.__dict__ and len(cs) == 0


# -- the engine: bit-exact, less memory ---------------------------------------------------------------
def _compare(train_side_by_side, options, steps=3):
    ref = _lora_llama()
    model = copy.deepcopy(ref)
    model, opt = ts.wrap(model, _lora_opt(model), vram_budget="64GiB", host_arena=None, page_weights=False,
                         offload_optimizer=False, **options)
    train_side_by_side(ref, model, _lora_opt(ref), opt, [_ids(s) for s in range(steps)])
    return model


@pytest.mark.parametrize("offload", [False, True])
def test_lora_blocks_save_the_bf16_source_bit_exact(offload, train_side_by_side):
    """Kept on the device or offloaded, a LoRA block that saves the bf16 source of each fp32 copy gives the same
    losses and LoRA gradients as the plain PEFT model, bit for bit."""
    model = _compare(train_side_by_side, dict(offload_activations=offload, min_activation_bytes=0, elide_casts=True))
    stats = model.trainstream_stats()["activations"]
    # 7 LoRA layers per block, 3 blocks, each saving (views of) an fp32 copy of its input
    assert stats["casts_elided"] >= 7 * 3
    assert stats["cast_bytes_elided"] > 0
    assert (stats["offloaded"] > 0) == offload
    eng = ts.engine_of(model)
    ts.unwrap(model)
    assert eng.casts is not None and not any("_cast_input_dtype" in m.__dict__ for m in model.modules())


def test_elide_casts_off_keeps_the_copies(train_side_by_side):
    model = _compare(train_side_by_side, dict(offload_activations=False, elide_casts=False), steps=1)
    assert ts.engine_of(model).offloader is None and ts.engine_of(model).casts is None


def test_measured_block_counts_the_source_not_the_copy():
    """The plan measures what the engine will hold: with elision a LoRA block's saved bytes drop by the fp32
    copies less their bf16 sources."""
    model = _lora_llama(layers=1)
    block = model.base_model.model.model.layers[0]
    plain = planner.measure_block(model, block, (2, 16), torch.device("cpu"))
    cs = CastSources()
    cs.install(model.modules())
    elided = planner.measure_block(model, block, (2, 16), torch.device("cpu"), casts=cs)
    cs.uninstall()
    tokens, h, i = 32, 64, 128
    # fp32 copies: q, k, v, o, gate, up inputs (h each) and down's (i); bf16 sources: one for q/k/v, one for
    # gate/up, down's (o's is the attention output, which attention saves anyway).
    saved = tokens * 4 * (6 * h + i) - tokens * 2 * (2 * h + i)
    assert plain.activation_bytes - elided.activation_bytes == saved


def test_source_changed_in_place_after_the_save_is_an_error():
    """A widened copy whose source is overwritten after autograd saved it cannot be rebuilt: backward raises
    instead of using wrong values."""

    class Cast(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def _cast_input_dtype(self, x, dtype):
            return x.to(dtype)

        def forward(self, x):
            src = x * 1                           # a bf16 tensor nobody else saves
            y = self._cast_input_dtype(src, torch.float32) @ self.w
            src.add_(1)                           # ... overwritten after its fp32 copy was saved
            return y.to(x.dtype)

    blocks = nn.ModuleList([Cast(), Cast()])
    cs = CastSources()
    cs.install(blocks.modules())
    hooks = BlockHooks(list(blocks))
    off = ActivationOffloader(hooks, TransferStreams("cpu"), HostArena(1 << 20, pinned=False), blocks=[],
                              casts=cs)
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    out = blocks[1](blocks[0](x))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.float().sum().backward()
    off.close()
    hooks.remove()


# -- backward prefetch ----------------------------------------------------------------------------
def test_prefetch_allowance():
    p = Prefetch(resident=[10, 0, 10, 30], current=[0, 20, 0, 0], limit=100, grads=5)
    assert p.allowance(3) == 100 - 50 - 0 - 5
    assert p.allowance(1) == 100 - 10 - 20 - 5
    assert Prefetch().allowance(3) == 0


@pytest.mark.parametrize("limit,expect", [(0, "one ahead"), (1 << 40, "all at once")])
def test_backward_fetches_ahead_within_the_allowance(limit, expect):
    """Offloaded blocks come back one block ahead by default, and all at once when the plan leaves room."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    model, _ = ts.wrap(model, None, vram_budget="64GiB", host_arena=None, page_weights=False,
                       offload_activations=True, min_activation_bytes=0)
    off = ts.engine_of(model).offloader
    off.prefetch = Prefetch(resident=[0] * 6, current=[1] * 6, limit=limit, grads=0)
    calls = []
    start, fetch = off.backward_start, off._fetch_block
    off.backward_start = lambda i: (calls.append(("at", i)), start(i))
    off._fetch_block = lambda j: (calls.append(("fetch", j)), fetch(j))
    ids = _ids(0)
    model(input_ids=ids, labels=ids).loss.backward()
    fetched_at = {}
    now = None
    for kind, k in calls:
        if kind == "at":
            now = k
        else:
            fetched_at[k] = now
    if expect == "one ahead":
        assert fetched_at == {5: 5, 4: 5, 3: 4, 2: 3, 1: 2, 0: 1}
    else:
        assert fetched_at == {k: 5 for k in range(6)}
    ts.unwrap(model)


def test_wrap_measures_a_block_whose_input_needs_a_gradient():
    """With a frozen embedding the first block's input needs no gradient and it saves less than the others; the
    plan takes the second block's figure (as every later block runs)."""
    model = _lora_llama()
    blocks = model.base_model.model.model.layers
    cs = CastSources()
    cs.install(model.modules())
    first, second = (planner.measure_block(model, b, (1, 64), torch.device("cpu"), casts=cs).activation_bytes
                     for b in (blocks[0], blocks[1]))
    cs.uninstall()
    assert first < second
    model, _ = ts.wrap(model, None, vram_budget="64GiB", host_arena=None, batch_shape=(1, 64), elide_casts=True)
    assert {b.activation_bytes for b in model.trainstream_plan.blocks} == {second}
    ts.unwrap(model)


def test_auto_elides_casts_only_when_the_plan_needs_the_memory():
    """elide_casts='auto' (the default): with room for every block's full activations nothing is installed (no
    hooks, no casts in backward) and the plan counts the copies; at a budget only the elided activations meet, the
    elision is installed and keeps every block on the device."""
    shape = (1, 64)
    roomy, _ = ts.wrap(_lora_llama(), None, vram_budget="64GiB", host_arena=None, batch_shape=shape)
    eng = ts.engine_of(roomy)
    assert eng.casts is None and eng.offloader is None
    full = roomy.trainstream_plan
    ts.unwrap(roomy)
    forced, _ = ts.wrap(_lora_llama(), None, vram_budget="64GiB", host_arena=None, batch_shape=shape,
                        elide_casts=True)
    elided = forced.trainstream_plan
    ts.unwrap(forced)
    assert elided.blocks[1].activation_bytes < full.blocks[1].activation_bytes
    tight, _ = ts.wrap(_lora_llama(), None, vram_budget=elided.predicted_peak() + elided.margin, host_arena=None,
                       batch_shape=shape, page_weights=False)
    eng = ts.engine_of(tight)
    assert eng.casts is not None
    pl = tight.trainstream_plan
    assert not (pl.paged_blocks or pl.offloaded_activation_blocks or pl.recomputed_blocks)
    ts.unwrap(tight)


def test_auto_installs_nothing_where_nothing_is_widened():
    """LoRA over QuantLinear bases takes the native path (ops.lora_add), which saves the bf16 input itself: the
    measured block has nothing to elide, so 'auto' installs no saved-tensor hooks even at a budget where the plan
    would want the memory (they would cost a Python call per saved tensor for nothing)."""
    from peft import LoraConfig, get_peft_model

    from trainstream_hf.quant import quantize_model
    from trainstream_hf.integrations.peft import register_quant_lora

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    model = quantize_model(LlamaForCausalLM(cfg).to(torch.bfloat16), "nf4")
    model = get_peft_model(model, register_quant_lora(LoraConfig(r=4, target_modules=TARGETS)))
    wrapped, _ = ts.wrap(model, None, vram_budget="64GiB", host_arena=None, batch_shape=(1, 64))
    eng = ts.engine_of(wrapped)
    assert eng.casts is None and eng.offloader is None
    assert not any("_cast_input_dtype" in m.__dict__ for m in wrapped.modules())  # the recording wrapper is gone
    ts.unwrap(wrapped)
