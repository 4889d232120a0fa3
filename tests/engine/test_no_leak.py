"""A forward pass with grad enabled whose backward never runs must not leak its activations (saved-tensor hooks
that hold a node's own output make a reference cycle through C++ that Python's gc cannot collect)."""
import weakref

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import trainstream_hf as ts
from trainstream_hf import planner


def _llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=100))


def _watch(model):
    refs = []
    model.model.layers[0].register_forward_hook(
        lambda m, a, o: refs.append(weakref.ref(o if isinstance(o, torch.Tensor) else o[0])))
    return refs


def test_measure_block_leaves_nothing_alive():
    model = _llama()
    refs = _watch(model)
    planner.measure_block(model, model.model.layers[1], (1, 32), torch.device("cpu"))
    assert refs and all(r() is None for r in refs)


def test_wrapped_forward_without_backward_leaves_nothing_alive():
    model = _llama()
    model, _ = ts.wrap(model, None, vram_budget="64GiB", host_arena=None)
    refs = _watch(model)
    ids = torch.randint(0, 100, (1, 16))
    model(input_ids=ids)       # grad enabled, no backward (e.g. an evaluation pass without no_grad)
    assert refs and all(r() is None for r in refs)
    ts.unwrap(model)


def test_a_model_dropped_without_unwrap_leaves_no_gc_callback():
    import gc

    model, _ = ts.wrap(_llama(), None, vram_budget="64GiB", host_arena=None)
    pauses = ts.engine_of(model)._gc  # the engine counts GC pauses per step through a gc callback
    assert pauses._callback in gc.callbacks
    engine = weakref.ref(ts.engine_of(model))
    del model
    gc.collect()
    assert engine() is None and pauses._callback not in gc.callbacks
