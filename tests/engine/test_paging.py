"""Weight paging + activation offload on the CPU compute device, bit-exact against the unwrapped model.

Each case builds a tiny transformers model from a config, deep-copies it as the reference, pages every
block's weights (slots S, prefetch P) and offloads the saved activations of every block, then runs five
forward/backward passes on five random batches. Loss and every gradient must be ``torch.equal`` to the
reference's. Between passes both models take the same plain SGD step, ``w -= lr * grad`` with one host
``add_`` per tensor: on the reference's parameters, and for paged parameters on their host copy
(``WeightPager.host_tensor``), which is where an optimizer writes a paged weight.
"""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainstream_hf.engine.activations import ActivationOffloader
from trainstream_hf.engine.arena import HostArena
from trainstream_hf.engine.blocks import Blocks, find_blocks
from trainstream_hf.engine.hooks import BlockHooks
from trainstream_hf.engine.streams import TransferStreams
from trainstream_hf.engine.weights import WeightPager

transformers.logging.set_verbosity_error()

VOCAB, HIDDEN, SEQ = 128, 64, 16
MIN_BYTES = 2048  # small enough that most activations move, large enough that some stay
# The compute device. The same tests run on CUDA when a script on the GPU machine sets this (and a bigger
# HIDDEN / SEQ / MIN_BYTES) before calling them.
DEVICE = torch.device("cpu")




def _decoder_kwargs(layers):
    return dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=HIDDEN // 4,
                max_position_embeddings=max(64, SEQ), pad_token_id=0, bos_token_id=1, eos_token_id=2)


FAMILIES = {
    "llama": lambda n: transformers.LlamaForCausalLM(transformers.LlamaConfig(**_decoder_kwargs(n))),
    "qwen2": lambda n: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_decoder_kwargs(n))),
    "mistral": lambda n: transformers.MistralForCausalLM(
        transformers.MistralConfig(**_decoder_kwargs(n), sliding_window=8)),
    "gemma2": lambda n: transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(**_decoder_kwargs(n), query_pre_attn_scalar=HIDDEN // 4, sliding_window=8)),
    "gemma3": lambda n: transformers.Gemma3ForCausalLM(
        transformers.Gemma3TextConfig(**_decoder_kwargs(n), query_pre_attn_scalar=HIDDEN // 4, sliding_window=8)),
    "phi3": lambda n: transformers.Phi3ForCausalLM(transformers.Phi3Config(**_decoder_kwargs(n))),
    "gpt2": lambda n: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=HIDDEN, n_layer=n, n_head=4, n_inner=2 * HIDDEN, n_positions=max(64, SEQ),
        bos_token_id=1, eos_token_id=2)),  # Conv1D weights, fused qkv (saved views with offsets), dropout 0.1
}


def _model(family, dtype=torch.float32, layers=3, seed=0):
    torch.manual_seed(seed)
    model = FAMILIES[family](layers).to(DEVICE, dtype)
    with torch.no_grad():  # outlier channels, as trained models have
        emb = model.get_input_embeddings().weight
        emb[:, [3, 17]] *= 25
    return model.train()


