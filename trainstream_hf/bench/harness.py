"""How a training configuration is timed: the same harness for trainstream and for every peer.

:func:`measure_training` runs ``warmup`` untimed steps, resets the CUDA peak-memory statistics, then
reports the median of ``repeats`` steps (CUDA events on CUDA, ``perf_counter`` on CPU) with
``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` over those timed steps, in bytes. A CUDA
out-of-memory is a result (``status: "oom"``), never a crash; memory is released before it returns.
"""
from __future__ import annotations

import contextlib
import gc
import gzip
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from typing import Callable, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from trainstream_hf.bench.common import median_time
from trainstream_hf.engine.arena import HostMemoryError
from trainstream_hf.engine.gcstats import GcPauses

Step = Callable[[], Optional[torch.Tensor]]  # one training step; may return its loss


def default_device() -> torch.device:
    """``cuda`` when a GPU is visible, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@contextlib.contextmanager
def vram_cap(budget: Optional[int], device: torch.device):
    """Caps the caching allocator at ``budget`` bytes on ``device`` (None: no cap); restores 1.0 after.

    ``set_per_process_memory_fraction`` limits what the allocator may reserve; the CUDA context, cuBLAS
    workspaces and NCCL buffers outside the allocator are not counted, so a real GPU of that size has a
    little less room than the cap suggests.
    """
    if budget is None or device.type != "cuda":
        yield
        return
    if device.index is None:  # set_per_process_memory_fraction wants an index
        device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)


def free_memory() -> None:
    """Drops unreachable objects and returns cached CUDA blocks to the driver (between peers)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def is_oom(err: BaseException) -> bool:
    # Some libraries re-raise allocation failures as plain RuntimeErrors (cuBLAS, NCCL, bitsandbytes).
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and ("out of memory" in str(err).lower() or "ALLOC_FAILED" in str(err)))


# ``--profile N``: after its timed steps, each row runs N more under torch.profiler (:func:`profile_steps`); the
# row's ``profile`` holds where they spent their time, and with PROFILE_TRACES a directory, their Chrome trace.
PROFILE_STEPS = 0
PROFILE_TRACES: Optional[str] = None


def busy_us(events) -> float:
    """The union of the CUDA kernels' intervals in a profiler trace (any stream; copies and memsets left out): the
    time the GPU computed, in microseconds."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name
                   and "Memset" not in e.name)
    busy, start, end = 0.0, None, None
    for s, e in spans:
        if end is None or s > end:
            if end is not None:
                busy += end - start
            start, end = s, e
        else:
            end = max(end, e)
    return busy + (end - start if end is not None else 0.0)


def profile_steps(step: Step, device: torch.device, steps: int, *, top: int = 20,
                  trace: Optional[str] = None) -> dict:
    """Runs ``steps`` more steps under torch.profiler; where they spent their time, per step.

    Returns:
        ``{"steps", "wall_ms", "kernel_busy_ms" (CUDA; None on the CPU), "kernels": [{"name", "ms", "calls"}]
        (the ``top`` CUDA kernels by total time), "cpu_ops": [...] (the ``top`` operators by self CPU time),
        "trace"}`` with every time and count per step; ``trace`` is the gzipped Chrome trace written (None without
        ``trace``, a path ending in ``.json.gz``).
    """
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
    events = prof.events()
    kernels: dict[str, list] = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(e.name, [0.0, 0])
            k[0] += e.time_range.elapsed_us()
            k[1] += 1
    ops = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:top]
    out = {"steps": steps, "wall_ms": wall * 1e3 / steps,
           "kernel_busy_ms": busy_us(events) / 1e3 / steps if cuda else None,
           "kernels": [{"name": n, "ms": t / 1e3 / steps, "calls": c / steps}
                       for n, (t, c) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]],
           "cpu_ops": [{"name": a.key, "self_cpu_ms": a.self_cpu_time_total / 1e3 / steps, "calls": a.count / steps}
                       for a in ops],
           "trace": None}
    if trace:
        os.makedirs(os.path.dirname(trace) or ".", exist_ok=True)
        raw = trace[:-len(".gz")] if trace.endswith(".gz") else trace
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as f, gzip.open(raw + ".gz", "wb") as g:
            shutil.copyfileobj(f, g)
        os.remove(raw)
        out["trace"] = raw + ".gz"
    return out


def profile_markdown(rows: list[dict], top: int = 8) -> str:
    """Each profiled row's top kernels (CUDA) or CPU operators, as markdown."""
    parts = []
    for r in rows:
        p = r.get("profile")
        if not p:
            continue
        title = r.get("label") or r.get("name") or r.get("row")
        busy = p["kernel_busy_ms"]
        head = f"**{title}**: {p['wall_ms']:.1f} ms per profiled step" + (
            f", GPU kernels busy {busy:.1f} ms ({100 * busy / p['wall_ms']:.0f}%)" if busy is not None else "")
        if p["kernels"]:
            lines = [f"| {k['ms']:.2f} ms | {k['calls']:g} | {k['name'][:100]} |" for k in p["kernels"][:top]]
            parts.append(f"{head}\n\n| kernel time | calls | kernel |\n|---|---|---|\n" + "\n".join(lines))
        else:
            lines = [f"| {o['self_cpu_ms']:.2f} ms | {o['calls']:g} | {o['name'][:100]} |" for o in p["cpu_ops"][:top]]
            parts.append(f"{head}\n\n| self CPU | calls | operator |\n|---|---|---|\n" + "\n".join(lines))
    return "\n\n".join(parts)


