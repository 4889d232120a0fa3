"""planner: measured activation bytes, the placement decisions for a budget, the predicted peak, budgets.

Budgets are built from the model's own plan (its predicted peak, one block's weights or activations), so
the tests hold whatever the estimates' constants are; what they pin down is the order of decisions and the
contract of ``predicted_peak``.
"""
import copy
import re

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from trainstream_hf import planner
from trainstream_hf.config import TrainStreamConfig, parse_bytes
from trainstream_hf.engine.blocks import find_blocks
from trainstream_hf.planner import GiB, BudgetError, format_bytes

CPU = torch.device("cpu")
SHAPE = (1, 128)
HUGE = 1 << 50  # a budget nothing needs




def _llama(dtype=torch.float32, layers=4, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).to(dtype)


def _ids(b=2, t=32, seed=7):
    return torch.randint(0, 128, (b, t), generator=torch.Generator().manual_seed(seed))


def _saved_tensor_hooks_installed() -> bool:
    # No public accessor: the top of autograd's thread-local saved-tensors-hooks stack (None when empty).
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def _plan(model, **kw):
    kw.setdefault("vram_budget", HUGE)
    kw.setdefault("batch_shape", SHAPE)
    return planner.plan(model, list(find_blocks(model)), device=CPU, **kw)


# -- measure_activation_bytes -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_measured_activations_scale_with_tokens(dtype):
    model = _llama(dtype)
    block = find_blocks(model)[0]
    one = planner.measure_activation_bytes(model, block, (1, 128), CPU)
    assert one > 0
    # Not smaller than the analytic count of the block's saved tensors (which leaves out LoRA, masks, rope).
    assert one >= planner.activation_bytes_per_token(model.config, dtype.itemsize) * 128 * 0.9
    for shape in [(1, 256), (2, 128)]:
        two = planner.measure_activation_bytes(model, block, shape, CPU)
        assert 1.8 <= two / one <= 2.2, (shape, one, two)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_measured_activations_follow_what_trains(dtype):
    """Frozen base: no graph, nothing saved. Norms trainable: some. LoRA adds its adapters' inputs."""
    frozen = _llama(dtype)
    frozen.requires_grad_(False)
    assert planner.measure_activation_bytes(frozen, find_blocks(frozen)[0], SHAPE, CPU) == 0

    norms = _llama(dtype)
    for n, p in norms.named_parameters():
        p.requires_grad_("norm" in n)
    with_norms = planner.measure_activation_bytes(norms, find_blocks(norms)[0], SHAPE, CPU)

    base = _llama(dtype)
    for n, p in base.named_parameters():
        p.requires_grad_("norm" in n)
    lora = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0))
    for n, p in lora.named_parameters():  # same base trainables as `norms`, plus the adapters
        if "norm" in n:
            p.requires_grad_(True)
    with_lora = planner.measure_activation_bytes(lora, find_blocks(lora)[0], SHAPE, CPU)
    assert 0 < with_norms < with_lora, (with_norms, with_lora)


def test_measuring_leaves_the_model_as_it_was():
    model = _llama()
    ref = copy.deepcopy(model)
    blocks = find_blocks(model)
    assert not blocks[0]._forward_hooks and not blocks[0]._forward_pre_hooks
    rng = torch.get_rng_state()
    assert planner.measure_activation_bytes(model, blocks[0], SHAPE, CPU) > 0
    assert torch.equal(rng, torch.get_rng_state())  # the user's seeded run is not perturbed
    for b in blocks:
        assert not b._forward_hooks and not b._forward_pre_hooks
    assert not _saved_tensor_hooks_installed()
    ids = _ids()
    la = model(input_ids=ids, labels=ids).loss
    lb = ref(input_ids=ids, labels=ids).loss
    assert torch.equal(la, lb)
    la.backward()
    lb.backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_measuring_cleans_up_when_the_block_raises():
    model = _llama()
    block = find_blocks(model)[0]

    def boom(module, args, out):
        raise RuntimeError("boom")

    h = block.mlp.register_forward_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            planner.measure_activation_bytes(model, block, SHAPE, CPU)
    finally:
        h.remove()
    assert not block._forward_hooks and not block._forward_pre_hooks
    assert not _saved_tensor_hooks_installed()


# -- plan(): decisions for a budget ------------------------------------------------------------------------
def test_generous_budget_moves_nothing():
    model = _llama()
    pl = _plan(model)
    assert pl.fits()
    assert pl.offload_optimizer == [] and pl.offload_numel == 0 and pl.grads == "device"
    assert pl.paged_blocks == [] and pl.offloaded_activation_blocks == []
    assert pl.slots == 0 and pl.pcie_bytes() == 0
    # Exactly enough is still enough (fits is <=).
    tight = _plan(model, vram_budget=pl.predicted_peak() + pl.margin)
    assert tight.paged_blocks == [] and tight.offloaded_activation_blocks == []


def _assert_minimal_prefix(pl, attr, place="host"):
    moved = [b.index for b in pl.blocks if getattr(b, attr) == place]
    assert moved == list(range(len(moved))), moved  # the first blocks first
    assert pl.fits()
    # Minimal: with the last moved block back on the device the plan would not fit.
    back = copy.deepcopy(pl)
    setattr(back.blocks[len(moved) - 1], attr, "device")
    if attr == "weights" and len(moved) == 1:
        back.slots = 0
    assert not back.fits()
    return moved


def test_budget_fitting_weights_but_not_activations_offloads_first_activations():
    model = _llama()
    full = _plan(model, offload_optimizer=False)
    a = full.blocks[0].activation_bytes
    budget = full.margin + full.predicted_peak() - a
    pl = _plan(model, vram_budget=budget, offload_optimizer=False)
    moved = _assert_minimal_prefix(pl, "activations")
    assert 0 < len(moved) < len(pl.blocks)
    assert pl.paged_blocks == [] and pl.slots == 0


