"""Element formats beyond E2M1 (OCP MX v1.0: MXFP8 E4M3/E5M2, MXFP6 E2M3/E3M2) and IEEE-style
block scales (issue 20, items 3 and 6), against the independent NumPy reference
(``tests/reference.py``: grids enumerated from bit codes and cross-checked with ml_dtypes),
the exactness of the GEMM emulation against float64, the new recipes through ``fp4jax.dot``
and ``jax.grad``, and the dispatcher's XLA fallback for non-E2M1 formats.

Shapes are small and every format's inputs are stacked into one tensor (blocks of MX
formats are independent), so each case compiles once.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp4jax
from fp4jax import backends as B
from fp4jax import formats as F
from fp4jax import numerics

# the modules (``fp4jax.quantize`` and ``fp4jax.dot`` are the package's functions)
from fp4jax import quantization as qz
from fp4jax import recipes as R
from pallas_kernels import dispatch, dot_sm90
from tests import reference as ref
from tests.checks import bits_equal, dequantized, recipe_grads

F32 = np.float32
TINY = 2.0**-126
FTZ = jax.default_backend() == "cpu"  # XLA on CPU flushes float32 subnormal results
ELEMS = [(2, 1), (2, 3), (3, 2), (4, 3), (5, 2)]
MX_NEW = [F.MXFP8_E4M3, F.MXFP8_E5M2, F.MXFP6_E2M3, F.MXFP6_E3M2, F.MXFP8_E4M3_UP,
          F.MXFP8_E5M2_UP, F.MXFP6_E2M3_UP, F.MXFP6_E3M2_UP]


def _stack_inputs(width: int = 80) -> np.ndarray:
    """Rows of every regime, one tensor (40, ``width``): Gaussian, heavy-tailed, outliers,
    tiny (1e-30, 1e-36), huge (1e30), mixed magnitudes, zero rows, a row zero but for its
    last partial block. ``width`` 80 leaves a partial block of 16 (blocks of 32); 40 rows
    a partial block along axis 0."""
    r = np.random.default_rng(20)
    rows = [r.standard_normal((6, width)),
            r.standard_t(2.0, (6, width)),
            np.where(r.random((6, width)) < 0.05, 300.0, 1.0) * r.standard_normal((6, width)),
            1e-30 * r.standard_normal((4, width)),
            1e-36 * r.standard_normal((2, width)),
            1e30 * r.standard_normal((4, width)),
            r.standard_normal((6, width)) * 10.0 ** r.integers(-12, 12, (6, width)),
            np.zeros((4, width))]
    last = np.zeros((2, width))
    last[:, -(width % 32 or 16):] = r.standard_normal((2, width % 32 or 16))
    return np.concatenate(rows + [last]).astype(F32)


INPUTS = _stack_inputs()


def _round_fixed(v: np.ndarray, grid, n: int = 4608) -> np.ndarray:
    """``numerics.round_to_grid`` of ``v`` padded to ``n`` values: one shape for every grid,
    so that the eager primitives compile once for all the parametrized cases."""
    pad = np.zeros(n, F32)
    pad[: len(v)] = v
    return np.asarray(numerics.round_to_grid(jnp.asarray(pad), grid, "nearest"))[: len(v)]


def _deq_equal(got, want):
    """Dequantized values equal, except that XLA on CPU flushes float32 subnormal results
    (|value| < 2**-126: an FP8/FP6 subnormal element times a tiny scale) to zero."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    if FTZ:
        sub = np.abs(want) < TINY
        assert np.all((got[sub] == 0) | (got[sub] == want[sub]))
        got, want = got[~sub], want[~sub]
    bits_equal(got, want)


def _ref(x, fmt, axis=-1, block_2d=False, sr_key_words=None):
    """The NumPy reference of ``quantize(x, fmt)``. On CPU, float32 subnormal inputs are
    flushed to zero first, as XLA there does (the FP8/FP6 subnormal elements of a block of
    ~1e-36 values can hold them; E2M1 rounds them to zero anyway)."""
    x = np.asarray(x, F32)
    if FTZ:
        x = np.where(np.abs(x) < TINY, np.copysign(F32(0), x), x).astype(F32)
    return ref.ref_quantize(x, fmt.scale_exp_bits, fmt.scale_man_bits, fmt.block_size,
                            fmt.tensor_scale, fmt.scale_rule, axis, block_2d,
                            sr_key_words=sr_key_words,
                            elem=(fmt.elem_exp_bits, fmt.elem_man_bits),
                            scale_ieee=fmt.scale_ieee)