def _enable_checkpointing(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


class Engine:
    """What wrap() will assemble: hooks, pager and offloader over one arena and one pair of streams."""

    def __init__(self, model, *, slots=2, prefetch=1, min_bytes=MIN_BYTES, blocks=None, param_filter=None,
                 offload=True):
        self.blocks = blocks if blocks is not None else find_blocks(model)
        self.hooks = BlockHooks(self.blocks)
        self.streams = TransferStreams(DEVICE)
        self.arena = HostArena(slab_bytes="8MiB")  # pinned when there is a GPU
        self.pager = WeightPager(self.hooks, self.streams, self.arena, slots=slots, prefetch=prefetch,
                                 param_filter=param_filter)
        self.offloader = (ActivationOffloader(self.hooks, self.streams, self.arena, min_bytes=min_bytes)
                          if offload else None)

    def close(self):
        if self.offloader is not None:
            self.offloader.close()
        self.pager.unwrap()
        self.hooks.remove()


def _batch(step, batch=2, seq=None):
    seq = seq or SEQ
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(3, VOCAB, (batch, seq), generator=g)
    labels = ids.clone()
    labels[torch.rand(batch, seq, generator=g) < 0.2] = -100
    return ids.to(DEVICE), labels.to(DEVICE)


def _loss(model, step, **kw):
    ids, labels = _batch(step, **kw)
    torch.manual_seed(step)  # the same dropout masks in both models
    return model(input_ids=ids, labels=labels, use_cache=False).loss


def _sgd(model, pager=None, lr=0.05):
    """``w -= lr * grad``, computed on the host for every parameter (on a GPU too), so both models round
    alike; a paged weight is updated in its host copy."""
    paged = {id(p) for p in pager.paged_parameters()} if pager is not None else set()
    if pager is not None:
        pager.wait_copies()  # no copy may still read a host buffer that is about to change
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is None:
                continue
            if id(p) in paged:
                pager.host_tensor(p).add_(p.grad.cpu(), alpha=-lr)
            else:
                w = p.data.cpu()  # the tensor itself on the CPU
                w.add_(p.grad.cpu(), alpha=-lr)
                p.data.copy_(w)
            p.grad = None


def _assert_step_equal(model, ref, step, engine, **kw):
    loss = _loss(model, step, **kw)
    ref_loss = _loss(ref, step, **kw)
    loss.backward()
    ref_loss.backward()
    assert torch.equal(loss, ref_loss), (step, loss.item(), ref_loss.item())
    del loss
    if engine.offloader is not None:
        assert engine.offloader.stats()["live"] == 0  # the backward released every host and device copy
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        r = ref_params[name]
        assert (p.grad is None) == (r.grad is None), name
        if p.grad is not None:
            assert p.grad.shape == r.grad.shape and p.grad.stride() == r.grad.stride(), name
            assert torch.equal(p.grad, r.grad), f"step {step}: gradient of {name} differs"
    _sgd(model, engine.pager)
    _sgd(ref)


def _assert_unwrapped_equal(engine, model, ref):
    engine.close()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p.data, ref_params[name].data) and p.stride() == ref_params[name].stride(), name
    for block in engine.blocks:
        assert not block._forward_hooks and not block._forward_pre_hooks
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ckpt"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_paged_training_is_bit_exact(family, dtype, checkpointing):
    model = _model(family, dtype)
    if checkpointing:
        _enable_checkpointing(model)
    ref = copy.deepcopy(model)
    engine = Engine(model)
    assert engine.pager.paged_blocks == [0, 1, 2]
    for step in range(5):
        _assert_step_equal(model, ref, step, engine)
    pstats, ostats = engine.pager.stats(), engine.offloader.stats()
    assert pstats["h2d_copies"] > 0 and pstats["reused_backward"] == 2 * 5  # S=2: both resident blocks
    assert ostats["offloaded"] > 0 and ostats["d2h_bytes"] > 0 and ostats["h2d_bytes"] == ostats["d2h_bytes"]
    if not checkpointing:
        assert ostats["kept_small"] > 0 and ostats["kept_small_bytes"] > 0  # the small ones stayed
        assert pstats["weight_refs"] > 0  # saved weights (and views of them) went by reference
    _assert_unwrapped_equal(engine, model, ref)


def test_slots_and_prefetch_depth():
    """S=3, P=2 over 4 blocks: at block i's forward, i+1 and i+2 are already resident; 3 blocks reused."""
    model = _model("llama", layers=4)
    ref = copy.deepcopy(model)
    engine = Engine(model, slots=3, prefetch=2)
    pager, seen = engine.pager, []

    def check(i):
        def pre(module, args):
            resident = [j for j in range(4) if pager.is_resident(j)]
            assert len(resident) <= 3
            assert all(pager.is_resident(j) for j in range(i, min(i + 3, 4))), (i, resident)
            seen.append(i)
        return pre

    handles = [block.register_forward_pre_hook(check(i)) for i, block in enumerate(engine.blocks)]
    before = pager.stats()
    _assert_step_equal(model, ref, 0, engine)
    s = pager.stats()
    assert seen == [0, 1, 2, 3]
    assert s["loads_forward"] - before["loads_forward"] == 4
    assert s["reused_backward"] == 3 and s["loads_backward"] == 1
    assert s["h2d_copies"] == 5 and s["slots"] == 3
    assert s["h2d_bytes"] == 5 * s["paged_bytes"] // 4  # identical blocks
    for step in range(1, 3):
        _assert_step_equal(model, ref, step, engine)
    for h in handles:
        h.remove()
    _assert_unwrapped_equal(engine, model, ref)


