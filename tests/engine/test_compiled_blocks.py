"""wrap(compile_blocks=...): each block's forward compiled as one region (engine/compiled.py), on the CPU.

The engine's moves stay exact around a compiled block: paged weights, offloaded activations and recomputation give
the same losses and gradients, bit for bit, as the same model with the same blocks compiled and nothing moved. The
compiled region itself is held to the eager model within rounding. ``aot_eager`` (AOTAutograd's traced forward and
backward, run by eager kernels) keeps these tests fast; one test generates inductor's kernels.
"""
import copy

import pytest
import torch

import trainstream_hf as ts
from trainstream_hf.engine.compiled import CompiledBlocks
from tests.helpers import tiny_llama

pytest.importorskip("torch._dynamo")


def _llama():
    return tiny_llama(3, vocab=128, positions=64, seed=0)


def _batches(n=3):
    return [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1000 + s)) for s in range(n)]


def _lora_over(fmt: str, layers: int, **llama):
    """A bf16 tiny Llama packed in ``fmt``, LoRA r8 on every linear layer (the recipes' adapter), its B matrices
    non-zero (seeded), as after a first update: the adapters then add to each layer's output and A has gradients, so
    a compiled adapter path that computes them wrongly shows (B = 0 hides both)."""
    from trainstream_hf.quant import quantize_model
    from trainstream_hf.train.model import add_lora

    m = quantize_model(tiny_llama(layers, vocab=128, positions=64, seed=0, **llama).to(torch.bfloat16), fmt)
    m = add_lora(m, r=8, alpha=16, dropout=0.0, target_modules="all-linear")
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return m


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


MOVES = {
    "offloaded": dict(offload_activations=True, min_activation_bytes=0, recompute=False, page_weights=False,
                      offload_optimizer=False),
    "recomputed": dict(recompute=True, offload_activations=False, page_weights=False, offload_optimizer=False),
    "recomputed_from_host": dict(recompute=True, offload_activations=True, min_activation_bytes=0,
                                 page_weights=False, offload_optimizer=False),
}
# With gradients in host RAM (paged trainable weights, the offloaded optimizer's host mode) the parameters change
# class after the first step and the compiled backward's gradients agree within float32 rounding only.
HOST_GRADS = dict(page_weights=True, offload_activations=True, min_activation_bytes=0, offload_optimizer=True,
                  min_offload_numel=0, recompute=False)


def _compiled_pair(**moves):
    """(reference, its optimizer, model, its optimizer): one model twice, both with compiled blocks (the engine's own
    option, so the same compiled code); the reference moves nothing, the model makes ``moves``."""
    ref = _llama()
    model = copy.deepcopy(ref)
    ref, ref_opt = ts.wrap(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), device="cpu", vram_budget="64GiB",
                           host_arena=None, compile_blocks="aot_eager", recompute=False, offload_activations=False,
                           page_weights=False, offload_optimizer=False)
    model, opt = ts.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), device="cpu", vram_budget="64GiB",
                         host_arena=None, compile_blocks="aot_eager", **moves)
    return ref, ref_opt, model, opt


@pytest.mark.parametrize("moves", list(MOVES))
def test_the_engines_moves_stay_exact_around_compiled_blocks(train_side_by_side, moves):
    ref, ref_opt, model, opt = _compiled_pair(**MOVES[moves])
    pl = ts.engine_of(model).plan
    assert (pl.offloaded_activation_blocks or pl.recomputed_blocks), pl
    assert ts.engine_of(model).compiled is not None and len(ts.engine_of(ref).compiled._saved) == 3
    train_side_by_side(ref, model, ref_opt, opt, _batches())