def _check(x, fmt, axis=-1, block_2d=False):
    q = fp4jax.quantize(jnp.asarray(x), fmt, axis=axis, block_2d=block_2d)
    rq, rs, rdec = _ref(x, fmt, axis, block_2d)
    assert q.data.dtype == fmt.data_dtype and q.data.shape == np.shape(x)
    assert q.scale.dtype == fmt.scale_dtype
    bits_equal(q.data.astype(jnp.float32), rq)
    bits_equal(q.scale.astype(jnp.float32), rs)
    assert np.float32(q.global_scale) == rdec
    _deq_equal(fp4jax.dequantize(q), ref.ref_dequantize(rq, rs, rdec, fmt.block_size, axis,
                                                        block_2d))
    return q


# ----------------------------------------------------------------------------- grids


@pytest.mark.parametrize("elem", ELEMS, ids=lambda e: f"e{e[0]}m{e[1]}")
def test_element_grids_and_rne_are_ml_dtypes(elem):
    """Each element grid is the ml_dtypes dtype's (the reference enumerates it from bit
    codes and checks it against ml_dtypes at import), and RNE onto it equals the reference's
    nearest-code rounding and ml_dtypes' cast after clamping to the max (saturation):
    random values over the whole range, every tie (midpoint), zero, the max, beyond it,
    Inf."""
    g = numerics.element_grid(*elem)
    want = ref.ELEM_GRIDS[elem]
    assert (g.max_value, g.min_value) == (want[-1], want[1])
    assert g.max_exp == int(np.floor(np.log2(want[-1])))  # OCP MX emax: 2, 2, 4, 8, 15
    r = np.random.default_rng(sum(elem))
    lo, hi = np.log2(want[1]) - 2, np.log2(want[-1]) + 2
    v = np.concatenate([np.exp2(r.uniform(lo, hi, 4000)), want, (want[1:] + want[:-1]) / 2,
                        [want[1] / 2, want[1] * 0.49, want[-1] * 1.03, 3 * want[-1], 1e30,
                         np.inf]]).astype(F32)
    got = _round_fixed(v, g)
    np.testing.assert_array_equal(got, ref.round_nearest(v, want))
    np.testing.assert_array_equal(got, ref.round_elem_saturating_ml_dtypes(v, elem))


def test_element_grid_errors_and_constants():
    assert numerics.E5M2.max_value == 57344 and numerics.E5M2.specials == "ieee"
    assert numerics.E2M3.max_value == 7.5 and numerics.E3M2.max_value == 28
    with pytest.raises(ValueError, match=r"E3M3 is not an OCP MX element format; valid .*"
                                         r"\(4, 3\) E4M3"):
        numerics.element_grid(3, 3)


@pytest.mark.parametrize("e,m", [(e, m) for e in range(1, 9) for m in range(0, 8)
                                 if e + m <= 8 and not (e == 1 and m == 0)])
def test_ieee_scale_grids_equal_the_enumeration(e, m):
    """``unsigned_grid(ieee=True)`` is the grid of ExMy codes minus the all-ones exponent
    field (IEEE 754): max, min and every value, for every scale format of the sweeps; ExM0
    grids coincide with the ``fn`` ones; E5M2 is ml_dtypes' ``float8_e5m2``."""
    g = numerics.unsigned_grid(e, m, ieee=True)
    want = ref.grid_values(e, m, nan_code=True, ieee=True)
    assert g.max_value == want[-1] and g.min_value == want[1 if m else 0]
    # Every value is on the grid, and nothing lies between them (midpoints: ties). Values
    # >= 2**127 (E8M0's top) are left out: their inverse quantum 2**-127 is a float32
    # subnormal that XLA on CPU flushes; a block scale never gets there (the block amax is
    # divided by the element max, >= 6, before rounding).
    want = want[want < 2.0**127]
    mids = ((want[1:] + want[:-1]) / 2).astype(F32)
    got = _round_fixed(np.concatenate([want, mids]).astype(F32), g)
    np.testing.assert_array_equal(got[: len(want)], want.astype(F32))
    np.testing.assert_array_equal(got[len(want):], ref.round_nearest(mids, want,
                                                                      ties_up=(m == 0)))
    if m == 0:
        fn = numerics.unsigned_grid(e, m)
        assert (g.max_value, g.min_exp) == (fn.max_value, fn.min_exp)


