"""host_embedding: a frozen input embedding's table in pinned host RAM, the parameter a CUDA tensor over it
(engine/embedding.py).

The CPU compute device has nothing to move (its tables are in host RAM), so ``wrap`` hosts nothing there; the tests
below check the wiring (which embeddings qualify, when the plan is made again without the table, the parameter's data
given back at unwrap) with the device mapping stood in by the host tensor itself. The mapping and the device memory
it saves are checked on the GPU (tests/gpu/test_embedding_cuda.py)."""
import importlib
import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model

import trainstream_hf as ts
from trainstream_hf import planner
from trainstream_hf.engine import embedding
from trainstream_hf.engine.embedding import HOSTED_ATTR, hostable
from tests.helpers import tiny_llama

OPTS = dict(device="cpu", vram_budget="8GiB", host_arena=None)


def _lora(seed=0, **config):
    model = get_peft_model(tiny_llama(3, vocab=128, positions=64, seed=seed, **config),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    g = torch.Generator().manual_seed(3)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _train(model, opt, steps=3):
    losses = []
    for s in range(steps):
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(s))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


@pytest.fixture
def mapped(monkeypatch):
    """The CPU device treated as one that reads host memory in place, the mapping the host tensor itself; records
    each table mapped."""
    seen = []

    def map_to_device(host, device):
        seen.append(host)
        return host

    # (the module: the package's `wrap` is the function)
    monkeypatch.setattr(importlib.import_module("trainstream_hf.wrap"), "_maps_host_memory", lambda device: True)
    monkeypatch.setattr(embedding, "map_to_device", map_to_device)
    return seen


def test_which_embeddings_qualify():
    assert hostable(_lora()) is not None
    assert hostable(_lora(tie_word_embeddings=True)) is None  # the head reads the whole table
    assert hostable(tiny_llama(3, vocab=128, positions=64)) is None  # trainable


def test_the_wrapped_model_trains_the_same_with_the_table_mapped(mapped):
    ref, model = _lora(), _lora()
    table = model.get_input_embeddings().weight.detach().clone()
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, opt = ts.wrap(model, opt, host_embedding=True, **OPTS)
    engine = ts.engine_of(model)
    assert engine.plan.host_embedding_bytes == table.numel() * table.element_size()
    assert "input embedding in host RAM (32.0 KiB)" in str(engine.plan).splitlines()[0]
    weight = model.get_input_embeddings().weight
    assert len(mapped) == 1 and weight.data_ptr() == mapped[0].data_ptr() and getattr(weight, HOSTED_ATTR)
    assert torch.equal(weight, table)
    for a, b in zip(_train(ref, ref_opt), _train(model, opt)):
        assert torch.equal(a, b)
    ts.unwrap(model)
    weight = model.get_input_embeddings().weight
    assert not hasattr(weight, HOSTED_ATTR) and torch.equal(weight, table)
    assert weight.data_ptr() != mapped[0].data_ptr()  # a copy of its own again


def test_auto_maps_it_only_when_the_plan_moves_something(mapped):
    for options, hosted in ((dict(), False), (dict(offload_activations=True, min_activation_bytes=0), True)):
        model = _lora()
        model, _ = ts.wrap(model, None, **options, **OPTS)
        assert (ts.engine_of(model).host_embedding is not None) == hosted, options
        ts.unwrap(model)


def test_the_cpu_device_and_a_tied_table_stay_as_they_are():
    for setting in ("auto", False):
        model = _lora()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model, _ = ts.wrap(model, None, host_embedding=setting, offload_activations=True, min_activation_bytes=0,
                               **OPTS)
        assert ts.engine_of(model).host_embedding is None
        ts.unwrap(model)
    model = _lora()
    with pytest.warns(RuntimeWarning, match="host_embedding=True: the input embedding stays where it is: the compute "
                                            "device is the CPU"):
        model, _ = ts.wrap(model, None, host_embedding=True, **OPTS)
    ts.unwrap(model)


def test_a_tied_table_asked_for_is_a_warning(mapped):
    tied = _lora(tie_word_embeddings=True)
    with pytest.warns(RuntimeWarning, match="stays where it is: only a frozen nn.Embedding that no other module"):
        tied, _ = ts.wrap(tied, None, host_embedding=True, **OPTS)
    assert ts.engine_of(tied).plan.host_embedding_bytes == 0 and not mapped
    ts.unwrap(tied)


def test_the_plan_counts_the_table_on_the_host_not_the_device():
    model = _lora()
    emb = hostable(model)
    layers = list(model.base_model.model.model.layers)
    on_device = planner.plan(model, layers, batch_shape=(2, 16), vram_budget="8GiB", device="cpu")
    hosted = planner.plan(model, layers, batch_shape=(2, 16), vram_budget="8GiB", device="cpu", host_embedding=emb)
    nbytes = emb.weight.numel() * emb.weight.element_size()
    assert on_device.fixed_bytes - hosted.fixed_bytes == nbytes
    assert hosted.host_bytes() - on_device.host_bytes() == nbytes


def test_auto_maps_it_when_only_that_makes_the_plan_fit(mapped, monkeypatch):
    """A budget the plan cannot meet with the table on the device, but can without it: 'auto' maps the table rather
    than refuse; a budget it cannot meet either way is still refused."""
    real = planner.plan

    def tight(*args, host_embedding=None, **kwargs):
        if host_embedding is None:
            raise planner.BudgetError("does not fit with the table on the device")
        return real(*args, host_embedding=host_embedding, **kwargs)

    monkeypatch.setattr(planner, "plan", tight)
    model, _ = ts.wrap(_lora(), None, **OPTS)
    assert ts.engine_of(model).host_embedding is not None and ts.engine_of(model).plan.host_embedding_bytes > 0
    ts.unwrap(model)
    model = _lora()
    with pytest.raises(planner.BudgetError, match="with the table on the device"):
        ts.wrap(model, None, host_embedding=False, **OPTS)
    assert ts.engine_of(model) is None and not mapped[1:]
