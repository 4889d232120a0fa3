"""The benchmark table: one LoRA step of an 8B-class model under one VRAM cap, every row in a process of its own.

``python -m trainstream_hf.bench table [--shape llama3.1-8b] [--peers ts_nf4,bnb_ckpt,...] [--vram-budget-gib 24]``

Every row trains the same seeded random weights on the same batch (``batch`` x ``seq`` tokens, bf16 compute, LoRA
r16 on every linear layer but the LM head, AdamW on the adapters) under the same allocator cap, timed by
:func:`trainstream_hf.bench.harness.measure_training` (median of ``repeats`` steps after ``warmup``). Each row runs
in a child process (``python -m trainstream_hf.bench.table --child ROW ...``), so a row's allocator state, a crash
or a hang cannot touch another's: a child that dies or outlives ``row_timeout`` is a row with that status, an
out-of-memory under the cap is a row with the peak it reached, a peer that is not installed is a row saying so.

Columns: median step, tokens/s, peak allocated and reserved VRAM, the step time over the fastest row's, the last
loss (every step's loss is in the JSON, so a fast row that trains something else shows), the gradient norm of the
first step (every warm-up step's is in the JSON: Adam hides a gradient's scale in the losses), and for trainstream rows
the plan's first line and the PCIe GB/s of the last step. The JSON (``results``: the rows; the environment:
command, commit, GPU, versions, date) is what the README's table is made from (:func:`readme_table`).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from typing import Callable, Optional

import torch

from trainstream_hf.bench.common import markdown_table, peak_bf16_flops
from trainstream_hf.bench.harness import run_child
from trainstream_hf.bench.models import lora_step_flops
from trainstream_hf.bench.peers import LORA

GiB = 2**30

# row -> (label, module of trainstream_hf.bench, function, its options). The functions take shape, batch, seq,
# warmup, repeats, vram_budget and seed, and return one row (harness.measure_training / harness.not_run).
ROWS: dict[str, tuple[str, str, str, dict]] = {
    "ts_nvfp4_outliers": ("trainstream nvfp4, 1% outliers", "engine", "trainstream_quant",
                          dict(quantize="nvfp4", outliers=0.01)),
    "ts_nvfp4": ("trainstream nvfp4", "engine", "trainstream_quant", dict(quantize="nvfp4")),
    "ts_nf4": ("trainstream nf4", "engine", "trainstream_quant", dict(quantize="nf4")),
    "ts_nf4_compiled": ("trainstream nf4, compiled blocks", "engine", "trainstream_quant",
                        dict(quantize="nf4", compile_blocks=True, name_suffix=", compiled blocks")),
    # every block's saved activations in host RAM (forced): the row set beside Unsloth's offloaded checkpointing,
    # where memory is short
    "ts_nf4_offload": ("trainstream nf4, activations offloaded", "engine", "trainstream_quant",
                       dict(quantize="nf4", offload_activations=True, name_suffix=", activations offloaded")),
    "ts_nf4_offload_compiled": ("trainstream nf4, activations offloaded, compiled blocks", "engine",
                                "trainstream_quant", dict(quantize="nf4", offload_activations=True, compile_blocks=True,
                                                          name_suffix=", activations offloaded, compiled blocks")),
    # the plan's budget is the peak Unsloth's offloaded checkpointing reached in the same run (the table runs that
    # row first): the plan chooses what to offload or recompute to meet it; "at equal or lower peak", measured
    "ts_nf4_at_ckpt_peak": ("trainstream nf4, compiled blocks, plan budget = Unsloth checkpointing's peak", "engine",
                            "trainstream_quant", dict(quantize="nf4", compile_blocks=True,
                                                      name_suffix=", compiled blocks, budget of a peer's peak")),
    "ts_fp8": ("trainstream fp8", "engine", "trainstream_quant", dict(quantize="fp8")),
    "ts_fp8_compiled": ("trainstream fp8, compiled blocks", "engine", "trainstream_quant",
                        dict(quantize="fp8", compile_blocks=True, name_suffix=", compiled blocks")),
    "ts_auto": ("trainstream bf16 base, auto plan", "engine", "trainstream_lora", {}),
    "bnb": ("bitsandbytes QLoRA nf4 + PEFT", "peers", "bnb_qlora", dict(grad_ckpt=False)),
    "bnb_ckpt": ("bitsandbytes QLoRA nf4 + PEFT, checkpointing", "peers", "bnb_qlora", dict(grad_ckpt=True)),
    "ds_lora": ("DeepSpeed ZeRO-2 optimizer offload + PEFT, bf16", "peers", "deepspeed_zero2_offload",
                dict(lora=True, grad_ckpt=False)),
    "ds_lora_ckpt": ("DeepSpeed ZeRO-2 optimizer offload + PEFT, bf16, checkpointing", "peers",
                     "deepspeed_zero2_offload", dict(lora=True, grad_ckpt=True)),
    "unsloth": ("Unsloth 4-bit + LoRA", "unsloth", "unsloth_lora", dict(grad_ckpt=False)),
    "unsloth_ckpt": ("Unsloth 4-bit + LoRA, its checkpointing", "unsloth", "unsloth_lora", dict(grad_ckpt=True)),
    "peft": ("PyTorch + PEFT, bf16", "peers", "peft_lora", dict(grad_ckpt=False)),
    "peft_ckpt": ("PyTorch + PEFT, bf16, checkpointing", "peers", "peft_lora", dict(grad_ckpt=True)),
    "peft_uncapped": ("PyTorch + PEFT, bf16, no VRAM cap (reference)", "peers", "peft_lora", dict(grad_ckpt=False)),
}
# Rows that run without the table's VRAM cap: the unconstrained speed the capped rows are held against. They are
# never "the fastest row" of vs_fastest (which compares rows under the cap).
UNCAPPED = frozenset({"peft_uncapped"})
# Rows whose plan budget is another row's peak allocated memory in the same run (that row runs first; the table's
# cap stays the process's cap).
PLAN_BUDGET_OF = {"ts_nf4_at_ckpt_peak": "unsloth_ckpt"}
# Rows whose process gets the environment of trainstream_hf.bench.unsloth.child_env (Unsloth's own folder first).
UNSLOTH = frozenset({"unsloth", "unsloth_ckpt"})
COLUMNS = ("row", "status", "step_s", "tokens_per_s", "mfu", "alloc_GiB", "reserved_GiB", "vs_fastest", "last_loss",
           "grad_norm", "pcie_GBps", "plan")


def run_row(row: str, *, shape: str, batch: int, seq: int, warmup: int, repeats: int,
            vram_budget: Optional[int], seed: int = 0, plan_budget: Optional[int] = None) -> dict:
    """Runs one row in this process; returns its result (what the child writes). ``plan_budget``: the plan's
    budget of a :data:`PLAN_BUDGET_OF` row (under the cap ``vram_budget``)."""
    label, module, function, options = ROWS[row]
    fn: Callable[..., dict] = getattr(importlib.import_module(f"trainstream_hf.bench.{module}"), function)
    if plan_budget is not None:
        options = {**options, "plan_budget": plan_budget}
    result = fn(shape, batch=batch, seq=seq, warmup=warmup, repeats=repeats,
                vram_budget=None if row in UNCAPPED else vram_budget, seed=seed, **options)
    return {**result, "row": row, "label": label}


# A peer's library, by the row function that needs it: a row whose library this interpreter lacks is "not run"
# (the reason its own function gives) without starting a process for it.
NEEDS = {"bnb_qlora": "bitsandbytes", "deepspeed_zero2_offload": "deepspeed"}


def _child(row: str, args: dict, timeout: Optional[float]) -> dict:
    """``row`` in a child process; a crash or a timeout is the row's status."""
    label = ROWS[row][0]
    need = NEEDS.get(ROWS[row][2])
    if need is not None and importlib.util.find_spec(need) is None:
        return {"row": row, "label": label, "status": f"not run: {need} not installed"}
    if row in UNSLOTH and torch.version.cuda is None:  # a torch built without CUDA (the row's child would say so)
        from trainstream_hf.bench.unsloth import NEEDS_CUDA
        return {"row": row, "label": label, "status": f"not run: {NEEDS_CUDA}"}
    env = None
    if row in UNSLOTH:
        from trainstream_hf.bench.unsloth import child_env
        env = child_env()
    result = run_child(lambda out: [sys.executable, "-m", "trainstream_hf.bench.table", "--child", row, "--json", out,
                                    "--child-args", json.dumps(args), "--harness", json.dumps(harness_settings())],
                       timeout, env=env)
    return {"row": row, "label": label, **result}


