"""The plan says what will happen: the printed plan's paged blocks and bytes, and its offloaded optimizer state, are
what the engine then does (``model.trainstream_stats()``, the pager's parameters); a forced option that cannot move
anything (``page_weights=True`` where ``min_offload_numel`` keeps every parameter on the device,
``offload_activations=True`` where every saved tensor is below ``min_activation_bytes``) warns, naming the option to
change, and the plan shows those blocks on the device."""
import re
import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import trainstream_hf
from trainstream_hf import engine_of, planner
from trainstream_hf.engine.blocks import find_blocks

CFG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=100)
BUDGET = "8GiB"
HEADER = re.compile(r"^TrainStream plan: .*, (\d+) blocks paged \(([^)]*)\), (\d+) weight slots, .* optimizer state of "
                    r"(\d+) parameters")


def llama(frozen_base=False):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CFG))
    if frozen_base:  # only the norms train (a tiny stand-in for a LoRA model's frozen base)
        for n, p in model.named_parameters():
            p.requires_grad_("norm" in n)
    return model


def steps(model, opt, n=2):
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        ids = torch.randint(0, 100, (2, 12), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def header(pl) -> tuple[int, str, int, int]:
    m = HEADER.match(str(pl).splitlines()[0])
    assert m, str(pl).splitlines()[0]
    return int(m[1]), m[2], int(m[3]), int(m[4])


def ours(record, option):
    return [w for w in record if issubclass(w.category, RuntimeWarning) and f"{option}=True, but" in str(w.message)]


def test_page_weights_that_pages_nothing_warns_and_the_plan_says_zero():
    """A small fully trainable model: min_offload_numel (default 1M) keeps every matrix on the device."""
    model = llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.warns(RuntimeWarning, match=r"page_weights=True, but no block is paged \(all 2 stay on the device\): "
                                            r"min_offload_numel=1048576 .*lower min_offload_numel \(e.g. 0\)"):
        model, opt = trainstream_hf.wrap(model, opt, vram_budget=BUDGET, page_weights=True)
    try:
        pl = model.trainstream_plan
        assert header(pl)[:3] == (0, "0 B", 0) and pl.paged_blocks == [] and pl.paged_bytes() == 0
        assert all("| device |" in row for row in str(pl).splitlines()[3:5])
        steps(model, opt)
        assert engine_of(model).pager is None and model.trainstream_stats().get("weights") is None
    finally:
        trainstream_hf.unwrap(model)


def test_plan_warns_the_same():
    with pytest.warns(RuntimeWarning, match=r"page_weights=True, but no block is paged .*min_offload_numel=1048576"):
        pl = trainstream_hf.plan(llama(), (2, 12), vram_budget=BUDGET, page_weights=True)
    assert header(pl)[:2] == (0, "0 B")


@pytest.mark.parametrize("case", ["full, min_offload_numel=0", "frozen base, trainable norms"])
def test_printed_plan_matches_the_engine(case):
    """Every block paged: the header's block count and bytes are the pager's, its parameters are those the plan
    chose, and the offloaded optimizer state it announces is the optimizer's."""
    frozen = case.startswith("frozen")
    model = llama(frozen_base=frozen)
    options = {} if frozen else {"min_offload_numel": 0}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model, opt = trainstream_hf.wrap(model, opt, vram_budget=BUDGET, page_weights=True, **options)
    try:
        assert not ours(record, "page_weights")
        pl = model.trainstream_plan
        blocks = find_blocks(model)
        steps(model, opt)
        stats = model.trainstream_stats()
        weights = stats["weights"]
        n_paged, shown, slots, n_opt = header(pl)
        assert n_paged == len(pl.paged_blocks) == weights["paged_blocks"] == len(blocks)
        assert pl.paged_bytes() == weights["paged_bytes"] and shown == planner.format_bytes(weights["paged_bytes"])
        assert slots == pl.slots == weights["slots"]
        assert max(b.host_weight_bytes() for b in pl.blocks) == weights["slot_bytes"]
        # the parameters paged are exactly those the plan counted: frozen ones, and trainable ones it did not skip
        paged = engine_of(model).pager.paged_parameters()
        want = [p for i in pl.paged_blocks for p in blocks[i].parameters()
                if planner.pages_param(p, pl.min_offload_numel)]
        assert [id(p) for p in paged] == [id(p) for p in want] and paged
        assert all(not p.requires_grad for p in paged) == frozen
        # optimizer state of the paged trainable weights goes to the host: the plan says so
        names = {id(p): n for n, p in model.named_parameters()}
        offloaded = sorted(names[id(p)] for p in getattr(opt, "_slots", {}))
        assert n_opt == len(pl.offload_optimizer) == stats.get("optimizer", {}).get("offloaded_params", 0)
        assert sorted(pl.offload_optimizer) == offloaded
        assert (pl.grads == "host") == bool(offloaded)
    finally:
        trainstream_hf.unwrap(model)


def test_host_bytes_count_what_the_pager_lays_out():
    """Each paged parameter starts at an aligned offset of its block's host buffer, so the plan's host bytes (what the
    arena reserves) and slot size are the pager's, not the parameters' raw bytes."""
    model = llama().to(torch.bfloat16)  # a norm's weight is 128 bytes: the next parameter starts 128 bytes later
    pl = planner.plan(model, list(find_blocks(model)), batch_shape=(2, 12), vram_budget=BUDGET, device="cpu",
                      page_weights=True, min_offload_numel=0)
    raw = sum(p.numel() * p.element_size() for p in find_blocks(model)[0].parameters())
    assert pl.blocks[0].weight_bytes == raw
    assert raw < pl.blocks[0].host_weight_bytes() < raw + 256 * 9
    assert pl.host_bytes() >= pl.paged_bytes() == 2 * pl.blocks[0].host_weight_bytes()


def test_forced_activation_offload_that_moves_nothing_warns_in_the_planner():
    """Every saved tensor of this tiny block is below the offloader's min_bytes (default 1 MiB): nothing would move.
    The plan keeps the activations on the device and says why; with min_activation_bytes=0 they go."""
    model = llama()
    blocks = list(find_blocks(model))
    m = planner.measure_block(model, blocks[1], (2, 12), torch.device("cpu"))
    assert m.saved_sizes and sum(m.saved_sizes) == m.activation_bytes and max(m.saved_sizes) < 1 << 20
    kw = dict(batch_shape=(2, 12), vram_budget=BUDGET, device="cpu", offload_activations=True,
              activation_bytes=m.activation_bytes, activation_sizes=m.saved_sizes)
    want = (r"offload_activations=True, but no activation would move to the host: every saved tensor of a block is "
            rf"smaller than min_activation_bytes=1048576 \(the largest: {max(m.saved_sizes)} bytes\)")
    with pytest.warns(RuntimeWarning, match=want):
        pl = planner.plan(model, blocks, min_activation_bytes=1 << 20, **kw)
    assert pl.offloaded_activation_blocks == []
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        pl = planner.plan(model, blocks, min_activation_bytes=0, **kw)
    assert pl.offloaded_activation_blocks == [0, 1]
    frozen = llama(frozen_base=True).requires_grad_(False)
    with pytest.warns(RuntimeWarning, match="the blocks save no activations for backward"):
        pl = planner.plan(frozen, list(find_blocks(frozen)), activation_bytes=0, batch_shape=(2, 12),
                          vram_budget=BUDGET, device="cpu", offload_activations=True)
    assert pl.offloaded_activation_blocks == []


@pytest.mark.parametrize("min_activation_bytes", ["1MiB", 0])
def test_forced_activation_offload_through_wrap_matches_the_offloader(min_activation_bytes):
    """Through wrap, planned for the batches it then trains on: the plan offloads a block's activations exactly when
    the offloader then moves some."""
    model = llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model, opt = trainstream_hf.wrap(model, opt, vram_budget=BUDGET, offload_activations=True, batch_shape=(2, 12),
                                         min_activation_bytes=min_activation_bytes)
    try:
        pl = model.trainstream_plan
        steps(model, opt)
        acts = model.trainstream_stats().get("activations") or {}
        moved = acts.get("d2h_bytes", 0)
        if min_activation_bytes:
            assert [str(w.message) for w in ours(record, "offload_activations")], "no warning"
            assert pl.offloaded_activation_blocks == [] and moved == 0
        else:
            assert not ours(record, "offload_activations")
            assert pl.offloaded_activation_blocks == [0, 1] and moved > 0
    finally:
        trainstream_hf.unwrap(model)
