#!/bin/bash
# stop 52 (nvidia-h200-x4): bench_train at HEAD, small bf16 (fastest: cudnn via auto) vs nvfp4,
# 1 and 4 GPUs data parallel, 64 sequences a device: the data-parallel rows after stops 49-51 (issue 35)
set -u
PY=/opt/torch/.venv/bin/python
export PATH=/opt/torch/.venv/bin:$PATH PYTHONPATH=$PWD FP4JAX_COMMIT=${FP4JAX_COMMIT:?}
mkdir -p $OUT/dp
nvidia-smi -L > $OUT/dp/device.txt
$PY experiments/bench_train.py --presets small --configs bf16 nvfp4 --devices 1 4 --batch-per-device 64 --iterations 10 --time-limit 500 --out $OUT/dp > $OUT/dp/bench_train.log 2>&1
echo "rc=$?"; tail -14 $OUT/dp/bench_train.log
