import importlib
import os

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


@pytest.fixture(autouse=True)
def _compile_blocks_default(monkeypatch):
    """``TS_TEST_COMPILE_BLOCKS=auto`` (or True, or a backend): every wrap() and plan() of the GPU tests that does not
    choose compile_blocks itself gets this value instead of the default, so the suite can be run as it would be with
    another default (scripts/gpu_round.sh compile_tests)."""
    value = os.environ.get("TS_TEST_COMPILE_BLOCKS")
    if not value:
        yield
        return
    from trainstream_hf.config import parse_value

    wrap_mod = importlib.import_module("trainstream_hf.wrap")  # (the package's `wrap` is the function)

    real = wrap_mod._configure

    def configure(model, optimizer, config, options):
        if "compile_blocks" not in options and (config is None or config.compile_blocks is False):
            options = {**options, "compile_blocks": parse_value(value)}
        return real(model, optimizer, config, options)

    monkeypatch.setattr(wrap_mod, "_configure", configure)
    yield
