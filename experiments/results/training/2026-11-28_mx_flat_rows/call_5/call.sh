export PATH=/opt/torch/.venv/bin:$PATH
nvidia-smi --query-gpu=name --format=csv,noheader
# one machine: bf16 and MXFP4 at small and 100m on this tree (a8fb196), MXFP4 on the old tree (097045d)
for p in small 100m; do
  PYTHONPATH=$PWD FP4JAX_COMMIT=a8fb196 python3 experiments/bench_train.py --presets $p --configs bf16 mxfp4 --devices 1 --batch-per-device 64 --iterations 10 --time-limit 200 --out $OUT/new_$p > $OUT/new_$p.log 2>&1; echo new $p rc=$?
  (cd .data/oldtree && PYTHONPATH=$PWD FP4JAX_COMMIT=097045d python3 experiments/bench_train.py --presets $p --configs mxfp4 --devices 1 --batch-per-device 64 --iterations 10 --time-limit 120 --out $OUT/old_$p > $OUT/old_$p.log 2>&1); echo old $p rc=$?
done
for f in $OUT/new_small.log $OUT/old_small.log $OUT/new_100m.log $OUT/old_100m.log; do echo "== $f"; grep "^| \`" $f; done
