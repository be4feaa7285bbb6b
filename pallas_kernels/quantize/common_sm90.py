"""Shared internals of the NVFP4 quantize kernels for Hopper (sm_90), Pallas Mosaic GPU.

Both quantize kernel families import this module (and nothing else of each other):
``packed_sm90`` (E2M1 codes two a byte + E4M3 scale bits, for storage and packed GEMMs)
and ``operand_sm90`` (the bf16 ``data * scale`` GEMM operands ``fp4jax.dot`` uses on
Hopper). It owns the in-register numerics they share, each a transcription of one rule
of the core (cited where defined): the tensor scales (``global_scales``, from
``fp4jax.quantization.global_encode_scale``), E4M3 block-scale rounding (``e4m3_round``,
``block_scale_bits``), the correctly rounded reciprocal of the element encode scale
(``recip_rn``, ``recip_table``; ``fp4jax.numerics.div_rn``), E2M1 element rounding to the
nearest or stochastically (``e2m1_code``, ``e2m1_value``; ``fp4jax.numerics``), the
stochastic-rounding bits (``key_words``, ``sr_uniform``; ``numerics.uniform_from_key``),
the kernels' scalar input (``kernel_scalars``, ``scalars``) and the word layout of bf16
pairs in the WGMMA register layout (``load_words``). Tiling defaults shared by both
(``SUB``, ``G2D``, ``GR``, ``QUAD_BLOCKS``) live here too.

Numerics (Transformer Engine, ``core_nvfp4.cuh``; evaluated in float32 exactly as
the fp4jax reference does):

* ``s = e4m3_rne_satfinite(amax_block * (enc * f32(1/6)))``; NaN if the block holds NaN/Inf;
* ``e = min(1 / (f32(s) * dec), FLT_MAX)`` (FLT_MAX when ``s == 0``: the nonzero elements
  of an underflowed block saturate to +-6, as TE's; with a subnormal ``dec``, a tiny
  tensor's, exact IEEE arithmetic without a flush: ``_elem_scale_tiny``);
* ``q = e2m1_rne_satfinite(x * e)``.

Mosaic GPU on Hopper cannot convert to float4/float8 in registers, so both roundings
are done with float32 comparisons and integer bit operations:

* E4M3 (scales, always >= 0): normal range by adding ``0x7FFFF + lsb`` to the float32
  bits and clearing the 20 low mantissa bits; subnormals (< 2^-6) by the
  ``(v * 2^9 + 2^23) - 2^23`` round-to-nearest-even trick.
* E2M1: the magnitude code is the number of round-to-nearest-even decision thresholds
  (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) that ``|v|`` passes, with ``>`` where the tie
  goes down to the even code and ``>=`` where it goes up; saturation at 6 is automatic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from fp4jax import quantization
from fp4jax.formats import NVFP4
from fp4jax.numerics import div_rn, floor_log2, pow2, reciprocal_rn, subnormal_hi
from fp4jax.quantization import block_decode_scale, global_encode_scale
from pallas_kernels import mosaic_compat as mc

FLT_MAX = float(np.finfo(np.float32).max)


def finite_amax(x: jax.Array) -> jax.Array:
    """``max |x|`` over the finite values of ``x`` (float32 scalar; an XLA reduction): the
    core's tensor amax rule itself (``fp4jax.quantization.finite_amax``)."""
    return quantization.finite_amax(x)  # reads x through numerics.exact_float32


def global_scales(x: jax.Array | None, amax: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array]:
    """NVFP4 tensor scales (enc, dec) from the finite amax of ``x`` (an XLA reduction), or
    from ``amax`` when given (the finite amax computed elsewhere, e.g. ``cols_amaxes``).

    Exactly the core's: ``fp4jax.quantization.global_encode_scale`` and ``dec =
    numerics.reciprocal_rn(enc)`` (correctly rounded, also on the GPU; subnormal for a
    tiny tensor, as TE's).
    """
    if amax is None:
        amax = finite_amax(x)
    enc = global_encode_scale(amax, NVFP4)
    dec = reciprocal_rn(enc)
    return enc, dec


def bits_to_i32(v):
    return lax.bitcast_convert_type(v, jnp.int32)


def bits_to_f32(v):
    return lax.bitcast_convert_type(v, jnp.float32)