def test_paged_weights_with_host_gradients_agree_within_rounding():
    ref, ref_opt, model, opt = _compiled_pair(**HOST_GRADS)
    assert ts.engine_of(model).plan.paged_blocks == [0, 1, 2] and ts.engine_of(model).plan.grads == "host"
    for ids in _batches():
        la, lb = (m(input_ids=ids, labels=ids).loss for m in (ref, model))
        la.backward()
        lb.backward()
        assert abs(la.item() - lb.item()) <= 1e-6
        for (n, p), q in zip(ref.named_parameters(), model.parameters()):
            assert (p.grad - q.grad).abs().max().item() <= 1e-6 * max(1.0, p.grad.abs().max().item()), n
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()


def test_compiled_blocks_train_like_eager_and_unwrap_restores_the_forwards():
    losses = {}
    for compiled in (False, "aot_eager"):
        model = _llama()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = ts.wrap(model, opt, device="cpu", vram_budget="8GiB", host_arena=None, compile_blocks=compiled)
        assert all(("forward" in layer.__dict__) == bool(compiled) for layer in model.model.layers)
        run = []
        for ids in _batches():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.item())
        losses[compiled] = run
        model = ts.unwrap(model)
        assert not any("forward" in layer.__dict__ for layer in model.model.layers)
    assert max(abs(a - b) for a, b in zip(losses[False], losses["aot_eager"])) < 1e-5, losses


