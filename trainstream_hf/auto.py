"""``TRAINSTREAM=on``: the engine inside any script that trains with transformers' ``Trainer``, the script unchanged.

::

    TRAINSTREAM=on TRAINSTREAM_VRAM_BUDGET=24GiB python -m trainstream_hf.auto train.py --the --script's --args
    TRAINSTREAM=on accelerate launch --config_file configs/accelerate/single_gpu.yaml -m trainstream_hf.auto train.py
    python -m trainstream_hf.auto --install      # once per environment: from then on plain `python train.py` and
                                                 # `accelerate launch train.py` do the same whenever TRAINSTREAM is set

Variables (read when a ``Trainer`` is built; the launcher checks them before the script starts):

* ``TRAINSTREAM``: ``off`` (or unset: nothing happens at all), ``on``, or ``auto`` (on when a GPU is present).
* ``TRAINSTREAM_<OPTION>``: any :class:`~trainstream_hf.TrainStreamConfig` field, e.g.
  ``TRAINSTREAM_VRAM_BUDGET=24GiB``, ``TRAINSTREAM_QUANTIZE=nf4``, ``TRAINSTREAM_OFFLOAD_OPTIMIZER=true``,
  ``TRAINSTREAM_BATCH_SHAPE=1,2048``. Values read as ``true`` / ``false``, ``none``, integers, floats,
  comma-separated lists, else text. An unknown
  ``TRAINSTREAM_*`` name or a value the option does not take is an error naming the variable and what it accepts.
  (``TRAINSTREAM_TRACE``, ``TRAINSTREAM_CUDA``, ``TRAINSTREAM_CPU_ISA`` and ``TRAINSTREAM_COMMIT`` are the engine's,
  the build's and the benchmarks' own switches, not options.)

Every ``Trainer`` (and subclass: TRL's trainers) built in the process then carries a
:class:`~trainstream_hf.integrations.transformers.TrainStreamEnvCallback`: at the first training step it wraps the
Trainer's model and Accelerate-prepared optimizer with these options (``TRAINSTREAM_QUANTIZE``: the frozen linear
layers of a PEFT model are packed first), puts the engine's figures into each log (``trainstream/h2d_GBps``, ...,
in ``trainer.state.log_history`` and whatever ``report_to`` reports to) and unwraps at the end. A Trainer that already
installs the engine itself (``TrainStreamTrainer``, a ``TrainStreamCallback``) keeps its own settings.

How it gets in, and the one place it touches transformers (read and run against transformers 5.24 and accelerate
1.16; 5.17 / 1.15, the oldest this package targets, are not installed here): ``Trainer.__init__`` builds its
callbacks from the module-level list ``transformers.trainer.DEFAULT_CALLBACKS`` (then ``report_to``'s integrations,
then the caller's). transformers has no public registry for a third party's default callback: ``report_to`` names a
fixed table, and no environment variable adds one. So this module appends one class to that list, right after
``transformers.trainer`` is imported, through a post-import hook on ``sys.meta_path``: nothing is imported ahead of
the script, and with ``TRAINSTREAM`` unset or ``off`` nothing is installed at all. ``accelerate launch`` passes the
environment to the processes it starts and runs ``-m trainstream_hf.auto`` as ``python -m`` would.

``--install`` writes ``trainstream_hf_autostart.pth`` (and the small module it imports) into site-packages: Python
runs a ``.pth`` file's ``import`` line at every start-up, and this one only tests ``TRAINSTREAM`` in ``os.environ``
(microseconds) unless it is set; ``--uninstall`` removes both. This module imports nothing beyond the standard library
until a ``Trainer`` is built, so that start-up hook costs nothing more.
"""
from __future__ import annotations

import importlib.abc
import os
import sys
from pathlib import Path

__all__ = ["env_config", "parse_value", "enable", "install_startup_hook",
           "uninstall_startup_hook", "main"]

TRAINER_MODULE = "transformers.trainer"
PTH_NAME = "trainstream_hf_autostart.pth"
STUB_NAME = "trainstream_hf_autostart.py"


# -- the variables -------------------------------------------------------------------------------------------
# The parser lives with the options (trainstream_hf.config: env_config, parse_value), imported only when called:
# this module must stay importable without the package (the start-up hook runs it alone, before torch).
def parse_value(text: str):
    """:func:`trainstream_hf.config.parse_value`."""
    from trainstream_hf.config import parse_value as parse

    return parse(text)


def env_config(environ=None, *, default: str = "off"):
    """:func:`trainstream_hf.config.env_config`: ``(mode, config)`` from ``TRAINSTREAM`` and ``TRAINSTREAM_*``."""
    from trainstream_hf.config import env_config as read

    return read(environ, default=default)


