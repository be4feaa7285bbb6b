"""On the device: ``fp4jax.ragged_dot`` (grouped MoE GEMMs) against its definition, every
expert its own ``fp4jax.dot``, and its speed against the per-expert loop and bf16
``jax.lax.ragged_dot``.

    PYTHONPATH=$PWD python3 experiments/moe_ragged_check.py --out $OUT/moe_ragged.json
    PYTHONPATH=$PWD python3 experiments/moe_ragged_check.py --quick   # small shapes, any device

Per recipe (nvfp4, mxfp4, bf16 on bfloat16 tensors): forward rows, dx rows and dw[g] of one
call with uneven expert sizes (one empty, trailing rows) compared bit for bit with
``fp4jax.dot`` on each expert's slice with ``fold_in(key, g)`` (``mismatches`` per output;
on the CPU all 0, ``tests/dot/test_ragged.py``; on a GPU the float32 accumulation order of
XLA's ragged GEMM may differ from its dense GEMM, so a mismatch there is reported with its
largest relative difference, not a failure of the operands, which are the same bits;
the exit status counts mismatches on the CPU only),
then the median time of one forward+backward of: ``fp4jax.ragged_dot``, the per-expert
``fp4jax.dot`` loop (static sizes), and ``jax.lax.ragged_dot`` in bfloat16 (no
quantization). Writes ``lab.run_info`` then one record per recipe.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import lab  # noqa: F401  (puts the repository root on sys.path)
import numpy as np

import fp4jax


def problem(m_sizes: list[int], M: int, K: int, N: int, dtype) -> tuple:
    rng = np.random.default_rng(0)
    G = len(m_sizes)
    x = jnp.asarray(rng.standard_normal((M, K)) * np.exp(rng.uniform(-2, 2, (M, 1))), dtype)
    w = jnp.asarray(rng.standard_normal((G, K, N)) * 0.05, dtype)
    dy = jnp.asarray(rng.standard_normal((M, N)), dtype)
    return x, w, dy


def check(recipe: str, sizes: list[int], M: int, K: int, N: int, iterations: int) -> dict:
    dtype = jnp.bfloat16
    x, w, dy = problem(sizes, M, K, N, dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    key = jax.random.key(7)

    @jax.jit
    def ragged(x, w, dy, key):
        y, vjp = jax.vjp(lambda a, b: fp4jax.ragged_dot(a, b, gs, recipe=recipe, key=key), x, w)
        return (y, *vjp(dy))

    @jax.jit
    def loop(x, w, dy, key):
        out, o = [], 0
        for g, m in enumerate(sizes):
            if m == 0:
                out.append(None)
                continue
            y, vjp = jax.vjp(lambda a, b, g=g: fp4jax.dot(
                a, b, recipe=recipe, key=jax.random.fold_in(key, g)), x[o:o + m], w[g])
            out.append((y, *vjp(dy[o:o + m])))
            o += m
        return out

    @jax.jit
    def plain(x, w, dy):
        y, vjp = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, gs), x, w)
        return (y, *vjp(dy))

    y, dx, dw = ragged(x, w, dy, key)
    want = loop(x, w, dy, key)
    S = sum(sizes)
    pairs = {"y": (y[:S], jnp.concatenate([o[0] for o in want if o])),
             "dx": (dx[:S], jnp.concatenate([o[1] for o in want if o]))}
    for g, o in enumerate(want):
        if o:
            pairs[f"dw{g}"] = (dw[g], o[2])
    rec = {"recipe": recipe, "sizes": sizes, "M": M, "K": K, "N": N, "outputs": {}}
    for name, (a, b) in pairs.items():
        a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
        rel = float(jnp.max(jnp.abs(a32 - b32)) / (jnp.max(jnp.abs(b32)) + 1e-30))
        rec["outputs"][name] = {"mismatches": lab.mismatches(a, b), "max_rel_diff": rel}
    rec["trailing_rows_zero"] = bool(jnp.all(y[S:] == 0) and jnp.all(dx[S:] == 0))
    empty = [g for g, m in enumerate(sizes) if m == 0]
    rec["empty_experts_dw_zero"] = bool(all(jnp.all(dw[g] == 0) for g in empty))
    rec["time_ragged"] = lab.time_fn(ragged, x, w, dy, key, iterations=iterations)
    rec["time_loop"] = lab.time_fn(loop, x, w, dy, key, iterations=iterations)
    rec["time_bf16_ragged_dot"] = lab.time_fn(plain, x, w, dy, iterations=iterations)
    return rec


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="JSON file (default: print only)")
    ap.add_argument("--quick", action="store_true", help="small shapes (a CPU smoke run)")
    ap.add_argument("--recipes", default="nvfp4,mxfp4,bf16")
    ap.add_argument("--iterations", type=int, default=10)
    args = ap.parse_args(argv)
    if args.quick:
        sizes, K, N = [21, 0, 13, 30], 64, 48
    else:  # 8 experts of an MoE FFN's up projection, ~4k routed rows, uneven load
        sizes, K, N = [700, 0, 513, 1024, 300, 611, 410, 500], 1024, 2816
    M = sum(sizes) + 5
    records = [lab.run_info(__file__, argv)]
    bad = 0
    for r in args.recipes.split(","):
        rec = check(r, sizes, M, K, N, 2 if args.quick else args.iterations)
        if jax.default_backend() == "cpu":  # on a GPU a mismatch is reported, not a failure
            bad += sum(o["mismatches"] > 0 for o in rec["outputs"].values())
        records.append(rec)
        print(json.dumps(rec), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
