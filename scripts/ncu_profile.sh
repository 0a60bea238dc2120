#!/usr/bin/env bash
# Nsight Compute on one cuflash call per case: where a kernel's time goes (tensor-pipe activity, issue
# slots, warp stall reasons, DRAM/L2 traffic), for tuning between benchmark runs. On the H200 machine:
#
#   scripts/ncu_profile.sh                              # the default cases below
#   CASES="fa3:backward:128:8192:0 fa3:forward:128:2048:1" scripts/ncu_profile.sh
#
# A case is impl:direction:headdim:seqlen:causal at the FlashAttention benchmark shape (16k tokens, hidden
# 2048: batch = 16384 / seqlen, heads = 2048 / headdim), bf16. Each runs scripts/iomodel_ncu.py's driver,
# which compiles and warms up, then brackets exactly one call with cudaProfilerStart/Stop. impl "fa3fp8"
# (direction forward) is the FP8 forward on e4m3 inputs, driven by scripts/fp8_probe.py --profile, and "cudnnfp8"
# cuDNN's FP8 attention (the fp8 suite's peer; nvidia-cudnn-frontend, e.g. from .whl); "torch-flash" and
# "torch-cudnn" are torch SDPA with that backend (the peers, for instruction counts beside ours). The clocks are
# left alone (--clock-control none, as the device notes ask). Full reports go to $OUT/ncu-<case>.txt (with
# SourceCounters: the SASS lines where warps stall most); the summary lines (duration, SM and memory
# throughput, tensor pipe, issue-slot use, shared-memory pipe use, the top stall reasons, DRAM bytes) are
# printed per kernel. NCU_SASS=REGEX adds, per case, a CSV of the matching kernels' SASS with the stall
# samples of each instruction ($OUT/ncu-<case>-sass.csv).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} CUFLASH_CACHE_DIR=${CUFLASH_CACHE_DIR:-/tmp/cuflash-cache}
NCU=${NCU:-ncu}
CASES=${CASES:-"fa3fp8:forward:128:8192:0 fa3:forward:64:8192:0 fa3:backward:128:8192:0 fa3:backward:64:8192:0"}
METRICS=smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum
status=0
for case in $CASES; do
  IFS=: read -r impl direction d n causal <<< "$case"
  batch=$((16384 / n)); heads=$((2048 / d))
  mask=(); [ "$causal" = 1 ] && mask=(--mask-causal)
  log="$OUT/ncu-${impl}-${direction}-d${d}-n${n}-c${causal}.txt"
  echo "=== $case (batch $batch, heads $heads)"
  if [ "$impl" = fa3fp8 ]; then
    driver=(python3 scripts/fp8_probe.py --profile "$d:$n:$causal")
  elif [ "$impl" = cudnnfp8 ]; then
    driver=(python3 scripts/fp8_probe.py --profile-cudnn "$d:$n:$causal")
  else
    driver=(python3 scripts/iomodel_ncu.py --driver --impl "$impl" --direction "$direction" --headdim "$d"
            --seqlen "$n" --batch "$batch" --heads "$heads" "${mask[@]}")
  fi
  timeout ${NCU_TIMEOUT:-300} "$NCU" --profile-from-start off --target-processes all --clock-control none \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SourceCounters \
    --metrics "$METRICS" "${driver[@]}" > "$log" 2>&1 || status=1
  grep -E '^\s+[a-z_0-9]+.*\(|Duration|^\s+(Compute \(SM\) Throughput|Memory Throughput|Registers Per Thread|Achieved Occupancy|Issue Slots Busy|No Eligible|Shared Memory|Mem Pipes Busy)|Stall|Pipe|sm__pipe_tensor|sm__inst_executed_pipe_tensor|smsp__issue_active|dram__bytes|lts__t_bytes' "$log" \
    | grep -vE '^\s*$' | head -40
  if [ -n "${NCU_SASS:-}" ]; then
    # Per SASS instruction: executed count and warp stall samples by reason (CSV), for the kernels whose name
    # matches NCU_SASS (a regex, e.g. "fa3_bwd"): which instructions the warps wait at, and for what.
    timeout ${NCU_TIMEOUT:-300} "$NCU" --profile-from-start off --target-processes all --clock-control none \
      --kernel-name "regex:$NCU_SASS" --section SourceCounters --section WarpStateStats \
      --page source --print-source sass --csv "${driver[@]}" > "${log%.txt}-sass.csv" 2>&1 || status=1
    echo "sass: $(wc -l < "${log%.txt}-sass.csv") lines in ${log%.txt}-sass.csv"
  fi
done
echo "=== done status=$status"
exit $status