def e4m3_round(s_f):
    """RNE-to-E4M3 of a float32 array (>= 0, <= 448 after the caller's clamp).

    Returns (value as float32, E4M3 bit pattern as int32).
    """
    bits = bits_to_i32(s_f)
    lsb = lax.shift_right_logical(bits, 20) & 1
    rn = (bits + 0x7FFFF + lsb) & -0x100000  # clear the 20 mantissa bits E4M3 lacks
    byte_norm = ((lax.shift_right_logical(rn, 23) - 120) << 3) | (
        lax.shift_right_logical(rn, 20) & 7
    )
    # round(s * 2^9) to an integer, ties to even; the barrier stops XLA (interpret mode)
    # from folding (v + 2^23) - 2^23 into v.
    sub = lax.optimization_barrier(s_f * 512.0 + 8388608.0) - 8388608.0
    is_sub = s_f < 0.015625  # 2^-6, smallest normal E4M3
    val = jnp.where(is_sub, sub * (1.0 / 512.0), bits_to_f32(rn))
    byte = jnp.where(is_sub, sub.astype(jnp.int32), byte_norm)
    return val, byte


def e2m1_code(v):
    """RNE, saturating E2M1 code (int32, 0..15) of a float32 array, integer ops.

    ``|v| >= 1``: round the float32 to one mantissa bit (add ``0x1FFFFF + lsb`` to the
    bits), then code = biased exponent/mantissa - 252, saturated at 7 (6.0).
    ``|v| < 1``: code = round-half-even(2|v|) in {0, 1, 2}, read from the low bits of
    ``2|v| + 2^23``. Sign: bit 31 -> code bit 3 (so -0 and small negatives give 8, as
    a float4 cast does).
    """
    bits = bits_to_i32(v)
    ab = bits & 0x7FFFFFFF
    r = ab + 0x1FFFFF + (lax.shift_right_logical(ab, 22) & 1)
    c_hi = jnp.minimum(lax.shift_right_logical(r, 22) - 252, 7)
    a = bits_to_f32(ab)
    # the barrier stops XLA (interpret mode) from simplifying the magic-number add
    c_lo = bits_to_i32(lax.optimization_barrier(a * 2.0 + 8388608.0)) & 3
    code = jnp.where(a < 1.0, c_lo, c_hi)
    return code | (lax.shift_right_logical(bits, 28) & 8)


_HI12 = -0x1000  # float32 bits mask keeping sign, exponent and the top 12 significand bits


def recip_rn(p, y0=None):
    """Correctly rounded float32 ``1 / p`` for normal ``p > 0`` with a normal quotient.

    XLA's (and LLVM's default) float32 division on NVIDIA GPUs may be one ulp off
    (docs/performance.md); this rounds like
    ``fp4jax.numerics.div_rn(1, p)`` and costs ~30 scalar operations per block.

    ``p = m * 2^k`` with ``m`` in [1, 2) (exponent bits replaced); ``y = 1 / m`` from the
    hardware division (``y0``, a test hook, replaces it; must be within one ulp of
    ``1/m``), then the exact residual ``r = 1 - m*y`` from a Dekker product whose
    splits are integer masks (12 + 12 significand bits): every partial product is
    exact, so FMA contraction cannot change it, and each subtraction is exact (the
    first by Sterbenz, the others because the partial sums fit in 24 bits). ``y`` moves
    one ulp up when ``r > m*(y_up - y)/2`` (1/m is above the midpoint to the next float),
    down when ``r < -m*(y - y_dn)/2`` (no ties: 1/m is never a midpoint). The result's
    exponent is then lowered by ``k``. Returns (result, ok) where ``ok`` is False for
    zero, subnormal, Inf/NaN ``p`` or a quotient outside the normal range (the caller
    falls back to ``1 / p`` there, as ``div_rn`` does).
    """
    bits = bits_to_i32(p)
    ep = lax.shift_right_logical(bits, 23) & 0xFF
    m = bits_to_f32((bits & 0x7FFFFF) | 0x3F800000)
    y = 1.0 / m if y0 is None else y0
    yb = bits_to_i32(y)
    mh = bits_to_f32(bits_to_i32(m) & _HI12)
    ml = m - mh
    yh = bits_to_f32(yb & _HI12)
    yl = y - yh
    r = (((1.0 - mh * yh) - mh * yl) - ml * yh) - ml * yl
    y_up = bits_to_f32(yb + 1)
    y_dn = bits_to_f32(yb - 1)
    up = r > m * ((y_up - y) * 0.5)
    dn = r < -(m * ((y - y_dn) * 0.5))
    yb = jnp.where(up, yb + 1, jnp.where(dn, yb - 1, yb))
    e_out = (lax.shift_right_logical(yb, 23) & 0xFF) - (ep - 127)
    res = bits_to_f32(yb - ((ep - 127) << 23))
    ok = (ep > 0) & (ep < 255) & (e_out > 0) & (e_out < 255)
    return res, ok


