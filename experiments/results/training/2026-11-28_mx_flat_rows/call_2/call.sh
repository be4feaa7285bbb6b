set -x
export PATH=/opt/torch/.venv/bin:$PATH PYTHONPATH=$PWD FP4JAX_COMMIT=27983d7
nvidia-smi --query-gpu=name --format=csv,noheader
python3 experiments/mxfp4_check.py --reps 10 --out $OUT/mxfp4_check.json > $OUT/mxfp4_check.log 2>&1; echo mxfp4_check rc=$?
tail -5 $OUT/mxfp4_check.log
python3 experiments/gpu_check.py rows --out $OUT/gpu_check_rows.json > $OUT/gpu_check_rows.log 2>&1; echo gpu_check rc=$?
tail -3 $OUT/gpu_check_rows.log
python3 experiments/bench_train.py --presets small --configs bf16 mxfp4 nvfp4 --devices 1 --batch-per-device 64 --iterations 10 --time-limit 300 --out $OUT/bench > $OUT/bench.log 2>&1; echo bench rc=$?
tail -12 $OUT/bench.log
python3 experiments/profile_step.py --preset small --specs mxfp4 --attention cudnn --batch-size 64 --seq-len 256 --iterations 20 --out $OUT/prof > $OUT/prof.log 2>&1; echo prof rc=$?
head -14 $OUT/prof.log
