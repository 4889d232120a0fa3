"""Timeline of one training step: copies on the H2D / D2H streams beside block compute.

Off by default. When on (``TRAINSTREAM_TRACE=file.json`` or ``wrap(..., timeline=True)``) every copy and
every block's forward / backward is bracketed by timing events (CUDA events on the stream that runs it;
``perf_counter`` on the CPU). At the end of a step the events are read, which costs one host
synchronisation per step; that is why it is off by default. The result is

* the step's **overlap**: the fraction of copy time during which a block was computing, and
* a Chrome trace (``chrome://tracing`` or https://ui.perfetto.dev) with one row per stream.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch

__all__ = ["Timeline", "overlap_fraction"]


@dataclass
class _Interval:
    track: str           # "compute", "h2d" or "d2h"
    name: str
    start: object        # torch.cuda.Event or float seconds
    end: object = None
    nbytes: int = 0


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def overlap_fraction(copies: list[tuple[float, float]], compute: list[tuple[float, float]]) -> float | None:
    """Fraction of the (union of) copy time that falls inside the (union of) compute time; None if no copies."""
    cu, ku = _union(copies), _union(compute)
    total = sum(b - a for a, b in cu)
    if total <= 0:
        return None
    inside, j = 0.0, 0
    for a, b in cu:
        for c, d in ku:
            lo, hi = max(a, c), min(b, d)
            if hi > lo:
                inside += hi - lo
    return inside / total


class Timeline:
    """Collects intervals for the current step; :meth:`close_step` turns them into figures and trace events.

    Args:
        device: the compute device (CUDA: events; CPU: perf_counter).
        path: Chrome-trace JSON file rewritten after every step (None: figures only).
    """

    def __init__(self, device: torch.device, path: str | None = None):
        self.cuda = device.type == "cuda"
        self.path = path
        self.events: list[dict] = []
        self._open: list[_Interval] = []
        self._blocks: dict[tuple[str, int], _Interval] = {}
        self._ref = None
        self._ref_host = 0.0
        self._offset_us = 0.0
        self.last: dict = {}

    def _now(self, stream=None):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    # -- recording --------------------------------------------------------------------------------
    def start_step(self) -> None:
        self._open.clear()
        self._blocks.clear()
        self._ref_host = time.perf_counter()
        self._ref = self._now(torch.cuda.current_stream() if self.cuda else None)

    def begin(self, track: str, name: str, nbytes: int = 0, stream=None) -> _Interval | None:
        if self._ref is None:
            return None
        iv = _Interval(track, name, self._now(stream), nbytes=nbytes)
        self._open.append(iv)
        return iv

    def end(self, iv: _Interval | None, stream=None) -> None:
        if iv is not None:
            iv.end = self._now(stream)

    def block(self, phase: str, i: int, *, end: bool) -> None:
        """Brackets block ``i``'s forward (``end`` at its forward hook) or backward (ended by the next
        block's backward or the step's close)."""
        if self._ref is None:
            return
        if phase == "backward":
            for key, iv in list(self._blocks.items()):
                if key[0] == "backward" and iv.end is None:
                    self.end(iv, torch.cuda.current_stream() if self.cuda else None)
        key = (phase, i)
        if end:
            iv = self._blocks.get(key)
            self.end(iv, torch.cuda.current_stream() if self.cuda else None)
        else:
            self._blocks[key] = self.begin("compute", f"block {i} {phase}",
                                           stream=torch.cuda.current_stream() if self.cuda else None)

    # -- reading ----------------------------------------------------------------------------------
    def _seconds(self, t) -> float:
        if not self.cuda:
            return t - self._ref
        return self._ref.elapsed_time(t) / 1e3

    def close_step(self, step: int) -> dict:
        """Reads the step's events (one host sync on CUDA), returns ``{"overlap", "copy_seconds",
        "compute_seconds"}`` and appends Chrome-trace events (rewriting ``path``)."""
        if self._ref is None:
            return {}
        stream = torch.cuda.current_stream() if self.cuda else None
        for iv in self._open:
            if iv.end is None:
                iv.end = self._now(stream)
        if self.cuda:
            torch.cuda.synchronize()
        spans = [(iv, self._seconds(iv.start), self._seconds(iv.end)) for iv in self._open if iv.start is not None]
        copies = [(a, b) for iv, a, b in spans if iv.track != "compute"]
        compute = [(a, b) for iv, a, b in spans if iv.track == "compute"]
        fig = {"overlap": overlap_fraction(copies, compute),
               "copy_seconds": sum(b - a for a, b in _union(copies)),
               "compute_seconds": sum(b - a for a, b in _union(compute))}
        base = self._offset_us
        tids = {"compute": 0, "h2d": 1, "d2h": 2}
        for iv, a, b in spans:
            self.events.append({"name": iv.name, "ph": "X", "pid": 0, "tid": tids.get(iv.track, 3),
                                "ts": base + a * 1e6, "dur": max(0.0, (b - a) * 1e6),
                                "args": {"bytes": iv.nbytes, "step": step}})
        self._offset_us = base + max((b for _, _, b in spans), default=0.0) * 1e6 + 10.0
        if self.path:
            meta = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": t, "args": {"name": n}}
                    for n, t in tids.items()]
            with open(self.path, "w") as f:
                json.dump({"traceEvents": meta + self.events}, f)
        self._ref = None
        self._open.clear()
        self.last = fig
        return fig
