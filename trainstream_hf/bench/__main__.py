"""python -m trainstream_hf.bench <suite> [--quick] [--out DIR]: markdown on stdout, JSON to DIR."""
from __future__ import annotations

import argparse
import re

import torch

from trainstream_hf.bench import common

SUITES = ("micro",)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainstream_hf.bench", description=__doc__)
    parser.add_argument("suite", choices=SUITES)
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats (smoke test)")
    parser.add_argument("--out", default=None, help=f"JSON directory (default {common.RESULTS_DIR})")
    parser.add_argument("--name", default=None, help="JSON file name without .json")
    args = parser.parse_args(argv)
    if args.suite == "micro":
        from trainstream_hf.bench import micro
        payload, md = micro.run(quick=args.quick)
    where = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()).strip("-") \
        if torch.cuda.is_available() else "cpu"
    name = args.name or f"{args.suite}-{where}{'-quick' if args.quick else ''}"
    path = common.write_json(name, payload, args.out)
    print(md)
    print(f"\nJSON: {path}")


if __name__ == "__main__":
    main()