def test_inductor_compiles_shared_graphs_and_stays_close_to_eager():
    """The real backend: the three blocks share compiled graphs (regional compilation): two, as block 0's input needs
    no gradient (a frozen embedding) and the others' do; the bf16 LoRA step over an nf4 base stays within bf16
    rounding of eager (inductor fuses elementwise chains: fewer roundings)."""
    from torch._dynamo.utils import counters

    ids = _batches(1)[0]
    grads = {}
    for compiled in (False, True):
        model = _lora_over("nf4", 3)
        model, _ = ts.wrap(model, None, device="cpu", vram_budget="8GiB", host_arena=None, compile_blocks=compiled,
                           batch_shape=tuple(ids.shape))
        counters.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads[compiled] = (loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        if compiled:
            assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
            assert not counters["graph_break"], dict(counters["graph_break"])
        ts.unwrap(model)
    (l0, g0), (l1, g1) = grads[False], grads[True]
    assert abs(l0.item() - l1.item()) <= 1e-2 * abs(l0.item())
    assert g0.keys() == g1.keys() and len(g0) == 3 * 7 * 2
    for n in g0:
        scale = g0[n].float().abs().max().item()
        assert (g0[n].float() - g1[n].float()).abs().max().item() <= 0.05 * scale, n


def test_install_keeps_and_restores_an_instance_forward():
    block = torch.nn.Linear(4, 4)
    own = block.forward
    block.__dict__["forward"] = own
    plain = torch.nn.Linear(4, 4)
    c = CompiledBlocks("eager")
    assert c.install([block, plain]) == 2 and block.forward is not own and "forward" in plain.__dict__
    x = torch.randn(2, 4)
    assert torch.equal(block(x), torch.nn.functional.linear(x, block.weight, block.bias))
    c.uninstall()
    assert block.__dict__["forward"] is own and "forward" not in plain.__dict__


def test_compile_blocks_option():
    assert ts.TrainStreamConfig(compile_blocks="aot_eager").compile_blocks == "aot_eager"
    with pytest.raises(ValueError, match="compile_blocks: unknown torch.compile backend 'nope'; choose one of"):
        ts.TrainStreamConfig(compile_blocks="nope")
    with pytest.raises(ValueError, match="compile_blocks: True, False or a torch.compile backend name"):
        ts.TrainStreamConfig(compile_blocks=3)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma2", "gemma3", "phi3", "gpt2"])
def test_every_family_compiles_to_one_shared_graph(family):
    """Every decoder family the engine pages compiles its blocks into one graph without a break (GPT-2's model passes
    its cache positionally: dropped there too), and trains as eager does."""
    from torch._dynamo.utils import counters

    from tests.engine.test_paging import _model

    ref = _model(family)
    model = copy.deepcopy(ref)
    for m in (ref, model):  # GPT-2's dropout: the same (none) in both
        for mod in m.modules():
            if isinstance(mod, torch.nn.Dropout):
                mod.p = 0.0
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    counters.clear()  # (the plan's measurement compiles, at wrap; the training call reuses its graph)
    model, _ = ts.wrap(model, None, device="cpu", vram_budget="8GiB", host_arena=None, compile_blocks="aot_eager",
                       batch_shape=tuple(ids.shape))
    la, lb = (m(input_ids=ids, labels=ids).loss for m in (ref, model))
    la.backward()
    lb.backward()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["stats"])
    assert abs(la.item() - lb.item()) <= 1e-6 * abs(la.item())
    for (n, p), q in zip(ref.named_parameters(), model.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= 1e-6 * max(1.0, p.grad.abs().max().item()), n


@pytest.mark.parametrize("fmt", ["int8", "nf4", "nvfp4", "fp8_tensor_cores"])
def test_every_format_compiles_without_a_break(fmt, request, monkeypatch):
    """LoRA over each packed format (bf16 autocast) compiles without a graph break and trains as eager. The FP8
    tensor-core path (the C++ fp8_linear node, what sm_89+ GPUs take) is forced on the CPU: traced with data-less
    tensors, its node hands the op to its fake kernel whole."""
    from torch._dynamo.utils import counters

    from trainstream_hf.quant import matmul

    if fmt == "fp8_tensor_cores":
        request.getfixturevalue("rowwise_scaled_mm")
        monkeypatch.setitem(matmul.ACT_QUANT_FORMATS, "fp8", matmul.FP8_W8A8_SCALED_MM)
    ids = _batches(1)[0]
    out = {}
    for compiled in (False, "aot_eager"):
        torch._dynamo.reset()
        m = _lora_over(fmt.split("_")[0], 2)
        counters.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            # wrap measures the block under the autocast the training runs in: the graphs compiled for the
            # measurement are the training's
            m, _ = ts.wrap(m, None, device="cpu", vram_budget="8GiB", host_arena=None, compile_blocks=compiled,
                           batch_shape=tuple(ids.shape))
            compiles = counters["stats"]["unique_graphs"]
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        out[compiled] = (loss.item(), [p.grad.float() for p in m.parameters() if p.grad is not None])
        if compiled:
            assert counters["stats"]["unique_graphs"] == compiles == 2 and not counters["graph_break"], \
                dict(counters["stats"])
        ts.unwrap(m)
    (l0, g0), (l1, g1) = out[False], out["aot_eager"]
    assert abs(l0 - l1) <= 1e-3 * abs(l0) and len(g0) == len(g1) == 2 * 7 * 2
    for a, b in zip(g0, g1):
        assert a.abs().max().item() > 0  # B non-zero (_lora_over): every A has a gradient too
        assert (a - b).abs().max().item() <= 0.02 * a.abs().max().item()


def test_the_plan_measures_the_compiled_block():
    """With compiled blocks the plan measures the block through the compiled region, at wrap (inductor: its
    partitioner recomputes cheap elementwise results instead of saving them): fewer bytes than the eager block, and
    what the engine then moves per block in a training step, offloading every activation. The training call reuses
    the graphs compiled for the measurement (same shape, same grad and autocast modes)."""
    from torch._dynamo.utils import counters

    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(4))
    per_block, moved = {}, {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        m = _lora_over("nf4", 2)
        m, opt = ts.wrap(m, torch.optim.AdamW([p for p in m.parameters() if p.requires_grad]), device="cpu",
                         vram_budget="8GiB", host_arena=None, compile_blocks=compiled, batch_shape=tuple(ids.shape),
                         offload_activations=True, min_activation_bytes=0, recompute=False)
        per_block[compiled] = m.trainstream_plan.blocks[1].activation_bytes
        m.train()
        m(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        moved[compiled] = m.trainstream_stats()["activations"]["d2h_bytes"]
        if compiled:
            assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])  # wrap's two, none at the step
        ts.unwrap(m)
    assert per_block[True] < 0.8 * per_block[False], per_block
    for c in (False, True):  # block 0 saves a little less than the measured block 1 (its input needs no gradient)
        assert 0.8 * 2 * per_block[c] <= moved[c] <= 2 * per_block[c], (c, per_block, moved)


