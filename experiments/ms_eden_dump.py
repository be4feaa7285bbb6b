"""fp4jax side of the MS-EDEN comparison (issue 20): runs the protocol of
``tests/recipes/test_quartet2.py::test_ms_eden_is_unbiased_over_random_rotations`` (the same x, the
same 4096 keys, the same RHT signs and quantize keys) with ``fp4jax.quantize(...,
rounding="ms_eden")`` and writes, per key, every intermediate that the Quartet II reference
(``quartet2_reference.py``, run in a separate torch venv) is compared on:

  x (2, 256), signs (K, 128), xr = rotated x (K, 2, 256), amax (K,), u = the block uniforms
  fp4jax used (K, 2, 16), dec (K,), s_rn = block scales before the correction (K, 2, 16),
  c = the EDEN correction (K, 2, 2), sc = s_rn * c before the stochastic rounding (K, 2, 16),
  q = E2M1 elements (K, 2, 256), s = final block scales (K, 2, 16), deq = dequantized
  rotated values (K, 2, 256), back = H^T deq in the original basis (K, 2, 256).

The intermediates are read from the library's own ``ms_eden`` (called through
``fp4jax.quantization.quantize_unchecked``, the body of ``fp4jax.quantize`` without its inner jit,
checked bit for bit against ``fp4jax.quantize`` on every key) by wrapping three
``fp4jax.numerics`` functions while it is traced (no library file is changed):
``round_to_grid`` on the E4M3 grid (s_rn), ``div_rn`` of shape ``(..., groups)`` (c) and
``stochastic_round_to_grid`` (its argument sc and uniforms u).

Run from the repository root with the project's venv (the results of issue 20's run are in
``experiments/results/numerics/2026-11-25_ms_eden_vs_quartet2_cpu/``):

    PYTHONPATH=$PWD python3 experiments/ms_eden_dump.py --out /tmp/ms_eden_fp4jax.npz
"""

from __future__ import annotations

import argparse
import contextlib
import json

import jax
import jax.numpy as jnp
import numpy as np

import fp4jax
from fp4jax import numerics, quantization
from fp4jax.hadamard import hadamard_matrix

D = 256
H = hadamard_matrix(128).astype(np.float32)


def x_of_test() -> jax.Array:
    """``tests/recipes/test_quartet2.py::_x``: a fixed heavy-tailed (2, 256) tensor."""
    k1, k2 = jax.random.split(jax.random.key(0))
    return jax.random.normal(k1, (2, D)) * jnp.exp(jax.random.normal(k2, (2, D)))


@contextlib.contextmanager
def captured(store: dict):
    """Wrap the numerics functions ``ms_eden`` calls; record the traced values in ``store``."""
    orig = (numerics.round_to_grid, numerics.div_rn, numerics.stochastic_round_to_grid)

    def round_to_grid(v, grid, mode, *a, **k):
        out = orig[0](v, grid, mode, *a, **k)
        if grid is numerics.E4M3 and mode == "nearest":
            store["s_rn_raw"] = out
        return out

    def div_rn(a, b):
        out = orig[1](a, b)
        store.setdefault("div", []).append(out)
        return out

    def sr(v, grid, u):
        store["sc"], store["u"] = v, u
        return orig[2](v, grid, u)

    numerics.round_to_grid, numerics.div_rn, numerics.stochastic_round_to_grid = (
        round_to_grid, div_rn, sr)
    try:
        yield
    finally:
        numerics.round_to_grid, numerics.div_rn, numerics.stochastic_round_to_grid = orig


def one(k, x):
    """One key of the test's protocol, with the intermediates."""
    h = jnp.asarray(H)
    ks, kq = jax.random.split(k)
    s = jax.random.rademacher(ks, (128,), jnp.float32)
    xr = ((x.reshape(2, D // 128, 128) * s) @ h).reshape(2, D)
    q = fp4jax.quantize(xr, rounding="ms_eden", key=kq)  # the public path
    store: dict = {}
    with captured(store):  # its traced body, without quantize's inner jit, for the values
        q2 = quantization.quantize_unchecked(xr, kq, fp4jax.NVFP4, -1, False, "ms_eden",
                                         eden_group=128)
    deq = fp4jax.dequantize(q)
    back = ((deq.reshape(2, D // 128, 128) @ h) * s).reshape(2, D)
    ng = (2, D // 128)
    c = [d for d in store["div"] if d.shape == ng][-1]  # c = div_rn(num, den)
    s_rn = store["s_rn_raw"]
    s_rn = jnp.where(s_rn == 0, jnp.float32(1.0), s_rn)  # ms_eden: s = 1 where 0
    same = (jnp.all(q2.data.astype(jnp.float32) == q.data.astype(jnp.float32))
            & jnp.all(q2.scale.astype(jnp.float32) == q.scale.astype(jnp.float32))
            & (q2.global_scale == q.global_scale))
    return dict(same_as_public=same, signs=s, xr=xr, amax=jnp.max(jnp.abs(xr)),
                u=store["u"].reshape(2, -1),
                dec=q.global_scale, s_rn=s_rn.reshape(2, -1), c=c,
                sc=store["sc"].reshape(2, -1), q=q.data.astype(jnp.float32),
                s=q.scale.astype(jnp.float32), deq=deq, back=back)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/ms_eden_fp4jax.npz")
    ap.add_argument("--keys", type=int, default=4096)
    a = ap.parse_args()
    x = x_of_test()
    keys = jax.random.split(jax.random.key(1), a.keys)  # the test's keys
    res = jax.jit(jax.vmap(lambda k: one(k, x)))(keys)
    res = {k: np.asarray(v) for k, v in res.items()}
    xn = np.asarray(x)
    mean = res["back"].mean(0)
    se = res["back"].std(0) / np.sqrt(a.keys)
    shrink = float(np.sum(mean * xn) / np.sum(xn * xn) - 1)
    z = float(np.sqrt(np.mean(((mean - xn) / se) ** 2)))
    assert res["same_as_public"].all(), "the traced body differs from fp4jax.quantize"
    np.savez_compressed(a.out, x=xn, **res)
    print(json.dumps(dict(jax=jax.__version__, keys=a.keys, shrink=shrink, z=z, out=a.out)))


if __name__ == "__main__":
    main()
