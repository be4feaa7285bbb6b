#!/bin/bash
# stop 45 call D (x2): dot_recipes at 8d9ed38 vs HEAD (the 'mixed' FAIL), FP4 gather bits on 2 GPUs
set -u
PY=/opt/torch/.venv/bin/python
export PATH=/opt/torch/.venv/bin:$PATH FP4JAX_COMMIT=${FP4JAX_COMMIT:?}
W=/tmp/wd; mkdir -p $W /tmp/old; t0=$(date +%s)
tar xzf .data/old8d9.tgz -C /tmp/old
( export CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$PWD
  timeout 200 $PY experiments/param_gather_bits_check.py --devices 1 --out $W/bits1 > $W/bits1.log 2>&1; echo "bits1 rc=$? $(( $(date +%s) - t0 )) s" >> $W/timeline.txt
  timeout 240 $PY experiments/gpu_check.py dot_recipes --out $W/gpu_check_new.json > $W/gpu_check_new.log 2>&1; echo "new rc=$? $(( $(date +%s) - t0 )) s" >> $W/timeline.txt ) &
( export CUDA_VISIBLE_DEVICES=0
  cd /tmp/old && FP4JAX_COMMIT=8d9ed38 PYTHONPATH=/tmp/old timeout 300 $PY experiments/gpu_check.py dot_recipes --out $W/gpu_check_old.json > $W/gpu_check_old.log 2>&1; echo "old rc=$? $(( $(date +%s) - t0 )) s" >> $W/timeline.txt ) &
wait
PYTHONPATH=$PWD timeout 200 $PY experiments/param_gather_bits_check.py --devices 2 --out $W/bits > $W/bits.log 2>&1; echo "bits rc=$? $(( $(date +%s) - t0 )) s" >> $W/timeline.txt
cat $W/timeline.txt; cat $W/bits1.log $W/bits.log | tail -12; grep -h "FAIL\|summary\|dot_recipes  " $W/gpu_check_*.log | cut -c1-400
(cd /tmp && tar czf $OUT/wd.tgz wd)
