# Three nvidia-h100-x1 calls, 2026-12-07 (JAX 0.11.2), from the repository root; SHA as in each JSON.
# call 1 (commit 7056b18)
python3 experiments/mxfp4_fp8_gpu_check.py --out $OUT/fp8 --commit $SHA --quick        # -> mxfp4_fp8_kernel.json
OUT=$OUT/check LAB_TIMEOUT=190 bash experiments/gpu_lab.sh check                        # -> gpu_check_operands.json (cut at 190 s)
python3 experiments/bench_train.py --presets small --configs bf16 mxfp4 --time-limit 85 --timeout-s 80 --out $OUT/bench --commit $SHA
# call 2 (commit f9c4268)
OUT=$OUT/check LAB_TIMEOUT=230 bash experiments/gpu_lab.sh check dot dot_recipes gemm_alpha threefry  # -> gpu_check_dot.json
python3 experiments/mxfp4_fp8_gpu_check.py --out $OUT/dot --commit $SHA --dot-only --quick            # -> mxfp4_fp8_dot.json
# call 3 (commit f9c4268)
OUT=$OUT/check LAB_TIMEOUT=150 bash experiments/gpu_lab.sh check gemm_alpha threefry   # -> gpu_check_gemm_threefry.json
