# One device call (a fresh nvidia-h100-x1; asked for no kind), 2026-12-07 16:13-16:19 UTC, JAX 0.11.2,
# Python 3.12.3, from the repository root at commit 7d8f269 (the working tree of /work/main, clean).
# 317 s of wall; four earlier tries got no machine (no output). Outputs renamed here:
#   $OUT/bench/bench_train.json -> bench_train_small_gemm.json, $OUT/bench_fp8/bench_train.json -> bench_train_gemm_mxfp4_fp8.json.
# The final `tail -40 A B` failed on the device's tail ("option used in invalid context -- 4"; rc 1
# of the call); both logs came back whole (bench.log, bench_fp8.log).
export FP4JAX_COMMIT=7d8f2697fd7d43a4ec662e32761ce1a4ced7e17f XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD; nvidia-smi -L > $OUT/env.log; python3 -c 'import jax,sys;print(sys.version, jax.__version__)' >> $OUT/env.log; python3 experiments/bench_train.py --presets small --configs bf16 nvfp4 mxfp4 --gemm --gemm-timeout-s 200 --time-limit 420 --timeout-s 150 --out $OUT/bench > $OUT/bench.log 2>&1; echo rc=$?; FP4JAX_KERNEL_GEMM=fp8 python3 experiments/bench_train.py --gemm-only --gemm-recipes mxfp4 --gemm-timeout-s 130 --out $OUT/bench_fp8 > $OUT/bench_fp8.log 2>&1; echo rc=$?; tail -40 $OUT/bench.log $OUT/bench_fp8.log
