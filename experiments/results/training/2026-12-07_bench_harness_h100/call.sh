# device call (nvidia-h100-x1, 2026-12-07 ~09:05 UTC), working tree of main at 6d2b17e
# (the merge of h-hspeed; the JSON's "commit" says c1ac737 because `git rev-parse HEAD` on the
# device machine's copy did not see the merge: the code that ran is 6d2b17e's)
export FP4JAX_COMMIT=$(git rev-parse HEAD); export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout 500 python3 experiments/bench_harness.py --out $OUT/bench_harness --time-limit 330
