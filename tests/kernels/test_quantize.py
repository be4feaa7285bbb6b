"""CPU tests of the Pallas Mosaic GPU kernels (pallas_kernels/).

* The quantize kernel body runs in Mosaic GPU interpret mode
  (``InterpretGPUParams``) and is compared bit for bit with an independent NumPy
  reference (ml_dtypes casts) and with ``fp4jax.quantize``.
* The kernels are lowered for CUDA on this CPU machine (``jax.export`` with
  ``platforms=["cuda"]``), which runs the whole Pallas -> Mosaic GPU lowering and
  catches unsupported ops, layouts and shapes without a GPU.
* The W4A16 and W4A4 kernels: tests/kernels/test_w4a16.py, tests/kernels/test_w4a4.py.
Exactness on the GPU itself: experiments/gpu_check.py (results in
experiments/results/kernels/).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

from pallas_kernels import dispatch  # noqa: E402
from pallas_kernels import reference as npref  # noqa: E402
from pallas_kernels.quantize import common_sm90 as cm  # noqa: E402
from pallas_kernels.quantize import packed_sm90 as qk  # noqa: E402
from tests.checks import export_cuda  # noqa: E402

try:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
except ImportError:  # pragma: no cover
    InterpretGPUParams = None

LUT = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def _hard_input(rows, cols, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    x *= np.exp2(rng.integers(-20, 20, (rows, 1))).astype(np.float32)  # scale subnormals too
    x[0, :16] = 0.0  # all-zero block -> s = 0, e = 0
    x[0, 16:32] = -0.0
    x[1, 3] = np.inf  # Inf block -> NaN scale
    x[2, 40] = np.nan  # NaN block -> NaN scale
    x[3, :16] = rng.choice([-6, -5, -3.5, -2.5, -1.75, -1.25, -.75, -.25, .25, .75, 1.25,
                            1.75, 2.5, 3.5, 5, 6], 16)  # E2M1 ties after scaling by 1
    x[3, 0] = 6.0
    return x


def _numpy_expected(xb16):
    x32 = np.asarray(xb16.astype(jnp.float32))
    codes, sbits, dec = npref.quantize_nvfp4_1x16(x32)
    packed = npref.pack_codes(codes)
    # NaN/Inf blocks: the scale carries the NaN; element codes there are unspecified.
    finite_blk = np.isfinite(x32.reshape(*x32.shape[:-1], -1, 16)).all(-1)
    return packed, sbits, dec, finite_blk


def _compare(packed, sbits, dec, xb16):
    e_packed, e_sbits, e_dec, finite_blk = _numpy_expected(xb16)
    np.testing.assert_array_equal(np.asarray(sbits), e_sbits)
    assert np.float32(dec) == e_dec
    pk = np.asarray(packed).reshape(*finite_blk.shape, 8)
    ek = e_packed.reshape(*finite_blk.shape, 8)
    np.testing.assert_array_equal(pk[finite_blk], ek[finite_blk])


@pytest.mark.skipif(InterpretGPUParams is None, reason="no Mosaic GPU interpret mode")
@pytest.mark.parametrize("shape,seed", [((16, 256), 0), ((4, 2048), 1)])
def test_quantize_kernel_interpret_matches_numpy(shape, seed):
    x = jnp.asarray(_hard_input(*shape, seed), jnp.bfloat16)
    packed, sbits, dec = qk.quantize_nvfp4_1x16(x, interpret=InterpretGPUParams())
    _compare(packed, sbits, dec, x)


@pytest.mark.skipif(InterpretGPUParams is None, reason="no Mosaic GPU interpret mode")
def test_quantize_kernel_interpret_matches_fp4jax():
    fp4jax = pytest.importorskip("fp4jax")
    x = jnp.asarray(_hard_input(16, 256, 2), jnp.bfloat16)
    x = jnp.where(jnp.isfinite(x), x, 1.0)  # data codes of NaN blocks are unspecified
    packed, sbits, dec = qk.quantize_nvfp4_1x16(x, interpret=InterpretGPUParams())
    q = fp4jax.quantize(x, fp4jax.NVFP4)
    np.testing.assert_array_equal(np.asarray(packed), np.asarray(fp4jax.pack_e2m1(q.data)))
    np.testing.assert_array_equal(
        np.asarray(sbits), np.asarray(jax.lax.bitcast_convert_type(q.scale, jnp.uint8)))
    assert float(dec) == float(q.global_scale)


@pytest.mark.skipif(InterpretGPUParams is None, reason="no Mosaic GPU interpret mode")
def test_quantize_kernel_interpret_random_block_scales_matches_fp4jax():
    # many blocks with random per-block magnitudes: every E4M3 block scale occurs, with
    # a random tensor scale, so 1/(s*dec) takes ~thousands of distinct values
    fp4jax = pytest.importorskip("fp4jax")
    rng = np.random.default_rng(7)
    x = rng.standard_normal((64, 1024)).astype(np.float32)
    x *= np.exp2(rng.uniform(-12, 6, (64, 64, 1))).repeat(16, -1).reshape(64, 1024)
    x *= np.float32(rng.uniform(1, 2))
    x = jnp.asarray(x, jnp.bfloat16)
    packed, sbits, dec = qk.quantize_nvfp4_1x16(x, interpret=InterpretGPUParams())
    q = fp4jax.quantize(x, fp4jax.NVFP4)
    assert len(np.unique(np.asarray(sbits))) > 100
    np.testing.assert_array_equal(np.asarray(packed), np.asarray(fp4jax.pack_e2m1(q.data)))
    np.testing.assert_array_equal(
        np.asarray(sbits), np.asarray(jax.lax.bitcast_convert_type(q.scale, jnp.uint8)))
    assert float(dec) == float(q.global_scale)


def test_recip_rn_corrects_one_ulp_errors():
    # the kernel's 1/(s*dec): the hardware quotient may be one ulp off on the GPU; feed
    # recip_rn the exact quotient and both neighbours and expect div_rn's bits each time
    from fp4jax import numerics

    rng = np.random.default_rng(0)
    s = np.arange(1, 127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    dec = np.exp2(rng.uniform(-40, 40, 400)).astype(np.float32)
    p = (s[:, None] * dec[None, :]).ravel()
    p = np.concatenate([p, np.exp2(rng.uniform(-100, 100, 20000)).astype(np.float32),
                        np.float32([1, 2, 0.5, 1.5, np.nextafter(np.float32(1), 2),
                                    np.nextafter(np.float32(2), 0)])])
    want = (1.0 / p.astype(np.float64)).astype(np.float32)  # exact by double rounding
    pj = jnp.asarray(p)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(lambda v: numerics.div_rn(jnp.float32(1), v))(pj)), want)
    m = (p.view(np.int32) & 0x7FFFFF | 0x3F800000).view(np.float32)
    y = (1.0 / m.astype(np.float64)).astype(np.float32)
    f = jax.jit(cm.recip_rn)
    for d in (-1, 0, 1):
        res, ok = f(pj, jnp.asarray((y.view(np.int32) + d).view(np.float32)))
        assert np.asarray(ok).all()
        np.testing.assert_array_equal(np.asarray(res), want)
    res, ok = jax.jit(cm.recip_rn)(pj)  # the hardware quotient itself
    np.testing.assert_array_equal(np.asarray(res), want)


def test_e4m3_round_matches_ml_dtypes():
    # every E4M3 value, the midpoints between neighbours (ties) and random values;
    # float32 normals only (XLA on CPU flushes float32 subnormals)
    grid = np.arange(0, 127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    mids = (grid[1:] + grid[:-1]) / 2
    rng = np.random.default_rng(0)
    rand = np.exp2(rng.uniform(-12, 8.8, 4000)).astype(np.float32)
    v = np.concatenate([grid, mids, rand, np.nextafter(mids, 0), np.nextafter(mids, 1000)])
    v = np.minimum(v, np.float32(448))
    v = v[(v == 0) | (v >= np.finfo(np.float32).tiny)]
    val, byte = jax.jit(cm.e4m3_round)(jnp.asarray(v))
    expect = v.astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(byte).astype(np.uint8), expect.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(val), expect.astype(np.float32))


def test_e2m1_code_matches_ml_dtypes():
    mags = np.array([0, .25, .5, .75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 100],
                    np.float32)
    v = np.concatenate([mags, -mags, np.nextafter(mags, 0), np.nextafter(mags, 10),
                        np.random.default_rng(1).uniform(-8, 8, 3000).astype(np.float32)])
    got = np.asarray(jax.jit(cm.e2m1_code)(jnp.asarray(v)))
    np.testing.assert_array_equal(got.astype(np.uint8), npref.e2m1_codes(v))


def test_quantize_supported_shapes():
    assert qk.supported((16, 256), jnp.bfloat16)
    assert not qk.supported((16, 256), jnp.float32)
    assert not qk.supported((3, 256), jnp.bfloat16)  # 48 blocks, not a multiple of 256
    assert not qk.supported((256, 100), jnp.bfloat16)


def test_quantize_kernel_lowers_for_cuda():
    x = jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16)
    s = jax.ShapeDtypeStruct((), jnp.float32)
    exp = export_cuda(lambda x, e, d: qk.quantize_nvfp4_1x16_scaled(x, e, d), x, s, s)
    assert "mosaic_gpu" in exp.mlir_module()


def test_dispatch_falls_back_to_xla_on_cpu(monkeypatch):
    fp4jax = pytest.importorskip("fp4jax")
    if dispatch.on_sm90():
        pytest.skip("tests the fallback off the GPU")
    assert not dispatch.is_supported("quantize", (64, 256), jnp.bfloat16)
    x = jax.random.normal(jax.random.key(0), (64, 256)).astype(jnp.bfloat16)
    q1, q2 = dispatch.quantize(x), fp4jax.quantize(x)
    np.testing.assert_array_equal(np.asarray(fp4jax.pack_e2m1(q1.data)),
                                  np.asarray(fp4jax.pack_e2m1(q2.data)))
    with pytest.raises(ValueError, match="no sm_90 GPU"):
        dispatch.quantize_packed(x, backend="pallas")
    monkeypatch.setenv("FP4JAX_KERNELS", "on")
    with pytest.raises(ValueError, match="unavailable"):
        dispatch.quantize_packed(x)
    with pytest.raises(ValueError, match="backend"):
        dispatch.quantize(x, backend="triton")
