#!/bin/bash
# stop 52 (nvidia-h200): bench_train at HEAD, small, bf16 (fastest: cudnn via auto) vs nvfp4 vs mxfp4:
# did stop 51's quantize_model changes (the Llama runs under them) move the speed? (issue 35)
set -u
PY=/opt/torch/.venv/bin/python
export PATH=/opt/torch/.venv/bin:$PATH PYTHONPATH=$PWD FP4JAX_COMMIT=${FP4JAX_COMMIT:?}
mkdir -p $OUT/one
nvidia-smi -L > $OUT/one/device.txt
$PY experiments/bench_train.py --presets small --configs bf16 nvfp4 mxfp4 --iterations 10 --time-limit 540 --out $OUT/one > $OUT/one/bench_train.log 2>&1
echo "rc=$?"; tail -30 $OUT/one/bench_train.log