def test_smaller_budget_pages_weights_too():
    model = _llama()
    # Without recompute the activations of every block go to the host first, then the first blocks' weights.
    # (min_offload_numel=0: by default paging leaves this tiny model's trainable matrices on the device.)
    acts_out = _plan(model, offload_optimizer=False, offload_activations=True, min_offload_numel=0)
    w = acts_out.blocks[0].weight_bytes
    budget = acts_out.margin + acts_out.predicted_peak() - w
    pl = _plan(model, vram_budget=budget, offload_optimizer=False, slots=2, prefetch=0, recompute=False,
               min_offload_numel=0)
    assert pl.offloaded_activation_blocks == list(range(len(pl.blocks)))
    moved = _assert_minimal_prefix(pl, "weights")
    assert 0 < len(moved) < len(pl.blocks)
    assert (pl.slots, pl.prefetch) == (2, 0)


def test_paged_plan_recomputes_instead_of_offloading_activations():
    """Once weights are paged the H2D link is the bottleneck: activations are recomputed, not sent over it, and
    the budget left after paging goes to the last blocks' activations."""
    model = _llama(layers=6)
    recomputed = _plan(model, offload_optimizer=False, recompute=True, min_offload_numel=0)
    w = recomputed.blocks[0].weight_bytes
    budget = recomputed.margin + recomputed.predicted_peak() - w
    pl = _plan(model, vram_budget=budget, offload_optimizer=False, slots=2, prefetch=0, min_offload_numel=0)
    assert pl.offloaded_activation_blocks == []
    moved = _assert_minimal_prefix(pl, "weights")
    assert 0 < len(moved) < len(pl.blocks)
    # Every block is recomputed but a suffix that is kept whole; one more kept block would not fit.
    kept = [b.index for b in pl.blocks if b.activations == "device"]
    assert kept == list(range(len(pl.blocks) - len(kept), len(pl.blocks)))
    assert pl.recomputed_blocks == list(range(len(pl.blocks) - len(kept)))
    more = copy.deepcopy(pl)
    more.blocks[len(pl.blocks) - len(kept) - 1].activations = "device"
    assert not more.fits()
    # Fewer bytes over PCIe than the same budget with activations offloaded (recompute=False).
    offloading = _plan(model, vram_budget=budget, offload_optimizer=False, slots=2, prefetch=0, recompute=False,
                       min_offload_numel=0)
    assert pl.pcie_bytes() < offloading.pcie_bytes()


def test_paged_plan_needs_no_more_than_the_offload_layout():
    """At the budget of the offload-everything, page-everything layout the auto plan fits, with no more PCIe
    traffic (here recomputing every block fits without paging at all: it never holds two blocks' activations)."""
    model = _llama()
    lowest = _plan(model, offload_optimizer=False, offload_activations=True, page_weights=True, min_offload_numel=0)
    pl = _plan(model, vram_budget=lowest.predicted_peak() + lowest.margin, offload_optimizer=False,
               min_offload_numel=0)
    assert pl.fits() and pl.pcie_bytes() <= lowest.pcie_bytes()
    assert pl.predicted_peak() <= lowest.predicted_peak()


def test_below_the_minimum_raises_with_the_minimum():
    model = _llama()
    kw = dict(min_offload_numel=1000)
    lowest = [_plan(model, offload_optimizer=True, grads="host", page_weights=True, **acts, **kw)
              for acts in (dict(offload_activations=True), dict(offload_activations=False, recompute=True),
                           dict(offload_activations=True, recompute=True))]  # the last: inputs in host RAM
    minimum = min(p.predicted_peak() for p in lowest) + lowest[0].margin
    assert minimum < _plan(model, **kw).predicted_peak() + lowest[0].margin  # offloading buys something
    at = _plan(model, vram_budget=minimum, **kw)  # exactly the minimum fits
    assert at.fits() and at.predicted_peak() + at.margin == minimum
    with pytest.raises(BudgetError, match="below the minimum") as e:
        _plan(model, vram_budget=minimum - 1, **kw)
    # The least budget is rounded up, never down: asking for the figure the message names fits.
    asked = re.search(r"raise vram_budget to at least ([0-9.]+ [KMG]iB)", str(e.value)).group(1)
    assert asked == format_bytes(minimum, up=True) and parse_bytes(asked.replace(" ", "")) >= minimum
    assert _plan(model, vram_budget=asked.replace(" ", ""), **kw).fits()
    assert f"plus {format_bytes(lowest[0].margin)} kept free" in str(e.value)
    assert "| block |" in str(e.value)  # the table of the plan that did not fit


def test_format_bytes_rounds_a_least_amount_up():
    assert format_bytes(GiB) == format_bytes(GiB, up=True) == "1.00 GiB"
    assert format_bytes(GiB + 1) == "1.00 GiB" and format_bytes(GiB + 1, up=True) == "1.01 GiB"
    assert format_bytes(int(9.996 * GiB), up=True) == "10.0 GiB"  # one digit past 10, as when rounded down
    assert format_bytes(24 * GiB, up=True) == "24.0 GiB" and format_bytes(1500, up=True) == "1.47 KiB"
    assert format_bytes(900, up=True) == "900 B"


