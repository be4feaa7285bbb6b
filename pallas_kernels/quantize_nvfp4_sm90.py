"""Fused NVFP4 1x16 quantization for Hopper (sm_90), Pallas Mosaic GPU.

One pass over ``x`` (bf16 or f32, shape (R, C), C % 16 == 0) that writes

* ``packed``: uint8 (R, C // 2), two E2M1 codes per byte along the last axis
  (element 2i in the low nibble, 2i+1 in the high nibble; code bits ``s e1 e0 m``);
* ``scale_bits``: uint8 (R, C // 16), the E4M3 block-scale bit patterns
  (view them with ``jax.lax.bitcast_convert_type(..., jnp.float8_e4m3fn)``);

given the tensor encode scale ``enc`` and decode scale ``dec`` (computed from the
global amax by a separate XLA reduction, see :func:`global_scales`).

Numerics (Transformer Engine, ``core_nvfp4.cuh``; evaluated in float32 exactly as
the fp4jax reference does):

* ``s = e4m3_rne_satfinite(amax_block * (enc * f32(1/6)))``; NaN if the block holds NaN/Inf;
* ``e = min(1 / (f32(s) * dec), FLT_MAX)``, ``e = 0`` when ``s == 0``;
* ``q = e2m1_rne_satfinite(x * e)``.

Mosaic GPU on Hopper cannot convert to float4/float8 in registers, so both roundings
are done with float32 comparisons and integer bit operations:

* E4M3 (scales, always >= 0): normal range by adding ``0x7FFFF + lsb`` to the float32
  bits and clearing the 20 low mantissa bits; subnormals (< 2^-6) by the
  ``(v * 2^9 + 2^23) - 2^23`` round-to-nearest-even trick.
* E2M1: the magnitude code is the number of round-to-nearest-even decision thresholds
  (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) that ``|v|`` passes, with ``>`` where the tie
  goes down to the even code and ``>=`` where it goes up; saturation at 6 is automatic.

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
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

try:  # JAX 0.11 registers pallas_call's Mosaic GPU lowering only when this is imported.
    from jax._src.pallas.mosaic_gpu import pallas_call_registration as _  # noqa: F401
except ImportError:  # pragma: no cover
    pass

FLT_MAX = float(np.finfo(np.float32).max)


def global_scales(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """NVFP4 tensor scales (enc, dec) from the finite amax of ``x`` (an XLA reduction).

    Exactly the core's: ``fp4jax.quantize.global_encode_scale`` and ``dec =
    numerics.div_rn(1, enc)`` (correctly rounded divisions, also on the GPU).
    """
    from fp4jax.formats import NVFP4
    from fp4jax.numerics import div_rn
    from fp4jax.quantize import global_encode_scale

    a = jnp.abs(x.astype(jnp.float32))
    amax = jnp.max(jnp.where(jnp.isfinite(a), a, 0.0))
    enc = global_encode_scale(amax, NVFP4)
    dec = div_rn(jnp.float32(1.0), enc)
    return enc, dec


def _i32(v):
    return lax.bitcast_convert_type(v, jnp.int32)


def _f32(v):
    return lax.bitcast_convert_type(v, jnp.float32)


def e4m3_round(s_f):
    """RNE-to-E4M3 of a float32 array (>= 0, <= 448 after the caller's clamp).

    Returns (value as float32, E4M3 bit pattern as int32).
    """
    bits = _i32(s_f)
    lsb = lax.shift_right_logical(bits, 20) & 1
    rn = (bits + 0x7FFFF + lsb) & -0x100000  # clear the 20 mantissa bits E4M3 lacks
    byte_norm = ((lax.shift_right_logical(rn, 23) - 120) << 3) | (
        lax.shift_right_logical(rn, 20) & 7
    )
    # round(s * 2^9) to an integer, ties to even; the barrier stops XLA (interpret mode)
    # from folding (v + 2^23) - 2^23 into v.
    sub = lax.optimization_barrier(s_f * 512.0 + 8388608.0) - 8388608.0
    is_sub = s_f < 0.015625  # 2^-6, smallest normal E4M3
    val = jnp.where(is_sub, sub * (1.0 / 512.0), _f32(rn))
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
    bits = _i32(v)
    ab = bits & 0x7FFFFFFF
    r = ab + 0x1FFFFF + (lax.shift_right_logical(ab, 22) & 1)
    c_hi = jnp.minimum(lax.shift_right_logical(r, 22) - 252, 7)
    a = _f32(ab)
    # the barrier stops XLA (interpret mode) from simplifying the magic-number add
    c_lo = _i32(lax.optimization_barrier(a * 2.0 + 8388608.0)) & 3
    code = jnp.where(a < 1.0, c_lo, c_hi)
    return code | (lax.shift_right_logical(bits, 28) & 8)


_HI12 = -0x1000  # float32 bits mask keeping sign, exponent and the top 12 significand bits


def recip_rn(p, y0=None):
    """Correctly rounded float32 ``1 / p`` for normal ``p > 0`` with a normal quotient.

    XLA's (and LLVM's default) float32 division on NVIDIA GPUs may be one ulp off
    (``experiments/results/gpu_numpy_diff.json``); this rounds like
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
    bits = _i32(p)
    ep = lax.shift_right_logical(bits, 23) & 0xFF
    m = _f32((bits & 0x7FFFFF) | 0x3F800000)
    y = 1.0 / m if y0 is None else y0
    yb = _i32(y)
    mh = _f32(_i32(m) & _HI12)
    ml = m - mh
    yh = _f32(yb & _HI12)
    yl = y - yh
    r = (((1.0 - mh * yh) - mh * yl) - ml * yh) - ml * yl
    y_up = _f32(yb + 1)
    y_dn = _f32(yb - 1)
    up = r > m * ((y_up - y) * 0.5)
    dn = r < -(m * ((y - y_dn) * 0.5))
    yb = jnp.where(up, yb + 1, jnp.where(dn, yb - 1, yb))
    e_out = (lax.shift_right_logical(yb, 23) & 0xFF) - (ep - 127)
    res = _f32(yb - ((ep - 127) << 23))
    ok = (ep > 0) & (ep < 255) & (e_out > 0) & (e_out < 255)
    return res, ok


