#!/usr/bin/env bash
# One device call of the scale ladder (issue 36): corpus, tokens and the runs that fit.
#   bash experiments/ladder/gpu.sh --phases sweep:mini ladder:mini --time-limit 550
# Everything comes back under $OUT (driver.log, driver.json, runs/, corpus/ on the first call).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-.data/ladder-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{ date -u; nvidia-smi -L 2>/dev/null; python3 -c 'import jax, sys; print(sys.version.split()[0], "jax", jax.__version__)'; echo "commit ${FP4JAX_COMMIT:-unknown}"; } > "$OUT/env.log" 2>&1
python3 experiments/ladder/run.py --out "$OUT" "$@" > "$OUT/driver.log" 2>&1
rc=$?
tail -n 40 "$OUT/driver.log"
exit $rc
