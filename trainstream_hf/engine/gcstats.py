"""Python's cyclic GC pauses, counted: collections per generation and their total time.

A collection stops the thread that launches the GPU work; a full (generation 2) pass over a large heap takes tens to
hundreds of ms. The engine reports the figures per step and the benchmark per row, so a slow step can be told apart
from a slow GPU. The callback holds only this counter, never its owner.
"""
from __future__ import annotations

import gc
import time

__all__ = ["GcPauses"]


class GcPauses:
    """Counts collections from :meth:`start` until :meth:`stop`; :meth:`take` returns the figures and resets them."""

    def __init__(self):
        self.collections = [0, 0, 0]
        self.seconds = 0.0
        self._t: float | None = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t is not None:
            self.collections[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._t
            self._t = None

    def start(self) -> "GcPauses":
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def take(self) -> dict:
        out = {"collections": list(self.collections), "seconds": self.seconds}
        self.collections, self.seconds = [0, 0, 0], 0.0
        return out
