"""Shared test settings."""
import importlib.util
from pathlib import Path

import pytest
import torch

# The shared helpers assert too: rewrite them, so that their failures show the values as a test's own asserts do.
pytest.register_assert_rewrite("tests.helpers")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """One intra-op thread for the whole run: CI machines have 2 cores shared with other jobs, where
    2-thread matmuls on tiny tensors ran over 100x slower. Tests that are about threading set their own
    count and restore it."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(autouse=True)
def _threads_restored():
    """A test that sets its own thread count does not pass it on: with two pytest workers on two cores, every later
    test of its worker ran 2-thread matmuls beside the other worker (a recipe test took 49 s instead of 8 s)."""
    yield
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def _train_side_by_side(ref, model, ref_opt, opt, batches):
    """Steps ``ref`` and the wrapped ``model`` on the same batches (token ids, used as labels too): each step's loss
    and every parameter gradient must be ``torch.equal``. Without optimizers the gradients are only reset."""
    for ids in batches:
        la = ref(input_ids=ids, labels=ids).loss
        la.backward()
        lb = model(input_ids=ids, labels=ids).loss
        lb.backward()
        assert torch.equal(la, lb)
        for (n, p), q in zip(ref.named_parameters(), model.parameters()):
            if p.grad is not None or q.grad is not None:
                assert p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad), n
        for m, o in ((ref, ref_opt), (model, opt)):
            if o is not None:
                o.step()
                o.zero_grad()
            else:
                for p in m.parameters():
                    p.grad = None


@pytest.fixture
def train_side_by_side():
    """The bit-exactness loop many tests share (see :func:`_train_side_by_side`)."""
    return _train_side_by_side


@pytest.fixture
def recipe(monkeypatch):
    """``recipe("sft")`` is ``recipes/sft.py``'s ``main``, run from the repository root (the configs' paths are
    relative to it)."""
    monkeypatch.chdir(ROOT)

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"recipe_{name}", ROOT / "recipes" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.main
    return load


@pytest.fixture(scope="session")
def rowwise_scaled_mm():
    """Skips where this torch's CPU torch._scaled_mm takes per-tensor scales only (torch 2.11, the GPU machine's; 2.13
    takes row-wise ones): the FP8 tensor-core path's C++ node calls the real op, on the CPU too."""
    a = torch.zeros(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        pytest.skip("this torch's CPU _scaled_mm takes per-tensor scales only (row-wise from 2.13)")


@pytest.fixture
def gemm_setting():
    """Gives the FP8 layer's GEMM setting (ops.set_fp8_gemm) back as it was after the test."""
    from trainstream_hf import ops
    before = ops.set_fp8_gemm(None)
    ops.set_fp8_gemm(before)
    yield
    ops.set_fp8_gemm(before)


def _autograd_node_names(y):
    """Names of every autograd node behind y."""
    names, todo = [], [y.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None:
            names.append(node.name())
            todo.extend(n for n, _ in node.next_functions)
    return names


@pytest.fixture
def graph_names():
    """The names of every autograd node behind a tensor: ``graph_names(y)``."""
    return _autograd_node_names
