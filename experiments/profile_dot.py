"""Where the time of an NVFP4 ``fp4jax.dot`` forward + backward goes (issue 5).

One device call. For an ``M x K x N`` problem (default 8192^3, bf16 inputs) it times,
with CUPTI (``lab.time_fn``: warm-up, median of N calls, device time only):

* the pieces of the recipe on their own, each as one jitted function: the amax
  reduction, threefry bits, 1x16 RtN/SR quantization along either axis, 16x16
  quantization, RHT + quantization along the token axis, the bf16 decode
  (``scaled_data``), and the bf16 GEMMs;
* ``fp4jax.dot`` fwd and fwd+bwd (``value_and_grad`` with a random cotangent) against
  bf16, and the fwd+bwd's per-kernel breakdown (``profiler.measure(aggregate=False)``:
  XLA fusion names and their device times, summed over identical names).

Writes ``$OUT/profile_dot.json`` (device, JAX version, git commit, command, then the
pieces and the breakdown) and, with ``--hlo``, the optimized HLO of the fwd+bwd
(``$OUT/profile_dot_hlo.txt.gz``) to map fusion names to ops. ``FP4JAX_KERNELS`` (recorded)
chooses the path: e.g. ``FP4JAX_KERNELS=on python3 experiments/profile_dot.py --skip-pieces``
profiles the kernel path.

    PYTHONPATH=$PWD python3 experiments/profile_dot.py [--shape M K N] [--hlo]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import sys

import jax
import jax.numpy as jnp
import lab  # before fp4jax: puts the repository root on sys.path

import fp4jax
from fp4jax import quantization as qz
from fp4jax.formats import NVFP4
from fp4jax.hadamard import random_hadamard_transform, resolve_signs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", type=int, nargs=3, default=(8192, 8192, 8192))
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--hlo", action="store_true")
    ap.add_argument("--skip-pieces", action="store_true")
    args = ap.parse_args()
    m, k, n = args.shape
    out_dir = os.environ.get("OUT", ".")
    res = lab.run_info(__file__, sys.argv[1:]) | {"shape": [m, k, n], "pieces": {},
                                                  "breakdown": []}

    def dump():
        with open(os.path.join(out_dir, "profile_dot.json"), "w") as f:
            json.dump(res, f, indent=1)

    def t(name, f, *a):
        try:
            r = lab.time_fn(jax.jit(f), *a, iterations=args.iterations)
            res["pieces"][name] = round(r["median_us"], 1)
        except Exception as e:  # noqa: BLE001
            res["pieces"][name] = f"error {type(e).__name__}: {str(e)[:300]}"
        print(f"{name:<60} {res['pieces'][name]}", flush=True)
        dump()

    x, w, ct = lab.dot_problem(m, k, n)
    key = jax.random.key(7)
    recipe = fp4jax.recipes.nvfp4()
    signs = resolve_signs(None, 16)

    def q(a, axis=-1, sr=False, block_2d=False):
        return qz.quantize_unchecked(a, key if sr else None, NVFP4, axis, block_2d,
                                 "stochastic" if sr else "nearest")

    if not args.skip_pieces:
        t("copy x (bf16 -> bf16, x+1)", lambda a: a + 1, x)
        t("amax |x|", lambda a: jnp.max(jnp.abs(a.astype(jnp.float32))), x)
        t("threefry bits (m,k) uint32", lambda kk: jax.random.bits(kk, (m, k), jnp.uint32), key)
        t("quantize 1x16 RtN axis -1", lambda a: q(a), x)
        t("quantize 1x16 SR axis -1", lambda a: q(a, sr=True), x)
        t("quantize 1x16 RtN axis 0", lambda a: q(a, axis=0), x)
        t("quantize 16x16 RtN", lambda a: q(a, block_2d=True), w)
        t("RHT axis 0 only (bf16 out)", lambda a: random_hadamard_transform(
            a, axis=0, size=16, signs=signs).astype(jnp.bfloat16), x)
        t("RHT axis 0 + quantize 1x16 RtN axis 0", lambda a: q(random_hadamard_transform(
            a, axis=0, size=16, signs=signs), axis=0), x)
        t("RHT axis 0 + quantize 1x16 SR axis 0", lambda a: q(random_hadamard_transform(
            a, axis=0, size=16, signs=signs), axis=0, sr=True), x)
        t("quantize 1x16 RtN axis -1 + decode to bf16",
          lambda a: qz.scaled_data(q(a), jnp.bfloat16), x)
        t("bf16 dot x @ w", jnp.dot, x, w)
        t("bf16 dot x.T @ ct (wgrad shape)", lambda a, b: a.T @ b, x, ct)

    def loss_bf(x, w, ct):
        return (jnp.dot(x, w).astype(jnp.float32) * ct).sum()

    t("bf16 fwd", jnp.dot, x, w)
    t("bf16 fwd+bwd", jax.value_and_grad(loss_bf, argnums=(0, 1)), x, w, ct)
    t("nvfp4 fwd", lambda a, b: fp4jax.dot(a, b, recipe=recipe, key=key), x, w)
    fb = jax.jit(jax.value_and_grad(lab.dot_loss(recipe, key), argnums=(0, 1)))
    t("nvfp4 fwd+bwd", fb, x, w, ct)
    try:
        from jax.experimental.mosaic.gpu import profiler

        jax.block_until_ready(fb(x, w, ct))
        _, per = profiler.measure(fb, aggregate=False)(x, w, ct)
        agg = collections.OrderedDict()
        for name, ms in per:
            c, s = agg.get(name, (0, 0.0))
            agg[name] = (c + 1, s + ms * 1e3)
        total = sum(s for _, s in agg.values())
        # launch order, to tell the Pallas kernels apart (they share one name) against
        # the HLO schedule (--hlo)
        res["sequence"] = [[name[:80], round(ms * 1e3, 1)] for name, ms in per]
        res["breakdown_total_us"] = round(total, 1)
        res["breakdown"] = [{"kernel": kname, "calls": c, "us": round(s, 1)}
                            for kname, (c, s) in sorted(agg.items(), key=lambda kv: -kv[1][1])]
        for r in res["breakdown"][:40]:
            print(f"  {r['us']:>9.1f} us  x{r['calls']}  {r['kernel'][:100]}")
        print(f"  total {total:.1f} us over {len(per)} kernels")
        for i, (name, us) in enumerate(res["sequence"]):
            if us >= 5:
                print(f"  #{i:<3} {us:>9.1f} us  {name}")
    except Exception as e:  # noqa: BLE001
        res["breakdown_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(res["breakdown_error"])
    dump()
    if args.hlo:
        txt = fb.lower(x, w, ct).compile().as_text()
        with gzip.open(os.path.join(out_dir, "profile_dot_hlo.txt.gz"), "wt") as f:
            f.write(txt)


if __name__ == "__main__":
    main()