def test_a_compiled_quantized_block_saves_no_more_than_eager():
    """The forward's and the backward's decode of a packed weight must stay two (no CSE across the joint graph):
    merged, the dense weights would be saved for the backward (the 8B row's out-of-memory at 66d2b61)."""
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(4))
    saved = {}
    for compiled in (False, "aot_eager"):
        torch._dynamo.reset()
        m = _lora_over("nf4", 2, hidden=128, intermediate_size=512)
        m, _ = ts.wrap(m, None, device="cpu", vram_budget="8GiB", host_arena=None, compile_blocks=compiled,
                       batch_shape=tuple(ids.shape), fused_loss=False)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            m(input_ids=ids, labels=ids).loss.backward()  # the compile
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        saved[compiled] = total[0]
        ts.unwrap(m)
    assert saved["aot_eager"] <= saved[False], saved


def _counting_backend(calls: list):
    def backend(gm, example_inputs):
        calls.append(len(example_inputs))
        return gm.forward
    return backend


def test_only_training_calls_run_compiled():
    """generate() and evaluation write a cache per layer: they run eager, so the blocks' shared graph never meets a
    per-layer guard; a training call compiles."""
    model = _llama()
    calls = []
    compiled = CompiledBlocks(_counting_backend(calls))
    compiled.install(list(model.model.layers))
    ids = _batches(1)[0]
    model.eval()
    with torch.no_grad():
        model.generate(ids[:, :4], max_new_tokens=3, do_sample=False)
    model(input_ids=ids, labels=ids)  # eval mode, grad on: eager too
    assert calls == []
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    assert calls
    compiled.uninstall()


def _failing_backend(gm, example_inputs):
    raise RuntimeError("no kernels here")


def test_auto_falls_back_to_eager_with_one_warning_and_true_raises():
    ref, model = _llama(), _llama()
    ids = _batches(1)[0]
    want = ref(input_ids=ids, labels=ids).loss
    compiled = CompiledBlocks(_failing_backend, fallback=True)
    compiled.install(list(model.model.layers))
    with pytest.warns(RuntimeWarning, match="compile_blocks='auto': torch.compile of the decoder blocks failed"):
        got = model(input_ids=ids, labels=ids).loss
    assert torch.equal(got, want) and compiled.failed
    import warnings as w
    with w.catch_warnings():
        w.simplefilter("error")
        assert torch.equal(model(input_ids=ids, labels=ids).loss, want)  # eager from now on, no second warning
    compiled.uninstall()
    strict = CompiledBlocks(_failing_backend)
    strict.install(list(model.model.layers))
    with pytest.raises(Exception, match="no kernels here"):
        model(input_ids=ids, labels=ids)
    strict.uninstall()


def test_auto_compiles_only_on_cuda_with_triton():
    model, _ = ts.wrap(_llama(), None, device="cpu", vram_budget="8GiB", host_arena=None, compile_blocks="auto")
    assert ts.engine_of(model).compiled is None
    from trainstream_hf.engine.compiled import inductor_usable
    assert not inductor_usable(torch.device("cpu"))
    ts.unwrap(model)


@pytest.mark.parametrize("paged", [False, True])
def test_a_compiled_no_grad_forward_keeps_the_hooks_out_unless_weights_are_paged(paged):
    """torch.compile over the whole wrapped model, no grad (a compiled generation step): with every weight on the
    device the engine's block hooks stand aside (one graph, no break); with paged weights they are traced as before,
    the pager running at the graph breaks. Either way the logits are eager's."""
    from torch._dynamo.utils import counters

    model = _llama()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    model, _ = ts.wrap(model, None, device="cpu", vram_budget="8GiB", host_arena=None, page_weights=paged,
                       min_offload_numel=0)
    assert bool(model.trainstream_plan.paged_blocks) == paged
    counters.clear()
    with torch.no_grad():
        out = torch.compile(model, backend="eager")(input_ids=ids).logits
    assert torch.equal(out, ref)
    assert bool(counters["graph_break"]) == paged, dict(counters["graph_break"])
    ts.unwrap(model)


