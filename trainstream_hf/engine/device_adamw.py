"""The device share of :class:`~trainstream_hf.engine.optimizer.OffloadedAdamW`: offloaded parameters whose AdamW
step runs on the compute device, with the same fp32 masters and moments and the same op as the CPU share.

Two kinds of parameter (``_Slot.where``):

* ``"resident"``: fp32 master and both moments live on the device (12 bytes a parameter of spare device memory);
  the step reads the gradient where autograd left it and writes the new weight in place. No PCIe traffic.
* ``"streamed"``: fp32 master and moments stay in the pinned host arena; the step brings them over in chunks
  through a ring of device buffers, steps them there and copies them back: 12 bytes each way per parameter, against
  the CPU share's 2 + 2 (gradient down, weight up), but no CPU time. With copies in both directions at once (one
  stream each) a streamed parameter costs ~0.24 s per billion on an H100's PCIe 5 link, about what the CPU kernel
  takes on 16 cores, so the plan splits the offloaded parameters between the two to finish them together.

The update is ``ops.adamw_step_``, whose CUDA kernel applies the CPU kernel's float operations in the same order:
a parameter gets the same bits whichever share steps it (tested with ``torch.equal``). Every chunk runs on three
streams of its own, so the pipeline neither queues behind nor blocks the CPU share's copies and the next forward::

    in      | state c0 -> buf0 | state c1 -> buf1 | state c2 -> buf2 | (waits buf0's copy-out) c3 -> buf0 ...
    compute |                  | adam c0, w c0    | adam c1, w c1    | adam c2 ...
    out     |                                     | buf0 -> state c0 | buf1 -> state c1 ...

Each parameter's new weight is ready at an event the next forward waits for (:meth:`OffloadedAdamW.wait_for`), as
for the CPU share; the host state is written back at a later one, which every host reader waits for.
On a CPU compute device the same steps run synchronously (the tests' path).
"""
from __future__ import annotations

import torch

from trainstream_hf import ops

__all__ = ["DeviceSteps", "DeviceWrite", "DEFAULT_CHUNK_NUMEL"]

# 8 Mi elements: 96 MiB of fp32 state per ring buffer, ~2 ms of copy each way at 54 GB/s (launch costs negligible).
DEFAULT_CHUNK_NUMEL = 8 << 20
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class DeviceWrite:
    """What a device-stepped parameter's update left in flight: ``event`` (its new weight is written: the next
    forward waits for it) and ``done`` (its host state is written back too: host readers wait for it). The
    ``Transfer`` interface the optimizer's slots keep in ``last_h2d``."""

    __slots__ = ("event", "done")

    def __init__(self, event, done):
        self.event, self.done = event, done

    def synchronize(self) -> None:
        if self.done is not None:
            self.done.synchronize()


