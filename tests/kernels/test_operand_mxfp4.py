"""CPU tests of the MXFP4 operand kernels (``pallas_kernels/quantize/operand_sm90`` with
``fmt=MXFP4`` / ``MXFP4_OCP``: 1x32 rows, 32x1 columns with the RHT-32, round-to-nearest
and stochastic rounding) and of ``fp4jax.dot``'s kernel path for the ``mxfp4`` recipe.

* The block scale inside the kernels is the core's ``block_decode_scale`` itself; its
  power-of-two round-up (``numerics.round_to_grid(.., "up")`` on E8M0, from the bits) is
  checked against NumPy's ``2**ceil(log2 v)`` over the whole float32 range.
* The rows kernels run in Mosaic GPU interpret mode and equal the XLA path
  (``scaled_data(fp4jax.quantize(...), bfloat16)``) bit for bit, on inputs with NaN, Inf,
  -0, tiny values and values near bf16's maximum (whose MX scale 2**126 makes products
  beyond bf16's range: both sides saturate).
* ``fp4jax.dot`` forward + backward of the ``mxfp4`` recipe with every operand kernel in
  interpret mode (rows RtN and SR, columns with the RHT-32, RtN and SR) equals the XLA
  path bit for bit.
* The kernels lower for CUDA (``jax.export``), and the dispatcher routes MXFP4 specs to them
  (its 32x32 weight tiles and packed MXFP4 to XLA, with reasons).
GPU: ``experiments/gpu_check.py mxfp4`` (bit-identity on fresh inputs, timings).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy
fp4jax = pytest.importorskip("fp4jax")

from fp4jax import numerics as nm  # noqa: E402
from fp4jax import quantization as qz  # noqa: E402
from fp4jax.formats import MXFP4, MXFP4_OCP, MXFP8_E4M3_UP, NVFP4  # noqa: E402
from fp4jax.hadamard import default_signs, random_hadamard_transform  # noqa: E402
from pallas_kernels import dispatch  # noqa: E402
from pallas_kernels.quantize import common_sm90 as cm  # noqa: E402
from pallas_kernels.quantize import operand_sm90 as fq  # noqa: E402
from tests.checks import export_cuda  # noqa: E402
from tests.interpret import InterpretGPUParams, needs_interpret  # noqa: E402
from tests.kernel_inputs import mismatches, wild_input  # noqa: E402

IP = InterpretGPUParams() if InterpretGPUParams is not None else None
SIGNS32 = jnp.asarray(default_signs(32))


@functools.partial(jax.jit, static_argnames=("fmt", "axis", "rht"))
def _xla(x, fmt, axis, key=None, rht=False):
    """The XLA path's scaled operand (bf16), jitted as the library runs it."""
    xin = random_hadamard_transform(x, axis=0, size=32, signs=SIGNS32) if rht else x
    q = qz.quantize_unchecked(xin, key, fmt, axis, False,
                              "stochastic" if key is not None else "nearest")
    return qz.scaled_data(q, jnp.bfloat16)


def test_e8m0_round_up_is_two_to_the_ceil_log2():
    """The MX "up" scale rule on the E8M0 grid (integer ops, run inside the kernels) equals
    NumPy's ``clip(2**ceil(log2 v), 2**-126, 2**127)`` on random float32 bit patterns,
    every power of two and its neighbours, subnormals, zero, Inf and NaN."""
    rng = np.random.default_rng(0)
    p2 = np.arange(1, 255, dtype=np.int64) << 23
    bits = np.concatenate([rng.integers(0, 2**31, 20000), np.arange(0, 4096), p2, p2 + 1,
                           p2 - 1, [0x7F800000, 0x7FC00000, 0x7F7FFFFF]])
    v = bits.astype(np.uint32).view(np.float32)
    got = np.asarray(jax.jit(lambda a: nm.round_to_grid(a, nm.E8M0, "up"))(jnp.asarray(v)))
    with np.errstate(divide="ignore", invalid="ignore"):
        f = v.astype(np.float64)
        want = np.clip(np.exp2(np.ceil(np.log2(np.where(f > 0, f, 2.0**-200)))), 2.0**-126,
                       2.0**127)
    want = np.where(np.isnan(f), np.nan, want)
    assert mismatches(got, want.astype(np.float32)) == 0


def test_is_mx_names_the_two_mxfp4_formats():
    assert cm.is_mx(MXFP4) and cm.is_mx(MXFP4_OCP)
    assert not cm.is_mx(NVFP4) and not cm.is_mx(MXFP8_E4M3_UP)
    assert not cm.is_mx(MXFP4.replace(block_size=16))
    with pytest.raises(ValueError, match="fmt"):
        fq.fq_rows_scaled(jnp.zeros((16, 256), jnp.bfloat16), cm.scalars(1.0, 1.0),
                          cm.key_words(None), fmt=MXFP8_E4M3_UP)


