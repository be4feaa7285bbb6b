#!/bin/bash
# stop 48 call B (x2): small on ONE device of a 2-GPU host, bf16 vs nvfp4 vs mxfp4, after the one_device fix (issue 35)
set -u
PY=/opt/torch/.venv/bin/python
export PATH=/opt/torch/.venv/bin:$PATH PYTHONPATH=$PWD FP4JAX_COMMIT=${FP4JAX_COMMIT:?}
mkdir -p $OUT/r/one
nvidia-smi -L > $OUT/r/device.txt
cp .data/c48b.sh $OUT/r/call.sh
$PY experiments/bench_train.py --presets small --configs bf16 nvfp4 mxfp4 --devices 1 --batch-per-device 64 --iterations 10 --time-limit 300 --out $OUT/r/one > $OUT/r/one.log 2>&1
echo "one rc=$?"
tail -8 $OUT/r/one.log
cd $OUT && tar czf r.tgz r && rm -rf r
