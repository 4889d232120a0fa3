"""trainstream_hf.provenance.git_commit: the commit stamped into benchmark JSON and run summaries."""
import subprocess
from pathlib import Path

from trainstream_hf.provenance import git_commit

ROOT = Path(__file__).resolve().parent.parent


def test_environment_variable_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("TRAINSTREAM_COMMIT", "abc1234")
    assert git_commit(tmp_path) == ("abc1234", None)  # even outside any repository


def test_git_tree_and_no_tree(monkeypatch, tmp_path):
    monkeypatch.delenv("TRAINSTREAM_COMMIT", raising=False)
    assert git_commit(tmp_path / "missing") == (None, None)
    try:
        head = subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return  # a tree without git (a copy): the first assertion covered it
    commit, dirty = git_commit(ROOT)
    assert commit == head and isinstance(dirty, bool)


def test_benchmark_environment_and_run_summary_use_it(monkeypatch):
    monkeypatch.setenv("TRAINSTREAM_COMMIT", "feedbee")
    from trainstream_hf.bench import common
    from trainstream_hf.train import report
    env = common.environment()
    assert env["commit"] == "feedbee" and env["dirty"] is None
    assert report._git_commit() == "feedbee"
