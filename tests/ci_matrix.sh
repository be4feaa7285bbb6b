#!/usr/bin/env bash
# The test suite on the oldest and the newest JAX that fp4jax supports, each in its own
# virtual environment (what CI runs: README, Quick start):
#   oldest: Python 3.11 with JAX pinned to 0.10.2 (pyproject.toml's lower bound);
#   newest: Python 3.12 (the GPU machines' Python), else 3.13, found on PATH or among
#           pyenv's versions, with the newest JAX that pip resolves within pyproject.toml's
#           range (3.12 and 3.13 resolve the same JAX).
#
# Usage: bash tests/ci_matrix.sh [all|oldest|newest] [pytest arguments...]
#   default: all, and pytest's arguments '-q -n 2 --dist loadgroup --durations=15' (the
#   whole suite on the newest; on the oldest, its layers below);
#   e.g. `bash tests/ci_matrix.sh newest -m "not slow"` runs the fast tier on the newest.
# Environment: FP4JAX_CI_VENVS (where the environments live, default
# ~/.cache/fp4jax/ci-venvs; reused between runs, re-installed each run),
# FP4JAX_CI_OLDEST_PYTHON / FP4JAX_CI_NEWEST_PYTHON (the interpreters to use).
# Both runs go on even if one fails; the exit status is non-zero if either failed.
set -uo pipefail
cd "$(dirname "$0")/.."

which_runs=all
case "${1:-}" in
  all|oldest|newest) which_runs=$1; shift ;;
esac
whole_suite=0
if [ "$#" -eq 0 ]; then
  set -- -q -n 2 --dist loadgroup --durations=15
  whole_suite=1
fi
venvs=${FP4JAX_CI_VENVS:-$HOME/.cache/fp4jax/ci-venvs}
pyenv_root=${PYENV_ROOT:-$HOME/.pyenv}

# an interpreter of Python version $1 (e.g. 3.12) that runs, or nothing
find_python() {
  local v=$1 c
  for c in "python$v" "$pyenv_root"/versions/"$v".*/bin/"python$v"; do
    if [ -x "$(command -v "$c" 2>/dev/null)" ] && "$c" -c 'import sys' >/dev/null 2>&1; then
      command -v "$c"
      return 0
    fi
  done
  return 1
}

# Test paths known to fail on the newest JAX for a reason in the library, each with its
# reason: on the newest they run apart, beside the rest of the suite (in the background,
# their output printed at the end), and their failures are printed but do not fail the
# run; the rest of the suite gates as usual. Empty it as soon as they pass.
# (A test that hangs, blocked in a collective, takes no CPU there: tests/train/
# test_multiprocess.py on JAX 0.12.1 did for its 600 s limit until fp4jax-train stopped
# using the persistent compilation cache in multi-process CPU runs, cli._GLOO_CACHE_HANGS.)
newest_known_failing=(
)

# The oldest JAX runs the layers issue 57 asks of it (core, recipes, dot, nn, the harness,
# the cross-layer tests at the top) and a smoke set of the kernels (every kernel traced for
# the GPU path, the packed quantizer in interpret mode, two CUDA lowerings); the kernels'
# interpret-mode suite, the experiments' scripts and the docs' notebooks run on the newest
# only, shortening the oldest's run toward its 25-minute budget (measured times:
# tests/README.md). Only for the whole suite (no pytest arguments): `bash
# tests/ci_matrix.sh oldest ARGS` runs ARGS as given.
oldest_skipped=(tests/kernels tests/experiments tests/docs)
oldest_smoke=(tests/kernels/test_lowering.py tests/kernels/test_quantize.py
              tests/kernels/test_gemm_alpha.py)

# the oldest's test paths: every test folder and top-level test file of tests/ but
# oldest_skipped, then oldest_smoke
oldest_paths() {
  local p s skip
  for p in tests/*/ tests/test_*.py; do
    p=${p%/}
    [ -e "$p" ] || continue
    [ -d "$p" ] && [ "$(basename "$p")" = __pycache__ ] && continue
    skip=0
    for s in "${oldest_skipped[@]}"; do [ "$p" = "$s" ] && skip=1; done
    [ "$skip" = 1 ] || echo "$p"
  done
  printf '%s\n' "${oldest_smoke[@]}"
}

oldest_python=${FP4JAX_CI_OLDEST_PYTHON:-$(find_python 3.11 || true)}
newest_python=${FP4JAX_CI_NEWEST_PYTHON:-$(find_python 3.12 || find_python 3.13 || true)}

# run NAME PYTHON PIN...: a fresh install of fp4jax[dev] (plus the pins) into
# $venvs/NAME, then pytest there
run() {
  local name=$1 python=$2
  shift 2
  local pins=("$@")
  if [ -z "$python" ]; then
    echo "ci_matrix: no Python found for the $name JAX run (set FP4JAX_CI_${name^^}_PYTHON)" >&2
    return 1
  fi
  local venv="$venvs/$name"
  echo "ci_matrix: $name: $("$python" --version 2>&1) ($python) in $venv"
  "$python" -m venv "$venv" || return 1
  "$venv/bin/python" -m pip install -q --upgrade pip || return 1
  "$venv/bin/python" -m pip install -q -e ".[dev]" "${pins[@]}" || return 1
  "$venv/bin/python" -c 'import jax, flax, sys; print(f"ci_matrix: '"$name"': Python {sys.version.split()[0]}, JAX {jax.__version__}, Flax {flax.__version__}")' || return 1
  local t0=$SECONDS ignores=() p known_pid="" known_log
  if [ "$name" = newest ]; then
    for p in "${newest_known_failing[@]}"; do
      case "$p" in
        *::*) ignores+=("--deselect=$p") ;;  # a test
        *) ignores+=("--ignore=$p") ;;       # a file or folder
      esac
    done
    if [ "$whole_suite" = 1 ] && [ "${#ignores[@]}" -gt 0 ]; then
      # in the background, one worker (-p no:xdist), beside the gating run
      known_log=$(mktemp "${TMPDIR:-/tmp}/ci_matrix_known.XXXXXX")
      "$venv/bin/python" -m pytest -q -p no:xdist "${newest_known_failing[@]}" \
        >"$known_log" 2>&1 &
      known_pid=$!
    fi
  fi
  local paths=()
  if [ "$name" = oldest ] && [ "$whole_suite" = 1 ]; then
    mapfile -t paths < <(oldest_paths)
    echo "ci_matrix: oldest: ${paths[*]}"
  fi
  "$venv/bin/python" -m pytest "${pytest_args[@]}" "${ignores[@]}" "${paths[@]}"
  local rc=$?
  if [ -n "$known_pid" ]; then
    wait "$known_pid"
    local known_rc=$?
    cat "$known_log"
    rm -f "$known_log"
    echo "ci_matrix: newest: known failing on this JAX (not gating):" \
         "${newest_known_failing[*]}: pytest exit $known_rc"
  fi
  echo "ci_matrix: $name: pytest exit $rc in $((SECONDS - t0)) s"
  return $rc
}

pytest_args=("$@")
status=0
results=()
if [ "$which_runs" != newest ]; then
  run oldest "$oldest_python" "jax==0.10.2" "jaxlib==0.10.2"
  rc=$?; results+=("oldest: exit $rc"); [ $rc -eq 0 ] || status=1
fi
if [ "$which_runs" != oldest ]; then
  run newest "$newest_python"
  rc=$?; results+=("newest: exit $rc"); [ $rc -eq 0 ] || status=1
fi
echo "ci_matrix: ${results[*]}"
exit $status
