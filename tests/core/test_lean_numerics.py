"""The lean lowerings of the rounding rules (issue 35/38: compile time) give the same bits as
before and as independent NumPy references:

* ``numerics.round_to_grid(..., "nearest")`` onto E2M1 and E4M3 by XLA's conversions
  (``NATIVE_RNE``) vs a NumPy nearest-value search (ties to the even code) and vs the
  arithmetic path (``native=False``), on every grid value and midpoint and their float32
  neighbours, +-0, float32 subnormals, Inf, NaN payloads, saturation and 2**17 random
  non-negative float32 bit patterns;
* ``numerics.reciprocal_rn`` (float64 path for subnormal quotients) vs exact integer
  rounding of ``2**149 / v`` in Python and vs the integer long division it replaced;
* ``numerics.recip_scaled_subnormal_rn`` (float64 path) vs an exact rational reference and
  vs the integer path it replaced;
* ``quantization.element_encode_scale`` (``div_rn`` per block) vs ``numerics.recip_scaled_rn``
  (the per-tensor table it replaced) and NumPy IEEE float32;
* ``numerics.draws_from_key`` (JAX's Threefry primitive off the CPU) vs the Python transcription
  ``numerics.threefry2x32`` and ``jax.random.bits``.
"""

from __future__ import annotations

from fractions import Fraction

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fp4jax import numerics
from fp4jax import quantization as qz

FLT_MAX = np.float32(np.finfo(np.float32).max)
_BITS = np.uint32