class DeviceSteps:
    """Runs the AdamW updates of resident and streamed parameters on ``device``.

    Args:
        device: the compute device (CUDA: three streams and a ring of buffers; CPU: synchronous).
        chunk_numel: elements per streamed chunk (and per fp32 temporary of a resident parameter's gradient).
        ring: streamed chunk buffers on the device (>= 2; 3 lets copy-in, compute and copy-out overlap).
    """

    def __init__(self, device: torch.device, *, chunk_numel: int = DEFAULT_CHUNK_NUMEL, ring: int = 3):
        if chunk_numel < 1 or ring < 2:
            raise ValueError(f"DeviceSteps: chunk_numel >= 1 and ring >= 2, got {chunk_numel} and {ring}")
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.chunk_numel, self.ring = int(chunk_numel), int(ring)
        if self.cuda:
            self.copy_in = torch.cuda.Stream(self.device)
            self.compute = torch.cuda.Stream(self.device)
            self.copy_out = torch.cuda.Stream(self.device)
        self._buffers: list[torch.Tensor] | None = None  # ring x (3, chunk) fp32: master, exp_avg, exp_avg_sq
        self._free: list = [None] * ring  # per buffer: the event after its last copy-out
        self._next = 0
        self.h2d_bytes = self.d2h_bytes = 0

    @staticmethod
    def check(slot, grad: torch.Tensor | None) -> None:
        """Raises a one-line ValueError unless ``grad`` can step ``slot`` on the device; writes nothing."""
        if grad is None:
            return
        p = slot.param
        if grad.layout != torch.strided or grad.device != p.device or grad.dtype not in _FLOAT_DTYPES or \
                grad.numel() != p.numel():
            raise ValueError(f"OffloadedAdamW: the gradient of a device-stepped parameter of shape {tuple(p.shape)} "
                             f"must be a dense float32/bfloat16/float16 tensor of the same numel on {p.device}, got "
                             f"a {grad.layout} {grad.dtype} tensor of numel {grad.numel()} on {grad.device} (AdamW "
                             "takes no sparse gradients)")

    def buffer_bytes(self) -> int:
        return 0 if self._buffers is None else sum(b.numel() * b.element_size() for b in self._buffers)

    def _buffer(self):
        if self._buffers is None:
            self._buffers = [torch.empty(3, self.chunk_numel, dtype=torch.float32, device=self.device)
                             for _ in range(self.ring)]
        k = self._next
        self._next = (k + 1) % self.ring
        return k, self._buffers[k]

    def step(self, work, compute_done) -> None:
        """Issues the update of each ``(slot, grad, hyper)`` in ``work``, in that order (grad: the device gradient;
        None skips the slot, as torch skips a parameter without one); sets each slot's ``last_h2d``. Returns once
        everything is queued (CUDA) or done (CPU). Called once per step with every slot, or once per slot as each
        gradient is ready (``optimizer_in_backward``): the streams only wait for what each slot reads.

        ``compute_done``: an event after every kernel that reads the parameters or writes the gradients (None on the
        CPU); nothing here starts before it.
        """
        if not work:
            return
        if self.cuda:
            self.copy_in.wait_event(compute_done)
            self.compute.wait_event(compute_done)
        for slot, grad, h in work:
            if grad is None:
                continue
            previous = slot.last_h2d
            if isinstance(previous, DeviceWrite):
                if self.cuda and previous.done is not None:  # its host state is back before it is read again
                    self.copy_in.wait_event(previous.done)
            else:
                slot.wait_h2d()  # (a host-side state load since the last step)
            slot.step += 1
            step = int(slot.step.item())
            if self.cuda:
                grad.record_stream(self.compute)  # zero_grad() on the main stream must not free it under us
            if slot.where == "resident":
                self._resident(slot, grad, h, step)
            else:
                self._streamed(slot, grad, h, step)

    # -- one parameter ---------------------------------------------------------------------------------------
    def _update(self, master, exp_avg, exp_avg_sq, grad, out, h, step) -> None:
        """One chunk's AdamW on the device, exactly as ``OffloadedAdamW._step_slot`` does it on the host."""
        wd = h["weight_decay"]
        l2 = wd != 0 and not h["decoupled"]
        if grad.dtype == torch.float16 or (l2 and grad.dtype != torch.float32):
            grad = grad.float()
        if l2:  # torch's Adam: g + wd * p, the kernel negating after (so subtract under maximize); never in place
            grad = grad.add(master, alpha=-wd if h["maximize"] else wd)
        bf16 = out if out.dtype == torch.bfloat16 else None
        ops.adamw_step_(master, exp_avg, exp_avg_sq, grad, lr=h["lr"], beta1=h["beta1"], beta2=h["beta2"],
                        eps=h["eps"], weight_decay=wd if h["decoupled"] else 0.0, step=step, maximize=h["maximize"],
                        param_bf16=bf16)
        if bf16 is None:
            out.copy_(master)

    def _resident(self, slot, grad, h, step):
        p, n, c = slot.param, slot.master.numel(), self.chunk_numel
        g, w = grad.reshape(-1), p.data.view(-1)
        stream = torch.cuda.stream(self.compute) if self.cuda else _Null()
        with stream:
            for lo in range(0, n, c):
                hi = min(n, lo + c)
                self._update(slot.master[lo:hi], slot.exp_avg[lo:hi], slot.exp_avg_sq[lo:hi], g[lo:hi], w[lo:hi],
                             h, step)
            event = self.compute.record_event() if self.cuda else None
        slot.last_h2d = DeviceWrite(event, event)

    def _streamed(self, slot, grad, h, step):
        p, n, c = slot.param, slot.master.numel(), self.chunk_numel
        g, w = grad.reshape(-1), p.data.view(-1)
        host = (slot.master, slot.exp_avg, slot.exp_avg_sq)
        ready = done = None
        for lo in range(0, n, c):
            hi = min(n, lo + c)
            k, buf = self._buffer()
            state = [b[:hi - lo] for b in buf]
            if not self.cuda:
                for d, s in zip(state, host):
                    d.copy_(s[lo:hi])
                self._update(*state, g[lo:hi], w[lo:hi], h, step)
                for d, s in zip(state, host):
                    s[lo:hi].copy_(d)
            else:
                if self._free[k] is not None:  # the buffer's previous chunk has left
                    self.copy_in.wait_event(self._free[k])
                with torch.cuda.stream(self.copy_in):
                    for d, s in zip(state, host):
                        d.copy_(s[lo:hi], non_blocking=True)
                self.compute.wait_stream(self.copy_in)
                with torch.cuda.stream(self.compute):
                    self._update(*state, g[lo:hi], w[lo:hi], h, step)
                    ready = self.compute.record_event()
                self.copy_out.wait_event(ready)
                with torch.cuda.stream(self.copy_out):
                    for d, s in zip(state, host):
                        s[lo:hi].copy_(d, non_blocking=True)
                    done = self._free[k] = self.copy_out.record_event()
            self.h2d_bytes += 12 * (hi - lo)
            self.d2h_bytes += 12 * (hi - lo)
        slot.last_h2d = DeviceWrite(ready, done)

    def synchronize(self) -> None:
        """Blocks the host until every update issued is complete, host write-backs included."""
        if self.cuda:
            for s in (self.copy_in, self.compute, self.copy_out):
                s.synchronize()

    def wait_all(self, stream=None) -> None:
        """Makes ``stream`` (default: the current one) wait for every update issued, without blocking the host."""
        if self.cuda:
            stream = stream if stream is not None else torch.cuda.current_stream(self.device)
            stream.wait_stream(self.compute)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
