"""Shared test settings."""
import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """One intra-op thread for the whole run: CI machines have 2 cores shared with other jobs, where
    2-thread matmuls on tiny tensors ran over 100x slower. Tests that are about threading set their own
    count and restore it."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