def harness_settings() -> dict:
    """The harness's process-wide settings (``--gc-freeze``, ``--profile``), for a row's child process."""
    from trainstream_hf.bench import harness
    return {"GC_FREEZE": harness.GC_FREEZE, "PROFILE_STEPS": harness.PROFILE_STEPS,
            "PROFILE_TRACES": harness.PROFILE_TRACES}


def _rows_and_budget(rows: Optional[list[str]], vram_budget_gib: float) -> tuple[list[str], Optional[int]]:
    """The rows to run (default all, unknown names refused) and the cap in bytes (None: no cap)."""
    rows = list(ROWS) if rows is None else rows
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise ValueError(f"bench table: unknown row(s) {unknown}; choose from {', '.join(ROWS)}")
    return rows, int(vram_budget_gib * GiB) if vram_budget_gib else None


def _ordered(rows: list[str]) -> list[str]:
    """``rows`` with each :data:`PLAN_BUDGET_OF` source moved ahead of the rows that take its peak."""
    sources = [r for r in rows if r in PLAN_BUDGET_OF.values()]
    return sources + [r for r in rows if r not in sources]


def summarize(rows: list[dict], payload: Optional[dict] = None) -> list[dict]:
    """The table's columns for each row; ``vs_fastest`` is the step time over the fastest ``ok`` row's under the cap
    (an :data:`UNCAPPED` row gets its ratio too, but is never the fastest); ``mfu`` is the model FLOPs utilisation,
    ``payload``'s ``model_flops_per_step`` (:func:`~trainstream_hf.bench.models.lora_step_flops`) per step time over
    its ``peak_bf16_flops`` (None where the GPU's peak is unknown, and on the CPU)."""
    flops = (payload or {}).get("model_flops_per_step")
    peak = (payload or {}).get("peak_bf16_flops")
    times = [r["step_s"] for r in rows
             if r.get("status") == "ok" and r.get("step_s") and r.get("row") not in UNCAPPED]
    fastest = min(times, default=None)
    table = []
    for r in rows:
        stats = r.get("engine_stats") or {}
        pcie = (stats.get("h2d_GBps") or 0) + (stats.get("d2h_GBps") or 0) if stats else None
        losses = r.get("losses") or []
        ok = r.get("status") == "ok" and r.get("step_s")
        table.append({
            "row": r.get("label", r.get("row")), "status": r.get("status"),
            "step_s": r.get("step_s"), "tokens_per_s": r.get("tokens_per_s"),
            "mfu": flops / r["step_s"] / peak if ok and flops and peak else None,
            "alloc_GiB": None if r.get("max_allocated") is None else r["max_allocated"] / GiB,
            "reserved_GiB": None if r.get("max_reserved") is None else r["max_reserved"] / GiB,
            "vs_fastest": r["step_s"] / fastest if ok and fastest else None,
            "last_loss": losses[-1] if losses else None, "grad_norm": (r.get("warmup_grad_norms") or [None])[0],
            "pcie_GBps": pcie, "plan": r.get("plan")})
    return table


