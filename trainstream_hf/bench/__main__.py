"""python -m trainstream_hf.bench <suite> [--quick] [--out DIR]: markdown on stdout, JSON to DIR.

Suites: micro (foundation micro-benchmarks); peers (PEFT, bitsandbytes, torch, DeepSpeed training steps);
engine (the peers plus trainstream.wrap under the same VRAM budget, in one run).
"""
from __future__ import annotations

import argparse
import re

import torch

from trainstream_hf.bench import common

SUITES = ("micro", "peers", "engine")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainstream_hf.bench", description=__doc__)
    parser.add_argument("suite", choices=SUITES)
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats (smoke test)")
    parser.add_argument("--out", default=None, help=f"JSON directory (default {common.RESULTS_DIR})")
    parser.add_argument("--name", default=None, help="JSON file name without .json")
    peers = parser.add_argument_group("peers suite")
    peers.add_argument("--shape", default=None,
                       help="LoRA/QLoRA model shape (default llama3-8b; tiny if --quick)")
    peers.add_argument("--full-shape", default=None,
                       help="full fine-tune model shape (default llama3.2-3b; tiny if --quick)")
    peers.add_argument("--batch", type=int, default=1, help="sequences per step")
    peers.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048; 64 if --quick)")
    peers.add_argument("--warmup", type=int, default=None, help="untimed steps per peer (default 3; 1 if --quick)")
    peers.add_argument("--repeats", type=int, default=None, help="timed steps per peer (default 10; 3 if --quick)")
    peers.add_argument("--vram-budget-gib", type=float, default=24.0,
                       help="allocator cap for the DeepSpeed offload rows (0: none)")
    peers.add_argument("--peers", default=None, help="comma-separated subset of: bandwidth,peft,peft_ckpt,"
                       "bnb,bnb_ckpt,full,ds,ds_ckpt,cpu_adamw (default all)")
    args = parser.parse_args(argv)
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
            peers=args.peers.split(",") if args.peers else None, extra_jobs=extra, suite=args.suite)
    where = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()).strip("-") \
        if torch.cuda.is_available() else "cpu"
    name = args.name or f"{args.suite}-{where}{'-quick' if args.quick else ''}"
    path = common.write_json(name, payload, args.out)
    print(md)
    print(f"\nJSON: {path}")


if __name__ == "__main__":
    main()
