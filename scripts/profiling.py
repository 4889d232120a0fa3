"""What the profile scripts share: the GPU's busy time in a torch.profiler trace, the gzipped Chrome trace, and the
host's enqueue time of a call while the GPU is kept busy."""
import gzip
import os
import shutil
import time

import torch


def busy_time_us(events) -> float:
    """Union of the intervals of CUDA kernels (on any stream, copies and memsets left out): the GPU's busy time."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name
                   and "Memset" not in e.name)
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    return busy


def export_trace(prof, out: str | None, name: str) -> None:
    """Writes ``prof``'s Chrome trace to ``<out>/<name>.json.gz`` (nothing when ``out`` is unset)."""
    if not out:
        return
    path = os.path.join(out, f"{name}.json")
    prof.export_chrome_trace(path)
    with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
        shutil.copyfileobj(f, g)
    os.remove(path)


def enqueue_seconds(fn, n: int) -> float:
    """Host seconds per call of ``fn`` while the GPU is kept busy by a ~1 s spin kernel queued first, so its launches
    never wait for the device (a call that does wait shows ~1 s / n). ``fn`` runs once before, untimed. Keep n calls
    under CUDA's ~1024 pending launches: past that, launches wait like a sync (benchmarks/NOTES.md: the 50 ms per step
    read at f4de1e0 on the H200, 2026-12-04)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    seconds = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    return seconds
