#!/usr/bin/env bash
# The benchmark table on the GPU machine, longer than one command may run: `start` installs the carried wheels
# (.whl, and Unsloth's own folder .whl-unsloth), builds the extension, then runs each table given in TABLES (one
# set of `python -m trainstream_hf.bench table` arguments per line) one after another in a process session of its
# own, and waits (a line that starts with a suite name, e.g. `cache --quick`, runs that suite instead of the table;
# `round engine_full cache` runs those steps of scripts/gpu_round.sh, their JSON under round/; leading NAME=value
# words set that line's environment: `TRAINSTREAM_FP8_GEMM=torch --shape llama3.1-8b --peers ts_fp8`);
# `wait` waits for that session. Both copy what is written so far (JSON, markdown, logs) to $OUT
# and return before LIMIT seconds (default 570).
#   TRAINSTREAM_COMMIT=<sha> TABLES=$'--shape llama3.1-8b\n--shape mistral-7b --peers ts_nf4,bnb_ckpt' \
#     bash scripts/gpu_table.sh start
#   bash scripts/gpu_table.sh wait
# When the device budget left is below a call's 600 s, pass LIMIT a little under it (LIMIT=300 bash ... wait): a call
# cut by the budget returns nothing copied after its cut, so the last JSON written may never come back.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
RUN=/tmp/trainstream-table; LIMIT=${LIMIT:-570}; t0=$(date +%s)
PY=${PY:-python3}
# What comes back (the device returns at most 8 files a call): the results and the progress, newest JSON first; the
# set-up logs only when the build failed (they stay in $RUN; `NO_SETUP=1`-style dry runs see them there).
collect() {
  local f n=0
  rm -f "$OUT"/*.json "$OUT"/*.md "$OUT"/*.log "$OUT"/table.err  # (what an earlier collect left: the newest only)
  for f in "$RUN"/progress.log "$RUN"/round-*.log; do [[ -f $f ]] && cp "$f" "$OUT"/ && n=$((n + 1)); done
  for f in $(ls -t "$RUN"/*.json "$RUN"/round/*.json "$RUN"/*.md 2>/dev/null); do
    (( n < 7 )) && cp "$f" "$OUT"/ && n=$((n + 1))
  done
  [[ -f $RUN/table.err ]] && tail -50 "$RUN/table.err" > "$OUT/table.err"
}
running() { [[ -f $RUN/pid ]] && kill -0 "$(cat "$RUN/pid")" 2>/dev/null; }

if [[ ${1:-} == start ]]; then
  mkdir -p "$RUN"
  export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  if [[ -x /usr/bin/g++ ]]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc; fi  # see scripts/gpu_check.sh
  { nvidia-smi; $PY -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))"; free -g; df -h /tmp; } \
    > "$RUN/env.log" 2>&1
  if [[ -z ${NO_SETUP:-} ]]; then  # NO_SETUP=1: the wheels and the extension are already in place (a CPU dry run)
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    > "$RUN/wheels.log" 2>&1 && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  if ls .whl-unsloth/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/unsloth-site \
      .whl-unsloth/*.whl > "$RUN/wheels-unsloth.log" 2>&1 && export TRAINSTREAM_UNSLOTH_SITE=/tmp/unsloth-site
  fi
  TRAINSTREAM_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=16 \
    $PY setup.py -q build_ext --inplace > "$RUN/build.log" 2>&1 || { tail -30 "$RUN/build.log"; cp "$RUN"/*.log "$OUT"/
      exit 1; }
  fi
  printf '%s\n' "${TABLES:---shape llama3.1-8b}" > "$RUN/tables"
  setsid bash -c '
    while IFS= read -r args; do
      [[ -z $args ]] && continue
      echo "== table $args ($(date -u +%H:%M:%S))" >> "$0/progress.log"
      envs=(PYTHONUNBUFFERED=1); re="^([A-Z][A-Z0-9_]*=[^ ]*) +(.*)"  # leading NAME=value words: that line'"'"'s environment
      while [[ $args =~ $re ]]; do envs+=("${BASH_REMATCH[1]}"); args=${BASH_REMATCH[2]}; done
      case $args in micro*|peers*|engine*|quant*|sqnr*|table*|host*|cache*) suite=;; round*) suite=round;; *) suite=table;; esac
      if [[ $suite == round ]]; then  # `round <steps>`: scripts/gpu_round.sh steps, its summary as round-<steps>.log
        mkdir -p "$0/round" && env "${envs[@]}" OUT="$0/round" bash scripts/gpu_round.sh ${args#round} 2>> "$0/table.err"
        cp "$0/round/summary.log" "$0/$(echo $args | tr -c "a-z0-9.\n" -).log" 2>/dev/null
      else
      env "${envs[@]}" '"$PY"' -m trainstream_hf.bench $suite $args --out "$0" > "$0/table-$(echo $suite $args | tr -c "a-z0-9.\n" -).md" 2>> "$0/table.err"
      fi
      echo "   exit $? ($(date -u +%H:%M:%S))" >> "$0/progress.log"
      rm -rf /tmp/trainstream-bench-models  # the checkpoints saved for Unsloth (~16 GB a shape)
    done < "$0/tables"; echo finished >> "$0/progress.log"' "$RUN" < /dev/null > /dev/null 2>&1 &
  echo $! > "$RUN/pid"
elif [[ ${1:-} != wait ]]; then
  echo "usage: $0 start|wait"; exit 2
fi
while running && (( $(date +%s) - t0 < LIMIT )); do sleep 10; collect; done
collect
cat "$RUN/progress.log" 2>/dev/null; tail -5 "$RUN/table.err" 2>/dev/null
if running; then echo "STILL RUNNING: call again with 'wait'"; else echo "ALL DONE"; cat "$RUN"/table-*.md; fi