def test_ieee_scale_maxima():
    assert numerics.unsigned_grid(5, 2, ieee=True).max_value == 57344  # fn: 98304
    assert numerics.unsigned_grid(5, 2).max_value == 98304
    assert numerics.unsigned_grid(4, 3, ieee=True).max_value == 240  # fn: 448
    assert numerics.unsigned_grid(3, 4, ieee=True).max_value == 15.5
    assert numerics.unsigned_grid(1, 6, ieee=True).max_value == 63 / 32  # subnormals only
    e5m2 = np.arange(128, dtype=np.uint8).view(ml_dtypes.float8_e5m2).astype(np.float64)
    np.testing.assert_array_equal(ref.grid_values(5, 2, True, ieee=True),
                                  e5m2[np.isfinite(e5m2)])
    with pytest.raises(ValueError, match="ieee=True"):
        numerics.unsigned_grid(5, 2, has_nan_code=False, ieee=True)


# ----------------------------------------------------------------------------- quantize


@pytest.mark.parametrize("fmt", MX_NEW, ids=lambda f: f.name)
def test_mx_formats_bit_exact(fmt):
    """MXFP8/MXFP6 (OCP scale rule and rounded-up scale) against the NumPy reference, along
    either axis, partial blocks, zeros, tiny and huge values; and one 2D case."""
    _check(INPUTS, fmt, axis=-1)
    _check(INPUTS, fmt, axis=0)
    _check(INPUTS[:24, :48], fmt, block_2d=True)


TWO_LEVEL = [
    fp4jax.BlockFormat("nvfp8-e4m3", 16, elem_exp_bits=4, elem_man_bits=3),
    fp4jax.BlockFormat("nv-e5m2", 16, elem_exp_bits=5, elem_man_bits=2),
    fp4jax.BlockFormat("nv-e2m3-up", 16, scale_rule="up", elem_exp_bits=2, elem_man_bits=3),
    fp4jax.BlockFormat("e3m2-e8m0-ts", 32, 8, 0, True, "ocp", elem_exp_bits=3,
                       elem_man_bits=2),
    fp4jax.BlockFormat("e4m3-e3m4", 16, 3, 4, False, "nearest", 4, 3),
]


@pytest.mark.parametrize("fmt", TWO_LEVEL, ids=lambda f: f.name)
def test_two_level_scaling_with_other_elements_bit_exact(fmt):
    """NVFP4's two-level scaling with FP8/FP6 elements: the tensor amax maps to
    ``tensor_scale_target * elem_max`` and each block amax to ``elem_max``."""
    q = _check(INPUTS, fmt, axis=-1)
    if fmt.tensor_scale:
        amax = np.abs(INPUTS).max()
        want = F32(1) / F32(F32(fmt.tensor_scale_target * fmt.elem_max) / F32(amax))
        assert np.float32(q.global_scale) == want


IEEE_SWEEP = [fp4jax.BlockFormat(f"e{e}m{m}-ieee-{rule}", 16, e, m, True, rule,
                                 scale_ieee=True)
              for (e, m) in [(1, 6), (2, 5), (3, 4), (4, 3), (5, 2), (6, 1), (8, 0)]
              for rule in (["nearest", "up"] if m else ["nearest", "ocp"])]