# Safe range of the tensor decode scale for the table reciprocal (see recip_table).
TABLE_DEC_MIN = 2.0**-117
TABLE_DEC_MAX = 2.0**117
N_SC = 32  # float32 words of the kernels' scalar input (see kernel_scalars)
_SC_TABLE = 3  # index of the first of the 16 table entries in that input
_SC_TINY = 19  # 1.0 when dec is a float32 subnormal (a tiny tensor), else 0.0
_SC_DEC_M = 20  # dec's integer significand m (dec = m * 2^-149) when subnormal, as float32
_SC_DEC_HI = 21  # dec * 2^64 (exact, normal)


def recip_table(dec: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-tensor table of the element encode scales ``1 / (f32(s) * dec)`` (XLA, outside
    the kernel). Returns ``(safe, table)``: a bool scalar and 16 float32 entries.

    Rule (Transformer Engine ``core_nvfp4.cuh``, fp4jax ``quantize.element_encode_scale``):
    ``e(s) = min(div_rn(1, f32(s) * dec), FLT_MAX)`` (FLT_MAX when ``s == 0``), for the
    127 finite non-negative E4M3 scales ``s``. ``table_recip`` returns it for a scale
    byte ``b = (ef << 3) | m`` as::

        ef >= 1 (normal,    s = 2^(ef-7) * (1 + m/8)):  e = 2^(7-ef) * table[m]
        ef == 0 (subnormal, s = m * 2^-9):              e = table[8 + m]

    with ``table[m] = div_rn(1, f32(1 + m/8) * dec)`` (m = 0..7),
    ``table[8 + m] = 2^9 * div_rn(1, f32(m) * dec)`` (m = 1..7) and ``table[8] = FLT_MAX``
    (``s == 0``: ``1/0`` clamped).

    Exact (bit-identical to the rule) when ``2^-117 <= dec < 2^117`` (``safe``): write
    ``s = 2^E * M`` (M = 1 + m/8 with E = ef - 7, or M = m with E = -9). Then the real
    products ``M*dec`` lie in [2^-117, 2^120) and ``s*dec`` in [2^-126, 448 * 2^117 <
    2^126), both in the float32 normal range, and round-to-nearest commutes with scaling
    by 2^E inside it: ``f32(s*dec) = 2^E * f32(M*dec)``. Likewise ``1/f32(M*dec)`` lies
    in (2^-120, 2^117] and ``1/f32(s*dec)`` in (2^-126, 2^126]: normal again, so
    ``div_rn(1, f32(s*dec)) = 2^-E * div_rn(1, f32(M*dec))``, exactly, and the FLT_MAX
    clamp is never active. The kernel applies 2^(7-ef) as an integer add to the exponent
    field (exact: the result stays normal). fp4jax's decode scale is ``1/enc`` with
    ``enc <= 2^126`` and ``enc >= 2688/FLT_MAX``, i.e. ``dec`` in [2^-126, 1.3e35 <
    2^117): only tensors with amax below ``2688 * 2^-117`` (~1.6e-32) are unsafe, and
    get the ``recip_rn`` path. Checked exhaustively against IEEE float32 (NumPy) by
    ``tests/kernels/test_quantize_fast.py`` (all E4M3 scales x thousands of ``dec``,
    including both range ends).
    """
    dec = jnp.asarray(dec, jnp.float32)
    mant = jnp.asarray(np.arange(8, dtype=np.float32) / 8 + 1)  # 1 + m/8, exact
    sub = jnp.asarray(np.arange(8, dtype=np.float32))  # m
    d = dec[..., None]  # a vector of decode scales gives a table per entry (same bits)
    t_norm = div_rn(jnp.float32(1.0), mant * d)
    t_sub = div_rn(jnp.float32(1.0), sub[1:] * d) * jnp.float32(512.0)
    table = jnp.concatenate([t_norm, jnp.full(dec.shape + (1,), FLT_MAX, jnp.float32), t_sub],
                            axis=-1)
    safe = (dec >= jnp.float32(TABLE_DEC_MIN)) & (dec < jnp.float32(TABLE_DEC_MAX))
    return safe, table


def table_recip(s_byte, table):
    """``e = 1 / (f32(s) * dec)`` from the E4M3 bit pattern ``s_byte`` (int32 array,
    0..126) and the 16 entries of ``recip_table`` (scalars): a 4-level select tree on
    the index ``(ef == 0) << 3 | m`` and an exponent add of ``7 - ef`` (0 for
    subnormal scales). The rule and its exactness range: ``recip_table``.
    """
    m = s_byte & 7
    ef = lax.shift_right_logical(s_byte, 3) & 15
    is_sub = ef == 0
    b0 = (m & 1) != 0
    b1 = (m & 2) != 0
    b2 = (m & 4) != 0
    t = list(table)
    lvl = [jnp.where(b0, t[i + 1], t[i]) for i in range(0, 16, 2)]
    lvl = [jnp.where(b1, lvl[i + 1], lvl[i]) for i in range(0, 8, 2)]
    lvl = [jnp.where(b2, lvl[i + 1], lvl[i]) for i in range(0, 4, 2)]
    v = jnp.where(is_sub, lvl[1], lvl[0])
    shift = jnp.where(is_sub, 0, 7 - ef)
    return bits_to_f32(bits_to_i32(v) + (shift << 23))


def kernel_scalars(enc: jax.Array, dec: jax.Array) -> jax.Array:
    """The kernels' scalar input (float32[N_SC], computed by XLA): ``enc * f32(1/6)``,
    ``dec``, the table flag (1.0 when ``recip_table`` is exact for ``dec``), the 16
    table entries, the subnormal-``dec`` flag, ``dec``'s integer significand and ``dec *
    2^64`` (``_elem_scale_tiny``; read from the bits: ``numerics.subnormal_hi``), zero
    padding. ``enc`` and ``dec`` may be vectors (k,) of several
    operands' scales: the result is then (k, N_SC), row ``i`` the same bits as the call
    with ``enc[i]``, ``dec[i]`` (one XLA fusion for all of them)."""
    enc = jnp.asarray(enc, jnp.float32)
    dec = jnp.asarray(dec, jnp.float32)
    safe, table = recip_table(dec)
    tiny = dec < jnp.float32(2.0**-126)
    dec_m = (bits_to_i32(dec) & 0x7FFFFF).astype(jnp.float32)  # exact: < 2^23
    sc = jnp.concatenate([
        jnp.stack([enc * jnp.float32(1.0 / 6.0), dec, safe.astype(jnp.float32)], axis=-1),
        table,
        jnp.stack([tiny.astype(jnp.float32), jnp.where(tiny, dec_m, 0.0),
                   subnormal_hi(dec)], axis=-1)], axis=-1)
    return jnp.pad(sc, [(0, 0)] * (sc.ndim - 1) + [(0, N_SC - sc.shape[-1])])


RECIP_MODES = ("auto", "table", "rn", "hw")


def elem_scale(sc_ref, s_val, s_byte, mode: str):
    """Element encode scale ``min(1/(f32(s)*dec), FLT_MAX)`` (FLT_MAX when s == 0) of a
    vector of block scales, by ``mode``: ``"table"`` (``table_recip``; exact only for a
    safe dec), ``"rn"`` (``recip_rn``, exact for every dec: a subnormal dec takes
    ``_elem_scale_tiny``), ``"hw"`` (the hardware quotient, may be one ulp off on the GPU:
    timing only). Rule: ``fp4jax.quantization.element_encode_scale``.
    """
    if mode == "table":
        return table_recip(s_byte, [sc_ref[_SC_TABLE + i] for i in range(16)])
    p = s_val * sc_ref[1]
    if mode == "rn":
        e_rn, ok = recip_rn(p)
        e = jnp.where(ok, e_rn, 1.0 / p)  # div_rn's fallback (p or 1/p not normal)
        # A tiny tensor's subnormal dec (never in practice) takes the exact integer path
        # behind a uniform branch on the scalar flag: evaluated with jnp.where for every
        # block it made the rn-mode (stochastic-rounding, column) kernels ~14% slower.
        e = lax.cond(sc_ref[_SC_TINY] != 0.0,
                     lambda e: _elem_scale_tiny(sc_ref, s_val, s_byte), lambda e: e, e)
    else:
        e = 1.0 / p
    return jnp.where(e > FLT_MAX, FLT_MAX, e)


def _elem_scale_tiny(sc_ref, s_val, s_byte):
    """``1 / RN(s * dec)`` (before the FLT_MAX clamp) for a subnormal ``dec = m * 2^-149``
    in IEEE arithmetic without a flush (the rule and its proof:
    ``fp4jax.numerics.recip_scaled_subnormal_rn``), for E4M3 ``s = k * 2^a`` from its byte:
    ``k m < 2^27`` is exact in int32; where ``k m 2^a < 2^23`` the product is subnormal
    and rounds half to even by an integer shift, ``n * 2^-149``; elsewhere it is the
    float32 product ``s * (dec * 2^64)`` scaled back. The reciprocal of the scaled
    product (normal) is ``recip_rn``'s, times 2^64 (Inf beyond the float32 range)."""
    ef = lax.shift_right_logical(s_byte, 3) & 15
    mm = s_byte & 7
    k = jnp.where(ef > 0, mm | 8, mm)
    sh = jnp.where(ef > 0, 10 - ef, 9)  # s = k * 2^-sh
    prod = k * sc_ref[_SC_DEC_M].astype(jnp.int32)
    shc = jnp.clip(sh, 1, 10)
    q = lax.shift_right_logical(prod, shc)
    rem = prod - (q << shc)
    half = 1 << (shc - 1)
    n = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).astype(jnp.int32)
    sub = (sh > 0) & ((sh >= 4) | (prod < (1 << (23 + jnp.clip(sh, 0, 3)))))
    p_hi = jnp.where(sub, n.astype(jnp.float32) * jnp.float32(2.0**-85),
                     s_val * sc_ref[_SC_DEC_HI])
    r, ok = recip_rn(p_hi)
    r = jnp.where(ok, r, 1.0 / p_hi)
    return r * jnp.float32(2.0**64)


