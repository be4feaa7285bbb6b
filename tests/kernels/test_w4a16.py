"""W4A16 decode kernel (pallas_kernels/gemm/w4a16_sm90.py): weight layout, decode rule, lowering.

The kernel itself needs an sm_90 GPU (its register-level step has no interpret mode);
on CPU these tests check every piece it is built from against independent NumPy
references, and that it lowers for CUDA. GPU exactness: ``experiments/gpu_check.py w4a16``.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.gemm import w4a16_sm90 as wk
from tests.checks import export_cuda

LUT = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def _codes(n, k, seed=0):
    return np.random.default_rng(seed).integers(0, 16, (n, k), dtype=np.uint8)


def test_word_layout_is_a_permutation_in_fragment_order():
    idx = wk.word_layout(128)
    assert idx.shape == (16, 8)
    assert sorted(idx.ravel().tolist()) == list(range(128))
    # word 8c + 2q + v, slot (i, t) -> k = 64c + 16i + 8v + 2q + t
    for w in range(16):
        c, r = divmod(w, 8)
        q, v = divmod(r, 2)
        for slot in range(8):
            i, t = divmod(slot, 2)
            assert idx[w, slot] == 64 * c + 16 * i + 8 * v + 2 * q + t
    with pytest.raises(ValueError, match="multiple of 64"):
        wk.word_layout(96)


def test_slot_bits_cover_each_bit_once():
    pos = [p for slot in wk._SLOT_BITS for half in slot for p in half]
    assert sorted(pos) == list(range(32))


def test_decode_rule_gives_code_values_in_fragment_order():
    """pack -> decode_words -> register reinterpretation (NumPy model) == LUT[codes] * 2^-126."""
    n, k = 8, 256
    codes = _codes(n, k)
    words = np.asarray(wk.pack_codes(jnp.asarray(codes)))  # (N, K/8)
    assert words.dtype == np.uint32 and words.shape == (n, k // 8)
    for c in range(k // 64):
        parts = wk.decode_words(jnp.asarray(words[:, 8 * c: 8 * c + 8]))
        for i, part in enumerate(parts):
            bits = wk.fragment_reference(np.asarray(part))  # (N, 16) uint16
            vals = bits.view(ml_dtypes.bfloat16).astype(np.float64) * 2.0**126
            k0 = 64 * c + 16 * i
            np.testing.assert_array_equal(vals, LUT[codes[:, k0: k0 + 16]])


def test_decode_rule_all_code_pairs():
    # every (lo, hi) code pair in every slot: 256 words per slot
    a, b = np.meshgrid(np.arange(16), np.arange(16), indexing="ij")
    a, b = a.ravel(), b.ravel()
    for i in range(4):
        w = np.zeros(256, np.uint32)
        for t, code in enumerate((a, b)):
            for bit, pos in zip((3, 2, 1, 0), wk._SLOT_BITS[i][t], strict=True):
                w |= ((code >> bit) & 1).astype(np.uint32) << pos
        out = np.asarray(wk.decode_words(jnp.asarray(w))[i])
        lo = (out & 0xFFFF).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
        hi = (out >> 16).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
        np.testing.assert_array_equal(lo * 2.0**126, LUT[a])
        np.testing.assert_array_equal(hi * 2.0**126, LUT[b])
        # signed zero survives (code 8 is -0)
        assert np.all(np.signbit(lo[a == 8])) and not np.any(np.signbit(lo[a == 0]))


def test_fragment_reference_matches_wgmma_register_order():
    # thread q of a quad holds A columns 2q, 2q+1 (register v = 0) and 8+2q, 9+2q (v = 1)
    words = np.arange(8, dtype=np.uint32).reshape(1, 8) * 0x00020002 + np.uint32(0x00010000)
    bits = wk.fragment_reference(words)[0]
    for q in range(4):
        for v in range(2):
            w = words[0, 2 * q + v]
            assert bits[8 * v + 2 * q] == w & 0xFFFF and bits[8 * v + 2 * q + 1] == w >> 16


@pytest.mark.parametrize("block_2d", [False, True])
def test_prepare_weight_and_reference(block_2d):
    fp4jax = pytest.importorskip("fp4jax")
    kx, kw = jax.random.split(jax.random.key(5))
    x = jax.random.normal(kx, (5, 512)).astype(jnp.bfloat16)
    # rows of very different magnitude: some block scales are E4M3 subnormals
    w = jax.random.normal(kw, (512, 192)) * jnp.logspace(-6, 0, 192)[None, :]
    q = (fp4jax.quantize(w, fp4jax.NVFP4, block_2d=True) if block_2d
         else fp4jax.quantize(w, fp4jax.NVFP4, axis=0))
    assert np.any(np.asarray(q.scale.astype(jnp.float32)) < 2.0**-6) or block_2d
    wp, ws, dec = wk.prepare_weight(q)
    assert wp.shape == (192, 64) and wp.dtype == jnp.uint32
    assert ws.shape == (32, 192) and ws.dtype == jnp.bfloat16
    # the bf16 scales are the E4M3 ones times 2^117, exactly
    s = np.asarray(q.scale.astype(jnp.float32))
    if block_2d:
        s = np.repeat(s, 16, axis=1)
    np.testing.assert_array_equal(np.asarray(ws.astype(jnp.float32)), s * np.float32(2.0**117))
    y = wk.reference_w4a16(x, wp, ws, dec)
    expect = jnp.dot(x.astype(jnp.float32), fp4jax.dequantize(q, jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(np.asarray(y), np.asarray(expect), rtol=1e-5, atol=1e-30)


def test_prepare_weight_rejects_bad_input():
    fp4jax = pytest.importorskip("fp4jax")
    w = jnp.ones((128, 64))
    with pytest.raises(ValueError, match="contraction axis"):
        wk.prepare_weight(fp4jax.quantize(w, fp4jax.NVFP4, axis=1))
    with pytest.raises(ValueError, match="NVFP4"):
        wk.prepare_weight(fp4jax.quantize(w, fp4jax.MXFP4, axis=0))


def test_kernel_rejects_bad_layout():
    x = jnp.zeros((16, 256), jnp.bfloat16)
    wp = jnp.zeros((64, 32), jnp.uint32)
    ws = jnp.zeros((16, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="wp must be"):
        wk.w4a16_matmul(x, wp.astype(jnp.uint8), ws, 1.0)
    with pytest.raises(ValueError, match="ws must be"):
        wk.w4a16_matmul(x, wp, ws.astype(jnp.uint8), 1.0)
    with pytest.raises(ValueError, match="M must be"):
        wk.w4a16_matmul(jnp.zeros((300, 256), jnp.bfloat16), wp, ws, 1.0)


@pytest.mark.parametrize("m,k,n,kw", [
    (16, 2048, 256, {}),  # defaults: two compute warpgroups, split-K
    (1, 256, 64, {}),  # one compute warpgroup (N = 64)
    (200, 512, 128, {"compute_wgs": 0, "x_direct": False}),  # one warpgroup, x^T by XLA
    (16, 2048, 256, {"k_wgs": 3}),  # three warpgroups splitting k (run 38: exact, slower)
])
def test_w4a16_kernel_lowers_for_cuda(m, k, n, kw):
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
            jax.ShapeDtypeStruct((n, k // 8), jnp.uint32),
            jax.ShapeDtypeStruct((k // 16, n), jnp.bfloat16),
            jax.ShapeDtypeStruct((), jnp.float32))
    exp = export_cuda(lambda *a: wk.w4a16_matmul(*a, **kw), *args)
    assert "mosaic_gpu" in exp.mlir_module()


def test_kernel_rejects_bad_k_wgs():
    x = jnp.zeros((16, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="k_wgs must be"):
        wk.w4a16_matmul(x, jnp.zeros((64, 32), jnp.uint32), jnp.zeros((16, 64), jnp.bfloat16),
                        1.0, k_wgs=1)


def test_default_config_fits_and_divides():
    for m in (1, 16, 64, 256):
        for k, n in ((8192, 8192), (4096, 14336), (14336, 4096), (1024, 320), (512, 128)):
            cfg = wk.default_config(m, k, n)
            mp = next(p for p in (16, 32, 64, 128, 256) if p >= m)
            cta_n = wk.TILE_N * max(cfg["compute_wgs"], 1)
            assert n % cta_n == 0 and k % cfg["tile_k"] == 0
            assert (k // cfg["tile_k"]) % cfg["split_k"] == 0
            # run 35: (2, 256, 2 stages) at M=128 asked for 237,600 bytes of 232,448
            smem = wk._smem_bytes(mp, cfg["tile_k"], cfg["compute_wgs"], cfg["stages"])
            assert smem <= wk.SMEM_BUDGET, (m, k, n, cfg, smem)


def test_dispatch_w4a16_matches_xla_on_cpu():
    fp4jax = pytest.importorskip("fp4jax")
    from pallas_kernels import dispatch

    kx, kw = jax.random.split(jax.random.key(9))
    x = jax.random.normal(kx, (2, 3, 256)).astype(jnp.bfloat16)
    q = fp4jax.quantize(jax.random.normal(kw, (256, 128)), fp4jax.NVFP4, axis=0)
    y = dispatch.w4a16_matmul(x, q, out_dtype=jnp.float32)
    assert y.shape == (2, 3, 128)
    ref = jnp.dot(x.astype(jnp.float32), fp4jax.dequantize(q, jnp.float32),
                  precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(ref))
    if not dispatch.on_sm90():
        with pytest.raises(ValueError, match="pallas W4A16 kernel unavailable"):
            dispatch.w4a16_matmul(x, q, backend="pallas")
