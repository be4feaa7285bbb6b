"""CPU tests of the quantize kernel's table reciprocal and its 16x16 (2D) variant.

* ``recip_table``/``table_recip`` (the per-tensor table of ``1/(s*dec)``) against IEEE
  float32 computed by NumPy, for all 127 finite non-negative E4M3 scales times
  thousands of decode scales over the whole float32 range, incl. the safe-range ends.
* The kernels run in Mosaic GPU interpret mode and are compared bit for bit with
  ``fp4jax.quantize`` and the NumPy references (``pallas_kernels/reference.py``),
  with the table path, the ``recip_rn`` path and the automatic choice (incl. a tensor
  whose decode scale is outside the table's safe range).
* The real kernels are lowered for CUDA on this machine (``jax.export``).
* ``dispatch.quantize(..., block_2d=True)``'s wiring, with the kernel in interpret mode.
GPU exactness: ``experiments/gpu_check.py recip packed packed_2d``.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy
fp4jax = pytest.importorskip("fp4jax")

from pallas_kernels import dispatch  # noqa: E402
from pallas_kernels import reference as npref  # noqa: E402
from pallas_kernels.quantize import common_sm90 as cm  # noqa: E402
from pallas_kernels.quantize import packed_sm90 as qk  # noqa: E402
from tests.checks import assert_packed_equal, export_cuda, packed_bits  # noqa: E402
from tests.interpret import InterpretGPUParams, needs_interpret  # noqa: E402

F32_MAX = np.finfo(np.float32).max
TINY = np.finfo(np.float32).tiny


def _ieee_elem_scale(dec):
    """(127, n) float32: min(1/(f32(s)*dec), FLT_MAX) (FLT_MAX where s == 0), in NumPy."""
    s = np.arange(127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    with np.errstate(all="ignore"):
        p = s[:, None] * dec[None, :]
        return np.minimum(np.float32(1) / p, F32_MAX).astype(np.float32)


def _table_elem_scale(dec):
    def one(d):
        safe, table = cm.recip_table(d)
        return safe, cm.table_recip(jnp.arange(127, dtype=jnp.int32), list(table))

    safe, e = jax.jit(jax.vmap(one))(jnp.asarray(dec))
    return np.asarray(safe), np.asarray(e).T


def test_recip_table_exact_over_safe_range():
    rng = np.random.default_rng(0)
    edges = np.float32([TINY, 2.0**-120, 2.0**-117, 2.0**-116, 1.0, 2.0**116, 2.0**117,
                        2688 / F32_MAX, 1.0 / 2.0**126, F32_MAX])
    with np.errstate(over="ignore"):
        edges = np.concatenate([edges, np.nextafter(edges, np.float32(0)),
                                np.nextafter(edges, np.float32(np.inf))])
    dec = np.concatenate([
        np.exp2(rng.uniform(-126, 128, 3000)),  # log-uniform over all normal floats
        np.exp2(rng.uniform(-118, -116, 500)), np.exp2(rng.uniform(116, 118, 500)),
        rng.uniform(1, 2, 500) * np.float32(1 / 2688),  # typical: amax in [1, 2)
        edges]).astype(np.float32)
    dec = dec[np.isfinite(dec) & (dec >= TINY)]
    safe, got = _table_elem_scale(dec)
    want = _ieee_elem_scale(dec)
    exact = (got.view(np.int32) == want.view(np.int32)).all(axis=0)
    assert safe.sum() > 2500 and (~safe).sum() > 300
    np.testing.assert_array_equal(safe, (dec >= 2.0**-117) & (dec < 2.0**117))
    bad = dec[safe & ~exact]
    assert bad.size == 0, f"table inexact for safe dec {bad[:5]}"
    # outside the range the table is wrong somewhere (so the range is not vacuous)
    assert (~exact[~safe]).any()


def test_recip_table_safe_for_all_but_tiny_tensors():
    # fp4jax's dec = 1/enc with enc in [2688/FLT_MAX, FLT_MAX]: the largest dec is safe;
    # the table is refused only for tensors with amax below 2688 * 2^-117
    def dec_of(amax):
        return cm.global_scales(jnp.full((16,), amax, jnp.float32))[1]

    for amax, want in ((F32_MAX, True), (1.0, True), (1e-30, True), (1e-33, False),
                       (1e-37, False), (0.0, True)):
        safe, _ = cm.recip_table(dec_of(amax))
        assert bool(safe) == want, amax


def test_batched_scalars_equal_one_operand_at_a_time():
    """``dot_sm90.make_operands`` computes every operand's tensor scales and kernel scalar
    vector as one batch (``global_scales`` and ``scalars`` on vectors): each row must be the
    bits of the scalar call, over amaxes from 0 and tiny (unsafe table) to FLT_MAX, NaN-free
    and with and without RHT signs."""
    amax = jnp.asarray([0.0, 1e-37, 1e-33, 3.2e-35, 1e-30, 2.5e-3, 1.0, 448.0 * 6, 1e30,
                        F32_MAX], jnp.float32)
    signs = jnp.asarray(np.random.default_rng(0).choice([-1.0, 1.0], (amax.size, 16)),
                        jnp.float32)
    enc, dec = cm.global_scales(None, amax)
    batched = np.asarray(cm.scalars(enc, dec, signs)).view(np.uint32)
    batched_no_signs = np.asarray(cm.scalars(enc, dec)).view(np.uint32)
    # kernel_scalars, then the RHT sign slots (32: room for MX's RHT-32); 16 signs are
    # padded with ones
    assert batched.shape == (amax.size, cm.SC_WIDTH) and cm.SC_WIDTH == cm.N_SC + 32
    assert (batched[:, cm.N_SC + 16:] == np.float32(1).view(np.uint32)).all()
    np.testing.assert_array_equal(batched[:, cm.N_SC:cm.N_SC + 16],
                                  np.asarray(signs).view(np.uint32))
    for i in range(amax.size):
        e, d = cm.global_scales(None, amax[i])
        assert np.asarray(e).view(np.uint32) == np.asarray(enc[i]).view(np.uint32)
        assert np.asarray(d).view(np.uint32) == np.asarray(dec[i]).view(np.uint32)
        one = np.asarray(cm.scalars(e, d, signs[i])).view(np.uint32)
        np.testing.assert_array_equal(batched[i], one)
        np.testing.assert_array_equal(batched_no_signs[i],
                                      np.asarray(cm.scalars(e, d)).view(np.uint32))
    assert not np.all(batched[:, 2] == batched[0, 2])  # both table flags occur


def _block_input(rows, cols, seed, tile=(1, 16)):
    """Random magnitudes per block (or per 16x16 tile) over 2^-14 .. 2^8, so every
    E4M3 scale code occurs, with zero, NaN and Inf blocks/tiles."""
    rng = np.random.default_rng(seed)
    tr, tc = tile
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    mag = np.exp2(rng.uniform(-14, 8, (rows // tr, 1, cols // tc, 1)))
    x *= np.broadcast_to(mag, (rows // tr, tr, cols // tc, tc)).reshape(rows, cols)
    x *= np.float32(rng.uniform(1, 2))
    x[:tr, :tc] = 0.0
    x[:tr, tc:2 * tc] = -0.0
    if rows < 4 * tr:  # too small for the special blocks below
        return jnp.asarray(x, jnp.bfloat16)
    x[tr, 3] = np.inf
    x[2 * tr, 2 * tc + 5] = np.nan
    x[3 * tr + 1, 3 * tc:4 * tc] = [-6, -5, -3.5, -2.5, -1.75, -1.25, -.75, -.25, .25, .75,
                                    1.25, 1.75, 2.5, 3.5, 5, 6][:tc]
    return jnp.asarray(x, jnp.bfloat16)


def _finite_scales(x, tile):
    """Mask of blocks (tiles) without NaN/Inf. Compared with ``fp4jax.quantize`` only
    there: on CPU, XLA's block max can drop a NaN (seen with JAX 0.10.2: a block whose
    6th element is NaN got the scale of its finite values from ``fp4jax.quantize``,
    while NumPy and the kernel give the NaN scale 0x7F), a core issue, not the kernel's.
    NaN/Inf blocks are compared with the NumPy reference."""
    x32 = np.asarray(x.astype(jnp.float32))
    r, c = x32.shape
    tr, tc = tile
    return np.isfinite(x32).reshape(r // tr, tr, c // tc, tc).all(axis=(1, 3))


def _finite_bytes(x, tile):
    """(R, C/2) mask of packed bytes whose block (tile) holds no NaN/Inf: codes of
    NaN/Inf blocks are unspecified (their scale carries the NaN)."""
    x32 = np.asarray(x.astype(jnp.float32))
    r, c = x32.shape
    tr, tc = tile
    ok = np.isfinite(x32).reshape(r // tr, tr, c // tc, tc).all(axis=(1, 3))
    ok = np.repeat(np.repeat(ok, tr, 0), tc, 1)
    return ok[:, 0::2]


@needs_interpret
@pytest.mark.parametrize("recip", ["auto", "table"])
def test_1x16_table_interpret_matches_fp4jax_and_numpy(recip):
    x = _block_input(64, 1024, 1)
    packed, sbits, dec = qk.quantize_nvfp4_1x16(x, interpret=InterpretGPUParams(),
                                                recip=recip)
    assert len(np.unique(np.asarray(sbits))) > 100
    mask = _finite_bytes(x, (1, 16))
    x32 = np.asarray(x.astype(jnp.float32))
    codes, s_np, d_np = npref.quantize_nvfp4_1x16(x32)
    assert_packed_equal((packed, sbits, dec), (npref.pack_codes(codes), s_np, d_np), mask)
    core = packed_bits(fp4jax.quantize(x, fp4jax.NVFP4))
    assert_packed_equal((packed, sbits, dec), core, mask, _finite_scales(x, (1, 16)))


@needs_interpret
def test_2d_interpret_matches_fp4jax_and_numpy():
    x = _block_input(96, 1024, 2, tile=(16, 16))
    packed, sbits, dec = qk.quantize_nvfp4_2d(x, interpret=InterpretGPUParams())
    assert sbits.shape == (6, 64) and packed.shape == (96, 512)
    assert len(np.unique(np.asarray(sbits))) > 90
    mask = _finite_bytes(x, (16, 16))
    x32 = np.asarray(x.astype(jnp.float32))
    codes, s_np, d_np = npref.quantize_nvfp4_16x16(x32)
    assert_packed_equal((packed, sbits, dec), (npref.pack_codes(codes), s_np, d_np), mask)
    core = packed_bits(fp4jax.quantize(x, fp4jax.NVFP4, block_2d=True))
    assert_packed_equal((packed, sbits, dec), core, mask, _finite_scales(x, (16, 16)))


@needs_interpret
@pytest.mark.parametrize("block_2d", [False, True])
def test_unsafe_dec_takes_recip_rn_path(block_2d):
    # amax <= 2^-110: dec <= 2^-121 is outside the table's range; "auto" must give
    # recip_rn's (and fp4jax's) bits
    x = _block_input(32, 1024, 3, tile=(16, 16) if block_2d else (1, 16))
    x = jnp.where(jnp.isfinite(x), x, 1.0)
    amax = float(jnp.max(jnp.abs(x.astype(jnp.float32))))
    x = x * jnp.bfloat16(2.0 ** (-110 - int(np.ceil(np.log2(amax)))))  # exact, amax <= 2^-110
    _, dec = cm.global_scales(x)
    assert not bool(cm.recip_table(dec)[0])
    f = qk.quantize_nvfp4_2d if block_2d else qk.quantize_nvfp4_1x16
    auto = f(x, interpret=InterpretGPUParams(), recip="auto")
    rn = f(x, interpret=InterpretGPUParams(), recip="rn")
    for a, b in zip(auto, rn, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    mask = np.ones(auto[0].shape, bool)
    assert_packed_equal(auto, packed_bits(fp4jax.quantize(x, fp4jax.NVFP4, block_2d=block_2d)),
                        mask)


@pytest.mark.parametrize("recip", ["auto", "table"])
def test_1x16_table_kernel_lowers_for_cuda(recip):
    x = jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16)
    s = jax.ShapeDtypeStruct((), jnp.float32)
    exp = export_cuda(lambda x, e, d: qk.quantize_nvfp4_1x16_scaled(x, e, d, recip=recip),
                       x, s, s)
    assert "mosaic_gpu" in exp.mlir_module()


@pytest.mark.parametrize("g", [64, 128])
def test_2d_kernel_lowers_for_cuda(g):
    x = jax.ShapeDtypeStruct((512, 14336), jnp.bfloat16)
    exp = export_cuda(functools.partial(qk.quantize_nvfp4_2d, g=g), x)
    assert "mosaic_gpu" in exp.mlir_module()


def test_2d_supported_shapes_and_reasons():
    assert qk.supported_2d((32, 1024), jnp.bfloat16)
    assert not qk.supported_2d((24, 1024), jnp.bfloat16)
    assert not qk.supported_2d((32, 1000), jnp.bfloat16)
    assert not qk.supported_2d((32, 1024), jnp.float32)
    r = dispatch.quantize_unsupported_reason
    assert "16x16" in r((24, 1024), jnp.bfloat16, block_2d=True)
    assert "stochastic" in r((32, 1024), jnp.bfloat16, block_2d=True, rounding="stochastic")
    if not dispatch.on_sm90():
        assert r((2, 32, 1024), jnp.bfloat16, block_2d=True) == "no sm_90 GPU"


@needs_interpret
@pytest.mark.parametrize("block_2d", [False, True])
def test_dispatch_kernel_path_wiring(monkeypatch, block_2d):
    # pretend to be on an sm_90 GPU and run the kernels in interpret mode: the
    # QuantizedArray from dispatch.quantize must equal fp4jax.quantize's (stacked weights)
    monkeypatch.setattr(dispatch, "on_sm90", lambda: True)
    monkeypatch.setattr(dispatch, "mosaic_api_reason", lambda: None)  # any JAX
    for name in ("quantize_nvfp4_2d", "quantize_nvfp4_1x16"):
        monkeypatch.setattr(qk, name, functools.partial(getattr(qk, name),
                                                        interpret=InterpretGPUParams()))
    x = jnp.stack([_block_input(32, 1024, 4, tile=(16, 16)), _block_input(32, 1024, 5)])
    x = jnp.where(jnp.isfinite(x), x, 2.0)
    q = dispatch.quantize(x, fp4jax.NVFP4, block_2d=block_2d, backend="pallas")
    want = fp4jax.quantize(x, fp4jax.NVFP4, block_2d=block_2d)
    assert (q.axis, q.block_2d) == (want.axis, want.block_2d)
    for a, b in ((q.data, want.data), (q.scale, want.scale)):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                      np.asarray(b.astype(jnp.float32)))
    assert float(q.global_scale) == float(want.global_scale)