@pytest.mark.parametrize("fmt", IEEE_SWEEP, ids=lambda f: f.name)
def test_ieee_scale_sweep_bit_exact(fmt):
    """FP4-all-the-way's scale-format sweep (E1M6 .. E8M0, NVFP4 elements, blocks of 16, a
    tensor scale) with IEEE-convention scales, bit for bit; E5M2 and E4M3 scales stay
    below 57,344 and 240. (Rows 22-23, ~1e-38 after the 0.01, are left out: there the
    float32 block-scale value itself is subnormal, which XLA on CPU flushes.)"""
    q = _check(INPUTS[:22] * 0.01, fmt)
    assert float(jnp.nanmax(q.scale.astype(jnp.float32))) <= fmt.scale_max
    if (fmt.scale_exp_bits, fmt.scale_man_bits) in ((5, 2), (4, 3)):
        assert fmt.scale_max == {5: 57344, 4: 240}[fmt.scale_exp_bits]


@pytest.mark.parametrize("fmt", [F.MXFP8_E4M3, F.MXFP8_E5M2_UP, F.MXFP6_E2M3, TWO_LEVEL[0]],
                         ids=lambda f: f.name)
def test_non_finite_blocks_dequantize_to_nan(fmt):
    """As for E2M1: a block holding NaN/Inf gets a NaN scale and dequantizes to NaN
    (elements are never Inf/NaN: they saturate); the others are quantized as if the bad
    values were absent."""
    x = np.random.default_rng(1).standard_normal((8, 64)).astype(F32)
    x[1, 3], x[4, 40], x[6, 63] = np.nan, np.inf, -np.inf
    q = fp4jax.quantize(jnp.asarray(x), fmt)
    data = np.asarray(q.data.astype(jnp.float32))
    assert np.isfinite(data).all()
    d = np.asarray(fp4jax.dequantize(q))
    b = fmt.block_size
    bad = np.zeros_like(d, bool)
    for r, c in ((1, 3), (4, 40), (6, 63)):
        bad[r, c // b * b:(c // b + 1) * b] = True
    assert np.isnan(d[bad]).all() and np.isfinite(d[~bad]).all()
    x2 = np.where(np.isfinite(x), x, 0).astype(F32)
    d2 = np.asarray(fp4jax.dequantize(fp4jax.quantize(jnp.asarray(x2), fmt)))
    np.testing.assert_array_equal(d[~bad], d2[~bad])
    rq, rs, _ = _ref(x, fmt)
    bits_equal(q.data.astype(jnp.float32), rq)
    bits_equal(q.scale.astype(jnp.float32), rs)


def test_ocp_rule_saturates_and_up_rule_does_not():
    """OCP MX sec. 6.3 maps a block amax to [2**emax, 2**(emax+1)): above the element max it
    saturates (E4M3: 480 -> 448 at scale 1); the rounded-up scale keeps it (2 * 240)."""
    x = jnp.zeros((1, 32)).at[0, 0].set(480.0).at[0, 1].set(1.0)
    q = fp4jax.quantize(x, F.MXFP8_E4M3)
    assert float(q.scale[0, 0].astype(jnp.float32)) == 1.0
    assert float(q.data[0, 0].astype(jnp.float32)) == 448.0
    q = fp4jax.quantize(x, F.MXFP8_E4M3_UP)
    assert float(q.scale[0, 0].astype(jnp.float32)) == 2.0
    assert float(fp4jax.dequantize(q)[0, 0]) == 480.0


# ----------------------------------------------------------------------------- SR


@pytest.mark.parametrize("fmt,axis,block_2d", [
    (F.MXFP8_E4M3_UP, -1, False), (F.MXFP8_E5M2, 0, False), (F.MXFP6_E2M3, -1, False),
    (F.MXFP6_E3M2_UP, None, True), (TWO_LEVEL[0], -1, False)], ids=lambda v: str(v)[:20])
def test_sr_bit_exact_against_numpy(fmt, axis, block_2d):
    """Stochastic rounding onto the FP8/FP6 grids equals the NumPy reference (independent
    Threefry, the documented byte rule, its own neighbour search)."""
    x = INPUTS[:12, :48]
    key = jax.random.key(7)
    k1, k2 = (int(v) for v in np.asarray(jax.random.key_data(key)))
    ax = -1 if block_2d else axis
    q = fp4jax.quantize(jnp.asarray(x), fmt, axis=ax, block_2d=block_2d,
                        rounding="stochastic", key=key)
    rq, rs, _ = _ref(x, fmt, ax, block_2d, sr_key_words=(k1, k2))
    bits_equal(q.data.astype(jnp.float32), rq)
    bits_equal(q.scale.astype(jnp.float32), rs)
    rtn, _, _ = _ref(x, fmt, ax, block_2d)
    assert np.sum(rq != rtn) > 20  # the random bits matter


@pytest.mark.parametrize("fmt", [F.MXFP8_E4M3_UP, F.MXFP6_E3M2_UP], ids=lambda f: f.name)
def test_sr_is_unbiased_over_keys(fmt):
    """Over 4000 keys the mean of the SR draws is each element (the rounded-up scale never
    saturates), within 5 standard errors plus the lattice's 2**-9 of a grid step; RtN's
    error on the same data is far larger."""
    r = np.random.default_rng(4)
    x = jnp.asarray(r.standard_normal((4, 32)) * np.exp(r.uniform(-3, 3, (4, 1))), jnp.float32)
    keys = jax.random.split(jax.random.key(0), 4000)
    draws = np.asarray(jax.jit(jax.vmap(lambda k: fp4jax.dequantize(
        fp4jax.quantize(x, fmt, rounding="stochastic", key=k))))(keys), np.float64)
    q = fp4jax.quantize(x, fmt)
    s = np.repeat(np.asarray(q.scale.astype(jnp.float32), np.float64), 32, -1)
    xn = np.asarray(x, np.float64)
    g = ref.ELEM_GRIDS[(fmt.elem_exp_bits, fmt.elem_man_bits)]
    t = np.abs(xn) / s
    lo = g[np.searchsorted(g, t, side="right") - 1]
    hi = g[np.minimum(np.searchsorted(g, t, side="left"), len(g) - 1)]
    assert np.all(t <= g[-1])
    step = (hi - lo) * s
    assert np.all(np.isin(np.abs(draws) / s, g))  # always a grid value ...
    assert np.all((np.abs(draws) >= lo * s) & (np.abs(draws) <= hi * s))  # ... a neighbour
    sd = np.sqrt((hi * s - np.abs(xn)) * (np.abs(xn) - lo * s))
    tol = 5 * sd / np.sqrt(len(keys)) + step * 2.0**-9 + 1e-7 * np.abs(xn)
    mean = draws.mean(0)
    assert np.all(np.abs(mean - xn) <= tol)
    rtn = np.asarray(fp4jax.dequantize(q), np.float64)
    assert np.sum(np.abs(rtn - xn) > tol) > 10


# ----------------------------------------------------------------------------- storage


def test_data_dtypes_nbytes_and_packing():
    x = jnp.ones((4, 64))
    want = {F.MXFP8_E4M3: (jnp.float8_e4m3fn, 8), F.MXFP8_E5M2: (jnp.float8_e5m2, 8),
            F.MXFP6_E2M3: (jnp.float8_e4m3fn, 6), F.MXFP6_E3M2: (jnp.float8_e4m3fn, 6),
            fp4jax.MXFP4: (jnp.float4_e2m1fn, 4)}
    for fmt, (dt, bits) in want.items():
        q = fp4jax.quantize(x, fmt)
        assert q.data.dtype == dt and fmt.elem_bits == bits
        assert q.nbytes_packed() == 256 * bits // 8 + 8 * 1 + 4
    assert fp4jax.quantize(x).nbytes_packed() == 128 + 16 + 4  # NVFP4 unchanged
    with pytest.raises(TypeError, match="FP8 and FP6 formats keep one element per byte"):
        fp4jax.pack_e2m1(fp4jax.quantize(x, F.MXFP8_E4M3).data)
    ieee = fp4jax.BlockFormat("e5m2-ieee", 16, 5, 2, scale_ieee=True)
    assert ieee.scale_dtype == jnp.float8_e5m2
    assert fp4jax.BlockFormat("e5m2", 16, 5, 2).scale_dtype == jnp.float32


def test_block_format_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"elem_exp_bits=3, elem_man_bits=3\) is not an OCP "
                                         r"MX element format: use one of .*\(5, 2\) E5M2"):
        fp4jax.BlockFormat("bad", 32, elem_exp_bits=3, elem_man_bits=3)
    with pytest.raises(TypeError, match="scale_ieee must be True or False"):
        fp4jax.BlockFormat("bad", 16, scale_ieee="yes")
    with pytest.raises(ValueError, match="4over6.*NVFP4 only.*elements e4m3"):
        fp4jax.quantize(jnp.ones((2, 32)), TWO_LEVEL[0], block_scale_rule="4over6")
    with pytest.raises(ValueError, match="4over6.*NVFP4 only.*e4m3 ieee"):
        fp4jax.quantize(jnp.ones((2, 32)), fp4jax.NVFP4.replace(scale_ieee=True),
                        block_scale_rule="4over6")
    with pytest.raises(ValueError, match="block_scale_rule.*NVFP4 only"):
        R.mxfp8().replace(block_scale_rule="4over6")
    assert fp4jax.get_format("MXFP8_E4M3") is F.MXFP8_E4M3
    assert fp4jax.NVFP4 == fp4jax.BlockFormat("nvfp4", 16, 4, 3, True, "nearest", 2, 1, False)


