"""peer='auto' on the GPU: two processes (gloo, both on GPU 0) share one page-locked host copy of a paged frozen
base, registered with CUDA in each, and train to the same bits as with a private pinned copy each (peer=False).

One GPU is enough for this: what is tested is the host side (one segment, registered in two CUDA contexts, read by
both processes' H2D copies). NCCL over two GPUs is tests/gpu/test_ddp_cuda.py's business where two GPUs exist.
"""
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).resolve().parents[1] / "engine" / "ddp_worker.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("ddp_worker_cuda", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    out = tmp_path_factory.mktemp("peer_cuda")
    os.environ["DDP_WORKER_DEVICE"] = "cuda"
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    try:
        res = worker.launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             str(WORKER), str(out), "lora_paged", "lora_private"], out, timeout=400)
    finally:
        del os.environ["DDP_WORKER_DEVICE"]
    return {name: [r[name] for r in res] for name in ("lora_paged", "lora_private")}


def test_shared_pinned_copy_trains_to_the_same_bits(ranks):
    for name in ("lora_paged", "lora_private"):
        for k, r in enumerate(ranks[name]):
            assert "error" not in r, f"{name} rank {k}: {r.get('traceback')}"
    shared, private = ranks["lora_paged"], ranks["lora_private"]
    for k in range(2):
        s = shared[k]["info"]["shared"]
        assert s is not None and s["pinned"] and s["processes"] == 2 and s["writer"] == (k == 0)
        assert s["pinned_bytes"] >= s["nbytes"] >= shared[k]["info"]["paged_bytes"] > 0
        assert private[k]["info"]["shared"] is None
        assert shared[k]["info"]["stats"]["h2d_bytes"] > 0 and shared[k]["info"]["shared_after_unwrap"] == 0
        assert shared[k]["losses"] == private[k]["losses"]
        for n, p in shared[k]["params"].items():
            assert torch.equal(p, private[k]["params"][n]), n
    a, b = shared[0]["params"], shared[1]["params"]
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert shared[0]["info"]["mapping"]["inode"] == shared[1]["info"]["mapping"]["inode"] is not None
