#!/bin/bash
# stop 48 call A (x4): bench_train at HEAD: small bf16 vs nvfp4 on 1, 2, 4 GPUs (64 seq/device, weak scaling), 1b FSDP 2 scanned (issue 35)
set -u
PY=/opt/torch/.venv/bin/python
export PATH=/opt/torch/.venv/bin:$PATH PYTHONPATH=$PWD FP4JAX_COMMIT=${FP4JAX_COMMIT:?}
mkdir -p $OUT/r/dp $OUT/r/fsdp
nvidia-smi -L > $OUT/r/device.txt
cp .data/c48a.sh $OUT/r/call.sh
$PY experiments/bench_train.py --presets small --configs bf16 nvfp4 --devices 1 2 4 --batch-per-device 64 --iterations 10 --time-limit 340 --out $OUT/r/dp > $OUT/r/dp.log 2>&1
echo "dp rc=$?"
$PY experiments/bench_train.py --presets 1b --configs bf16:scan nvfp4:scan --devices 2 --fsdp 2 --batch-per-device 64 --iterations 10 --time-limit 190 --out $OUT/r/fsdp > $OUT/r/fsdp.log 2>&1
echo "fsdp rc=$?"
tail -14 $OUT/r/dp.log; tail -8 $OUT/r/fsdp.log
cd $OUT && tar czf r.tgz r && rm -rf r
