# One nvidia-h200 call (a fresh machine; asked for no kind), 2026-12-07 13:08 UTC, JAX 0.11.2,
# Python 3.12.3, from the repository root at commit 7968d81 (FP4JAX_KERNEL_OPERANDS default
# "fused" at that commit). 196 s of wall. train_sep's JSON did not come back (the call's file
# count); its row is in bench_train_small_separate.log.
export FP4JAX_COMMIT=7968d81 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout 120 python3 experiments/gpu_check.py rowscols dot --out $OUT/gpu_check.json           # -> gpu_check_rowscols_dot.json
timeout 75 python3 experiments/bench_kernels.py rowscols --out $OUT/bench_kernels.json        # -> bench_kernels_rowscols.json
python3 experiments/bench_train.py --presets small --configs bf16 nvfp4 --time-limit 150 \
    --timeout-s 105 --out $OUT/train_fused                                                    # -> bench_train_small_fused.json
FP4JAX_KERNEL_OPERANDS=separate python3 experiments/bench_train.py --presets small \
    --configs nvfp4 --time-limit 100 --timeout-s 98 --out $OUT/train_sep                      # -> bench_train_small_separate.log