def by_mode(sc_ref, mode: str, body):
    """Run ``body(mode)`` with a concrete reciprocal mode: ``"auto"`` branches (uniformly,
    on the scalar table flag) between ``"table"`` and ``"rn"``."""
    if mode != "auto":
        body(mode)
        return

    def run_table():
        body("table")

    def run_rn():
        body("rn")

    lax.cond(sc_ref[2] != 0.0, run_table, run_rn)


SUB = 256  # blocks per register sub-tile: (256, 8) words, 16 words per thread


def lane_params(**kw) -> plgpu.CompilerParams:
    """The quantize kernels' compiler parameters: Mosaic GPU's Lane lowering semantics, which
    they are written for (explicit register layouts on every load, elementwise code).
    JAX 0.10 defaults to Lane, JAX 0.11 to Warpgroup, where the same kernels lower through
    the dialect's layout inference: correct, but seconds per kernel (its constraint solver
    sorts variables by a key that prints the whole module; docs/performance.md)."""
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane, **kw)


def load_words(x_ref, rows, plain: bool, layout=None):
    """A (rows, 8) tile of uint32 words (bf16 pairs) as int32, in the WGMMA register
    layout (a block = a row spread over a quad of lanes) or ``layout`` (``strip_layout``)
    unless ``plain`` (interpret)."""
    if plain:
        w = x_ref[rows, :]
    else:
        w = mc.load(x_ref, (rows, slice(None)), layout=layout or plgpu.Layout.WGMMA)
    return lax.bitcast_convert_type(w, jnp.int32)


