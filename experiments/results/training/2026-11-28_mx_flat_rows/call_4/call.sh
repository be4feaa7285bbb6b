export PATH=/opt/torch/.venv/bin:$PATH
nvidia-smi --query-gpu=name --format=csv,noheader
NEW=$PWD/.data/newtree
FP4JAX_KERNELS=off PYTHONPATH=$PWD python3 experiments/bits_ab.py --out $OUT/bits_old.json > $OUT/bits.log 2>&1
FP4JAX_KERNELS=off PYTHONPATH=$NEW python3 experiments/bits_ab.py --out $OUT/bits_new.json >> $OUT/bits.log 2>&1
PYTHONPATH=$PWD python3 experiments/bits_ab.py --compare $OUT/bits_old.json $OUT/bits_new.json >> $OUT/bits.log 2>&1; echo compare rc=$?
tail -4 $OUT/bits.log
PYTHONPATH=$PWD FP4JAX_COMMIT=27983d7 python3 experiments/bench_train.py --presets small --configs bf16 mxfp4 nvfp4 --devices 1 --batch-per-device 64 --iterations 10 --time-limit 200 --out $OUT/main > $OUT/main.log 2>&1; echo main rc=$?
(cd $NEW && PYTHONPATH=$NEW FP4JAX_COMMIT=27983d7+blockamax python3 experiments/bench_train.py --presets small --configs mxfp4 nvfp4 --devices 1 --batch-per-device 64 --iterations 10 --time-limit 150 --out $OUT/new > $OUT/new.log 2>&1); echo new rc=$?
grep -h "^| \`" $OUT/main.log $OUT/new.log
(cd $NEW && PYTHONPATH=$NEW python3 experiments/profile_step.py --preset small --specs mxfp4 --attention cudnn --batch-size 64 --seq-len 256 --iterations 20 --out $OUT/prof_new > $OUT/prof_new.log 2>&1); echo prof rc=$?
head -12 $OUT/prof_new.log
