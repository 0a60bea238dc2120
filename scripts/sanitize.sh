#!/usr/bin/env bash
# compute-sanitizer over every kernel family: memcheck, racecheck, synccheck and initcheck, each tool in a
# run of its own over scripts/sanitize_driver.py (representative variants: smallest and largest head dim,
# causal and not, Sq != Sk both ways with odd lengths, GQA, one row, a window, softcap/ALiBi where the
# family has them; the family "decode" runs flash_attn_with_kvcache on contiguous and paged caches with
# ragged lengths, unsplit and split (its combine kernel), with the append + rotary, and flash_attn_combine
# on its own; "cascade" (listed with decode) runs cascade_attention on three of tests/cascade_cases.py's
# cases (paged with empty suffixes, 3 causal queries, d 256 under a long prefix); "fp8" (sm_89 and newer)
# runs cuflash.fp8.quantize on every head dim, rotation on and off, block 1 / 64 / 128 / 200 / None over 77
# and 300 rows (None and 200 over 300: the two launches, amax then convert), a strided x and fp16; small
# shapes so racecheck finishes quickly).
#
#   scripts/sanitize.sh                  every tool x every family this package and GPU have
#   SANITIZE_TOOLS="memcheck" SANITIZE_FAMILIES="fa1-bwd decode cascade fp8" scripts/sanitize.sh
#
# Prints one line per (tool, family) and "sanitize: N runs, M with errors"; logs go to
# ${OUT:-out}/sanitize-<tool>-<family>.log (and sanitize-warmup.log). Exits non-zero when any run found
# an error, failed, or the sanitizer could not run. Other knobs: PYTHON (default python3),
# COMPUTE_SANITIZER (path), SANITIZE_FLAGS (extra sanitizer flags, e.g. "--report-api-errors no"),
# SANITIZE_TIMEOUT (seconds per run, default 1200).
#
# initcheck reports reads of device memory that nothing wrote. Output buffers that a kernel allocates
# uninitialised and then writes in full are fine; the driver turns CuPy's memory pool off so that each
# array is a fresh cudaMalloc of its exact size (a pool would hide both uninitialised reads and
# out-of-bounds reads that land in a neighbouring array). Inputs are written in full (the decode caches
# past each entry's keys too, every page of the cascade caches, the heads that fp8's strided x skips),
# except the partial rows of a combine split with lse -inf, which the combine must not read.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
CACHE=$(mktemp -d "${TMPDIR:-/tmp}/cuflash-sanitize-cache.XXXXXX")
# A cache of its own, seeded from the caller's (e.g. gpu_check.sh's, warm from a packed cache): the
# warm-up then compiles only what that cache lacks.
[ -d "${CUFLASH_CACHE_DIR:-}" ] && cp "$CUFLASH_CACHE_DIR"/*.cubin "$CACHE"/ 2>/dev/null
export CUFLASH_CACHE_DIR=$CACHE
trap 'rm -rf "$CACHE"' EXIT

SAN=${COMPUTE_SANITIZER:-}
if [ -z "$SAN" ]; then
  SAN=$(command -v compute-sanitizer 2>/dev/null || true)
  for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer \
           /usr/local/cuda-*/bin/compute-sanitizer /opt/nvidia/compute-sanitizer/compute-sanitizer; do
    [ -z "$SAN" ] && [ -x "$c" ] && SAN=$c
  done
fi
if [ -z "$SAN" ]; then
  echo "sanitize: compute-sanitizer not found (set COMPUTE_SANITIZER=/path/to/compute-sanitizer)"
  echo "sanitize: 0 runs, 0 with errors (not run)"
  exit 2
fi
echo "sanitize: $("$SAN" --version 2>/dev/null | grep -iE 'version' | head -1) ($SAN)"

FAMILIES=${SANITIZE_FAMILIES:-$("$PY" scripts/sanitize_driver.py --list)}
TOOLS=${SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}
if [ -z "$FAMILIES" ]; then
  echo "sanitize: no kernel family can run here (no GPU?)"
  echo "sanitize: 0 runs, 0 with errors (not run)"
  exit 2
fi

runs=0
bad=0
warm_failed=0