def test_params_are_empty_between_uses():
    model = _model("qwen2", layers=4)
    engine = Engine(model)
    layers, checks = engine.blocks.layers, []

    def forward_check(module, args):  # block 3 runs: blocks 0 and 1 have left the device
        assert all(p.numel() == 0 for i in (0, 1) for p in layers[i].parameters())
        assert all(p.numel() > 0 for p in layers[3].parameters())
        checks.append("forward")

    def backward_check(grad):  # block 0's backward is next: block 3 has left, block 0 is back
        assert all(p.numel() == 0 for p in layers[3].parameters())
        assert all(p.numel() > 0 for p in layers[0].parameters())
        checks.append("backward")

    def on_output(module, args, out):
        out.register_hook(backward_check)

    handles = [layers[3].register_forward_pre_hook(forward_check), layers[0].register_forward_hook(on_output)]
    _loss(model, 0).backward()
    assert checks == ["forward", "backward"]
    for h in handles:
        h.remove()
    ref = _model("qwen2", layers=4)  # same seed: the initial weights
    for p in model.parameters():
        p.grad = None
    _assert_unwrapped_equal(engine, model, ref)  # never trained


def test_exception_in_forward_and_backward_recovers():
    model = _model("llama")
    ref = copy.deepcopy(model)
    engine = Engine(model)
    armed = {"forward": False, "backward": False, "interrupt": False}

    def boom_forward(module, args, output):
        if armed["forward"]:
            raise RuntimeError("boom in forward")
        if armed["interrupt"]:
            raise KeyboardInterrupt  # a BaseException: the always_call hook does not run

    def boom_backward(module, args, output):
        if armed["backward"]:
            output.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom in backward")))

    model.model.layers[1].mlp.register_forward_hook(boom_forward)
    boom_handle = model.model.layers[1].register_forward_hook(boom_backward)
    _assert_step_equal(model, ref, 0, engine)
    armed["forward"] = True
    with pytest.raises(RuntimeError, match="boom in forward"):
        _loss(model, 1)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # no context left pushed
    armed["forward"], armed["interrupt"] = False, True
    with pytest.raises(KeyboardInterrupt):
        _loss(model, 1)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is not None  # left pushed...
    armed["interrupt"], armed["backward"] = False, True  # ...until block 0's next forward pops it
    loss = _loss(model, 2)
    with pytest.raises(RuntimeError, match="boom in backward"):
        loss.backward()
    del loss
    armed["backward"] = False
    for p in model.parameters():  # the failed backward accumulated part of the gradients
        p.grad = None
    for step in range(3, 6):
        _assert_step_equal(model, ref, step, engine)
    armed["forward"] = True  # fails mid-step, then unwraps with the weights intact
    with pytest.raises(RuntimeError, match="boom in forward"):
        _loss(model, 6)
    boom_handle.remove()
    _assert_unwrapped_equal(engine, model, ref)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # peft calls a deprecated transformers alias
def test_peft_lora_on_a_paged_frozen_base():
    peft = pytest.importorskip("peft")
    base = _model("llama", layers=4)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                                      lora_dropout=0.0, init_lora_weights=False))
    blocks = find_blocks(model)
    assert blocks.name == "base_model.model.model.layers"
    assert blocks.layers == tuple(base.model.layers)
    ref = copy.deepcopy(model)
    # The frozen base is paged; the small trainable LoRA weights stay on the device with their optimizer.
    engine = Engine(model, blocks=blocks, param_filter=lambda name, p: not p.requires_grad)
    assert all(not p.requires_grad for p in engine.pager.paged_parameters())
    loads = []
    for step in range(4):
        before = engine.pager.stats()["loads_forward"]
        _assert_step_equal(model, ref, step, engine)
        loads.append(engine.pager.stats()["loads_forward"] - before)
    assert loads == [4, 2, 2, 2]  # frozen blocks left resident by backward are reused by the next forward
    _assert_unwrapped_equal(engine, model, ref)


@pytest.mark.parametrize("trainable", [False, True], ids=["frozen", "trainable"])
def test_two_forwards_one_backward(trainable):
    """Like DPO's chosen/rejected passes: the second forward moves blocks to other slots than the first
    used (frozen blocks stay resident across forwards), so the first graph's saved weight views are only
    right because they were packed as references."""
    model = _model("mistral")
    if not trainable:
        for name, p in model.named_parameters():
            p.requires_grad_("layers" not in name or "mlp.down_proj" in name)
    ref = copy.deepcopy(model)
    engine = Engine(model, param_filter=lambda name, p: trainable or not p.requires_grad)
    for step in range(3):
        losses = [_loss(m, step) + _loss(m, step + 10) for m in (model, ref)]
        for loss in losses:
            loss.backward()
        assert torch.equal(*losses)
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            if p.grad is not None or ref_params[name].grad is not None:
                assert torch.equal(p.grad, ref_params[name].grad), name
        _sgd(model, engine.pager)
        _sgd(ref)
    _assert_unwrapped_equal(engine, model, ref)


