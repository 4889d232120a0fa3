"""Data parallel on two GPUs (torchrun, NCCL, rank r on GPU r): each process wraps its replica, DDP around it; the
losses and the final weights match one GPU trained on the whole global batch to 1e-5 (fp32), for a full fine-tune
with host optimizer state and for LoRA over a paged frozen base whose host copy the two processes share (peer).

Needs two GPUs (skipped with one: tests/gpu/test_peer_cuda.py covers the shared pinned copy on one GPU). NCCL's
NVLink multicast stays off (scripts/gpu_check.sh exports NCCL_NVLS_ENABLE=0 and its two companions).
"""
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).resolve().parents[1] / "engine" / "ddp_worker.py"
NAMES = ["full_device", "full_auto_accum", "lora_paged", "lora_paged_accum"]

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


def _worker():
    spec = importlib.util.spec_from_file_location("ddp_worker_nccl", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    return worker


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_nccl")
    env = {"DDP_WORKER_DEVICE": "nccl", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    try:
        res = _worker().launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                "2", str(WORKER), str(out), *NAMES], out, timeout=400)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return {name: [r[name] for r in res] for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_nccl_ddp_matches_one_gpu_on_the_global_batch(ranks, name):
    worker = _worker()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        ref = worker.reference(name, device="cuda:0")
    finally:
        torch.use_deterministic_algorithms(False)
    worker.check_matches_one_process(ranks[name], worker.SCENARIOS[name][0], ref)
    if name.startswith("lora"):
        for k, r in enumerate(ranks[name]):
            shared = r["info"]["shared"]
            assert shared is not None and shared["pinned"] and shared["writer"] == (k == 0), shared
