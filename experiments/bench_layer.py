"""One linear layer's forward + backward, NVFP4 recipe vs bf16, with bf16 and float32 weights
(issue 17's layer targets).

For each ``M K N`` (default the issue's 16384 x 1024 x 4096, and 16384 x 512 x 2048) it
times with CUPTI (``lab.time_fn``: warm-up, median device time of every kernel of one call)
the ``value_and_grad`` over ``(x, w)`` of ``sum(dot(x, w) * ct)`` (``lab.dot_loss``: the
forward GEMM is kept), x and ct bf16:

* ``bf16``: ``jnp.dot`` of bf16 x and bf16 w (the baseline);
* ``nvfp4 w bf16``: ``fp4jax.dot`` with the NVFP4 recipe, w bf16;
* ``nvfp4 w f32``: the same with float32 w (what a functional user with an f32 master
  copy passes);
* ``nvfp4 w f32->bf16``: float32 w cast to bf16 inside the program, then ``fp4jax.dot``
  (the issue's "bf16 weights plus a cast"; it quantizes the bf16-rounded weight, so its
  numerics differ from ``w f32`` where the f32 weight is quantized directly);
* ``nvfp4 w f32 y bf16``: float32 w, ``preferred_element_type=bfloat16`` (the output and
  so the gradient ``dy`` bf16, as with the cast; the weight quantized from its float32
  values by the 16x16 kernel): the like-for-like comparison with ``w f32->bf16``, whose
  ``y`` is bf16 too (``w f32``'s is float32, so its ``dy`` is twice the bytes).

Ratios are against ``bf16`` of the same shape in the same process. Writes
``$OUT/bench_layer.json`` (``lab.run_info`` first: device, JAX version, commit, command).

    PYTHONPATH=$PWD python3 experiments/bench_layer.py [--shapes M K N [M K N ...]]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import lab  # before fp4jax: puts the repository root on sys.path

DEFAULT_SHAPES = ((16384, 1024, 4096), (16384, 512, 2048))


def _bf16_loss(x, w, ct):
    return (jnp.dot(x, w).astype(jnp.float32) * ct.astype(jnp.float32)).sum()


def variants():
    """``{name: (loss(x, w, ct), weight dtype)}``."""
    nv = lab.dot_loss()
    return {"bf16": (_bf16_loss, jnp.bfloat16),
            "nvfp4 w bf16": (nv, jnp.bfloat16),
            "nvfp4 w f32": (nv, jnp.float32),
            "nvfp4 w f32->bf16": (lambda x, w, ct: nv(x, w.astype(jnp.bfloat16), ct),
                                  jnp.float32),
            "nvfp4 w f32 y bf16": (lab.dot_loss(out_dtype=jnp.bfloat16), jnp.float32)}


def measure(m: int, k: int, n: int, iterations: int) -> dict:
    x, w, ct = lab.dot_problem(m, k, n)
    row: dict = {"shape": [m, k, n]}
    for name, (loss, wdt) in variants().items():
        f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        row[name] = lab.time_fn(f, x, w.astype(wdt), ct, iterations=iterations)
    base = row["bf16"]["median_us"]
    row["vs_bf16"] = {name: round(row[name]["median_us"] / base, 3)
                      for name in variants() if name != "bf16"}
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", type=int, nargs="+", default=None, metavar="M K N",
                    help=f"problems as M K N triples (default: {DEFAULT_SHAPES})")
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    if args.shapes is not None and (len(args.shapes) % 3 or min(args.shapes) < 1):
        ap.error(f"--shapes takes positive M K N triples, got {args.shapes}")
    shapes = (DEFAULT_SHAPES if args.shapes is None else
              [tuple(args.shapes[i:i + 3]) for i in range(0, len(args.shapes), 3)])
    res = lab.run_info(__file__, sys.argv[1:] if argv is None else argv) | {"rows": []}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_layer.json")
    for m, k, n in shapes:
        row = measure(m, k, n, args.iterations)
        res["rows"].append(row)
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        times = ", ".join(f"{name} {row[name]['median_us']:.1f} us" for name in variants())
        print(f"{m}x{k}x{n}: {times}; vs bf16 {row['vs_bf16']}", flush=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
