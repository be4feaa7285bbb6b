"""Packed-NVFP4 x packed-NVFP4 GEMM (W4A4) for Hopper (sm_90), Pallas Mosaic GPU.

MXFP4 operands (blocks of 32, UE8M0 scales) run through the two-pass implementation too:
``prepare_a``/``prepare_b`` repeat each 32-block's scale for its two 16-halves and
``decode_operand(scale_fmt="ue8m0")`` decodes ``q * 2^(e - 127)`` (``decode_ue8m0``).

``y = dequantize(A) @ dequantize(B)`` with A (M, K) and B (K, N) both NVFP4 scaled in
1x16 blocks along K (E2M1 codes, E4M3 block scales, FP32 tensor decode scale each),
float32 accumulation, output bfloat16 or float32.

Kernel-native operand layout (the same for both operands; made by
:func:`prepare_a` / :func:`prepare_b` from an ``fp4jax.QuantizedArray``). An operand
is viewed as R rows of K contraction elements (A: R = M; B: R = N, i.e. B^T):

* ``codes`` (R, K/2) uint8: for each pair of 16-blocks (g0, g1) of a row, 16 bytes
  whose byte j holds the E2M1 code of element j of g0 (low nibble) and of g1 (high
  nibble); so the low (high) nibbles of a 16-byte group are one whole scale block.
* ``sbits`` (K/16, R) uint8: E4M3 block-scale bits, one row per k-block (contiguous
  along R), so that a 16-k block's scales of a tile's rows are one row of SMEM.
* ``dec`` float32 scalar: the tensor decode scale (``QuantizedArray.global_scale``).

Numerics (one rule, :func:`decode_block`): each element decodes to ``q * s`` exactly
(E2M1 has 2 and E4M3 4 significant bits, and |q*s| lies in [2^-10, 2688], so the
product is an exact normal bfloat16). A GEMM of those exact values accumulates in
float32 and multiplies by ``dec_a * dec_b`` (one float32 product) in the epilogue, so
the result equals ``dequantize(A) @ dequantize(B)`` (float32) up to float32
accumulation order and the one rounding of ``dec_a * dec_b``.

Implementation (:func:`w4a4_matmul_two_pass`): a Mosaic GPU decode kernel
(:func:`decode_operand`) writes each operand as exact bf16 ``q * s`` to HBM, then the
bf16 GEMM with float32 accumulation and ``dec_a * dec_b`` in its epilogue
(``gemm.alpha_sm90.gemm_alpha``; XLA's ``dot_general`` and a separate epilogue where its
tiles do not fit). :func:`w4a4_matmul_xla` is the same with the decode and the GEMM in
XLA. (A fused single-kernel variant that decoded in registers reached only 0.15x bf16,
CUDA-core bound, and was removed; git history keeps it.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from fp4jax.quantization import e2m1_codes
from pallas_kernels import mosaic_compat as mc

# Lane semantics, what the decode kernel is written for (JAX 0.11 defaults to Warpgroup,
# whose layout inference makes lowering slow: quantize/common_sm90.lane_params)
_LANE = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)

ROWS = 64  # rows of one wgmma register operand / decode tile (WGMMA layout)


# ---------------------------------------------------------------------------
# Kernel-native layout (XLA, once per operand).
# ---------------------------------------------------------------------------


def native_from_codes(codes_rk: jax.Array, sbits_rk: jax.Array):
    """(R, K) uint8 codes and (R, K/16) uint8 E4M3 scale bits -> (codes (R, K/2) uint8,
    sbits (K/16, R) uint8) kernel layout (see the module docstring)."""
    r, k = codes_rk.shape
    if k % 32:
        raise ValueError(f"K must be a multiple of 32, got {k}")
    c = codes_rk.reshape(r, k // 32, 2, 16).astype(jnp.uint8)
    packed = (c[:, :, 0, :] | (c[:, :, 1, :] << 4)).reshape(r, k // 2)
    return packed, sbits_rk.astype(jnp.uint8).T


def scale_format(fmt) -> str | None:
    """``"e4m3"`` for NVFP4, ``"ue8m0"`` for MXFP4 (blocks of 32, UE8M0 scale, no tensor
    scale: ``fp4jax.MXFP4`` and ``MXFP4_OCP``, which differ only in how they choose the
    scale), else None (no kernel; so for every format with non-E2M1 elements, MXFP8 and
    MXFP6 included)."""
    bits = (fmt.scale_exp_bits, fmt.scale_man_bits)
    if (fmt.elem_exp_bits, fmt.elem_man_bits) != (2, 1):
        return None  # the kernels decode E2M1 codes only (FP6/FP8 elements: XLA)
    if fmt.block_size == 16 and fmt.tensor_scale and bits == (4, 3):
        return "e4m3"
    if fmt.block_size == 32 and not fmt.tensor_scale and bits == (8, 0):
        return "ue8m0"
    return None


def operand_unsupported_reason(q, contract_axis: int) -> str | None:
    """None when ``prepare_a`` (``contract_axis`` 1) / ``prepare_b`` (0) take the
    ``QuantizedArray`` ``q``, else why not (shapes aside: see ``dispatch``)."""
    sf = scale_format(q.fmt)
    if sf is None:
        return f"W4A4 kernels support NVFP4 and MXFP4 operands, got {q.fmt.name}"
    if sf == "ue8m0" and q.block_2d:
        return "MXFP4 operands must be scaled in 1-D blocks along K"
    if q.ndim != 2:
        return f"2-D operands only, got shape {tuple(q.shape)}"
    if not q.block_2d and q.axis % 2 != contract_axis:
        return (f"operand must be scaled along K, its contraction axis {contract_axis} "
                "(or in 16x16 tiles)")
    return None


def _prepare(q, contract_axis: int):
    reason = operand_unsupported_reason(q, contract_axis)
    if reason is not None:
        raise ValueError(reason)
    sf = scale_format(q.fmt)
    codes = e2m1_codes(q.data)
    sb = lax.bitcast_convert_type(q.scale, jnp.uint8)
    if q.block_2d:  # 16x16 tiles: repeat each tile scale along the non-contracted axis
        sb = jnp.repeat(sb, 16, axis=1 - contract_axis)
        sb = sb[:, : codes.shape[1]] if contract_axis == 0 else sb[: codes.shape[0]]
    if sf == "ue8m0":  # one 32-block = the two 16-blocks of one 16-byte group: repeat
        sb = jnp.repeat(sb, 2, axis=contract_axis)
    if contract_axis == 0:
        codes, sb = codes.T, sb.T
    packed, sbits = native_from_codes(codes, sb)
    dec = q.global_scale if q.global_scale is not None else jnp.float32(1.0)
    return packed, sbits, jnp.asarray(dec, jnp.float32)


def prepare_a(q):
    """Kernel layout of an NVFP4 or MXFP4 ``QuantizedArray`` A (M, K) scaled along K
    (axis=1 / -1, or NVFP4 16x16 tiles). Returns (codes (M, K/2) uint8, sbits (K/16, M)
    uint8, dec f32); MXFP4: each UE8M0 scale is repeated for both of its 16-halves and
    dec is 1 (decode with ``scale_fmt="ue8m0"``)."""
    return _prepare(q, 1)


def prepare_b(q):
    """Kernel layout of an NVFP4 or MXFP4 ``QuantizedArray`` B (K, N) scaled along K
    (axis=0 / -2, or NVFP4 16x16 tiles). Returns (codes (N, K/2) uint8, sbits (K/16, N)
    uint8, dec f32) ; MXFP4
    as ``prepare_a`` (scale repeated per 16-half, dec = 1, ``scale_fmt="ue8m0"``)."""
    return _prepare(q, 0)


# ---------------------------------------------------------------------------
# Decoding (the one numeric rule of this file).
# ---------------------------------------------------------------------------


def decode_e4m3(b):
    """E4M3 (float8_e4m3fn) bits -> float32, integer ops; 0x7F/0xFF (NaN) -> NaN.

    OCP FP8 spec: normal ``2^(e-7) * (1 + m/8)``, subnormal (e = 0) ``m * 2^-9``. Block
    scales are >= 0 (fp4jax / Transformer Engine); the sign bit is honoured anyway.
    """
    b = b.astype(jnp.int32)
    mag = b & 0x7F
    e = lax.shift_right_logical(mag, 3)
    m = b & 7
    normal = lax.bitcast_convert_type(((e + 120) << 23) | (m << 20), jnp.float32)
    v = jnp.where(e == 0, m.astype(jnp.float32) * jnp.float32(2.0**-9), normal)
    v = jnp.where(mag == 0x7F, jnp.float32(jnp.nan), v)
    return jnp.where((b & 0x80) != 0, -v, v)


def decode_ue8m0(b):
    """UE8M0 (float8_e8m0fnu) bits -> float32 ``2^(b - 127)``, integer ops; 0xFF -> NaN.

    OCP MX v1.0 spec (E8M0: exponent only, bias 127, 0xFF = NaN). ``b = 0`` (2^-127) is
    a float32 subnormal; fp4jax's MXFP4 scales stay within 2^-126..2^127 (see
    ``fp4jax.formats``), so it does not occur."""
    b = b.astype(jnp.int32) & 0xFF
    v = lax.bitcast_convert_type(jnp.where(b == 0, 0x00400000, b << 23), jnp.float32)
    return jnp.where(b == 0xFF, jnp.float32(jnp.nan), v)


SCALE_DECODERS = {"e4m3": decode_e4m3, "ue8m0": decode_ue8m0}


def decode_block(c, s):
    """E2M1 codes ``c`` (int32, 0..15) times float32 scales ``s`` -> exact ``q * s`` (bf16).

    E2M1 (OCP MX spec): code ``s e1 e0 m``; magnitude ``2^(e-1) * (1 + m/2)`` for
    e = e1e0 >= 1, ``m / 2`` for e = 0. With ``f = bits (c & 7) << 22`` plus the float32
    bits of 0.5 the float is ``2^(e-1) * (1 + m/2)`` for every e; for e = 0 that is
    0.5 or 0.75, mapped to 0 / 0.5 by ``2f - 1`` (exact). No subnormal is ever formed
    (no reliance on denormal handling). ``|q| * s`` is exact in float32 and in bf16
    (2 x 4 significant bits, range [2^-10, 2688]); the sign is ORed in last, so code 8
    gives -0 like ``fp4jax.dequantize``; a NaN scale gives NaN. MXFP4 (``s`` a power of
    two, 2^-126..2^127): ``q * s`` is exact wherever it is a normal float (|q * s| <
    2^128; an overflow gives Inf as ``fp4jax.dequantize`` does).
    """
    mag = c & 7
    f = lax.bitcast_convert_type((mag << 22) + 0x3F000000, jnp.float32)
    f = jnp.where(mag < 2, f * 2.0 - 1.0, f)
    bits = lax.bitcast_convert_type(f * s, jnp.int32) | ((c & 8) << 28)
    return lax.bitcast_convert_type(bits, jnp.float32).astype(jnp.bfloat16)


def _decode_tile(q_ref, nblk, load_scale, emit, scale_fmt: str = "e4m3"):
    """Decode one (rows, 8 * nblk) packed tile (``nblk`` 16-k blocks per row).

    ``load_scale(g)`` gives block g's scales (rows,) as uint8 (``scale_fmt`` bits);
    ``emit(g, v)`` receives block g's decoded values v (rows, 16) bf16 (k = 16g .. 16g +
    15 of the tile).
    """
    decode_scale = SCALE_DECODERS[scale_fmt]
    byts = q_ref[...].astype(jnp.int32)
    rows = byts.shape[0]
    lo_all = byts & 15
    hi_all = lax.shift_right_logical(byts, 4)
    for p in range(nblk // 2):
        cols = slice(16 * p, 16 * p + 16)
        for h, codes in enumerate((lo_all[:, cols], hi_all[:, cols])):
            g = 2 * p + h
            s = decode_scale(load_scale(g))
            emit(g, decode_block(codes, lax.broadcast_in_dim(s, (rows, 16), (0,))))


def _swizzle_transforms(row_bytes: int, itemsize: int):
    swz = plgpu.find_swizzle(row_bytes * 8)
    return (plgpu.TilingTransform((8, swz // itemsize)), plgpu.SwizzleTransform(swz))


# ---------------------------------------------------------------------------
# (a) Decode kernel + XLA bf16 GEMM.
# ---------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("tile_k", "stages", "out_swizzle", "interpret",
                                             "scale_fmt"))
def decode_operand(codes, sbits, *, tile_k: int = 256, stages: int = 2, out_swizzle: bool = True,
                   interpret=False, scale_fmt: str = "e4m3"):
    """Kernel-layout operand -> (R, K) bfloat16 ``q * s`` (exact; no tensor scale).
    ``scale_fmt``: ``"e4m3"`` (NVFP4) or ``"ue8m0"`` (MXFP4, see ``prepare_a``).

    codes (R, K/2) uint8, sbits (K/16, R) uint8; R % 64 == 0, K % tile_k == 0
    (tile_k a multiple of 32). ``out_swizzle``: the bf16 output tile in SMEM is
    tiled (8, 16) with a 32-byte swizzle (else plain row-major; a GPU-sweep knob).
    ``interpret``: Mosaic GPU interpret mode (CPU tests),
    which runs the tile body once over the whole operand (no TMA pipeline).
    """
    r, kh = codes.shape
    k = 2 * kh
    if sbits.shape != (k // 16, r):
        raise ValueError(f"layout mismatch: codes {codes.shape}, sbits {sbits.shape}")
    if interpret:
        def body_i(q_ref, s_ref, o_ref):
            def emit(g, v):
                o_ref[:, 16 * g:16 * g + 16] = v

            _decode_tile(q_ref, s_ref.shape[0], lambda g: s_ref[g, :], emit, scale_fmt)

        return pl.pallas_call(
            body_i, out_shape=jax.ShapeDtypeStruct((r, k), jnp.bfloat16),
            interpret=interpret, compiler_params=_LANE,
        )(codes, sbits)

    if r % ROWS or k % tile_k or tile_k % 32:
        raise ValueError(f"decode kernel needs R % {ROWS} == 0 and K % {tile_k} == 0,"
                         f" got R={r}, K={k}")
    ks = k // tile_k
    nblk = tile_k // 16
    # one CTA per 64 rows, pipelining over K in steps of tile_k
    out_tf = ((plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32)) if out_swizzle
              else ())  # tiles of one 16-k block wide, so a block's slice is tile-aligned
    q_tf = _swizzle_transforms(tile_k // 2, 1)  # tiled load -> WGMMA register layout

    def body(q_gmem, s_gmem, o_gmem):
        ri = lax.axis_index("r")

        def step(_, q_smem, s_smem, o_smem):
            def load_scale(g):
                return mc.load(s_smem, (g, slice(None)), layout=plgpu.Layout.WGMMA.reduce(1))

            def emit(g, v):
                if out_tf:
                    o_smem[:, pl.ds(16 * g, 16)] = v
                else:  # plain row-major
                    mc.store_untiled(o_smem.at[:, pl.ds(16 * g, 16)], v)

            _decode_tile(q_smem, nblk, load_scale, emit, scale_fmt)

        plgpu.emit_pipeline(
            step,
            grid=(ks,),
            in_specs=[plgpu.BlockSpec((ROWS, tile_k // 2), lambda j: (ri, j), transforms=q_tf),
                      plgpu.BlockSpec((nblk, ROWS), lambda j: (j, ri))],
            out_specs=[plgpu.BlockSpec((ROWS, tile_k), lambda j: (ri, j), transforms=out_tf)],
            max_concurrent_steps=min(stages, ks),
        )(q_gmem, s_gmem, o_gmem)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((r, k), jnp.bfloat16),
        grid=(r // ROWS,),
        grid_names=("r",),
        compiler_params=_LANE,
    )(codes, sbits)


def decode_operand_xla(codes, sbits, scale_fmt: str = "e4m3"):
    """XLA version of :func:`decode_operand` (same rule, :func:`decode_block`)."""
    r, kh = codes.shape
    c = codes.reshape(r, kh // 16, 1, 16).astype(jnp.int32)
    c = jnp.concatenate([c & 15, c >> 4], axis=2).reshape(r, kh // 8, 16)
    s = SCALE_DECODERS[scale_fmt](sbits).T[:, :, None]  # (R, K/16, 1)
    return decode_block(c, s).reshape(r, 2 * kh)


def _epilogue(acc, dec_a, dec_b, out_dtype):
    return (acc * (dec_a.astype(jnp.float32) * dec_b.astype(jnp.float32))).astype(out_dtype)


def _gemm_decoded(a16, bt16, dec_a, dec_b, out_dtype, pallas: bool = False):
    """``a16 @ bt16.T`` in f32 times ``dec_a * dec_b``; with ``pallas`` (a GPU, bf16 out,
    sizes that ``alpha_sm90.preferred`` takes) on ``alpha_sm90.gemm_alpha`` (the
    scale in its epilogue, so the f32 product never goes to memory), else XLA's dot and
    the epilogue."""
    from pallas_kernels.gemm import alpha_sm90 as ga

    (m, k), n = a16.shape, bt16.shape[0]
    if pallas and jnp.dtype(out_dtype) == jnp.bfloat16 and ga.preferred(m, k, n):
        alpha = dec_a.astype(jnp.float32) * dec_b.astype(jnp.float32)
        return ga.gemm_alpha(a16, bt16, alpha, trans_b=True)
    acc = lax.dot_general(a16, bt16, (((1,), (1,)), ((), ())),
                          preferred_element_type=jnp.float32)
    return _epilogue(acc, dec_a, dec_b, out_dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "tile_k", "out_swizzle", "interpret",
                                             "scale_a", "scale_b"))
def w4a4_matmul_two_pass(aq, as_, dec_a, bq, bs, dec_b, *, out_dtype=jnp.bfloat16,
                         tile_k: int = 256, out_swizzle: bool = True, interpret=False,
                         scale_a: str = "e4m3", scale_b: str = "e4m3"):
    """(a): decode kernel on each operand, then the bf16 GEMM with f32 accumulation and the
    ``dec_a * dec_b`` epilogue: the Pallas ``gemm_alpha`` kernel when the sizes fit its
    tiles and the output is bf16 (else XLA's dot and a separate epilogue).

    aq (M, K/2), as_ (K/16, M), bq (N, K/2), bs (K/16, N) uint8 (kernel layout);
    dec_a, dec_b float32 scalars. Returns (M, N) ``out_dtype``. ``tile_k``,
    ``out_swizzle``: :func:`decode_operand` knobs; ``scale_a``/``scale_b``: each
    operand's block-scale format (``scale_format``: NVFP4 or MXFP4, mixed allowed).
    """
    a16 = decode_operand(aq, as_, tile_k=tile_k, out_swizzle=out_swizzle, interpret=interpret,
                         scale_fmt=scale_a)
    b16 = decode_operand(bq, bs, tile_k=tile_k, out_swizzle=out_swizzle, interpret=interpret,
                         scale_fmt=scale_b)
    return _gemm_decoded(a16, b16, dec_a, dec_b, out_dtype, pallas=not interpret)


@functools.partial(jax.jit, static_argnames=("out_dtype", "scale_a", "scale_b"))
def w4a4_matmul_xla(aq, as_, dec_a, bq, bs, dec_b, *, out_dtype=jnp.bfloat16,
                    scale_a: str = "e4m3", scale_b: str = "e4m3"):
    """XLA decode (:func:`decode_operand_xla`) + bf16 GEMM: the comparison baseline."""
    a16 = decode_operand_xla(aq, as_, scale_a)
    b16 = decode_operand_xla(bq, bs, scale_b)
    return _gemm_decoded(a16, b16, dec_a, dec_b, out_dtype)


def reference_w4a4(aq, as_, dec_a, bq, bs, dec_b):
    """float32 ``dequantize(A) @ dequantize(B)`` from the kernel layout, by a LUT (not
    :func:`decode_block`) and ``float8_e4m3fn`` casts, at HIGHEST precision."""
    lut = jnp.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6],
                    jnp.float32)

    def deq(codes, sbits, dec):
        r, kh = codes.shape
        c = codes.reshape(r, kh // 16, 1, 16)
        c = jnp.concatenate([c & 15, c >> 4], axis=2).reshape(r, 2 * kh)
        s = lax.bitcast_convert_type(sbits, jnp.float8_e4m3fn).astype(jnp.float32).T
        return (lut[c.astype(jnp.int32)] * jnp.repeat(s, 16, axis=1)) * dec

    a = deq(aq, as_, dec_a)
    b = deq(bq, bs, dec_b)
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST)