# ``--gc-freeze``: move every object alive after warm-up out of the cyclic GC's reach for the timed steps (for every
# row alike), so a full collection over the model's Python objects cannot land in a timed step.
GC_FREEZE = False


@contextlib.contextmanager
def python_gc_counted(row: dict, *, freeze: bool = False):
    """Counts Python's cyclic GC collections per generation, and their pause time, into ``row["python_gc"]``;
    with ``freeze``, ``gc.freeze()`` first (``gc.unfreeze()`` after)."""
    if freeze:
        gc.collect()
        gc.freeze()
    pauses = GcPauses().start()
    try:
        yield pauses
    finally:
        pauses.stop()
        if freeze:
            gc.unfreeze()
        row["python_gc"] = {**pauses.take(), "frozen": freeze}


def measure_training(name: str, setup: Callable[[], tuple[Step, Optional[Callable[[], None]]]], *,
                     device: torch.device, warmup: int = 3, repeats: int = 10,
                     vram_budget: Optional[int] = None, build: Optional[Callable[[], object]] = None,
                     tokens: Optional[int] = None, fields: Optional[dict] = None) -> dict:
    """Times one training configuration: optional uncapped ``build``, then ``setup`` and steps under the cap.

    Args:
        name: the row's ``name``.
        setup: called under the VRAM cap; returns ``(step, close)``: ``step()`` runs one full training
            step (and may return its loss, a tensor: the row then lists every step's loss, read after the timed
            steps so that no step waits on it), ``close()`` (or None) releases what the peer holds outside Python
            references.
        device: where it runs (CUDA: events + peak memory; CPU: perf_counter, no memory figures).
        warmup: untimed steps first (first-step allocations, JIT builds, optimizer state).
        repeats: timed steps; the median is reported.
        vram_budget: bytes the allocator may reserve (None: the whole GPU), see :func:`vram_cap`.
        build: run before the cap is set (for builds a small GPU would do from disk, e.g. quantization).
        tokens: tokens per step, for ``tokens_per_s``.
        fields: extra fields for the row (peer, shape, ...); read after ``setup``, which may add to it.

    Returns:
        ``{"name", **fields, "step_s", "tokens_per_s", "max_allocated", "max_reserved", "vram_budget",
        "status", "setup_s"}``; ``status`` is ``"ok"``, ``"oom"`` or ``"host memory"`` (the host arena could not
        grow: ``HostMemoryError``), the last two adding ``error`` and the device peak reached so far.
    """
    out = {"step_s": None, "tokens_per_s": None, "max_allocated": None, "max_reserved": None,
           "vram_budget": vram_budget, "status": "ok"}
    losses: list = []
    grad_norms: list = []
    cuda = device.type == "cuda"
    step = raw_step = close = None
    try:
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        if build is not None:
            build()
        free_memory()
        with vram_cap(vram_budget, device):
            raw_step, close = setup()
            out["setup_s"] = time.perf_counter() - t0
            step = _keeping_losses(raw_step, losses)
            with _grad_norms_kept(grad_norms) as armed:
                for _ in range(warmup):
                    armed.set()
                    step()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(device)
            with python_gc_counted(out, freeze=GC_FREEZE):
                # pipelined: an overlapped optimizer step's tail (side-stream copies, the CPU update the next
                # forward waits for) lands in the next step's time, as in a training loop
                out["step_s"] = median_time(step, repeats=repeats, warmup=0, cuda=cuda, pipelined=True)
            out["tokens_per_s"] = tokens / out["step_s"] if tokens else None
            if PROFILE_STEPS:
                trace = None
                if PROFILE_TRACES:
                    trace = os.path.join(PROFILE_TRACES, re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
                                         + ".json.gz")
                out["profile"] = profile_steps(raw_step, device, PROFILE_STEPS, trace=trace)
    except Exception as err:  # noqa: BLE001 - an OOM (device or host) is a result; anything else propagates
        if not (is_oom(err) or isinstance(err, HostMemoryError)):
            raise
        out["status"] = "oom" if is_oom(err) else "host memory"
        out["error"] = str(err).splitlines()[0][:300]
    finally:
        if cuda:
            out["max_allocated"] = torch.cuda.max_memory_allocated(device)
            out["max_reserved"] = torch.cuda.max_memory_reserved(device)
        if losses and out["status"] == "ok":  # warm-up steps first; each a float now that the steps are over
            out["losses"] = [float(v) for v in losses]
        if grad_norms and out["status"] == "ok":
            out["warmup_grad_norms"] = [_total_norm(parts) for parts in grad_norms]
        if close is not None:
            close()
        step = raw_step = close = None
        losses.clear()
        grad_norms.clear()
        free_memory()
    return {"name": name, **(fields or {}), **out}


