"""Data parallel on the CPU: 2 processes (torchrun, gloo), each wraps its replica, DDP around it; the losses and the
final weights match one process trained on the whole global batch (plain torch AdamW) to 1e-5.

The replicas start from different random weights (seed = rank), so a match also shows that rank 0's values reached
everything the engine holds outside DDP's view (paged host weights, fp32 optimizer masters).
"""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import trainstream_hf as ts
from trainstream_hf.config import TrainStreamConfig
from trainstream_hf.engine import distributed

WORKER = Path(__file__).resolve().parent / "ddp_worker.py"
_spec = importlib.util.spec_from_file_location("ddp_worker", WORKER)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

TRAINED = ["full_device", "full_auto_accum", "lora_paged", "lora_paged_accum", "lora_private", "lora_peer_fallback"]
REFUSED = ["full_host", "full_paged", "plan_differs", "ddp_first", "peer_required_fails"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    # --standalone: torchrun picks a free port itself (parallel CI jobs cannot collide)
    res = worker.launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                         str(WORKER), str(out), *TRAINED, *REFUSED], out)
    return {name: [r[name] for r in res] for name in TRAINED + REFUSED}


@pytest.mark.parametrize("name", TRAINED)
def test_ddp_matches_one_process_on_the_global_batch(ranks, name):
    worker.check_matches_one_process(ranks[name], worker.SCENARIOS[name][0], worker.reference(name))
    info = ranks[name][0]["info"]
    if name.startswith("full"):
        # (a) full fine-tune, optimizer state of every parameter on the host; 'auto' gradients are device ones
        assert info["optimizer"] == "OffloadedAdamW" and info["grads"] == "device" and info["paged_params"] == 0
    elif name == "lora_peer_fallback":
        assert info["paged_blocks"] == [0, 1, 2] and info["stats"]["h2d_bytes"] > 0
    else:
        # (b) LoRA over a paged frozen base, activations offloaded: weights and activations crossed to the device
        assert info["paged_blocks"] == [0, 1, 2] and info["offloaded_activations"] == [0, 1, 2]
        assert info["paged_params"] == 27 and info["stats"]["h2d_bytes"] > 0 and info["stats"]["d2h_bytes"] > 0


@pytest.mark.parametrize("name, message", [
    ("full_host", "grads='host' cannot be used with several processes"),
    ("full_paged", "page_weights: 27 trainable parameters would be paged"),
    ("plan_differs", "the plan differs between processes: paged differs between rank 0 and rank 1"),
    ("ddp_first", "already inside DistributedDataParallel; wrap the model first"),
    ("peer_required_fails", "peer=True: rank 1 could not share host memory with its host's other processes: "
                            "injected: cannot open"),
])
def test_ddp_refusals_are_clear_and_on_every_rank(ranks, name, message):
    for k, res in enumerate(ranks[name]):
        assert message in res.get("error", ""), f"rank {k}: {res}"


def test_peer_auto_keeps_one_host_copy_of_the_frozen_base(ranks):
    """peer='auto' (the default): rank 0 fills one shared segment with the paged frozen base, rank 1 maps the same
    pages (same inode, each process's proportional share of them is half) and never writes them; neither arena holds
    the paged weights any more; the mapping goes with unwrap. peer=False: each process holds its own copy."""
    shared, private = [r["info"] for r in ranks["lora_paged"]], [r["info"] for r in ranks["lora_private"]]
    paged = shared[0]["paged_bytes"]
    assert paged > 100_000 and shared[1]["paged_bytes"] == paged
    s0, s1 = shared[0]["shared"], shared[1]["shared"]
    assert (s0["writer"], s1["writer"]) == (True, False) and s0["processes"] == s1["processes"] == 2
    assert s0["name"] == s1["name"] and s0["nbytes"] == s1["nbytes"] and paged <= s0["nbytes"] < paged + 3 * 4096
    m0, m1 = shared[0]["mapping"], shared[1]["mapping"]
    assert m0["inode"] is not None and m0["inode"] == m1["inode"]
    pages_kb = s0["nbytes"] / 1024
    assert abs(m0["pss_kb"] + m1["pss_kb"] - pages_kb) <= 0.05 * pages_kb, (m0, m1, pages_kb)
    assert max(m0["pss_kb"], m1["pss_kb"]) <= 0.55 * pages_kb
    for k in range(2):
        assert shared[k]["stats"]["host_shared_bytes"] == s0["nbytes"] and shared[k]["shared_after_unwrap"] == 0
        # the arena (activations, no weights) is lighter by at least the paged weights than with peer=False
        assert private[k]["shared"] is None and private[k]["stats"]["host_shared_bytes"] == 0
        assert private[k]["arena_used"] - shared[k]["arena_used"] >= paged, (private[k], shared[k])
        assert not shared[k]["warnings"] and not private[k]["warnings"]


def test_frozen_parameters_are_sent_by_the_engine_not_ddp(ranks):
    """Under LoRA the frozen base is left out of DDP (its initial broadcast cannot send float8 codes over gloo, nor
    paged placeholders): wrap sends rank 0's frozen values itself, as bytes -- the replicas start from different
    seeds, so the match with one process (test_ddp_matches_one_process_on_the_global_batch) shows they arrived --
    and unwrap takes DDP's ignore list off the model again."""
    for name in ("lora_paged", "lora_private"):
        for k, res in enumerate(ranks[name]):
            assert res["info"]["ddp_ignores_the_frozen"], (name, k)
            assert not res["info"]["ddp_ignore_after_unwrap"], (name, k)


def test_peer_auto_falls_back_to_a_private_copy(ranks):
    """Rank 1 cannot map the segment (injected): it warns, keeps its own copy, and the run still matches one process
    (test_ddp_matches_one_process_on_the_global_batch[lora_peer_fallback])."""
    r0, r1 = (r["info"] for r in ranks["lora_peer_fallback"])
    assert r0["shared"]["writer"] and r0["shared"]["processes"] == 1 and r1["shared"] is None
    assert r1["arena_used"] >= r1["paged_bytes"] > 0
    assert len(r1["warnings"]) == 1 and "keeps its own host copy" in r1["warnings"][0]
    assert "injected: cannot open" in r1["warnings"][0] and not r0["warnings"]


def test_data_parallel_option():
    with pytest.raises(ValueError, match="data_parallel: 'auto', True or False"):
        TrainStreamConfig(data_parallel="yes")
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="data_parallel=True: torch.distributed is not initialized"):
        distributed.process_group(True, "device")
    assert distributed.process_group("auto", "host") is None  # one process: nothing changes
    model = worker.build("full", 0)
    model, opt = ts.wrap(model, torch.optim.AdamW(model.parameters()), grads="host", offload_optimizer=True,
                         min_offload_numel=0, **worker.ENGINE)
    assert opt.grads_mode == "host"
    ts.unwrap(model)


def test_exit_handler_is_registered_once_and_waits_only_under_a_process_group(monkeypatch):
    """settle_collectives_at_exit: one atexit handler per process, whatever the number of wraps; it releases the GIL
    (sleeps) only while a process group exists, so gloo's worker threads can finish before finalization."""
    registered, slept = [], []
    monkeypatch.setattr(distributed, "_SETTLE_REGISTERED", False)
    monkeypatch.setattr(distributed.atexit, "register", registered.append)
    monkeypatch.setattr(distributed.time, "sleep", slept.append)
    distributed.settle_collectives_at_exit()
    distributed.settle_collectives_at_exit()
    assert registered == [distributed._settle]
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    distributed._settle()
    assert slept == []
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    distributed._settle()
    assert slept == [distributed.SETTLE_SECONDS]