# ----------------------------------------------------------------------------- GEMMs


def _exact_operand(r, fmt, shape, axis):
    """An array whose quantization is known exactly: per block (along ``axis``) one scale
    ``s`` of the scale grid (5 significant bits where the grid has them) and elements
    ``q`` from the element grid's top binade with the element max in every block, so that
    ``quantize`` returns ``q`` and ``s`` (``x = q * s``, exact in float32). Returns
    ``(x, q)``."""
    g = ref.ELEM_GRIDS[(fmt.elem_exp_bits, fmt.elem_man_bits)]
    top = g[g >= 2.0 ** np.floor(np.log2(g[-1]))]
    q = r.choice(top, shape) * r.choice([-1.0, 1.0], shape)
    qm = np.moveaxis(q, axis, -1)
    nb = qm.shape[-1] // fmt.block_size
    qm = qm.reshape(*qm.shape[:-1], nb, fmt.block_size)
    qm[..., 0] = g[-1] * np.sign(qm[..., 0])  # the block amax is the element max
    sg = ref.grid_values(fmt.scale_exp_bits, fmt.scale_man_bits, True)
    sg = sg[(sg >= 0.25) & (sg <= 8)]
    s = r.choice(sg, qm.shape[:-1])
    x = np.moveaxis((qm * s[..., None]).reshape(np.moveaxis(q, axis, -1).shape), -1, axis)
    return x.astype(F32), np.moveaxis(qm.reshape(np.moveaxis(q, axis, -1).shape), -1, axis)


