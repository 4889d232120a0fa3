"""The README runs as written: every ```python block on the CPU, every command and file it names exists.

Each python block runs in a fresh interpreter from the repository root, with an empty HOME and Hugging Face cache,
the hub switched off and no GPU visible, so a block that needs a download, a GPU or a file outside the repository
fails here. The blocks also see the environment of a one-process ``torchrun`` (the several-GPU example reads it).
The blocks run two or more at a time: each costs a few seconds, mostly importing transformers.
"""
from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
TIMEOUT_S = 180


def _blocks(lang: str) -> list[str]:
    return [body for tag, body in FENCE.findall(README.read_text()) if tag == lang]


PYTHON = _blocks("python")
BASH = _blocks("bash")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(code: str, tmp: Path) -> subprocess.CompletedProcess:
    tmp.mkdir(parents=True)
    env = {**os.environ, "HOME": str(tmp), "HF_HOME": str(tmp / "hf"), "TMPDIR": str(tmp),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "CUDA_VISIBLE_DEVICES": "", "TRAINSTREAM": "off", "OMP_NUM_THREADS": "1",
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    script = tmp / "block.py"
    script.write_text(code)
    try:
        return subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        return subprocess.CompletedProcess(e.cmd, -1, e.stdout or "", f"timed out after {TIMEOUT_S} s")


@pytest.fixture(scope="module")
def python_runs(tmp_path_factory) -> list[subprocess.CompletedProcess]:
    base = tmp_path_factory.mktemp("readme")
    with ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 2))) as pool:
        return list(pool.map(lambda ic: _run(ic[1], base / f"block{ic[0]}"), enumerate(PYTHON)))


def test_the_readme_has_its_examples():
    assert len(PYTHON) >= 5 and len(BASH) >= 3  # a parser that finds nothing must not pass every check below


@pytest.mark.parametrize("index", range(len(PYTHON)))
def test_python_block_runs_as_written(python_runs, index):
    run = python_runs[index]
    assert run.returncode == 0, (f"README python block {index} failed (exit {run.returncode}):\n{PYTHON[index]}\n"
                                 f"--- stderr (end) ---\n{run.stderr[-4000:]}")


def _commands() -> list[str]:
    """Each command line of the bash blocks, continuation lines joined, comments dropped."""
    lines = []
    for body in BASH:
        for line in body.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def test_bash_blocks_name_modules_and_make_targets_that_exist():
    makefile = (ROOT / "Makefile").read_text()
    modules = [m for line in _commands() for m in re.findall(r"(?:^|\s)-m\s+([A-Za-z_][\w.]*)", line)]
    targets = [t for line in _commands() for t in re.findall(r"(?:^|[;&|]\s*)make\s+([\w-]+)", line)]
    assert modules and targets
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    assert not missing, f"README runs python -m on modules that do not exist: {missing}"
    absent = [t for t in targets if not re.search(rf"^{re.escape(t)}\s*:", makefile, re.M)]
    assert not absent, f"README names make targets the Makefile lacks: {absent}"


REPO_PATH = re.compile(r"(?<![\w/.])((?:recipes|configs|data|scripts|benchmarks|docs|tests|trainstream_hf|csrc)/"
                       r"[\w./-]*[\w])")


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_files_and_links_are_inside_the_repository(doc):
    text = doc.read_text()
    named = set(REPO_PATH.findall(text))
    gone = sorted(p for p in named if not (ROOT / p).exists())
    assert not gone, f"{doc.name} names files that are not in the repository: {gone}"
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        path = (doc.parent / target.split("#")[0]).resolve()
        assert "://" not in target and path.is_relative_to(ROOT), f"{doc.name} links outside the repository: {target}"
        assert path.exists(), f"{doc.name} links to a missing file: {target}"
    assert "../shared" not in text
