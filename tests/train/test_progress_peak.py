"""The alignment recipes' peak memory: the training steps' peak, read at each step's end (the engine resets CUDA's
counters at its own step starts), the model's loading left out, the same way for every trainer."""
from types import SimpleNamespace

import torch

from trainstream_hf.train import align


def test_train_peak_is_the_max_over_steps_after_one_reset(monkeypatch):
    readings = iter([5, 9, 7])  # max_memory_allocated at each step's end (each since a reset by the engine)
    resets = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: resets.append(a))
    reading = {}

    def allocated(*a):
        reading["last"] = next(readings)
        return reading["last"]

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: reading["last"] + 1)
    p = align.Progress("t", {})
    p.bar = SimpleNamespace(update=lambda n: None)
    state = SimpleNamespace(max_steps=3)
    for _ in range(3):
        p.on_step_begin(None, state, None)
        p.on_step_end(None, state, None)
    assert len(resets) == 1  # at the first step's start: loading the model is not part of the peak
    assert p.train_peak["bytes"] == 9 and p.train_peak["reserved_bytes"] == 10


def test_no_train_peak_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    p = align.Progress("t", {})
    p.bar = SimpleNamespace(update=lambda n: None)
    p.on_step_begin(None, SimpleNamespace(max_steps=1), None)
    p.on_step_end(None, SimpleNamespace(max_steps=1), None)
    assert p.train_peak is None  # the summary then reports the process's peak (max RSS on the CPU)