def test_offload_optimizer_lists_every_large_trainable_parameter():
    model = _llama()
    min_numel = 2000
    pl = _plan(model, offload_optimizer=True, min_offload_numel=min_numel)
    big = {n: p.numel() for n, p in model.named_parameters() if p.numel() >= min_numel}
    assert sorted(pl.offload_optimizer) == sorted(big)
    assert any(p.numel() < min_numel for p in model.parameters())  # norms stay with the device optimizer
    assert pl.offload_numel == sum(big.values())
    kept = _plan(model, offload_optimizer=False, min_offload_numel=min_numel)
    assert kept.offload_optimizer == [] and kept.offload_numel == 0
    assert pl.fixed_bytes < kept.fixed_bytes
    # Frozen parameters have no optimizer state to offload.
    model.lm_head.requires_grad_(False)
    assert "lm_head.weight" not in _plan(model, offload_optimizer=True, min_offload_numel=min_numel).offload_optimizer


def test_host_grads_hold_fewer_bytes_on_the_device():
    model = _llama()
    kw = dict(offload_optimizer=True, min_offload_numel=2000)
    dev = _plan(model, grads="device", **kw)
    host = _plan(model, grads="host", **kw)
    assert (dev.grads, host.grads) == ("device", "host")
    assert host.grad_bytes < dev.grad_bytes
    assert dev.grad_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    # Without optimizer offload there is nothing to move the gradients for.
    assert _plan(model, offload_optimizer=False, grads="host").grads == "device"


def test_paged_trainable_weights_plan_host_grads():
    # wrap() sends a paged trainable weight's gradient to its host master, so the plan counts host gradients
    # even when device gradients would have fitted before paging.
    model = _llama()
    kw = dict(offload_optimizer=True, min_offload_numel=2000, page_weights=True)
    pl = _plan(model, **kw)
    assert pl.paged_blocks and pl.grads == "host"
    assert pl.grad_bytes == _plan(model, grads="host", **kw).grad_bytes
    # A frozen paged base (LoRA) has no such gradients: device gradients stay.
    for p in model.model.layers.parameters():
        p.requires_grad_(False)
    assert _plan(model, **kw).grads == "device"


@pytest.mark.parametrize("slots,prefetch", [(2, 2), (1, 1), (2, 3)])
def test_prefetch_must_be_below_slots(slots, prefetch):
    with pytest.raises(ValueError, match="prefetch"):
        _plan(_llama(), page_weights=True, slots=slots, prefetch=prefetch)


def test_activation_bytes_override_is_used_in_every_block():
    model = _llama()
    estimate = _plan(model)
    override = 3 * estimate.blocks[0].activation_bytes + 12345
    pl = _plan(model, activation_bytes=override)
    assert [b.activation_bytes for b in pl.blocks] == [override] * len(pl.blocks)
    assert pl.predicted_peak() > estimate.predicted_peak()
    zero = _plan(model, activation_bytes=0)  # a frozen model's measurement
    assert all(b.activation_bytes == 0 for b in zero.blocks)


def test_predicted_peak_contract():
    """Moving a block to the host never raises the peak, except the first one: the first offloaded block may
    add its transient (two blocks' activations on the device at a time: at most one block more than it
    saves) and the first paged block adds the weight ring (slots x the largest paged block in the pager's layout,
    less the block's own device bytes)."""
    model = _llama(layers=6)
    base = _plan(model, offload_optimizer=False, min_offload_numel=0)
    a = max(b.activation_bytes for b in base.blocks)
    pl = copy.deepcopy(base)
    peaks = [pl.predicted_peak()]
    for b in pl.blocks:
        b.activations = "host"
        peaks.append(pl.predicted_peak())
    assert peaks[1] - peaks[0] <= a
    assert all(q <= p for p, q in zip(peaks[1:], peaks[2:])), peaks
    assert peaks[-1] < peaks[0]

    pl.slots = 2
    w, h = pl.blocks[0].weight_bytes, pl.blocks[0].host_weight_bytes()
    assert w <= h < w + 256 * sum(1 for _ in find_blocks(model)[0].parameters())  # aligned offsets, as the pager's
    peaks = [pl.predicted_peak()]
    for b in pl.blocks:
        b.weights = "host"
        peaks.append(pl.predicted_peak())
    assert peaks[1] - peaks[0] == pl.slots * h - w
    assert all(q <= p for p, q in zip(peaks[1:], peaks[2:])), peaks
    assert peaks[-1] < peaks[0]

    # Optimizer state in host RAM lowers it; so do gradients in host RAM once the end of backward is the
    # peak (a short sequence: gradients outweigh the activations).
    for shape, lower in [(SHAPE, "<="), ((1, 2), "<")]:
        kw = dict(min_offload_numel=2000, batch_shape=shape)
        host = _plan(model, offload_optimizer=True, grads="host", **kw).predicted_peak()
        dev = _plan(model, offload_optimizer=True, grads="device", **kw).predicted_peak()
        kept = _plan(model, offload_optimizer=False, **kw).predicted_peak()
        assert dev < kept and (host < dev if lower == "<" else host <= dev), (shape, host, dev, kept)


def test_plan_str_has_header_and_a_row_per_block():
    model = _llama(layers=5)
    pl = _plan(model, offload_activations=True, page_weights=True, min_offload_numel=0)
    lines = str(pl).splitlines()
    assert lines[0].startswith("TrainStream plan: budget ") and "predicted peak" in lines[0]
    assert lines[1] == "| block | weights | MiB | activations | MiB | PCIe MiB/step | est. ms |"
    rows = [ln for ln in lines if ln.startswith("| ") and ln.split("|")[1].strip().isdigit()]
    assert [int(r.split("|")[1]) for r in rows] == list(range(5))
    assert all("| host |" in r for r in rows)
    assert lines[-1].startswith("non-block weights")


