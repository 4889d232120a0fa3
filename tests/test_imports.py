"""Every module of the package imports on its own, first (no import circle between our modules shows only in some
orders), and the layering holds: each layer imports only the layers below it."""
import ast
import importlib
import pkgutil
import sys
from pathlib import Path

import pytest

import trainstream_hf

PACKAGE = Path(trainstream_hf.__file__).parent
MODULES = sorted(m.name for m in pkgutil.walk_packages([str(PACKAGE)], "trainstream_hf.")
                 if not m.name.endswith("__main__"))


def test_the_package_has_its_modules():
    assert len(MODULES) > 40 and "trainstream_hf.wrap" in MODULES and "trainstream_hf.engine.head" in MODULES


def test_each_module_imports_first():
    """One interpreter, third-party packages already loaded, every trainstream_hf module dropped before each import:
    a module that only imports after some other of ours (a circle) fails here."""
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    saved = {k: v for k, v in sys.modules.items() if k == "trainstream_hf" or k.startswith("trainstream_hf.")}
    failures = []
    try:
        for name in MODULES:
            for k in [k for k in sys.modules if k == "trainstream_hf" or k.startswith("trainstream_hf.")]:
                del sys.modules[k]
            try:
                importlib.import_module(name)
            except ImportError as e:
                failures.append(f"{name}: {e}")
    finally:
        for k in [k for k in sys.modules if k == "trainstream_hf" or k.startswith("trainstream_hf.")]:
            del sys.modules[k]
        sys.modules.update(saved)
    assert not failures, "\n".join(failures)


# Lower layers never import upper ones at module level (imports inside functions are where a lower layer may reach up
# on purpose, lazily).
LAYERS = ["config", "ops", "quant", "engine", "planner", "cache", "losses", "wrap", "integrations", "train", "auto",
          "bench"]


def _layer(module: str) -> str | None:
    part = module.split(".")[1] if module.count(".") else None
    return part if part in LAYERS else None


@pytest.mark.parametrize("name", [m for m in MODULES if _layer(m) in ("config", "ops", "quant", "engine")])
def test_low_layers_do_not_import_high_ones_at_module_level(name):
    path = PACKAGE.joinpath(*name.split(".")[1:])
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    tree = ast.parse(path.read_text())
    mine = LAYERS.index(_layer(name))
    for node in tree.body:  # module level only
        targets = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trainstream_hf."):
            targets = [node.module]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names if a.name.startswith("trainstream_hf.")]
        for t in targets:
            layer = _layer(t)
            assert layer is None or LAYERS.index(layer) <= mine, f"{name} imports {t} (a layer above it)"
