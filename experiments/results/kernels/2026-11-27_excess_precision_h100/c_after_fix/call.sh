#!/bin/bash
# stop 45 call C (x2): after exact_float32 (a65af45): in-program casts on the GPU, bench small, dot_recipes, FP4 gather bits
set -u
PY=/opt/torch/.venv/bin/python
export PATH=/opt/torch/.venv/bin:$PATH PYTHONPATH=$PWD FP4JAX_COMMIT=${FP4JAX_COMMIT:?}
W=/tmp/wc; mkdir -p $W; t0=$(date +%s)
nvidia-smi -L > $W/device.txt
( export CUDA_VISIBLE_DEVICES=0
  timeout 150 $PY experiments/excess_precision_check.py --out $W --tag _default > $W/epc_default.log 2>&1; echo "epc rc=$? $(( $(date +%s) - t0 )) s" >> $W/timeline.txt
  timeout 300 $PY experiments/bench_train.py --presets small --configs bf16 nvfp4 --out $W/bench > $W/bench.log 2>&1; echo "bench rc=$? $(( $(date +%s) - t0 )) s" >> $W/timeline.txt ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 420 $PY experiments/gpu_check.py dot_recipes --out $W/gpu_check.json > $W/gpu_check.log 2>&1; echo "gpu_check rc=$? $(( $(date +%s) - t0 )) s" >> $W/timeline.txt ) &
wait
left=$(( 560 - ($(date +%s) - t0) ))
timeout $left $PY experiments/param_gather_check.py --preset small --devices 2 --fsdp 2 --batch-size 64 --seq-len 256 --no-deterministic --out $W/gather > $W/gather.log 2>&1; echo "gather rc=$? $(( $(date +%s) - t0 )) s" >> $W/timeline.txt
cat $W/timeline.txt; cat $W/epc_default.log; tail -5 $W/bench.log; tail -15 $W/gpu_check.log; tail -12 $W/gather.log
(cd /tmp && tar czf $OUT/wc.tgz wc)