def test_paged_trainable_weights_put_their_optimizer_state_on_the_host():
    """wrap steps paged trainable weights on the host whatever the plan chose, so with offload_optimizer='auto' the plan
    lists exactly those (and host gradients); forced True lists every large trainable parameter."""
    model = _llama()
    blocks = find_blocks(model)
    pl = _plan(model, page_weights=True, min_offload_numel=0)
    assert pl.paged_blocks == list(range(len(blocks)))
    names = {id(p): n for n, p in model.named_parameters()}
    assert pl.offload_optimizer == [names[id(p)] for b in blocks for p in b.parameters()]
    assert pl.grads == "host" and pl.offload_numel == sum(p.numel() for b in blocks for p in b.parameters())
    unpaged = _plan(model, min_offload_numel=0)
    assert unpaged.paged_blocks == [] and unpaged.offload_optimizer == [] and pl.fixed_bytes < unpaged.fixed_bytes
    forced = _plan(model, page_weights=True, min_offload_numel=0, offload_optimizer=True)
    assert forced.offload_optimizer == [n for n, _ in model.named_parameters()]


def test_forced_page_weights_that_moves_nothing_warns():
    model = _llama()
    with pytest.warns(RuntimeWarning, match=r"page_weights=True, but no block is paged \(all 4 stay on the device\): "
                                            r"min_offload_numel=1048576"):
        pl = _plan(model, page_weights=True)
    assert pl.paged_blocks == [] and (pl.slots, pl.prefetch) == (0, 0) and pl.paged_bytes() == 0
    assert " 0 blocks paged (0 B), 0 weight slots" in str(pl).splitlines()[0]


def test_format_bytes():
    assert [planner.format_bytes(n) for n in (0, 900, 1024, 148480, 3 << 19, 1023 << 20, 24 * GiB, 1500 * GiB)] == [
        "0 B", "900 B", "1.00 KiB", "145 KiB", "1.50 MiB", "1023 MiB", "24.0 GiB", "1500 GiB"]


# -- resolve_budget ----------------------------------------------------------------------------------------
def test_resolve_budget_sizes_and_bytes():
    assert planner.resolve_budget("24GiB", CPU) == 24 * GiB
    assert planner.resolve_budget("1.5GB", CPU) == 1_500_000_000
    assert planner.resolve_budget(123_456_789, CPU) == 123_456_789


def test_resolve_budget_fraction_and_auto_on_cpu(monkeypatch):
    import trainstream_hf.engine.arena as arena

    total = 10 * GiB + 4096
    monkeypatch.setattr(arena, "host_memory_available", lambda: total)
    assert planner.resolve_budget(0.5, CPU) == total // 2
    assert planner.resolve_budget(1.0, CPU) == total
    assert planner.resolve_budget("auto", CPU) == total
    monkeypatch.setattr(arena, "host_memory_available", lambda: None)  # no /proc/meminfo
    assert planner.resolve_budget("auto", CPU) == 64 * GiB
    monkeypatch.undo()
    # Unpatched: MemAvailable, so positive and at most the machine's RAM.
    import os

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for b in (planner.resolve_budget("auto", CPU), planner.resolve_budget(0.5, CPU)):
        assert isinstance(b, int) and 0 < b <= ram


def test_config_budgets_resolve():
    # What a user writes in TrainStreamConfig resolves to bytes.
    for v, want in [("512MiB", 512 * 2**20), (2**33, 2**33)]:
        assert planner.resolve_budget(TrainStreamConfig(vram_budget=v).vram_budget, CPU) == want


def test_measure_head_is_cuda_only():
    # Off CUDA there are no allocator statistics: the plan keeps its formula (the GPU test checks the measured one).
    model = _llama()
    assert planner.measure_head(model, SHAPE, CPU) is None
    analytic = _plan(model).logits_bytes
    assert _plan(model, head_bytes=12345).logits_bytes == 12345 != analytic


def test_a_float32_copy_of_the_outputs_counts_at_the_end_of_the_forward_only():
    """Accelerate's mixed precision copies the returned logits to float32 after the forward: the plan counts that copy
    beside the logits (the end of the forward), not in the backward, where it is gone."""
    model = _llama()
    base, more = _plan(model, head_bytes=1000), _plan(model, head_bytes=1000, output_fp32_bytes=GiB)
    assert more.logits_bytes == base.logits_bytes + GiB
    (f0, b0, e0), (f1, b1, e1) = base._moments(), more._moments()
    assert f1 == f0 + GiB and (b1, e1) == (b0, e0)


