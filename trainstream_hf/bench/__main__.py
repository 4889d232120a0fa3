"""python -m trainstream_hf.bench <suite> [--quick] [--out DIR]: markdown on stdout, JSON to DIR.

Suites: micro (foundation micro-benchmarks); peers (PEFT, bitsandbytes, torch, DeepSpeed training steps);
engine (the peers plus trainstream.wrap under the same VRAM budget, in one run); quant (QuantLinear per format
beside bf16 nn.Linear and bitsandbytes NF4 on one block's linear layers, and dequantize bandwidth); sqnr
(quantization SQNR of a real pretrained model's linear layers, on the CPU); table (one LoRA step of an 8B-class
model, every trainstream format and peer in a process of its own under one VRAM cap: the README's table); host (the
host side of a step, Python, dispatch and autograd, on the CPU); cache (generate() with DynamicCache, TrainStreamCache
at several residencies and DynamicCache's offloading, each paged row against its floor).
"""
from __future__ import annotations

import argparse
import os
import re

import torch

from trainstream_hf.bench import common
from trainstream_hf.bench.cache import ALL_ROWS as CACHE_ROWS
from trainstream_hf.bench.models import SHAPES, model_config, shape_label
from trainstream_hf.bench.host import ROWS as HOST_ROWS
from trainstream_hf.bench.table import ROWS as TABLE_ROWS