def test_gradient_accumulation_reuses_resident_blocks():
    """refresh_trainable=False: micro-batches reuse the blocks the previous backward left resident; the
    caller invalidates after the optimizer step."""
    model = _model("phi3", layers=4)
    ref = copy.deepcopy(model)
    engine = Engine(model)
    engine.pager.refresh_trainable = False
    for step in range(2):
        loads = []
        for micro in range(3):
            before = engine.pager.stats()["loads_forward"]
            for m in (model, ref):
                _loss(m, 10 * step + micro).backward()
            loads.append(engine.pager.stats()["loads_forward"] - before)
        assert loads == [4, 2, 2]
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            assert torch.equal(p.grad, ref_params[name].grad), name
        _sgd(model, engine.pager)
        _sgd(ref)
        engine.pager.invalidate()
    _assert_unwrapped_equal(engine, model, ref)


def test_an_outer_saved_tensors_context_still_gets_what_the_engine_leaves():
    model = _model("qwen2")
    ref = copy.deepcopy(model)
    engine = Engine(model, min_bytes=1 << 30)  # the offloader claims nothing; the pager claims the weights
    seen = {"pack": 0, "unpack": 0}

    def pack(t):
        seen["pack"] += 1
        return t.clone()

    def unpack(t):
        seen["unpack"] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss = _loss(model, 0)
    loss.backward()
    ref_loss = _loss(ref, 0)
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    ref_params = dict(ref.named_parameters())
    assert all(torch.equal(p.grad, ref_params[n].grad) for n, p in model.named_parameters())
    assert seen["pack"] > 0 and seen["unpack"] == seen["pack"]
    assert engine.pager.stats()["weight_refs"] > 0
    _assert_unwrapped_equal(engine, model, ref)


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class _Stack(nn.Module):
    """Checkpoints ``block.__call__``: the module hooks run inside the checkpoint (older transformers)."""

    def __init__(self, d=32, n=3, reentrant=False):
        super().__init__()
        self.layers = nn.ModuleList(_Block(d) for _ in range(n))
        self.head = nn.Linear(d, 1)
        self.reentrant = reentrant

    def forward(self, x):
        for block in self.layers:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x).square().mean()


def _assert_backward_equal(model, ref, x, loss_of):
    """One forward and backward of both models from the same input: equal losses, input and parameter gradients."""
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    loss, ref_loss = loss_of(model(xs[0])), loss_of(ref(xs[1]))
    loss.backward()
    ref_loss.backward()
    assert torch.equal(loss, ref_loss) and torch.equal(xs[0].grad, xs[1].grad)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, ref_params[name].grad), name


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpoint_around_module_call(reentrant):
    torch.manual_seed(0)
    model = _Stack(reentrant=reentrant).to(DEVICE)
    ref = copy.deepcopy(model)
    blocks = find_blocks(model)
    assert blocks.name == "layers"
    engine = Engine(model, blocks=blocks, min_bytes=256)
    for step in range(3):
        x = (torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(step)) * 3).to(DEVICE)
        _assert_backward_equal(model, ref, x, lambda out: out)
        _sgd(model, engine.pager)
        _sgd(ref)
    assert engine.pager.stats()["reused_backward"] > 0
    _assert_unwrapped_equal(engine, model, ref)


def test_find_blocks_errors_and_override():
    with pytest.raises(ValueError, match="no repeated blocks"):
        find_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    model = _model("gpt2", layers=2)
    blocks = find_blocks(model)
    assert blocks.name == "transformer.h" and len(blocks) == 2 and isinstance(blocks, Blocks)
    assert find_blocks(model, path="transformer.h").layers == blocks.layers
    with pytest.raises(ValueError, match="not a non-empty nn.ModuleList"):
        find_blocks(model, path="transformer.wte")


def test_argument_validation():
    model = _model("llama", layers=2)
    hooks = BlockHooks(find_blocks(model))
    streams, arena = TransferStreams("cpu"), HostArena(pinned=False, slab_bytes="8MiB")
    with pytest.raises(ValueError, match="prefetch must be in"):
        WeightPager(hooks, streams, arena, slots=2, prefetch=2)
    with pytest.raises(ValueError, match="slots must be"):
        WeightPager(hooks, streams, arena, slots=0, prefetch=0)
    with pytest.raises(ValueError, match="block indices"):
        ActivationOffloader(hooks, streams, arena, blocks=[5])
    hooks.remove()
    assert all(p.numel() > 0 for p in model.parameters())  # nothing was paged