def test_offloaded_blocks_are_spaced_by_their_copy_time():
    """Kept blocks form the tail; before them every s-th block is offloaded, s = how many block forwards one
    block's copy needs, and the rest are checkpointed. A faster copy (or slower forward) offloads more."""
    model = _llama(layers=8)
    a = 1 << 20
    copy_s = a / planner.DEFAULT_PCIE_BPS
    base = _plan(model, activation_bytes=a, input_bytes=a // 16)
    budget = base.predicted_peak() + base.margin - 4 * a
    layouts = {}
    for spacing in (1, 2, 3):
        f = copy_s / (planner.COPY_WINDOW * spacing) * 1.01  # s = spacing
        pl = _plan(model, vram_budget=budget, activation_bytes=a, input_bytes=a // 16, forward_seconds=f)
        acts = [b.activations for b in pl.blocks]
        layouts[spacing] = acts
        kept = acts.index("device")
        assert set(acts[kept:]) == {"device"} and "device" not in acts[:kept]
        assert acts[:kept] == ["host" if (i % spacing == 0 and i + spacing <= 8) else "recompute"
                               for i in range(kept)], (spacing, acts)
        assert pl.fits()
    assert layouts[1].count("recompute") == 0 < layouts[2].count("recompute") <= layouts[3].count("recompute")


def test_forward_backlog_counts_a_copy_still_running():
    """An offloaded block with too little forward after it to finish its copy is still on the device when the
    logits arrive: the peak counts it."""
    model = _llama(layers=4)
    a = 1 << 20
    pl = _plan(model, activation_bytes=a, input_bytes=a // 16, forward_seconds=1.0)
    pl.blocks[0].activations = "host"
    assert pl.forward_backlog() == 0        # three slow blocks follow: the copy is long done
    pl.forward_seconds = 1e-9
    assert pl.forward_backlog() == a
    before = pl.predicted_peak()
    pl.forward_seconds = None               # unknown: no backlog (as on the CPU, where copies are synchronous)
    assert pl.forward_backlog() == 0 and pl.predicted_peak() <= before


def test_paged_plan_keeps_inputs_in_host_ram_where_that_pages_fewer_blocks():
    """Where checkpoint inputs are small beside a block's weights (an 8B block at 2048 tokens: 16 MiB against 105
    MiB in nf4), the paged layout puts the first blocks' inputs in host RAM and pages fewer blocks: fewer bytes up
    the link than recomputing with every input on the device (the layout when inputs may not move)."""
    torch.manual_seed(0)
    model = _llama(layers=16)
    for n, p in model.named_parameters():
        p.requires_grad_("norm" in n)  # a frozen base
    blocks = list(find_blocks(model))
    w = sum(p.numel() * p.element_size() for p in blocks[0].parameters())

    def make(budget, **kw):
        return planner.plan(model, blocks, batch_shape=SHAPE, vram_budget=budget, activation_bytes=2 * w,
                            input_bytes=w // 8, forward_seconds=1e-9, slots=2, prefetch=0, min_offload_numel=0,
                            offload_optimizer=False, device=CPU, **kw)

    unpaged = make(HUGE, recompute=True, min_activation_bytes=0)
    for short in (2, 4):
        budget = unpaged.predicted_peak() + unpaged.margin - short * w
        pl = make(budget, min_activation_bytes=0)
        on_device = make(budget, min_activation_bytes=w)  # inputs below the offloader's minimum: they stay
        assert pl.fits() and on_device.fits()
        assert on_device.offloaded_activation_blocks == [] and on_device.paged_blocks
        kinds = [b.activations for b in pl.blocks]
        assert kinds[0] == "recompute_host" and set(kinds) <= {"recompute_host", "recompute", "device"}
        assert len(pl.paged_blocks) < len(on_device.paged_blocks)
        assert planner._h2d_bytes(pl) < planner._h2d_bytes(on_device)


def test_backward_extra_counts_in_each_blocks_backward():
    """What a block's backward allocates beyond what it holds (measured on CUDA, none on the CPU) is on top of every
    backward moment: all activations kept, recomputed blocks, and the first block's backward beside the gradients;
    a budget that fits without it moves activations with it."""
    model = _llama(layers=4)
    for n, p in model.named_parameters():
        p.requires_grad_("norm" in n)  # a frozen base: the activations, not the gradients, make the peak
    a = 1 << 20
    kw = dict(activation_bytes=a, input_bytes=a // 16, forward_seconds=1e-9, offload_optimizer=False)
    extra = a
    for moves in ({}, dict(recompute=True)):
        without, with_extra = _plan(model, **moves, **kw), _plan(model, backward_extra_bytes=extra, **moves, **kw)
        assert (without.backward_extra, with_extra.backward_extra) == (0, extra)
        assert with_extra.predicted_peak() > without.predicted_peak()
        assert with_extra.predicted_peak() <= without.predicted_peak() + extra
    kept = _plan(model, backward_extra_bytes=extra, **kw)
    assert not kept.moves_blocks and max(kept._moments()) >= sum(b.activation_bytes for b in kept.blocks) + extra
    budget = _plan(model, **kw).predicted_peak() + planner.DEFAULT_MARGIN
    assert not _plan(model, vram_budget=budget, **kw).moves_blocks
    tight = _plan(model, vram_budget=budget, backward_extra_bytes=extra, **kw)
    assert tight.fits() and tight.moves_blocks
    assert "backward extra 0.00 GiB" in str(tight)  # 1 MiB, printed in GiB
    # the CPU has no allocator peak to measure it by
    assert planner.measure_block(model, find_blocks(model)[1], SHAPE, CPU).backward_extra is None


def test_backward_extra_probe_runs_one_blocks_backward_and_leaves_the_model_as_it_was():
    """The probe behind Plan.backward_extra (CUDA's allocator counters stood in): the forward stops at the block's
    end, the backward stops at its input (the blocks before it and the embedding get no gradient), every trainable
    parameter's gradient is as before afterwards, and the random streams are untouched."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_llama(layers=3), LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0))
    blocks = list(find_blocks(model))
    seen = {}

    def peak(_device):
        seen["grads"] = {n: p.grad is not None for n, p in model.named_parameters() if p.requires_grad}
        return 1000

    counters = (lambda _d: None, lambda _d: 600, lambda _d: None, peak)
    ids = torch.randint(0, 128, SHAPE)
    state = torch.random.get_rng_state()
    assert planner.measure_backward_extra(model, blocks[1], ids, memory=counters) == 400
    assert torch.equal(state, torch.random.get_rng_state())
    got = seen["grads"]
    assert any(v for n, v in got.items() if ".layers.1." in n)  # block 1's adapters had their gradients
    assert not any(v for n, v in got.items() if ".layers.0." in n or ".layers.2." in n)  # cut at its input
    assert all(p.grad is None for p in model.parameters())  # and given back
    assert planner.measure_backward_extra(model, blocks[1], ids) is None  # the CPU: not measured


def test_recompute_true_is_kept_when_paging():
    """recompute=True means every block that can be recomputed is: the paged layout does not give blocks back their
    activations, whatever the slack."""
    model = _llama(layers=6)
    recomputed = _plan(model, offload_optimizer=False, recompute=True, min_offload_numel=0)
    budget = recomputed.margin + recomputed.predicted_peak() - recomputed.blocks[0].weight_bytes
    pl = _plan(model, vram_budget=budget, offload_optimizer=False, slots=2, prefetch=0, recompute=True,
               min_offload_numel=0)
    assert pl.paged_blocks and pl.recomputed_blocks == list(range(len(pl.blocks)))


# -- the optimizer's device share (resident and streamed parameters) ----------------------------------------------
def test_device_share_off_on_cpu_by_default_and_fills_spare_memory_when_forced():
    model = _llama()
    kw = dict(offload_optimizer=True, min_offload_numel=2000, grads="host")
    auto = _plan(model, **kw)
    assert auto.resident_optimizer == [] and auto.streamed_optimizer == []  # 'auto': CUDA only
    forced = _plan(model, optimizer_resident=True, optimizer_streamed=False, **kw)
    assert forced.resident_optimizer == auto.offload_optimizer  # everything fits a huge budget, in forward order
    assert forced.resident_numel == auto.offload_numel
    assert forced.fixed_bytes == auto.fixed_bytes + 12 * auto.offload_numel
    assert forced.host_bytes() < auto.host_bytes()
    # A budget with room for some: the first ones in forward order (the embedding comes first), and the plan fits.
    tight = _plan(model, **kw)
    spare = 12 * 128 * 64 + 4 * 128 * 64 + (2 * 64 * 64 + 2 * 64 * 32) * 16  # the embedding and a bit
    budget = int((tight.predicted_peak() + tight.margin + spare) / (1 - planner.DEVICE_SHARE_RESERVE)) + 1
    some = _plan(model, vram_budget=budget, optimizer_resident=True, optimizer_streamed=False, **kw)
    assert some.resident_optimizer[0] == "model.embed_tokens.weight"
    assert 0 < len(some.resident_optimizer) < len(some.offload_optimizer) and some.fits()
    # and it leaves DEVICE_SHARE_RESERVE of the budget unused beyond the margin
    assert some.predicted_peak() + some.margin + planner.DEVICE_SHARE_RESERVE * budget <= budget


def test_streamed_share_balances_cpu_and_link_or_takes_a_fraction():
    model = _llama(layers=8)
    kw = dict(offload_optimizer=True, min_offload_numel=2000, grads="device", optimizer_resident=False,
              device_chunk_numel=1024)
    base = _plan(model, **kw)
    # The link as fast as the CPU per element (12 bytes an element at pcie_bps): about half each, in forward order.
    pl_fast = _plan(model, optimizer_streamed=True, cpu_adam_pps=base.pcie_bps / 12, **kw)
    assert 0.35 < pl_fast.streamed_numel / base.offload_numel < 0.65
    assert pl_fast.streamed_optimizer[0] == base.offload_optimizer[0]
    half = _plan(model, optimizer_streamed=0.5, **kw)
    assert abs(half.streamed_numel / base.offload_numel - 0.5) < 0.2
    everything = _plan(model, optimizer_streamed=1.0, **kw)
    assert everything.streamed_numel == base.offload_numel and everything.streamed_optimizer == base.offload_optimizer
    assert everything.fixed_bytes == base.fixed_bytes + 3 * 12 * 1024  # the ring; device gradients already counted
    # fp32 parameters, device gradients: 16 bytes each on the CPU share (master, moments, gradient buffer), 12 streamed
    assert base.host_bytes() == 16 * base.offload_numel
    assert everything.host_bytes() == base.host_bytes() - 4 * base.offload_numel
    assert _plan(model, optimizer_streamed=0.0, **kw).streamed_numel == 0
    # A slower CPU sends more to the link; the floor counts both.
    slow = _plan(model, optimizer_streamed=True, cpu_adam_pps=base.pcie_bps / 120, **kw)
    assert slow.streamed_numel > pl_fast.streamed_numel
    assert slow.predicted_step_floor() < _plan(model, optimizer_streamed=False, cpu_adam_pps=base.pcie_bps / 120,
                                               **kw).predicted_step_floor()
    assert "streamed" in str(slow)


def test_paged_parameters_stay_on_the_cpu_share():
    model = _llama()
    pl = _plan(model, offload_optimizer=True, min_offload_numel=2000, page_weights=True, optimizer_resident=True,
               optimizer_streamed=True)
    paged = {n for n, _ in model.named_parameters() if n.startswith("model.layers.")}
    assert pl.paged_blocks and not paged & set(pl.resident_optimizer + pl.streamed_optimizer)
    assert set(pl.resident_optimizer) <= {"model.embed_tokens.weight", "lm_head.weight"}


def test_measure_cpu_adam_is_a_rate():
    assert 1e6 < planner.measure_cpu_adam(1, numel=1 << 16) < 1e12


def test_streamed_share_keeps_its_memory_before_the_resident_share_fills_the_rest():
    """A streamed element costs its gradient (host-gradient plans), a resident one 12 bytes more: with room for half
    of the parameters resident, the plan still streams its balanced share and makes resident what is left."""
    model = _llama(layers=8)
    kw = dict(offload_optimizer=True, min_offload_numel=2000, grads="host", device_chunk_numel=1024)
    base = _plan(model, **kw)
    cpu_pps = base.pcie_bps / 12  # link and CPU equally fast per element
    need = 16 * base.offload_numel // 2  # half of everything resident (12 bytes + a 4-byte fp32 gradient)
    budget = int((base.predicted_peak() + base.margin + need) / (1 - planner.DEVICE_SHARE_RESERVE)) + 1
    pl = _plan(model, vram_budget=budget, optimizer_resident=True, optimizer_streamed=True, cpu_adam_pps=cpu_pps, **kw)
    assert pl.resident_numel > 0 and pl.streamed_numel > 0.3 * (base.offload_numel - pl.resident_numel)
    assert pl.fits() and not set(pl.resident_optimizer) & set(pl.streamed_optimizer)
    only_resident = _plan(model, vram_budget=budget, optimizer_resident=True, optimizer_streamed=False, **kw)
    assert pl.resident_numel < only_resident.resident_numel


def test_host_budget_checkpoints_offloaded_blocks_keeping_their_input_in_host_ram():
    """Long sequences: offloaded activations that would pass the host RAM the arena may pin become checkpointed
    blocks whose input alone waits there, first block first, while the device budget still fits."""
    model = _llama(layers=6)
    kw = dict(offload_activations=True, batch_shape=(1, 256))
    full = _plan(model, **kw)
    assert [b.activations for b in full.blocks] == ["host"] * 6
    per_block = full.blocks[0].host_activation_bytes()
    assert full.blocks[0].input_bytes < per_block
    saved = per_block - full.blocks[0].input_bytes  # what checkpointing one offloaded block saves in host RAM
    budget = full.host_bytes() - 2 * saved  # exactly two blocks' worth too little
    pl = _plan(model, host_budget=budget, **kw)
    assert [b.activations for b in pl.blocks][:3] == ["recompute_host"] * 2 + ["host"]
    assert pl.host_bytes() <= budget and pl.fits()
    assert _plan(model, host_budget=full.host_bytes(), **kw).host_bytes() == full.host_bytes()  # enough: unchanged


def test_bf16_moments_count_half_the_moment_bytes_and_keep_the_cpu_share():
    model = _llama()
    kw = dict(offload_optimizer=True, min_offload_numel=2000, grads="host", optimizer_resident=True,
              optimizer_streamed=True)
    exact = _plan(model, **kw)
    approx = _plan(model, optimizer_moments="bfloat16", **kw)
    assert exact.resident_numel > 0  # a huge budget: the device share takes everything it can
    assert approx.resident_numel == approx.streamed_numel == 0  # the device kernel takes float32 moments
    assert approx.host_bytes() == _plan(model, optimizer_resident=False, optimizer_streamed=False,
                                        **{k: v for k, v in kw.items() if not k.startswith("optimizer_")}).host_bytes() \
        - 4 * approx.offload_numel


def test_host_bytes_follow_each_parameters_dtype_and_placement():
    """bf16 parameters: master 4 + moments 8 + gradient buffer 2 + the weight copy 2 (none when paged: the paged
    weight's host copy is counted with the blocks); host gradients keep the bf16 first term only."""
    model = _llama(dtype=torch.bfloat16)
    kw = dict(offload_optimizer=True, min_offload_numel=2000, optimizer_resident=False, optimizer_streamed=False)
    dev = _plan(model, grads="device", **kw)
    assert dev.host_bytes() == 16 * dev.offload_numel
    host = _plan(model, grads="host", **kw)
    assert host.host_bytes() == 16 * host.offload_numel
    paged = _plan(model, page_weights=True, **kw)
    in_blocks = sum(p.numel() for n, p in model.named_parameters() if n.startswith("model.layers.") and p.numel() >= 2000)
    assert paged.grads == "host"
    assert paged.host_bytes() == paged.paged_bytes() + 16 * paged.offload_numel - 2 * in_blocks
    approx = _plan(model, page_weights=True, optimizer_moments="bfloat16", **kw)
    assert paged.host_bytes() - approx.host_bytes() == 4 * paged.offload_numel


# -- gradient accumulation ----------------------------------------------------------------------------------
def test_accumulation_puts_the_held_gradients_beside_the_forward():
    """From the second micro-batch on, each forward runs beside the gradients kept until step(): all of them with
    device gradients, only the device-stepped ones with host gradients (the rest left during backward)."""
    model = _llama()
    kw = dict(offload_optimizer=True, min_offload_numel=2000)
    for grads in ("device", "host"):
        one, two = _plan(model, grads=grads, **kw), _plan(model, grads=grads, accumulation=2, **kw)
        assert (one.grads, two.grads) == (grads, grads)
        forward_one, forward_two = one._moments()[0], two._moments()[0]
        assert forward_two - forward_one == two.held_grad_bytes() > 0
        assert one._moments()[1:] == two._moments()[1:]  # backward already counted every held gradient
    dev, host = _plan(model, grads="device", **kw), _plan(model, grads="host", **kw)
    assert dev.held_grad_bytes() == dev.grad_bytes  # every gradient stays until step()
    assert host.held_grad_bytes() == host.grad_bytes - host.inflight_grad_bytes < dev.held_grad_bytes()
    assert "2 micro-batches per step" in str(_plan(model, accumulation=2, **kw)).splitlines()[0]
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        _plan(model, accumulation=0)


def test_accumulation_the_plan_would_not_fit_moves_the_gradients_to_the_host():
    """A budget where device gradients fit one micro-batch but not a second forward beside them: the plan made for
    accumulation sends the offloaded gradients to the host during backward instead."""
    model = _llama()
    kw = dict(offload_optimizer=True, min_offload_numel=2000, offload_activations=False, page_weights=False, margin=0)
    one = _plan(model, **kw)
    assert one.grads == "device"
    budget = one.predicted_peak() + one.grad_bytes // 2  # one micro-batch per step fits, not two with all gradients
    assert _plan(model, vram_budget=budget, **kw).grads == "device"
    two = _plan(model, vram_budget=budget, accumulation=2, **kw)
    assert two.grads == "host" and two.fits()


def test_accumulation_counts_the_fp32_accumulator_of_bf16_host_gradients():
    model = _llama(dtype=torch.bfloat16)
    kw = dict(offload_optimizer=True, min_offload_numel=2000, optimizer_resident=False, optimizer_streamed=False,
              grads="host")
    one, two = _plan(model, **kw), _plan(model, accumulation=2, **kw)
    assert two.host_bytes() - one.host_bytes() == 4 * one.offload_numel
    dev = dict(kw, grads="device")
    assert _plan(model, accumulation=2, **dev).host_bytes() == _plan(model, **dev).host_bytes()


def test_a_plan_fills_its_budget_when_it_moves_blocks_steps_state_on_the_device_or_is_tight():
    """wrap turns the allocator's expandable segments on ('auto', on CUDA) for these plans."""
    model = _llama()
    assert not _plan(model).fills_budget()  # a huge budget
    assert _plan(model, page_weights=True, min_offload_numel=0).fills_budget()
    assert _plan(model, offload_activations=True, min_activation_bytes=0).fills_budget()
    assert _plan(model, recompute=True, offload_activations=False).fills_budget()
    assert _plan(model, offload_optimizer=True, min_offload_numel=2000, optimizer_resident=True).fills_budget()
    loose = _plan(model)
    need = loose.predicted_peak() + loose.margin
    assert _plan(model, vram_budget=int(need / planner.FILLS_BUDGET) - 1024).fills_budget()
    assert not _plan(model, vram_budget=int(need / planner.FILLS_BUDGET) + 1024).fills_budget()


def test_recompute_buys_device_share_when_the_optimizer_outlasts_the_forwards():
    """A full fine-tune whose optimizer step is bound by the CPU AdamW: checkpointing blocks frees their activations
    for resident optimizer state (no CPU or PCIe time) when a forward is cheap against the work it takes off the CPU;
    not when forwards are dear, nor with recompute=False, nor without a measured forward time."""
    model = _llama(layers=8)
    kw = dict(offload_optimizer=True, min_offload_numel=2000, grads="device", optimizer_resident=True,
              optimizer_streamed=False, batch_shape=(1, 256))
    base = _plan(model, **{**kw, "optimizer_resident": False})
    # room for every block's activations and a quarter of the offloaded state resident
    budget = int((base.predicted_peak() + base.margin + 3 * base.offload_numel) / (1 - planner.DEVICE_SHARE_RESERVE))
    slow_cpu = base.offload_numel / 1.0  # the CPU share takes ~1 s
    cheap = _plan(model, vram_budget=budget, forward_seconds=1e-6, cpu_adam_pps=slow_cpu, **kw)
    plain = _plan(model, vram_budget=budget, forward_seconds=1e-6, cpu_adam_pps=slow_cpu, recompute=False, **kw)
    assert not plain.recomputed_blocks and 0 < plain.resident_numel < plain.offload_numel
    assert cheap.recomputed_blocks and cheap.resident_numel > plain.resident_numel and cheap.fits()
    assert cheap.predicted_step_floor() + cheap.recompute_seconds() < 0.95 * plain.predicted_step_floor()
    assert all(b.activations == "device" for b in cheap.blocks if b.index not in cheap.recomputed_blocks)
    dear = _plan(model, vram_budget=budget, forward_seconds=10.0, cpu_adam_pps=slow_cpu, **kw)
    assert not dear.recomputed_blocks and dear.resident_numel == plain.resident_numel
    unknown = _plan(model, vram_budget=budget, cpu_adam_pps=slow_cpu, **kw)
    assert not unknown.recomputed_blocks
    # each micro-batch recomputes: a forward cheap enough for one per step is too dear for eight
    assert _plan(model, vram_budget=budget, forward_seconds=0.03, cpu_adam_pps=slow_cpu, **kw).recomputed_blocks
    assert not _plan(model, vram_budget=budget, forward_seconds=0.03, cpu_adam_pps=slow_cpu, accumulation=8,
                     **kw).recomputed_blocks


def test_an_optimizer_in_backward_recomputes_where_its_cpu_share_outlasts_the_backward():
    """optimizer_in_backward: the CPU steps each block as its gradients land, so forwards recomputed inside the
    backward cost nothing while the CPU share outlasts it. A forward too dear to recompute for a step's optimizer at
    step() (0.2 s a block against ~1.4 s less CPU work) is worth it there; not once the backward is the longer."""
    model = _llama(layers=8)
    kw = dict(offload_optimizer=True, min_offload_numel=2000, grads="host", optimizer_resident=True,
              optimizer_streamed=False, batch_shape=(1, 32))
    base = _plan(model, **{**kw, "optimizer_resident": False})
    budget = int((base.predicted_peak() + base.margin + base.offload_numel // 2) / (1 - planner.DEVICE_SHARE_RESERVE))
    slow_cpu = base.offload_numel / 10.0  # the CPU share alone takes ~10 s
    at_step = _plan(model, vram_budget=budget, forward_seconds=0.2, cpu_adam_pps=slow_cpu, **kw)
    inside = _plan(model, vram_budget=budget, forward_seconds=0.2, cpu_adam_pps=slow_cpu, optimizer_in_backward=True,
                   **kw)
    assert not at_step.recomputed_blocks and not at_step.in_backward
    assert inside.in_backward and inside.recomputed_blocks and inside.fits()
    assert inside.predicted_step_floor() < at_step.predicted_step_floor()
    # a backward longer than the CPU share: recomputation is paid for again
    fast_cpu = base.offload_numel / 0.5
    assert not _plan(model, vram_budget=budget, forward_seconds=0.2, cpu_adam_pps=fast_cpu, optimizer_in_backward=True,
                     **kw).recomputed_blocks
