#!/usr/bin/env bash
# Downloads the Python 3.12 x86-64 wheels of Unsloth and the pins it needs (trl <= 1.15, datasets < 5, ...) into
# DEST (default .whl-unsloth), apart from .whl: its pins conflict with the test suite's trl and datasets, so the
# benchmark table installs them into a folder of their own (scripts/gpu_table.sh) and only the Unsloth
# rows' processes see it, through PYTHONPATH (trainstream_hf.bench.unsloth).
# Usage: scripts/unsloth-wheels.sh [DEST]
set -euo pipefail
dest=${1:-.whl-unsloth}
mkdir -p "$dest"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$dest" \
  "unsloth==2026.10.9" "unsloth_zoo==2026.10.9" "trl==1.15.0" "datasets==4.3.0" "dill==0.4.0" \
  "multiprocess==0.70.18" "tyro" "docstring-parser" "shtab" "typeguard" "msgspec" "json5" "nest-asyncio" \
  "structlog" "cut_cross_entropy" "hf_transfer" "diffusers" "certifi>=2026.10.19" "typing_extensions>=4.16" \
  2>&1 | grep -v '^WARNING' || true
# Unsloth's wheel carries its web "studio" (82 MB unpacked, a front end and a server) that training never imports:
# leave it and the CLI out, so the folder travels to the GPU machine under the carry limit.
whl=$(ls "$dest"/unsloth-2026.10.9-*.whl)
python3 - "$whl" <<'PY'
import csv, io, os, sys, zipfile
path = sys.argv[1]
keep = lambda name: not name.startswith(("studio/", "unsloth_cli/"))
with zipfile.ZipFile(path) as src:
    items = [(i, src.read(i)) for i in src.infolist() if keep(i.filename)]
tmp = path + ".tmp"
with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
    for info, data in items:
        if info.filename.endswith(".dist-info/RECORD"):
            rows = [r for r in csv.reader(io.StringIO(data.decode())) if r and keep(r[0])]
            out = io.StringIO(); csv.writer(out, lineterminator="\n").writerows(rows); data = out.getvalue().encode()
        dst.writestr(info, data)
os.replace(tmp, path)
PY
ls "$dest"; du -sh "$dest"
