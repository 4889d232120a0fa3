"""What a recipe measures while it trains, and the summary it prints and writes as JSON."""
from __future__ import annotations

import datetime
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from trainstream_hf.provenance import git_commit
from trainstream_hf.train.config import ConfigError

__all__ = ["StepLog", "peak_memory", "plan_summary", "run_info", "check_output_dir", "write_summary",
           "endpoints", "write_curves", "format_summary", "format_dpo_summary", "format_grpo_summary", "format_table",
           "format_run"]


class StepLog:
    """Per-step wall time and loss, and the engine's per-step figures when the model is wrapped.

    ``model.trainstream_stats()`` describes the last *completed* step (it closes when ``optimizer.step()``
    returns), so each new figure is recorded once, keyed by its step number.
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
        """Medians over the recorded steps of bytes moved each way, and the last step's full figures."""
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
            "offloaded_optimizer_numel": plan.offload_numel, "resident_optimizer_numel": plan.resident_numel,
            "streamed_optimizer_numel": plan.streamed_numel, "moment_bytes": plan.moment_bytes, "grads": plan.grads,
            "predicted_peak_bytes": plan.predicted_peak(), "pcie_bytes_per_step": plan.pcie_bytes(),
            "host_bytes": plan.host_bytes()}


def _git_commit() -> str | None:
    return git_commit(Path(__file__).resolve().parent)[0]  # TRAINSTREAM_COMMIT wins (a copied tree)


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
    """Fails now, before any work, unless ``output_dir`` can be written at the end: makes it (and any missing
    parents), creates and deletes a file in it, then removes the directories it made. Permission bits alone do not
    tell (root passes ``os.access`` where ``/proc`` still refuses every new file), so the check writes for real; it
    leaves nothing behind, whether it passes or fails.

    Raises:
        NotADirectoryError: ``output_dir`` or one of its ancestors is a file.
        ConfigError: the directory cannot be made or written in; naming the path and the reason.
    """
    path = Path(output_dir).absolute()
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"output_dir: {output_dir!r} exists and is not a directory")
    missing = []  # deepest first
    parent = path
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    if not parent.is_dir():
        raise NotADirectoryError(f"output_dir: {output_dir!r} cannot be created: {str(parent)!r} is a file")
    made: list[Path] = []
    step = ""
    try:
        for d in reversed(missing):
            step = f"making {str(d)!r}"
            try:
                d.mkdir()
            except FileExistsError:  # made meanwhile by another process: not ours to remove
                continue
            made.append(d)
        step = "creating a file in it"
        fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"output_dir: {output_dir!r} cannot be written ({step}: {e.strerror or e}); pass "
                          "--output_dir a directory you can create files in") from None
    finally:
        for d in reversed(made):
            try:
                d.rmdir()
            except OSError:
                pass


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


def endpoints(before: float, after: float, steps: int) -> list[list[float]]:
    """A held-out figure as a two-point curve: ``before`` at step 0, ``after`` at step ``steps``."""
    return [[0, before], [steps, after]]


