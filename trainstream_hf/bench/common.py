"""What every benchmark writes: the environment it ran in, a markdown table, and a JSON file."""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable, Sequence

import torch

from trainstream_hf.provenance import git_commit

RESULTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           "benchmarks", "results")


# The suite's arguments as main() received them (sys.argv[1:] when run from the command line).
ARGV: list[str] | None = None


def environment(command: str | None = None) -> dict:
    """Command (default: this bench suite's), git commit, GPU, versions, host and date of this run."""
    commit, dirty = git_commit(os.path.dirname(RESULTS_DIR))  # TRAINSTREAM_COMMIT wins (a copied tree)
    commit = commit or "unknown"
    env = {
        "command": command or " ".join([os.path.basename(sys.executable), "-m", "trainstream_hf.bench"]
                                       + (sys.argv[1:] if ARGV is None else ARGV)),
        "commit": commit,
        "dirty": dirty,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": None,
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env["gpu"] = {"name": p.name, "capability": f"{p.major}.{p.minor}",
                      "memory_bytes": p.total_memory, "driver": _driver_version()}
    return env


def _driver_version() -> str | None:
    try:
        return subprocess.check_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       text=True, stderr=subprocess.DEVNULL).strip().splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return None


# Dense bf16 tensor-core peak FLOP/s by GPU name (the datasheets' figures "with sparsity", halved): NVIDIA H100
# Tensor Core GPU datasheet (SXM 1,979 TFLOPS, PCIe 1,513, NVL 1,671) and NVIDIA H200 datasheet (1,979).
PEAK_BF16_DENSE = (("H200", 989.5e12), ("H100 PCIe", 756.5e12), ("H100 NVL", 835.5e12), ("H100", 989.5e12))


def peak_bf16_flops(gpu_name: str | None) -> float | None:
    """The dense bf16 peak of the GPU called ``gpu_name`` (``torch.cuda.get_device_name``), None when unknown."""
    for key, flops in PEAK_BF16_DENSE:
        if gpu_name and key in gpu_name:
            return flops
    return None


def median_time(fn: Callable[[], None], *, repeats: int = 10, warmup: int = 2, cuda: bool = False,
                pipelined: bool = False) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after ``warmup`` runs (CUDA events when ``cuda``).

    ``pipelined`` (CUDA): the runs follow each other with no synchronisation between them, an event recorded after
    each; a run's time is the GPU timeline from the previous run's event to its own. A training step whose work
    carries over into the next one (an overlapped optimizer step: copies on side streams, a CPU update the next
    forward waits for) is then charged for it, as in a training loop; synchronising before each run would hide that
    work outside the timed window.
    """
    for _ in range(warmup):
        fn()
    times = []
    if cuda and pipelined:
        torch.cuda.synchronize()
        events = [torch.cuda.Event(enable_timing=True)]
        events[0].record()
        for _ in range(repeats):
            fn()
            events.append(torch.cuda.Event(enable_timing=True))
            events[-1].record()
        events[-1].synchronize()
        times = [a.elapsed_time(b) / 1e3 for a, b in zip(events, events[1:])]
        return statistics.median(times)
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def markdown_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return "" if v is None else str(v)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_json(name: str, payload: dict, out_dir: str | None = None, command: str | None = None) -> str:
    """Writes ``payload`` (plus the environment, :func:`environment`'s ``command``) to ``<out_dir>/<name>.json``;
    returns the path. Written under a temporary name and renamed: the table rewrites its JSON after every row, and a
    run stopped (Ctrl-C, the machine taken back) during a write keeps the previous rows' file whole."""
    out_dir = out_dir or RESULTS_DIR
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    tmp = os.path.join(out_dir, f".{name}.json.partial")
    try:
        with open(tmp, "w") as f:
            json.dump({"environment": environment(command), **payload}, f, indent=1, sort_keys=False)
            f.write("\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path
