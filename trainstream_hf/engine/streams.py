"""Transfer streams: one host->device and one device->host stream per device.

Every cross-stream use is guarded: a copy waits for the work that produced its source (or last read its
destination) through an event, and a device tensor used on a stream other than the one it was allocated
on is marked with ``Tensor.record_stream`` so the caching allocator does not hand its memory out again
while the copy is in flight. On the CPU the same calls copy synchronously.
"""
from __future__ import annotations

import torch

__all__ = ["Transfer", "TransferStreams"]


class Transfer:
    """A copy in flight: ``tensor`` is valid once ``wait()`` (device consumer) or ``synchronize()``
    (host consumer) has returned."""

    __slots__ = ("tensor", "event", "_consumed_on")

    def __init__(self, tensor: torch.Tensor, event: "torch.cuda.Event | None"):
        self.tensor = tensor
        self.event = event
        self._consumed_on: set = set()

    def wait(self, stream: "torch.cuda.Stream | None" = None) -> torch.Tensor:
        """Makes ``stream`` (default: the current stream) wait for the copy; returns the tensor.

        No host synchronisation. A device tensor is also recorded on that stream, so freeing it there
        is safe.
        """
        if self.event is not None:
            stream = stream if stream is not None else torch.cuda.current_stream(self.event.device)
            stream.wait_event(self.event)
            if self.tensor.is_cuda and stream not in self._consumed_on:
                self.tensor.record_stream(stream)
                self._consumed_on.add(stream)
        return self.tensor

    def synchronize(self) -> torch.Tensor:
        """Blocks the host until the copy is done (for host consumers of a device->host copy)."""
        if self.event is not None:
            self.event.synchronize()
        return self.tensor

    def done(self) -> bool:
        return self.event is None or self.event.query()


class TransferStreams:
    """The H2D and D2H streams of one device.

    Args:
        device: a CUDA device (streams and events) or ``cpu`` (synchronous copies, same API).
        priority: CUDA stream priority of the copy streams (lower is higher priority).
    """

    def __init__(self, device: torch.device | str | int = "cuda", priority: int = 0):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"TransferStreams: device must be cuda or cpu, got {device}")
        self.device = device
        self.is_cuda = device.type == "cuda"
        if self.is_cuda:
            self.h2d = torch.cuda.Stream(device, priority=priority)
            self.d2h = torch.cuda.Stream(device, priority=priority)
        else:
            self.h2d = self.d2h = None
        self.h2d_bytes = 0
        self.d2h_bytes = 0
        self.timeline = None  # an engine.trace.Timeline while a step is being traced

    def _record(self, stream) -> "torch.cuda.Event":
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def to_device(self, src: torch.Tensor, out: torch.Tensor | None = None, *,
                  after: "torch.cuda.Event | None" = None, wait_current: bool = False) -> Transfer:
        """Copies host tensor ``src`` to the device on the H2D stream.

        Args:
            src: a CPU tensor; pinned for a truly asynchronous copy. It must stay unmodified until the
                transfer is done (the caller owns that; the arena never reuses a live tensor's block).
            out: a device buffer to copy into (e.g. a reused slot). The copy first waits for ``after``, or,
                when ``after`` is None, for all work queued so far on the current stream, so that a slot is
                never overwritten while something still reads it.
            after: the event after which ``out`` may be overwritten (or ``src`` is complete).
            wait_current: with ``after``, wait for the current stream's queued work as well (``out`` was just
                allocated on the current stream, whose earlier kernels may still use that memory).

        Returns:
            A :class:`Transfer`; call ``wait()`` on the consumer stream before using ``tensor``.
        """
        if src.device.type != "cpu":
            raise ValueError(f"to_device: src must be a host tensor, got one on {src.device}")
        if out is not None and (out.shape != src.shape or out.dtype != src.dtype or out.device != self.device):
            raise ValueError(f"to_device: out must be {tuple(src.shape)} {src.dtype} on {self.device}, got "
                             f"{tuple(out.shape)} {out.dtype} on {out.device}")
        nbytes = src.numel() * src.element_size()
        self.h2d_bytes += nbytes
        tl = self.timeline
        if not self.is_cuda:
            iv = tl.begin("h2d", "h2d", nbytes) if tl is not None else None
            res = src.clone() if out is None else out.copy_(src)
            if iv is not None:
                tl.end(iv)
            return Transfer(res, None)
        producer = torch.cuda.current_stream(self.device)
        if out is not None:
            if after is not None:
                self.h2d.wait_event(after)
            if after is None or wait_current:
                self.h2d.wait_stream(producer)
            # Written here, read (and freed) on the consumer's stream: its memory must not be handed out again
            # before this copy is done, even if it is dropped unread.
            out.record_stream(self.h2d)
        with torch.cuda.stream(self.h2d):
            if out is None:
                out = torch.empty(src.shape, dtype=src.dtype, device=self.device)
            iv = tl.begin("h2d", "h2d", nbytes, self.h2d) if tl is not None else None
            out.copy_(src, non_blocking=True)
            if iv is not None:
                tl.end(iv, self.h2d)
        return Transfer(out, self._record(self.h2d))

    def to_host(self, src: torch.Tensor, out: torch.Tensor) -> Transfer:
        """Copies device tensor ``src`` into host tensor ``out`` on the D2H stream.

        The copy waits for the work queued so far on the current stream (which produced ``src``), and
        ``src`` is recorded on the D2H stream, so the caller may drop it right away. Read ``out`` only after
        ``synchronize()`` (or ``wait()`` from a device stream that then reads it).
        """
        if out.device.type != "cpu":
            raise ValueError(f"to_host: out must be a host tensor, got one on {out.device}")
        if out.shape != src.shape or out.dtype != src.dtype:
            raise ValueError(f"to_host: out is {tuple(out.shape)} {out.dtype}, src is {tuple(src.shape)} "
                             f"{src.dtype}")
        nbytes = src.numel() * src.element_size()
        self.d2h_bytes += nbytes
        tl = self.timeline
        if not self.is_cuda or src.device.type == "cpu":
            iv = tl.begin("d2h", "d2h", nbytes) if tl is not None else None
            out.copy_(src)
            if iv is not None:
                tl.end(iv)
            return Transfer(out, None)
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h):
            iv = tl.begin("d2h", "d2h", nbytes, self.d2h) if tl is not None else None
            out.copy_(src, non_blocking=True)
            if iv is not None:
                tl.end(iv, self.d2h)
        src.record_stream(self.d2h)
        return Transfer(out, self._record(self.d2h))

    def synchronize(self) -> None:
        """Waits for every copy issued on both streams."""
        if self.is_cuda:
            self.h2d.synchronize()
            self.d2h.synchronize()

    def reset_counters(self) -> dict:
        """Returns and clears the byte counters."""
        out = {"h2d_bytes": self.h2d_bytes, "d2h_bytes": self.d2h_bytes}
        self.h2d_bytes = self.d2h_bytes = 0
        return out
