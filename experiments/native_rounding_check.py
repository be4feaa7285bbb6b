"""On the device: the lean lowerings of the quantizer rules (issue 35's compile time) give the
same bits as the code they replaced, on the backend JAX runs on (a GPU: the CPU's own run is
``tests/core/test_lean_numerics.py``, and was exhaustive for the conversions).

    PYTHONPATH=$PWD python3 experiments/native_rounding_check.py --out $OUT/native_rounding.json

Checks (mismatching bit patterns are counted, a few examples kept):

* ``round_e2m1``, ``round_e4m3``: XLA's conversion to ``float4_e2m1fn`` /
  ``float8_e4m3fn`` of ``min(v, max)`` (``round_to_grid(..., native=True)``'s rule, which
  ``numerics`` runs on the CPU only) vs the arithmetic rounding ``round_to_grid(v,
  grid)`` on this device, for every non-negative float32 bit pattern (2**31, NaNs and Inf
  included; ``--quick``: 2**24 spread over them);
* ``encode_scale``: ``quantization.element_encode_scale(s, dec)`` (``div_rn(1, s * dec)``
  per block) vs ``numerics.recip_scaled_rn`` (the table it replaced) for every E4M3 value
  and NaN times ``--decs`` normal decode scales;
* ``reciprocal_rn``: the float64 path vs the integer long division for every float32 in
  ``[2**126, 2**128)`` (2**24 values);
* ``recip_scaled_subnormal``: the float64 path vs the integer path for every E4M3 value
  (both signs) times every subnormal decode scale (2**23; ``--quick``: 2**16);
* ``draws``: ``numerics.draws_from_key`` (JAX's Threefry primitive off the CPU) vs the Python
  transcription ``numerics.threefry2x32``, under both GPU lowerings of the primitive
  (``jax_threefry_gpu_kernel_lowering`` on and off), with and without a wrapping offset.

Writes ``lab.run_info`` then one record per check (``mismatches`` 0 everywhere is the
pass); exits 1 if any check mismatched.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import lab  # noqa: E402  (puts the repository root on sys.path)
import ml_dtypes
import numpy as np

from fp4jax import numerics
from fp4jax import quantization as qz

U32 = np.uint32


def _diff(a, b, inputs, limit: int = 5) -> tuple[int, list]:
    a, b = np.asarray(a).view(U32).ravel(), np.asarray(b).view(U32).ravel()
    bad = np.nonzero(a != b)[0]
    ex = [[int(inputs[i]) if np.ndim(inputs) == 1 else str(inputs[i]), int(a[i]), int(b[i])]
          for i in bad[:limit]]
    return int(bad.size), ex


def check_round(grid, quick: bool) -> dict:
    def native(b):  # numerics' native rounding as it would run here (it is CPU-only now)
        v = jax.lax.bitcast_convert_type(b, jnp.float32)
        r = jnp.minimum(v, jnp.float32(grid.max_value)).astype(numerics.NATIVE_RNE[grid])
        quiet = jax.lax.bitcast_convert_type(b | jnp.uint32(0x400000), jnp.float32)
        return jnp.where(v != v, quiet, r.astype(jnp.float32))

    new = jax.jit(native)
    old = jax.jit(lambda b: numerics.round_to_grid(jax.lax.bitcast_convert_type(b, jnp.float32),
                                                   grid))
    chunk, step = (1 << 20, 1 << 11) if quick else (1 << 26, 1)  # quick: every 2048th
    total, bad, examples = 0, 0, []
    for start in range(0, 1 << 31, chunk * step):
        b = jnp.arange(0, chunk, dtype=jnp.uint32) * U32(step) + U32(start)
        n, ex = _diff(new(b), old(b), np.asarray(b))
        total += chunk
        bad += n
        examples += ex[: 5 - len(examples)]
    return {"values": total, "mismatches": bad, "examples": examples}


def check_encode_scale(n_decs: int) -> dict:
    rng = np.random.default_rng(0)
    s = jnp.asarray(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
                    .astype(np.float32))
    decs = np.concatenate([[2.0**-126, 1.0, 1 / 2688.0, 2.0**116],
                           rng.uniform(1, 2, n_decs) * np.exp2(rng.integers(-126, 117, n_decs))
                           ]).astype(np.float32)
    new = jax.jit(jax.vmap(qz.element_encode_scale, in_axes=(None, 0)))
    old = jax.jit(jax.vmap(lambda s, d: jnp.minimum(numerics.recip_scaled_rn(s, d),
                                                    jnp.float32(numerics.FLT_MAX)),
                           in_axes=(None, 0)))
    d = jnp.asarray(decs)
    n, ex = _diff(new(s, d), old(s, d), np.repeat(decs.view(U32), 256))
    return {"values": int(decs.size * 256), "mismatches": n, "examples": ex}


def check_reciprocal() -> dict:
    b = jnp.arange(0x7E800000, 0x7F800000, dtype=jnp.uint32)  # [2**126, 2**128)
    v = jax.lax.bitcast_convert_type(b, jnp.float32)
    new = jax.jit(numerics.reciprocal_rn)(v)

    def old(v):
        vb = jax.lax.bitcast_convert_type(v, jnp.int32)
        field = (vb >> 23) & 0xFF
        big = (field >= 253) & (field < 255) & (vb > 0)
        sub = jax.lax.bitcast_convert_type(numerics.recip_subnormal_integer(vb, field),
                                           jnp.float32)
        return jnp.where(big, sub, numerics.div_rn(jnp.float32(1.0), v))

    n, ex = _diff(new, jax.jit(old)(v), np.asarray(b))
    return {"values": int(b.size), "mismatches": n, "examples": ex}


def check_recip_scaled_subnormal(quick: bool) -> dict:
    s = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    new = jax.jit(numerics.recip_scaled_subnormal_rn)
    old = jax.jit(numerics.recip_scaled_subnormal_integer)
    n_dec = 1 << (16 if quick else 23)
    chunk = min(n_dec, 1 << 15)
    bad, examples = 0, []
    stride = (1 << 23) // n_dec
    for start in range(0, n_dec, chunk):
        idx = jnp.arange(start, start + chunk, dtype=jnp.uint32)
        d = jax.lax.bitcast_convert_type(idx * U32(stride), jnp.float32)  # subnormals, 0
        S, D = jnp.meshgrid(jnp.asarray(s), d)
        n, ex = _diff(new(S, D), old(S, D), np.asarray(D).view(U32).ravel())
        bad += n
        examples += ex[: 5 - len(examples)]
    return {"values": int(256 * n_dec), "mismatches": bad, "examples": examples}


def check_draws() -> dict:
    out = {}
    n = 1 << 22
    for kernel in (True, False):
        jax.config.update("jax_threefry_gpu_kernel_lowering", kernel)
        jax.clear_caches()
        for offset in (None, 4294900000):
            key = jax.random.key(2026)
            off = None if offset is None else jnp.uint32(offset)
            y0, y1 = jax.jit(lambda k, off: numerics.draws_from_key(k, n, off))(key, off)
            k1, k2 = jax.random.key_data(key)
            d = jnp.arange(n, dtype=jnp.uint32) + jnp.uint32(offset or 0)
            t0, t1 = jax.jit(lambda k1, k2, d: numerics.threefry2x32(
                k1, k2, jnp.zeros_like(d), d))(k1, k2, d)
            n0, _ = _diff(y0, t0, np.asarray(d))
            n1, _ = _diff(y1, t1, np.asarray(d))
            out[f"kernel={kernel},offset={offset}"] = n0 + n1
    return {"values": 4 * 2 * (1 << 22), "mismatches": sum(out.values()), "by_case": out}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = lab.arg_parser(__doc__, "native_rounding.json", "check",
                        "checks to run (default: all)")
    ap.add_argument("--quick", action="store_true", help="a sample of the exhaustive sets")
    ap.add_argument("--decs", type=int, default=20000, help="decode scales for encode_scale")
    a = ap.parse_args(argv)
    names = ["round_e2m1", "round_e4m3", "encode_scale", "reciprocal_rn",
             "recip_scaled_subnormal", "draws"]
    if a.list:
        print("\n".join(names))
        return 0
    out = a.out or lab.default_out("native_rounding.json")
    res = lab.Results(out, lab.run_info(__file__, argv, a.commit))
    checks = {
        "round_e2m1": lambda: check_round(numerics.E2M1, a.quick),
        "round_e4m3": lambda: check_round(numerics.E4M3, a.quick),
        "encode_scale": lambda: check_encode_scale(a.decs),
        "reciprocal_rn": check_reciprocal,
        "recip_scaled_subnormal": lambda: check_recip_scaled_subnormal(a.quick),
        "draws": check_draws,
    }
    failed = False
    assert list(checks) == names
    for name in a.names or names:
        t = time.perf_counter()
        try:
            rec = {"check": name, **checks[name]()}
        except Exception as e:  # noqa: BLE001  (record it, run the rest)
            rec = {"check": name, "error": lab.error_text(e), "mismatches": None}
        rec["seconds"] = round(time.perf_counter() - t, 2)
        failed |= rec["mismatches"] != 0
        res.add("results", rec)
    res.finish()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