@pytest.mark.parametrize("fmt", ["nf4", "fp8"])
def test_fp8_tensor_core_blocks_stay_eager_under_auto_and_warn_when_asked(fmt, monkeypatch):
    """Over FP8 tensor-core layers on the GPU compiled blocks do not yet train as eager (H100, benchmarks/NOTES.md
    2026-12-07): 'auto' leaves them eager with a warning, an explicit request compiles with one; other formats and
    the CPU are untouched. The GPU's path stood in: select_path answers the tensor-core path for fp8."""
    import sys
    import warnings

    from trainstream_hf.engine.blocks import find_blocks
    from trainstream_hf.quant import matmul

    wrap_module = sys.modules["trainstream_hf.wrap"]  # (the package's `wrap` attribute is the function)
    select = matmul.select_path
    monkeypatch.setattr(matmul, "select_path", lambda f, device, act_quant=None: matmul.FP8_W8A8_SCALED_MM
                        if f.name == "fp8" and torch.device(device).type == "cuda" else select(f, device, act_quant))
    monkeypatch.setattr(wrap_module, "inductor_usable", lambda device: device.type == "cuda")
    blocks = list(find_blocks(_lora_over(fmt, 1)))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    fp8 = fmt == "fp8"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert wrap_module._compile_mode("auto", blocks, cuda) is (not fp8)
        assert wrap_module._compile_mode(True, blocks, cuda) is True
        assert wrap_module._compile_mode("aot_eager", blocks, cpu) == "aot_eager"
        assert wrap_module._compile_mode(False, blocks, cuda) is False
    said = [str(w.message) for w in caught]
    if fp8:
        assert len(said) == 2 and "leaves blocks with FP8 tensor-core layers eager" in said[0] and \
            "compile_blocks=False gives eager's numbers" in said[1]
    else:
        assert said == []


def test_peft_lora_over_a_bf16_base_compiles():
    """PEFT's own LoRA forward (a bf16 base, float32 adapters, no autocast: PEFT casts each input up to float32,
    which the engine's cast elision records) in compiled blocks: the cast elision stands aside while torch.compile
    traces (it read version counters there, which AOTAutograd's graph cannot run: inductor failed to compile it), and
    the step stays within rounding of eager."""
    from trainstream_hf.train.model import add_lora

    from torch._dynamo.utils import counters

    ids = _batches(1)[0]
    grads = {}
    for compiled in (False, "aot_eager"):
        model = add_lora(tiny_llama(2, vocab=128, positions=64, seed=0).to(torch.bfloat16), r=8, alpha=16,
                         dropout=0.0, target_modules="all-linear")
        assert next(p for n, p in model.named_parameters() if "lora_A" in n).dtype == torch.float32
        model, _ = ts.wrap(model, None, device="cpu", vram_budget="8GiB", host_arena=None, compile_blocks=compiled,
                           batch_shape=tuple(ids.shape))
        counters.clear()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        # the region wrap measured is the one that trains (cast elision is not installed only to be dropped after
        # the measurement, which changed the region: every block compiled again at the first step)
        assert not counters["stats"]["unique_graphs"] and not counters["recompiles"], dict(counters)
        grads[compiled] = (loss.item(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None})
        ts.unwrap(model)
    (l0, g0), (l1, g1) = grads[False], grads["aot_eager"]
    assert abs(l0 - l1) <= 1e-2 * abs(l0)
    assert g0.keys() == g1.keys() and g0
    for n in g0:
        assert (g0[n] - g1[n]).abs().max().item() <= 0.05 * g0[n].abs().max().item(), n


