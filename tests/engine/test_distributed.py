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

TRAINED = ["full_device", "full_auto_accum", "lora_paged", "lora_paged_accum"]
REFUSED = ["full_host", "full_paged", "plan_differs", "ddp_first"]


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
    else:
        # (b) LoRA over a paged frozen base, activations offloaded: weights and activations crossed to the device
        assert info["paged_blocks"] == [0, 1, 2] and info["offloaded_activations"] == [0, 1, 2]
        assert info["paged_params"] == 27 and info["stats"]["h2d_bytes"] > 0 and info["stats"]["d2h_bytes"] > 0


@pytest.mark.parametrize("name, message", [
    ("full_host", "grads='host' cannot be used with several processes"),
    ("full_paged", "page_weights: 27 trainable parameters would be paged"),
    ("plan_differs", "the plan differs between processes: paged differs between rank 0 and rank 1"),
    ("ddp_first", "already inside DistributedDataParallel; wrap the model first"),
])
def test_ddp_refusals_are_clear_and_on_every_rank(ranks, name, message):
    for k, res in enumerate(ranks[name]):
        assert message in res.get("error", ""), f"rank {k}: {res}"


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