@needs_interpret
@pytest.mark.parametrize("fmt,sr", [(MXFP4, False), (MXFP4, True), (MXFP4_OCP, False)])
def test_mx_rows_kernel_matches_xla(fmt, sr):
    x = wild_input((16, 256), 0, block=32, mx_extremes=True)
    key = jax.random.key(3) if sr else None
    got = fq.fq_rows_scaled(x, cm.scalars(1.0, 1.0), cm.key_words(key), sr=sr,
                            interpret=IP, fmt=fmt)
    assert mismatches(got, _xla(x, fmt, -1, key)) == 0
    if sr:  # the draws matter: round-to-nearest differs
        assert mismatches(got, _xla(x, fmt, -1)) > 200


@needs_interpret
@pytest.mark.parametrize("c,rq", [(256, 8), (512, 4), (768, 8)])
def test_mx_sr_rows_flat_quads_match_xla(c, rq):
    """MX stochastic rounding in the flat rows layout (the GPU's default at 256, 512, 768
    columns: 8, 16, 24 blocks of 32 a row, where a 64-block quad tile would overhang the
    row 8, 4 or 3 times over), run in interpret mode on the same register tiles: bit for
    bit with the XLA path, the draws included."""
    key = jax.random.key(29)
    x = wild_input((32, c), 5, block=32, mx_extremes=True)
    assert fq.flat_quads(32, c, rq, fmt=MXFP4) == rq
    got = fq.fq_rows_scaled(x, cm.scalars(1.0, 1.0), cm.key_words(key), sr=True, rq=rq,
                            flat=True, interpret=IP, fmt=MXFP4)
    assert mismatches(got, _xla(x, MXFP4, -1, key)) == 0


@needs_interpret
@pytest.mark.parametrize("c,rq", [(256, 8), (512, 4)])
def test_mx_sr_rows_flat_shards_are_the_whole_tensors_rows(c, rq):
    """Data parallel (``fp4jax.sharding``): each of two row shards quantized by the flat MX
    SR layout from its first draw (``numerics.row_shard_draw_offset``) gives the whole
    tensor's rows, bit for bit with the XLA path on the whole tensor."""
    from fp4jax.numerics import row_shard_draw_offset

    key = jax.random.key(31)
    x = wild_input((64, c), 7, block=32, mx_extremes=True)
    parts = [fq.fq_rows_scaled(x[32 * i:32 * (i + 1)], cm.scalars(1.0, 1.0),
                               cm.key_words(key, row_shard_draw_offset((32, c), i)), sr=True,
                               rq=rq, flat=True, interpret=IP, fmt=MXFP4) for i in range(2)]
    assert mismatches(jnp.concatenate(parts), _xla(x, MXFP4, -1, key)) == 0


def test_mx_flat_quads_widths():
    """Where the MX SR rows take the flat layout: rows of 8 to 63 (not 64) blocks of 32
    filling whole 512-byte rows of words (a multiple of 8 blocks), about 256 blocks a CTA."""
    assert fq.flat_quads(16384, 256, fmt=MXFP4) == 8  # 8 blocks: 8 quads a 64-block tile
    assert fq.flat_quads(16384, 512, fmt=MXFP4) == 4
    assert fq.flat_quads(16384, 768, fmt=MXFP4) == 8  # 24 blocks: 8 quads make 3 tiles
    assert fq.flat_quads(16384, 2048, fmt=MXFP4) is None  # 64 blocks: the quad tiles
    assert fq.flat_quads(16384, 128, fmt=MXFP4) is None  # 4 blocks: 256-byte rows
    assert fq.flat_quads(16, 256, fmt=MXFP4) is None  # 4 quads, 8 needed
    assert fq.flat_quads(16384, 256) == 8  # NVFP4 at the same width: 16 blocks of 16


def _dot_fwd_bwd(recipe="mxfp4"):
    kx, kw, kc = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(kx, (32, 256)).astype(jnp.bfloat16)
    w = (0.05 * jax.random.normal(kw, (256, 256))).astype(jnp.bfloat16)
    ct = jax.random.normal(kc, (32, 256)).astype(jnp.bfloat16)

    def loss(x, w):
        y = fp4jax.dot(x, w, recipe=recipe, key=jax.random.key(9))
        return (y.astype(jnp.float32) * ct).sum(), y

    (v, y), (dx, dw) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)
    return [np.asarray(a, np.float32) for a in (y, v, dx, dw)]


