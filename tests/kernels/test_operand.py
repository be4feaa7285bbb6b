"""CPU tests of the fused NVFP4 GEMM-operand kernels (``pallas_kernels/quantize/operand_sm90``)
and of ``fp4jax.dot``'s kernel path.

* Each kernel (1x16 rows, 16x1 columns with and without the RHT, 16x16; round-to-nearest
  and stochastic rounding) runs in Mosaic GPU interpret mode and is compared bit for bit
  with the XLA path (``scaled_data(fp4jax.quantize(...))`` in bf16) and, for round-to-
  nearest, with the NumPy references (``pallas_kernels/reference.py``,
  ``tests/reference.py``'s butterfly), on inputs with NaN, Inf, -0, tiny and huge values.
* The real kernels are lowered for CUDA on this machine (``jax.export``).
* ``fp4jax.dot`` forward + backward with ``FP4JAX_KERNELS=interpret`` (all five
  quantizations through the kernels, or some falling back to XLA) equals the XLA path
  bit for bit.
GPU exactness and speed: ``experiments/gpu_check.py rows cols 2d amax dot``,
``experiments/bench_kernels.py fakequant1 dotkern1``.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy
fp4jax = pytest.importorskip("fp4jax")

from fp4jax import quantization as qz  # noqa: E402
from fp4jax.formats import NVFP4  # noqa: E402
from fp4jax.hadamard import default_signs, random_hadamard_transform  # noqa: E402
from pallas_kernels import reference as npref  # noqa: E402
from pallas_kernels.quantize import common_sm90 as cm  # noqa: E402
from pallas_kernels.quantize import operand_sm90 as fq  # noqa: E402
from tests import reference as ref  # noqa: E402
from tests.checks import export_cuda  # noqa: E402
from tests.interpret import InterpretGPUParams, needs_interpret  # noqa: E402
from tests.kernel_inputs import mismatches, wild_input  # noqa: E402

IP = InterpretGPUParams() if InterpretGPUParams is not None else None
SIGNS = np.asarray(default_signs(16), np.float32)


def _np_scaled(codes, sbits, scale_repeat):
    """NumPy: decode(codes) * E4M3 scale (broadcast by ``scale_repeat``), in bf16 bits."""
    s = np.asarray(sbits, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return (npref.decode_codes(codes) * scale_repeat(s)).astype(ml_dtypes.bfloat16)


@functools.partial(jax.jit, static_argnames=("axis", "block_2d", "rht"))
def _xla_scaled(x, axis, *, key=None, block_2d=False, rht=False):
    """The XLA path's scaled operand and tensor scale, jitted as the library runs it (one
    compiled program a configuration instead of ~50 eagerly compiled operations)."""
    xin = random_hadamard_transform(x, axis=0, size=16, signs=SIGNS) if rht else x
    q = qz.quantize_unchecked(xin, key, NVFP4, axis, block_2d,
                          "stochastic" if key is not None else "nearest")
    return qz.scaled_data(q, jnp.bfloat16), q.global_scale


def _rounding_inputs():
    """float32 values around every E2M1 grid point and tie, random magnitudes over the
    whole float32 range (subnormals included), both signs."""
    rng = np.random.default_rng(3)
    grid = np.array([0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8],
                    np.float32)
    near = (grid[:, None].view(np.int32) + np.arange(-3, 4, dtype=np.int32)).view(np.float32)
    rnd = np.concatenate([rng.uniform(0, 7, 20000), np.exp2(rng.uniform(-149, 127, 4000)),
                          rng.uniform(0, 1, 4000) * 2.0**-126]).astype(np.float32)
    v = np.concatenate([near.ravel(), grid, rnd, [np.float32(np.inf)]])
    v = v[np.isfinite(v) | np.isinf(v)]
    return np.concatenate([v, -v]).astype(np.float32)


def test_kernel_element_rounding_is_the_core_rule():
    """The kernels' full-rate E2M1 rounding (bit tricks, no int<->float conversion) gives
    the core rule's bits: numerics.round_to_grid (nearest) and stochastic_round_to_grid
    with u = (b + 1/2)/256 for every byte b (via sr_uniform on each byte position)."""
    from fp4jax import numerics as nm

    v = jnp.asarray(_rounding_inputs())
    finite = np.isfinite(np.asarray(v))
    want = jnp.sign(v) * nm.round_to_grid(jnp.abs(v), nm.E2M1, "nearest")
    got = jax.jit(lambda a: cm.e2m1_value(a, None, True))(v)
    np.testing.assert_array_equal(np.abs(np.asarray(got))[finite],
                                  np.abs(np.asarray(want))[finite])
    np.testing.assert_array_equal(np.signbit(np.asarray(got)), np.signbit(np.asarray(v)))
    assert np.all(np.asarray(got)[~finite] == 6.0 * np.sign(np.asarray(v)[~finite]))
    rng = np.random.default_rng(4)
    b = jnp.asarray(rng.integers(0, 256, v.shape), jnp.int32)
    for i in range(4):  # the byte at position i of a word, the others random
        word = (b << (8 * i)) | jnp.asarray(rng.integers(0, 2**31, v.shape) & ~(
            0xFF << (8 * i)), jnp.int32) if i < 3 else (b << 24) | jnp.asarray(
            rng.integers(0, 2**24, v.shape), jnp.int32)
        u = jax.jit(lambda w, i=i: cm.sr_uniform(w, i))(word)
        np.testing.assert_array_equal(np.asarray(u), (np.asarray(b) + 0.5) / 256)
        want = jnp.sign(v) * nm.stochastic_round_to_grid(jnp.abs(v), nm.E2M1, u)
        got = jax.jit(lambda a, uu: cm.e2m1_value(a, uu, True))(v, u)
        np.testing.assert_array_equal(np.asarray(got)[finite], np.asarray(want)[finite])


@needs_interpret
@pytest.mark.parametrize("sr", [False, True])
def test_rows_kernel_matches_xla_and_numpy(sr):
    x = wild_input((32, 1024) if sr else (32, 512), 0, block=16)
    key = jax.random.key(3) if sr else None
    got, dec = fq.fq_rows(x, key, interpret=IP)
    want, wdec = _xla_scaled(x, -1, key=key)
    assert mismatches(got, want) == 0 and float(dec) == float(wdec)
    if sr:  # the random bits really matter: round-to-nearest differs
        assert mismatches(got, _xla_scaled(x, -1)[0]) > 1000
        other, _ = fq.fq_rows(x, jax.random.key(4), interpret=IP)
        assert mismatches(got, other) > 1000
    else:
        codes, sb, _ = npref.quantize_nvfp4_1x16(np.asarray(x, np.float32))
        want_np = _np_scaled(codes, sb, lambda s: np.repeat(s, 16, -1))
        assert mismatches(got, want_np.astype(np.float32)) == 0


@needs_interpret
@pytest.mark.parametrize("sr", [False, True])
@pytest.mark.parametrize("rht", [False, True])
def test_cols_kernel_matches_xla_and_numpy(sr, rht):
    x = wild_input((32, 1024), 1, block=16)
    key = jax.random.key(5) if sr else None
    got, dec = fq.fq_cols(x, key, signs=jnp.asarray(SIGNS) if rht else None, interpret=IP)
    want, wdec = _xla_scaled(x, 0, key=key, rht=rht)
    assert mismatches(got, want) == 0 and float(dec) == float(wdec)
    if sr:
        assert mismatches(got, _xla_scaled(x, 0, rht=rht)[0]) > 1000
    else:
        xt = np.asarray(x, np.float32).T  # (C, R): blocks along the original rows
        if rht:
            xt = ref.ref_fwht_f32(xt.reshape(-1, 16) * SIGNS, 16).reshape(xt.shape)
        codes, sb, _ = npref.quantize_nvfp4_1x16(xt)
        want_np = _np_scaled(codes, sb, lambda s: np.repeat(s, 16, -1)).T
        assert mismatches(got, want_np.astype(np.float32)) == 0


@needs_interpret
def test_sr_kernels_with_the_gpu_tiling_match_xla():
    """The draw offsets of the GPU tilings (several CTA tiles per row and per column
    strip), run in interpret mode: rows SR with 2 row quads x 64 blocks per tile (2 x 2
    tiles), cols SR (with RHT) in strips of 64 column blocks."""
    key = jax.random.key(21)
    x = wild_input((16, 2048), 6, block=16)
    enc, dec = cm.global_scales(x)
    got = fq.fq_rows_scaled(x, cm.scalars(enc, dec), cm.key_words(key), sr=True, g=64, rq=2,
                            interpret=IP)
    assert mismatches(got, _xla_scaled(x, -1, key=key)[0]) == 0
    x = wild_input((16, 2048), 7, block=16)
    got, _ = fq.fq_cols(x, key, signs=jnp.asarray(SIGNS), interpret=IP, g=64)
    assert mismatches(got, _xla_scaled(x, 0, key=key, rht=True)[0]) == 0
    with pytest.raises(ValueError, match="tiling"):
        fq.fq_rows_scaled(x, cm.scalars(enc, dec), cm.key_words(key), sr=True, g=48,
                          interpret=IP)


@needs_interpret
def test_sr_rows_compact_tiles_match_xla():
    """The ``compact`` SR rows tile (a quad's four rows as a loop: the row picks its draw
    word and bytes with integer masks and shifts) gives the same bits as the XLA path."""
    key = jax.random.key(24)
    x = wild_input((16, 2048), 10, block=16)
    enc, dec = cm.global_scales(x)
    got = fq.fq_rows_scaled(x, cm.scalars(enc, dec), cm.key_words(key), sr=True, g=64, rq=2,
                            compact=True, interpret=IP)
    assert mismatches(got, _xla_scaled(x, -1, key=key)[0]) == 0


@needs_interpret
@pytest.mark.parametrize("c,rq", [(256, 8), (512, 2), (768, 4)])
def test_sr_rows_flat_quads_match_xla(c, rq):
    """The flat SR rows layout of narrow matrices (row r of ``rq`` quads as one run of
    64-block register tiles; the GPU's default at these widths), run in interpret mode on
    the same tiles: bit for bit with the XLA path, the draws included."""
    key = jax.random.key(23)
    x = wild_input((32, c), 9, block=16)
    assert fq.flat_quads(32, c, rq) == rq
    enc, dec = cm.global_scales(x)
    got = fq.fq_rows_scaled(x, cm.scalars(enc, dec), cm.key_words(key), sr=True, rq=rq,
                            flat=True, interpret=IP)
    assert mismatches(got, _xla_scaled(x, -1, key=key)[0]) == 0


def test_flat_quads_widths():
    assert fq.flat_quads(16384, 256) == 8 and fq.flat_quads(16384, 512) == 4
    assert fq.flat_quads(16384, 768) == 4  # 48 blocks: 4 quads make 3 tiles of 64
    assert fq.flat_quads(16384, 1024) is None  # 64 blocks a row: the quad tiles
    assert fq.flat_quads(1024, 1296) is None  # 81 blocks: overhanging quad tiles
    assert fq.flat_quads(8, 256) is None  # 2 quads, 4 needed
    assert fq.flat_quads(32, 512, rq=3) is None
    x = jnp.zeros((16, 256), jnp.bfloat16)  # 4 quads: rq=8 does not fit
    with pytest.raises(ValueError, match="flat=True"):
        fq.fq_rows_scaled(x, cm.scalars(jnp.float32(1), jnp.float32(1)), cm.key_words(None),
                          sr=True, flat=True, rq=8, interpret=IP)


@needs_interpret
@pytest.mark.parametrize("c,g", [(768, 16), (768, 48)])
def test_narrow_cols_kernels_with_the_gpu_tiling_match_xla(c, g):
    """Matrices narrower than 1024 columns (the strided-layout strips: 256, 512, 768
    columns, as a small model's wgrad operands are): cols SR after the RHT and the rotated
    amaxes, in strips of ``g`` column blocks (the GPU's draw offsets), bit for bit. The
    strips of 16 blocks (the GPU's at C = 256) run three to a row here (their first is
    C = 256's one strip; the strip code depends on ``g`` and the offsets, not on C), those
    of 48 blocks (C = 768's) one."""
    key = jax.random.key(22)
    x = wild_input((32, c), 8, block=16)
    got, dec = fq.fq_cols(x, key, signs=jnp.asarray(SIGNS), interpret=IP, g=g)
    want, wdec = _xla_scaled(x, 0, key=key, rht=True)
    assert mismatches(got, want) == 0 and float(dec) == float(wdec)
    got, _ = fq.fq_cols(x, interpret=IP, g=g)
    assert mismatches(got, _xla_scaled(x, 0)[0]) == 0
    plain, rot = fq.cols_amaxes(x, jnp.asarray(SIGNS), interpret=IP, g=g)
    r = np.asarray(random_hadamard_transform(x, axis=0, size=16, signs=SIGNS))
    xa = np.asarray(x, np.float32)
    for got_a, arr in ((rot, r), (plain, xa)):
        want_a = np.max(np.where(np.isfinite(arr), np.abs(arr), 0))
        assert np.asarray(got_a).view(np.uint32) == np.float32(want_a).view(np.uint32)


def test_strip_layout_by_width():
    from jax.experimental.pallas import mosaic_gpu as plgpu

    assert cm.strip_layout(64) == plgpu.Layout.WGMMA
    assert cm.strip_layout(128) == plgpu.Layout.WGMMA
    for g in (16, 32, 48):
        lay = cm.strip_layout(g)
        assert lay.layout_cls == plgpu.Layout.WG_STRIDED
    with pytest.raises(ValueError, match="multiple of 16"):
        cm.strip_layout(8)
    assert [fq._cols_g(n) for n in (64, 128, 48, 16, 32, 80, 96)] == [64, 64, 48, 16, 32, 16, 48]
    with pytest.raises(ValueError, match="multiple of 16"):
        fq._cols_g(40)


@needs_interpret
@pytest.mark.parametrize("wild", [False, True])
def test_rht_cols_amax_is_the_finite_amax_of_the_rotation(wild):
    x = wild_input((32, 1024), 4, block=16) if wild else jax.random.normal(
        jax.random.key(2), (32, 1024)).astype(jnp.bfloat16)
    got = fq.rht_cols_amax(x, jnp.asarray(SIGNS), interpret=IP)
    r = np.asarray(random_hadamard_transform(x, axis=0, size=16, signs=SIGNS))
    want = np.max(np.where(np.isfinite(r), np.abs(r), 0))
    assert np.asarray(got).view(np.uint32) == np.float32(want).view(np.uint32)
    # one read for both tensor amaxes (rows and rotated cols operands of the same x)
    plain, rot = fq.cols_amaxes(x, jnp.asarray(SIGNS), interpret=IP)
    xa = np.asarray(x, np.float32)
    want_plain = np.max(np.where(np.isfinite(xa), np.abs(xa), 0))
    assert np.asarray(rot).view(np.uint32) == np.float32(want).view(np.uint32)
    assert np.asarray(plain).view(np.uint32) == np.float32(want_plain).view(np.uint32)
    assert float(plain) != float(rot)


@needs_interpret
def test_2d_kernel_matches_xla_and_numpy():
    x = wild_input((32, 1024), 2, block=16)
    got, dec = fq.fq_2d(x, interpret=IP)
    want, wdec = _xla_scaled(x, -1, block_2d=True)
    assert mismatches(got, want) == 0 and float(dec) == float(wdec)
    codes, sb, _ = npref.quantize_nvfp4_16x16(np.asarray(x, np.float32))
    want_np = _np_scaled(codes, sb, lambda s: np.repeat(np.repeat(s, 16, 0), 16, 1))
    assert mismatches(got, want_np.astype(np.float32)) == 0


def _data_f32(shape, seed):
    """``_data`` with float32 mantissa bits below bf16's set at random where finite (so
    the kernel must quantize the float32 values, not their bf16 roundings), and a tile of
    values that round differently from their bf16 roundings near E2M1 ties."""
    x = np.asarray(wild_input(shape, seed, block=16), np.float32)
    rng = np.random.default_rng(seed + 100)
    low = rng.integers(0, 1 << 16, shape, dtype=np.uint32)
    bits = x.view(np.uint32)
    x = np.where(np.isfinite(x), (bits | low).view(np.float32), x)
    x[16:32, 16:32] = 6.0 * np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 32,
                                     np.float32).reshape(16, 16) / 6.0 * (1 + 2.0**-20)
    return jnp.asarray(x)


@needs_interpret
def test_2d_kernel_float32_input_matches_xla_and_numpy():
    """A float32 weight is quantized from its float32 values (the master copy a functional
    user passes): bit for bit with the XLA path and the NumPy reference."""
    x = _data_f32((32, 1024), 12)
    assert x.dtype == jnp.float32 and fq.supported_2d(x.shape, x.dtype)
    got, dec = fq.fq_2d(x, interpret=IP)
    assert got.dtype == jnp.bfloat16 and got.shape == x.shape
    want, wdec = _xla_scaled(x, -1, block_2d=True)
    assert mismatches(got, want) == 0 and float(dec) == float(wdec)
    codes, sb, _ = npref.quantize_nvfp4_16x16(np.asarray(x, np.float32))
    want_np = _np_scaled(codes, sb, lambda s: np.repeat(np.repeat(s, 16, 0), 16, 1))
    assert mismatches(got, want_np.astype(np.float32)) == 0
    # and not what quantizing the bf16-rounded weight gives (the test can tell them apart)
    assert mismatches(got, _xla_scaled(x.astype(jnp.bfloat16), -1, block_2d=True)[0]) > 0


def test_supported_shapes():
    bf = jnp.bfloat16
    assert fq.supported_rows((16, 256), bf) and not fq.supported_rows((16, 255), bf)
    assert not fq.supported_rows((16, 256), jnp.float32)
    assert not fq.supported_rows((8, 16), bf)  # fewer than 256 blocks
    # stochastic rounding takes rows in quads of >= 64 blocks
    assert fq.supported_rows((32, 1024), bf, sr=True)
    assert not fq.supported_rows((32, 512), bf, sr=True)
    assert not fq.supported_rows((33, 4096), bf, sr=True) and fq.supported_rows((33, 4096), bf)
    assert not fq.supported_rows((34, 4096), bf, sr=True) and fq.supported_rows((34, 4096), bf)
    assert fq.supported_rows((36, 4096), bf, sr=True)
    # the operand kernel's SR tiles may overhang a row (TMA skips the blocks past it)
    assert fq.supported_rows((32, 512), bf, sr=True, padded=True)
    assert fq.supported_rows((64, 768), bf, sr=True, padded=True)
    assert not fq.supported_rows((34, 768), bf, sr=True, padded=True)  # rows in quads
    assert not fq.supported_rows((32, 520), bf, sr=True, padded=True)  # C % 16
    assert fq.supported_cols((16, 1024), bf) and not fq.supported_cols((24, 1024), bf)
    # narrow matrices (strided register layout below 1024 columns): C % 256
    assert fq.supported_cols((16, 512), bf) and fq.supported_cols((16, 768), bf)
    assert fq.supported_cols((16, 256), bf) and not fq.supported_cols((16, 128), bf)
    assert not fq.supported_cols((16, 640), bf)
    assert fq.supported_2d((32, 2048), bf) and not fq.supported_2d((8, 1024), bf)
    with pytest.raises(ValueError, match="fq_cols needs"):
        fq.fq_cols_scaled(jnp.zeros((24, 1024), bf), cm.scalars(jnp.float32(1), jnp.float32(1)),
                          cm.key_words(None))


@pytest.mark.parametrize("variant", ["rows", "rows_sr", "cols", "cols_rht_sr", "2d", "amax",
                                     "amax2", "rows_sr_c1024", "rows_tiled", "cols_steps",
                                     "cols_c768", "cols_c256", "amax2_c512", "rows_sr_c256",
                                     "rows_sr_c768", "2d_f32", "rows_sr_compact"])
def test_kernels_lower_for_cuda(variant):
    key = jax.random.key(0)
    f = {
        "rows": lambda x: fq.fq_rows(x),
        # the tuning knobs (run 40): two tiles a step, 128-block register tiles, 2 steps
        "rows_tiled": lambda x: fq.fq_rows(x, kt=2, chunk=128, steps=2, recip="rn"),
        "cols_steps": lambda x: fq.fq_cols(x, signs=jnp.asarray(SIGNS), steps=2),
        "rows_sr": lambda x: fq.fq_rows(x, key),
        "cols": lambda x: fq.fq_cols(x),
        "cols_rht_sr": lambda x: fq.fq_cols(x, key, signs=jnp.asarray(SIGNS)),
        "2d": lambda x: fq.fq_2d(x),
        "2d_f32": lambda x: fq.fq_2d(x.astype(jnp.float32)),
        "amax": lambda x: fq.rht_cols_amax(x, jnp.asarray(SIGNS)),
        "amax2": lambda x: fq.cols_amaxes(x, jnp.asarray(SIGNS)),
        "rows_sr_c1024": lambda x: fq.fq_rows(x.reshape(512, 1024), key),  # 64-block quads
        # SR tuning knobs: rows and quads as loops, 4 double-buffered tiles a CTA
        "rows_sr_compact": lambda x: fq.fq_rows(x, key, compact=True, steps=4, rq=2, g=64),
        # narrow matrices: strided-layout strips of 48, 16 and 32 column blocks
        "cols_c768": lambda x: fq.fq_cols(x[:, :768], key, signs=jnp.asarray(SIGNS)),
        "cols_c256": lambda x: fq.fq_cols(x[:, :256], key, signs=jnp.asarray(SIGNS)),
        "amax2_c512": lambda x: fq.cols_amaxes(x[:, :512], jnp.asarray(SIGNS)),
        # SR rows in the flat quad layout: 8 quads of 16 blocks, 4 of 48 (3 tiles)
        "rows_sr_c256": lambda x: fq.fq_rows(x[:, :256], key),
        "rows_sr_c768": lambda x: fq.fq_rows(x[:, :768], key),
    }[variant]
    exp = export_cuda(f, jax.ShapeDtypeStruct((256, 2048), jnp.bfloat16))
    assert "mosaic_gpu" in exp.mlir_module()


def test_rows_tiling_rejects_bad_knobs():
    x = jnp.zeros((256, 2048), jnp.bfloat16)  # 128 tiles of 256 blocks
    with pytest.raises(ValueError, match="chunk=96"):
        fq.fq_rows(x, chunk=96)
    with pytest.raises(ValueError, match="kt=3"):
        fq.fq_rows(x, kt=3)
    with pytest.raises(ValueError, match="g=64 x steps=3"):
        fq.fq_cols(x, steps=3)


def _dot_fwd_bwd(m, recipe="nvfp4", wdtype=jnp.bfloat16, out=None):
    kx, kw, kc = jax.random.split(jax.random.key(m), 3)
    x = jax.random.normal(kx, (m, 1024)).astype(jnp.bfloat16)
    w = (0.05 * jax.random.normal(kw, (1024, 1024))).astype(wdtype)
    ct = jax.random.normal(kc, (m, 1024)).astype(jnp.bfloat16)
    key = jax.random.key(9)

    def loss(x, w):
        y = fp4jax.dot(x, w, recipe=recipe, key=key, preferred_element_type=out)
        return (y.astype(jnp.float32) * ct).sum(), y

    (v, y), (dx, dw) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)
    return [np.asarray(a, np.float32) for a in (y, v, dx, dw)]


@needs_interpret
@pytest.mark.parametrize("m", [16, 24])  # 24 tokens: the 16x1 kernels fall back to XLA
def test_dot_kernel_path_equals_xla_path(monkeypatch, m):
    monkeypatch.setenv("FP4JAX_KERNELS", "off")
    want = _dot_fwd_bwd(m)
    monkeypatch.setenv("FP4JAX_KERNELS", "interpret")
    lowered = jax.jit(lambda x, w: fp4jax.dot(x, w, key=jax.random.key(0))).lower(
        jnp.zeros((m, 1024), jnp.bfloat16), jnp.zeros((1024, 1024), jnp.bfloat16))
    assert "pallas" in lowered.as_text() or "callback" in lowered.as_text()
    got = _dot_fwd_bwd(m)
    for g, w, name in zip(got, want, ("y", "loss", "dx", "dw"), strict=True):
        assert (g.view(np.uint32) == w.view(np.uint32)).all(), name


@needs_interpret
def test_dot_float32_weight_takes_the_2d_kernel(monkeypatch):
    """A float32 weight with a bf16 output (``preferred_element_type``): its 16x16
    operand comes from the kernel (float32 input), the rest as with a bf16 weight; the
    forward and backward equal the XLA path's bit for bit."""
    monkeypatch.setenv("FP4JAX_KERNELS", "off")
    want = _dot_fwd_bwd(16, wdtype=jnp.float32, out=jnp.bfloat16)
    monkeypatch.setenv("FP4JAX_KERNELS", "interpret")
    seen = []
    real = fq.fq_2d_scaled

    def spy(x, *a, **k):
        seen.append(x.dtype)
        return real(x, *a, **k)

    monkeypatch.setattr(fq, "fq_2d_scaled", spy)
    got = _dot_fwd_bwd(16, wdtype=jnp.float32, out=jnp.bfloat16)
    assert jnp.float32 in seen, seen
    for g, w, name in zip(got, want, ("y", "loss", "dx", "dw"), strict=True):
        assert (g.view(np.uint32) == w.view(np.uint32)).all(), name


@needs_interpret
def test_dot_kernel_path_under_vmap_equals_xla_path(monkeypatch):
    """Under vmap the kernel path's operands fall back to the (vmapped) XLA path: same bits,
    no Pallas batching error."""
    x = jax.random.normal(jax.random.key(1), (2, 16, 1024)).astype(jnp.bfloat16)
    w = (0.05 * jax.random.normal(jax.random.key(2), (1024, 1024))).astype(jnp.bfloat16)

    def f(xi, w):
        return (fp4jax.dot(xi, w, key=jax.random.key(3)).astype(jnp.float32) ** 2).sum()

    outs = []
    for mode in ("off", "interpret"):
        monkeypatch.setenv("FP4JAX_KERNELS", mode)
        v, (dx, dw) = jax.vmap(jax.value_and_grad(f, argnums=(0, 1)), in_axes=(0, None))(x, w)
        outs.append([np.asarray(a, np.float32) for a in (v, dx, dw)])
    for a, b in zip(*outs, strict=True):
        assert (a.view(np.uint32) == b.view(np.uint32)).all()


def _auto_mode(mkn: int, batch: int = 1) -> str:
    """``"on"`` when the automatic choice takes the Hopper kernels for an ``M*K*N == mkn``
    call traced here (``fp4jax.sharding.xla_partitions`` as ``fp4jax.dot`` asks it), else
    ``"off"``."""
    from fp4jax import backends as B

    call = B.DotCall(fp4jax.recipes.nvfp4(), batch, mkn, 1, 1,
                     fp4jax.sharding.xla_partitions())
    return "on" if B.select(None, call)[0].name == "pallas" else "off"


def test_auto_mode_size_threshold_and_devices(monkeypatch):
    from pallas_kernels import dot_sm90

    monkeypatch.setenv("FP4JAX_KERNELS", "auto")
    monkeypatch.setattr(dot_sm90, "on_sm90", lambda: True)
    monkeypatch.setattr(dot_sm90, "mosaic_api_reason", lambda: None)  # any JAX
    big = dot_sm90.KERNEL_AUTO_MIN_MKN
    want = "on" if jax.device_count() == 1 else "off"
    assert _auto_mode(big) == want
    assert _auto_mode(big - 1) == "off"
    # the small preset's k/v projections with 8,192 tokens a device (two-GPU data parallel),
    # where XLA's path cost 3x the kernels' (2026-11-26)
    assert _auto_mode(8192 * 512 * 256) == want
    assert _auto_mode(big, batch=2) == "off"  # batched dot_general
    # a program on one device of a multi-device host (fp4jax.sharding.one_device): the
    # kernels as on a one-device host; nested off again, and never for small or batched GEMMs
    with fp4jax.sharding.one_device():
        assert _auto_mode(big) == "on" and _auto_mode(big - 1) == "off"
        assert _auto_mode(big, batch=2) == "off"
        with fp4jax.sharding.one_device(False):
            assert _auto_mode(big) == want
    assert _auto_mode(big) == want
    with pytest.raises(TypeError, match="active must be a bool"):
        with fp4jax.sharding.one_device("yes"):
            pass
    monkeypatch.setenv("FP4JAX_KERNELS", "on")
    assert _auto_mode(1) == "on"
    monkeypatch.setattr(dot_sm90, "on_sm90", lambda: False)
    assert _auto_mode(big) == "off"
    with fp4jax.sharding.one_device():
        assert _auto_mode(big) == "off"  # no sm_90 GPU


def test_kernel_mode_setting(monkeypatch):
    from fp4jax import backends as B

    for v, setting, want in (("off", "off", "off"), ("0", "off", "off"),
                             ("interpret", "interpret", "on"), ("", "auto", "off"),
                             ("auto", "auto", "off"), ("on", "on", "off")):
        monkeypatch.setenv("FP4JAX_KERNELS", v)  # "on"/"auto" need an sm_90 GPU
        assert B.kernels_setting() == setting
        if jax.devices()[0].platform == "cpu":
            assert _auto_mode(2**40) == want, v
    monkeypatch.setenv("FP4JAX_KERNELS", "fast")
    with pytest.raises(ValueError, match="FP4JAX_KERNELS"):
        B.kernels_setting()


@pytest.mark.parametrize("kind", ["rows", "rows_sr", "cols_rht_sr", "2d"])
def test_operand_kernels_lower_for_cuda_with_a_scalar_row(kind):
    """``dot_sm90.make_operands`` passes every kernel the flat scalars of all operands of a
    tensor and the operand's row (``sc_row``): the kernels still lower for CUDA (Mosaic GPU),
    at the presets' widths (768 columns: overhanging SR tiles, strided column strips)."""
    sc = jax.ShapeDtypeStruct((3 * cm.SC_WIDTH,), jnp.float32)
    kw = jax.ShapeDtypeStruct((3,), jnp.int32)
    shape = (1024, 1024) if kind == "2d" else (16384, 768)
    x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    f = {"rows": lambda x, s, k: fq.fq_rows_scaled(x, s, k, sc_row=2),
         "rows_sr": lambda x, s, k: fq.fq_rows_scaled(x, s, k, sr=True, sc_row=1),
         "cols_rht_sr": lambda x, s, k: fq.fq_cols_scaled(x, s, k, sr=True, rht=True, sc_row=1),
         "2d": lambda x, s, k: fq.fq_2d_scaled(x, s, sc_row=0)}[kind]
    exp = export_cuda(f, x, sc, kw)
    assert "mosaic_gpu" in exp.mlir_module()
