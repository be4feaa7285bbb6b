#!/bin/bash
# stop 48 call C (x4): profile_step small bf16 vs nvfp4, cudnn attention, on 1 and on 4 GPUs of one host (64 seq a device), at HEAD (issue 35: where data parallelism loses)
set -u
PY=/opt/torch/.venv/bin/python
export PATH=/opt/torch/.venv/bin:$PATH PYTHONPATH=$PWD FP4JAX_COMMIT=${FP4JAX_COMMIT:?}
mkdir -p $OUT/r/d1 $OUT/r/d4
nvidia-smi -L > $OUT/r/device.txt
cp .data/c48c.sh $OUT/r/call.sh
timeout 270 $PY experiments/profile_step.py --preset small --specs bf16 nvfp4 --attention cudnn --batch-size 64 --devices 1 --out $OUT/r/d1 > $OUT/r/d1.log 2>&1
echo "d1 rc=$?"
timeout 290 $PY experiments/profile_step.py --preset small --specs bf16 nvfp4 --attention cudnn --batch-size 256 --devices 4 --out $OUT/r/d4 > $OUT/r/d4.log 2>&1
echo "d4 rc=$?"
tail -30 $OUT/r/d1.log; tail -30 $OUT/r/d4.log
cd $OUT && tar czf r.tgz r && rm -rf r
