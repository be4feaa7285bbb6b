#!/usr/bin/env bash
# Issue 5, seventh session, W4A16 k-split warpgroups + Nsight Compute stall profile (one H200):
#   phase 1: gpu_check_w4a16v2.py kwgs: k_wgs = 2, 3 exactness (4 shapes, NaN row) and the
#            M=16, K=N=8192 sweep against bf16 and the default kernel (same process)
#   phase 2: ncu (WarpStateStats, SchedulerStats, SourceCounters, ...) of one launch of the
#            default W4A16 kernel, of k_wgs=3, and of the 1x16 RtN operand kernel fq_rows
#   phase 3: kwgs4 (k_wgs = 4; the row-split four-warpgroup kernel hung in run 33), time-boxed
#   OUT=<dir> bash experiments/gpu_run38.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:?set OUT}
LOG=$OUT/kwgs.log
{ date -u; nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } >"$LOG" 2>&1
timeout 240 python3 experiments/gpu_check_w4a16v2.py kwgs >>"$LOG" 2>&1
echo "kwgs exit $? $(date -u)" >>"$LOG"
cp "$OUT/gpu_check_w4a16v2.json" "$OUT/kwgs.json" 2>/dev/null
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
SECS="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section SourceCounters --section InstructionStats"
NLOG=$OUT/ncu.log
echo "ncu: $NCU" >"$NLOG"
for subj in "w4a16 {}" "w4a16 {\"k_wgs\":3}" "fq_rows {}"; do
  set -- $subj
  echo "=== $subj $(date -u)" >>"$NLOG"
  timeout 100 "$NCU" --clock-control none -k regex:mosaic --launch-skip 2 --launch-count 1 \
    $SECS python3 experiments/ncu_kernel.py "$1" "$2" >>"$NLOG" 2>&1
  echo "ncu exit $?" >>"$NLOG"
done
timeout 120 python3 experiments/gpu_check_w4a16v2.py kwgs4 >>"$LOG" 2>&1
echo "kwgs4 exit $? $(date -u)" >>"$LOG"
