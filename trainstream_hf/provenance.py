"""Which commit a result came from: the one rule the benchmarks' JSON and the recipes' run summaries share."""
from __future__ import annotations

import os
import subprocess

__all__ = ["git_commit"]


def git_commit(root: str | os.PathLike) -> tuple[str | None, bool | None]:
    """``(commit, dirty)`` of the git tree at ``root``.

    ``TRAINSTREAM_COMMIT`` wins when set, with ``dirty`` None (unknown): a copied tree (the GPU machine's) has no
    ``.git``, or a stale one. Otherwise ``git rev-parse HEAD`` and whether tracked files differ from it; ``(None,
    None)`` where git or the repository is missing.
    """
    if os.environ.get("TRAINSTREAM_COMMIT"):
        return os.environ["TRAINSTREAM_COMMIT"], None
    try:
        commit = subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=root, text=True, timeout=5,
                                         stderr=subprocess.DEVNULL).strip()
        dirty = bool(subprocess.check_output(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                             text=True, timeout=10, stderr=subprocess.DEVNULL).strip())
    except (OSError, subprocess.SubprocessError):
        return None, None
    return commit or None, dirty