@pytest.mark.parametrize("fmt,bf16", [
    (F.MXFP8_E4M3, True),  # 4 + 1 significant bits
    (fp4jax.BlockFormat("e4m3xe4m3", 16, 4, 3, False, "nearest", 4, 3), True),  # 4 + 4
    (fp4jax.BlockFormat("e4m3xe3m4", 16, 3, 4, False, "nearest", 4, 3), False),  # 4 + 5
    (fp4jax.BlockFormat("e2m3xe3m4", 16, 3, 4, False, "nearest", 2, 3), False),
    (fp4jax.BlockFormat("e5m2xe4m3", 16, 4, 3, False, "nearest", 5, 2), True),  # 3 + 4
], ids=lambda v: getattr(v, "name", str(v)))
def test_gemm_emulation_is_exact(fmt, bf16):
    """``fp4jax.dot`` of quantized operands equals the float64 product of the exact
    ``q * s`` (one block along K per row/column, so the float32 accumulation is exact
    too): the operands run in bfloat16 only when ``data * scale`` fits its 8 bits
    (``BlockFormat.scaled_bits``), else in float32. The control: where it does not fit,
    the bfloat16 operand would differ."""
    r = np.random.default_rng(fmt.scaled_bits)
    k = fmt.block_size
    x, qx = _exact_operand(r, fmt, (8, k), -1)
    w, qw = _exact_operand(r, fmt, (k, 6), 0)
    a, b = x.astype(np.float64), w.astype(np.float64)  # exactly q * s, one block per row/col
    qa = fp4jax.quantize(jnp.asarray(x), fmt)
    bits_equal(qa.data.astype(jnp.float32), qx)
    bits_equal(qz.scaled_data(qa), a)
    assert (fmt.scaled_bits <= 8) == bf16 == B.Operand.from_codes(qa).exact_in_bf16()
    recipe = R.bf16().replace(**{"fprop.lhs.fmt": fmt, "fprop.rhs.fmt": fmt})
    y = fp4jax.dot(jnp.asarray(x), jnp.asarray(w), recipe=recipe)
    np.testing.assert_array_equal(np.asarray(y, np.float64), a @ b)
    if not bf16:  # the control: these operands are not bfloat16 numbers
        a16 = np.asarray(qz.scaled_data(qa, jnp.bfloat16).astype(jnp.float32), np.float64)
        assert np.any(a16 != a)