def test_a_rebuilt_extension_gets_graphs_of_its_own_from_the_compile_caches(tmp_path, monkeypatch):
    """torch.compile's caches treat this package's ops as cache-safe and a compiled block holds them whole at dynamo's
    level, so a rebuilt extension whose C++ nodes trace to other ATen ops would be served the graphs compiled before.
    The compiled blocks' settings put the extension's build into the keys: the same build hits, another one misses."""
    from torch._dynamo.utils import counters

    from trainstream_hf import ops
    from trainstream_hf.engine import compiled as compiled_blocks

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x = torch.randn(16, 64, requires_grad=True)

    def step(x):  # one of this package's ops with a C++ autograd node: the graph AOTAutograd caches
        return ops.rms_norm(x, torch.ones(64), 1e-6).square().sum()

    def hits(build: str) -> int:
        monkeypatch.setattr(compiled_blocks, "build_identity", lambda: build)
        torch._dynamo.reset()
        counters.clear()
        torch.compile(step, backend=compiled_blocks._backend("inductor"))(x).backward()
        # the AOTAutograd cache: keyed on dynamo's graph, where this package's ops are whole (inductor's own cache is
        # keyed on the traced graph's code, which a changed C++ node changes anyway)
        return counters["aot_autograd"]["autograd_cache_hit"]

    with torch._inductor.config.patch(fx_graph_cache=True), torch._functorch.config.patch(enable_autograd_cache=True):
        assert hits("build 1") == 0
        assert hits("build 1") > 0
        assert hits("build 2") == 0


def test_a_second_wrap_reuses_the_compiled_graph():
    """The settings compiled regions need travel with one backend object per backend (entered where dynamo compiles,
    not around every block call): a second model of the same shape, wrapped later, meets no backend-mismatch
    recompilation."""
    from torch._dynamo.utils import counters

    ids = _batches(1)[0]
    for round_ in range(2):
        if round_:
            counters.clear()
        model, _ = ts.wrap(_llama(), None, device="cpu", vram_budget="8GiB", host_arena=None,
                           compile_blocks="aot_eager", batch_shape=tuple(ids.shape))
        model(input_ids=ids, labels=ids).loss.backward()
        ts.unwrap(model)
    assert not counters["stats"]["unique_graphs"] and not counters["recompiles"], dict(counters)


def test_torch_compile_of_a_wrapped_model_with_paged_weights_trains_as_eager():
    """torch.compile over the whole wrapped model (the Trainer's torch_compile=True) with paged block weights: the
    blocks run outside the enclosing graph (the pager swaps their parameters' data, which a traced graph cannot
    follow; traced, the step failed in dynamo's fake tensors), the graph covers what lies around them, and training
    gives eager's losses and weights bit for bit. Unwrap gives the blocks their forwards back."""
    from torch._dynamo.utils import counters

    ids = _batches(1)[0]
    runs = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        model = _lora_over("nf4", 3)  # (a bf16 full fine-tune, its weights trainable and paged, failed the same way)
        forwards = [b.__dict__.get("forward") for b in model.modules() if type(b).__name__ == "LlamaDecoderLayer"]
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        model, opt = ts.wrap(model, opt, device="cpu", vram_budget="8GiB", host_arena=None, page_weights=True,
                             min_offload_numel=0, batch_shape=tuple(ids.shape))
        assert model.trainstream_plan.paged_blocks
        run = torch.compile(model, backend="aot_eager") if compiled else model
        counters.clear()
        losses = []
        for _ in range(2):
            loss = run(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        if compiled:
            assert counters["stats"]["unique_graphs"] >= 1 and counters["graph_break"], dict(counters["stats"])
        ts.unwrap(model)
        assert [b.__dict__.get("forward") for b in model.modules()
                if type(b).__name__ == "LlamaDecoderLayer"] == forwards
        runs[compiled] = (losses, [p.detach().clone() for p in model.parameters()])
    assert runs[True][0] == runs[False][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[True][1], runs[False][1]))