def strip_layout(g: int):
    """The register layout of one (g, 8) word row of a column strip (``fq_cols`` and the
    rotated-amax kernels, whose arithmetic is elementwise across the strip's 16 rows):
    WGMMA when ``g % 64 == 0`` (its tile is 64 rows), else Mosaic GPU's strided layout
    (the g * 8 words flattened over the warpgroup's 128 threads, ``g % 16 == 0``), so
    strips of 256, 512 or 768 columns work as well."""
    if g % 64 == 0:
        return plgpu.Layout.WGMMA
    if g % 16:
        raise ValueError(f"strip_layout: g={g} must be a multiple of 16")
    per_thread = g * 8 // 128
    vec = 4 if per_thread % 4 == 0 else 2 if per_thread % 2 == 0 else 1
    return plgpu.Layout.WG_STRIDED((g, 8), vec_size=vec)


def block_amax_bits(w):
    """Per-row (block) max of |x| as float32 bits (int32; integer order == float order
    for >= 0, NaN/Inf compare above every finite value). Rule: the block amax of
    ``fp4jax.quantization.quantize_unchecked`` (``max |x|`` over the block, NaN/Inf poison it)."""
    return jnp.max(jnp.maximum((w << 16) & 0x7FFFFFFF, w & 0x7FFF0000), axis=1)