@needs_interpret
def test_dot_mxfp4_kernel_path_equals_xla_path(monkeypatch):
    """The mxfp4 recipe on the kernel path: x 1x32 rows, dy 1x32 rows with SR, x and dy
    32x1 columns after the RHT-32 (dy with SR) from the kernels, the 32x32 weight from the
    XLA path; y, loss, dx and dw bit for bit equal to the XLA path (the columns kernel's
    only CPU check of its numerics: it takes ~30 s to interpret alone)."""
    monkeypatch.setenv("FP4JAX_KERNELS", "off")
    want = _dot_fwd_bwd()
    monkeypatch.setenv("FP4JAX_KERNELS", "interpret")
    seen = []
    for name in ("fq_rows_scaled", "fq_cols_scaled"):
        real = getattr(fq, name)

        def spy(*a, _real=real, _name=name, **k):
            seen.append((_name, k.get("fmt"), k.get("sr"), k.get("rht")))
            return _real(*a, **k)

        monkeypatch.setattr(fq, name, spy)
    got = _dot_fwd_bwd()
    assert sorted(seen, key=str) == sorted([
        ("fq_rows_scaled", MXFP4, False, None), ("fq_rows_scaled", MXFP4, False, None),
        ("fq_rows_scaled", MXFP4, True, None), ("fq_cols_scaled", MXFP4, False, True),
        ("fq_cols_scaled", MXFP4, True, True)], key=str)
    for g, w, name in zip(got, want, ("y", "loss", "dx", "dw"), strict=True):
        assert (g.view(np.uint32) == w.view(np.uint32)).all(), name


@pytest.mark.parametrize("variant", ["rows", "rows_ocp", "rows_sr", "rows_sr_flat",
                                     "cols_rht_sr"])
def test_mx_kernels_lower_for_cuda(variant):
    """The real kernels (GPU tiling: WGMMA rows tiles, 64-block SR quads overhanging a
    736-column row, the flat SR layout of a 768-column one, strided 32-row column strips)
    lower for CUDA, with the flat scalars of
    several operands, as ``dot_sm90.make_operands`` calls them."""
    sc = jax.ShapeDtypeStruct((3 * cm.SC_WIDTH,), jnp.float32)
    kw = jax.ShapeDtypeStruct((3,), jnp.int32)
    x = jax.ShapeDtypeStruct((16384, 768), jnp.bfloat16)
    f = {"rows": lambda x, s, k: fq.fq_rows_scaled(x, s, k, sc_row=2, fmt=MXFP4),
         "rows_ocp": lambda x, s, k: fq.fq_rows_scaled(x, s, k, sc_row=0, fmt=MXFP4_OCP),
         "rows_sr": lambda x, s, k: fq.fq_rows_scaled(x[:, :736], s, k, sr=True, sc_row=1,
                                                      fmt=MXFP4),
         "rows_sr_flat": lambda x, s, k: fq.fq_rows_scaled(x, s, k, sr=True, sc_row=1,
                                                           fmt=MXFP4),
         "cols_rht_sr": lambda x, s, k: fq.fq_cols_scaled(x, s, k, sr=True, rht=True,
                                                          sc_row=1, fmt=MXFP4)}[variant]
    exp = export_cuda(f, x, sc, kw)
    assert "mosaic_gpu" in exp.mlir_module()


def test_dispatch_routes_mxfp4():
    """MXFP4 specs are the kernels' (one statement: ``spec_unsupported_reason``); the
    recipe takes the kernel path; per operand: rows and RHT-32 columns from the kernels,
    32x32 weight tiles and float32 inputs from XLA; packed MXFP4 stays on XLA."""
    assert dispatch.spec_unsupported_reason(MXFP4) is None
    assert dispatch.spec_unsupported_reason("mxfp4_ocp", rounding="stochastic") is None
    assert "E4M3 elements" in dispatch.spec_unsupported_reason(MXFP8_E4M3_UP)
    from pallas_kernels.dot_sm90 import recipe_reason

    assert recipe_reason(fp4jax.recipes.mxfp4()) is None
    key = jax.random.key(0)
    x = jnp.zeros((1, 64, 512), jnp.bfloat16)
    kind = dispatch.operand_kernel
    assert kind(x, block_2d=False, axis=2, stochastic=True, rht=0, key=key, fmt=MXFP4) == "rows"
    assert kind(x, block_2d=False, axis=1, stochastic=True, rht=32, key=key,
                fmt=MXFP4) == "cols"
    assert kind(x, block_2d=False, axis=1, stochastic=False, rht=16, key=key,
                fmt=MXFP4) is None  # an RHT other than the block's 32
    assert kind(x, block_2d=True, axis=1, stochastic=False, rht=0, key=key, fmt=MXFP4) is None
    assert kind(x.astype(jnp.float32), block_2d=False, axis=2, stochastic=False, rht=0,
                key=key, fmt=MXFP4) is None
    assert kind(x[:, :48], block_2d=False, axis=1, stochastic=False, rht=32, key=key,
                fmt=MXFP4) is None  # 48 tokens: not whole 32x1 blocks
    reason = dispatch.quantize_unsupported_reason((64, 512), jnp.bfloat16, fmt=MXFP4)
    assert "NVFP4 only" in reason
