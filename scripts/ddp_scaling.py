"""Step time, throughput and host RAM of the sft recipe on 1 process against N (data parallel, one GPU each).

python3 scripts/ddp_scaling.py [--config configs/llama3-8b-lora-nf4-24gib.yaml] [--processes 2] [--out DIR]
                               [--name NAME] [--cpu] [-- recipe overrides ...]

Runs ``accelerate launch`` twice on the same recipe config -- configs/accelerate/single_gpu.yaml, then
configs/accelerate/two_gpus.yaml (N processes: ``--num_processes N``) -- with NCCL's NVLink multicast off
(shared/GPU.md),
reads both summaries and writes ``<out>/ddp-scaling-<gpu>-<commit>.json``: per run the median step seconds of each
process, tokens per second together, host memory (each process's PSS, which counts a page shared between processes
once in all, and the bytes of the frozen base the processes share through ``peer``), and the scaling efficiency
``tokens/s with N / (N x tokens/s with 1)``. Each process trains ``train.batch_size`` sequences per step, so N
processes train N times the global batch of one.

``--cpu``: the same on the CPU (gloo, the tiny demo config unless --config says otherwise; a check of this script,
not a figure).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainstream_hf.bench.common import environment, write_json  # noqa: E402
from trainstream_hf.train.processes import cpu_launch_config  # noqa: E402

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def launch(processes: int, config: str, extra: list[str], out: Path, cpu: bool) -> dict:
    """One ``accelerate launch`` of recipes/sft.py; returns its summary."""
    if cpu:  # the multi-GPU launcher (torchrun) with the recipe on the CPU, as tests/test_recipe_sft.py does
        acc, cpu_env = cpu_launch_config(out / f"launch-{processes}.yaml", processes)
        extra = ["--device", "cpu", *extra]
    else:
        acc = ROOT / "configs" / "accelerate" / ("single_gpu.yaml" if processes == 1 else "two_gpus.yaml")
    run_dir = out / f"run-{processes}"
    accelerate = str(Path(sys.executable).parent / "accelerate")
    cmd = [accelerate if os.path.exists(accelerate) else "accelerate", "launch", "--config_file", str(acc),
           "--num_processes", str(processes), "recipes/sft.py", "--config", config, *extra,
           "--output_dir", str(run_dir)]
    env = {**(cpu_env if cpu else {}), **os.environ, **NO_MULTICAST}  # the caller's own settings win
    env.setdefault("OMP_NUM_THREADS", "8")
    print("+", " ".join(cmd), flush=True)
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    (out / f"launch-{processes}.log").write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        raise SystemExit(f"launch of {processes} process(es) failed ({r.returncode}):\n{r.stderr[-4000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def figures(summary: dict) -> dict:
    procs = summary["processes"]
    return {"processes": procs["world"], "tokens_per_second": summary["timing"]["tokens_per_second"],
            "median_step_seconds": [p["median_step_seconds"] for p in procs["per_process"]],
            "host_pss_bytes": procs["host_pss_bytes"],
            "host_rss_bytes": [p.get("rss_bytes") for p in procs["per_process"]],
            "host_shared_bytes": max(p.get("host_shared_bytes", 0) for p in procs["per_process"]),
            "peak_memory": summary["peak_memory"], "command": summary["command"],
            "plan": (summary["trainstream"] or {}).get("plan")}


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--out", default=os.environ.get("OUT", "build/ddp-scaling"))
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--name", default=None, help="JSON name without .json (default ddp-scaling-<gpu>-<commit>)")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.processes < 2:
        ap.error("--processes: at least 2 (the run it is compared with has 1)")
    config = args.config or ("configs/sft-tiny-cpu.yaml" if args.cpu else "configs/llama3-8b-lora-nf4-24gib.yaml")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        one = figures(launch(1, config, extra, Path(tmp), args.cpu))
        many = figures(launch(args.processes, config, extra, Path(tmp), args.cpu))
    result = {"config": config, "overrides": extra, "one": one, "many": many,
              "scaling_efficiency": many["tokens_per_second"] / (args.processes * one["tokens_per_second"]),
              "host_pss_ratio": many["host_pss_bytes"] / one["host_pss_bytes"]}
    env = environment()
    gpu = "cpu" if args.cpu or env["gpu"] is None else env["gpu"]["name"].lower().replace("nvidia", "").split()[0]
    path = write_json(args.name or f"ddp-scaling-{gpu}-{env['commit'][:7]}", result, str(out),
                      command=" ".join(["python3", "scripts/ddp_scaling.py", *argv]))
    print(json.dumps({k: result[k] for k in ("scaling_efficiency", "host_pss_ratio")}), "->", path)


if __name__ == "__main__":
    main()