def block_scale_bits(amax_bits, enc6):
    """Block decode scale from the block amax bits: ``(s_val, s_byte, finite)``.

    Rule (``fp4jax.quantization.block_decode_scale``, TE ``core_nvfp4.cuh``):
    ``s = e4m3_rne_satfinite(amax_block * (enc * f32(1/6)))``; a NaN/Inf block gets the
    NaN byte 0x7F (``s_val``/``s_byte`` are meaningless there: the caller masks them)."""
    finite = amax_bits < 0x7F800000
    s_f = bits_to_f32(amax_bits) * enc6
    s_f = jnp.where(s_f > 448.0, 448.0, s_f)
    s_val, s_byte = e4m3_round(s_f)
    return s_val, s_byte, finite


def word_scales(sc_ref, w, mode: str):
    """Block scales of a (n, 8) word tile (a block = a row): ``(s_val, s_byte, e, finite)``
    with ``e`` the element encode scale (``block_scale_bits``, ``elem_scale``)."""
    s_val, s_byte, finite = block_scale_bits(block_amax_bits(w), sc_ref[0])
    return s_val, s_byte, elem_scale(sc_ref, s_val, s_byte, mode), finite


def strip_2d_scales(sc_ref, x_ref, plain: bool, mode: str):
    """Tile scales of a strip of 16x16 tiles, x_ref (16, g, 8) words: the tile amax is the
    elementwise max of the 16 rows' block amaxes. Returns ``(s_val, s_byte, e, finite)``,
    one per tile. Rule: ``fp4jax.quantization.quantize_unchecked`` with ``block_2d=True``."""
    amax = None
    for k in range(16):
        a = block_amax_bits(load_words(x_ref.at[k], slice(None), plain))
        amax = a if amax is None else jnp.maximum(amax, a)
    s_val, s_byte, finite = block_scale_bits(amax, sc_ref[0])
    return s_val, s_byte, elem_scale(sc_ref, s_val, s_byte, mode), finite


BF16_MAX = float(jnp.finfo(jnp.bfloat16).max)  # the satfinite bound of bf16 operands


def is_mx(fmt) -> bool:
    """Whether ``fmt`` (a ``BlockFormat``; None: NVFP4) is one of the MX FP4 formats the
    kernels quantize besides NVFP4: E2M1 elements in blocks of 32 with a power-of-two
    (E8M0) scale and no tensor scale (``fp4jax.MXFP4``, its ``"up"`` rule, and
    ``fp4jax.MXFP4_OCP``, the ``"ocp"`` rule)."""
    return (fmt is not None and fmt.block_size == 32 and not fmt.tensor_scale
            and (fmt.elem_exp_bits, fmt.elem_man_bits) == (2, 1)
            and (fmt.scale_exp_bits, fmt.scale_man_bits) == (8, 0) and not fmt.scale_ieee
            and fmt.scale_rule in ("up", "ocp"))


