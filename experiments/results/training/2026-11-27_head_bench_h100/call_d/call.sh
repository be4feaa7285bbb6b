#!/bin/bash
# stop 47 call D (x1): bench_train at HEAD, small and 100m, bf16 (fastest: cudnn via auto) vs nvfp4 vs mxfp4 (issue 35)
set -u
PY=/opt/torch/.venv/bin/python
export PATH=/opt/torch/.venv/bin:$PATH PYTHONPATH=$PWD FP4JAX_COMMIT=${FP4JAX_COMMIT:?}
mkdir -p $OUT/one
nvidia-smi -L > $OUT/one/device.txt
$PY experiments/bench_train.py --presets small 100m --configs bf16 nvfp4 mxfp4 --iterations 10 --time-limit 540 --out $OUT/one > $OUT/one/bench_train.log 2>&1
echo "rc=$?"; tail -30 $OUT/one/bench_train.log
