"""host_embedding: a frozen input embedding's table in host RAM, its rows gathered per batch (engine/embedding.py).

On the CPU compute device host_embedding=True runs the whole path (the placeholder parameter, the gathering forward
through ops.embedding_from_host's CPU kernel, the state-dict hooks, unwrap); the CUDA kernel, which reads the pinned
table from the GPU, is checked in tests/gpu/test_embedding_cuda.py."""
import copy
import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model

import trainstream_hf as ts
from trainstream_hf import ops, planner
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


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_the_op_gives_nn_embeddings_rows(dtype):
    table = torch.randn(50, 12, dtype=torch.bfloat16)
    ids = torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(0)).to(dtype)
    out = ops.embedding_from_host(ids, table)
    assert out.shape == (3, 7, 12) and torch.equal(out, torch.nn.functional.embedding(ids.long(), table))
    with pytest.raises((IndexError, RuntimeError)):
        ops.embedding_from_host(torch.tensor([50]), table)
    with pytest.raises(TypeError, match="ids must be int64 or int32"):
        ops.embedding_from_host(ids.float(), table)
    with pytest.raises(ValueError, match=r"weight must be \(vocab, dim\)"):
        ops.embedding_from_host(ids, table[0])


def test_the_wrapped_model_trains_bit_for_bit_with_the_table_in_host_ram():
    ref, model = _lora(), _lora()
    table = model.get_input_embeddings().weight.detach().clone()
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, opt = ts.wrap(model, opt, host_embedding=True, **OPTS)
    plan = ts.engine_of(model).plan
    assert plan.host_embedding_bytes == table.numel() * table.element_size()
    assert "input embedding in host RAM (32.0 KiB)" in str(plan).splitlines()[0]
    weight = model.get_input_embeddings().weight
    assert weight.numel() == 0 and getattr(weight, HOSTED_ATTR) and weight.device.type == "cpu"
    for a, b in zip(_train(ref, ref_opt), _train(model, opt)):
        assert torch.equal(a, b)
    for (n, p), q in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(p, q) or p.shape != q.shape, n  # every trained weight the same; the table is elsewhere
    # the state dict holds the table, and a load writes into it
    state = model.state_dict()
    key = next(k for k in state if k.endswith("embed_tokens.weight"))
    assert torch.equal(state[key], table)
    state[key] = table * 2
    model.load_state_dict(state)
    assert torch.equal(model.state_dict()[key], table * 2)
    assert torch.equal(ops.embedding_from_host(torch.tensor([3]), ts.engine_of(model).host_embedding.host)[0],
                       table[3] * 2)
    ts.unwrap(model)
    weight = model.get_input_embeddings().weight
    assert not hasattr(weight, HOSTED_ATTR) and torch.equal(weight, table * 2)
    assert "forward" not in model.get_input_embeddings().__dict__


def test_a_tied_or_trainable_embedding_stays_on_the_device():
    tied = _lora(tie_word_embeddings=True)
    assert hostable(tied) is None
    with pytest.warns(RuntimeWarning, match="host_embedding=True: the input embedding stays on the device"):
        tied, _ = ts.wrap(tied, None, host_embedding=True, **OPTS)
    assert ts.engine_of(tied).plan.host_embedding_bytes == 0 and tied.get_input_embeddings().weight.numel() > 0
    ts.unwrap(tied)
    full = tiny_llama(3, vocab=128, positions=64)
    assert hostable(full) is None  # trainable


def test_auto_keeps_it_on_a_cpu_device_and_false_never_moves_it():
    for setting in ("auto", False):
        model = _lora()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model, _ = ts.wrap(model, None, host_embedding=setting, offload_activations=True, min_activation_bytes=0,
                               **OPTS)
        assert ts.engine_of(model).host_embedding is None and model.get_input_embeddings().weight.numel() > 0
        ts.unwrap(model)


def test_the_plan_counts_the_table_on_the_host_not_the_device():
    model = _lora()
    emb = hostable(model)
    on_device = planner.plan(model, list(model.base_model.model.model.layers), batch_shape=(2, 16),
                                vram_budget="8GiB", device="cpu")
    hosted = planner.plan(model, list(model.base_model.model.model.layers), batch_shape=(2, 16),
                             vram_budget="8GiB", device="cpu", host_embedding=emb)
    nbytes = emb.weight.numel() * emb.weight.element_size()
    assert on_device.fixed_bytes - hosted.fixed_bytes == nbytes
    assert hosted.host_bytes() - on_device.host_bytes() == nbytes


def test_a_compiled_model_traces_the_gather():
    model = _lora()
    ref = copy.deepcopy(model)
    model, _ = ts.wrap(model, None, host_embedding=True, **OPTS)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=False)
    with torch.no_grad():
        assert torch.equal(compiled(input_ids=ids).logits, ref(input_ids=ids).logits)
    ts.unwrap(model)