def mx_block_scales(amax_bits, fmt):
    """MX block scales from the block amax bits (int32, ``block_amax_bits``: NaN/Inf above
    every finite value): ``(s_val, e, finite)``.

    ``s_val`` is the core's own rule, ``fp4jax.quantization.block_decode_scale(amax, 1,
    fmt)`` (the format's scale rule, ``"up"`` or ``"ocp"``; no tensor scale: ``enc = 1``),
    run here on register arrays (for E8M0 scales it is integer and compare/select
    arithmetic); ``e`` the element encode scale ``fp4jax.quantization.element_encode_scale
    (s, 1) = 1/s``, exact for a power of two ``s`` in ``[2^-126, 2^126]`` (every finite
    block's: ``amax * f32(1/6) <= FLT_MAX / 6 < 2^126``), as ``numerics.pow2(-floor_log2
    s)``. A NaN/Inf block (``finite`` False) gets s = 1 here: the caller writes NaN."""
    finite = amax_bits < 0x7F800000
    s = block_decode_scale(bits_to_f32(amax_bits), np.float32(1.0), fmt)
    s = jnp.where(finite, s, 1.0)
    return s, pow2(-floor_log2(s)), finite


def pick_block(n: int, candidates) -> int | None:
    for c in candidates:
        if n % c == 0:
            return c
    return None


G2D = (64,)  # tiles per 2D strip (default): (16, 64, 8) words = 32 KiB; g=128 also works


def recip_mode(recip: str, exact_recip: bool | None) -> str:
    if exact_recip is False:  # the old flag: hardware quotient
        return "hw"
    if recip not in RECIP_MODES:
        raise ValueError(f"recip must be one of {RECIP_MODES}, got {recip!r}")
    return recip


SC_SIGNS = 32  # f32 scalars: kernel_scalars (32 words) then the 16 RHT signs

SC_WIDTH = SC_SIGNS + 32  # float32 words of one operand's scalar input (``scalars``):
# room for the 32 signs of the MX formats' RHT-32 (NVFP4's 16 use the first 16)


class _ScalarRow:
    """``sc_ref[i]`` of one operand's scalars inside a flat batch (``scalars`` of k operands,
    reshaped to (k * SC_WIDTH,)): reads ``ref[offset + i]``, static indices as before."""

    def __init__(self, ref, offset: int):
        self.ref, self.offset = ref, offset

    def __getitem__(self, i: int):
        return self.ref[self.offset + i]


def scalar_row(sc_ref, row: int | None):
    """The kernel's view of its scalars: ``sc_ref`` itself (``row`` None: one operand's
    vector) or row ``row`` of the flat batch ``sc_ref`` (``dot_sm90.make_operands``)."""
    return sc_ref if row is None else _ScalarRow(sc_ref, row * SC_WIDTH)


def scalars(enc: jax.Array, dec: jax.Array, signs: jax.Array | None = None) -> jax.Array:
    """The kernels' float32 scalar input: ``kernel_scalars(enc, dec)`` then 32 RHT sign
    slots (16 or 32 signs, padded with ones). Batched as ``kernel_scalars``: ``enc``,
    ``dec`` (k,) and ``signs`` (k, 16 or 32) (or None) give (k, SC_WIDTH)."""
    ks = kernel_scalars(enc, dec)
    n = SC_WIDTH - SC_SIGNS
    if signs is None:
        s = jnp.ones(ks.shape[:-1] + (n,), jnp.float32)
    else:
        s = jnp.asarray(signs, jnp.float32)
        s = s.reshape(ks.shape[:-1] + (s.shape[-1],))
        s = jnp.pad(s, [(0, 0)] * (s.ndim - 1) + [(0, n - s.shape[-1])], constant_values=1.0)
    return jnp.concatenate([ks, s], axis=-1)


def key_words(key: jax.Array | None, offset: jax.Array | None = None) -> jax.Array:
    """int32[3]: the two Threefry key words of ``key`` (zeros without a key) and the
    counter of the first draw, ``offset`` (uint32 scalar, default 0: a shard's place in the
    whole tensor, ``numerics.row_shard_draw_offset``; the packed kernels ignore it)."""
    off = jnp.zeros((1,), jnp.int32) if offset is None else lax.bitcast_convert_type(
        jnp.asarray(offset).astype(jnp.uint32).reshape(1), jnp.int32)
    if key is None:
        return jnp.concatenate([jnp.zeros((2,), jnp.int32), off])
    return jnp.concatenate(
        [lax.bitcast_convert_type(jax.random.key_data(key).reshape(2), jnp.int32), off])


def _barrier(v, plain: bool):
    # stops XLA (interpret mode) from folding (v + 2^23) - 2^23 into v
    return lax.optimization_barrier(v) if plain else v


