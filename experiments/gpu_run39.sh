#!/usr/bin/env bash
# Issue 5, seventh session: tiling sweep of the rows / RHT-cols operand kernels + profiles
# of the kernels whose targets are missed (one H200):
#   phase 1: gpu_tune_quant.py rows cols (bit-exactness vs XLA and time incl. amax pass,
#            fraction of the copy bandwidth of the same process)
#   phase 2: ncu (SpeedOfLight, SchedulerStats, WarpStateStats, ...) of one launch each of
#            the SR rows kernel, the RHT cols kernel, the RHT + SR cols kernel
#   OUT=<dir> bash experiments/gpu_run39.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:?set OUT}
LOG=$OUT/tune.log
{ date -u; nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } >"$LOG" 2>&1
timeout 330 python3 experiments/gpu_tune_quant.py rows cols >>"$LOG" 2>&1
echo "tune exit $? $(date -u)" >>"$LOG"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
SECS="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section InstructionStats"
NLOG=$OUT/ncu.log
echo "ncu: $NCU" >"$NLOG"
for subj in fq_rows_sr fq_cols_rht fq_cols_rht_sr; do
  echo "=== $subj $(date -u)" >>"$NLOG"
  timeout 80 "$NCU" --clock-control none -k regex:mosaic --launch-skip 2 --launch-count 1 \
    $SECS python3 experiments/ncu_kernel.py "$subj" >>"$NLOG" 2>&1
  echo "ncu exit $?" >>"$NLOG"
done