SUB = 256  # blocks per register sub-tile: (256, 8) words, 16 words per thread


def _quant_tile(sc_ref, x_ref, q_ref, s_ref, *, nb: int, plain: bool = False,
                exact_recip: bool = True):
    """Quantize ``nb`` blocks: x_ref (nb, 8) uint32 words (bf16 pairs), q_ref (nb, 8)
    uint8 packed codes, s_ref (nb,) uint8 scale bits.

    Block b is row b. Word k of a block holds elements 2k (low half) and 2k+1 (high
    half); their two E2M1 codes make byte k of the packed output, so the packed tile
    has the same (rows, 8) shape as the word tile and every thread only transforms the
    words it loaded. The words are held in the WGMMA register layout (a row spread over
    a quad of lanes), so a block's amax is a row reduction (quad shuffles) and the
    per-block scales live in the row layout and broadcast back along the row.
    """
    enc6 = sc_ref[0]
    dec = sc_ref[1]
    for a in range(0, nb, SUB):
        rows = pl.ds(a, SUB) if nb > SUB else slice(None)
        if plain:
            w = x_ref[rows, :]
        else:
            w = plgpu.load(x_ref, (rows, slice(None)), layout=plgpu.Layout.WGMMA)
        w = lax.bitcast_convert_type(w, jnp.int32)
        lo = _f32(w << 16)  # element 2k
        hi = _f32(w & -0x10000)  # element 2k+1
        # |x| bits of the larger half, as an int: integer order == float order for >= 0
        abs_bits = jnp.maximum(_i32(lo) & 0x7FFFFFFF, _i32(hi) & 0x7FFFFFFF)
        amax_bits = jnp.max(abs_bits, axis=1)  # (SUB,) row layout
        finite = amax_bits < 0x7F800000
        s_f = _f32(amax_bits) * enc6
        s_f = jnp.where(s_f > 448.0, 448.0, s_f)
        s_val, s_byte = e4m3_round(s_f)
        s_byte = jnp.where(finite, s_byte, 0x7F)
        p = s_val * dec
        if exact_recip:
            e_rn, ok = recip_rn(p)
            e = jnp.where(ok, e_rn, 1.0 / p)  # div_rn's fallback (p or 1/p not normal)
        else:  # the hardware quotient (may be 1 ulp off on the GPU); for timing only
            e = 1.0 / p
        e = jnp.where(e > FLT_MAX, FLT_MAX, e)
        e = jnp.where(s_val == 0.0, 0.0, e)
        s_ref[rows] = s_byte.astype(jnp.uint8)
        eb = lax.broadcast_in_dim(e, (SUB, 8), (0,))
        fin = lax.broadcast_in_dim(finite.astype(jnp.int32), (SUB, 8), (0,))
        byte = e2m1_code(lo * eb) | (e2m1_code(hi * eb) << 4)
        byte = jnp.where(fin != 0, byte, 0x88)  # NaN/Inf block: codes -0, as astype
        q_ref[rows, :] = byte.astype(jnp.uint8)


