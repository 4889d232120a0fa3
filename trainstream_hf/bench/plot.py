"""PNG bar charts of a benchmark JSON: ``python -m trainstream_hf.bench.plot RESULT.json [...]``.

Each JSON written by a suite with a ``results`` list (engine, peers, quant) becomes ``RESULT.png`` beside it: one
bar per row that ran, step time on the left, peak device memory on the right (allocated and reserved, with the VRAM
budget drawn as a line where the run had one). Rows that did not run are listed under the chart with their reason,
so a missing bar is never silent. Needs matplotlib (``pip install matplotlib``); it runs on the development machine
over committed results, not on the GPU machine.
"""
from __future__ import annotations

import argparse
import json
import os
import textwrap
from typing import Optional

GIB = 2 ** 30


def _step_seconds(row: dict) -> Optional[float]:
    if row.get("step_s") is not None:
        return float(row["step_s"])
    if row.get("step_ms") is not None:
        return float(row["step_ms"]) / 1e3
    return None


def rows_to_plot(payload: dict) -> tuple[list[dict], list[dict]]:
    """Splits ``payload['results']`` into rows with a step time and rows that did not run.

    Returns:
        ``(ran, skipped)``; ``ran`` rows carry ``label``, ``step_s``, ``alloc_gib``, ``reserved_gib``;
        ``skipped`` rows carry ``label`` and ``status``.
    """
    if not isinstance(payload.get("results"), list):
        raise ValueError("plot: the JSON has no 'results' list (engine, peers and quant suites have one)")
    ran, skipped = [], []
    for r in payload["results"]:
        # the table's own label first (it says which row ran without the cap)
        label = r.get("label") or r.get("name") or r.get("key") or r.get("peer") or "?"
        step = _step_seconds(r)
        if r.get("status", "ok") != "ok" or step is None:
            skipped.append({"label": label, "status": r.get("status", "no step time")})
            continue
        alloc = r.get("max_allocated") or r.get("peak_allocated_bytes")
        reserved = r.get("max_reserved") or r.get("peak_reserved_bytes")
        ran.append({"label": label, "step_s": step,
                    "alloc_gib": None if alloc is None else alloc / GIB,
                    "reserved_gib": None if reserved is None else reserved / GIB,
                    "budget_gib": None if not r.get("vram_budget") else r["vram_budget"] / GIB})
    return ran, skipped


def plot(path: str, out: Optional[str] = None) -> str:
    """Writes the bar chart of the benchmark JSON at ``path``; returns the PNG's path."""
    import matplotlib
    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt

    with open(path) as f:
        payload = json.load(f)
    ran, skipped = rows_to_plot(payload)
    if not ran:
        raise ValueError(f"plot: no row of {path} ran ({len(skipped)} not run)")
    env = payload.get("environment", {})
    gpu = (env.get("gpu") or {}).get("name", "CPU")
    labels = ["\n".join(textwrap.wrap(r["label"], 28)) for r in ran]
    ys = list(range(len(ran)))[::-1]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 1.0 + 0.55 * len(ran)), sharey=True)
    ax_t.barh(ys, [r["step_s"] for r in ran], color="#4c72b0")
    for y, r in zip(ys, ran):
        ax_t.text(r["step_s"], y, f" {r['step_s']:.3g} s", va="center", fontsize=8)
    ax_t.set_yticks(ys, labels, fontsize=8)
    ax_t.set_xlabel("step time (s, median)")
    ax_t.margins(x=0.2)
    alloc = [r["alloc_gib"] or 0.0 for r in ran]
    reserved = [r["reserved_gib"] or 0.0 for r in ran]
    ax_m.barh([y + 0.2 for y in ys], reserved, height=0.4, color="#dd8452", label="peak reserved")
    ax_m.barh([y - 0.2 for y in ys], alloc, height=0.4, color="#55a868", label="peak allocated")
    budgets = sorted({r["budget_gib"] for r in ran if r["budget_gib"]})
    for b in budgets:
        ax_m.axvline(b, color="#c44e52", linestyle="--", linewidth=1)
        ax_m.text(b, max(ys) + 0.5, f" budget {b:.0f} GiB", color="#c44e52", fontsize=8, va="bottom")
    ax_m.set_xlabel("device memory (GiB)")
    ax_m.legend(fontsize=8, loc="lower right")
    title = f"{os.path.basename(path)} - {gpu}, commit {str(env.get('commit', '?'))[:10]}, {env.get('date', '')}"
    fig.suptitle(title, fontsize=9)
    if skipped:
        note = "not run: " + "; ".join(f"{s['label']} ({s['status']})" for s in skipped)
        fig.text(0.01, 0.005, "\n".join(textwrap.wrap(note, 180)), fontsize=7, va="bottom")
    fig.tight_layout(rect=(0, 0.04 if skipped else 0, 1, 0.97))
    out = out or os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainstream_hf.bench.plot", description=__doc__)
    parser.add_argument("json", nargs="+", help="benchmark JSON files (benchmarks/results/*.json)")
    args = parser.parse_args(argv)
    for p in args.json:
        print(plot(p))


if __name__ == "__main__":
    main()