def run(*, shape: str = "llama3.1-8b", rows: Optional[list[str]] = None, batch: int = 1, seq: int = 2048,
        warmup: int = 3, repeats: int = 10, vram_budget_gib: float = 24.0, seed: int = 0,
        row_timeout: Optional[float] = 1800.0, on_row: Optional[Callable[[dict], None]] = None) -> tuple[dict, str]:
    """Runs ``rows`` (default all of :data:`ROWS`), each in its own process; returns (payload, markdown).

    Raises:
        ValueError: an unknown row name (the message lists the known ones).
    """
    rows, budget = _rows_and_budget(rows, vram_budget_gib)
    args = dict(shape=shape, batch=batch, seq=seq, warmup=warmup, repeats=repeats, vram_budget=budget, seed=seed)
    payload = {"suite": "table", **args, "results": [],
               "model_flops_per_step": lora_step_flops(shape, batch, seq, LORA["r"]),
               "peak_bf16_flops": peak_bf16_flops(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None}
    done: dict[str, dict] = {}
    for row in _ordered(rows):
        source = PLAN_BUDGET_OF.get(row)
        if source is None:
            done[row] = _child(row, args, row_timeout)
        elif source not in done:
            done[row] = {"row": row, "label": ROWS[row][0],
                         "status": f"not run: its plan budget is {source}'s peak in the same run; add {source}"}
        elif done[source].get("status") != "ok" or not done[source].get("max_allocated"):
            done[row] = {"row": row, "label": ROWS[row][0],
                         "status": f"not run: {source} did not run ({done[source].get('status')})"}
        else:
            done[row] = _child(row, {**args, "plan_budget": int(done[source]["max_allocated"])}, row_timeout)
        payload["results"].append(done[row])
        payload["table"] = summarize(payload["results"], payload)
        if on_row is not None:
            on_row(payload)
    payload["table"] = summarize(payload["results"], payload)
    title = (f"LoRA r16 step, {shape}, batch {batch} x {seq} tokens, "
             f"{'VRAM cap ' + format(vram_budget_gib, 'g') + ' GiB' if budget else 'no VRAM cap'}")
    return payload, f"{title}\n\n{markdown_table(payload['table'], COLUMNS)}"


def longest_fitting(fits: Callable[[int], bool], start: int, limit: int, granularity: int = 1024
                    ) -> tuple[int | None, list[tuple[int, bool]]]:
    """The longest sequence length up to ``limit`` that ``fits``: doubling from ``start`` until a length does not
    fit (or ``limit``), then bisecting between the last that fit and the first that did not, down to
    ``granularity`` tokens (lengths stay multiples of it). When ``start`` does not fit, halving from it until a
    length does, then bisecting the same way.

    Returns:
        (the longest length that fit, or None when not even ``granularity`` tokens did; every probe as
        ``(length, fitted)``).
    """
    probes: list[tuple[int, bool]] = []

    def probe(n: int) -> bool:
        ok = fits(n)
        probes.append((n, ok))
        return ok

    def bisect(good: int, bad: int) -> int:
        while bad - good > granularity:
            mid = (good + bad) // 2 // granularity * granularity
            if mid <= good:
                break
            if probe(mid):
                good = mid
            else:
                bad = mid
        return good

    if not probe(start):  # halve down to the granularity for one that fits, then bisect above it
        bad, n = start, start
        while True:
            n = n // 2 // granularity * granularity
            if n < granularity:
                return None, probes
            if probe(n):
                return bisect(n, bad), probes
            bad = n
    good, n = start, start
    while n < limit:
        n = min(2 * n, limit)
        if not probe(n):
            return bisect(good, n), probes
        good = n
    return good, probes


def run_longest(*, shape: str = "llama3.1-8b", rows: Optional[list[str]] = None, batch: int = 1,
                start: int = 8192, limit: int = 262144, granularity: int = 4096, vram_budget_gib: float = 24.0,
                seed: int = 0, row_timeout: Optional[float] = 1800.0,
                on_row: Optional[Callable[[dict], None]] = None) -> tuple[dict, str]:
    """For each row, the longest sequence (batch ``batch``) one training step runs at under the cap, each probe a
    child process running one step (an out-of-memory, a crash or a timeout: does not fit; at 128k tokens an 8B step
    takes minutes, so there is no warm-up step); the tokens/s of that first step at the longest length is reported
    beside it (one-time costs included: a compile in the first step, Unsloth's, counts against it)."""
    rows, budget = _rows_and_budget(rows, vram_budget_gib)
    payload = {"suite": "table-longest", "shape": shape, "batch": batch, "vram_budget": budget, "start": start,
               "limit": limit, "granularity": granularity, "results": []}
    for row in rows:
        seen: dict[int, dict] = {}

        def fits(n: int) -> bool:
            seen[n] = _child(row, dict(shape=shape, batch=batch, seq=n, warmup=0, repeats=1, vram_budget=budget,
                                       seed=seed), row_timeout)
            return seen[n].get("status") == "ok"

        best, probes = longest_fitting(fits, start, limit, granularity)
        at = seen.get(best, {}) if best is not None else {}
        first = next(iter(seen.values()))
        status = "ok" if best is not None else first.get("status", "?")
        payload["results"].append({"row": row, "label": ROWS[row][0], "status": status, "longest_seq": best,
                                   "tokens_per_s": at.get("tokens_per_s"), "max_reserved": at.get("max_reserved"),
                                   "probes": probes, "statuses": {n: r.get("status") for n, r in seen.items()},
                                   # what each probe's plan decided (with its host bytes), the peak it reached
                                   # against its prediction, and how a failed one failed
                                   "plans": {n: {k: r[k] for k in ("plan", "plan_host_bytes", "predicted_peak",
                                                                   "max_allocated", "max_reserved", "error")
                                                 if k in r} for n, r in seen.items()}})
        if on_row is not None:
            on_row(payload)
    shown = [{"row": r["label"], "status": r["status"], "longest_seq": r["longest_seq"],
              "first_step_tokens_per_s": r["tokens_per_s"],
              "reserved_GiB": None if r["max_reserved"] is None else r["max_reserved"] / GiB} for r in payload["results"]]
    payload["table"] = shown
    title = (f"Longest sequence per LoRA step, {shape}, batch {batch}, "
             f"{'VRAM cap ' + format(vram_budget_gib, 'g') + ' GiB' if budget else 'no VRAM cap'}")
    return payload, f"{title}\n\n{markdown_table(shown, ('row', 'status', 'longest_seq', 'first_step_tokens_per_s', 'reserved_GiB'))}"


def readme_table(path: str) -> str:
    """The README's markdown for the table JSON at ``path``: its rows, and a line naming the GPU, commit, date and
    the JSON (which holds the command and every column)."""
    with open(path) as f:
        payload = json.load(f)
    env = payload.get("environment", {})
    gpu = (env.get("gpu") or {}).get("name", "CPU")
    # the columns again from the rows (a JSON written before a column existed gets it too: mfu)
    table = summarize(payload["results"], {
        "model_flops_per_step": lora_step_flops(payload["shape"], payload["batch"], payload["seq"], LORA["r"]),
        "peak_bf16_flops": peak_bf16_flops(gpu)})
    for r in table:  # a row that did not run shows why in its step column (out of memory, not run: ...)
        if r["status"] != "ok":
            r["step_s"] = r["status"]
    cols = ("row", "step_s", "tokens_per_s", "reserved_GiB", "vs_fastest", "last_loss")
    if any(r.get("mfu") is not None for r in table):
        cols = cols[:3] + ("mfu",) + cols[3:]
    source = f"{gpu}, commit {env.get('commit', '?')}, {str(env.get('date', '?'))[:10]}: `{os.path.relpath(path)}`"
    return f"{markdown_table(table, cols)}\n\n{source}"


BEGIN, END = "<!-- bench table: begin (generated by python -m trainstream_hf.bench.table --readme JSON) -->", \
    "<!-- bench table: end -->"


def write_readme(path: str, readme: str = "README.md") -> None:
    """Replaces what stands between the README's table markers with :func:`readme_table` of ``path``.

    Raises:
        ValueError: the README has not exactly one pair of markers.
    """
    with open(readme) as f:
        text = f.read()
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{readme}: expected one pair of lines {BEGIN!r} ... {END!r} around the table")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    with open(readme, "w") as f:
        f.write(f"{head}{BEGIN}\n{readme_table(path)}\n{END}{tail}")


def main(argv=None) -> None:
    """``--readme JSON``: write the README's table from a table JSON. ``--child ROW``: run one row (the table's
    child processes; see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m trainstream_hf.bench.table")
    parser.add_argument("--readme", help="a table JSON (benchmarks/results/table-*.json) to render into README.md")
    parser.add_argument("--child", choices=sorted(ROWS))
    parser.add_argument("--json")
    parser.add_argument("--child-args")
    parser.add_argument("--harness", default="{}", help="the harness settings of the parent (harness_settings)")
    a = parser.parse_args(argv)
    if a.readme:
        write_readme(a.readme)
        return
    if not (a.child and a.json and a.child_args):
        parser.error("give --readme JSON, or --child ROW --json OUT --child-args ARGS (python -m trainstream_hf.bench "
                     "table runs the whole table)")
    from trainstream_hf.bench import harness
    for key, value in json.loads(a.harness).items():
        setattr(harness, key, value)
    result = run_row(a.child, **json.loads(a.child_args))
    with open(a.json, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
