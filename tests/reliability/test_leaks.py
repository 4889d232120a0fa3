"""Nothing accumulates: wrap/unwrap, failed wraps, and wrapped models dropped without unwrap (the optimizer's worker
thread and gc callback included) leave host arena bytes, RSS, threads, file descriptors, gc callbacks and
``/dev/shm`` flat."""
import ctypes
import gc
import glob
import os
import threading
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import trainstream_hf as ts
from trainstream_hf.engine.arena import HostArena
from trainstream_hf.wrap import Engine

ROUNDS = 3
IDS = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(0))
# ~3.7 M parameters (15 MB in fp32): a model, its arena or its optimizer state kept per round shows in RSS
# (measured after malloc_trim, RSS stays within 1 MiB from round to round)
RSS_SLACK = 8 << 20


def _llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=1000))


def _rss() -> int:
    """Resident bytes, after glibc gave back the free memory it keeps (per-thread malloc arenas made by the
    optimizer's worker threads would otherwise make RSS swing by tens of MiB from round to round)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS as it is
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _live(cls) -> list:
    return [o for o in gc.get_objects() if isinstance(o, cls)]


def _resources() -> dict:
    """Counts that must come back to where they were, waited for briefly (a worker thread ends on its own).

    Only this process's ``/dev/shm`` segments count: tests running beside it in other processes make and remove
    their own."""
    deadline = time.monotonic() + 10
    while True:
        gc.collect()
        r = {"engines": len(_live(Engine)),
             "arena_bytes": sum(a.stats()["reserved"] for a in _live(HostArena)),
             "threads": len(os.listdir("/proc/self/task")), "python_threads": threading.active_count(),
             "fds": len(os.listdir("/proc/self/fd")), "gc_callbacks": len(gc.callbacks),
             "shm": len(glob.glob(f"/dev/shm/trainstream-{os.getpid()}-*"))}
        if r["engines"] == 0 or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def _train(model, opt, steps=2):
    for _ in range(steps):
        model(input_ids=IDS, labels=IDS).loss.backward()
        opt.step()
        opt.zero_grad()


OPTIONS = {
    "pages": dict(vram_budget="64GiB", batch_shape=(2, 32), page_weights=True, offload_optimizer=True,
                  min_offload_numel=0, offload_activations=True, min_activation_bytes=0, host_arena="auto"),
    "in_backward": dict(vram_budget="64GiB", batch_shape=(2, 32), offload_optimizer=True, min_offload_numel=0,
                        optimizer_in_backward=True, host_arena="auto"),
}


def _wrap_unwrap(options):
    model = _llama()
    model, opt = ts.wrap(model, torch.optim.AdamW(model.parameters()), **options)
    _train(model, opt)
    ts.unwrap(model)


def _drop(options):
    model = _llama()
    model, opt = ts.wrap(model, torch.optim.AdamW(model.parameters()), **options)
    _train(model, opt)
    del model, opt  # no unwrap


def _failed_wrap(options):
    model = _llama()
    with pytest.raises(ts.BudgetError):
        ts.wrap(model, torch.optim.AdamW(model.parameters()), **dict(options, vram_budget="1KiB"))


def _failed_late(options, monkeypatch):
    from trainstream_hf.engine.optimizer import OffloadedAdamW

    model = _llama()
    with monkeypatch.context() as mp:
        mp.setattr(OffloadedAdamW, "set_param_names", lambda *a: (_ for _ in ()).throw(RuntimeError("late")))
        with pytest.raises(RuntimeError, match="late"):
            ts.wrap(model, torch.optim.AdamW(model.parameters()), **options)


@pytest.mark.parametrize("options", sorted(OPTIONS))
@pytest.mark.parametrize("cycle", ["wrap_unwrap", "drop_without_unwrap", "failed_wrap", "failed_late"])
def test_nothing_accumulates(cycle, options, monkeypatch):
    run = {"wrap_unwrap": _wrap_unwrap, "drop_without_unwrap": _drop, "failed_wrap": _failed_wrap,
           "failed_late": lambda o: _failed_late(o, monkeypatch)}[cycle]
    torch.set_num_threads(2)  # (tests/conftest.py sets 1 back after the test)
    run(OPTIONS[options])  # first round: one-time allocations (kernels, thread pools, caches)
    start, rss0 = _resources(), _rss()
    for _ in range(ROUNDS):
        run(OPTIONS[options])
    end, rss1 = _resources(), _rss()
    assert end == start, f"after {ROUNDS} rounds of {cycle}: {start} -> {end}"
    assert rss1 - rss0 < RSS_SLACK, f"RSS grew by {(rss1 - rss0) / 2**20:.0f} MiB over {ROUNDS} rounds of {cycle}"
