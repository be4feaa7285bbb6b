export PATH=/opt/torch/.venv/bin:$PATH
nvidia-smi --query-gpu=name --format=csv,noheader
NEW=9734d1c+glue; OLD=9734d1c
PYTHONPATH=$PWD FP4JAX_COMMIT=$NEW timeout 200 python3 experiments/gpu_check.py rows cols shards dot --out $OUT/gpu_check.json > $OUT/gpu_check.log 2>&1; echo check rc=$?
grep -E 'PASS|FAIL|pass|fail' $OUT/gpu_check.log | tail -12
PYTHONPATH=$PWD FP4JAX_COMMIT=$NEW python3 experiments/bench_train.py --presets small --configs bf16 nvfp4 --devices 1 --batch-per-device 64 --iterations 10 --time-limit 170 --out $OUT/new_small > $OUT/new_small.log 2>&1; echo new rc=$?
(cd .data/oldtree && PYTHONPATH=$PWD FP4JAX_COMMIT=$OLD python3 experiments/bench_train.py --presets small --configs nvfp4 --devices 1 --batch-per-device 64 --iterations 10 --time-limit 100 --out $OUT/old_small > $OUT/old_small.log 2>&1); echo old rc=$?
for f in $OUT/new_small.log $OUT/old_small.log; do echo "== $f"; grep "^| \`" $f; done