def write_curves(output_dir: str, title: str, losses: dict[str, list], metrics: dict[str, list],
                 engine: list[dict] | None = None, name: str = "curves.png") -> Path:
    """Draws the run's curves into ``<output_dir>/<name>`` (a PNG, next to ``summary.json``) and returns its path.

    Up to three panels side by side, sharing the step axis: the losses; the recipe's other figures (accuracy,
    reward, exact match); and, when the engine ran, its H2D and D2H GB/s of every step. A panel without any points
    is left out. Like :func:`write_summary` the file is written under a temporary name and renamed. matplotlib
    (Agg backend, no display needed) is imported here, so a run pays for it only when it draws.

    Args:
        output_dir: the run's output directory (created if missing).
        title: the figure's title.
        losses: label -> ``[[step, value], ...]``: training loss (per step or per log) and held-out loss
            (:func:`endpoints`), drawn on one panel.
        metrics: label -> ``[[step, value], ...]``: the evaluation figures, on a second panel.
        engine: the engine's per-step figures as ``model.trainstream_stats()`` returns them (``step``, 0-based;
            ``h2d_GBps``, ``d2h_GBps``); None or empty when the model was not wrapped.
        name: the PNG's file name.

    Returns:
        The PNG's path.
    """
    import matplotlib
    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt

    def drawn(series: dict[str, list]) -> dict[str, list]:
        return {label: points for label, points in series.items() if points}

    panels: list[tuple[str, dict[str, list]]] = [("loss", drawn(losses)), ("evaluation", drawn(metrics))]
    if engine:
        steps = [s["step"] + 1 for s in engine]  # the engine counts from 0, the recipes' steps from 1
        panels.append(("engine GB/s per step", {"H2D": list(zip(steps, (s["h2d_GBps"] for s in engine))),
                                                "D2H": list(zip(steps, (s["d2h_GBps"] for s in engine)))}))
    panels = [(ylabel, series) for ylabel, series in panels if series]
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(4.6 * max(len(panels), 1), 3.6), squeeze=False)
    for ax, (ylabel, series) in zip(axes[0], panels):
        for label, points in series.items():
            xs, ys = zip(*points)
            # Before / after figures are two points: markers and a dashed line between them, not a curve.
            style = dict(marker="o", linestyle="--") if len(points) <= 2 else dict(marker="." if len(points) <= 50
                                                                                    else None)
            ax.plot(xs, ys, label=label, linewidth=1.2, **style)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    tmp = out / f".{name}.partial"
    try:
        fig.savefig(tmp, format="png", dpi=100)
    finally:
        plt.close(fig)
    os.replace(tmp, path)
    return path


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def format_table(rows: list[tuple[str, str, str]], title: str = "held-out") -> list[str]:
    """``(label, before, after)`` rows as markdown table lines (with a blank line either side)."""
    return ["", f"| {title} | before | after |", "|---|---|---|", *[f"| {a} | {b} | {c} |" for a, b, c in rows], ""]


def format_summary(s: dict) -> str:
    """The sft summary as a few readable lines (markdown table for the before/after figures)."""
    em, loss = s["exact_match"], s["loss"]
    if em is None:
        lines = ["", "held-out evaluation: off (eval.enabled false)", ""]
    else:
        lines = format_table([
            ("loss per completion token", f"{loss['before']:.3f}", f"{loss['after']:.3f}"),
            ("exact match", f"{em['before']:.1%} ({em['correct_before']}/{em['total']})",
             f"{em['after']:.1%} ({em['correct_after']}/{em['total']})")])
    return "\n".join(lines + format_run(s))


def format_run(s: dict) -> list[str]:
    """The lines every recipe's summary ends with: steps and time, peak memory, what the engine moved."""
    t = s["timing"]
    rate = f", {t['tokens_per_second']:.0f} tokens/s" if t.get("tokens_per_second") else ""
    lines = [f"{s['steps']} steps in {t['train_seconds']:.1f} s (median step "
             f"{t['median_step_seconds'] * 1e3:.0f} ms{rate}); whole run {t['wall_seconds']:.1f} s"]
    mem = s["peak_memory"]
    lines.append(f"peak memory ({mem['kind']}): {_mib(mem['bytes'])}")
    ts = s.get("trainstream")
    if ts and not ts["steps_measured"]:
        lines.append("trainstream: no completed step measured (a step's figures close when optimizer.step() returns)")
    elif ts:
        passes = (f", {ts['engine_steps_per_step']:g} forward passes each" if ts.get("engine_steps_per_step", 1) != 1
                  else "")
        lines.append(f"trainstream per step: H2D {_mib(ts['h2d_bytes_per_step'])}, D2H {_mib(ts['d2h_bytes_per_step'])}"
                     f" (median of {ts['steps_measured']} steps{passes}); arena {_mib(ts['arena_reserved_bytes'])} "
                     "reserved; "
                     f"plan: blocks {ts['plan']['paged_blocks']} paged, activations of "
                     f"{ts['plan']['offloaded_activation_blocks']} offloaded, optimizer state of "
                     f"{ts['plan']['offloaded_optimizer_params']} parameters on the host")
    else:
        lines.append("trainstream: off (wrap=false)")
    procs = s.get("processes") or {}
    if procs.get("world", 1) > 1:
        each = procs["per_process"]
        shared = max(p.get("host_shared_bytes", 0) for p in each)
        steps = ", ".join(f"{p['median_step_seconds'] * 1e3:.0f}" for p in each)
        lines.append(f"{procs['world']} processes (data parallel, {t['tokens_per_second']:.0f} tokens/s together): "
                     f"median steps {steps} ms; host "
                     f"memory (PSS) {_mib(procs['host_pss_bytes'])} in all"
                     + (f", of which a {_mib(shared)} frozen base shared by the processes of a host" if shared else ""))
    return lines


