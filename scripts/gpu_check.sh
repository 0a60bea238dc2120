#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, then the benchmark suites, logs and JSON under $OUT.
#   scripts/gpu_check.sh [STAGE...]   stages: warm (compile every variant, all cores), tests, risky (the
#                                     kernels that could hang, each in its own process), bench, long (64k
#                                     tokens: naive runs out of memory), quick (a small perf probe), sanitize,
#                                     probes (the tuning probes bench/NOTES.md asks for next; PROBE_TIMEOUT),
#                                     tune (the FA2 tile candidates against torch flash), e2e (GPT-2
#                                     small end to end), iomodel (ncu DRAM bytes against cuflash.iomodel),
#                                     ncu (scripts/ncu_profile.sh: stall reasons of the open speed cases),
#                                     warm-probes (the probes' variants compiled on all cores)
# Default: warm tests risky bench. Timeouts: TESTS_TIMEOUT (main tier), RISKY_TIMEOUT (each risky file).
# Bench suites: SUITES (default "prefill backward decode fp8"), their arguments BENCH_ARGS. Extra pytest
# arguments: PYTEST_ARGS="-x --lf" (split at spaces), PYTEST_K="backward or bwd" (one -k expression, spaces
# and all). RISKY: the risky test files to run (default: all of them).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export CUFLASH_CACHE_DIR=${CUFLASH_CACHE_DIR:-/tmp/cuflash-cache}
# Peers the machine lacks travel as wheels in .whl/ (git-ignored; the device call names it in `carry`), e.g.
# nvidia-cudnn-frontend for the fp8 suite's cuDNN FP8 peer; installed beside the image's packages.
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
# A compile cache packed on the CPU machine (scripts/cache_pack.py; the call carries .cache-pack): the warm
# stage then finds every entry and the tests compile nothing.
for pack in .cache-pack/*.tar.xz; do
  [ -f "$pack" ] && python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" \
    "$pack" "$CUFLASH_CACHE_DIR" && echo "unpacked $pack into $CUFLASH_CACHE_DIR"
done
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(warm tests risky bench)
status=0
# The main tier (tests) always leaves every risky file out, whatever RISKY picks for the risky stage (a RISKY
# of one file once made the main tier run the other ten: 434 s instead of 140).
all_risky="tests/test_hopper_probe.py tests/test_fa3_gpu.py tests/test_decode_gpu.py tests/test_fuzz_gpu.py tests/test_streams_graphs_gpu.py
       tests/test_bench_gpu.py tests/test_adapters_gpu.py tests/test_fp8_gpu.py tests/test_fp8_attention_gpu.py
       tests/test_special_values_gpu.py tests/test_large_gpu.py"
risky=${RISKY:-$all_risky}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
python3 -c "import cupy, torch; print('cupy', cupy.__version__, 'nvrtc', cupy.cuda.nvrtc.getVersion(), 'torch', torch.__version__)"

for stage in "${stages[@]}"; do
  echo "=== $stage ($(date +%T))"
  case $stage in
    warm)
      # NVRTC compiles one program per thread: fill the disk cache with every variant on all cores first,
      # so the tests spend the GPU's time running kernels, not compiling them.
      python3 -m cuflash compile --arch sm_90a --json > /tmp/cuflash-compile.json 2> "$OUT/compile.err" || status=1
      tail -3 "$OUT/compile.err" ;;
    tests)
      ignore=""; for f in $all_risky; do ignore="$ignore --ignore=$f"; done
      timeout ${TESTS_TIMEOUT:-900} python3 -m pytest tests -q -m gpu -p no:cacheprovider --durations=25 $ignore ${PYTEST_ARGS:-} \
        ${PYTEST_K:+-k "$PYTEST_K"} \
        > "$OUT/pytest-gpu.log" 2>&1 || status=1
      grep -E "^(FAILED|ERROR)" "$OUT/pytest-gpu.log" | head -30; tail -1 "$OUT/pytest-gpu.log" ;;
    risky)
      # Kernels that can hang (mbarrier waits) or fault (code new to the GPU), and the files that run every
      # available family (streams/graphs, bench, adapters), run in their own processes, each under a
      # timeout, so one bad kernel cannot take the rest of the tier with it; test_large_gpu too (it needs
      # 48 GB free, which the main tier's memory pool does not leave). One combined log comes back.
      : > "$OUT/risky.log"
      for f in $risky; do
        name=$(basename "$f" .py)
        echo "##### $name" >> "$OUT/risky.log"
        # SIGINT first: pytest stops and still prints its summary and the slowest tests
        timeout -s INT -k 20 ${RISKY_TIMEOUT:-300} python3 -m pytest "$f" -q -m gpu -p no:cacheprovider --durations=8 \
          ${PYTEST_ARGS:-} ${PYTEST_K:+-k "$PYTEST_K"} \
          > /tmp/risky-$name.log 2>&1 || status=1
        cat /tmp/risky-$name.log >> "$OUT/risky.log"
        echo "$name: $(grep -E "^(FAILED|ERROR)" /tmp/risky-$name.log | head -5)"; tail -1 /tmp/risky-$name.log
      done ;;
    bench)
      # JSON per suite (bench/results/ takes them as they are) and one combined log; SVG with BENCH_SVG=1.
      for suite in ${SUITES:-prefill backward decode fp8}; do
        svg=(); [ -n "${BENCH_SVG:-}" ] && svg=(--svg "$OUT/h200-$suite.svg")
        python3 -m cuflash bench --suite $suite --json "$OUT/h200-$suite.json" ${svg[@]+"${svg[@]}"} ${BENCH_ARGS:-} 2>&1 \
          | tee -a "$OUT/bench.log" | tail -60 || status=1
      done ;;
    long)
      # One sequence of 64k tokens: the naive attention needs a 64k x 64k score matrix per head (275 GB in
      # fp32 at 16 heads) and runs out of memory; cuflash needs the LSE beyond its inputs and output.
      python3 -m cuflash bench --suite prefill --headdims 128 --seqlens 65536 --causal false --reps 5 \
        --impls cuflash-fa1,cuflash-fa2,torch-flash,torch-cudnn,naive --json "$OUT/h200-prefill-long.json" 2>&1 \
        | tee "$OUT/bench-long.log" | tail -20 || status=1 ;;
    quick)
      python3 scripts/quick_perf.py ${QUICK_ARGS:-} --json "$OUT/quick.json" 2>&1 | tee "$OUT/quick.log" || status=1 ;;
    sanitize)
      bash scripts/sanitize.sh 2>&1 | tee "$OUT/sanitize.log" | tail -30 || status=1 ;;
    probes)
      # The tuning probes bench/NOTES.md asks for next, each under a time limit, one log. Now
      # scripts/ab_probe.py: FP8 d = 128 on per-block and per-tensor descales.
      # Earlier probes (sustain_probe.py with nvidia-smi -lms beside it, fa3_l2_probe.py, fa3_exp2_probe.py,
      # decode_probe.py, ...) stay in scripts/.
      probe() { echo "##### $*" | tee -a "$OUT/probes.log"; timeout -k 10 ${PROBE_TIMEOUT:-240} python3 "$@" 2>&1 | tee -a "$OUT/probes.log" | tail -40 || status=1; }
      probe scripts/ab_probe.py fp8-scaling ;;
    warm-probes)
      # The probes' variants (not in the package's tables) into the disk cache on all cores, so that the
      # GPU tests of the switches they A/B find them compiled.
      python3 scripts/fa3_exp2_probe.py --precompile-only --headdims 64,128 --emu 0,8,4,2 2>&1 | tail -3 ;;
    tune)
      # The FA2 tile candidates against torch's flash backend (each candidate compiles first, ~20 s): the
      # backward at d = 64 / 256, the forward at d = 128 / 256 (bench/NOTES.md, session 8). One log.
      # TUNE: the runs, "|"-separated (default "tune_fa2_bwd.py 64 256|tune_fa2.py 128 256").
      IFS='|' read -ra tunes <<< "${TUNE:-tune_fa2_bwd.py 64 256|tune_fa2.py 128 256}"
      for args in "${tunes[@]}"; do
        echo "##### $args" | tee -a "$OUT/tune.log"
        timeout -k 10 ${PROBE_TIMEOUT:-300} python3 scripts/$args 2>&1 | tee -a "$OUT/tune.log" | tail -40 || status=1
      done ;;
    e2e)
      # Issue 7's end-to-end run: GPT-2 small, cuflash / sdpa / naive at 1k-8k (bench/results/h200-e2e.json).
      timeout -k 10 ${E2E_TIMEOUT:-420} python3 bench/e2e_gpt.py --json "$OUT/h200-e2e.json" ${E2E_ARGS:-} 2>&1 \
        | tee "$OUT/e2e.log" | tail -30 || status=1 ;;
    iomodel)
      # Issue 7's IO-model check: ncu's DRAM bytes against cuflash.iomodel (iomodel_ncu.md / .json in $OUT).
      timeout -k 10 ${IOMODEL_TIMEOUT:-420} python3 scripts/iomodel_ncu.py --out "$OUT" ${IOMODEL_ARGS:-} 2>&1 \
        | tee "$OUT/iomodel.log" | tail -30 || status=1 ;;
    ncu)
      # Nsight Compute on the open speed questions (scripts/ncu_profile.sh's cases; CASES to pick others):
      # stall reasons, tensor / issue / shared-memory pipes. Full reports in $OUT/ncu-*.txt.
      bash scripts/ncu_profile.sh 2>&1 | tee "$OUT/ncu.log" | tail -100 || status=1 ;;
    *) echo "unknown stage $stage"; status=2 ;;
  esac
done
echo "=== done ($(date +%T)) status=$status"
exit $status
