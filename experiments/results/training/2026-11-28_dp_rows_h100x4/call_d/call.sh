#!/bin/bash
# stop 48 call D (x4): small on 4 GPUs, bf16 vs nvfp4 (global amax) vs nvfp4(amax_scope=local), same call: the amax barriers' pipelined cost (issue 35)
set -u
PY=/opt/torch/.venv/bin/python
export PATH=/opt/torch/.venv/bin:$PATH PYTHONPATH=$PWD FP4JAX_COMMIT=${FP4JAX_COMMIT:?}
mkdir -p $OUT/r/local
nvidia-smi -L > $OUT/r/device.txt
cp .data/c48d.sh $OUT/r/call.sh
$PY experiments/bench_train.py --presets small --configs bf16 nvfp4 "nvfp4(amax_scope=local)" --devices 4 --batch-per-device 64 --iterations 10 --time-limit 300 --out $OUT/r/local > $OUT/r/local.log 2>&1
echo "rc=$?"
tail -8 $OUT/r/local.log
cd $OUT && tar czf r.tgz r && rm -rf r
