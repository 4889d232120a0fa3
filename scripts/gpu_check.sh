#!/usr/bin/env bash
# One call on the GPU machine (shared/GPU.md): install carried wheels, build for sm_90, run the CPU and
# GPU tests, run the micro-benchmarks; logs and JSON go to $OUT (or ./gpu-out).
#   TRAINSTREAM_COMMIT=<sha> [BENCH="micro engine"] [BENCH_ARGS=...] bash scripts/gpu_check.sh [pytest args...]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}  # deterministic cuBLAS for the exactness tests
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PY:-python3}
# The image's default CXX (/opt/gcc/bin/g++, "g++-real") links broken copies of libstdc++'s stream code into
# the extension: the first std::ostringstream << long segfaults (cuda-gdb backtrace, 2026-12-03). The
# distribution's g++ builds a working extension.
if [[ -x /usr/bin/g++ ]]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc; fi
status=0
step() { echo "== $1 ($(date -u +%H:%M:%S))"; }

step "environment"
{ nvidia-smi; $PY -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"; nproc; free -g;
  echo "CXX=${CXX:-} c++=$(command -v c++) g++=$(command -v g++)"; c++ --version | head -1; ls /usr/bin/g++* 2>/dev/null; } \
  > "$OUT/env.log" 2>&1; tail -3 "$OUT/env.log"

if ls .whl/*.whl >/dev/null 2>&1; then
  step "carried wheels"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/wheels.log" 2>&1 && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || { echo "wheel install failed"; status=1; }
fi

step "build (sm_90)"
if ! TRAINSTREAM_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} \
     $PY setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
fi
$PY -c "from trainstream_hf import ops; assert ops.built_with_cuda(), 'not a CUDA build'; print('CUDA build ok')" || exit 1
# A C++ exception thrown by the extension must reach Python as an error, not kill the process (a compiler
# whose libstdc++ differs from the one loaded at run time can break unwinding).
$PY - <<'PY' || { echo "C++ EXCEPTIONS FROM THE EXTENSION CRASH THE PROCESS"; status=1; }
import torch
from trainstream_hf import ops
try:
    ops.adamw_step_(torch.zeros(4, dtype=torch.float64), torch.zeros(4), torch.zeros(4), torch.zeros(4), lr=1e-3, step=1)
except RuntimeError as e:
    print("C++ exception reached Python:", str(e).splitlines()[0])
PY

step "tests (CPU + GPU)"
$PY -m pytest -q -p no:cacheprovider --continue-on-collection-errors ${TESTS:-tests} --junitxml="$OUT/pytest.xml" "$@" > "$OUT/pytest.log" 2>&1 || status=1
tail -25 "$OUT/pytest.log"

# BENCH: suites to run (default micro); BENCH_ARGS: extra arguments for each, e.g. "--peers peft,ts_lora".
for suite in ${BENCH-micro}; do
  step "benchmark: $suite"
  $PY -m trainstream_hf.bench $suite --out "$OUT" ${BENCH_ARGS:-} > "$OUT/bench-$suite.md" 2> "$OUT/bench-$suite.err" \
    || { status=1; tail -20 "$OUT/bench-$suite.err"; }
  cat "$OUT/bench-$suite.md"
done

step "done (status $status)"
exit $status
