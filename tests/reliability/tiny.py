"""The tiny Llama (hidden 64, vocab 100, 32 positions, seed 0) and token rows (16 tokens, seed 7) the Trainer tests
of this folder train on (CPU, a few seconds); they live in tests/helpers.py with the other shared builders."""
import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:  # imported by a test file run as a script (the killed child processes): no root on the path
    sys.path.insert(0, _ROOT)

from tests.helpers import tiny_llama, token_rows  # noqa: E402

__all__ = ["tiny_llama", "token_rows"]
