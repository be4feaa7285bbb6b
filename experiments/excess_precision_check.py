"""Does XLA drop the bfloat16 rounding of a weight cast inside a jitted program before
fp4jax quantizes it? (issue 37 item 1: the FP4 parameter gather was not bit-identical on
the GPU.)

A float32 master weight cast to bfloat16 inside ``jax.jit`` and then quantized by fp4jax
(which computes in float32) is the pair ``convert(f32 -> bf16) -> convert(bf16 -> f32)``;
with ``--xla_allow_excess_precision`` (XLA's default: true) XLA may remove it, and fp4jax
would quantize the unrounded float32 values. Each case compares, bit for bit, the same
function on the in-program cast with the function on the weight cast on the host (the
reference: bfloat16 inputs, nothing to elide):

* ``quantize_2d``: ``dequantize(quantize(w.astype(bf16), NVFP4, block_2d=True))``;
* ``dot_fwd``: ``fp4jax.dot(x, w.astype(bf16), recipe=nvfp4)`` (forward);
* ``dot_grads``: the gradients of ``sum(fp4jax.dot(...)**2)`` w.r.t. x and w.

Run it twice, with and without ``XLA_FLAGS=--xla_allow_excess_precision=false``:

    PYTHONPATH=$PWD python3 experiments/excess_precision_check.py --out DIR

Writes ``excess_precision_check.json`` (mismatch counts per case, the XLA flags, device,
JAX version, ``$FP4JAX_COMMIT``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fp4jax  # noqa: E402


def _bits(a) -> np.ndarray:
    """The float32 bits of ``a`` (bfloat16 values widen exactly)."""
    return np.asarray(jax.device_get(a), np.float32).view(np.uint32)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--m", type=int, default=2048)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    w = jnp.asarray((rng.standard_normal((a.k, a.n)) * 0.02).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((a.m, a.k)).astype(np.float32)).astype(jnp.bfloat16)
    wb = jax.device_put(np.asarray(w).astype(jnp.bfloat16))  # cast on the host
    recipe = fp4jax.recipes.nvfp4()
    key = jax.random.key(1)
    out: dict = {"xla_flags": os.environ.get("XLA_FLAGS", ""), "jax": jax.__version__,
                 "device": str(jax.devices()[0]), "commit": os.environ.get("FP4JAX_COMMIT"),
                 "shapes": {"x": [a.m, a.k], "w": [a.k, a.n]}, "cases": {}}

    def q2d(v):
        return fp4jax.dequantize(fp4jax.quantize(v, fp4jax.NVFP4, block_2d=True))

    def fwd(xv, v):
        return fp4jax.dot(xv, v, recipe=recipe, key=key)

    def loss(xv, v):
        return jnp.sum(fwd(xv, v).astype(jnp.float32) ** 2)

    grads = jax.grad(loss, argnums=(0, 1))
    cases = {
        "quantize_2d": (jax.jit(lambda v: q2d(v.astype(jnp.bfloat16)))(w), jax.jit(q2d)(wb)),
        "dot_fwd": (jax.jit(lambda xv, v: fwd(xv, v.astype(jnp.bfloat16)))(x, w),
                    jax.jit(fwd)(x, wb)),
        "dot_grads": (jax.jit(lambda xv, v: grads(xv, v.astype(jnp.bfloat16)))(x, w),
                      jax.jit(grads)(x, wb)),
        # the candidate guard: an explicit reduce_precision to bfloat16's bits after the
        # widening, which still rounds if XLA removes the convert pair
        "quantize_2d_guarded": (jax.jit(lambda v: q2d(jax.lax.reduce_precision(
            v.astype(jnp.bfloat16).astype(jnp.float32), exponent_bits=8, mantissa_bits=7)))(w),
            jax.jit(q2d)(wb)),
    }
    for name, (got, ref) in cases.items():
        g, r = jax.tree.leaves(got), jax.tree.leaves(ref)
        mism = [int((_bits(u) != _bits(v)).sum()) for u, v in zip(g, r, strict=True)]
        out["cases"][name] = {"mismatches": mism, "elements": [int(u.size) for u in g]}
        print(f"{name}: mismatches {mism} of {[int(u.size) for u in g]}", flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"excess_precision_check{a.tag}.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
