#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, then the benchmark suites, logs and JSON under $OUT.
#   scripts/gpu_check.sh [STAGE...]   stages: tests, bench, quick (a small perf probe), sanitize
# Default: tests bench. Extra pytest arguments: PYTEST_ARGS="-k fa1". Bench arguments: BENCH_ARGS.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export CUFLASH_CACHE_DIR=${CUFLASH_CACHE_DIR:-/tmp/cuflash-cache}
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests bench)
status=0

nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
python3 -c "import cupy, torch; print('cupy', cupy.__version__, 'nvrtc', cupy.cuda.nvrtc.getVersion(), 'torch', torch.__version__)"

for stage in "${stages[@]}"; do
  echo "=== $stage ($(date +%T))"
  case $stage in
    tests)
      python3 -m pytest tests -q -m gpu -p no:cacheprovider --timeout=900 ${PYTEST_ARGS:-} 2>&1 \
        | tee "$OUT/pytest-gpu.log" | grep -vE '^\s*$' | tail -40 || status=1 ;;
    bench)
      for suite in prefill backward; do
        python3 -m cuflash bench --suite $suite --json "$OUT/h200-$suite.json" --svg "$OUT/h200-$suite.svg" \
          ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench-$suite.log" | tail -60 || status=1
      done ;;
    quick)
      python3 scripts/quick_perf.py 2>&1 | tee "$OUT/quick.log" || status=1 ;;
    sanitize)
      bash scripts/sanitize.sh 2>&1 | tee "$OUT/sanitize.log" | tail -30 || status=1 ;;
    *) echo "unknown stage $stage"; status=2 ;;
  esac
done
echo "=== done ($(date +%T)) status=$status"
exit $status