def _pick_block(n: int, candidates) -> int | None:
    for c in candidates:
        if n % c == 0:
            return c
    return None


def supported(shape, dtype) -> bool:
    """Whether the kernel handles x of this shape/dtype (else use the XLA path)."""
    if len(shape) != 2 or jnp.dtype(dtype) != jnp.bfloat16:
        return False
    r, c = shape
    return c % 16 == 0 and (r * c // 16) % SUB == 0


@functools.partial(
    jax.jit, static_argnames=("block", "steps_per_cta", "interpret", "exact_recip"))
def quantize_nvfp4_1x16_scaled(
    x: jax.Array,
    enc: jax.Array,
    dec: jax.Array,
    *,
    block: int | None = None,
    steps_per_cta: int | None = None,
    interpret=False,
    exact_recip: bool = True,
):
    """Kernel call with given tensor scales. x: (R, C) bfloat16, see ``supported``.

    Returns (packed uint8 (R, C//2), scale_bits uint8 (R, C//16)).
    ``exact_recip=False`` uses the hardware ``1/(s*dec)`` (not bit-exact on the GPU;
    kept only to time the cost of the correctly rounded reciprocal).
    """
    if not supported(x.shape, x.dtype):
        raise ValueError(
            f"quantize kernel needs bfloat16 (R, C) with C % 16 == 0 and R*C % {16 * SUB} == 0,"
            f" got {x.dtype} {x.shape}"
        )
    r, c = x.shape
    nbt = r * c // 16  # total blocks
    xw = lax.bitcast_convert_type(x.reshape(nbt, 8, 2), jnp.uint32)  # (blocks, 8 words)
    sc = jnp.stack([enc.astype(jnp.float32) * jnp.float32(1.0 / 6.0), dec.astype(jnp.float32)])
    sc = jnp.pad(sc, (0, 2))  # 16 bytes
    if interpret:
        # Mosaic GPU interpret mode (CPU tests) supports only trivial windows: run the
        # tile body once over all blocks (the TMA pipeline is not exercised).
        q, s = pl.pallas_call(
            functools.partial(_quant_tile, nb=nbt, plain=True, exact_recip=exact_recip),
            out_shape=(
                jax.ShapeDtypeStruct((nbt, 8), jnp.uint8),
                jax.ShapeDtypeStruct((nbt,), jnp.uint8),
            ),
            interpret=interpret,
            compiler_params=plgpu.CompilerParams(),
        )(sc, xw)
        return q.reshape(r, c // 2), s.reshape(r, c // 16)

    # TMA boxes are at most 256 along a dimension: view the blocks as (n, 256, ...) slabs.
    ns = nbt // SUB
    # Defaults from the H200 sweep in experiments/results/bench_kernels_run1.json: small
    # steps (2 slabs = 16 KiB of input) and one step per CTA, i.e. many small CTAs per SM,
    # were fastest (94 us vs 144 us for 4 slabs x up to 8 steps at 8192x8192).
    kt = block or _pick_block(ns, (2, 1))  # slabs per pipeline step
    steps = ns // kt
    spc = steps_per_cta or 1
    if steps % spc:
        raise ValueError(f"steps_per_cta={spc} must divide the {steps} steps")
    # JAX 0.11 lowers Mosaic GPU kernels through plgpu.kernel: each CTA pipelines (TMA
    # in/out, double-buffered) over `spc` consecutive steps of `kt` slabs.

    def body(sc_gmem, x_gmem, q_gmem, s_gmem):
        cta = lax.axis_index("ctas")

        def step(_, x_smem, q_smem, s_smem):
            for i in range(kt):
                _quant_tile(
                    sc_gmem, x_smem.at[i], q_smem.at[i].reshape(SUB, 8), s_smem.at[i], nb=SUB,
                    exact_recip=exact_recip,
                )

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
        compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True),
    )(sc, xw.reshape(ns, SUB, 8))
    return q.reshape(r, c // 2), s.reshape(r, c // 16)


def quantize_nvfp4_1x16(x: jax.Array, *, interpret: bool = False, **kw):
    """Global amax (XLA) + fused kernel. Returns (packed, scale_bits, dec)."""
    enc, dec = global_scales(x)
    packed, s = quantize_nvfp4_1x16_scaled(x, enc, dec, interpret=interpret, **kw)
    return packed, s, dec