# Warm-up without the sanitizer: compiles every variant into the cache and checks the results against
# the fp32 reference, so the sanitized runs neither compile nor test something that is already wrong.
start=$SECONDS
# shellcheck disable=SC2086
if "$PY" scripts/sanitize_driver.py --check $FAMILIES >"$OUT/sanitize-warmup.log" 2>&1; then
  printf '%-10s %-9s %-34s %4ss  %s\n' "warm-up" "all" "clean (results match the reference)" $((SECONDS - start)) \
    "$OUT/sanitize-warmup.log"
else
  printf '%-10s %-9s %-34s %4ss  %s\n' "warm-up" "all" "FAILED (see log)" $((SECONDS - start)) "$OUT/sanitize-warmup.log"
  grep -E 'MISMATCH|Error|error' "$OUT/sanitize-warmup.log" | head -5 | sed 's/^/    /'
  warm_failed=1
fi

for tool in $TOOLS; do
  for fam in $FAMILIES; do
    log="$OUT/sanitize-$tool-$fam.log"
    start=$SECONDS
    # shellcheck disable=SC2086
    timeout "${SANITIZE_TIMEOUT:-1200}" "$SAN" --tool "$tool" --error-exitcode 1 ${SANITIZE_FLAGS:-} \
      "$PY" scripts/sanitize_driver.py "$fam" >"$log" 2>&1
    rc=$?
    runs=$((runs + 1))
    # memcheck & co. end with "ERROR SUMMARY: N errors", racecheck with "RACECHECK SUMMARY: H hazards
    # displayed (N errors, W warnings)".
    errors=$(grep -Eo 'ERROR SUMMARY: [0-9]+ error|RACECHECK SUMMARY: .*\([0-9]+ error' "$log" | tail -1 \
      | grep -Eo '[0-9]+ error' | grep -Eo '[0-9]+' || true)
    # cuda.bindings asks cuGetProcAddress for driver entry points that this driver lacks (it probes
    # versions while building a tensor map); the driver answers "invalid argument" and the binding moves
    # on. Those API "errors" are not ours: they are counted apart and leave the run clean.
    probes=$(grep -c 'Program hit .*cuGetProcAddress' "$log" || true)
    api=$(( $(grep -c 'Program hit' "$log" || true) - probes ))
    [ -n "$errors" ] && errors=$((errors - probes))
    # --error-exitcode counts the probes too (exit 1 with nothing else wrong): such a run is clean unless
    # the program itself failed (a Python traceback also exits 1).
    if [ "$rc" -eq 1 ] && [ "$probes" -gt 0 ] && [ "${errors:-1}" -eq 0 ] && ! grep -q Traceback "$log"; then rc=0; fi
    if grep -q 'Device not supported' "$log"; then
      status="SANITIZER CANNOT USE THIS GPU"
    elif [ "$rc" -eq 124 ]; then
      status="TIMED OUT (${SANITIZE_TIMEOUT:-1200}s)"
    elif [ -n "$errors" ] && [ "$errors" -gt 0 ]; then
      status="$errors ERROR(S)"
      [ "$api" -gt 0 ] && status="$status ($api CUDA API)"
    elif [ "$rc" -ne 0 ]; then
      status="FAILED (exit $rc)"
    elif [ -z "$errors" ]; then
      status="NO SUMMARY (exit 0)"
    else
      status="clean"
    fi
    [ "$status" = "clean" ] || bad=$((bad + 1))
    printf '%-10s %-9s %-34s %4ss  %s\n' "$tool" "$fam" "$status" $((SECONDS - start)) "$log"
    if [ "$status" != "clean" ]; then
      grep -E '^=+ +(Invalid|Race|Uninitialized|Barrier|Program hit|Error)|Traceback|Error:' "$log" | grep -v SUMMARY \
        | sort | uniq -c | sort -rn | head -5 | sed 's/^/    /'
    fi
    if [ "$status" = "SANITIZER CANNOT USE THIS GPU" ]; then
      echo "sanitize: compute-sanitizer refused the device; stopping (see $log)"
      echo "sanitize: $runs runs, $bad with errors (stopped: the sanitizer cannot run here)"
      exit 3
    fi
  done
done

[ "$warm_failed" -eq 1 ] && note=" (and the warm-up check against the reference FAILED)" || note=""
echo "sanitize: $runs runs, $bad with errors$note"
[ "$bad" -eq 0 ] && [ "$warm_failed" -eq 0 ]
