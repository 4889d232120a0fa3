"""Python's cyclic GC pauses, counted: collections per generation and their total time.

A collection stops the thread that launches the GPU work; a full (generation 2) pass over a large heap takes tens to
hundreds of ms. The engine reports the figures per step and the benchmark per row, so a slow step can be told apart
from a slow GPU.

The entry in ``gc.callbacks`` is a native counter (``csrc/runtime/gc_pauses.cpp``), not a Python function: a
SIGINT that arrives during a collection raises KeyboardInterrupt in the first bytecode that runs after it, and
inside a gc callback CPython prints that exception and drops it (Ctrl-C lost). Native code runs no bytecode, so
the interrupt reaches the training loop. The callback holds only this counter, never its owner.
"""
from __future__ import annotations

import gc

from trainstream_hf import _C

__all__ = ["GcPauses"]


class GcPauses:
    """Counts collections from :meth:`start` until :meth:`stop`; :meth:`take` returns the figures and resets them."""

    def __init__(self):
        self._callback = _C.GcPauses()  # the entry in gc.callbacks: native, see the module docstring

    def start(self, owner: object | None = None) -> "GcPauses":
        """Appends the counter to ``gc.callbacks``.

        Args:
            owner: the counter leaves ``gc.callbacks`` by itself when ``owner`` is garbage collected (a model
                dropped without unwrap), in native code. Use it instead of ``weakref.finalize(owner, self.stop)``,
                whose Python callback can run mid-step and drop a Ctrl-C.
        """
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        if owner is not None:
            self._callback.remove_when_dead(owner, gc.callbacks)
        return self

    def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def take(self) -> dict:
        """``{"collections": [generation 0, 1, 2], "seconds": total pause}`` since the last take; resets them."""
        collections, seconds = self._callback.take()
        return {"collections": collections, "seconds": seconds}