SUITES = ("micro", "peers", "engine", "quant", "sqnr", "table", "host", "cache")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainstream_hf.bench", description=__doc__)
    parser.add_argument("suite", choices=SUITES)
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats (smoke test)")
    parser.add_argument("--out", default=None, help=f"JSON directory (default {common.RESULTS_DIR})")
    parser.add_argument("--name", default=None, help="JSON file name without .json")
    peers = parser.add_argument_group("peers, engine and quant suites")
    peers.add_argument("--shape", default=None,
                       help="LoRA/QLoRA model shape: one of " + ", ".join(sorted(SHAPES)) + ", or the path of a "
                            "model's config.json (or its folder; random weights of that shape); quant: the block "
                            "whose linear layers are timed (default llama3-8b; tiny if --quick)")
    peers.add_argument("--full-shape", default=None,
                       help="full fine-tune model shape, as --shape (default llama3.2-3b; tiny if --quick)")
    peers.add_argument("--batch", type=int, default=1, help="sequences per step")
    peers.add_argument("--seq", type=int, default=None,
                       help="tokens per sequence (default 2048; 64 if --quick or --shape tiny)")
    peers.add_argument("--warmup", type=int, default=None, help="untimed steps per peer (default 3; 1 if --quick)")
    peers.add_argument("--repeats", type=int, default=None, help="timed steps per peer (default 10; 3 if --quick)")
    peers.add_argument("--vram-budget-gib", type=float, default=24.0,
                       help="allocator cap for the DeepSpeed offload rows, and for every row of table (0: none)")
    peers.add_argument("--peers", default=None, help="comma-separated subset of: bandwidth,peft,peft_ckpt,"
                       "bnb,bnb_ckpt,full,ds,ds_ckpt,ds3,ds3_ckpt,cpu_adamw (default all); engine: those and ts_lora,ts_nf4,"
                       "ts_nf4_fused_norms,recipe_nf4,ts_full,ts_full_cpu,ts_full_bf16m,ts_full_devgrads,ts_full_serial,"
                       "ts_full_inbwd,ts_full_inbwd_rc,ts_full_stale,ts_paged; quant: bf16,bnb_nf4,int8,"
                       "nf4,fp8,fp8_outliers,fp8_wo,nvfp4,nvfp4_w4a4,dequant; table: "
                       + ",".join(TABLE_ROWS) + "; host: " + ",".join(HOST_ROWS) + "; cache: " + ",".join(CACHE_ROWS))
    peers.add_argument("--accum", type=int, default=1,
                       help="peers, engine: micro-batches per optimizer step of the full fine-tune rows (gradient "
                            "accumulation; tokens per step = accum x batch x seq)")
    peers.add_argument("--new-tokens", type=int, default=None,
                       help="cache: tokens generated per sequence (with --batch and --seq: one setting instead of "
                            "the two default ones, 8 x 2048 + 128 and 32 x 1024 + 64)")
    peers.add_argument("--longest", action="store_true",
                       help="table: instead of the step table, the longest sequence each row trains at under the cap "
                            "(doubling from --seq, default 8192, then bisecting to 4096 tokens; shape default "
                            "llama3.1-8b)")
    peers.add_argument("--granularity", type=int, default=None,
                       help="table --longest: bisect down to this many tokens (default 4096)")
    peers.add_argument("--row-timeout", type=float, default=None,
                       help="table, cache: seconds a row's process may run before it is stopped and reported as "
                            "such (default 1800 for table, 240 for cache)")
    parser.add_argument("--gc-freeze", action="store_true",
                        help="gc.freeze() before each row's timed steps (every row alike); rows always report their "
                             "Python GC collections and pause time (python_gc)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="peers, engine, quant, table: after its timed steps, each row runs N more under "
                             "torch.profiler; its JSON gets their top CUDA kernels (or CPU operators) per step and the "
                             "GPU's busy time against the wall time, and the markdown a table of them per row")
    parser.add_argument("--trace", action="store_true",
                        help="with --profile: also write each row's Chrome trace (gzipped) beside the JSON")
    args = parser.parse_args(argv)
    common.ARGV = list(argv) if argv is not None else None  # the JSON's "command"
    if args.profile < 0:
        parser.error(f"--profile {args.profile}: give a number of steps >= 1 (0: no profile)")
    if args.trace and not args.profile:
        parser.error("--trace writes the traces of --profile's steps: give --profile N too")
    if args.row_timeout is not None and not args.row_timeout > 0:
        parser.error(f"--row-timeout {args.row_timeout:g}: give the seconds a row's process may run (> 0)")
    row_timeout = {} if args.row_timeout is None else {"row_timeout": args.row_timeout}  # else each suite's default
    for option, shape in (("--shape", args.shape), ("--full-shape", args.full_shape)):
        if shape is not None:
            try:
                model_config(shape)
            except ValueError as e:
                parser.error(f"{option}: {e}")
    known = {"table": TABLE_ROWS, "host": HOST_ROWS, "cache": CACHE_ROWS}.get(args.suite)
    unknown = [r for r in (args.peers or "").split(",") if r and known is not None and r not in known]
    if unknown:
        parser.error(f"--peers: unknown {args.suite} row(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    from trainstream_hf.bench import harness
    harness.GC_FREEZE = args.gc_freeze
    harness.PROFILE_STEPS = args.profile
    harness.PROFILE_TRACES = os.path.abspath(os.path.join(args.out or common.RESULTS_DIR, "traces")) \
        if args.trace else None
    where = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()).strip("-") \
        if torch.cuda.is_available() and args.suite != "sqnr" else "cpu"  # sqnr always computes on the CPU
    suite = "sqnr-minilm" if args.suite == "sqnr" else "table-longest" if args.longest else args.suite
    # one file per shape of the table
    shaped = f"-{shape_label(args.shape)}" if args.suite == "table" and args.shape else ""
    name = args.name or f"{suite}{shaped}-{where}{'-quick' if args.quick else ''}"

    def on_row(partial: dict) -> None:  # each measured row reaches the JSON at once (a timed-out run keeps it)
        common.write_json(name, partial, args.out)

    if args.suite == "micro":
        from trainstream_hf.bench import micro
        payload, md = micro.run(quick=args.quick)
    elif args.suite in ("peers", "engine"):
        # engine = the peers plus trainstream's own rows, side by side in one process
        from trainstream_hf.bench import peers as peers_suite
        extra = None
        if args.suite == "engine":
            from trainstream_hf.bench import engine
            extra = engine.JOBS
        payload, md = peers_suite.run(
            quick=args.quick, shape=args.shape, full_shape=args.full_shape, batch=args.batch, seq=args.seq,
            warmup=args.warmup, repeats=args.repeats, vram_budget_gib=args.vram_budget_gib,
            peers=args.peers.split(",") if args.peers else None, extra_jobs=extra, suite=args.suite,
            on_row=on_row, accum=args.accum)
    elif args.suite == "quant":
        from trainstream_hf.bench import quant
        payload, md = quant.run(shape=args.shape, seq=args.seq, warmup=args.warmup, repeats=args.repeats,
                                rows=args.peers.split(",") if args.peers else None, quick=args.quick)
    elif args.suite == "sqnr":
        from trainstream_hf.bench import sqnr
        payload, md = sqnr.run()
    elif args.suite == "cache":
        from trainstream_hf.bench import cache
        settings = None
        if args.seq or args.new_tokens or args.batch != 1:
            settings = ((args.batch, args.seq or 2048, args.new_tokens or 128),)
        payload, md = cache.run(shape=args.shape, settings=settings, repeats=args.repeats or 3, quick=args.quick,
                                rows=args.peers.split(",") if args.peers else None, on_row=on_row,
                                **row_timeout)
    elif args.suite == "host":
        from trainstream_hf.bench import host
        payload, md = host.run(quick=args.quick, rows=args.peers.split(",") if args.peers else None)
    elif args.suite == "table" and args.longest:
        from trainstream_hf.bench import table
        tiny = args.quick or args.shape == "tiny"
        payload, md = table.run_longest(
            shape=args.shape or ("tiny" if args.quick else "llama3.1-8b"), batch=args.batch,
            start=args.seq or (16 if tiny else 8192), limit=256 if tiny else 262144,
            granularity=args.granularity or (16 if tiny else 4096),
            vram_budget_gib=args.vram_budget_gib, rows=args.peers.split(",") if args.peers else None,
            on_row=on_row, **row_timeout)
    elif args.suite == "table":
        from trainstream_hf.bench import table
        quick_or_tiny = args.quick or args.shape == "tiny"
        payload, md = table.run(
            shape=args.shape or ("tiny" if args.quick else "llama3.1-8b"), batch=args.batch,
            seq=args.seq or (64 if quick_or_tiny else 2048), warmup=args.warmup or (1 if args.quick else 3),
            repeats=args.repeats or (3 if args.quick else 10), vram_budget_gib=args.vram_budget_gib,
            rows=args.peers.split(",") if args.peers else None, on_row=on_row, **row_timeout)
    path = common.write_json(name, payload, args.out)
    if args.profile:
        profiled = harness.profile_markdown(payload.get("results") or payload.get("rows") or [])
        md += f"\n\n{profiled}" if profiled else ""
    print(md)
    print(f"\nJSON: {path}")


if __name__ == "__main__":
    main()