# ----------------------------------------------------------------------------- recipes


def _randn(*shape):
    return jnp.asarray(np.random.default_rng(sum(shape)).standard_normal(shape), jnp.float32)


def test_new_recipes_contents():
    m = R.mxfp8()
    quant = [q for g in m.gemms.values() for q in (g.lhs, g.rhs)]
    assert all(q.fmt == F.MXFP8_E4M3_UP and q.rounding == "nearest" and not q.block_2d
               for q in quant)
    assert not any(g.hadamard for g in m.gemms.values()) and not m.needs_key
    h = R.mxfp8_fwd_nvfp4_bwd()
    assert h.fprop == m.fprop and h.dgrad == R.nvfp4().dgrad and h.wgrad == R.nvfp4().wgrad
    assert h.needs_key and h.dgrad.rhs.block_2d and h.wgrad.hadamard == 16
    assert R.parse("mxfp8") == m and R.parse("mxfp8_fwd_nvfp4_bwd") == h
    hybrid = R.parse("mxfp8(dgrad.lhs.fmt=mxfp8_e5m2_up, wgrad.rhs.fmt=mxfp8_e5m2_up)")
    assert hybrid.dgrad.lhs.fmt == F.MXFP8_E5M2_UP and hybrid.fprop == m.fprop
    # the hybrid's NVFP4 backward takes the kernels, its MXFP8 forward the XLA quantizer
    assert dot_sm90.recipe_reason(m) is not None and dot_sm90.recipe_reason(h) is None


@pytest.mark.parametrize("name", ["mxfp8", "mxfp8_fwd_nvfp4_bwd"])
def test_new_recipes_forward_and_backward(name):
    """``fp4jax.dot`` and its VJP (jitted) follow the recipe: y = Q(x) Q(w),
    dx = Q(dy) Q(w).T, dw = Q(H x).T Q(H dy) (round-to-nearest, to compare values); the
    hybrid with its own stochastic rounding runs ``jax.grad`` under ``jit``, and the same
    key gives the same bits."""
    r = R.get(name).replace(sr=False)
    x, w, g = _randn(64, 64), _randn(64, 32), _randn(64, 32)

    @jax.jit
    def fwd_bwd(x, w):
        y, vjp = jax.vjp(lambda x, w: fp4jax.dot(x, w, recipe=r), x, w)
        return (y, *vjp(g))

    y, dx, dw = fwd_bwd(x, w)
    want_y = dequantized(x, r.fprop.lhs, -1) @ dequantized(w, r.fprop.rhs, 0)
    np.testing.assert_allclose(np.asarray(y), want_y, rtol=1e-5, atol=1e-4)
    want_dx, want_dw = recipe_grads(r, x, w, g)
    np.testing.assert_allclose(np.asarray(dx), want_dx, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(dw), want_dw, rtol=1e-5, atol=1e-4)
    rel = np.linalg.norm(np.asarray(dw) - np.asarray(x.T @ g)) / np.linalg.norm(x.T @ g)
    assert rel < (0.3 if r.wgrad.lhs.fmt == fp4jax.NVFP4 else 0.05), rel
    full = R.get(name)
    if full.needs_key:  # the recipe as named (SR on dy): jitted grad, same key same bits
        grad = jax.jit(jax.grad(lambda x, w, k: jnp.sum(
            fp4jax.dot(x, w, recipe=full, key=k) * g), argnums=(0, 1)))
        a, b = grad(x, w, jax.random.key(1)), grad(x, w, jax.random.key(1))
        c = grad(x, w, jax.random.key(2))
        for u, v in zip(a, b, strict=True):
            np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
        assert not np.array_equal(np.asarray(a[0]), np.asarray(c[0]))


