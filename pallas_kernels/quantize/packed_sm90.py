"""Packed NVFP4 quantization (1x16 and 16x16 blocks) for Hopper (sm_90), Pallas Mosaic GPU.

One pass over ``x`` (bf16 or f32, shape (R, C), C % 16 == 0) that writes

* ``packed``: uint8 (R, C // 2), two E2M1 codes per byte along the last axis
  (element 2i in the low nibble, 2i+1 in the high nibble; code bits ``s e1 e0 m``);
* ``scale_bits``: uint8 (R, C // 16), the E4M3 block-scale bit patterns
  (view them with ``jax.lax.bitcast_convert_type(..., jnp.float8_e4m3fn)``);

given the tensor encode scale ``enc`` and decode scale ``dec`` (computed from the
global amax by a separate XLA reduction, see :func:`global_scales`).

Numerics: the rules of ``common_sm90`` (Transformer Engine ``core_nvfp4.cuh`` in
float32, as ``fp4jax.quantize``); this module owns the packed output layouts and the
kernels that write them: 1x16 round-to-nearest (``quantize_nvfp4_1x16``) or stochastic
(``quantize_nvfp4_1x16_sr``) and 16x16 tiles (``quantize_nvfp4_2d``).

Kernel layout: ``x`` is viewed as (R, C/16, 16) (a free reshape). Each grid step moves
a (block_rows, block_groups, 16) tile into shared memory with TMA; the kernel reads
the 16 element positions of all blocks of the tile as 16 strided (block_rows,
block_groups) register arrays, so that a block's amax is an elementwise max across
those arrays (no cross-lane reduction), and writes byte ``i`` of every block
(elements 2i, 2i+1) as one strided store into the (block_rows, block_groups, 8)
output tile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from fp4jax.numerics import threefry2x32
from pallas_kernels import mosaic_compat  # noqa: F401  (pallas_call's Mosaic GPU lowering)
from pallas_kernels.quantize.common_sm90 import (
    G2D,
    GR,
    QUAD_BLOCKS,
    SUB,
    bits_to_f32,
    bits_to_i32,
    by_mode,
    e2m1_code,
    e2m1_value,
    global_scales,
    iota,
    kernel_scalars,
    key_words,
    lane_params,
    load_words,
    pick_block,
    recip_mode,
    sr_uniform,
    strip_2d_scales,
    supported_rows,
    word_scales,
)


def _encode_words(w, e, finite, n: int):
    """Packed E2M1 bytes (int32, (n, 8)) of a (n, 8) word tile, per-row scale ``e``;
    NaN/Inf blocks get codes -0 (0x88) as a float4 cast of NaN gives.
    Rule: ``q = e2m1_rne_satfinite(x * e)`` (``fp4jax.quantization._round_elements``)."""
    lo = bits_to_f32(w << 16)  # element 2k
    hi = bits_to_f32(w & -0x10000)  # element 2k+1
    eb = lax.broadcast_in_dim(e, (n, 8), (0,))
    fin = lax.broadcast_in_dim(finite.astype(jnp.int32), (n, 8), (0,))
    byte = e2m1_code(lo * eb) | (e2m1_code(hi * eb) << 4)
    return jnp.where(fin != 0, byte, 0x88)


def _quant_tile(sc_ref, x_ref, q_ref, s_ref, *, nb: int, plain: bool = False,
                mode: str = "rn"):
    """Quantize ``nb`` blocks: x_ref (nb, 8) uint32 words (bf16 pairs), q_ref (nb, 8)
    uint8 packed codes, s_ref (nb,) uint8 scale bits.

    Block b is row b. Word k of a block holds elements 2k (low half) and 2k+1 (high
    half); their two E2M1 codes make byte k of the packed output, so the packed tile
    has the same (rows, 8) shape as the word tile and every thread only transforms the
    words it loaded. The words are held in the WGMMA register layout (a row spread over
    a quad of lanes), so a block's amax is a row reduction (quad shuffles) and the
    per-block scales live in the row layout and broadcast back along the row.
    """
    for a in range(0, nb, SUB):
        rows = pl.ds(a, SUB) if nb > SUB else slice(None)
        n = min(nb, SUB)
        w = load_words(x_ref, rows, plain)
        _, s_byte, e, finite = word_scales(sc_ref, w, mode)
        s_ref[rows] = jnp.where(finite, s_byte, 0x7F).astype(jnp.uint8)
        q_ref[rows, :] = _encode_words(w, e, finite, n).astype(jnp.uint8)


def _quant_strip_2d(sc_ref, x_ref, q_ref, s_ref, *, g: int, plain: bool = False,
                    mode: str = "rn"):
    """Quantize one strip of ``g`` 16x16 tiles: x_ref (16, g, 8) uint32 words (row k of
    tile j is x_ref[k, j]), q_ref (16, g, 8) uint8 packed codes, s_ref (g,) uint8 tile
    scale bits. Two passes over the shared-memory strip: the tile amax is the
    elementwise max of the 16 rows' block amaxes (all in the row layout, no shuffles
    across rows), then every row is encoded with its tile's scale.
    Rule: ``fp4jax.quantization.quantize_unchecked`` with ``block_2d=True`` (one scale per
    16x16 tile, amax over the tile)."""
    _, s_byte, e, finite = strip_2d_scales(sc_ref, x_ref, plain, mode)
    s_ref[...] = jnp.where(finite, s_byte, 0x7F).astype(jnp.uint8)
    for k in range(16):
        w = load_words(x_ref.at[k], slice(None), plain)
        q_ref[k] = _encode_words(w, e, finite, g).astype(jnp.uint8)


def supported(shape, dtype) -> bool:
    """Whether the kernel handles x of this shape/dtype (else use the XLA path)."""
    if len(shape) != 2 or jnp.dtype(dtype) != jnp.bfloat16:
        return False
    r, c = shape
    return c % 16 == 0 and (r * c // 16) % SUB == 0


def supported_2d(shape, dtype) -> bool:
    """Whether the 16x16 kernel handles x (R, C) (bf16, R % 16 == 0, C % 1024 == 0)."""
    if len(shape) != 2 or jnp.dtype(dtype) != jnp.bfloat16:
        return False
    r, c = shape
    return r % 16 == 0 and c % 16 == 0 and (c // 16) % G2D[-1] == 0


@functools.partial(
    jax.jit,
    static_argnames=("block", "steps_per_cta", "interpret", "exact_recip", "recip"))
def quantize_nvfp4_1x16_scaled(
    x: jax.Array,
    enc: jax.Array,
    dec: jax.Array,
    *,
    block: int | None = None,
    steps_per_cta: int | None = None,
    interpret=False,
    exact_recip: bool | None = None,
    recip: str = "auto",
):
    """Kernel call with given tensor scales. x: (R, C) bfloat16, see ``supported``.

    Returns (packed uint8 (R, C//2), scale_bits uint8 (R, C//16)).
    ``recip``: how ``1/(s*dec)`` is computed: ``"auto"`` (the default; the table of
    ``recip_table`` when it is exact for this ``dec``, else ``recip_rn``; a uniform
    branch inside the kernel), ``"table"`` (table only: exact only for a safe dec),
    ``"rn"`` (``recip_rn`` always), ``"hw"`` (the hardware quotient: not bit-exact on the
    GPU; kept only to time the cost). ``exact_recip=False`` is the old spelling of "hw".
    """
    if not supported(x.shape, x.dtype):
        raise ValueError(
            f"quantize kernel needs bfloat16 (R, C) with C % 16 == 0 and R*C % {16 * SUB} == 0,"
            f" got {x.dtype} {x.shape}"
        )
    mode = recip_mode(recip, exact_recip)
    r, c = x.shape
    nbt = r * c // 16  # total blocks
    xw = lax.bitcast_convert_type(x.reshape(nbt, 8, 2), jnp.uint32)  # (blocks, 8 words)
    sc = kernel_scalars(enc, dec)
    if interpret:
        # Mosaic GPU interpret mode (CPU tests) supports only trivial windows: run the
        # tile body once over all blocks (the TMA pipeline is not exercised).
        def interp_body(sc_ref, x_ref, q_ref, s_ref):
            by_mode(sc_ref, mode, lambda md: _quant_tile(
                sc_ref, x_ref, q_ref, s_ref, nb=nbt, plain=True, mode=md))

        q, s = pl.pallas_call(
            interp_body,
            out_shape=(
                jax.ShapeDtypeStruct((nbt, 8), jnp.uint8),
                jax.ShapeDtypeStruct((nbt,), jnp.uint8),
            ),
            interpret=interpret,
            compiler_params=lane_params(),
        )(sc, xw)
        return q.reshape(r, c // 2), s.reshape(r, c // 16)

    # TMA boxes are at most 256 along a dimension: view the blocks as (n, 256, ...) slabs.
    ns = nbt // SUB
    # Defaults from an H200 sweep (docs/performance.md): small steps (2 slabs = 16 KiB of
    # input) and one step per CTA, i.e. many small CTAs per SM, were fastest.
    kt = block or pick_block(ns, (2, 1))  # slabs per pipeline step
    steps = ns // kt
    spc = steps_per_cta or 1
    if steps % spc:
        raise ValueError(f"steps_per_cta={spc} must divide the {steps} steps")
    # JAX 0.11 lowers Mosaic GPU kernels through plgpu.kernel: each CTA pipelines (TMA
    # in/out, double-buffered) over `spc` consecutive steps of `kt` slabs.

    def body(sc_gmem, x_gmem, q_gmem, s_gmem):
        cta = lax.axis_index("ctas")

        def step(_, x_smem, q_smem, s_smem):
            def tiles(md):
                for i in range(kt):
                    _quant_tile(
                        sc_gmem, x_smem.at[i], q_smem.at[i].reshape(SUB, 8), s_smem.at[i],
                        nb=SUB, mode=md,
                    )

            by_mode(sc_gmem, mode, tiles)

        plgpu.emit_pipeline(
            step,
            grid=(spc,),
            in_specs=[plgpu.BlockSpec((kt, SUB, 8), lambda j: (cta * spc + j, 0, 0))],
            out_specs=[
                plgpu.BlockSpec((kt, SUB // 2, 16), lambda j: (cta * spc + j, 0, 0)),
                plgpu.BlockSpec((kt, SUB), lambda j: (cta * spc + j, 0)),
            ],
            max_concurrent_steps=min(2, spc),
        )(x_gmem, q_gmem, s_gmem)

    q, s = plgpu.kernel(
        body,
        out_type=(
            jax.ShapeDtypeStruct((ns, SUB // 2, 16), jnp.uint8),
            jax.ShapeDtypeStruct((ns, SUB), jnp.uint8),
        ),
        grid=(steps // spc,),
        grid_names=("ctas",),
        compiler_params=lane_params(unsafe_no_auto_barriers=True),
    )(sc, xw.reshape(ns, SUB, 8))
    return q.reshape(r, c // 2), s.reshape(r, c // 16)


def quantize_nvfp4_1x16(x: jax.Array, *, interpret: bool = False, **kw):
    """Global amax (XLA) + fused kernel. Returns (packed, scale_bits, dec)."""
    enc, dec = global_scales(x)
    packed, s = quantize_nvfp4_1x16_scaled(x, enc, dec, interpret=interpret, **kw)
    return packed, s, dec


@functools.partial(jax.jit, static_argnames=("g", "interpret", "recip"))
def quantize_nvfp4_2d_scaled(
    x: jax.Array,
    enc: jax.Array,
    dec: jax.Array,
    *,
    g: int | None = None,
    interpret=False,
    recip: str = "rn",
):
    """16x16 kernel call with given tensor scales. x: (R, C) bfloat16, see ``supported_2d``.

    Returns (packed uint8 (R, C//2), tile scale_bits uint8 (R//16, C//16)): the packed
    codes of ``fp4jax.quantize(x, NVFP4, block_2d=True).data`` along the last axis and
    the bits of its ``.scale``. ``recip`` as in ``quantize_nvfp4_1x16_scaled``; the default
    here is ``"rn"`` (exact for every dec, no table branch): one reciprocal per 256
    elements costs little, and on the H200 it measured faster than ``"auto"``
    (docs/performance.md).

    Layout: x is viewed as (R/16, 16, C/16, 8) words (a free reshape); each grid step
    moves a strip of ``g`` tiles, (1, 16, g, 8) words, into shared memory with TMA and
    runs ``_quant_strip_2d`` on it.
    """
    if not supported_2d(x.shape, x.dtype):
        raise ValueError(
            f"16x16 quantize kernel needs bfloat16 (R, C) with R % 16 == 0 and"
            f" C % {16 * G2D[-1]} == 0, got {x.dtype} {x.shape}")
    mode = recip_mode(recip, None)
    r, c = x.shape
    nr, nc = r // 16, c // 16
    xw = lax.bitcast_convert_type(x.reshape(nr, 16, nc, 8, 2), jnp.uint32)
    sc = kernel_scalars(enc, dec)
    if interpret:
        # one pallas_call over the whole array (interpret mode: trivial windows only);
        # the strips are looped over in Python (small test shapes only)
        def interp_body(sc_ref, x_ref, q_ref, s_ref):
            def strips(md):
                for i in range(nr):
                    _quant_strip_2d(sc_ref, x_ref.at[i], q_ref.at[i], s_ref.at[i], g=nc,
                                    plain=True, mode=md)

            by_mode(sc_ref, mode, strips)

        q, s = pl.pallas_call(
            interp_body,
            out_shape=(
                jax.ShapeDtypeStruct((nr, 16, nc, 8), jnp.uint8),
                jax.ShapeDtypeStruct((nr, nc), jnp.uint8),
            ),
            interpret=interpret,
            compiler_params=lane_params(),
        )(sc, xw)
        return q.reshape(r, c // 2), s

    g = g or pick_block(nc, G2D)
    if g is None or nc % g:
        raise ValueError(f"g={g} must divide C/16={nc}")

    def body(sc_gmem, x_gmem, q_gmem, s_gmem):
        i = lax.axis_index("rows")
        j = lax.axis_index("cols")

        def step(_, x_smem, q_smem, s_smem):
            by_mode(sc_gmem, mode, lambda md: _quant_strip_2d(
                sc_gmem, x_smem.at[0], q_smem.at[0].reshape(16, g, 8), s_smem.at[0], g=g,
                mode=md))

        plgpu.emit_pipeline(
            step,
            grid=(1,),
            in_specs=[plgpu.BlockSpec((1, 16, g, 8), lambda _: (i, 0, j, 0))],
            out_specs=[
                plgpu.BlockSpec((1, 16, g // 2, 16), lambda _: (i, 0, j, 0)),
                plgpu.BlockSpec((1, g), lambda _: (i, j)),
            ],
            max_concurrent_steps=1,
        )(x_gmem, q_gmem, s_gmem)

    q, s = plgpu.kernel(
        body,
        out_type=(
            jax.ShapeDtypeStruct((nr, 16, c // 32, 16), jnp.uint8),
            jax.ShapeDtypeStruct((nr, nc), jnp.uint8),
        ),
        grid=(nr, nc // g),
        grid_names=("rows", "cols"),
        compiler_params=lane_params(unsafe_no_auto_barriers=True),
    )(sc, xw)
    return q.reshape(r, c // 2), s


def quantize_nvfp4_2d(x: jax.Array, *, interpret: bool = False, **kw):
    """Global amax (XLA) + fused 16x16 kernel. Returns (packed, tile scale_bits, dec)."""
    enc, dec = global_scales(x)
    packed, s = quantize_nvfp4_2d_scaled(x, enc, dec, interpret=interpret, **kw)
    return packed, s, dec


# ---------------------------------------------------------------------------
# 1x16 with stochastic rounding (packed output).
# ---------------------------------------------------------------------------


def e2m1_code_of_value(v):
    """E2M1 code (int32, 0..15, bits ``s e1 e0 m``) of a float32 ``v`` that is exactly an
    E2M1 value (what ``common_sm90.e2m1_value`` returns), integer ops only:
    ``|v| >= 1`` has one mantissa bit, so ``(bits >> 22) - 252`` is the code (1.0 -> 2 ..
    6.0 -> 7); below 1 the values are 0 and 0.5 (code 0, 1: bit 24 of the bits). The
    sign bit moves to code bit 3 (-0 -> 8, as ``fp4jax.quantization.e2m1_codes``)."""
    bits = bits_to_i32(v)
    ab = bits & 0x7FFFFFFF
    mag = jnp.where(ab >= 0x3F800000, lax.shift_right_logical(ab, 22) - 252,
                    lax.shift_right_logical(ab, 24) & 1)
    return mag | (lax.shift_right_logical(bits, 28) & 8)


def _sr_packed_quad_tile(sc_ref, kw_ref, x_ref, q_ref, s_ref, *, g: int, draw0,
                         plain: bool, mode: str):
    """Stochastic rounding of ``g`` blocks of four neighbouring rows (4m .. 4m+3), packed:
    x_ref (4, g, 8) uint32 words (bf16 pairs) in; q_ref (4, g, 8) uint8 (byte k of a
    block: codes of elements 2k (low nibble) and 2k+1) and s_ref (4, g) uint8 E4M3 scale
    bits out.

    The same steps as ``operand_sm90._fq_quad_tile`` (whose bf16 words these
    codes times their scales are): block scales ``word_scales`` (TE ``core_nvfp4.cuh``),
    the 64-bit draw ``draw0 + 8 i + j`` for word (i, j) of the four rows
    (``numerics.uniform_from_key`` on x's stored (R, C) order: rows 4m, 4m+1 take word
    y0, rows 4m+2, 4m+3 word y1; the even row bytes 0 (low element) and 1 (high), the odd
    row bytes 2 and 3), ``u = sr_uniform(byte)``, the element rounding ``e2m1_value``
    (``numerics.stochastic_round_to_grid`` on E2M1), then the code of that value
    (``e2m1_code_of_value``). NaN/Inf blocks: scale byte 0x7F (NaN) and codes 0 (+0), the
    codes ``fp4jax.quantize`` gives there (its elements become NaN times the NaN encode
    scale, which round to +0 for a positive NaN; the round-to-nearest packed kernel
    writes 0x88 instead)."""
    d = draw0 + (iota((g, 8), 0, plain) << 3) + iota((g, 8), 1, plain)
    words = threefry2x32(kw_ref[0], kw_ref[1], d - d, d)
    for r in range(4):
        w = load_words(x_ref.at[r], slice(None), plain)
        _, s_byte, e, finite = word_scales(sc_ref, w, mode)
        bits = words[r // 2]
        eb = lax.broadcast_in_dim(e, (g, 8), (0,))
        fin = lax.broadcast_in_dim(finite.astype(jnp.int32), (g, 8), (0,))
        lo = e2m1_value(bits_to_f32(w << 16) * eb, sr_uniform(bits, 2 * (r % 2)), plain)
        hi = e2m1_value(bits_to_f32(w & -0x10000) * eb, sr_uniform(bits, 2 * (r % 2) + 1),
                            plain)
        byte = e2m1_code_of_value(lo) | (e2m1_code_of_value(hi) << 4)
        q_ref[r] = jnp.where(fin != 0, byte, 0).astype(jnp.uint8)
        s_ref[r] = jnp.where(finite, s_byte, 0x7F).astype(jnp.uint8)


def supported_sr(shape, dtype) -> bool:
    """Whether the stochastic-rounding 1x16 kernel handles x (R, C): bf16, R % 4 == 0,
    C % 1024 == 0, R*C < 2^31 (``common_sm90.supported_rows`` with ``sr``)."""
    return supported_rows(shape, dtype, sr=True)


@functools.partial(jax.jit, static_argnames=("interpret", "g", "rq"))
def quantize_nvfp4_1x16_sr_scaled(x: jax.Array, enc: jax.Array, dec: jax.Array,
                                  kw: jax.Array, *, interpret=False, g: int | None = None,
                                  rq: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Kernel call: 1x16 NVFP4 blocks along the last axis with stochastic rounding.

    Args:
      x: (R, C) bfloat16, see ``supported_sr``.
      enc, dec: float32 tensor scales (``global_scales``).
      kw: int32[3], the Threefry key words (``common_sm90.key_words(key)``; the third,
        the draw offset, is ignored here).
      g, rq: blocks per row and row quads of a CTA tile (defaults: the GPU's choice,
        ``common_sm90.GR`` / ``QUAD_BLOCKS``, as ``fq_rows``' SR kernel; in
        interpret mode whole rows, one quad, unless given, so CPU tests can run the GPU
        tiling's draw offsets).
    Returns:
      (packed uint8 (R, C//2), scale_bits uint8 (R, C//16)): ``pack_e2m1(q.data)`` and the
      bits of ``q.scale`` of ``q = fp4jax.quantize(x, NVFP4, axis=-1,
      rounding="stochastic", key=key)`` (codes of NaN/Inf blocks are 0; the scale is NaN
      there).

    Layout: x viewed as (R, C/16, 8) words; CTA (i, j) takes row quads ``i * rq + p`` (p <
    rq) x blocks ``j * g ..`` (``_sr_packed_quad_tile`` per quad). The packed output is
    viewed as (R, C/32, 16) bytes for its TMA store (boxes of 16 bytes a row) and the
    shared-memory tile reshaped to (4 rq, g, 8). The reciprocal is ``recip_rn`` (as
    ``fq_rows``' SR kernel: no table branch, whose second copy of the body would double
    an already long kernel).
    """
    if not supported_sr(x.shape, x.dtype):
        raise ValueError(f"stochastic-rounding quantize kernel needs bfloat16 (R, C) with "
                         f"R % 4 == 0, C % {16 * GR[-1]} == 0 and R*C < 2^31, got "
                         f"{x.dtype} {x.shape}")
    mode = "rn"
    r, c = x.shape
    nbr = c // 16
    xw = lax.bitcast_convert_type(x.reshape(r, nbr, 8, 2), jnp.uint32)
    sc = kernel_scalars(enc, dec)
    if interpret:
        g = g or nbr
        rq = rq or 1
    else:
        g = g or pick_block(nbr, GR)
        rq = rq or max(1, QUAD_BLOCKS // (4 * g))
        while (r // 4) % rq:
            rq //= 2
    if nbr % g or (r // 4) % rq or (not interpret and g % 64):
        raise ValueError(f"SR quantize tiling: g={g} must divide C/16={nbr} (and be a "
                         f"multiple of 64 on the GPU), rq={rq} must divide R/4={r // 4}")

    def draw0(i, j, p):  # draw of word (0, 0) of row quad i * rq + p, block j * g
        return (i * rq + p) * (c // 2) + 8 * g * j

    if interpret:
        def interp_body(sc_ref, kw_ref, x_ref, q_ref, s_ref):
            @pl.loop(0, r // (4 * rq))
            def _(i):
                for j in range(nbr // g):
                    for p in range(rq):
                        rows = pl.ds(4 * (i * rq + p), 4)
                        at = (rows, pl.ds(j * g, g))
                        _sr_packed_quad_tile(sc_ref, kw_ref, x_ref.at[at], q_ref.at[at],
                                             s_ref.at[at], g=g, draw0=draw0(i, j, p),
                                             plain=True, mode=mode)

        q, s = pl.pallas_call(
            interp_body,
            out_shape=(jax.ShapeDtypeStruct((r, nbr, 8), jnp.uint8),
                       jax.ShapeDtypeStruct((r, nbr), jnp.uint8)),
            interpret=interpret, compiler_params=lane_params())(sc, kw, xw)
        return q.reshape(r, c // 2), s

    def body(sc_gmem, kw_gmem, x_gmem, q_gmem, s_gmem):
        i = lax.axis_index("rows")
        j = lax.axis_index("cols")

        def step(_, x_smem, q_smem, s_smem):
            q_tile = q_smem.reshape(4 * rq, g, 8)
            for p in range(rq):
                rows = pl.ds(4 * p, 4)
                _sr_packed_quad_tile(sc_gmem, kw_gmem, x_smem.at[rows], q_tile.at[rows],
                                     s_smem.at[rows], g=g, draw0=draw0(i, j, p),
                                     plain=False, mode=mode)

        plgpu.emit_pipeline(
            step, grid=(1,),
            in_specs=[plgpu.BlockSpec((4 * rq, g, 8), lambda _: (i, j, 0))],
            out_specs=[plgpu.BlockSpec((4 * rq, g // 2, 16), lambda _: (i, j, 0)),
                       plgpu.BlockSpec((4 * rq, g), lambda _: (i, j))],
            max_concurrent_steps=1,
        )(x_gmem, q_gmem, s_gmem)

    q, s = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((r, c // 32, 16), jnp.uint8),
                  jax.ShapeDtypeStruct((r, nbr), jnp.uint8)),
        grid=(r // (4 * rq), nbr // g), grid_names=("rows", "cols"),
        compiler_params=lane_params(unsafe_no_auto_barriers=True),
    )(sc, kw, xw)
    return q.reshape(r, c // 2), s


def quantize_nvfp4_1x16_sr(x: jax.Array, key: jax.Array, *, interpret=False, amax=None,
                           **kw) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Global amax (XLA, or ``amax`` if known) + the stochastic-rounding 1x16 kernel.

    x: (R, C) bfloat16 (``supported_sr``); key: a threefry ``jax.random`` key (typed or
    raw). Returns (packed uint8 (R, C//2), scale_bits uint8 (R, C//16), dec float32),
    bit-identical to ``fp4jax.quantize(x, NVFP4, axis=-1, rounding="stochastic",
    key=key)`` (see ``quantize_nvfp4_1x16_sr_scaled``)."""
    enc, dec = global_scales(x, amax)
    packed, s = quantize_nvfp4_1x16_sr_scaled(x, enc, dec, key_words(key),
                                              interpret=interpret, **kw)
    return packed, s, dec
