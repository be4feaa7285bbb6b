#!/usr/bin/env bash
# Issue 5, third session, call 1 (one GPU, ~4 min): where does the NVFP4 fwd+bwd time go?
#   OUT=<dir> bash experiments/gpu_run11.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:?set OUT}
{ date -u; nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } >"$OUT/env.log" 2>&1
mkdir -p "$OUT/off" "$OUT/on"
OUT=$OUT/off timeout 240 python3 experiments/profile_dot.py --hlo >"$OUT/off/profile.log" 2>&1
echo "exit $?" >>"$OUT/off/profile.log"
OUT=$OUT/on FP4JAX_KERNELS=on timeout 120 python3 experiments/profile_dot.py --skip-pieces >"$OUT/on/profile.log" 2>&1
echo "exit $?" >>"$OUT/on/profile.log"
