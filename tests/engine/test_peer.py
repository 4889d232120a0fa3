"""Shared host memory (csrc/runtime/shared_host.cpp) and the peer option in one process; two processes sharing a
frozen base are tested in tests/engine/test_distributed.py."""
import importlib.util
import multiprocessing as mp
import os
import secrets
from pathlib import Path

import pytest
import torch

import trainstream_hf as ts
from trainstream_hf import _C
from trainstream_hf.engine import peer


def _name():
    return f"/trainstream-test-{os.getpid()}-{secrets.token_hex(4)}"


def _write_in_child(name, nbytes):
    t = _C.shared_host_open(name, nbytes, False)
    t[100:104] = torch.tensor([7, 8, 9, 10], dtype=torch.uint8)


def test_a_segment_is_the_same_memory_in_another_process():
    name, n = _name(), 3 * 4096
    t = _C.shared_host_create(name, n, False)
    try:
        assert t.dtype == torch.uint8 and t.shape == (n,) and not t.is_pinned()
        assert int(t.sum()) == 0  # fresh pages are zero
        before = peer.shared_bytes()
        child = mp.get_context("spawn").Process(target=_write_in_child, args=(name, n))
        child.start()
        child.join(60)
        assert child.exitcode == 0
        assert t[100:104].tolist() == [7, 8, 9, 10]
        assert peer.shared_bytes() == before
    finally:
        assert _C.shared_host_unlink(name)
    assert not _C.shared_host_unlink(name)  # gone from /dev/shm; the mapping stays valid
    t[0] = 5
    assert int(t[0]) == 5
    before = peer.shared_bytes()
    del t
    assert peer.shared_bytes() == before - n  # unmapped with the tensor


def test_segment_errors_are_clear():
    name = _name()
    with pytest.raises(RuntimeError, match="shm_open of '/trainstream-test-.*': No such file"):
        _C.shared_host_open(name, 4096, False)
    t = _C.shared_host_create(name, 4096, False)
    try:
        with pytest.raises(RuntimeError, match="File exists"):
            _C.shared_host_create(name, 4096, False)
        with pytest.raises(RuntimeError, match="holds 4096 bytes, expected 8192"):
            _C.shared_host_open(name, 8192, False)
    finally:
        _C.shared_host_unlink(name)
    del t
    for bad in ("no-slash", "/a/b", "/"):
        with pytest.raises(RuntimeError, match="the name must be '/' followed by"):
            _C.shared_host_create(bad, 4096, False)
    with pytest.raises(RuntimeError, match="nbytes must be > 0"):
        _C.shared_host_create(name, 0, False)


def test_a_segment_larger_than_dev_shm_is_refused_and_leaves_nothing():
    name = _name()
    with pytest.raises(RuntimeError, match="cannot reserve .* /dev/shm is too small"):
        _C.shared_host_create(name, 1 << 50, False)  # 1 PiB: posix_fallocate fails, no SIGBUS later
    with pytest.raises(RuntimeError, match="No such file"):
        _C.shared_host_open(name, 1 << 50, False)


@pytest.mark.skipif(_C.built_with_cuda(), reason="a CUDA build pins (registration is tested on the GPU)")
def test_pinning_needs_cuda():
    name = _name()
    with pytest.raises(RuntimeError, match="pinning needs a CUDA build"):
        _C.shared_host_create(name, 4096, True)
    assert not _C.shared_host_unlink(name)  # removed on failure


def test_peer_option_alone():
    assert peer.Peers.find(None, "auto") is None and peer.Peers.find(None, False) is None
    with pytest.raises(ValueError, match="peer=True shares host memory between the processes"):
        peer.Peers.find(None, True)
    spec = importlib.util.spec_from_file_location("ddp_worker", Path(__file__).resolve().parent / "ddp_worker.py")
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    model = worker.build("lora", 0)
    with pytest.raises(ValueError, match="peer=True shares host memory"):
        ts.wrap(model, vram_budget="64GiB", host_arena=None, page_weights=True, peer=True)
    assert ts.engine_of(model) is None
    with pytest.raises(ValueError, match="peer: 'auto', True or False"):
        ts.TrainStreamConfig(peer="yes")
    assert "/" in peer.host_key()
