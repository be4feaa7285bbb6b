export PATH=/opt/torch/.venv/bin:$PATH
nvidia-smi --query-gpu=name --format=csv,noheader
# A/B on one machine: the old tree (097045d) and the new (27983d7), MXFP4 at small, bf16 baseline
(cd .data/oldtree && PYTHONPATH=$PWD FP4JAX_COMMIT=097045d python3 experiments/bench_train.py --presets small --configs mxfp4 --devices 1 --batch-per-device 64 --iterations 10 --time-limit 150 --out $OUT/old > $OUT/old.log 2>&1); echo old rc=$?
PYTHONPATH=$PWD FP4JAX_COMMIT=27983d7 python3 experiments/bench_train.py --presets small --configs bf16 mxfp4 --devices 1 --batch-per-device 64 --iterations 10 --time-limit 200 --out $OUT/new > $OUT/new.log 2>&1; echo new rc=$?
grep -h "mxfp4\|bf16" $OUT/old.log $OUT/new.log | grep "^|" 