def test_failed_construction_gives_the_paged_blocks_back():
    """Blocks are freed as soon as they are copied; if a later block cannot be copied (here: a fixed arena
    that runs out), the ones already paged get their values back."""
    from trainstream_hf.engine.arena import ArenaExhaustedError
    model = _model("llama", layers=3)
    before = [p.detach().clone() for p in model.parameters()]
    one_block = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    arena = HostArena(size=2 * 2**20 if one_block < 2**20 else one_block + 2**20, pinned=False,
                      slab_bytes="2MiB")
    arena.reserve(0)
    hooks = BlockHooks(find_blocks(model))
    filler = arena.empty([arena.stats()["largest_free"] - one_block - 4096], torch.uint8)  # room for ~1 block
    with pytest.raises(ArenaExhaustedError):
        WeightPager(hooks, TransferStreams("cpu"), arena, slots=2, prefetch=1)
    hooks.remove()
    del filler
    for p, q in zip(before, model.parameters()):
        assert torch.equal(p, q)


def test_saved_tensor_hooks_only_where_a_listener_packs():
    """Block hooks push saved-tensor hooks around a block only while a listener takes saved tensors (paging,
    offload); with listeners that only hear forward / backward they push nothing (a Python call per saved tensor
    for nothing), and the block saves as plain torch does."""
    from trainstream_hf.engine.hooks import BlockListener, _top_hooks

    class Hear(BlockListener):
        def forward_start(self, i):
            seen.append(_top_hooks())

    class Take(Hear):
        def pack(self, i, tensor):
            return None  # declines every tensor, but asks to see them

    blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
    hooks = BlockHooks(blocks)
    seen = []

    def forward():
        x = torch.randn(3, 8, requires_grad=True)
        for b in blocks:
            x = b(x)
        return x

    try:
        hooks.add(Hear())
        y = forward()
        inner = []
        h = blocks[1].register_forward_pre_hook(lambda m, a: inner.append(_top_hooks()))  # runs after ours
        forward().sum().backward()
        h.remove()
        assert inner == [None] and len(seen) == 4  # nothing pushed around block 1; the listener heard both blocks
        y.sum().backward()
        take = Take()
        hooks.add(take)
        inner = []
        h = blocks[1].register_forward_pre_hook(lambda m, a: inner.append(_top_hooks()))  # runs after ours
        forward().sum().backward()
        h.remove()
        assert inner and inner[0] is not None  # pushed while a listener packs
        hooks.discard(take)
        inner = []
        h = blocks[1].register_forward_pre_hook(lambda m, a: inner.append(_top_hooks()))
        forward().sum().backward()
        h.remove()
        assert inner == [None]
    finally:
        hooks.remove()


class _ViewsBlock(nn.Module):
    """Saves one storage through three views (itself, a reshape and a transpose: each covers it), and a fresh
    tensor made after an earlier saved one is gone (its address may be the dead one's)."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d ** 0.5)

    def forward(self, x):
        h = torch.tanh(x)                                   # (b, t, d)
        a = h * h                                           # saves h (twice, the same tensor)
        flat = h.reshape(-1, h.shape[-1])                   # a view covering h's storage
        b = flat @ self.w                                   # saves flat
        c = (h.transpose(1, 2) * 2).sum()                   # multiplying by a constant saves nothing
        d_ = h.transpose(1, 2).sin()                        # saves the transposed view
        tmp = torch.cos(x) * 3                              # a temporary saved then dropped: its storage dies
        e = tmp.exp().sum()
        del tmp
        fresh = torch.sin(x) + 1                            # may land at tmp's address, same size, version 0
        f = fresh.exp()
        return a + b.view_as(h) + c + d_.transpose(1, 2) + e + f


class _ViewsStack(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.layers = nn.ModuleList(_ViewsBlock(d) for _ in range(n))

    def forward(self, x):
        for block in self.layers:
            x = block(x)
        return x


def test_views_of_one_storage_are_copied_once_and_a_reused_address_is_not_shared():
    torch.manual_seed(0)
    d, n = 64, 3
    model = _ViewsStack(d, n).to(DEVICE)
    ref = copy.deepcopy(model)
    blocks = find_blocks(model)
    engine = Engine(model, blocks=blocks, min_bytes=0)
    for step in range(2):
        x = torch.randn(2, 16, d, generator=torch.Generator().manual_seed(step)).to(DEVICE)
        _assert_backward_equal(model, ref, x, lambda out: out.square().mean())
        model.zero_grad()
        ref.zero_grad()
    stats = engine.offloader.stats()
    # h's three views come back from one copy: per block, at least two saves are served by another's copy
    assert stats["deduplicated"] >= 2 * n * 2
    assert stats["live"] == 0
    engine.close()
