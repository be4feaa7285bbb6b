"""Fused NVFP4 quantize-to-GEMM-operand kernels for Hopper (sm_90), Pallas Mosaic GPU.

Hopper has no FP4 tensor cores, so ``fp4jax.dot`` runs each quantized GEMM as a bf16
GEMM on ``data * scale`` (E2M1 times its E4M3 block scale: exact in bf16, see
``fp4jax.quantization.scaled_data``) with the two tensor scales applied to the f32 result.
These kernels make that bf16 operand in one pass over a bf16 input (read 2 bytes,
write 2 bytes an element; the tensor amax is a separate pass: an XLA reduction,
``rht_cols_amax`` for the rotated columns, or ``cols_amaxes`` for both from one read),
bit-identical
to ``scaled_data(fp4jax.quantize(...), bfloat16)``:

* ``fq_rows``: 1x16 blocks along the last axis (the fprop ``x`` and the dgrad ``dy``);
* ``fq_cols``: 16x1 blocks along the first axis, i.e. the token axis of the wgrad
  operands, optionally after the 16-point random Hadamard transform along that axis
  (``fp4jax.hadamard.fwht_tiles``: the same butterfly, the same float32 additions), so
  no transposed copy is ever written: the GEMM contracts the first axis directly;
* ``fq_2d``: 16x16 tiles (the fprop/dgrad weight);
* ``fq_rows_cols``: ``fq_rows`` and (RHT'd) ``fq_cols`` of one tensor from one read, the
  same bits (``dot_sm90.make_operands`` makes an NVFP4 x's or dy's rows and columns
  operands with it under ``FP4JAX_KERNEL_OPERANDS=fused``; opt-in: not faster, see
  docs/performance.md).

MX FP4 (``fmt=fp4jax.MXFP4`` or ``MXFP4_OCP``: blocks of 32, E8M0 scales, no tensor scale):
``fq_rows`` with 1x32 blocks and ``fq_cols`` with 32x1 blocks (strips of 32 rows, the RHT of
size 32), RtN and SR; the block scale is the core's ``block_decode_scale`` itself on register
arrays (``common_sm90.mx_block_scales``), products saturate to bf16's range as
``scaled_data``'s. The 32x32 MX weight tiles stay on XLA (a strip of 64 tiles, the least the
WGMMA register layout takes, needs 256 KiB of shared memory), as do float32 MX inputs.

Each does round-to-nearest-even or stochastic rounding. Stochastic rounding draws its
8 bits per element in the kernel from the key (``fp4jax.numerics.threefry2x32``, the
counter-based Threefry-2x32 of ``jax.random``; the eight elements of four rows x two
columns share both 32-bit words of one draw, the rule of
``fp4jax.numerics.uniform_from_key`` on x's stored (R, C) order, for rows and cols
alike). A bf16 word holds two neighbouring columns, so one draw serves the same word of
four neighbouring rows: ``fq_rows`` takes its rows in quads, ``fq_cols`` loops over row
quads. Kernels and XLA path produce the same bits with no random array in memory.

Numerics (each rule is the core's, cited where it is used): block amax, E4M3 block
scale and element encode scale from ``common_sm90`` (TE ``core_nvfp4.cuh``);
element rounding ``e2m1_value`` (``fp4jax.numerics.round_to_grid`` /
``stochastic_round_to_grid`` on E2M1). A block holding NaN/Inf gives NaN for all 16
(or 256) outputs, as ``scaled_data`` of its NaN scale does.

Layout: as the quantize kernels, words of two bf16 (uint32) in the WGMMA register
layout; ``fq_rows`` views x as (blocks, 8) words (a block = a row of 8 words),
``fq_cols`` and ``fq_2d`` view it as (R/16, 16, C/16, 8) words and process strips of
16 rows x ``16 g`` columns, where row ``k`` of the strip is one register array, so a
column block's amax and the Hadamard butterfly are elementwise operations across 16
arrays (no shuffles).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from fp4jax.formats import NVFP4
from fp4jax.numerics import threefry2x32
from pallas_kernels.quantize.common_sm90 import (
    BF16_MAX,
    G2D,
    GR,
    QUAD_BLOCKS,
    SC_SIGNS,
    SUB,
    bits_to_f32,
    bits_to_i32,
    block_amax_bits,
    block_scale_bits,
    by_mode,
    e2m1_value,
    elem_scale,
    global_scales,
    iota,
    is_mx,
    key_words,
    lane_params,
    load_words,
    mx_block_scales,
    pick_block,
    recip_mode,
    scalar_row,
    scalars,
    sr_uniform,
    strip_2d_scales,
    strip_layout,
    supported_rows,
    word_scales,
)

__all__ = ["fq_rows", "fq_cols", "fq_2d", "rht_cols_amax", "cols_amaxes", "flat_quads",
           "fq_rows_cols", "fq_rows_cols_scaled", "supported_rows", "supported_cols",
           "supported_2d", "supported_rows_cols", "scalars"]

_NAN2 = 0x7FC07FC0  # two bf16 quiet NaNs

def _bf16_hi(v):
    """bf16 bits of an exactly representable float32, in the high half of an int32."""
    return bits_to_i32(v) & -0x10000


def _satfinite_bf16(v, mx: bool):
    """``v`` clamped to bf16's finite range (``fp4jax.quantization.scaled_data``'s
    ``satfinite``): only MX products (E2M1 times a power-of-two scale up to 2^126) can
    exceed it; NVFP4's stay below 6 * 448."""
    return jnp.minimum(jnp.maximum(v, -BF16_MAX), BF16_MAX) if mx else v


def _scaled_words(w, e, s_val, finite, n: int, plain: bool, u_lo=None, u_hi=None,
                  mx: bool = False):
    """bf16 ``data * scale`` words (int32, (n, nw)) of a (n, nw) word tile (nw = 8: an
    NVFP4 block a row; 16: an MX block of 32) whose row ``i`` has element encode scale
    ``e[i]``, block scale ``s_val[i]`` and ``finite[i]`` (a NaN/Inf block gives NaN);
    ``u_lo``/``u_hi``: SR uniforms of the low/high elements; ``mx``: clamp to bf16's
    range (``_satfinite_bf16``)."""
    nw = w.shape[1]
    eb = lax.broadcast_in_dim(e, (n, nw), (0,))
    sb = lax.broadcast_in_dim(s_val, (n, nw), (0,))
    fin = lax.broadcast_in_dim(finite.astype(jnp.int32), (n, nw), (0,))
    lo = _satfinite_bf16(e2m1_value(bits_to_f32(w << 16) * eb, u_lo, plain) * sb, mx)
    hi = _satfinite_bf16(e2m1_value(bits_to_f32(w & -0x10000) * eb, u_hi, plain) * sb, mx)
    word = lax.shift_right_logical(bits_to_i32(lo), 16) | _bf16_hi(hi)
    return jnp.where(fin != 0, word, _NAN2)


def _row_scales(sc_ref, w, mode: str, fmt):
    """Block scales of a word tile whose rows are blocks: ``(s_val, e, finite)``, NVFP4
    (``fmt`` None: ``word_scales``, E4M3 with the tensor scale) or MX (``fmt``: the
    core's ``block_decode_scale`` through ``mx_block_scales``)."""
    if fmt is not None:
        return mx_block_scales(block_amax_bits(w), fmt)
    s_val, _, e, finite = word_scales(sc_ref, w, mode)
    return s_val, e, finite


def _check_fmt(fmt):
    """The kernels' format argument: None (or NVFP4 itself) for NVFP4, an MX FP4 format
    (``is_mx``: blocks of 32, E8M0 scales) as is; anything else is a ValueError."""
    if fmt is None or fmt == NVFP4:
        return None
    if not is_mx(fmt):
        raise ValueError(f"fmt: the operand kernels quantize NVFP4 (fmt=None) or MX FP4 "
                         f"(blocks of 32, E8M0 scales, no tensor scale), got {fmt!r}")
    return fmt


def _bw(fmt) -> int:
    """bf16 words (element pairs) per block: 8 (NVFP4, 16 elements) or 16 (MX, 32)."""
    return 8 if fmt is None else 16


# ---------------------------------------------------------------------------
# 1x16 along the last axis.
# ---------------------------------------------------------------------------


def _fq_tile(sc_ref, kw_ref, x_ref, o_ref, *, nb: int, plain: bool, mode: str,
             chunk: int = SUB, fmt=None):
    """Round-to-nearest: ``nb`` blocks, x_ref (nb, nw) uint32 words in (``_bw``), o_ref
    (nb, nw) uint32 words of bf16 ``data * scale`` out, ``chunk`` blocks (a multiple of 64)
    per register tile (stochastic rounding: ``_fq_quad_tile``). ``fmt``: None (NVFP4) or
    an MX format (``_check_fmt``)."""
    del kw_ref
    for a in range(0, nb, chunk):
        rows = pl.ds(a, chunk) if nb > chunk else slice(None)
        n = min(nb, chunk)
        w = load_words(x_ref, rows, plain)
        s_val, e, finite = _row_scales(sc_ref, w, mode, fmt)
        word = _scaled_words(w, e, s_val, finite, n, plain, mx=fmt is not None)
        o_ref[rows, :] = lax.bitcast_convert_type(word, jnp.uint32)


