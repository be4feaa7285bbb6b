#!/bin/bash
# stop 47 call E (x1): bench_train at HEAD, 100m nvfp4 alone (compile time) with a longer per-config limit (call D: nvfp4 timed out at 240 s) (issue 35)
set -u
PY=/opt/torch/.venv/bin/python
export PATH=/opt/torch/.venv/bin:$PATH PYTHONPATH=$PWD FP4JAX_COMMIT=${FP4JAX_COMMIT:?}
mkdir -p $OUT/one
nvidia-smi -L > $OUT/one/device.txt
$PY experiments/bench_train.py --presets 100m --configs nvfp4 --iterations 5 --timeout-s 400 --out $OUT/one > $OUT/one/bench_train.log 2>&1
echo "rc=$?"; tail -30 $OUT/one/bench_train.log