def _first_last(s: dict, key: str, fmt: str) -> str:
    first, last = s["train"]["first"].get(key), s["train"]["last"].get(key)
    return "n/a" if first is None else f"{first:{fmt}} -> {last:{fmt}}"


def format_dpo_summary(s: dict) -> str:
    """The dpo summary: held-out pair figures before / after, the logged training figures first -> last, the run."""
    h = s["heldout"]
    if h is None:
        lines = ["", "held-out evaluation: off (eval.enabled false)", ""]
    else:
        b, a = h["before"], h["after"]
        rows = [("DPO loss", f"{b['loss']:.3f}", f"{a['loss']:.3f}"),
                ("reward margin (mean)", f"{b['reward_margin']:.3f}", f"{a['reward_margin']:.3f}"),
                ("reward accuracy (chosen > rejected)", f"{b['reward_accuracy']:.1%}", f"{a['reward_accuracy']:.1%}")]
        rows += [(f"  rejected by {kind} ({n['pairs']} pairs)", f"{n['reward_accuracy']:.1%}",
                  f"{a['by_corruption'][kind]['reward_accuracy']:.1%}") for kind, n in b["by_corruption"].items()]
        rows.append(("policy log-prob: chosen > rejected", f"{b['logp_accuracy']:.1%}", f"{a['logp_accuracy']:.1%}"))
        lines = format_table(rows, title=f"held-out pairs ({s['pairs']['heldout']})")
        if b["reward_margin"] == 0.0:
            lines.insert(-1, "(before training the policy is its reference, LoRA B = 0: every margin is 0, a tie, "
                             "counted as not ranked right)")
    lines.append(f"training batches (first -> last log): loss {_first_last(s, 'loss', '.3f')}, reward accuracy "
                 f"{_first_last(s, 'rewards/accuracies', '.2f')}, margin {_first_last(s, 'rewards/margins', '.3f')}")
    return "\n".join(lines + format_run(s))


def format_grpo_summary(s: dict) -> str:
    """The grpo summary: held-out greedy rewards before / after, the sampled training rewards first -> last, the
    run."""
    h = s["heldout"]
    if h is None:
        lines = ["", "held-out evaluation: off (eval.enabled false)", ""]
    else:
        b, a = h["before"], h["after"]
        rows = [(f"reward {name} (greedy)", f"{b['rewards'][name]:.3f}", f"{a['rewards'][name]:.3f}")
                for name in b["rewards"]]
        rows.append(("exact match (greedy)", f"{b['exact_match']:.1%} ({b['correct']}/{b['total']})",
                     f"{a['exact_match']:.1%} ({a['correct']}/{a['total']})"))
        lines = format_table(rows)
    lines.append(f"sampled completions (first -> last log): mean reward {_first_last(s, 'reward', '.3f')}, "
                 f"mean length {_first_last(s, 'completions/mean_length', '.1f')}, "
                 f"KL {_first_last(s, 'kl', '.4f')}, loss {_first_last(s, 'loss', '.4f')}")
    curve = s["train"]["curves"].get("reward") or []
    if curve:
        lines.append("mean reward by step: " + ", ".join(f"{int(step)}: {v:.3f}" for step, v in curve))
    return "\n".join(lines + format_run(s))