# -- the hook ----------------------------------------------------------------------------------------------
class _HookedLoader(importlib.abc.Loader):
    """The module's own loader, then ``hook(module)`` once it has run."""

    def __init__(self, loader, hook):
        self._loader, self._hook = loader, hook

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._hook(module)

    def __getattr__(self, name):  # get_source, get_resource_reader, is_package, ...: the real loader's
        return getattr(self._loader, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``hook(module)`` right after the module ``name`` is first imported, then leaves ``sys.meta_path``."""

    trainstream_hook = True

    def __init__(self, name: str, hook):
        self.name, self.hook = name, hook

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if getattr(finder, "trainstream_hook", False) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _HookedLoader(spec.loader, self._run)
        return spec

    def _run(self, module) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        self.hook(module)


def _add_default_callback(trainer_module) -> None:
    """The one change to transformers: TrainStreamEnvCallback appended to ``transformers.trainer.DEFAULT_CALLBACKS``
    (transformers 5.24: ``Trainer.__init__`` reads that list at each call, and ``CallbackHandler.add_callback``
    instantiates a class found there, so every new Trainer gets its own callback)."""
    from trainstream_hf.integrations.transformers import TrainStreamEnvCallback

    callbacks = trainer_module.DEFAULT_CALLBACKS
    if not any(getattr(c, "trainstream_env", False) for c in callbacks):
        callbacks.append(TrainStreamEnvCallback)


def enable(environ=None) -> bool:
    """Installs the hook when ``TRAINSTREAM`` is set and not ``off`` (no-op otherwise, or when already installed).

    Returns:
        Whether the hook is (now) installed.
    """
    env = os.environ if environ is None else environ
    if env.get("TRAINSTREAM", "").strip().lower() in ("", "off"):
        return False
    module = sys.modules.get(TRAINER_MODULE)
    if module is not None and hasattr(module, "DEFAULT_CALLBACKS"):
        _add_default_callback(module)
    elif not any(getattr(f, "trainstream_hook", False) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(TRAINER_MODULE, _add_default_callback))
    return True


# -- start-up hook files -----------------------------------------------------------------------------------------
_PTH = ("import os; os.environ.get('TRAINSTREAM', '').strip().lower() not in ('', 'off') "
        "and __import__('trainstream_hf_autostart')\n")
_STUB = '''"""Written by `python -m trainstream_hf.auto --install` (remove with --uninstall); imported by {pth}
only when TRAINSTREAM is set. Runs trainstream_hf/auto.py alone (not the package, which imports torch) and
enables its hook."""
import importlib.util

_pkg = importlib.util.find_spec("trainstream_hf")  # locates the package without importing it
if _pkg is not None and _pkg.submodule_search_locations:
    # under a name of its own: `python -m trainstream_hf.auto` may still run the real module as __main__
    _path = _pkg.submodule_search_locations[0] + "/auto.py"
    _spec = importlib.util.spec_from_file_location("_trainstream_hf_auto", _path)
    _auto = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_auto)
    _auto.enable()
'''.format(pth=PTH_NAME)


def _site_dir(site_dir: str | None) -> Path:
    if site_dir is not None:
        return Path(site_dir)
    import sysconfig

    return Path(sysconfig.get_paths()["purelib"])


def install_startup_hook(site_dir: str | None = None) -> list[Path]:
    """Writes the ``.pth`` start-up hook and its module into ``site_dir`` (default: this interpreter's
    site-packages). Returns the files written."""
    d = _site_dir(site_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / STUB_NAME).write_text(_STUB)
    (d / PTH_NAME).write_text(_PTH)
    return [d / PTH_NAME, d / STUB_NAME]


def uninstall_startup_hook(site_dir: str | None = None) -> list[Path]:
    """Removes what :func:`install_startup_hook` wrote. Returns the files removed."""
    d = _site_dir(site_dir)
    removed = []
    for name in (PTH_NAME, STUB_NAME):
        if (d / name).exists():
            (d / name).unlink()
            removed.append(d / name)
    return removed


# -- the launcher ----------------------------------------------------------------------------------------------
_USAGE = """usage: python -m trainstream_hf.auto SCRIPT.py [ARGS ...]      run SCRIPT as `python SCRIPT.py ARGS` would,
                                                               with the engine in its Trainers when TRAINSTREAM is set
       python -m trainstream_hf.auto -m MODULE [ARGS ...]     the same for `python -m MODULE ARGS`
       python -m trainstream_hf.auto --install [--site-dir DIR]    start-up hook: no launcher needed any more
       python -m trainstream_hf.auto --uninstall [--site-dir DIR]
(accelerate launch [...] -m trainstream_hf.auto SCRIPT.py ARGS runs it in each process.)"""


def main(argv: list[str] | None = None) -> None:
    import runpy

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        raise SystemExit(0 if argv else 2)
    if argv[0] in ("--install", "--uninstall"):
        site_dir = argv[argv.index("--site-dir") + 1] if "--site-dir" in argv[:-1] else None
        if argv[0] == "--install":
            files = install_startup_hook(site_dir)
            print("trainstream_hf: wrote " + ", ".join(map(str, files)) + "; active whenever TRAINSTREAM is set")
        else:
            files = uninstall_startup_hook(site_dir)
            print("trainstream_hf: removed " + (", ".join(map(str, files)) or "nothing (not installed)"))
        return
    try:
        env_config()  # a bad variable fails here, before the script's own start-up work
    except ValueError as e:
        raise SystemExit(f"trainstream_hf.auto: {e}") from None
    enable()
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit(_USAGE)
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = argv[0]
        if not Path(script).is_file():
            raise SystemExit(f"trainstream_hf.auto: no such script {script!r}")
        sys.argv = argv
        sys.path[0] = str(Path(script).resolve().parent)  # as `python SCRIPT` sets it
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