def _fq_quad_tile(sc_ref, kw_ref, x_rows, o_rows, *, g: int, draw0, plain: bool, mode: str,
                  dyn: bool = False, fmt=None):
    """Stochastic rounding of the same ``g`` blocks of four neighbouring rows (4m ..
    4m+3): ``x_rows[r]``/``o_rows[r]`` (g, 8) words of row 4m+r (views of one (4, g, 8)
    tile, or, in the flat layout of ``_fq_rows_quads``, of row r of consecutive quads).
    The word (i, j) of the four rows shares the 64-bit
    draw ``offset + draw0 + 8 i + j`` (``numerics.uniform_from_key`` on (R, C), ``offset =
    kw_ref[2]``: the draw of row 0, ``numerics.row_shard_draw_offset``): rows 4m, 4m+1 take
    word y0, rows 4m+2, 4m+3 word y1; the even row bytes 0 (low element) and 1 (high), the
    odd row bytes 2 and 3); ``draw0 = m * C/2 + 8 * (first block of the tile in its
    row)``. ``dyn``: x_rows/o_rows are the (4, g, 8) tile refs themselves and the four rows
    run as a loop (one row's code instead of four: a quarter of the instructions to fetch;
    the row picks its word and bytes by integer masks and shifts, the same bits).
    ``fmt``: an MX format (blocks of 32: (g, 16) words, word (i, j) draw ``draw0 + 16 i +
    j``, ``draw0`` counting 16 words a block) or None (NVFP4)."""
    nw = _bw(fmt)
    d = (draw0 + kw_ref[2] + (iota((g, nw), 0, plain) << (nw.bit_length() - 1))
         + iota((g, nw), 1, plain))
    words = threefry2x32(kw_ref[0], kw_ref[1], d - d, d)
    if dyn:
        @pl.loop(0, 4)
        def _(r):
            w = load_words(x_rows.at[r], slice(None), plain)
            s_val, e, finite = _row_scales(sc_ref, w, mode, fmt)
            m = -(lax.shift_right_logical(r, 1) & 1)  # rows 0, 1: word y0; rows 2, 3: y1
            bits = words[0] ^ ((words[0] ^ words[1]) & m)
            bits = lax.shift_right_logical(bits, (r & 1) << 4)  # odd rows: bytes 2, 3
            word = _scaled_words(w, e, s_val, finite, g, plain, sr_uniform(bits, 0),
                                 sr_uniform(bits, 1), mx=fmt is not None)
            o_rows.at[r][...] = lax.bitcast_convert_type(word, jnp.uint32)

        return
    for r in range(4):
        w = load_words(x_rows[r], slice(None), plain)
        s_val, e, finite = _row_scales(sc_ref, w, mode, fmt)
        bits = words[r // 2]
        word = _scaled_words(w, e, s_val, finite, g, plain, sr_uniform(bits, 2 * (r % 2)),
                             sr_uniform(bits, 2 * (r % 2) + 1), mx=fmt is not None)
        o_rows[r][...] = lax.bitcast_convert_type(word, jnp.uint32)


def _quads(ref):
    """The four row views ``ref.at[r]`` of a (4, g, 8) quad tile."""
    return [ref.at[r] for r in range(4)]


@functools.partial(jax.jit, static_argnames=("interpret", "recip", "sr", "g", "rq", "kt",
                                             "chunk", "steps", "sc_row", "flat",
                                             "compact", "fmt"))
def fq_rows_scaled(x, sc, kw, *, interpret: bool = False, recip: str | None = None,
                   sr: bool = False, g: int | None = None, rq: int | None = None,
                   kt: int | None = None, chunk: int = SUB, steps: int | None = None,
                   sc_row: int | None = None, flat: bool | None = None,
                   compact: bool | None = None, fmt=None):
    """Kernel call: x (R, C) bf16, ``sc = scalars(enc, dec)`` (or, with ``sc_row``, the flat
    (k * SC_WIDTH,) scalars of k operands, of which row ``sc_row`` is this one's: no slice
    of it runs outside the kernel), ``kw = key_words(key)``.
    Returns the bf16 (R, C) ``data * scale`` of 1x16 NVFP4 blocks along the last axis.
    ``g``, ``rq`` (SR only): blocks per row and row quads of a CTA tile (defaults: the
    GPU's choice; in interpret mode whole rows, one quad, unless given, so CPU tests can
    run the GPU tiling's draw offsets). Round-to-nearest tiling on the GPU (tuning only,
    same results): ``kt`` tiles of 256 blocks per pipeline step, ``chunk`` blocks per
    register tile (64, 128 or 256), ``steps`` pipeline steps per CTA (double-buffered
    when > 1); by default one tile per step and up to 4 steps per CTA (one step per CTA
    when only ``kt`` is given). ``flat`` (SR only): the flat quad layout
    (``_fq_rows_flat``) for widths of ``flat_quads``; by default on the GPU wherever it
    applies and ``g`` is not given, never in interpret mode unless asked (``rq`` then
    counts its quads a CTA). SR tiling knobs of the quad tiles (tuning only, same bits):
    ``steps`` pipeline steps (tiles) a CTA (double-buffered when > 1), ``compact`` a
    tile's rows and quads as loops rather than unrolled code (default on the GPU: 201.6
    against 223.3 µs with the amax pass at 8192^2 on an H100, fewer instructions to fetch;
    off in interpret mode).

    ``fmt``: None (NVFP4, 1x16 E4M3 blocks with the tensor scale of ``sc``) or an MX FP4
    format (``fp4jax.MXFP4`` / ``MXFP4_OCP``: 1x32 blocks, E8M0 scales by the format's
    rule, no tensor scale: ``sc`` is not read; C % 32 == 0). MX tiles hold as many
    elements as NVFP4's (128 blocks of 32 per 256-block tile; ``chunk`` halved); MX SR
    takes the quad tiles (``g`` blocks of 32) or, at the widths of ``flat_quads`` (C = 256,
    512, 768, ...), the flat layout, as NVFP4's."""
    fmt = _check_fmt(fmt)
    if not supported_rows(x.shape, x.dtype, sr, padded=True, block=16 if fmt is None else 32):
        raise ValueError(f"fq_rows needs bf16 (R, C), C % {16 if fmt is None else 32} == 0, "
                         f"R*C % {16 * SUB} == 0 (with a key also R % 4 == 0), got {x.dtype} "
                         f"{x.shape}")
    # "auto" (table, branching to recip_rn for extreme dec) emits the body twice; with
    # SR's Threefry that doubles an already long kernel, so SR takes "rn" alone. MX
    # formats take no reciprocal (a power-of-two scale): one body, "rn" unread.
    mode = recip_mode(recip or ("rn" if sr or fmt is not None else "auto"), None)
    r, c = x.shape
    nw = _bw(fmt)
    if sr:
        if flat or (flat is None and not interpret and g is None):
            frq = flat_quads(r, c, rq, fmt=fmt)
            if frq is not None:
                return _fq_rows_flat(x, sc, kw, interpret=interpret, mode=mode, rq=frq,
                                     sc_row=sc_row, fmt=fmt)
            if flat:
                b = 2 * nw
                raise ValueError(f"fq_rows SR tiling: flat=True needs C/{b} blocks a row that "
                                 f"fill whole 512-byte rows ({128 // nw} blocks) but are not a "
                                 f"multiple of 64, and rq={rq} quads that fit R/4 (got "
                                 f"{x.shape})")
        return _fq_rows_quads(x, sc, kw, interpret=interpret, mode=mode, g=g, rq=rq,
                              sc_row=sc_row, steps=steps or 1,
                              compact=not interpret if compact is None else compact, fmt=fmt)
    nbt = r * c // (2 * nw)
    bpt = SUB * 8 // nw  # blocks per tile: 4096 elements either way
    xw = lax.bitcast_convert_type(x.reshape(nbt, nw, 2), jnp.uint32)
    if interpret:
        def interp_body(sc_ref, kw_ref, x_ref, o_ref):
            sc_ref = scalar_row(sc_ref, sc_row)
            by_mode(sc_ref, mode, lambda md: _fq_tile(
                sc_ref, kw_ref, x_ref, o_ref, nb=nbt, plain=True, mode=md, fmt=fmt))

        o = pl.pallas_call(
            interp_body, out_shape=jax.ShapeDtypeStruct((nbt, nw), jnp.uint32),
            interpret=interpret, compiler_params=lane_params())(sc, kw, xw)
        return lax.bitcast_convert_type(o, jnp.bfloat16).reshape(r, c)

    ns = nbt // bpt
    chunk = chunk * 8 // nw
    # Defaults from an H200 sweep (docs/performance.md): one 256-block tile per step and 4
    # double-buffered steps per CTA, "auto" reciprocal; with two tiles per step the "auto"
    # branch doubles a body of two tiles (the table alone is exact only for safe dec).
    if steps is None:
        steps = pick_block(ns, (4, 2, 1)) if kt is None else 1
    kt = 1 if kt is None else kt
    if ns % (kt * steps) or chunk not in (64, 128, 256):
        raise ValueError(f"fq_rows tiling: kt={kt} x steps={steps} must divide {ns} tiles "
                         f"of {bpt} blocks, chunk={chunk * nw // 8} must be 64, 128 or 256 "
                         "(NVFP4 blocks)")

    def body(sc_gmem, kw_gmem, x_gmem, o_gmem):
        sc_gmem = scalar_row(sc_gmem, sc_row)
        cta = lax.axis_index("ctas")

        def step(_, x_smem, o_smem):
            def tiles(md):
                for i in range(kt):
                    _fq_tile(sc_gmem, kw_gmem, x_smem.at[i], o_smem.at[i], nb=bpt,
                             plain=False, mode=md, chunk=chunk, fmt=fmt)

            by_mode(sc_gmem, mode, tiles)

        plgpu.emit_pipeline(
            step, grid=(steps,),
            in_specs=[plgpu.BlockSpec((kt, bpt, nw), lambda j: (cta * steps + j, 0, 0))],
            out_specs=[plgpu.BlockSpec((kt, bpt, nw), lambda j: (cta * steps + j, 0, 0))],
            max_concurrent_steps=min(steps, 2),
        )(x_gmem, o_gmem)

    o = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((ns, bpt, nw), jnp.uint32),
        grid=(ns // (kt * steps),), grid_names=("ctas",),
        compiler_params=lane_params(unsafe_no_auto_barriers=True),
    )(sc, kw, xw.reshape(ns, bpt, nw))
    return lax.bitcast_convert_type(o, jnp.bfloat16).reshape(r, c)


def _fq_rows_quads(x, sc, kw, *, interpret: bool, mode: str, g: int | None = None,
                   rq: int | None = None, sc_row: int | None = None, steps: int = 1,
                   compact: bool = False, fmt=None):
    """``fq_rows_scaled`` with stochastic rounding: x viewed as (R, C/16, 8) words, each
    CTA (i, j) takes row quads ``i * rq + p`` (p < rq) x blocks ``j * g ..`` of them
    (``_fq_quad_tile`` per quad, first draw ``_quad_draw0``). On the GPU, when no width
    of ``GR`` divides C/16 (e.g. C = 768 or 256), g = 64 and the last tile of each row
    overhangs it: TMA reads the blocks past the row as zeros and skips them on the store,
    so only the row's own blocks, with their own draws (``_quad_draw0`` counts in C, not
    in tiles), are written. ``fmt``: an MX format (``g`` blocks of 32, (g, 16) words) or
    None (NVFP4)."""
    r, c = x.shape
    nw = _bw(fmt)
    nbr = c // (2 * nw)
    xw = lax.bitcast_convert_type(x.reshape(r, nbr, nw, 2), jnp.uint32)
    out_type = jax.ShapeDtypeStruct((r, nbr, nw), jnp.uint32)

    def result(o):
        return lax.bitcast_convert_type(o, jnp.bfloat16).reshape(r, c)

    if interpret:
        g = g or nbr
        rq = rq or 1
    else:
        g = g or pick_block(nbr, GR if nw == 8 else GR[-1:]) or GR[-1]  # MX: (64, 16)
        rq = rq or max(1, QUAD_BLOCKS * 8 // nw // (4 * g))
        while (r // 4) % rq:
            rq //= 2
    if (interpret and nbr % g) or (not interpret and g % 64) or (r // 4) % (rq * steps):
        raise ValueError(f"fq_rows SR tiling: g={g} must divide C/16={nbr} (interpret) or "
                         f"be a multiple of 64 (GPU), and rq={rq} x steps={steps} must "
                         f"divide R/4={r // 4}")

    def _quad_draw0(i, j, p):  # draw of word (0, 0) of row quad i * rq + p, block j * g
        return (i * rq + p) * (c // 2) + nw * g * j

    if interpret:
        def interp_body(sc_ref, kw_ref, x_ref, o_ref):
            sc_ref = scalar_row(sc_ref, sc_row)

            @pl.loop(0, r // (4 * rq))
            def _(i):
                for j in range(nbr // g):
                    for p in range(rq):
                        at = (pl.ds(4 * (i * rq + p), 4), pl.ds(j * g, g))
                        xs, os = x_ref.at[at], o_ref.at[at]
                        if not compact:
                            xs, os = _quads(xs), _quads(os)
                        _fq_quad_tile(sc_ref, kw_ref, xs, os, g=g,
                                      draw0=_quad_draw0(i, j, p), plain=True, mode=mode,
                                      dyn=compact, fmt=fmt)

        return result(pl.pallas_call(
            interp_body, out_shape=out_type, interpret=interpret,
            compiler_params=lane_params())(sc, kw, xw))

    def body(sc_gmem, kw_gmem, x_gmem, o_gmem):
        sc_gmem = scalar_row(sc_gmem, sc_row)
        i = lax.axis_index("rows")
        j = lax.axis_index("cols")

        def step(idx, x_smem, o_smem):
            tile = i * steps + (idx[0] if isinstance(idx, (tuple, list)) else idx)

            def quad(p):
                rows = pl.ds(4 * p, 4)
                xs, os = x_smem.at[rows], o_smem.at[rows]
                if not compact:
                    xs, os = _quads(xs), _quads(os)
                _fq_quad_tile(sc_gmem, kw_gmem, xs, os, g=g, draw0=_quad_draw0(tile, j, p),
                              plain=False, mode=mode, dyn=compact, fmt=fmt)

            if compact and rq > 1:
                pl.loop(0, rq)(quad)
            else:
                for p in range(rq):
                    quad(p)

        spec = plgpu.BlockSpec((4 * rq, g, nw), lambda t: (i * steps + t, j, 0))
        plgpu.emit_pipeline(step, grid=(steps,), in_specs=[spec], out_specs=[spec],
                            max_concurrent_steps=min(steps, 2))(x_gmem, o_gmem)

    o = plgpu.kernel(
        body, out_type=out_type,
        grid=(r // (4 * rq * steps), -(-nbr // g)), grid_names=("rows", "cols"),
        compiler_params=lane_params(unsafe_no_auto_barriers=True),
    )(sc, kw, xw)
    return result(o)


def flat_quads(r: int, c: int, rq: int | None = None, fmt=None) -> int | None:
    """Quads per CTA of the flat SR rows layout (``_fq_rows_flat``) for an (R, C) matrix,
    or None where it does not apply: the C/16 (NVFP4; ``fmt`` an MX format: C/32) blocks
    of a row not a multiple of 64 but filling whole 512-byte rows of words (NVFP4: a
    multiple of 16 blocks; MX: of 8; C = 256, 512, 768, ...: a small model's widths) and
    R/4 a multiple of the ``64 / gcd(blocks, 64)`` quads whose rows make whole 64-block
    register tiles. Default: about ``QUAD_BLOCKS`` NVFP4 blocks' elements a CTA, as the
    other SR tilings; ``rq`` checks a choice."""
    nw = _bw(_check_fmt(fmt))
    nbr = c // (2 * nw)
    if c % (2 * nw) or (nbr * nw) % 128 or nbr % 64 == 0 or r % 4:
        return None
    q = 64 // math.gcd(nbr, 64)
    if rq is None:
        rq = max(q, QUAD_BLOCKS * 8 // nw // (4 * nbr) // q * q)
        while (r // 4) % rq and rq > q:
            rq -= q
    return rq if rq % q == 0 and (r // 4) % rq == 0 else None


def _fq_rows_flat(x, sc, kw, *, interpret: bool, mode: str, rq: int,
                  sc_row: int | None = None, fmt=None):
    """``fq_rows_scaled`` with stochastic rounding for widths of ``flat_quads``: no tile
    overhangs a row. A CTA takes ``rq`` consecutive row quads; row ``r`` of them is read
    by its own TMA copy into a contiguous (rq, C/16, 8) tile, viewed as one run of
    ``n = rq * C/16`` blocks (flat index ``f = quad * C/16 + block``), cut into register
    tiles of 64 blocks for ``_fq_quad_tile``. The draws are unchanged: a quad's row holds
    C/2 words, so word (f, j) of the CTA's first quad ``m0`` has draw ``m0 * C/2 + 8 f + j``
    (``_fq_quad_tile``'s ``draw0 + 8 i + j``), the same as the quad tiles'. Interpret mode
    runs the same register tiles on x rearranged by XLA to (4, R/4 * C/16, 8) (the rows
    r of all quads contiguous), which is what the four TMA tiles hold on the GPU.
    ``fmt`` an MX format: the same with blocks of 32 elements, 16 words (C/32 blocks a
    row, word (f, j) draw ``m0 * C/2 + 16 f + j``)."""
    r, c = x.shape
    nw = _bw(fmt)
    nbr = c // (2 * nw)
    n = rq * nbr
    xw = lax.bitcast_convert_type(x.reshape(r // 4, 4, nbr, nw, 2), jnp.uint32)

    def tiles(sc_ref, kw_ref, xs, os, quad0, plain):
        for k in range(n // 64):
            rows = pl.ds(64 * k, 64)
            _fq_quad_tile(sc_ref, kw_ref, [v.at[rows] for v in xs], [v.at[rows] for v in os],
                          g=64, draw0=quad0 * (c // 2) + 64 * nw * k, plain=plain, mode=mode,
                          fmt=fmt)

    if interpret:
        xt = xw.transpose(1, 0, 2, 3).reshape(4, r // 4 * nbr, nw)

        def interp_body(sc_ref, kw_ref, x_ref, o_ref):
            sc_ref = scalar_row(sc_ref, sc_row)

            @pl.loop(0, r // (4 * rq))
            def _(i):
                at = pl.ds(i * n, n)
                tiles(sc_ref, kw_ref, [x_ref.at[q, at] for q in range(4)],
                      [o_ref.at[q, at] for q in range(4)], i * rq, True)

        o = pl.pallas_call(
            interp_body, out_shape=jax.ShapeDtypeStruct(xt.shape, jnp.uint32),
            interpret=interpret, compiler_params=lane_params())(sc, kw, xt)
        o = o.reshape(4, r // 4, nbr, nw).transpose(1, 0, 2, 3)
        return lax.bitcast_convert_type(o, jnp.bfloat16).reshape(r, c)

    def body(sc_gmem, kw_gmem, x_gmem, o_gmem):
        sc_gmem = scalar_row(sc_gmem, sc_row)
        i = lax.axis_index("rows")

        def step(_, *refs):
            views = [v.reshape(n, nw) for v in refs]
            tiles(sc_gmem, kw_gmem, views[:4], views[4:], i * rq, False)

        specs = [plgpu.BlockSpec((rq, 1, nbr, nw), lambda _, q=q: (i, q, 0, 0))
                 for q in range(4)]
        plgpu.emit_pipeline(step, grid=(1,), in_specs=specs, out_specs=specs,
                            max_concurrent_steps=1)(*[x_gmem] * 4, *[o_gmem] * 4)

    o = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct(xw.shape, jnp.uint32),
        grid=(r // (4 * rq),), grid_names=("rows",),
        compiler_params=lane_params(unsafe_no_auto_barriers=True),
    )(sc, kw, xw)
    return lax.bitcast_convert_type(o, jnp.bfloat16).reshape(r, c)


# ---------------------------------------------------------------------------
# 16x1 along the first axis (optionally RHT'd), and 16x16.
# ---------------------------------------------------------------------------


def _fwht16(v):
    """``fp4jax.hadamard.fwht_tiles`` over a list of 16 (or 32: the MX formats' RHT-32)
    arrays (the tile axis is the list): the same stages, pairs and float32 operations,
    then times ``f32(1/sqrt(n))`` (1/4 for 16)."""
    v = list(v)
    n = len(v)
    h = 1
    while h < n:
        for i in range(0, n, 2 * h):
            for j in range(i, i + h):
                v[j], v[j + h] = v[j] + v[j + h], v[j] - v[j + h]
        h *= 2
    c = 0.25 if n == 16 else np.float32(1.0 / np.sqrt(n))
    return [t * c for t in v]


def _fq_strip_cols(sc_ref, kw_ref, x_ref, o_ref, *, g: int, row0, col0, n_cols: int,
                   plain: bool, mode: str, sr: bool, rht: bool, fmt=None,
                   quad_bufs: bool = False):
    """One strip: x_ref (16, g, 8) uint32 words (row k of the strip is x_ref[k]; word
    (i, w) holds columns ``col0 + 16 i + 2 w`` (low half) and ``+1`` (high half)),
    o_ref (16, g, 8) words out. Each column of the strip is one 16-element block (along
    the rows), after the Hadamard rotation along the rows when ``rht``. SR
    (``numerics.uniform_from_key`` on x's stored (R, C) order): element (row, col) takes
    byte ``2 (row % 2) + (col % 2)`` of word ``row % 4 // 2`` of the 64-bit draw ``(row //
    4) * n_cols/2 + col // 2``, so a word (two neighbouring columns) of rows 4p .. 4p+3
    shares one draw.

    Code size: the block scales need all 16 (rotated) rows at once, but the per-element
    rounding (with its 80-operation Threefry for SR) runs in a loop over the 16 rows
    (pairs of rows, or quads with SR: one draw per iteration), so
    it is emitted once, not 16 times (an unrolled SR strip took minutes to compile). The
    rotated low halves wait in ``o_ref`` and the high halves in ``x_ref`` (float32 bits,
    one word per element) between the two phases.

    ``fmt``: an MX format: strips of 32 rows (x_ref, o_ref (32, g, 8)), 32x1 blocks, the
    RHT (if ``rht``) of size 32 (``sc``'s 32 signs), scales by ``mx_block_scales``.

    ``quad_bufs`` (NVFP4, ``fq_rows_cols_scaled``'s narrow strips): x_ref is a list of 4
    refs (4 g, 8), buffer r holding rows r, 4 + r, 8 + r, 12 + r of the strip (row 4p + r
    at words ``p g ..``), and the rounding loop takes quads (4 rows an iteration) also
    without SR: the same operations on the same rows."""
    enc6 = sc_ref[0]
    nk = 16 if quad_bufs else x_ref.shape[0]  # 16 (NVFP4) or 32 (MX): block and RHT size

    def xrow(p, r):  # quad_bufs: row 4 p + r of the strip (p static or traced, r static)
        return x_ref[r].at[pl.ds(p * g, g)]

    lay = None if plain else strip_layout(g)
    words = [load_words(xrow(k // 4, k % 4) if quad_bufs else x_ref.at[k], slice(None), plain,
                        lay) for k in range(nk)]
    scales = []
    for half, stash in ((0, o_ref), (1, x_ref)):
        v = [bits_to_f32(w << 16) if half == 0 else bits_to_f32(w & -0x10000) for w in words]
        if rht:
            v = _fwht16([v[k] * sc_ref[SC_SIGNS + k] for k in range(nk)])
        amax = jnp.abs(v[0])  # float max: NaN propagates, Inf stays above every finite
        for k in range(1, nk):
            amax = jnp.maximum(amax, jnp.abs(v[k]))
        if fmt is None:
            s_val, s_byte, finite = block_scale_bits(bits_to_i32(amax), enc6)
            scales.append((s_val, elem_scale(sc_ref, s_val, s_byte, mode), finite))
        else:
            s_val, e, finite = mx_block_scales(bits_to_i32(amax), fmt)
            scales.append((s_val, e, finite))
        for k in range(nk):
            vk = lax.bitcast_convert_type(v[k], jnp.uint32)
            if quad_bufs and half == 1:
                xrow(k // 4, k % 4)[...] = vk
            else:
                stash[k] = vk
    draw0 = None
    per = 4 if sr or quad_bufs else 2  # rows per loop iteration
    if sr:  # draw of (rows row0 .. row0 + 3; the word's column pair); row0 % 16 == 0
        draw0 = (kw_ref[2] + lax.shift_right_logical(row0, 2) * (n_cols // 2)
                 + lax.shift_right_logical(col0, 1) + (iota((g, 8), 0, plain, lay) << 3)
                 + iota((g, 8), 1, plain, lay))

    @pl.loop(0, nk // per)
    def _(p):
        if sr:
            d = draw0 + p * (n_cols // 2)
            draws = threefry2x32(kw_ref[0], kw_ref[1], d - d, d)
        for r in range(per):
            k = per * p + r
            out = []
            for half, stash in ((0, o_ref), (1, x_ref)):
                s_val, e, finite = scales[half]
                src = xrow(p, r) if quad_bufs and half == 1 else stash.at[k]
                v = bits_to_f32(load_words(src, slice(None), plain, lay))
                u = sr_uniform(draws[r // 2], 2 * (r % 2) + half) if sr else None
                out.append((_satfinite_bf16(e2m1_value(v * e, u, plain) * s_val,
                                            fmt is not None), finite))
            (lo, flo), (hi, fhi) = out
            bits = (jnp.where(flo, lax.shift_right_logical(bits_to_i32(lo), 16), _NAN2 & 0xFFFF)
                    | jnp.where(fhi, _bf16_hi(hi), _NAN2 & -0x10000))
            o_ref[k] = lax.bitcast_convert_type(bits, jnp.uint32)


def _fq_strip_2d(sc_ref, x_ref, o_ref, *, g: int, plain: bool, mode: str):
    """One strip of ``g`` 16x16 tiles: x_ref/o_ref (16, g, 8) words; one scale per tile
    (amax over its 16 rows' blocks). Rule: ``fp4jax.quantization.quantize_unchecked`` with
    ``block_2d=True``, round-to-nearest."""
    s_val, _, e, finite = strip_2d_scales(sc_ref, x_ref, plain, mode)
    for k in range(16):
        w = load_words(x_ref.at[k], slice(None), plain)
        o_ref[k] = lax.bitcast_convert_type(_scaled_words(w, e, s_val, finite, g, plain),
                                            jnp.uint32)


def _fq_strip_2d_f32(sc_ref, x_ref, o_ref, *, g: int, plain: bool, mode: str):
    """``_fq_strip_2d`` of a float32 input: x_ref (16, g, 16) uint32 words (one element
    each: a tile row's block is a row of 16 words), o_ref (16, g, 16) bfloat16. The same
    rules on the element's float32 value (``fp4jax.quantization.quantize_unchecked`` with
    ``block_2d=True`` computes in float32 whatever the input): the tile amax is the max of
    ``|x|`` bits over its 256 elements (NaN/Inf above every finite value), then
    ``block_scale_bits``, ``elem_scale``, ``e2m1_value``; a NaN/Inf tile gives NaN."""
    words = [load_words(x_ref.at[k], slice(None), plain) for k in range(16)]
    amax = None
    for w in words:
        a = jnp.max(w & 0x7FFFFFFF, axis=1)
        amax = a if amax is None else jnp.maximum(amax, a)
    s_val, s_byte, finite = block_scale_bits(amax, sc_ref[0])
    e = elem_scale(sc_ref, s_val, s_byte, mode)
    eb = lax.broadcast_in_dim(e, (g, 16), (0,))
    sb = lax.broadcast_in_dim(s_val, (g, 16), (0,))
    fin = lax.broadcast_in_dim(finite.astype(jnp.int32), (g, 16), (0,))
    for k, w in enumerate(words):
        v = e2m1_value(bits_to_f32(w) * eb, None, plain) * sb
        o_ref[k] = jnp.where(fin != 0, v, jnp.nan).astype(jnp.bfloat16)


GC = (64, 48, 32, 16)  # column-block groups (of 16 columns) per fq_cols strip, preferred first
COLS_MULTIPLE = 16 * GC[-1]  # fq_cols and the rotated amaxes: C a multiple of this (256)


def _cols_g(nc: int) -> int:
    """Column groups per strip of the column kernels for C/16 = ``nc`` (``GC``: 64, the
    WGMMA layout, when it divides; else the largest strided-layout width that does)."""
    g = pick_block(nc, GC)
    if g is None:
        raise ValueError(f"C/16={nc} is not a multiple of {GC[-1]}")
    return g


GC_MX = (32, 16)  # column groups per strip of the MX columns kernel (32 rows: fewer groups)


def supported_cols(shape, dtype, block: int = 16) -> bool:
    """bf16 (R, C), R % ``block`` == 0 (16: NVFP4; 32: the MX formats' 32x1 blocks),
    C % 256 == 0, R*C < 2^31."""
    if len(shape) != 2 or jnp.dtype(dtype) != jnp.bfloat16:
        return False
    r, c = shape
    return r % block == 0 and c % COLS_MULTIPLE == 0 and r * c < 2**31


def supported_2d(shape, dtype) -> bool:
    """bf16 or float32 (R, C), R % 16 == 0, C % 1024 == 0."""
    if len(shape) != 2 or jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16),
                                                   jnp.dtype(jnp.float32)):
        return False
    r, c = shape
    return r % 16 == 0 and c % (16 * G2D[-1]) == 0


def _strip_call(x, sc, kw, strip, *, g: int, interpret: bool, name: str,
                out_rows: int | None = None, steps: int = 1, rows: int = 16, cw: int = 16):
    """Run ``strip(sc_ref, kw_ref, x_ref, o_ref, g, row0, col0, plain)`` over all strips of
    ``rows`` rows x ``cw * g`` columns of x (R, C) bf16 (``rows``, ``cw``: 16, or 32 for the
    MX formats' 32x1 columns and 32x32 tiles). With ``out_rows`` None (``rows``) returns
    the bf16 (R, C) output; else the raw (R/rows, out_rows, C/cw, cw/2) uint32 output
    (``o_ref`` of a strip is (out_rows, g, cw/2)). On the GPU a CTA takes ``steps``
    neighbouring strips of a row of strips, double-buffered when ``steps > 1`` (tuning
    only)."""
    r, c = x.shape
    nr, nc = r // rows, c // cw
    out_rows = rows if out_rows is None else out_rows
    if x.dtype == jnp.float32:  # one element a word; the operand out as bf16 elements
        if out_rows != rows:
            raise ValueError(f"{name}: float32 input only for operand kernels")
        wpb = cw
        xw = lax.bitcast_convert_type(x.reshape(nr, rows, nc, cw), jnp.uint32)
        out_type = jax.ShapeDtypeStruct((nr, rows, nc, cw), jnp.bfloat16)
    else:
        wpb = cw // 2
        xw = lax.bitcast_convert_type(x.reshape(nr, rows, nc, wpb, 2), jnp.uint32)
        out_type = jax.ShapeDtypeStruct((nr, out_rows, nc, wpb), jnp.uint32)

    def result(o):
        if out_rows != rows:
            return o
        if x.dtype == jnp.float32:
            return o.reshape(r, c)
        return lax.bitcast_convert_type(o, jnp.bfloat16).reshape(r, c)

    if interpret:
        def interp_body(sc_ref, kw_ref, x_ref, o_ref):
            @pl.loop(0, nr)
            def _(i):
                for j in range(nc // g):
                    strip(sc_ref, kw_ref, x_ref.at[i, :, pl.ds(j * g, g)],
                          o_ref.at[i, :, pl.ds(j * g, g)], g, rows * i, cw * g * j, True)

        o = pl.pallas_call(
            interp_body, out_shape=out_type,
            interpret=interpret, compiler_params=lane_params())(sc, kw, xw)
        return result(o)
    if nc % (g * steps):
        raise ValueError(f"{name}: g={g} x steps={steps} must divide C/16={nc}")

    def body(sc_gmem, kw_gmem, x_gmem, o_gmem):
        i = lax.axis_index("rows")
        j = lax.axis_index("cols")

        def step(idx, x_smem, o_smem):
            jj = j * steps + (idx[0] if isinstance(idx, (tuple, list)) else idx)
            strip(sc_gmem, kw_gmem, x_smem.at[0], o_smem.at[0], g, rows * i, cw * g * jj,
                  False)

        plgpu.emit_pipeline(
            step, grid=(steps,),
            in_specs=[plgpu.BlockSpec((1, rows, g, wpb), lambda t: (i, 0, j * steps + t, 0))],
            out_specs=[plgpu.BlockSpec((1, out_rows, g, wpb),
                                       lambda t: (i, 0, j * steps + t, 0))],
            max_concurrent_steps=min(steps, 2),
        )(x_gmem, o_gmem)

    o = plgpu.kernel(
        body, out_type=out_type,
        grid=(nr, nc // (g * steps)), grid_names=("rows", "cols"),
        compiler_params=lane_params(unsafe_no_auto_barriers=True),
    )(sc, kw, xw)
    return result(o)


@functools.partial(jax.jit, static_argnames=("interpret", "recip", "sr", "rht", "g", "steps",
                                             "sc_row", "fmt"))
def fq_cols_scaled(x, sc, kw, *, interpret: bool = False, recip: str = "rn",
                   sr: bool = False, rht: bool = False, g: int | None = None,
                   steps: int = 1, sc_row: int | None = None, fmt=None):
    """Kernel call: x (R, C) bf16, ``sc = scalars(enc, dec, signs)`` (``sc_row``: as
    ``fq_rows_scaled``'s), ``kw = key_words(key)``. Returns bf16 (R, C): ``data * scale``
    of 16x1 NVFP4 blocks along the rows of ``rht16(x)`` (rows rotated in tiles of 16 when
    ``rht``) or of ``x``. ``fmt`` an MX FP4 format: 32x1 blocks (R % 32 == 0) with E8M0
    scales by its rule, after the RHT of size 32 (``sc``'s 32 signs) when ``rht``; the
    tensor scales of ``sc`` are not read."""
    fmt = _check_fmt(fmt)
    b = 16 if fmt is None else 32
    if not supported_cols(x.shape, x.dtype, b):
        raise ValueError(f"fq_cols needs bf16 (R, C), R % {b} == 0, C % {COLS_MULTIPLE} == 0, "
                         f"got {x.dtype} {x.shape}")
    mode = recip_mode(recip, None)
    n_cols = x.shape[1]
    if fmt is None:
        g = g or (x.shape[1] // 16 if interpret else _cols_g(x.shape[1] // 16))
    else:
        g = g or (x.shape[1] // 16 if interpret else pick_block(x.shape[1] // 16, GC_MX))

    def strip(sc_ref, kw_ref, x_ref, o_ref, g_, row0, col0, plain):
        sc_ref = scalar_row(sc_ref, sc_row)
        body = functools.partial(_fq_strip_cols, sc_ref, kw_ref, x_ref, o_ref, g=g_,
                                 row0=row0, col0=col0, n_cols=n_cols, plain=plain, sr=sr,
                                 rht=rht, fmt=fmt)
        if fmt is not None:  # no reciprocal: one body
            body(mode=mode)
            return
        by_mode(sc_ref, mode, lambda md: body(mode=md))

    return _strip_call(x, sc, kw, strip, g=g, interpret=interpret, name="fq_cols",
                       steps=steps, rows=b)


@functools.partial(jax.jit, static_argnames=("interpret", "recip", "g", "sc_row"))
def fq_2d_scaled(x, sc, *, interpret: bool = False, recip: str = "rn", g: int | None = None,
                 sc_row: int | None = None):
    """Kernel call: x (R, C) bf16 or float32 (a float32 master weight: quantized from its
    float32 values, ``_fq_strip_2d_f32``), ``sc = scalars(enc, dec)`` (``sc_row``: as
    ``fq_rows_scaled``'s). Returns bf16 (R, C):
    ``data * scale`` of 16x16-tile NVFP4 (round-to-nearest). ``recip="rn"`` as the
    16x16 quantize kernel (one reciprocal per 256 elements)."""
    if not supported_2d(x.shape, x.dtype):
        raise ValueError(f"fq_2d needs bf16 or float32 (R, C), R % 16 == 0, "
                         f"C % {16 * G2D[-1]} == 0, got {x.dtype} {x.shape}")
    mode = recip_mode(recip, None)
    g = g or (x.shape[1] // 16 if interpret else pick_block(x.shape[1] // 16, G2D))

    def strip(sc_ref, kw_ref, x_ref, o_ref, g_, row0, col0, plain):
        del kw_ref, row0, col0
        sc_ref = scalar_row(sc_ref, sc_row)
        fn = _fq_strip_2d_f32 if x.dtype == jnp.float32 else _fq_strip_2d
        by_mode(sc_ref, mode, lambda md: fn(sc_ref, x_ref, o_ref, g=g_, plain=plain, mode=md))

    return _strip_call(x, sc, key_words(None), strip, g=g, interpret=interpret, name="fq_2d")


# ---------------------------------------------------------------------------
# With the tensor scales (the amax pass, XLA).
# ---------------------------------------------------------------------------


def _finite_max_bits(v):
    """Elementwise max over the list ``v`` of float32 arrays of ``|v|``, with NaN/Inf
    counted as 0 (the core's ``finite_amax``), as int32 bits. Float compares, selects
    and max (full rate, the abs folds into them) rather than integer ones (half rate)."""
    m = None
    for t in v:
        a = jnp.abs(t)
        a = jnp.where(a < jnp.inf, a, 0.0)
        m = a if m is None else jnp.maximum(m, a)
    return bits_to_i32(m)


def _rht_cols_strip_amax(sc_ref, x_ref, a_ref, *, plain: bool, plain_amax: bool = False):
    """Finite amax bits (int32, NaN/Inf counted as 0) of every rotated column block of a
    strip: x_ref (16, g, 8) words in, a_ref (2, g, 8) out (low / high halves). The
    rotation is ``_fwht16``, the very operations of ``_fq_strip_cols``. With
    ``plain_amax`` a_ref is (4, g, 8) and rows 2, 3 get the amax of the unrotated
    blocks (the same read serves ``fq_rows``' tensor scale)."""
    lay = None if plain else strip_layout(x_ref.shape[1])
    words = [load_words(x_ref.at[k], slice(None), plain, lay) for k in range(16)]
    for half in (0, 1):
        v = [bits_to_f32(w << 16) if half == 0 else bits_to_f32(w & -0x10000) for w in words]
        if plain_amax:
            a_ref[2 + half] = lax.bitcast_convert_type(_finite_max_bits(v), jnp.uint32)
        v = _fwht16([v[k] * sc_ref[SC_SIGNS + k] for k in range(16)])
        a_ref[half] = lax.bitcast_convert_type(_finite_max_bits(v), jnp.uint32)


@functools.partial(jax.jit, static_argnames=("interpret", "g"))
def rht_cols_amax(x, signs, *, interpret: bool = False, g: int | None = None):
    """``max |rht16(x, axis=0)|`` over the finite values (float32 scalar), where the rotation
    runs along the rows in tiles of 16 (``fp4jax.hadamard.fwht_tiles``: the same float32
    bits as the XLA path's ``random_hadamard_transform``), without writing the rotated
    tensor: a Pallas pass writes one amax per column block (1/16 of x, int32 bits) and
    XLA reduces those. x: bf16 (R, C), see ``supported_cols``. Rule: the finite amax of
    ``fp4jax.quantization.quantize_unchecked`` (``finite_amax``)."""
    return _max_f32(_rht_strip_amaxes(x, signs, interpret, g, plain_amax=False))


def _max_f32(a):
    """The float32 whose (non-negative) int32 bits are the largest in uint32 array ``a``."""
    return bits_to_f32(lax.bitcast_convert_type(jnp.max(a), jnp.int32))


def _rht_strip_amaxes(x, signs, interpret, g, *, plain_amax: bool):
    name = "cols_amaxes" if plain_amax else "rht_cols_amax"
    if not supported_cols(x.shape, x.dtype):
        raise ValueError(f"{name} needs bf16 (R, C), R % 16 == 0, C % {COLS_MULTIPLE} "
                         f"== 0, got {x.dtype} {x.shape}")
    g = g or (x.shape[1] // 16 if interpret else _cols_g(x.shape[1] // 16))
    sc = jnp.concatenate([jnp.zeros((SC_SIGNS,), jnp.float32), signs.astype(jnp.float32)])

    def strip(sc_ref, kw_ref, x_ref, a_ref, g_, row0, col0, plain):
        del kw_ref, row0, col0, g_
        _rht_cols_strip_amax(sc_ref, x_ref, a_ref, plain=plain, plain_amax=plain_amax)

    return _strip_call(x, sc, key_words(None), strip, g=g, interpret=interpret,
                       name=name, out_rows=4 if plain_amax else 2)


@functools.partial(jax.jit, static_argnames=("interpret", "g"))
def cols_amaxes(x, signs, *, interpret: bool = False, g: int | None = None):
    """``(finite amax of x, rht_cols_amax(x, signs))`` from one read of x: the two tensor
    amaxes of an operand that is quantized along rows (``fq_rows``) and, rotated, along
    columns (``fq_cols`` with ``signs``), as the fprop and wgrad ``x`` or the dgrad and
    wgrad ``dy`` of the NVFP4 recipe are. Float32 scalars; x as ``rht_cols_amax``."""
    a = _rht_strip_amaxes(x, signs, interpret, g, plain_amax=True)  # (R/16, 4, C/16, 8)
    # one reduction for both (rows 0-1 rotated, 2-3 plain): max is exact in any order
    m = jnp.max(a.reshape(a.shape[0], 2, 2, *a.shape[2:]), axis=(0, 2, 3, 4))
    m = bits_to_f32(lax.bitcast_convert_type(m, jnp.int32))
    return m[1], m[0]


def fq_rows(x, key=None, *, interpret: bool = False, amax=None, offset=None, **kw):
    """bf16 ``data * scale`` of ``quantize(x, NVFP4, axis=-1)`` (SR with ``key``) and its
    tensor decode scale: ``(scaled (R, C) bf16, dec f32)``. ``amax``: x's finite amax if
    already known (else an XLA reduction computes it). ``offset``: the first SR draw
    (uint32 scalar, ``numerics.row_shard_draw_offset``; default 0)."""
    enc, dec = global_scales(x, amax)
    return fq_rows_scaled(x, scalars(enc, dec), key_words(key, offset), sr=key is not None,
                          interpret=interpret, **kw), dec


def fq_cols(x, key=None, *, signs=None, interpret: bool = False, amax=None, offset=None,
            **kw):
    """bf16 ``data * scale`` of ``quantize(rht(x, axis=0, signs) if signs is not None else
    x, NVFP4, axis=0)`` (SR with ``key``) and its tensor decode scale. ``amax``: the
    finite amax of the tensor that is quantized (rotated, with ``signs``) if known.
    ``offset``: as ``fq_rows``'s."""
    if amax is None and signs is not None:
        amax = rht_cols_amax(x, signs, interpret=interpret)
    enc, dec = global_scales(x, amax)
    return fq_cols_scaled(x, scalars(enc, dec, signs), key_words(key, offset),
                          sr=key is not None,
                          rht=signs is not None, interpret=interpret, **kw), dec


def fq_2d(x, *, interpret: bool = False, amax=None, **kw):
    """bf16 ``data * scale`` of ``quantize(x, NVFP4, block_2d=True)`` and its decode scale
    (``amax``: x's finite amax if known)."""
    enc, dec = global_scales(x, amax)
    return fq_2d_scaled(x, scalars(enc, dec), interpret=interpret, **kw), dec



# ---------------------------------------------------------------------------
# 1x16 rows and (RHT-16) 16x1 columns from one read.
# ---------------------------------------------------------------------------

ROWS_COLS_MULTIPLE = 1024  # fq_rows_cols: C a multiple of this (strips of 64 column blocks)
ROWS_COLS_NARROW = (256, 512, 768)  # or one of these (a whole row a strip: _fq_strip_rows_flat)


def supported_rows_cols(shape, dtype, sr_rows: bool = False) -> bool:
    """Shapes of ``fq_rows_cols_scaled``: those of both ``supported_cols`` and
    ``supported_rows`` (with ``sr_rows``: SR rows in quads, ``padded``) and C % 1024 == 0
    (strips of a multiple of 64 column blocks: the WGMMA register layout, whose row
    reductions the 1x16 blocks need) or C = 256, 512, 768 (a small model's widths: a strip
    is 16 whole rows, the rows operand in ``flat_quads``' register tiles)."""
    return (supported_cols(shape, dtype) and supported_rows(shape, dtype, sr_rows, padded=True)
            and (shape[1] % ROWS_COLS_MULTIPLE == 0 or shape[1] in ROWS_COLS_NARROW))


def _fq_strip_rows(sc_ref, kw_ref, x_ref, o_ref, *, g: int, row0, col0, n_cols: int,
                   plain: bool, mode: str, sr: bool):
    """The 1x16 rows operand of one strip: x_ref/o_ref (16, g, 8) words, row k of the strip
    a (g, 8) tile whose rows are blocks. Round to nearest: ``_fq_tile`` a row (a loop over
    the 16 rows). SR: ``_fq_quad_tile`` a row quad (a loop over the 4 quads, the quad's
    rows a loop too, ``dyn``), first draw ``(row0/4 + p) * C/2 + col0/2``: the draw
    ``_fq_rows_quads`` gives the same words (``_quad_draw0``: quad index times C/2 plus
    8 words a block before the tile)."""
    if not sr:
        @pl.loop(0, 16)
        def _(k):
            _fq_tile(sc_ref, kw_ref, x_ref.at[k], o_ref.at[k], nb=g, plain=plain, mode=mode,
                     chunk=max(g, SUB))

        return

    @pl.loop(0, 4)
    def _(p):
        rows = pl.ds(4 * p, 4)
        draw0 = ((lax.shift_right_logical(row0, 2) + p) * (n_cols // 2)
                 + lax.shift_right_logical(col0, 1))
        _fq_quad_tile(sc_ref, kw_ref, x_ref.at[rows], o_ref.at[rows], g=g, draw0=draw0,
                      plain=plain, mode=mode, dyn=True)


def _fq_strip_rows_flat(sc_ref, kw_ref, xs, os, *, g: int, row0, n_cols: int, plain: bool,
                        mode: str, sr: bool):
    """``_fq_strip_rows`` of a narrow strip (16 whole rows of g = C/16 blocks, g < 64):
    ``xs``/``os`` 4 refs (4 g, 8), buffer r rows r, 4 + r, 8 + r, 12 + r (row 4p + r at
    blocks ``p g ..``), cut into register tiles of 64 blocks (4 g is a multiple of 64).
    RtN: ``_fq_tile`` a tile. SR: ``_fq_rows_flat``'s tiles (``_fq_quad_tile`` on the same
    64 blocks of the 4 buffers): block f = p g + i of a buffer is block i of quad row0/4 + p,
    so its word j has draw ``(row0/4) C/2 + 8 f + j`` (C/2 = 8 g), ``draw0`` of tile k
    ``(row0/4) C/2 + 512 k``."""
    n = 4 * g
    if not sr:
        for r in range(4):
            _fq_tile(sc_ref, kw_ref, xs[r], os[r], nb=n, plain=plain, mode=mode, chunk=64)
        return
    quad0 = lax.shift_right_logical(row0, 2)
    for k in range(n // 64):
        rows = pl.ds(64 * k, 64)
        _fq_quad_tile(sc_ref, kw_ref, [v.at[rows] for v in xs], [v.at[rows] for v in os],
                      g=64, draw0=quad0 * (n_cols // 2) + 512 * k, plain=plain, mode=mode)


@functools.partial(jax.jit, static_argnames=("interpret", "recip_rows", "sr_rows", "sr_cols",
                                             "rht", "g", "steps", "sc_row_rows",
                                             "sc_row_cols"))
def fq_rows_cols_scaled(x, sc_rows, sc_cols, kw_rows, kw_cols, *, interpret: bool = False,
                        recip_rows: str | None = None, sr_rows: bool = False,
                        sr_cols: bool = False, rht: bool = False, g: int | None = None,
                        steps: int = 1, sc_row_rows: int | None = None,
                        sc_row_cols: int | None = None):
    """``(fq_rows_scaled(x, sc_rows, kw_rows, sr=sr_rows, sc_row=sc_row_rows),
    fq_cols_scaled(x, sc_cols, kw_cols, sr=sr_cols, rht=rht, sc_row=sc_row_cols))``, the
    same bits, from ONE read of x: the NVFP4 x (fprop rows + wgrad RHT'd columns) or dy
    (dgrad rows + wgrad columns) of ``dot_sm90.make_operands`` in one pass instead of two
    (docs/performance.md, "NVFP4 at the emulation floor": 4 S bytes a tensor with
    ``cols_amaxes`` instead of 5.5 S). NVFP4 only (no ``fmt``); x bf16 (R, C), see
    ``supported_rows_cols``. ``dot_sm90.make_operands`` calls it under ``fused``
    (``OPERAND_PASSES``).
    ``g`` (C % 1024 shapes; default 64 on the GPU, whole rows in interpret mode) column
    blocks a strip and ``steps`` strips a CTA (double-buffered when > 1): tuning only.

    Plan (how each output stays bit-identical):

    * Tiles: ``fq_cols``' strips, 16 rows x 16 g columns (x viewed as (R/16, 16, C/16, 8)
      words, g = 64 column blocks on the GPU, whole rows in interpret mode), a CTA
      ``steps`` strips of a row of strips (``_strip_call``'s grid). Row k of the strip,
      a (g, 8) word tile, is also g whole 1x16 row blocks, so the rows operand needs no
      other tile: phase 1 (``_fq_strip_rows``) writes it from x's strip with the rows
      kernel's own tile code (``_fq_tile`` a row, RtN; ``_fq_quad_tile`` a row quad, SR);
      phase 2 is ``_fq_strip_cols`` itself, unchanged (it then overwrites the input
      strip with its stash of rotated high halves, so it must come second). Each thread
      reads, in both phases, only the words of the WGMMA layout it later overwrites: no
      barrier between them. Scales: the rows phase reads ``sc_rows`` (the ``"auto"``
      reciprocal by default for RtN, ``"rn"`` for SR, as ``fq_rows_scaled``), the
      columns phase ``sc_cols`` (``"rn"``, with the RHT signs), as the separate kernels.
    * SR draws: both kernels count draws by ``numerics.uniform_from_key`` on x's stored
      (R, C) order, so an element's counter is the same in both: word (i, j) of a strip
      row quad p (rows row0 + 4p .. +3) has counter ``offset + (row0/4 + p) * C/2 +
      col0/2 + 8 i + j``; rows 4p, 4p+1 take its word y0, 4p+2, 4p+3 y1; even rows bytes
      0 (low element) and 1, odd rows 2 and 3. ``fq_rows``' quad tiles give the quad's
      first draw as ``m * C/2 + 8 * first block`` (m = row0/4 + p, first block =
      col0/16), ``_fq_strip_cols`` as ``(row0 >> 2) * C/2 + (col0 >> 1) + p * C/2``: the
      same number. The two outputs differ only in the key (and ``offset``) words: phase 1
      draws with ``kw_rows``, phase 2 with ``kw_cols`` (two Threefry per quad word, as
      the two kernels together; with one key for both the draws would be shared).
    * Narrow widths (C = 256, 512, 768, a small model's: ``fq_cols`` takes strips of 16,
      32, 48 blocks in the strided layout, which has no row reductions):
      ``_fq_rows_cols_narrow``, a strip of 16 whole rows held as 4 buffers of a row of each
      quad, the rows operand in ``_fq_rows_flat``'s 64-block register tiles (its draws:
      flat block f = p g + i has word j's draw ``(row0/4) C/2 + 8 f + j``, the same
      counter), the columns phase on strided-layout views of the same buffers, a
      warpgroup barrier between the phases (the layouts differ).
    * Budget (g = 64): shared memory a step 32 KiB in + 2 x 32 KiB out = 96 KiB (192 KiB
      double-buffered with ``steps > 1``, under the 227 KiB of an H100); registers: phase 1
      holds one (64, 8) row tile (4 words a thread) or a quad's draws, phase 2 is
      ``fq_cols``' peak (16 rows of 4 words and their float32 halves): no more than
      ``fq_cols`` alone. Bytes: reads 2 B and writes 4 B an element (two bf16 copies).
    """
    if not supported_rows_cols(x.shape, x.dtype, sr_rows):
        raise ValueError(f"fq_rows_cols needs bf16 (R, C), R % 16 == 0, "
                         f"C % {ROWS_COLS_MULTIPLE} == 0, R*C < 2^31, got {x.dtype} {x.shape}")
    mode_rows = recip_mode(recip_rows or ("rn" if sr_rows else "auto"), None)
    r, c = x.shape
    nr, nc = r // 16, c // 16
    if c in ROWS_COLS_NARROW:
        return _fq_rows_cols_narrow(x, sc_rows, sc_cols, kw_rows, kw_cols,
                                    interpret=interpret, mode_rows=mode_rows, sr_rows=sr_rows,
                                    sr_cols=sr_cols, rht=rht, steps=steps,
                                    sc_row_rows=sc_row_rows, sc_row_cols=sc_row_cols)
    g = g or (nc if interpret else 64)
    if nc % (g * steps) or (not interpret and g % 64):
        raise ValueError(f"fq_rows_cols tiling: g={g} x steps={steps} must divide C/16={nc} "
                         "and g be a multiple of 64 on the GPU")
    xw = lax.bitcast_convert_type(x.reshape(nr, 16, nc, 8, 2), jnp.uint32)
    out_type = jax.ShapeDtypeStruct((nr, 16, nc, 8), jnp.uint32)

    def strip(scr, scc, kwr, kwc, x_ref, or_ref, oc_ref, row0, col0, plain):
        scr = scalar_row(scr, sc_row_rows)
        scc = scalar_row(scc, sc_row_cols)
        by_mode(scr, mode_rows, lambda md: _fq_strip_rows(
            scr, kwr, x_ref, or_ref, g=g, row0=row0, col0=col0, n_cols=c, plain=plain,
            mode=md, sr=sr_rows))
        _fq_strip_cols(scc, kwc, x_ref, oc_ref, g=g, row0=row0, col0=col0, n_cols=c,
                       plain=plain, mode="rn", sr=sr_cols, rht=rht)

    def result(o):
        return lax.bitcast_convert_type(o, jnp.bfloat16).reshape(r, c)

    args = (sc_rows, sc_cols, kw_rows, kw_cols, xw)
    if interpret:
        def interp_body(scr, scc, kwr, kwc, x_ref, or_ref, oc_ref):
            @pl.loop(0, nr)
            def _(i):
                for j in range(nc // g):
                    at = (i, slice(None), pl.ds(j * g, g))
                    strip(scr, scc, kwr, kwc, x_ref.at[at], or_ref.at[at], oc_ref.at[at],
                          16 * i, 16 * g * j, True)

        o_rows, o_cols = pl.pallas_call(
            interp_body, out_shape=(out_type, out_type), interpret=interpret,
            compiler_params=lane_params())(*args)
        return result(o_rows), result(o_cols)

    def body(scr, scc, kwr, kwc, x_gmem, or_gmem, oc_gmem):
        i = lax.axis_index("rows")
        j = lax.axis_index("cols")

        def step(idx, x_smem, or_smem, oc_smem):
            jj = j * steps + (idx[0] if isinstance(idx, (tuple, list)) else idx)
            strip(scr, scc, kwr, kwc, x_smem.at[0], or_smem.at[0], oc_smem.at[0], 16 * i,
                  16 * g * jj, False)

        spec = plgpu.BlockSpec((1, 16, g, 8), lambda t: (i, 0, j * steps + t, 0))
        plgpu.emit_pipeline(step, grid=(steps,), in_specs=[spec], out_specs=[spec, spec],
                            max_concurrent_steps=min(steps, 2))(x_gmem, or_gmem, oc_gmem)

    o_rows, o_cols = plgpu.kernel(
        body, out_type=(out_type, out_type),
        grid=(nr, nc // (g * steps)), grid_names=("rows", "cols"),
        compiler_params=lane_params(unsafe_no_auto_barriers=True),
    )(*args)
    return result(o_rows), result(o_cols)


def _fq_rows_cols_narrow(x, sc_rows, sc_cols, kw_rows, kw_cols, *, interpret, mode_rows: str,
                         sr_rows: bool, sr_cols: bool, rht: bool, steps: int,
                         sc_row_rows, sc_row_cols):
    """``fq_rows_cols_scaled`` for C = 256, 512, 768 (g = C/16 = 16, 32, 48 blocks: a strip
    is 16 whole rows). The strip comes as 4 buffers (4 g, 8) words, buffer r rows r, 4 + r,
    8 + r, 12 + r (on the GPU 4 TMA copies of x viewed (R/4, 4, g, 8), as
    ``_fq_rows_flat``'s; in interpret mode x rearranged by XLA to (R/16, 4, 4 g, 8)). The
    rows phase is ``_fq_strip_rows_flat`` (64-block WGMMA tiles across the strip's quads),
    the columns phase ``_fq_strip_cols`` with ``quad_bufs`` (strided-layout rows, as
    ``fq_cols``' narrow strips). The two phases load the buffers in different register
    layouts, so on the GPU a warpgroup barrier (``plgpu.commit_smem``) separates the rows
    phase's reads from the columns phase's stash writes. The rows output has the buffers'
    layout (4 TMA stores; interpret: rearranged back by XLA)."""
    r, c = x.shape
    nr, g = r // 16, c // 16
    if nr % steps:
        raise ValueError(f"fq_rows_cols tiling: steps={steps} must divide R/16={nr}")
    cols_type = jax.ShapeDtypeStruct((nr, 16, g, 8), jnp.uint32)

    def strip(scr, scc, kwr, kwc, xs, os, oc_ref, row0, plain):
        scr = scalar_row(scr, sc_row_rows)
        scc = scalar_row(scc, sc_row_cols)
        by_mode(scr, mode_rows, lambda md: _fq_strip_rows_flat(
            scr, kwr, xs, os, g=g, row0=row0, n_cols=c, plain=plain, mode=md, sr=sr_rows))
        if not plain:
            plgpu.commit_smem()  # every thread's rows-phase reads before any stash write
        _fq_strip_cols(scc, kwc, xs, oc_ref, g=g, row0=row0, col0=0, n_cols=c, plain=plain,
                       mode="rn", sr=sr_cols, rht=rht, quad_bufs=True)

    def cols_result(o):
        return lax.bitcast_convert_type(o, jnp.bfloat16).reshape(r, c)

    if interpret:
        xt = lax.bitcast_convert_type(x.reshape(nr, 4, 4, g, 8, 2), jnp.uint32)
        xt = xt.transpose(0, 2, 1, 3, 4).reshape(nr, 4, 4 * g, 8)

        def interp_body(scr, scc, kwr, kwc, x_ref, or_ref, oc_ref):
            @pl.loop(0, nr)
            def _(i):
                strip(scr, scc, kwr, kwc, [x_ref.at[i, q] for q in range(4)],
                      [or_ref.at[i, q] for q in range(4)], oc_ref.at[i], 16 * i, True)

        o_rows, o_cols = pl.pallas_call(
            interp_body, out_shape=(jax.ShapeDtypeStruct(xt.shape, jnp.uint32), cols_type),
            interpret=interpret, compiler_params=lane_params(),
        )(sc_rows, sc_cols, kw_rows, kw_cols, xt)
        o_rows = o_rows.reshape(nr, 4, 4, g, 8).transpose(0, 2, 1, 3, 4)
        return (lax.bitcast_convert_type(o_rows, jnp.bfloat16).reshape(r, c),
                cols_result(o_cols))

    xq = lax.bitcast_convert_type(x.reshape(r // 4, 4, g, 8, 2), jnp.uint32)

    def body(scr, scc, kwr, kwc, x_gmem, or_gmem, oc_gmem):
        i = lax.axis_index("rows")

        def step(idx, *refs):
            t = i * steps + (idx[0] if isinstance(idx, (tuple, list)) else idx)
            views = [v.reshape(4 * g, 8) for v in refs[:8]]
            strip(scr, scc, kwr, kwc, views[:4], views[4:], refs[8].at[0], 16 * t, False)

        specs = [plgpu.BlockSpec((4, 1, g, 8), lambda t, q=q: (i * steps + t, q, 0, 0))
                 for q in range(4)]
        cspec = plgpu.BlockSpec((1, 16, g, 8), lambda t: (i * steps + t, 0, 0, 0))
        plgpu.emit_pipeline(step, grid=(steps,), in_specs=specs, out_specs=[*specs, cspec],
                            max_concurrent_steps=min(steps, 2),
                            )(*[x_gmem] * 4, *[or_gmem] * 4, oc_gmem)

    o_rows, o_cols = plgpu.kernel(
        body, out_type=(jax.ShapeDtypeStruct(xq.shape, jnp.uint32), cols_type),
        grid=(nr // steps,), grid_names=("rows",),
        compiler_params=lane_params(unsafe_no_auto_barriers=True),
    )(sc_rows, sc_cols, kw_rows, kw_cols, xq)
    return lax.bitcast_convert_type(o_rows, jnp.bfloat16).reshape(r, c), cols_result(o_cols)


def fq_rows_cols(x, key_rows=None, key_cols=None, *, signs=None, interpret: bool = False,
                 offset=None, **kw):
    """``(fq_rows(x, key_rows), fq_cols(x, key_cols, signs=signs))``, the same bits, with
    both tensor amaxes from one read (``cols_amaxes``) and both operands from another
    (``fq_rows_cols_scaled``): ``((rows (R, C) bf16, dec), (cols (R, C) bf16, dec))``.
    ``offset``: the first SR draw of both (``numerics.row_shard_draw_offset``)."""
    amax, rht_amax = cols_amaxes(x, jnp.ones((16,), jnp.float32) if signs is None else signs,
                                 interpret=interpret)
    enc, dec = global_scales(None, jnp.stack([amax, amax if signs is None else rht_amax]))
    ones = jnp.ones((16,), jnp.float32)
    sg = ones if signs is None else jnp.asarray(signs, jnp.float32).reshape(16)
    sc = scalars(enc, dec, jnp.stack([ones, sg])).reshape(-1)
    o_rows, o_cols = fq_rows_cols_scaled(
        x, sc, sc, key_words(key_rows, offset), key_words(key_cols, offset),
        sr_rows=key_rows is not None, sr_cols=key_cols is not None, rht=signs is not None,
        sc_row_rows=0, sc_row_cols=1, interpret=interpret, **kw)
    return (o_rows, dec[0]), (o_cols, dec[1])