def _grid_values(dtype) -> np.ndarray:
    """Every finite non-negative value of an ml_dtypes type, ascending (float64)."""
    n = 1 << (4 if dtype == ml_dtypes.float4_e2m1fn else 8)
    codes = np.arange(n // 2, dtype=np.uint8)  # sign bit clear
    if dtype == ml_dtypes.float4_e2m1fn:
        vals = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    else:
        vals = codes.view(dtype).astype(np.float64)
    vals = vals[np.isfinite(vals)]
    assert np.all(np.diff(vals) > 0)
    return vals


def np_rne_satfinite(v: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Independent reference: the nearest of ``values`` (ascending, from 0) to each float32
    ``v >= 0``, ties to the even code (the even index: codes increase with the value),
    ``v`` above the largest value (Inf included) saturating to it; NaN returned with its
    quiet bit set (what the arithmetic rounding does to a NaN)."""
    v = np.asarray(v, np.float32)
    nan = np.isnan(v)
    x = np.minimum(np.where(nan, np.float32(0), v).astype(np.float64), values[-1])
    i = np.clip(np.searchsorted(values, x, side="right") - 1, 0, len(values) - 2)
    lo, hi = values[i], values[i + 1]
    dlo, dhi = x - lo, hi - x  # exact: Sterbenz, or lo == 0
    up = (dhi < dlo) | ((dhi == dlo) & (i % 2 == 1))
    out = np.where(up, hi, lo).astype(np.float32)
    out[nan] = (v[nan].view(_BITS) | _BITS(0x400000)).view(np.float32)
    return out


def _interesting(values: np.ndarray, rng) -> np.ndarray:
    """Non-negative float32 inputs: every grid value and midpoint with 3 float32
    neighbours on each side, 0, float32 subnormals, the smallest normals, Inf, NaNs
    (quiet and signalling payloads), values far above the maximum and 2**17 random bit
    patterns with the sign bit clear."""
    pts = np.concatenate([values, (values[:-1] + values[1:]) / 2, [values[-1] * 1.5,
                                                                  values[-1] * 2]])
    pts = pts.astype(np.float32).view(_BITS)
    near = (pts[:, None].astype(np.int64) + np.arange(-3, 4)).ravel()
    near = near[(near >= 0) & (near < 0x7F800000)].astype(_BITS)
    special = np.array([0, 1, 2, 0x7FFFFF, 0x800000, 0x800001, 0x7F7FFFFF, 0x7F800000,
                        0x7F800001, 0x7FA00000, 0x7FC00000, 0x7FFFFFFF], _BITS)
    rand = rng.integers(0, 0x80000000, 1 << 17, dtype=np.int64).astype(_BITS)
    return np.concatenate([near, special, rand]).view(np.float32)


@pytest.mark.parametrize("grid,dtype", [(numerics.E2M1, ml_dtypes.float4_e2m1fn),
                                        (numerics.E4M3, ml_dtypes.float8_e4m3fn)])
def test_native_rne_matches_numpy_and_arithmetic(grid, dtype):
    assert grid in numerics.NATIVE_RNE
    values = _grid_values(dtype)
    assert values[-1] == grid.max_value
    v = _interesting(values, np.random.default_rng(0))
    native = np.asarray(jax.jit(lambda a: numerics.round_to_grid(a, grid, native=True))(v))
    arith = np.asarray(jax.jit(lambda a: numerics.round_to_grid(a, grid))(v))
    want = np_rne_satfinite(v, values)
    assert np.array_equal(native.view(_BITS), want.view(_BITS))
    assert np.array_equal(arith.view(_BITS), want.view(_BITS))
    # -0 keeps its sign, as the arithmetic does
    for nat in (True, False):
        z = np.asarray(numerics.round_to_grid(jnp.float32(-0.0), grid, native=nat))
        assert z.view(_BITS) == _BITS(0x80000000)


@pytest.mark.parametrize("grid,mlir", [(numerics.E2M1, "f4E2M1FN"), (numerics.E4M3, "f8E4M3FN")])
def test_native_rne_is_lowered_for_the_cpu_only(grid, mlir):
    """The native conversion (opt-in, ``native=True``) is used where it was checked
    exhaustively (XLA:CPU); a CUDA lowering keeps the arithmetic (on an H100 the native
    conversions were not bit-exact: experiments/results/kernels/2026-11-27_native_h100, by
    native_rounding_check.py, in git at 4cd04a4); by default neither converts."""
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    for nat in (True, False):
        f = jax.jit(lambda a, nat=nat: numerics.round_to_grid(a, grid, native=nat))
        text = {p: jax.export.export(f, platforms=[p])(x).mlir_module() for p in ("cpu",
                                                                                  "cuda")}
        assert (mlir in text["cpu"]) == nat
        assert mlir not in text["cuda"]


def _exact_rne_int(num: Fraction) -> int:
    """Round a non-negative rational to the nearest integer, ties to even."""
    q, r = divmod(num.numerator, num.denominator)
    twice = 2 * r
    if twice > num.denominator or (twice == num.denominator and q % 2 == 1):
        q += 1
    return q


def _f32_exact(x: np.float32) -> Fraction:
    return Fraction(float(x))


def test_reciprocal_rn_subnormal_quotients():
    """``1 / v`` for ``v`` in ``(2**126, FLT_MAX]`` (subnormal quotients) and around it, vs
    exact rational rounding to the float32 subnormal quantum, and vs the integer long
    division the float64 path replaced."""
    rng = np.random.default_rng(1)
    edge = np.array([2.0**126, 2.0**127, float(FLT_MAX)], np.float32).view(_BITS)
    near = (edge[:, None].astype(np.int64) + np.arange(-4, 5)).ravel()
    near = near[near < 0x7F800000].astype(_BITS)
    rand = rng.integers(0x7E800000, 0x7F800000, 4000, dtype=np.int64).astype(_BITS)
    v = np.concatenate([near, rand]).view(np.float32)
    got = np.asarray(jax.jit(numerics.reciprocal_rn)(jnp.asarray(v))).view(_BITS)
    big = v > np.float32(2.0**126)
    want = np.array([_exact_rne_int(Fraction(2**149) / _f32_exact(x)) for x in v[big]],
                    np.int64)
    assert np.array_equal(got[big].astype(np.int64), want)  # the bits of n * 2**-149
    # the normal quotients are div_rn's (NumPy's IEEE float32 division)
    assert np.array_equal(got[~big], (np.float32(1.0) / v[~big]).view(_BITS))
    vb = jnp.asarray(v[big]).view(jnp.int32)
    integer = jax.jit(numerics.recip_subnormal_integer)(vb, (vb >> 23) & 0xFF)
    assert np.array_equal(np.asarray(integer).astype(np.int64), want)


def _e4m3_all() -> np.ndarray:
    return np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def test_recip_scaled_subnormal_matches_exact_and_integer_path():
    """``min(RN(1 / RN(s * dec)), FLT_MAX)`` with IEEE subnormals, every E4M3 value (both
    signs, NaN) times subnormal decode scales: the float64 path vs an exact rational
    reference (for ``s >= 0``) and vs the integer path it replaced (every ``s``)."""
    rng = np.random.default_rng(2)
    s = _e4m3_all()
    dec_bits = np.concatenate([[1, 2, 3, 0x7FFFFF, 0x400000, 0x400001, 0x3FFFFF],
                               rng.integers(1, 0x800000, 60)]).astype(_BITS)
    dec = dec_bits.view(np.float32)
    S, D = (a.ravel() for a in np.meshgrid(s, dec))
    got = np.asarray(jax.jit(numerics.recip_scaled_subnormal_rn)(jnp.asarray(S),
                                                                  jnp.asarray(D)))
    old = np.asarray(jax.jit(numerics.recip_scaled_subnormal_integer)(jnp.asarray(S),
                                                                      jnp.asarray(D)))
    assert np.array_equal(got.view(_BITS), old.view(_BITS))
    q = Fraction(1, 2**149)
    for sv, dv, g in zip(S, D, got, strict=True):
        if not (sv >= 0):  # negative or NaN s: compared with the integer path above
            continue
        x = Fraction(float(sv)) * int(np.float32(dv).view(_BITS)) * q  # exact s * dec
        if x < Fraction(1, 2**126):
            p = _exact_rne_int(x / q) * q
        else:
            p = Fraction(float(_rn_f32(x)))
        want = FLT_MAX if p == 0 else min(_rn_f32(1 / p), FLT_MAX)
        assert np.float32(g).view(_BITS) == np.float32(want).view(_BITS), (sv, dv)


def _rn_f32(x: Fraction) -> np.float32:
    """The float32 nearest to a positive rational in the normal range (ties to even), Inf
    beyond FLT_MAX's rounding boundary: exact integer arithmetic."""
    e = x.numerator.bit_length() - x.denominator.bit_length()
    if Fraction(2) ** e > x:
        e -= 1
    m = _exact_rne_int(x / Fraction(2) ** (e - 23))  # 24 significant bits, may carry
    val = Fraction(m) * Fraction(2) ** (e - 23)
    if val >= Fraction(2) ** 128:
        return np.float32(np.inf)
    return np.float32(float(val))


def test_element_encode_scale_normal_dec_matches_table_and_numpy():
    """Every E4M3 value (and NaN) times normal scalar decode scales: ``div_rn(1, s * dec)``
    per block vs the per-tensor table ``recip_scaled_rn`` it replaced, and vs NumPy's
    IEEE float32 ``1 / (s * dec)`` wherever the product and the quotient are normal
    float32 numbers (XLA on the CPU flushes subnormal ones; both fp4jax paths alike)."""
    rng = np.random.default_rng(3)
    s = jnp.asarray(_e4m3_all())
    decs = np.concatenate([[2.0**-126, 1.0, 2.0**100, 1 / 2688.0, 3.4e37],
                           rng.uniform(1, 2, 40) * np.exp2(rng.integers(-126, 117, 40))]
                          ).astype(np.float32)
    enc = jax.jit(qz.element_encode_scale)
    table = jax.jit(lambda s, d: jnp.minimum(numerics.recip_scaled_rn(s, d),
                                             jnp.float32(numerics.FLT_MAX)))
    sn = np.asarray(s)
    for d in decs:
        got = np.asarray(enc(s, jnp.float32(d))).view(_BITS)
        assert np.array_equal(got, np.asarray(table(s, jnp.float32(d))).view(_BITS)), d
        with np.errstate(all="ignore"):
            p = sn * d
            want = np.minimum(np.float32(1.0) / p, FLT_MAX)
        # normal products and quotients (XLA:CPU flushes subnormal ones to zero)
        ok = (np.abs(p) >= np.float32(2.0**-126)) & ~(np.abs(want) < np.float32(2.0**-126))
        assert np.array_equal(got[ok], want[ok].view(_BITS)), d


@pytest.mark.parametrize("offset", [None, 4294967290])
def test_draws_from_key_are_the_threefry_transcription(offset):
    """``draws_from_key`` and the Threefry primitive give the Python transcription's bits
    (counters wrapping modulo 2**32 with an offset), and ``jax.random.bits``' (uint64
    draw = (y0, y1))."""
    key = jax.random.key(123)
    n = 1001
    off = None if offset is None else jnp.uint32(offset)
    y0, y1 = jax.jit(lambda k: numerics.draws_from_key(k, n, off))(key)
    k1, k2 = jax.random.key_data(key)
    d = (np.arange(n, dtype=np.uint64) + (offset or 0)).astype(np.uint32)
    d = jnp.asarray(d)
    t0, t1 = numerics.threefry2x32(k1, k2, jnp.zeros_like(d), d)
    assert np.array_equal(np.asarray(y0), np.asarray(t0))
    assert np.array_equal(np.asarray(y1), np.asarray(t1))
    # the primitive (what other backends take; the CPU takes the transcription)
    p0, p1 = jax.jit(numerics.threefry2x32_primitive)(k1, k2, jnp.zeros_like(d), d)
    assert np.array_equal(np.asarray(p0), np.asarray(t0))
    assert np.array_equal(np.asarray(p1), np.asarray(t1))
    if offset is None:
        with jax.enable_x64(True), jax.threefry_partitionable(True):
            b = np.asarray(jax.random.bits(key, (n,), jnp.uint64))
        assert np.array_equal((b >> 32).astype(np.uint32), np.asarray(y0))
        assert np.array_equal((b & 0xFFFFFFFF).astype(np.uint32), np.asarray(y1))


def _narrow_widen_pairs(mlir: str) -> list[str]:
    """SSA names converted float64 -> float32 and then back to float64 in ``mlir``."""
    import re

    narrow = r"(%[\w#]+) = stablehlo\.convert [^\n]*xf64>\) -> tensor<[^\n]*xf32>"
    widen = r"= stablehlo\.convert (%[\w#]+) [^\n]*xf32>\) -> tensor<[^\n]*xf64>"
    narrowed = set(re.findall(narrow, mlir))
    widened = re.findall(widen, mlir)
    return sorted(narrowed & set(widened))


def test_float64_paths_round_to_float32_without_a_convert_pair():
    """A float32 rounding written as ``x.astype(f32).astype(f64)`` is removed by XLA:GPU
    under its default ``xla_allow_excess_precision`` (the encode scales of subnormal decode
    scales came out 1 ulp off in 9% of cases on an H100): the float64 paths must round by
    other means (integer arithmetic on the bits)."""
    s = jnp.asarray(_e4m3_all())
    dec = jnp.float32(2.0**-140)
    for f in (numerics.recip_scaled_subnormal_rn, numerics.reciprocal_rn,
              lambda s, d: numerics.div_rn_f64(s, d)):
        args = (s, dec) if f is not numerics.reciprocal_rn else (s + 1,)
        mlir = jax.jit(f).lower(*args).as_text()
        assert not _narrow_widen_pairs(mlir), f
    # the detector finds the pattern it looks for
    bad = jax.jit(lambda x: x.astype(jnp.float32).astype(jnp.float64) * 2)
    with jax.enable_x64(True):
        assert _narrow_widen_pairs(bad.lower(jnp.zeros(3, jnp.float64)).as_text())


def test_exact_float32_is_the_widening_of_every_bf16_and_f16_value():
    """``numerics.exact_float32`` gives the float32 value of every bfloat16 and float16 bit
    pattern (subnormals, infinities, signed zeros; NaN stays NaN), and float32 unchanged."""
    import ml_dtypes

    for dt in (ml_dtypes.bfloat16, np.float16):
        v = np.arange(2**16, dtype=np.uint16).view(dt)
        got = np.asarray(jax.jit(numerics.exact_float32)(jnp.asarray(v)))
        want = v.astype(np.float32)
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan)
        assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    x = jnp.asarray(np.random.default_rng(0).standard_normal(64).astype(np.float32))
    assert numerics.exact_float32(x) is x


def test_operands_cast_in_program_keep_their_bf16_rounding():
    """A float32 weight cast to bfloat16 inside the jitted program and read by fp4jax's
    quantizers (XLA path), amax and RHT is read through ``numerics.exact_float32``: its
    lowering holds a ``reduce_precision`` to bfloat16's bits, which still rounds where XLA:GPU
    removes the convert pair under ``xla_allow_excess_precision`` (on an H100 90% of such a
    weight's quantized values differed before; excess_precision_check.py at commit c59dead)."""
    import fp4jax
    from fp4jax import hadamard, quantization

    w = jnp.asarray(np.random.default_rng(1).standard_normal((64, 32)).astype(np.float32))
    x = jnp.asarray(np.random.default_rng(2).standard_normal((16, 64)).astype(np.float32))
    r = fp4jax.recipes.nvfp4()
    key = jax.random.key(0)
    cases = {
        "quantize 2d": lambda w: fp4jax.quantize(w.astype(jnp.bfloat16), fp4jax.NVFP4,
                                                 block_2d=True).data,
        "quantize 1d": lambda w: fp4jax.quantize(w.astype(jnp.bfloat16), fp4jax.MXFP4).data,
        "row scaled": lambda w: fp4jax.quantize(w.astype(jnp.bfloat16), fp4jax.NVFP4,
                                                row_scaled=True).data,
        "amax": lambda w: quantization.finite_amax(w.astype(jnp.bfloat16)),
        "rht": lambda w: hadamard.random_hadamard_transform(w.astype(jnp.bfloat16), axis=0),
        "dot grads": lambda w: jax.grad(lambda v: jnp.sum(fp4jax.dot(
            x.astype(jnp.bfloat16), v.astype(jnp.bfloat16), recipe=r, key=key
        ).astype(jnp.float32)))(w),
    }
    rp = "stablehlo.reduce_precision"
    for name, f in cases.items():
        mlir = jax.jit(f).lower(w).as_text()
        assert f"{rp} " in mlir and "format = e8m7" in mlir, name
    # float32 operands need none
    assert rp not in jax.jit(lambda w: fp4jax.quantize(w, fp4jax.NVFP4).data).lower(w).as_text()
