"""Whether two source trees of fp4jax compute the same bits on this device: hashes of the
XLA path's outputs (``FP4JAX_KERNELS=off``) of the quantizers, the RHT and ``fp4jax.dot``'s
forward and backward under several recipes, on fixed inputs that include the hard cases
(NaN/Inf/-0, 40 binades, a tiny tensor). Run once per tree, then compare:

    FP4JAX_KERNELS=off PYTHONPATH=OLD_TREE python3 experiments/bits_ab.py --out old.json
    FP4JAX_KERNELS=off PYTHONPATH=$PWD python3 experiments/bits_ab.py --out new.json
    python3 experiments/bits_ab.py --compare old.json new.json

Meant for changes that must not change a bit (a refactoring of the numerics core): the CPU
tests check the core against the NumPy reference; this checks the GPU's lowering too.
Each record: ``{case: sha256 of the output arrays' bytes}``, the device, JAX version and
the tree's ``fp4jax.__file__``. ``--compare`` prints the differing cases and exits 1 if any.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

import numpy as np


def _inputs(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    wild = (rng.standard_normal((512, 256)) * 2.0 ** rng.integers(-20, 20, (512, 256)))
    wild = wild.astype(np.float32)
    wild.flat[rng.choice(wild.size, 40, replace=False)] = np.nan
    wild.flat[rng.choice(wild.size, 40, replace=False)] = np.inf
    wild.flat[rng.choice(wild.size, 40, replace=False)] = -0.0
    tiny = (rng.standard_normal((256, 128)) * 1e-38).astype(np.float32)
    normal = rng.standard_normal((512, 256)).astype(np.float32)
    return {"wild": wild, "tiny": tiny, "normal": normal}


def _hash(tree) -> str:
    import jax

    h = hashlib.sha256()
    for a in jax.tree.leaves(tree):
        a = np.asarray(a)
        if a.dtype.itemsize < 1 or a.dtype.name.startswith("float4"):
            a = a.view(np.uint8) if a.dtype.itemsize == 1 else a.astype(np.float32)
        h.update(str(a.dtype).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def run(out: str) -> None:
    import jax
    import jax.numpy as jnp

    import fp4jax

    rec: dict = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
                 "fp4jax": fp4jax.__file__, "cases": {}}
    key = jax.random.key(3)
    for name, x in _inputs().items():
        xj = jnp.asarray(x)
        for fmt in ("NVFP4", "MXFP4"):
            f = getattr(fp4jax, fmt)
            q = jax.jit(lambda a, f=f: fp4jax.quantize(a, f))(xj)
            rec["cases"][f"quantize/{fmt}/{name}"] = _hash((q.data, q.scale, q.global_scale))
            qs = jax.jit(lambda a, k, f=f: fp4jax.quantize(a, f, key=k))(xj, key)
            rec["cases"][f"quantize_sr/{fmt}/{name}"] = _hash((qs.data, qs.scale))
        r = jax.jit(lambda a: fp4jax.random_hadamard_transform(a, 0, 16))(xj)
        rec["cases"][f"rht16/{name}"] = _hash(r)
        if name == "wild":
            continue  # NaN/Inf inputs spread through the GEMMs: quantizers only
        w = jnp.asarray(_inputs(1)["normal"][:256, :128]) * 0.05
        for spec in ("nvfp4", "mxfp4", "quartet2", "fp4_all_the_way", "nvfp4(rht=128)"):
            recipe = fp4jax.recipes.get(spec)

            def loss(a, b, k, recipe=recipe):
                return jnp.sum(fp4jax.dot(a, b, recipe=recipe, key=k) ** 2)

            x2 = xj[:, :256] if xj.shape[1] >= 256 else jnp.tile(xj, (1, 2))
            val, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x2, w, key)
            rec["cases"][f"dot/{spec}/{name}"] = _hash((val, grads))
    with open(out, "w") as f:
        json.dump(rec, f, indent=1)
    print(f"wrote {out}: {len(rec['cases'])} cases on {rec['device']}")


def compare(a: str, b: str) -> int:
    ra, rb = (json.load(open(p)) for p in (a, b))
    diff = [c for c in sorted(set(ra["cases"]) | set(rb["cases"]))
            if ra["cases"].get(c) != rb["cases"].get(c)]
    print(f"{len(ra['cases'])} / {len(rb['cases'])} cases ({ra['device']}, {rb['device']}): "
          f"{len(diff)} differ" + "".join(f"\n  {c}" for c in diff))
    return 1 if diff else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bits_ab.json")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = p.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    run(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
