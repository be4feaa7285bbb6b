"""Data-parallel ``fp4jax.dot`` with the Hopper kernels in ``jax.shard_map`` against one
device, on every local GPU (issue 17 item 4, issue 18): the recipe's forward + backward with
``x`` and ``dy`` split by token rows over a ``("data",)`` mesh inside
``fp4jax.sharding.data_parallel``, compared with the same call on one device.

Per shape (M tokens, K, N; bf16 x, w, cotangent, the NVFP4 recipe: RHT, SR, 2D weights):

* the single-device reference runs ``fp4jax.dot`` on device 0 in a plain ``jit`` (with more
  than one device visible, ``FP4JAX_KERNELS=auto`` keeps that on the XLA path: the
  definition; with one device, the kernels, themselves checked by ``gpu_check.py``);
* the sharded call runs in ``shard_map`` with ``FP4JAX_KERNELS=auto`` (kernels on, as in
  training) and, to separate the kernels' share, ``off`` (the XLA path sharded);
* ``y`` and ``dx`` must be the reference's bits (``mismatches`` counts differing elements);
  ``dw``: each device's bf16 partial product summed in float32, against the reference's
  bf16 ``dw``: max relative error (per-tensor, over the max |dw|) reported, expected at the
  bf16 rounding level (~2^-8);
* ``kernels_in_hlo``: the sharded program holds Mosaic GPU custom calls (the kernels really
  ran);
* wall time (median to ``block_until_ready``) of the sharded forward + backward for kernels
  on and off, and of the one-device forward + backward with the kernels
  (``FP4JAX_KERNELS=on``), section ``one_device``.

    FP4JAX_COMMIT=<sha> PYTHONPATH=$PWD python3 experiments/gpu_sharded_check.py \\
        [--shapes 16384x768x3072 ...] [--out $OUT/gpu_sharded_check.json]

Writes one JSON (``lab.run_info`` and a row per shape and mode) and exits 1 if any ``y``
or ``dx`` differs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import lab  # before fp4jax: puts the repository root on sys.path
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import fp4jax
from fp4jax import sharding

DEFAULT_SHAPES = ("16384x768x3072", "16384x3072x768", "16384x768x768", "8192x2048x2048")


def _shape(text: str) -> tuple[int, int, int]:
    try:
        m, k, n = (int(v) for v in text.lower().split("x"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"shape {text!r}: use MxKxN, e.g. 16384x768x3072"
                                         ) from e
    return m, k, n


def wall_us(f, *args, iterations: int = 30, warmup: int = 3) -> dict:
    """Median wall-clock µs of ``f(*args)`` to ``block_until_ready`` (CUPTI would add up the
    kernels of all devices of a sharded call)."""
    for _ in range(warmup):
        jax.block_until_ready(f(*args))
    us = []
    for _ in range(iterations):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        us.append((time.perf_counter() - t) * 1e6)
    return {"median_us": statistics.median(us), "min_us": min(us), "n": iterations,
            "method": "wallclock"}


def fwd_bwd(recipe, key):
    def f(x, w, ct):
        y, vjp = jax.vjp(lambda x, w: fp4jax.dot(x, w, recipe=recipe, key=key), x, w)
        return (y, *vjp(ct))
    return f


def sharded(mesh, recipe, key):
    f = fwd_bwd(recipe, key)

    def local(x, w, ct):
        with sharding.data_parallel("data"):
            y, dx, dw = f(x, w, ct)
        return y, dx, jax.lax.psum(dw.astype(jnp.float32), "data")

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P(), P("data")),
                                 out_specs=(P("data"), P("data"), P()), check_vma=False))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", type=_shape,
                    default=[_shape(s) for s in DEFAULT_SHAPES])
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None)
    args = ap.parse_args(argv)
    devs = jax.devices()
    if len(devs) < 2:  # the shard_map + kernels program still runs (one shard, offset 0)
        print(f"only {len(devs)} device: a one-device mesh checks the code path, not the "
              "split", file=sys.stderr)
    mesh = Mesh(np.array(devs), ("data",))
    res = lab.Results(args.out or lab.default_out("gpu_sharded_check.json"),
                      lab.run_info(__file__, argv, args.commit))
    recipe, key = fp4jax.recipes.nvfp4(), jax.random.key(7)
    bad = 0
    for m, k, n in args.shapes:
        x, w, ct = lab.dot_problem(m, k, n)
        with lab.kernel_env("auto"):
            ref = jax.jit(fwd_bwd(recipe, key))(*(jax.device_put(a, devs[0]) for a in (x, w, ct)))
            ref = [np.asarray(a, np.float32) for a in ref]
        one = {"m": m, "k": k, "n": n, "devices": 1, "kernels": "on"}
        try:  # the same forward + backward on one device with the kernels, for the speedup
            with lab.kernel_env("on"):
                args1 = [jax.device_put(a, devs[0]) for a in (x, w, ct)]
                one["one_device_fwd_bwd"] = wall_us(jax.jit(fwd_bwd(recipe, key)), *args1)
        except Exception as e:  # noqa: BLE001 (recorded, the run goes on)
            one["error"] = lab.error_text(e)
        res.add("one_device", one)
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        cs = jax.device_put(ct, NamedSharding(mesh, P("data")))
        ws = jax.device_put(w, NamedSharding(mesh, P()))
        for mode in ("auto", "off"):
            row = {"m": m, "k": k, "n": n, "devices": len(devs), "kernels": mode}
            try:
                with lab.kernel_env(mode):
                    f = sharded(mesh, recipe, key)
                    hlo = f.lower(xs, ws, cs).as_text()
                    row["kernels_in_hlo"] = hlo.count("mosaic_gpu")
                    y, dx, dw = (np.asarray(a, np.float32) for a in f(xs, ws, cs))
                    row["y_mismatches"] = lab.mismatches(y, ref[0])
                    row["dx_mismatches"] = lab.mismatches(dx, ref[1])
                    row["dw_max_rel"] = float(np.abs(dw - ref[2]).max() / np.abs(ref[2]).max())
                    row["dw_bf16_mismatch_frac"] = float(np.mean(
                        dw.astype(jnp.bfloat16).astype(np.float32) != ref[2]))
                    row["sharded_fwd_bwd"] = wall_us(f, xs, ws, cs)
                row["ok"] = row["y_mismatches"] == 0 and row["dx_mismatches"] == 0
            except Exception as e:  # noqa: BLE001 (recorded, the run goes on)
                row["error"], row["ok"] = lab.error_text(e), False
            bad += not row["ok"]
            res.add("rows", row)
    res.finish(failed=bad)
    print(f"{bad} failed of {len(res.data.get('rows', []))}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    sys.exit(main())