def e2m1_value(v, u, plain: bool):
    """E2M1 value (float32, sign of ``v`` kept) of a scaled element ``v`` (finite).

    Rule: ``fp4jax.quantization._round_elements``: ``numerics.round_to_grid(|v|, E2M1,
    "nearest")`` (``u`` None) or ``numerics.stochastic_round_to_grid(|v|, E2M1, u)``
    (``u`` float32 from ``sr_uniform``), then the sign; the same values, computed with
    full-rate operations only (no int <-> float conversions, which run at a quarter of
    the integer rate and bounded the stochastic-rounding kernels):

    * nearest: below 1 the grid step is 1/2, so ``(|v| + 1.5 * 2^22) - 1.5 * 2^22``
      rounds half to even onto it; from 1 up E2M1 keeps one mantissa bit, so adding
      ``0x1FFFFF`` plus the kept bit to the float32 bits and clearing the 22 lower bits
      rounds half to even (a carry moves to the next binade); then ``min(., 6)``.
    * stochastic: ``t = |v| / q`` (``q = 2^(clip(floor_log2|v|, 0, 2) - 1)``, exact),
      ``floor(t)`` as ``RNE(t)`` (the 2^23 trick) minus one where that exceeds ``t``,
      round up where ``u < t - floor(t)``, then ``min(r * q, 6)``.
    """
    bits = bits_to_i32(v)
    ab = bits & 0x7FFFFFFF
    if u is None:
        small = _barrier(bits_to_f32(ab) + 6291456.0, plain) - 6291456.0
        big = bits_to_f32((ab + 0x1FFFFF + (lax.shift_right_logical(ab, 22) & 1)) & -0x400000)
        out = jnp.minimum(jnp.where(ab < 0x3F800000, small, big), 6.0)
    else:
        ex = jnp.minimum(jnp.maximum(lax.shift_right_logical(ab, 23) - 127, 0), 2) - 1
        t = bits_to_f32(ab) * bits_to_f32((127 - ex) << 23)
        r0 = _barrier(t + 8388608.0, plain) - 8388608.0
        lo = jnp.where(r0 > t, r0 - 1.0, r0)
        r = jnp.where(u < t - lo, lo + 1.0, lo)
        out = jnp.minimum(r * bits_to_f32((127 + ex) << 23), 6.0)
    return bits_to_f32(bits_to_i32(out) | (bits & -0x80000000))


def sr_uniform(bits, i: int):
    """``u = (b + 1/2) / 256`` (float32, exact) for byte ``i`` (0 = bits 0..7) ``b`` of
    int32 ``bits`` (``numerics.uniform_from_key``): the float ``1 + u`` is built from its
    bits (``b`` as mantissa bits 22..15, the half as bit 14), then 1 is subtracted."""
    sh = 15 - 8 * i
    b = (bits << sh) if sh >= 0 else lax.shift_right_logical(bits, -sh)
    return bits_to_f32((b & 0x7F8000) | 0x3F804000) - 1.0


def iota(shape, dim, plain: bool, layout=None):
    if plain:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=layout or plgpu.Layout.WGMMA)


GR = (128, 64)  # blocks per row of an SR quad tile (fq_rows with a key)
QUAD_BLOCKS = 512  # blocks per CTA of the SR rows kernel (as kt * SUB of the RtN one)


def supported_rows(shape, dtype, sr: bool = False, padded: bool = False,
                   block: int = 16) -> bool:
    """bf16 (R, C), C % ``block`` == 0 (16: NVFP4; 32: MX), R*C a multiple of 4096 (16 *
    ``SUB``), R*C < 2^31; with stochastic rounding (``sr``) also R % 4 == 0 (rows are taken
    in quads) and C % (64 * block) == 0 (64 blocks of each row per tile at least), unless
    ``padded``: the operand kernel's SR tiles may overhang the row
    (``operand_sm90.fq_rows_scaled``: any C % block == 0)."""
    if len(shape) != 2 or jnp.dtype(dtype) != jnp.bfloat16:
        return False
    r, c = shape
    ok = c % block == 0 and (r * c // 16) % SUB == 0 and r * c < 2**31
    return ok and (not sr or (r % 4 == 0 and (padded or c % (block * GR[-1]) == 0)))