# ----------------------------------------------------------------------------- dispatch


@pytest.mark.parametrize("fmt", [F.MXFP8_E4M3, F.MXFP8_E5M2_UP, F.MXFP6_E2M3, F.MXFP6_E3M2,
                                 TWO_LEVEL[0]], ids=lambda f: f.name)
def test_dispatcher_sends_non_e2m1_formats_to_xla(fmt):
    """The Hopper kernels implement E2M1 only: every entry of the dispatcher refuses other
    element types, so they run the XLA reference (on a GPU too)."""
    shape = (64, 2048)
    reason = dispatch.quantize_unsupported_reason(shape, jnp.bfloat16, fmt=fmt)
    assert reason is not None and "E2M1" in reason, reason
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 64)), jnp.bfloat16)
    with pytest.raises(ValueError, match="E2M1"):
        dispatch.quantize(x, fmt, backend="pallas")
    got = dispatch.quantize(x, fmt, backend="auto")
    want = fp4jax.quantize(x, fmt)
    np.testing.assert_array_equal(np.asarray(got.data.astype(jnp.float32)),
                                  np.asarray(want.data.astype(jnp.float32)))
    kw = dict(block_2d=False, axis=2, stochastic=False, rht=0, key=jax.random.key(0))
    xc = jnp.zeros((1, 256, 1024), jnp.bfloat16)
    assert dot_sm90.operand_kernel(xc, **kw, fmt=fmt) is None
    q = fp4jax.quantize(jnp.zeros((64, 256)), fmt, axis=-1)
    qb = fp4jax.quantize(jnp.zeros((256, 64)), fmt, axis=0)
    reason = dispatch.w4a4_unsupported_reason(64, 256, 64, q, qb)
    assert reason is not None and "E2M1" in reason, reason


def test_dispatcher_controls_still_take_e2m1():
    """The control of the test above: NVFP4 / MXFP4 operands pass the format checks (and
    fail only for want of a GPU here)."""
    kw = dict(block_2d=False, axis=2, stochastic=False, rht=0, key=jax.random.key(0))
    xc = jnp.zeros((1, 256, 1024), jnp.bfloat16)
    assert dot_sm90.operand_kernel(xc, **kw, fmt=fp4jax.NVFP4) == "rows"
    assert dot_sm90.operand_kernel(xc, **kw) == "rows"
    q = fp4jax.quantize(jnp.zeros((64, 256)), fp4jax.MXFP4, axis=-1)
    qb = fp4jax.quantize(jnp.zeros((256, 64)), fp4jax.MXFP4, axis=0)
    reason = dispatch.w4a4_unsupported_reason(64, 256, 64, q, qb)
    assert reason is None or "E2M1" not in reason


def test_diagnostics_saturation_uses_the_element_max():
    """The diagnostics count saturation against the element format's max (448 for E4M3): a
    rounded-up MXFP8 scale never saturates; the OCP rule does, for block maxima in
    (448, 512) times the scale (with E2M1's 6 as the bound nearly every element would
    count). Only the operand under test is quantized (the unquantized ``bf16`` recipe
    around it): the other five operands' quantizers would only add compile time."""
    from fp4jax import diagnostics

    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)
    base = R.get("bf16")
    key = jax.random.key(0)
    sat = {}
    for fmt in (F.MXFP8_E4M3_UP, F.MXFP8_E4M3):
        spec = R.QuantSpec(fmt)
        recipe = dataclasses.replace(base, fprop=dataclasses.replace(base.fprop, lhs=spec))
        st = jax.jit(lambda x, w, dy, recipe=recipe: diagnostics.gemm_stats(
            x, w, dy, recipe=recipe, key=key))(x, w, dy)
        sat[fmt.name] = float(st["fprop"]["lhs"]["saturation"])
    assert sat["mxfp8_e4m3_up"] == 0.0
    assert 0.0 < sat["mxfp8_e4m3"] < 0.1, sat


# ----------------------------------------------------------------------------- training
