"""What a recipe measures while it trains, and the summary it prints and writes as JSON."""
from __future__ import annotations

import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
from pathlib import Path

import torch

__all__ = ["StepLog", "peak_memory", "plan_summary", "run_info", "check_output_dir", "write_summary",
           "format_summary"]


class StepLog:
    """Per-step wall time and loss, and the engine's per-step figures when the model is wrapped.

    ``model.trainstream_stats()`` describes the last *completed* step (a step closes when the next one's
    forward begins), so each new figure is recorded once, keyed by its step number.
    """

    def __init__(self, model=None):
        self.model = model
        self.seconds: list[float] = []
        self.losses: list[float] = []
        self.engine: list[dict] = []

    def record(self, seconds: float, loss: float) -> None:
        self.seconds.append(seconds)
        self.losses.append(loss)
        stats = getattr(self.model, "trainstream_stats", None)
        if stats is not None:
            s = stats()
            if s and (not self.engine or s["step"] != self.engine[-1]["step"]):
                self.engine.append(s)

    def loss_curve(self, every: int) -> list[list[float]]:
        """``[step, mean loss of the steps since the previous point]`` every ``every`` steps (1-based)."""
        out = []
        for end in range(every, len(self.losses) + 1, every):
            out.append([end, statistics.fmean(self.losses[end - every:end])])
        if len(self.losses) % every:
            k = len(self.losses) % every
            out.append([len(self.losses), statistics.fmean(self.losses[-k:])])
        return out

    def engine_summary(self) -> dict:
        """Medians over the recorded steps of bytes moved each way, and the last step's full figures. The
        last step of a run is never among them: nothing starts after it to close it."""
        if not self.engine:
            return {"steps_measured": 0}
        med = {k: statistics.median(s[k] for s in self.engine)
               for k in ("h2d_bytes", "d2h_bytes", "h2d_GBps", "d2h_GBps", "step_seconds")}
        out = {f"{k}_per_step" if k.endswith("bytes") else k: v for k, v in med.items()}
        out["steps_measured"] = len(self.engine)
        out["arena_reserved_bytes"] = self.engine[-1]["arena_reserved_bytes"]
        out["arena_used_bytes"] = self.engine[-1]["arena_used_bytes"]
        peaks = [s["peak_allocated_bytes"] for s in self.engine if "peak_allocated_bytes" in s]
        if peaks:
            out["peak_allocated_bytes"] = max(peaks)
        out["last_step"] = self.engine[-1]
        return out


def peak_memory(device: torch.device) -> dict:
    """Peak memory of the run: CUDA ``max_memory_allocated`` / ``max_memory_reserved`` on a GPU, the process's
    maximum resident set size on the CPU. (The engine resets CUDA's peak counters at each step; the
    per-step peaks it reports are in the trainstream section.)"""
    if device.type == "cuda":
        return {"kind": "cuda max_memory_allocated", "bytes": torch.cuda.max_memory_allocated(device),
                "reserved_bytes": torch.cuda.max_memory_reserved(device)}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"kind": "process max RSS", "bytes": rss * (1 if sys.platform == "darwin" else 1024)}


def plan_summary(plan) -> dict:
    """The plan's placement decisions as JSON values."""
    return {"paged_blocks": plan.paged_blocks, "offloaded_activation_blocks": plan.offloaded_activation_blocks,
            "recomputed_blocks": plan.recomputed_blocks, "offloaded_optimizer_params": len(plan.offload_optimizer),
            "offloaded_optimizer_numel": plan.offload_numel, "grads": plan.grads,
            "predicted_peak_bytes": plan.predicted_peak(), "pcie_bytes_per_step": plan.pcie_bytes(),
            "host_bytes": plan.host_bytes()}


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def run_info(device: torch.device, command: str) -> dict:
    """Command, versions, commit, host and date: what makes a result reproducible."""
    import transformers

    import trainstream_hf

    info = {"command": command,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": _git_commit(), "torch": torch.__version__, "transformers": transformers.__version__,
            "trainstream_hf": trainstream_hf.__version__, "python": platform.python_version(),
            "device": str(device), "cpu_threads": torch.get_num_threads()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def check_output_dir(output_dir: str) -> None:
    """Fails now, before any work, if ``output_dir`` could not be written at the end: it is a file, or its nearest
    existing ancestor is not a writable directory. Creates nothing.

    Raises:
        NotADirectoryError, PermissionError: with the option's name and the path.
    """
    path = Path(output_dir).absolute()
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"output_dir: {output_dir!r} exists and is not a directory")
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise NotADirectoryError(f"output_dir: {output_dir!r} cannot be created: {str(probe)!r} is a file")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise PermissionError(f"output_dir: {output_dir!r} cannot be written ({str(probe)!r} is not writable)")


def write_summary(summary: dict, output_dir: str) -> Path:
    """Writes ``summary.json`` under ``output_dir`` (created) and returns its path. The file is written under a
    temporary name and renamed, so it is either complete or absent."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "summary.json"
    tmp = out / ".summary.json.partial"
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def format_summary(s: dict) -> str:
    """The summary as a few readable lines (markdown table for the before/after figures)."""
    em, loss = s["exact_match"], s["loss"]
    if em is None:
        lines = ["", "held-out evaluation: off (eval.enabled false)", ""]
    else:
        lines = ["", "| held-out | before | after |", "|---|---|---|",
                 f"| loss per completion token | {loss['before']:.3f} | {loss['after']:.3f} |",
                 f"| exact match | {em['before']:.1%} ({em['correct_before']}/{em['total']}) | "
                 f"{em['after']:.1%} ({em['correct_after']}/{em['total']}) |", ""]
    t = s["timing"]
    lines.append(f"{s['steps']} steps in {t['train_seconds']:.1f} s (median step "
                 f"{t['median_step_seconds'] * 1e3:.0f} ms, {t['tokens_per_second']:.0f} tokens/s); "
                 f"whole run {t['wall_seconds']:.1f} s")
    mem = s["peak_memory"]
    lines.append(f"peak memory ({mem['kind']}): {_mib(mem['bytes'])}")
    ts = s.get("trainstream")
    if ts and not ts["steps_measured"]:
        lines.append("trainstream: no completed step measured (a step's figures close when the next one begins)")
    elif ts:
        lines.append(f"trainstream per step: H2D {_mib(ts['h2d_bytes_per_step'])}, D2H {_mib(ts['d2h_bytes_per_step'])}"
                     f" (median of {ts['steps_measured']} steps); arena {_mib(ts['arena_reserved_bytes'])} reserved; "
                     f"plan: blocks {ts['plan']['paged_blocks']} paged, activations of "
                     f"{ts['plan']['offloaded_activation_blocks']} offloaded, optimizer state of "
                     f"{ts['plan']['offloaded_optimizer_params']} parameters on the host")
    else:
        lines.append("trainstream: off (wrap=false)")
    return "\n".join(lines)
