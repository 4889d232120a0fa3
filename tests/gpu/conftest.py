import pytest
import torch

from trainstream_hf import ops


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() and ops.built_with_cuda():
        return
    why = "requires CUDA" if not torch.cuda.is_available() else "requires a CUDA build (TRAINSTREAM_CUDA=1)"
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.skip(reason=why))