@contextlib.contextmanager
def _grad_norms_kept(into: list):
    """While open, the first optimizer step (any ``torch.optim.Optimizer``) after each ``armed.set()`` (the
    yielded event: the harness arms it before each warm-up step) first appends the squared norms of the gradients
    it is about to apply, one tensor per device, not read yet (no synchronisation): a row whose gradients differ in
    scale from the others' (a quantized backward, a missing loss scale) shows in ``warmup_grad_norms`` even where
    Adam's normalisation hides it in the losses. The first step of a training step is the loop's own optimizer; the
    ones it runs inside (an offloading optimizer's device and host shares) are not recorded. Gradients that cannot
    be read there (consumed during backward by ``optimizer_in_backward``) are left out; with none readable the step
    records nothing. Warm-up steps only: the timed steps run without the hook."""
    armed = threading.Event()

    def hook(optimizer, args, kwargs):
        if not armed.is_set():
            return
        armed.clear()
        by_device: dict = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                try:
                    grad = p.grad
                except RuntimeError:  # consumed by its update during backward
                    continue
                if grad is not None:
                    by_device.setdefault(grad.device, []).append(grad)
        if by_device:
            into.append([torch.stack([n.float() ** 2 for n in torch._foreach_norm(grads)]).sum()
                         for grads in by_device.values()])

    handle = register_optimizer_step_pre_hook(hook)
    try:
        yield armed
    finally:
        handle.remove()


def _total_norm(parts: list) -> float:
    return float(sum(float(t) for t in parts)) ** 0.5


def _keeping_losses(step: Step, into: list) -> Step:
    """``step`` that appends what it returns, when a one-element tensor (its loss), to ``into``."""
    def run():
        value = step()
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            into.append(value)
    return run


LOG_LINES = 20  # a failed child's last lines of output kept in its row


def run_child(command: Callable[[str], list[str]], timeout: Optional[float], *, env: Optional[dict] = None) -> dict:
    """Runs ``command(out)``, a child that writes its result to the JSON file ``out``, in a process of its own with
    ``env`` (None: this one's). Returns what it wrote to ``out`` last (a child may write its result as it goes, whole
    each time), with the status ``crashed (exit N): <its last line>`` (or ``signal N``) where it died or ended without
    a finished result (no status, or ``running``), ``timeout after N s`` where it outlived ``timeout`` seconds (None:
    no limit), ``log_tail`` (its last lines of output) where the status is not ``ok``, and ``wall_s``. Every suite's
    rows run through this one runner."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="trainstream-bench-") as tmp:
        out, log = os.path.join(tmp, "result.json"), os.path.join(tmp, "output.txt")
        with open(log, "w") as f:
            try:
                code = subprocess.run(command(out), stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                                      env=env).returncode
                failure = None if code == 0 else f"crashed (exit {code})" if code > 0 else f"crashed (signal {-code})"
            except subprocess.TimeoutExpired:
                failure = f"timeout after {timeout:g} s"
        result = {}
        if os.path.exists(out):  # written whole (renamed into place), or by a program that ended
            with open(out) as f:
                try:
                    result = json.load(f)
                except ValueError:
                    pass
        with open(log, errors="replace") as f:
            tail = [line.rstrip()[:300] for line in f.read().splitlines()[-LOG_LINES:]]
    if failure is None and result.get("status", "running") == "running":
        failure = "crashed (exit 0)"
    if failure is not None:
        last = next((line for line in reversed(tail) if line.strip()), "no output")
        result["status"] = failure if failure.startswith("timeout") else f"{failure}: {last}"
    if result["status"] != "ok" and tail:
        result["log_tail"] = tail
    result["wall_s"] = time.perf_counter() - t0
    return result


def not_run(name: str, reason: str, **fields) -> dict:
    """A row for a peer that could not run here, with the reason."""
    return {"name": name, **fields, "step_s": None, "tokens_per_s": None, "max_allocated": None,
            "max_reserved": None, "status": f"not run: {reason}"}
