"""NVFP4 codes identical to Transformer Engine in the two edge classes of issue 38, against the
independent NumPy reference (``tests/reference.py``) and across backends (the packed Hopper
kernels in interpret mode):

* a block whose E4M3 scale underflows to 0 while holding nonzero values: element encode
  scale ``min(1/(0 * dec), FLT_MAX) = FLT_MAX`` (TE ``core_nvfp4.cuh``
  ``compute_scaling_coefficient``, ``reference_nvfp4.py``), so its nonzero elements
  saturate to +-6 (codes 7/15) and it still dequantizes to 0;
* a tiny tensor (amax below ~3.2e-35): tensor encode scale clamped at FLT_MAX (not 2**126),
  decode scale ``1/enc`` a float32 subnormal, computed without the CPU's flush.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp4jax
from fp4jax import numerics
from tests import reference as ref
from tests.checks import assert_packed_equal, packed_bits
from tests.interpret import InterpretGPUParams, needs_interpret

F32 = np.float32
FLT_MAX = np.finfo(np.float32).max
RNG = np.random.default_rng(38)


def _underflow_input(shape=(32, 64)) -> np.ndarray:
    """Unit-scale data with 1x16 blocks (rows 1-4) and 16x16 tiles (rows 16-31) whose amax
    is 2**-20 .. 2**-40 of the tensor's (their E4M3 scale rounds to 0), one of them holding
    zeros and -0.0 too."""
    x = RNG.standard_normal(shape).astype(F32)
    x[16:32, 16:32] *= F32(2.0**-22)
    x[16:32, 32:48] *= F32(1e-10)
    x[0, 0] = 8.0
    x[1, 16:32] *= F32(2.0**-22)
    x[2, :16] = RNG.uniform(-1, 1, 16).astype(F32) * F32(1e-9)
    x[2, 3], x[2, 4] = 0.0, -0.0
    x[3, 32:48] *= F32(2.0**-40)
    x[4, 48:64] = F32(1.2e-38)  # normal float32; x * FLT_MAX ~ 4.08: codes 6, not 7
    return x


def _codes(data: np.ndarray) -> np.ndarray:
    """E2M1 codes (sign bit 3) of float64 element values with signed zeros."""
    return np.asarray(np.asarray(data, F32).astype(ml_dtypes.float4_e2m1fn)).view(np.uint8) & 0xF


def _assert_matches_reference(x: np.ndarray, q, **kw):
    want_q, want_s, want_dec = ref.ref_quantize(x, **kw)
    got_codes = _codes(np.asarray(q.data.astype(jnp.float32)))
    np.testing.assert_array_equal(got_codes, _codes(want_q))
    np.testing.assert_array_equal(np.asarray(q.scale.astype(jnp.float32)), want_s)
    assert np.float32(q.global_scale).view(np.uint32) == F32(want_dec).view(np.uint32)
    return want_q, want_s, want_dec


@pytest.mark.parametrize("axis,block_2d", [(-1, False), (0, False), (-1, True)])
def test_underflowed_blocks_saturate_like_te(axis, block_2d):
    x = _underflow_input()
    if axis == 0:  # the same blocks, along axis 0
        x = np.ascontiguousarray(x.T)
    q = fp4jax.quantize(jnp.asarray(x), fp4jax.NVFP4, axis=axis, block_2d=block_2d)
    want_q, want_s, _ = _assert_matches_reference(x, q, axis=axis, block_2d=block_2d)
    assert (want_s == 0).sum() >= 2  # the cases are there
    codes = _codes(np.asarray(q.data.astype(jnp.float32)))
    if not block_2d and axis == -1:
        blk = x[1, 16:32]
        np.testing.assert_array_equal(codes[1, 16:32], np.where(blk < 0, 15, 7))
        assert codes[2, 3] == 0 and codes[2, 4] == 8  # zeros stay zero (-0.0 keeps its sign)
        assert set(codes[2, 5:16]) <= {7, 15}
        assert set(codes[4, 48:64]) == {6}
    # dequantized: 0 in the underflowed blocks, the reference elsewhere
    d = np.asarray(fp4jax.dequantize(q))
    np.testing.assert_array_equal(d, ref.ref_dequantize(want_q, want_s, q.global_scale,
                                                        axis=axis, block_2d=block_2d))
    if not block_2d and axis == -1:
        assert np.all(d[1, 16:32] == 0) and np.all(d[3, 32:48] == 0)


def test_underflowed_blocks_stochastic_rounding_saturate():
    x = _underflow_input()
    key = jax.random.key(5)
    q = fp4jax.quantize(jnp.asarray(x), fp4jax.NVFP4, rounding="stochastic", key=key)
    kw = tuple(int(w) for w in np.asarray(jax.random.key_data(key)).ravel())
    _assert_matches_reference(x, q, sr_key_words=kw)
    codes = _codes(np.asarray(q.data.astype(jnp.float32)))
    np.testing.assert_array_equal(codes[1, 16:32], np.where(x[1, 16:32] < 0, 15, 7))


@pytest.mark.parametrize("amax", [1e-36, 8e-36, 2e-35, 3.1e-35])
def test_tiny_tensor_scales_follow_te(amax):
    """enc = min(2688/amax, FLT_MAX): block scales as TE's (not 1/4 of them, as with the
    old 2**126 clamp), a subnormal decode scale, codes and dequantized values exact."""
    x = (RNG.standard_normal((8, 64)) * amax / 4).astype(F32)
    x[0, 0] = F32(amax)
    x = np.where(np.abs(x) < 2.0**-126, F32(0), x)  # the CPU flushes subnormal inputs
    q = fp4jax.quantize(jnp.asarray(x), fp4jax.NVFP4)
    want_q, want_s, want_dec = _assert_matches_reference(x, q)
    with np.errstate(over="ignore", under="ignore"):
        enc = min(F32(F32(2688.0) / F32(amax)), FLT_MAX)
        assert F32(want_dec) == F32(F32(1) / F32(enc)) and want_dec < 2.0**-126
    if amax <= 2e-35:  # larger block scales than the old 2**126 clamp gave
        assert want_s.max() > 1.2 * amax * 2.0**126 / 6
    d = np.asarray(fp4jax.dequantize(q))
    with np.errstate(under="ignore"):
        want = ref.ref_dequantize(want_q, want_s, want_dec)
    normal = np.abs(want) >= 2.0**-126  # the CPU flushes subnormal results
    np.testing.assert_array_equal(d[normal], want[normal])
    assert normal.mean() > 0.9
    d64, x64 = d.astype(np.float64), x.astype(np.float64)
    rel = np.linalg.norm(d64 - x64) / np.linalg.norm(x64)
    assert rel < 0.15  # not zeroed: the usual 4-bit error


def test_reciprocal_and_subnormal_products_match_ieee():
    """``numerics.reciprocal_rn`` (subnormal quotients), ``recip_scaled_subnormal_rn`` and
    ``mul_decode_scale`` against NumPy's IEEE float32 (which keeps subnormals)."""
    enc = np.concatenate([F32(2.0**126) * RNG.uniform(1, 4, 3000).astype(F32),
                          [FLT_MAX, F32(2.0**126), F32(2.0**127)],
                          np.exp2(RNG.uniform(-120, 126, 500)).astype(F32)]).astype(F32)
    with np.errstate(under="ignore"):
        want = F32(1) / enc
    got = np.asarray(jax.jit(numerics.reciprocal_rn)(jnp.asarray(enc)))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    e4m3 = np.arange(127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(F32)
    s, dec = np.meshgrid(e4m3, want[:200][want[:200] < 2.0**-126])
    with np.errstate(divide="ignore", over="ignore", under="ignore"):
        want_e = np.minimum(F32(1) / (s * dec).astype(F32), FLT_MAX).astype(F32)
    got_e = np.asarray(jax.jit(numerics.recip_scaled_subnormal_rn)(jnp.asarray(s),
                                                                    jnp.asarray(dec)))
    np.testing.assert_array_equal(got_e.view(np.uint32), want_e.view(np.uint32))
    assert 0.1 < (want_e == FLT_MAX).mean() < 0.9  # both the clamp and the rest occur
    v = RNG.uniform(-2688, 2688, s.shape).astype(F32)
    with np.errstate(under="ignore"):
        want_m = (v * dec).astype(F32)
    got_m = np.asarray(jax.jit(numerics.mul_decode_scale)(jnp.asarray(v), jnp.asarray(dec)))
    ok = np.abs(want_m) >= 2.0**-126
    np.testing.assert_array_equal(got_m[ok].view(np.uint32), want_m[ok].view(np.uint32))


def test_element_encode_scale_of_zero_scale_is_flt_max():
    from fp4jax.quantization import element_encode_scale

    got = np.asarray(element_encode_scale(jnp.asarray([0.0, 1.0, 448.0]), jnp.float32(0.5)))
    np.testing.assert_array_equal(got, [FLT_MAX, 2.0, F32(1) / F32(224)])


# ---------------------------------------------------------------------------
# Every backend: the packed Hopper kernels (interpret mode) give the same codes.
# ---------------------------------------------------------------------------


def _kernel_input(tiny: bool) -> jnp.ndarray:
    x = RNG.standard_normal((16, 1024)).astype(F32)
    x[0, 0] = 8.0
    x[1, 16:48] *= F32(2.0**-22)  # underflowed blocks
    x[5, 64:80] = F32(1e-9)
    x[6, 80:96] = 0.0
    if tiny:
        x = x * F32(1e-36)
    x = jnp.asarray(x).astype(jnp.bfloat16)
    return jnp.where(jnp.abs(x.astype(jnp.float32)) < 2.0**-126, 0, x).astype(jnp.bfloat16)


@needs_interpret
@pytest.mark.parametrize("tiny", [False, True])
def test_packed_kernels_give_the_core_codes(tiny):
    from pallas_kernels.quantize import packed_sm90 as qk

    x = _kernel_input(tiny)
    ip = InterpretGPUParams()
    want = packed_bits(fp4jax.quantize(x, fp4jax.NVFP4))
    got = qk.quantize_nvfp4_1x16(x, interpret=ip)
    assert_packed_equal(got, want)
    assert (want[1] == 0).sum() >= 2 and np.isin(want[0] & 0xF, [7, 15]).any()
    if tiny:
        assert want[2] < 2.0**-126
    want2 = packed_bits(fp4jax.quantize(x, fp4jax.NVFP4, block_2d=True))
    got2 = qk.quantize_nvfp4_2d(x, interpret=ip)
    np.testing.assert_array_equal(np.asarray(got2[1]), want2[1])
    np.testing.assert_array_equal(np.asarray(got2[0]), want2[0])
