"""Checks ``fp4jax.diagnostics.gemm_stats`` on a GPU and times the harness's stats step.

``gemm_stats`` measures each GEMM of a layer as ``fp4jax.quantized_dot.reference_gemms``
computes it (the XLA reference's three GEMMs, each operand quantized once for its GEMM and
its statistics). This script checks, on the device it runs on:

1. ``--part bits``: for each recipe, bf16 ``x (M, K)``, a float32 ``w (K, N)`` and a
   cotangent: ``reference_gemms``' products against ``fp4jax.dot``'s forward and VJP with
   ``implementation="xla"`` (bit for bit: mismatching elements counted) and with the
   default implementation (on sm_90 the kernels: equal up to float32 accumulation order,
   the largest relative difference reported).
2. ``--part stats``: the ``--stats-every`` step of a preset
   (``fp4jax.train.make_stats_step``): its lower and compile seconds and its statistics,
   so that two commits' runs (this one and one before ``reference_gemms``) compare.

    PYTHONPATH=$PWD python3 experiments/stats_step_check.py --part bits stats \\
        --preset small --out $OUT/new
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

RECIPES = ("nvfp4", "nvfp4(sr=False)", "mxfp4", "quartet2", "fp4_all_the_way",
           "mxfp8_fwd_nvfp4_bwd")


def bits(m: int, k: int, n: int) -> list[dict]:
    """Part 1: one row per recipe and implementation."""
    import fp4jax
    from fp4jax import quantized_dot as qd

    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = 0.05 * jax.random.normal(kw, (k, n), jnp.float32)
    g = jax.random.normal(kg, (m, n), jnp.float32)
    key = jax.random.key(7)
    rows = []
    for spec in RECIPES:
        r = fp4jax.recipes.get(spec)
        def ref(x, w, g, r=r):
            d = qd.reference_gemms(x[None], w[None], g[None], r, qd.call_key(r, key))
            return [d[gemm][0][0] for gemm in ("fprop", "dgrad", "wgrad")]

        want = [np.asarray(a, np.float32) for a in jax.jit(ref)(x, w, g)]
        for impl in ("xla", None):
            def f(x, w, g, r=r, impl=impl):
                y, vjp = jax.vjp(lambda u, v: fp4jax.dot(
                    u, v, recipe=r, key=key, preferred_element_type=jnp.float32,
                    implementation=impl), x, w)
                return [y, *vjp(g)]
            got = [np.asarray(a, np.float32) for a in jax.jit(f)(x, w, g)]
            row = {"recipe": spec, "implementation": impl or "default"}
            for name, a, b in zip(("fprop", "dgrad", "wgrad"), got, want, strict=True):
                row[f"{name}_mismatch"] = int((a.view(np.uint32) != b.view(np.uint32)).sum())
                row[f"{name}_max_rel"] = float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def stats(preset: str, batch_size: int, seq_len: int, recipe: str) -> dict:
    """Part 2: the preset's stats step, lowered, compiled and run once."""
    from fp4jax import diagnostics
    from fp4jax import train as T
    from fp4jax.models import quantized_llama

    cfg = T.TrainConfig(preset=preset, batch_size=batch_size, seq_len=seq_len, recipe=recipe)
    mc = T.model_config(cfg)
    rcfg, rec = T.run_recipe(cfg)
    model = quantized_llama(mc, T.make_policy(rcfg, mc, rec))
    mesh = T.make_mesh(1)
    params = jax.jit(model.init)(jax.random.key(0),
                                 jnp.zeros((1, seq_len), jnp.int32))["params"]
    batch = jax.random.randint(jax.random.key(1), (batch_size, seq_len + 1), 0,
                               mc.vocab_size, jnp.int32)
    fn = T.make_stats_step(model, mesh)
    args = (params, batch, jax.random.key(2), jnp.int32(3))
    t0 = time.perf_counter()
    lowered = fn.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    t3 = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    t4 = time.perf_counter()
    return {"preset": preset, "recipe": recipe, "batch_size": batch_size, "seq_len": seq_len,
            "lower_s": round(t1 - t0, 3), "compile_s": round(t2 - t1, 3),
            "first_run_s": round(t3 - t2, 4), "run_s": round(t4 - t3, 4),
            "hlo_lines": len(compiled.as_text().splitlines()),
            "layers": {name: diagnostics.flatten_stats(s) for name, s in out.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", nargs="+", choices=("bits", "stats"), default=["bits", "stats"])
    ap.add_argument("--mkn", type=int, nargs=3, default=(2048, 1024, 1024),
                    help="the bits part's x (M, K) and w (K, N)")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--recipe", default="nvfp4")
    ap.add_argument("--commit", default=os.environ.get("FP4JAX_COMMIT", "unknown"))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    dev = jax.devices()[0]
    res = {"command": "PYTHONPATH=$PWD python3 experiments/stats_step_check.py "
                      + " ".join(sys.argv[1:] if argv is None else argv),
           "commit": args.commit, "jax": jax.__version__, "platform": dev.platform,
           "device": dev.device_kind}
    if "bits" in args.part:
        res["bits"] = bits(*args.mkn)
    if "stats" in args.part:
        res["stats"] = stats(args.preset, args.batch_size, args.seq_len, args.recipe)
        print({k: v for k, v in res["stats"].items() if k != "layers"}, flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "stats_step_check.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
