"""Scalar rounding rules: every bit-level decision of fp4jax lives here.

All functions are elementwise, pure, jit/vmap/grad-safe, and exact in float32:
they never round twice. They are written with integer exponent extraction and
power-of-two arithmetic so that the same code serves the OCP MX element formats (E2M1,
E2M3, E3M2, E4M3, E5M2), E4M3 and UE8M0 block scales, and any unsigned ExMy scale format
of the FP4-all-the-way sweeps.

References:
  * NVIDIA, "Pretraining Large Language Models with NVFP4" (arXiv 2509.25149),
    Appendix B (B.1 global scale, B.2 block scale, B.3 conversion, B.4 MXFP4).
  * Transformer Engine, ``transformer_engine/common/cast/nvfp4/core_nvfp4.cuh``
    (``compute_global_encode_scaling_factor_FP4``, the E4M3 ``satfinite``
    scale cast and the FP4 ``cvt.rn.satfinite.e2m1x2.f32`` conversion).
  * OCP Microscaling Formats (MX) v1.0, section 5.3 (the element data types: 5.3.1 FP8,
    5.3.2 FP6, 5.3.3 FP4) and section 6.3 (the OCP MX scale rule).
  * OCP 8-bit Floating Point Specification (OFP8) v1.0 (E4M3 and E5M2 encodings), and
    IEEE 754-2019 section 3.4 (the all-ones exponent field encodes Inf and NaN).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FLT_MAX = float(np.finfo(np.float32).max)

__all__ = [
    "FloatGrid",
    "E2M1",
    "E2M3",
    "E3M2",
    "E4M3",
    "E5M2",
    "E1M2",
    "E8M0",
    "ELEMENT_FORMATS",
    "unsigned_grid",
    "uniform_rows",
    "element_grid",
    "floor_log2",
    "pow2",
    "where",
    "clip",
    "round_even",
    "signbit",
    "round_to_grid",
    "NATIVE_RNE",
    "div_rn",
    "div_rn_f64",
    "div_rn_integer",
    "recip_scaled_rn",
    "stochastic_round_to_grid",
    "uniform_from_key",
    "threefry2x32",
    "threefry2x32_primitive",
    "threefry_bits_at",
    "draws_from_key",
    "reciprocal_rn",
    "subnormal_hi",
    "recip_scaled_subnormal_rn",
    "recip_scaled_subnormal_integer",
    "recip_subnormal_integer",
    "mul_decode_scale",
]


@dataclasses.dataclass(frozen=True)
class FloatGrid:
    """A small unsigned floating-point grid ``ExMy`` (the sign is handled apart).

    ``bias = 2**(exp_bits-1) - 1``. With ``man_bits > 0`` the format has subnormals
    (exponent code 0) and zero. Which codes are finite is ``specials`` (the convention,
    see ``unsigned_grid``): ``"fn"`` (only the all-ones code is NaN: ``float8_e4m3fn``),
    ``"ieee"`` (the whole all-ones exponent field is Inf/NaN: ``float8_e5m2``) or
    ``"none"`` (every code is finite: E2M1, E2M3, E3M2). With ``man_bits == 0``
    (E8M0-like) there is no zero and no subnormal; the all-ones exponent code is NaN
    (``"fn"`` and ``"ieee"`` coincide there), the smallest value used is
    ``max(2**-bias, 2**-126)`` (float32 normals only), and round-to-nearest ties go to
    the larger value.

    Attributes:
      exp_bits: exponent bits (1..8).
      man_bits: mantissa bits (0..7).
      max_value: largest finite magnitude.
      min_exp: exponent of the smallest normal binade (subnormal quantum is
        ``2**(min_exp - man_bits)``).
      specials: ``"fn"``, ``"ieee"`` or ``"none"``.
    """

    exp_bits: int
    man_bits: int
    max_value: float
    min_exp: int
    specials: str = "fn"

    @property
    def name(self) -> str:
        return f"E{self.exp_bits}M{self.man_bits}"

    @property
    def has_zero(self) -> bool:
        return self.man_bits > 0

    @property
    def min_value(self) -> float:
        """Smallest positive value (subnormal when ``man_bits > 0``)."""
        return float(2.0 ** (self.min_exp - self.man_bits))

    @property
    def max_exp(self) -> int:
        """Exponent of the largest binade in use: ``floor(log2(max_value))`` (the OCP MX
        ``emax`` of an element format, section 6.3), or ``min_exp`` for a grid of
        subnormals only (IEEE-style E1My, whose one normal exponent code is reserved)."""
        return max(int(np.floor(np.log2(self.max_value))), self.min_exp)


def unsigned_grid(exp_bits: int, man_bits: int, *, has_nan_code: bool = True,
                  ieee: bool = False) -> FloatGrid:
    """The unsigned ``E{exp_bits}M{man_bits}`` grid under one of three conventions for
    its special codes (bias ``2**(exp_bits-1) - 1``, subnormals at exponent code 0):

    * ``"fn"`` (the default): only the all-ones code (exponent and mantissa) is NaN; the
      rest of the top binade is finite. OCP OFP8 v1.0's E4M3 (``S.1111.111`` is NaN, max
      448: ``float8_e4m3fn``) and fp4jax's convention for every ExMy block scale
      (FP4-all-the-way's sweep, whose paper does not say). E5M2 scales then reach 98,304.
    * ``"ieee"`` (``ieee=True``): IEEE 754-2019 section 3.4: the whole all-ones exponent
      field encodes Inf (mantissa 0) and NaN, so the largest finite value is
      ``2**emax * (2 - 2**-man_bits)``: E5M2 57,344 (OCP OFP8 E5M2, ``float8_e5m2``),
      E4M3 240, E3M4 15.5. For ``man_bits == 0`` this is the ``"fn"`` grid (the all-ones
      code is the whole all-ones exponent field). An IEEE-style E1My has no normal
      numbers: its values are the subnormals ``k * 2**(1 - man_bits)``, ``k < 2**man_bits``.
    * ``"none"`` (``has_nan_code=False``): every code is finite, the all-ones code is the
      maximum. OCP MX v1.0 section 5.3.2-5.3.3: FP6 E2M3 (max 7.5), E3M2 (28) and FP4
      E2M1 (6) have no Inf or NaN.

    Args:
      exp_bits: 1..8.
      man_bits: 0..7 (``exp_bits + man_bits <= 8``).
      has_nan_code: whether special codes are reserved at all (False: ``"none"``).
      ieee: the IEEE convention (needs ``has_nan_code=True``).
    Returns:
      the ``FloatGrid`` (``specials`` records the convention).
    """
    if not (1 <= exp_bits <= 8 and 0 <= man_bits <= 7 and exp_bits + man_bits <= 8):
        raise ValueError(
            f"unsupported scale format E{exp_bits}M{man_bits}: need 1 <= exp_bits <= 8, "
            "0 <= man_bits and exp_bits + man_bits <= 8"
        )
    if ieee and not has_nan_code:
        raise ValueError("unsigned_grid: ieee=True reserves the all-ones exponent for Inf/NaN; "
                         "it cannot be combined with has_nan_code=False")
    specials = "none" if not has_nan_code else ("ieee" if ieee else "fn")
    bias = 2 ** (exp_bits - 1) - 1
    top_exp = (2**exp_bits - 1) - bias
    if man_bits == 0:
        # No subnormals, no zero; all-ones exponent is NaN (E8M0 convention).
        max_value = 2.0 ** (top_exp - 1 if has_nan_code else top_exp)
        # E8M0's smallest code, 2**-127, is a float32 subnormal: XLA on CPU (and
        # FTZ GPU code) flushes it to zero, which E8M0 cannot encode (NaN). The
        # smallest scale used is therefore the smallest normal float32, 2**-126.
        min_exp = max(-bias, -126)
    else:
        min_exp = 1 - bias
        if specials == "ieee":
            if top_exp - 1 < min_exp:  # E1My: exponent code 1 is reserved, subnormals only
                max_value = 2.0 ** (min_exp - man_bits) * (2**man_bits - 1)
            else:
                max_value = 2.0 ** (top_exp - 1) * (2.0 - 2.0**-man_bits)
        else:
            top_man = 2**man_bits - 1 - (1 if has_nan_code else 0)
            max_value = 2.0**top_exp * (1.0 + top_man / 2**man_bits)
    return FloatGrid(exp_bits, man_bits, float(max_value), int(min_exp), specials)


E2M1 = unsigned_grid(2, 1, has_nan_code=False)  # {0, .5, 1, 1.5, 2, 3, 4, 6}
E2M3 = unsigned_grid(2, 3, has_nan_code=False)  # FP6, max 7.5, min 2**-3
E3M2 = unsigned_grid(3, 2, has_nan_code=False)  # FP6, max 28, min 2**-4
E4M3 = unsigned_grid(4, 3)  # float8_e4m3fn magnitudes, max 448, min 2**-9
E5M2 = unsigned_grid(5, 2, ieee=True)  # float8_e5m2 magnitudes, max 57344, min 2**-16
E8M0 = unsigned_grid(8, 0)  # UE8M0: 2**-127 .. 2**127

E1M2 = unsigned_grid(1, 2, has_nan_code=False)  # uniform 4-bit: {0, .5, 1, ..., 3.5}

ELEMENT_FORMATS = {(2, 1): E2M1, (2, 3): E2M3, (3, 2): E3M2, (4, 3): E4M3, (5, 2): E5M2,
                   (1, 2): E1M2}
"""The element grids by ``(exp_bits, man_bits)`` (``element_grid``): OCP MX v1.0's and the
uniform 4-bit E1M2."""


NATIVE_RNE = {E2M1: jnp.float4_e2m1fn, E4M3: jnp.float8_e4m3fn}
"""Grids whose round-to-nearest-even ``round_to_grid`` takes from XLA's conversion to a
JAX dtype: E2M1 (OCP MX FP4, ``float4_e2m1fn``) and E4M3 (OCP OFP8, ``float8_e4m3fn``)."""


def element_grid(exp_bits: int, man_bits: int) -> FloatGrid:
    """The magnitudes of an element data type: OCP MX v1.0's (section 5.3; the FP8 encodings
    are OCP OFP8 v1.0's), and the uniform E1M2:

    * FP4 E2M1 (5.3.3): 0 .. 6, no Inf/NaN;
    * FP6 E2M3 (5.3.2): 0 .. 7.5 (subnormal quantum 2**-3), no Inf/NaN;
    * FP6 E3M2 (5.3.2): 0 .. 28 (subnormal quantum 2**-4), no Inf/NaN;
    * FP8 E4M3 (5.3.1): 0 .. 448 (quantum 2**-9), NaN only at ``S.1111.111``, no Inf;
    * FP8 E5M2 (5.3.1): 0 .. 57,344 (quantum 2**-16), IEEE Inf and NaN (exponent 11111).
    * FP4 E1M2 (not an OCP MX type): the *uniform* 4-bit grid 0, 0.5, 1, ..., 3.5 (bias 0,
      codes 0-3 subnormal, no Inf/NaN), the "E1M2" of "Rethinking Shrinkage Bias in LLM
      FP4 Pretraining" (UFP4, arXiv 2606.20381, abstract: "uniform grids (E1M2/INT4)
      bypass this grid-geometry error"). It is symmetric INT4 (-7 .. 7) times 1/2: under
      a block scale the two give the same values (the scale absorbs the factor 2).

    Conversion onto them (``round_to_grid``, ``stochastic_round_to_grid``) saturates to
    the maximum: OCP MX v1.0 section 6.3 leaves overflow implementation-defined, and the
    OCP reference library clamps (``microsoft/microxcaling``, ``mx/mx_ops.py``
    ``_quantize_mx``: ``_quantize_elemwise_core(..., saturate_normals=True)``), as
    Transformer Engine's ``satfinite`` conversions do. So no element is ever Inf or NaN.

    Raises:
      ValueError for any other ``(exp_bits, man_bits)``, listing the valid ones.
    """
    key = (exp_bits, man_bits)
    if key not in ELEMENT_FORMATS:
        valid = ", ".join(f"({e}, {m}) {g.name}" for (e, m), g in ELEMENT_FORMATS.items())
        raise ValueError(f"E{exp_bits}M{man_bits} is not an OCP MX element format; valid "
                         f"(exp_bits, man_bits): {valid}")
    return ELEMENT_FORMATS[key]


def exact_float32(x: jax.Array) -> jax.Array:
    """``x`` widened to float32 with exactly the values of its own dtype: how every fp4jax
    quantizer, amax and RHT reads a bfloat16 or float16 operand.

    Why a rule: XLA's ``--xla_allow_excess_precision`` (true by default) lets it remove a
    ``convert(f32 -> bf16) -> convert(bf16 -> f32)`` pair, so an operand cast to bfloat16
    inside the same jitted program (a float32 master weight that a layer casts to its
    compute dtype) reached the quantizer unrounded on the GPU, so its quantized values,
    and ``fp4jax.dot``'s outputs and gradients, differed from those of the same weight
    cast on the host (measured on an H100: docs/performance.md); on the CPU XLA kept the
    rounding.
    bfloat16 gets an explicit ``reduce_precision`` to its 8 exponent and 7 mantissa bits
    after the widening (round to nearest even, as the convert; the same exponent range as
    float32, so no overflow or subnormal differs), which still rounds where the convert
    pair was removed and changes nothing where it was not (one fused element-wise op).
    float16 gets an ``optimization_barrier`` before the widening instead (XLA's
    ``reduce_precision`` flushes values below the target's smallest normal to zero, which
    float16's convert does not). float32 passes unchanged.

    Args:
      x: a float array (float32, bfloat16 or float16).
    Returns:
      float32 array of ``x``'s shape.
    """
    x = jnp.asarray(x)
    if x.dtype == jnp.float32:
        return x
    if x.dtype == jnp.bfloat16:
        return jax.lax.reduce_precision(x.astype(jnp.float32), exponent_bits=8, mantissa_bits=7)
    if x.dtype == jnp.float16:
        return jax.lax.optimization_barrier(x).astype(jnp.float32)
    return x.astype(jnp.float32)


def floor_log2(v: jax.Array) -> jax.Array:
    """``floor(log2(v))`` for float32 ``v > 0``, exact, as int32.

    Read from the IEEE exponent field. For float32 subnormals (``v < 2**-126``)
    it returns -127, which every caller clamps to a larger ``min_exp``.
    """
    bits = jax.lax.bitcast_convert_type(v.astype(jnp.float32), jnp.int32)
    return ((bits >> 23) & 0xFF) - 127


def where(cond: Any, x: Any, y: Any) -> jax.Array:
    """``jnp.where(cond, x, y)`` (bool ``cond``; the same dtype promotion, broadcasting and
    ``select_n``, so the same bits) traced inline: ``jnp.where`` is a ``jax.jit``-wrapped
    function, and each call inside a trace is a nested jit (its own tracing, a private
    function in the lowered module). The quantizers call it about 900 times in a micro
    NVFP4 train step: inline, the step traces and lowers faster."""
    if not any(isinstance(a, (jax.Array, np.ndarray, np.generic)) for a in (x, y)):
        return jnp.where(cond, x, y)  # both Python scalars: jnp's weak result type
    dtype = jnp.result_type(x, y)
    x, y = jnp.asarray(x, dtype), jnp.asarray(y, dtype)
    shape = jnp.broadcast_shapes(jnp.shape(cond), x.shape, y.shape)
    return jax.lax.select(jnp.broadcast_to(cond, shape), jnp.broadcast_to(x, shape),
                          jnp.broadcast_to(y, shape))


def clip(x: jax.Array, lo: Any, hi: Any) -> jax.Array:
    """``jnp.clip(x, lo, hi)`` (``min(hi, max(lo, x))``, the same operations) traced
    inline, as ``where``."""
    return jnp.minimum(hi, jnp.maximum(lo, x))


def round_even(x: jax.Array) -> jax.Array:
    """``jnp.round(x)`` of a float array (round half to even), traced inline, as
    ``where``."""
    return jax.lax.round(x, jax.lax.RoundingMethod.TO_NEAREST_EVEN)


def signbit(x: jax.Array) -> jax.Array:
    """``jnp.signbit(x)`` (bool: the sign bit is set, -0.0 and NaNs included), traced
    inline for float32, as ``where``."""
    x = jnp.asarray(x)
    if x.dtype != jnp.float32:
        return jnp.signbit(x)
    return (jax.lax.bitcast_convert_type(x, jnp.int32) >> 31).astype(bool)


def _pow2_normal(n: jax.Array) -> jax.Array:
    """``2**n`` as float32 for integer ``n`` in [-126, 127], built from bits."""
    return jax.lax.bitcast_convert_type(((n + 127) << 23).astype(jnp.int32), jnp.float32)


def pow2(n: jax.Array) -> jax.Array:
    """Exact ``2**n`` as float32 for integer ``n`` in [-149, 127] (subnormals included).

    Written as a product of two normal powers of two so that the float32
    multiply is exact (the result is representable).
    """
    n = jnp.asarray(n, jnp.int32)
    half = n >> 1  # floor(n / 2): an arithmetic shift (``//`` lowers to a select chain)
    return _pow2_normal(half) * _pow2_normal(n - half)


def _quantum(a: jax.Array, grid: FloatGrid) -> tuple[jax.Array, jax.Array]:
    """Spacing of ``grid`` in the binade of ``a >= 0`` (subnormal spacing below), and its
    inverse; both exact powers of two, so ``a * inverse`` is an exact division."""
    e = clip(floor_log2(a), grid.min_exp, grid.max_exp) - grid.man_bits
    if grid.min_exp - grid.man_bits >= -126 and grid.max_exp - grid.man_bits <= 126:
        # both 2**e and 2**-e normal (E2M1, E4M3, every grid but the widest): one bit
        # pattern each, the same values as ``pow2``'s product, with half the operations
        # (an NVFP4 quantizer lowers to 16 fewer)
        return _pow2_normal(e), _pow2_normal(-e)
    return pow2(e), pow2(-e)


def div_rn(a: jax.Array, b: jax.Array) -> jax.Array:
    """Correctly rounded (IEEE round-to-nearest-even) float32 ``a / b`` on every backend.

    On the CPU XLA's float32 division is IEEE-exact, so it is used (the other paths compile
    slower there), guarded against XLA's rewrites of divisions (``_div_cpu``): a scalar or
    constant divisor made ``A * (1 / B)``, one ulp off for 0.2-33% of quotients
    (``tests/core/test_quantize.py``), and chained divisions merged.
    On every other platform the quotient comes from ``div_rn_f64`` (one float64 division,
    where the JAX version can trace one) or else ``div_rn_integer``: the same bits. The
    choice is made by ``jax.lax.platform_dependent`` when the computation is lowered for
    its device. (Before 2026-11-26 the CPU path had no guard: ``ms_eden``'s division of
    every block by the tensor scale was not correctly rounded there.)
    """
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    default = div_rn_f64 if hasattr(jax, "enable_x64") else div_rn_integer
    return jax.lax.platform_dependent(a, b, cpu=_div_cpu, default=default)


def _div_cpu(a: jax.Array, b: jax.Array) -> jax.Array:
    """XLA's float32 ``a / b`` (IEEE-exact on the CPU) kept whole: the divisor, broadcast to
    the quotient's shape, and the quotient pass through ``optimization_barrier``, which
    XLA's algebraic simplifier cannot see through. Without them it rewrites, on the CPU,
    ``A / broadcast(B)`` and ``A / constant`` into ``A * (1 / B)``, ``(A / B) / C`` into
    ``A / (B * C)`` and ``A / (B / C)`` into ``(A * C) / B``: each one ulp off for a share
    of the quotients (``tests/core/test_quantize.py``)."""
    a, b = jnp.broadcast_arrays(a, b)
    return jax.lax.optimization_barrier(a / jax.lax.optimization_barrier(b))


def _div_rn_normal(a: jax.Array, b: jax.Array) -> jax.Array:
    """Where ``div_rn_integer`` computes the quotient itself (bool, broadcast shape): both
    operands normal float32 numbers and the quotient, rounded to 24 significant bits,
    a normal float32 number; elsewhere it returns the backend's ``a / b``."""
    ea = (jax.lax.bitcast_convert_type(a, jnp.int32) >> 23) & 0xFF
    eb = (jax.lax.bitcast_convert_type(b, jnp.int32) >> 23) & 0xFF
    return (ea > 0) & (ea < 255) & (eb > 0) & (eb < 255)


def div_rn_f64(a: jax.Array, b: jax.Array) -> jax.Array:
    """``div_rn_integer``'s bits with one float64 division and one rounding to float32.

    For float32 ``a``, ``b`` (24-bit significands) the float64 quotient is the correctly
    rounded 53-bit quotient (IEEE division, ``div.rn.f64`` on NVIDIA GPUs), and rounding
    it again to 24 bits gives the correctly rounded float32 quotient: double rounding is
    innocuous for division when the intermediate precision is at least twice the final
    one plus two (53 >= 2 * 24 + 2; S. A. Figueroa, "When is double rounding
    innocuous?", SIGNUM Newsletter 30(3), 1995). The integer long division needs ~150
    integer operations per quotient, inlined into every quantization: on an H100 its
    chains were the largest fusions of an NVFP4 layer's compiled step, and XLA's fusion
    pass spent most of the compile time on them; this division compiles several times
    faster (docs/performance.md).

    Where ``div_rn_integer`` falls back to the backend's ``a / b`` (an operand zero,
    subnormal, infinite or NaN; a quotient that, rounded to 24 significant bits, is not a
    normal float32 number), so does this, so the bits are the same everywhere. (No
    quotient of two normal float32 numbers lies less than ``2**-24`` relative below a
    power of two, ``A = B (1 - d)`` with 24-bit integers ``A``, ``B`` needing
    ``d >= 1/B``, so none rounds up into the normal range: comparing the float64
    quotient with ``2**-126`` is the integer path's test.) The float64 values are traced
    under ``jax.enable_x64``, whatever the global setting.

    A broadcast or constant divisor: XLA may compute ``a * (1 / b)`` in float64 instead
    (two roundings, within ``2**-52`` relative of ``a / b``). The result is still the
    correctly rounded float32 quotient: with 24-bit integer significands ``A``, ``B`` the
    exact quotient ``A / B`` differs from a float32 rounding midpoint ``M / 2**25`` (``M``
    odd) by ``(2**25 A - M B) / (2**25 B)``, a nonzero integer over ``2**25 B`` (zero would
    need ``B`` a power of two, whose reciprocal is exact), so by over ``2**-50`` relative,
    and both roundings to float32 agree (``tests/core/test_quantize.py`` checks scalar and constant
    divisors on the CPU, which rewrites so).
    """
    a = a.astype(jnp.float32)
    b = b.astype(jnp.float32)
    a, b = jnp.broadcast_arrays(a, b)
    with jax.enable_x64(True):
        q64 = jax.lax.div(a.astype(jnp.float64), b.astype(jnp.float64))
        q = q64.astype(jnp.float32)  # infinite iff the rounded quotient is >= 2**128
        normal = jnp.abs(q64) >= jnp.float64(2.0**-126)
    ok = _div_rn_normal(a, b) & normal & jnp.isfinite(q)
    return where(ok, q, a / b)


def div_rn_integer(a: jax.Array, b: jax.Array) -> jax.Array:
    """Correctly rounded float32 ``a / b`` by integer long division (any backend).

    Transformer Engine computes its scales with CUDA's ``1.0f / x``, which is the
    IEEE-exact ``div.rn.f32``. XLA's float32 division on NVIDIA GPUs is not: it may be
    one ulp off, which flips E2M1 rounding ties (how often: docs/performance.md). So the
    quotient is rebuilt here with integer long
    division of the 24-bit significands (25 quotient bits, then round-half-even on
    the guard bit and the sticky remainder), which every backend computes exactly.

    Inputs that are zero, subnormal, infinite or NaN, and quotients outside the
    normal float32 range, fall back to the backend's ``a / b`` (the scale formulas
    clamp or special-case all of those).
    """
    a = a.astype(jnp.float32)
    b = b.astype(jnp.float32)
    a, b = jnp.broadcast_arrays(a, b)
    ia = jax.lax.bitcast_convert_type(a, jnp.int32)
    ib = jax.lax.bitcast_convert_type(b, jnp.int32)
    ea = (ia >> 23) & 0xFF
    eb = (ib >> 23) & 0xFF
    ma = (ia & 0x7FFFFF) | 0x800000
    mb = (ib & 0x7FFFFF) | 0x800000
    shift = (ma < mb).astype(jnp.int32)
    r = ma << shift  # now mb <= r < 2 * mb: the quotient r / mb is in [1, 2)
    e = ea - eb - shift + 127
    q = jnp.zeros_like(r)
    for _ in range(25):  # 1 integer bit, 23 fraction bits, 1 guard bit
        bit = (r >= mb).astype(jnp.int32)
        q = (q << 1) | bit
        r = (r - bit * mb) << 1
    guard = q & 1
    q = q >> 1
    q = q + (guard & ((r != 0) | (q & 1)).astype(jnp.int32))
    carry = q >> 24
    q = q >> carry
    e = e + carry
    sign = (ia ^ ib) & jnp.int32(-(2**31))
    bits = sign | (e << 23) | (q & 0x7FFFFF)
    exact = jax.lax.bitcast_convert_type(bits, jnp.float32)
    ok = (ea > 0) & (ea < 255) & (eb > 0) & (eb < 255) & (e > 0) & (e < 255)
    return where(ok, exact, a / b)


SUBNORMAL_SHIFT = 64
"""``subnormal_hi`` scales by ``2**SUBNORMAL_SHIFT``: float32 subnormals become normal."""


def reciprocal_rn(v: jax.Array) -> jax.Array:
    """Correctly rounded (RNE) float32 ``1 / v`` for float32 ``v > 0``, subnormal quotients
    included, bit-identical on every backend.

    Where the quotient is a normal float32 (``v <= 2**126``) this is ``div_rn(1, v)``. For
    ``v`` in ``(2**126, FLT_MAX]`` the quotient lies in ``[2**-128, 2**-126]``, where IEEE
    754 rounds to the subnormal quantum ``2**-149``: the result is
    ``RNE(2**149 / v) * 2**-149``, whose integer ``n = RNE(2**149 / v)`` (at most
    ``2**23``) is written into the bits directly (XLA on the CPU flushes subnormal results
    of arithmetic to zero, so a float32 division would give 0 there; a bitcast is not
    flushed). ``n`` is the float64 quotient ``1 / v`` scaled by ``2**149`` (exact) and
    rounded half-even to an integer: the exact ``2**149 / v = 2**46 / D`` (``D`` the
    significand, < ``2**25``) is either an integer or at least ``1 / (2 D)`` away from a
    rounding midpoint, over ``2**-49`` relative, so the float64 rounding (``2**-53``
    relative) cannot move it across one (as ``div_rn_f64``'s argument; JAX versions
    without ``jax.enable_x64`` take ``recip_subnormal_integer``, integer long division:
    the same ``n``). This is the tensor decode scale ``1 / enc`` of a tensor with amax
    below ``2688 * 2**-126`` (~3.2e-35), where Transformer Engine's ``S_dec = 1.0f /
    S_enc`` (``core_nvfp4.cuh``, ``compute_scaling_coefficient``) is subnormal; consumers
    that multiply by it on the CPU use ``mul_decode_scale`` and
    ``recip_scaled_subnormal_rn``.

    Args:
      v: float32 array of positive values (zero, Inf, NaN: the backend's ``1 / v``).
    Returns:
      float32 array shaped like ``v``.
    """
    v = jnp.asarray(v, jnp.float32)
    vb = jax.lax.bitcast_convert_type(v, jnp.int32)
    field = (vb >> 23) & 0xFF
    big = (field >= 253) & (field < 255) & (vb > 0)  # (2**126, 2**128): subnormal 1/v
    if hasattr(jax, "enable_x64"):
        with jax.enable_x64(True):
            n = round_even(jax.lax.div(jnp.float64(2.0**149), v.astype(jnp.float64)))
            n = where(big, n, 0.0).astype(jnp.int32)  # n <= 2**23 where big
    else:
        n = recip_subnormal_integer(vb, field)
    sub = jax.lax.bitcast_convert_type(n, jnp.float32)  # n <= 2**23: 2**-126 at most
    return where(big, sub, div_rn(jnp.float32(1.0), v))


def recip_subnormal_integer(vb: jax.Array, field: jax.Array) -> jax.Array:
    """``reciprocal_rn``'s ``n = RNE(2**149 / v)`` (int32) for ``v`` in ``(2**126,
    2**128)`` (bits ``vb``, exponent field ``field``) by integer long division, for JAX
    versions without ``jax.enable_x64`` (and an independent check of the float64 path):
    ``2**149 / v = 2**46 / D`` with ``D`` the significand shifted by ``field - 253``, in
    ``[2**23, 2**25)``."""
    d = ((vb & 0x7FFFFF) | 0x800000) << clip(field - 253, 0, 1)
    r = jnp.full_like(d, 1 << 23)  # the numerator's leading bits: 2**23 (< 2 * D)
    bit = (r >= d).astype(jnp.int32)
    q = bit
    r = r - bit * d
    for _ in range(23):  # 23 more quotient bits: 2**23 * 2**23 = 2**46
        r = r << 1
        bit = (r >= d).astype(jnp.int32)
        q = (q << 1) | bit
        r = r - bit * d
    return q + ((2 * r > d) | ((2 * r == d) & ((q & 1) == 1))).astype(jnp.int32)


def subnormal_hi(v: jax.Array) -> jax.Array:
    """``v * 2**SUBNORMAL_SHIFT`` for a non-negative float32 ``v`` below ``2**-126``
    (a subnormal), exactly and as a normal float32, on every backend: read from the bits
    (``v = m * 2**-149``), so the CPU's flush of subnormal operands does not apply.
    Elsewhere it returns ``v`` times ``2**SUBNORMAL_SHIFT`` by float arithmetic."""
    v = jnp.asarray(v, jnp.float32)
    m = jax.lax.bitcast_convert_type(v, jnp.int32) & 0x7FFFFFFF
    tiny = (m < (1 << 23))
    from_bits = m.astype(jnp.float32) * jnp.float32(2.0 ** (SUBNORMAL_SHIFT - 149))
    return where(tiny, from_bits, v * jnp.float32(2.0**SUBNORMAL_SHIFT))


def recip_scaled_subnormal_rn(s: jax.Array, dec: jax.Array) -> jax.Array:
    """``min(RN(1 / RN(s * dec)), FLT_MAX)`` in float32 for a subnormal ``dec`` (below
    ``2**-126``, from ``reciprocal_rn``) and ``s >= 0`` on a grid of at most 7 mantissa
    bits, with IEEE subnormal arithmetic (no flush), bit-identical on every backend:
    Transformer Engine's element encode scale ``fminf(1.0f / (float(S_dec_block) *
    S_dec), FLT_MAX)`` (``core_nvfp4.cuh``, ``compute_scaling_coefficient<float>``) for a
    tensor whose decode scale ``S_dec`` is subnormal.

    Exact in float64: ``dec = m * 2**-149`` is read from its bits (the CPU's flush of
    subnormal operands does not apply) and ``x = s * dec`` (at most 8 + 23 significant
    bits) is exact. Where ``x`` is below ``2**-126`` the float32 product rounds to the
    subnormal quantum: ``p = RNE(x * 2**149) * 2**-149``; elsewhere it is the normal
    float32 ``f32(x)``. Then ``RN(1/p)`` is the float64 quotient rounded to float32, which
    is the correctly rounded one (``p`` has at most 24 significant bits: the double
    rounding is innocuous, as ``div_rn_f64``'s argument) and normal (``p < 2 * 2**-126
    * 2**126``: every scale grid stays below ``2**128``, so the quotient is above 1/2); a
    quotient beyond FLT_MAX rounds to Inf or FLT_MAX, hence FLT_MAX.
    ``s == 0`` gives ``1/0 = Inf``, hence FLT_MAX. NaN ``s`` gives NaN. JAX versions
    without ``jax.enable_x64`` take ``recip_scaled_subnormal_integer`` (the same bits
    from integer arithmetic).

    Args:
      s: float32 block scales (any shape), normal float32 or 0 or NaN.
      dec: float32 subnormal decode scale(s), broadcastable against ``s``.
    Returns:
      float32 element encode scales shaped like ``s * dec``.
    """
    s = jnp.asarray(s, jnp.float32)
    dec = jnp.asarray(dec, jnp.float32)
    s, dec = jnp.broadcast_arrays(s, dec)
    if not hasattr(jax, "enable_x64"):
        return recip_scaled_subnormal_integer(s, dec)
    m = jax.lax.bitcast_convert_type(dec, jnp.int32) & 0x7FFFFF
    f64 = jnp.float64
    with jax.enable_x64(True):
        x = s.astype(f64) * (m.astype(f64) * f64(2.0**-149))  # exact
        # (a negative s, never a scale, takes |x| where the product is subnormal and x
        # elsewhere, as the integer path does)
        ax = jnp.abs(x)
        p_sub = round_even(ax * f64(2.0**149)) * f64(2.0**-149)  # half to even
        # the normal float32 product RNE(x) in integer arithmetic on x's float64 bits
        # (52 -> 23 fraction bits, a carry moves into the exponent): not
        # ``x.astype(float32).astype(float64)``, a convert pair that XLA:GPU removes
        # under its default ``xla_allow_excess_precision`` (then 1 ulp off in some encode
        # scales on an H100: docs/performance.md)
        xb = jax.lax.bitcast_convert_type(x, jnp.int64)
        half = jnp.int64((1 << 28) - 1) + ((xb >> 29) & 1)
        p_norm = jax.lax.bitcast_convert_type((xb + half) & ~jnp.int64((1 << 29) - 1), f64)
        p = where(ax < f64(2.0**-126), p_sub, p_norm)
        e = jax.lax.div(f64(1.0), p).astype(jnp.float32)
    e = jnp.minimum(e, jnp.float32(FLT_MAX))
    return where(jnp.isnan(s), jnp.float32(jnp.nan), e)


def recip_scaled_subnormal_integer(s: jax.Array, dec: jax.Array) -> jax.Array:
    """``recip_scaled_subnormal_rn`` (broadcast float32 ``s``, ``dec``) in integer and
    float32 arithmetic, for JAX versions without ``jax.enable_x64`` (and an independent
    check of the float64 path): ``dec = m * 2**-149``
    and ``s = k * 2**a`` (``k`` its 8 leading significand bits), so ``s * dec = (k m) *
    2**(a - 149)`` with ``k m < 2**31``. Where that is below ``2**-126`` the product rounds
    to the subnormal quantum: ``n = RNE(k m * 2**a)`` by an integer shift; elsewhere it is
    a normal float32, and the float32 product ``s * (dec * 2**64)`` is the same rounding
    scaled by ``2**64``. The reciprocal of the scaled product ``p_hi`` is ``div_rn(1,
    p_hi)``, a normal float32, and ``RN(1/p) = 2**64 RN(1/p_hi)`` (overflowing to Inf
    exactly where ``RN(1/p)`` does)."""
    m = jax.lax.bitcast_convert_type(dec, jnp.int32) & 0x7FFFFF
    sb = jax.lax.bitcast_convert_type(s, jnp.int32) & 0x7FFFFFFF
    k = ((sb & 0x7FFFFF) | 0x800000) >> 16  # 8 leading significand bits (128..255)
    k = where(sb == 0, 0, k)
    a = ((sb >> 23) & 0xFF) - 127 - 7  # s = k * 2**a
    u32 = jnp.uint32
    prod = (k * m).astype(u32)  # < 2**31: exact
    # subnormal product iff k m 2**a < 2**23
    t = 23 - a
    sub = where(t >= 32, True, where(t <= 0, False, prod < jnp.left_shift(
        u32(1), clip(t, 1, 31).astype(u32))))
    sh = clip(-a, 1, 31).astype(u32)
    q = jnp.right_shift(prod, sh)
    rem = prod - jnp.left_shift(q, sh)
    half = jnp.left_shift(u32(1), sh - u32(1))
    q = q + ((rem > half) | ((rem == half) & ((q & u32(1)) == u32(1)))).astype(u32)
    n = where(a >= 0, jnp.left_shift(prod, clip(a, 0, 31).astype(u32)), q)
    n = where(-a > 31, u32(0), n)
    p_sub = n.astype(jnp.float32) * jnp.float32(2.0 ** (SUBNORMAL_SHIFT - 149))
    p_hi = where(sub, p_sub, s * subnormal_hi(dec))
    e = div_rn(jnp.float32(1.0), p_hi) * jnp.float32(2.0**SUBNORMAL_SHIFT)
    e = jnp.minimum(e, jnp.float32(FLT_MAX))
    return where(jnp.isnan(s), jnp.float32(jnp.nan), e)


def mul_decode_scale(v: jax.Array, dec: jax.Array) -> jax.Array:
    """``RN(v * dec)`` in float32 where the decode scale ``dec`` may be a float32 subnormal
    (``reciprocal_rn`` of an encode scale above ``2**126``): computed as ``(v * (dec *
    2**64)) * 2**-64`` from ``subnormal_hi``, so XLA on the CPU, which flushes subnormal
    operands to zero, still sees the scale. The same bits as IEEE ``v * dec`` wherever the
    product is a normal float32 (scaling by a power of two commutes with rounding there);
    a subnormal product may differ from it by the double rounding (and is flushed to zero
    on the CPU anyway). A normal ``dec`` gives ``v * dec`` itself."""
    v = jnp.asarray(v, jnp.float32)
    dec = jnp.asarray(dec, jnp.float32)
    tiny = dec < jnp.float32(2.0**-126)
    hi = (v * subnormal_hi(dec)) * jnp.float32(2.0**-SUBNORMAL_SHIFT)
    return where(tiny, hi, v * dec)



def recip_scaled_rn(s: jax.Array, dec: jax.Array) -> jax.Array:
    """``div_rn(1, s * dec)`` (float32 product, then the correctly rounded reciprocal) for
    ``s`` with at most 7 significant mantissa bits (every value of a scale grid) and a
    float32 scalar ``dec``, without a per-element division.

    Write ``dec = 2**D * d`` with ``|d|`` in [1, 2) and every such ``s != 0`` as
    ``+-2**E * (1 + j/128)``, ``j`` its top 7 mantissa bits (float32 subnormals of either
    are first scaled by 2**64, exactly). With ``P = f32((1 + j/128) * d)``
    (in [1, 4)) and ``T = RN(1/P)`` (in (1/4, 1]): wherever ``p = f32(s * dec)`` and the
    result are normal float32 numbers, ``p = 2**(E+D) * P`` and
    ``RN(1/p) = 2**-(E+D) * T`` (scaling by a power of two commutes with rounding in
    the normal range). So the 128 reciprocals ``T`` are computed once per tensor with
    ``div_rn`` and each element takes one table entry and an exponent subtraction.
    Everywhere else (``p`` or the result not normal; ``s`` zero, NaN or Inf) it returns
    the backend's ``1 / p``, which is exactly where ``div_rn_integer`` also falls back:
    the bits equal ``div_rn(1, s * dec)`` on every backend (``tests/core/test_quantize.py``
    checks every E4M3/E8M0 value and random grid values times decode scales over the
    whole float32 range, against NumPy and against ``div_rn_integer``).

    Why: it was written when ``div_rn`` on GPUs was ``div_rn_integer``, ~130 integer
    operations per element. Since ``div_rn`` divides in float64 there,
    ``quantization.element_encode_scale`` calls ``div_rn(1, s * dec)`` per block instead
    (the same bits, a quarter of the lowered ops); this function stays as an
    independent check of it (``tests/core/test_lean_numerics.py`` and the on-device
    check of docs/numerics.md).

    Args:
      s: float32 array (block scales, on a grid with <= 7 mantissa bits).
      dec: float32 scalar (tensor decode scale).
    Returns:
      float32 array shaped like ``s``.
    """
    s = jnp.asarray(s, jnp.float32)
    dec = jnp.asarray(dec, jnp.float32)
    i32 = jnp.int32

    def normalized(v):
        """``v = 2**shift * m`` with ``|m|`` in [1, 2) (sign kept in ``m``); float32
        subnormals are scaled by 2**64 first (exact). Returns (bits of m, shift, ok)."""
        tiny = jnp.abs(v) < jnp.float32(2.0**-126)
        vb = jax.lax.bitcast_convert_type(where(tiny, v * jnp.float32(2.0**64), v), i32)
        field = (vb >> 23) & 0xFF
        shift = field - 127 - where(tiny, 64, 0)
        mb = (vb & i32(-0x7F800001)) | (127 << 23)  # sign and mantissa, exponent of 1
        return mb, shift, (field > 0) & (field < 255)

    db, d_shift, d_ok = normalized(dec)
    d = jax.lax.bitcast_convert_type(db, jnp.float32)
    table_p = (1.0 + jnp.arange(128, dtype=jnp.float32) * jnp.float32(1.0 / 128)) * d
    table = div_rn(jnp.float32(1.0), table_p)  # (128,) correctly rounded 1/P
    sb, s_shift, s_ok = normalized(s)
    j = (sb >> 16) & 0x7F
    shift = s_shift + d_shift  # E + D
    tb = jax.lax.bitcast_convert_type(jnp.take(table, j, mode="clip"), i32)
    pb = jax.lax.bitcast_convert_type(jnp.take(table_p, j, mode="clip"), i32)

    def normal(field):
        return (field > 0) & (field < 255)

    ok = ((sb & 0xFFFF) == 0) & s_ok & d_ok
    ok = ok & normal(((pb >> 23) & 0xFF) + shift) & normal(((tb >> 23) & 0xFF) - shift)
    # the table holds 1/P with dec's sign; s's sign flips it
    fast = jax.lax.bitcast_convert_type((tb - (shift << 23)) ^ (sb & i32(-(2**31))),
                                        jnp.float32)
    return where(ok, fast, jnp.float32(1.0) / (s * dec))


def round_to_grid(v: jax.Array, grid: FloatGrid, mode: str = "nearest", *,
                  native: bool = False) -> jax.Array:
    """Round ``v >= 0`` (float32) onto an unsigned ``grid``, saturating to its max.

    Modes:
      * ``"nearest"``: round-to-nearest, ties to even (IEEE RNE), then
        ``min(., grid.max_value)``: the ``satfinite`` conversions of Transformer
        Engine (``cvt.rn.satfinite.e2m1x2.f32`` for elements, the E4M3 scale
        cast in ``core_nvfp4.cuh``).
      * ``"up"``: round toward +inf (the NVFP4 paper's MXFP4 scale rule,
        Appendix B.4: "we typically round decode scale factors up").
      * ``"down"``: round toward zero.

    The value is multiplied by its binade's inverse quantum (a power of two: exact), the
    integer part is rounded, and multiplied back (exact). Formats without zero
    (``man_bits == 0``) map values below their minimum to the minimum.
    NaN stays NaN (quieted: its bits with the quiet bit set); ``+inf`` saturates to
    ``max_value``.

    With ``native=True``, ``"nearest"`` onto E2M1 and E4M3 (``NATIVE_RNE``) is computed on
    the CPU as XLA's own conversion of ``min(v, max_value)`` to ``float4_e2m1fn`` /
    ``float8_e4m3fn`` and back: IEEE RNE onto those grids, subnormals included, so the
    same values as the arithmetic above for every ``v >= 0``, ``+inf`` and NaN, in ~8
    operations instead of ~30 (``tests/core/test_lean_numerics.py`` compares the two on
    every float32 boundary and random bit patterns; XLA:CPU was run over all 2**31
    non-negative float32 bit patterns; the on-device check of docs/numerics.md runs the
    same on a GPU). Off by default: XLA:CPU compiles the conversions no faster than the
    arithmetic they replace (docs/performance.md). Negative ``v`` (outside the
    contract) may differ: below ``-max_value`` the arithmetic does not saturate.

    Args:
      v: float32 array of non-negative values (callers take ``abs`` first).
      grid: target grid.
      mode: ``"nearest"``, ``"up"`` or ``"down"``.
      native: ``"nearest"`` onto a ``NATIVE_RNE`` grid by XLA's conversion on the CPU
        (the same values; see above).
    Returns:
      float32 array, same shape, every finite entry on ``grid``.
    """
    v = v.astype(jnp.float32)
    if mode == "up" and grid.man_bits == 0:
        return _pow2_round_up(v, grid)
    if mode == "nearest" and native and grid in NATIVE_RNE:
        return jax.lax.platform_dependent(
            v, cpu=functools.partial(_native_rne, grid=grid),
            default=functools.partial(_arithmetic_round, grid=grid, mode=mode))
    return _arithmetic_round(v, grid, mode)


def _native_rne(v: jax.Array, grid: FloatGrid) -> jax.Array:
    """``round_to_grid(v, grid, "nearest")`` for E2M1/E4M3 as XLA's conversion of ``min(v,
    max_value)`` to the ``NATIVE_RNE`` dtype and back (NaN quieted as the arithmetic
    quiets it). Used on the CPU only, where it was checked on all 2**31 non-negative float32
    bit patterns; on GPUs ``_arithmetic_round`` runs until the on-device check of
    docs/numerics.md has passed there (XLA's GPU conversions to
    these dtypes are other code: PTX ``cvt`` or its own emitter). The check holds for
    XLA:CPU's default (fusion) emitters: with ``--xla_cpu_use_fusion_emitters=false`` (JAX
    0.10.2) the E2M1 conversion rounds twice, so values within a few ulps of a midpoint go
    the wrong way (0.25000003 -> 0, 0.7499999 -> 1; 22 of the test's 131,200 inputs,
    2026-11-27), which ``tests/core/test_lean_numerics.py`` catches."""
    r = jnp.minimum(v, jnp.float32(grid.max_value)).astype(NATIVE_RNE[grid])
    bits = jax.lax.bitcast_convert_type(v, jnp.int32)
    quiet = jax.lax.bitcast_convert_type(bits | 0x400000, jnp.float32)
    return where(v != v, quiet, r.astype(jnp.float32))


def _arithmetic_round(v: jax.Array, grid: FloatGrid, mode: str) -> jax.Array:
    """``round_to_grid`` by the quantum arithmetic (its docstring), any grid and mode."""
    q, inv_q = _quantum(v, grid)
    t = v * inv_q
    if mode == "nearest":
        r = round_even(t)  # half to even
    elif mode == "up":
        r = jnp.ceil(t)
    elif mode == "down":
        r = jnp.floor(t)
    else:
        raise ValueError(f"unknown rounding mode {mode!r}; use 'nearest', 'up' or 'down'")
    out = jnp.minimum(r * q, grid.max_value)
    if not grid.has_zero:
        out = jnp.maximum(out, grid.min_value)
    return out


def _pow2_round_up(v: jax.Array, grid: FloatGrid) -> jax.Array:
    """``round_to_grid(v, grid, "up")`` for a power-of-two grid (``man_bits == 0``: E8M0,
    the MX scales), from the float32 bits: adding ``0x7FFFFF`` carries into the exponent
    unless the significand is already 1.0, and clearing the mantissa leaves ``2**ceil(log2
    v)`` (a subnormal or zero ``v`` gives ``2**-126``, ``+inf`` and values above the top
    binade give ``2**128``); then the clamp to ``[min_value, max_value]``. The same values
    as the quantum arithmetic of ``round_to_grid`` (NaN stays NaN), in integer and
    compare/select operations only, so the Pallas kernels run this very function on
    register arrays (``pallas_kernels/quantize/common_sm90.mx_word_scales``)."""
    bits = jax.lax.bitcast_convert_type(v, jnp.int32)
    up = jax.lax.bitcast_convert_type((bits + 0x7FFFFF) & 0x7F800000, jnp.float32)
    out = jnp.minimum(jnp.maximum(up, grid.min_value), grid.max_value)
    return where(v != v, v, out)  # NaN in, NaN out (its bits + 0x7FFFFF would wrap)


def uniform_from_key(key: jax.Array, shape: tuple[int, ...],
                     offset: jax.Array | None = None) -> jax.Array:
    """Uniform float32 in (0, 1) on the midpoint lattice ``(b + 1/2) * 2**-8``, 8 random
    bits per element, eight elements (four rows x two columns) per 64-bit draw.

    Rule: view ``shape`` as a matrix (N, K) in its stored order, ``K = shape[-1]``, ``N =
    prod(shape[:-1])`` (callers pass the tensor being quantized as it is laid out, padded
    along the blocked axis, whichever axis that is; ``fp4jax.quantize`` then moves the
    uniforms along with the data). Draw ``d = (n // 4) * ceil(K/2) + k // 2`` is the
    Threefry-2x32 block (20 rounds) of the key words ``(k1, k2)`` on the counter ``(0,
    d)``: two words ``(y0, y1)`` (``draws_from_key``). Element (n, k) takes byte ``2 * (n %
    2) + (k % 2)`` (byte 0 = bits 0..7) of word ``y0`` if ``n % 4 < 2`` else ``y1``: rows
    4m..4m+3 and columns 2j, 2j+1 share one draw. In the Hopper kernels
    (``pallas_kernels/quantize/operand_sm90.py``) a bf16 word holds two neighbouring
    columns and each row is its own register array, both for the 1x16 blocks along rows
    and the 16x1 blocks along columns, so one draw serves the same word of four rows and a
    kernel makes one Threefry draw per eight elements with elementwise code only.

    ``(y0, y1)`` is what ``jax.random.bits(key, (D,), jnp.uint64)`` gives draw ``d`` as its
    high and low words (with ``jax_enable_x64`` and ``jax_threefry_partitionable``);
    computed here from the key words, so the stream does not depend on either flag. Keys
    of other implementations (``rbg``, ...) take ``jax.random.bits(key, (D, 2),
    jnp.uint32)`` rows as ``(y0, y1)``. ``D < 2**32`` (N * K < 2**34) is required.

    ``offset`` (uint32 scalar, threefry keys only) starts the draws at ``d = offset``:
    the uniforms of a block of rows of a larger tensor, ``row_shard_draw_offset``.

    Why 8 bits: it is the random-bit budget of Transformer Engine's NVFP4 stochastic
    rounding on Blackwell, which feeds one 32-bit ``rbits`` word to each
    ``cvt.rs.satfinite.e2m1x4.f32`` (four values; TE ``common/util/ptx.cuh``, PTX ISA
    ``cvt``), and generating the bits (20 Threefry rounds per draw) is what bounds the
    stochastic-rounding kernels on Hopper: using both 32-bit outputs of each Threefry
    block halves that work. With ``u`` on the midpoint lattice,
    ``stochastic_round_to_grid`` rounds up with probability ``round(frac * 256) / 256``
    (``frac`` the position between the two neighbours; exact ties at ``(b + 1/2) / 256``
    round down), so the rounding's bias is two-sided and at most ``2**-9`` of a grid step,
    exact grid values (``frac = 0``) never move, and ``frac > 511/512`` always rounds up.
    """
    shape = tuple(int(d) for d in shape)
    k = shape[-1] if shape else 1
    n = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    nq, kh = -(-n // 4), -(-k // 2)
    y0, y1 = draws_from_key(key, nq * kh, offset)
    words = jnp.stack([y0.reshape(nq, kh), y1.reshape(nq, kh)], axis=1)  # (nq, 2, kh)
    shift = (8 * (2 * jnp.arange(2, dtype=jnp.uint32)[:, None]
                  + jnp.arange(2, dtype=jnp.uint32)[None, :]))  # [n % 2, k % 2]
    b = (words[:, :, None, :, None] >> shift[None, None, :, None, :]) & 0xFF
    b = b.reshape(4 * nq, 2 * kh)[:n, :k]  # row 4m + 2 * word + n % 2
    u = (b.astype(jnp.float32) * 2 + 1) * jnp.float32(2.0**-9)
    return u.reshape(shape)


def uniform_rows(key_words: jax.Array, rows: jax.Array, ncols: int) -> jax.Array:
    """Rows of ``uniform_from_key``'s uniforms, each from its own key: row ``i`` of the result
    is row ``rows[i]`` of ``uniform_from_key(key_i, shape)`` for any ``shape`` whose last
    axis is ``ncols`` (the stored order's column count; the row count does not enter the
    rule), ``key_i`` the threefry key with key words ``key_words[i]``.

    The same rule, evaluated per row: element ``(n, k)`` takes draw ``d = (n // 4) *
    ceil(ncols/2) + k // 2`` of its key, byte ``2 * (n % 2) + (k % 2)`` of word ``y0`` if
    ``n % 4 < 2`` else ``y1``, ``u = (b + 1/2) * 2**-8``. Used where the rows of one array
    belong to different tensors, each drawn from the start of its own stream: the experts
    of a grouped GEMM (``fp4jax.ragged_dot``: expert ``g``'s rows are its tensor's rows
    ``0 .. m_g - 1``). Each row makes its own draws (four rows share one draw in
    ``uniform_from_key``): four times the Threefry work per element.

    Args:
      key_words: uint32 ``(R, 2)``, threefry key words (``jax.random.key_data``).
      rows: int ``(R,)``, each row's index in its own tensor (``n`` above, >= 0).
      ncols: the column count K of the stored order.
    Returns:
      float32 ``(R, ncols)``.
    """
    kw = jnp.asarray(key_words).astype(jnp.uint32)
    n = jnp.asarray(rows).astype(jnp.uint32)
    kh = -(-int(ncols) // 2)
    d = (n // 4)[:, None] * jnp.uint32(kh) + jnp.arange(kh, dtype=jnp.uint32)[None, :]
    y0, y1 = _threefry_draws(kw[:, 0:1], kw[:, 1:2], d)
    word = where((n % 4 < 2)[:, None], y0, y1)  # (R, kh)
    shift = 8 * (2 * (n % 2)[:, None] + jnp.arange(2, dtype=jnp.uint32)[None, :])  # (R, 2)
    b = (word[:, :, None] >> shift[:, None, :]) & 0xFF  # (R, kh, 2): column 2j + k % 2
    b = b.reshape(n.shape[0], 2 * kh)[:, :ncols]
    return (b.astype(jnp.float32) * 2 + 1) * jnp.float32(2.0**-9)


def draws_from_key(key: jax.Array, count: int, offset: jax.Array | None = None
                   ) -> tuple[jax.Array, jax.Array]:
    """The 64-bit draws ``0 .. count-1`` of ``uniform_from_key`` as two uint32 arrays
    ``(y0, y1)`` of shape (count,): ``threefry2x32(k1, k2, 0, d)`` for a threefry key
    (typed or raw) with key words ``(k1, k2)``, else ``jax.random.bits(key, (count, 2),
    uint32)`` split into its columns. With ``offset`` (a uint32 scalar, threefry keys
    only) the draws ``offset .. offset+count-1`` (counters wrap modulo 2**32)."""
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)  # raw uint32 key: the default implementation
    if count >= 2**32:
        raise ValueError(f"stochastic rounding of {count} draws (>= 2**32): quantize a "
                         "tensor of fewer than 2**34 elements per call")
    if "threefry" in str(jax.random.key_impl(key)).lower():
        k1, k2 = jax.random.key_data(key).reshape(2)
        d = jnp.arange(count, dtype=jnp.uint32)
        if offset is not None:
            d = d + jnp.asarray(offset).astype(jnp.uint32)
        return _threefry_draws(k1, k2, d)
    if offset is not None:
        raise ValueError(
            f"stochastic rounding of a shard (data-parallel fp4jax.dot) draws its bits by "
            f"position and needs a threefry key, got {jax.random.key_impl(key)}: make the "
            "key with jax.random.key(seed) (the default implementation)")
    bits = jax.random.bits(key, (count, 2), jnp.uint32)
    return bits[:, 0], bits[:, 1]


def _threefry_draws(k1: jax.Array, k2: jax.Array, d: jax.Array
                    ) -> tuple[jax.Array, jax.Array]:
    """``threefry2x32(k1, k2, 0, d)`` (uint32 key words, uint32 counters ``d``): off the
    CPU through JAX's own Threefry primitive (``jax.extend.random.threefry2x32_p``, the one
    ``jax.random`` draws with), which on CUDA under ``jax_threefry_gpu_kernel_lowering``
    (``fp4jax-train --threefry kernel``, its default) is one kernel instead of ~110
    unrolled operations fused into every stochastically rounded operand; on the CPU the
    Python transcription ``threefry2x32`` (JAX lowers the primitive there as a loop over
    its five 4-round groups, whose while-loop computations added 16 fusions to compile to
    one NVFP4 ``fp4jax.dot``; unrolled, XLA fuses it into its consumer). The same 20
    rounds, hence the same bits either way (``tests/core/test_lean_numerics.py``; on a GPU
    the on-device check of docs/numerics.md, under both lowerings). The Pallas kernels
    keep calling ``threefry2x32`` on register arrays."""
    def transcription(k1, k2, d):
        return threefry2x32(k1, k2, jnp.zeros_like(d), d)

    def primitive(k1, k2, d):
        return threefry2x32_primitive(k1, k2, jnp.zeros_like(d), d)

    return jax.lax.platform_dependent(k1, k2, d, cpu=transcription, default=primitive)


def threefry2x32_primitive(k1, k2, x0, x1) -> tuple[jax.Array, jax.Array]:
    """``threefry2x32(k1, k2, x0, x1)`` through JAX's Threefry primitive
    (``jax.extend.random.threefry2x32_p``): the same bits, its operands cast to uint32 and
    broadcast to one shape, lowered by JAX (a rolled loop on the CPU; on CUDA one kernel
    under ``jax_threefry_gpu_kernel_lowering``, else JAX's unrolled rounds in an outlined
    function). Falls back to ``threefry2x32`` where ``jax.extend.random`` does not export
    the primitive."""
    try:
        from jax.extend.random import threefry2x32_p
    except ImportError:  # pragma: no cover
        return threefry2x32(k1, k2, x0, x1)
    u32 = jnp.uint32
    args = jnp.broadcast_arrays(*(jnp.asarray(a).astype(u32) for a in (k1, k2, x0, x1)))
    y0, y1 = threefry2x32_p.bind(*args)
    return y0, y1


def row_shard_draw_offset(shape: tuple[int, ...], index: jax.Array,
                          n_shards: int | None = None) -> jax.Array:
    """The first draw (uint32 scalar) of shard ``index`` when a tensor is split into equal
    blocks of rows, each of ``shape`` (its local shape, laid out and padded as
    ``uniform_from_key`` is called on it), so that shard ``i``'s
    ``uniform_from_key(key, shape, offset)`` are rows ``i * N .. (i+1) * N - 1`` of the
    whole tensor's uniforms (``N = prod(shape[:-1])``).

    Rule: ``uniform_from_key``'s draw of row ``n`` is ``(n // 4) * ceil(K/2) + k // 2``, so
    shard ``i`` starts at ``i * (N / 4) * ceil(K/2)``; ``N % 4 == 0`` is required (rows
    4m .. 4m+3 share a draw). Used by data-parallel ``fp4jax.dot`` (``fp4jax.sharding``),
    where activations and gradients are split along their token rows. With ``n_shards``
    (the number of shards) the whole tensor's draws are checked to number fewer than
    ``2**32``, as ``draws_from_key`` checks one tensor's (else the counters would wrap)."""
    shape = tuple(int(d) for d in shape)
    n = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    if n % 4:
        raise ValueError(f"a row shard of shape {shape} has {n} rows: stochastic rounding "
                         "of a shard needs a multiple of 4 rows per device")
    per = (n // 4) * (-(-(shape[-1] if shape else 1) // 2))
    if n_shards is not None and n_shards * per >= 2**32:
        raise ValueError(f"stochastic rounding of {n_shards} row shards of shape {shape} "
                         f"({n_shards * per} draws >= 2**32): quantize a tensor of fewer "
                         "than 2**34 elements per call")
    return jnp.asarray(index).astype(jnp.uint32) * jnp.uint32(per % 2**32)


_THREEFRY_ROT = ((13, 15, 26, 6), (17, 29, 16, 24))


def _rotl32(v: jax.Array, r: int) -> jax.Array:
    dt = jnp.result_type(v)
    return jax.lax.shift_left(v, jnp.asarray(r, dt)) | jax.lax.shift_right_logical(
        v, jnp.asarray(32 - r, dt))


def threefry2x32(k1, k2, x0, x1):
    """The Threefry-2x32 block cipher with 20 rounds (Salmon et al., SC'11), as
    ``jax._src.random.threefry2x32`` (``_threefry2x32_lowering``) computes it.

    Pure 32-bit integer adds, rotations and xors, elementwise over broadcastable
    arrays; works on ``uint32`` or ``int32`` (two's-complement wrap-around gives the same
    bits), so the Pallas kernels run this very function on register arrays.

    Args:
      k1, k2: the two key words. x0, x1: the two counter words.
    Returns:
      the two output words ``(y0, y1)``.
    """
    ks = (k1, k2, k1 ^ k2 ^ jnp.asarray(0x1BD11BDA, jnp.result_type(k1)))
    x0 = x0 + ks[0]
    x1 = x1 + ks[1]
    for i in range(5):
        for r in _THREEFRY_ROT[i % 2]:
            x0 = x0 + x1
            x1 = _rotl32(x1, r)
            x1 = x0 ^ x1
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + (i + 1)
    return x0, x1


def threefry_bits_at(k1, k2, index):
    """The 32 random bits that ``jax.random.bits(key, shape, jnp.uint32)`` gives the
    element of row-major linear index ``index`` (< 2**32), for a threefry key with key
    words ``(k1, k2) = jax.random.key_data(key)``, under ``jax_threefry_partitionable``.

    Rule (``jax._src.random.threefry2x32._threefry_random_bits_partitionable``): the
    counter is the 64-bit linear index split into (high, low) words, and the bits are
    the xor of the two Threefry outputs. ``index`` is the low word (the high word is 0).
    """
    zero = index - index
    y0, y1 = threefry2x32(k1, k2, zero, index)
    return y0 ^ y1


def stochastic_round_to_grid(v: jax.Array, grid: FloatGrid, u: jax.Array) -> jax.Array:
    """Unbiased stochastic rounding of ``v >= 0`` onto ``grid``.

    With ``lo <= v <= hi`` the two neighbouring grid values, returns ``hi`` with
    probability ``(v - lo) / (hi - lo)`` and ``lo`` otherwise, so
    ``E[result] = v`` for every ``v`` inside the grid's range (values above
    ``max_value`` saturate, as in Transformer Engine's ``cvt.rs.satfinite``).
    The fractional position ``t - floor(t)`` is computed exactly and compared
    with ``u`` (uniform on the lattice ``(b + 1/2) / 256``, see ``uniform_from_key``), so
    the only bias is at most ``2**-9`` of one grid step, in either direction. Exact grid
    values are returned unchanged.

    Reference: FP4 All the Way (Chmiel et al., 2025), section 3 (SR definition);
    NVFP4 paper section 4.3.

    Args:
      v: float32 array of non-negative values.
      grid: target grid.
      u: float32 uniforms in (0, 1), same shape as ``v`` (``uniform_from_key``: the
        midpoint lattice ``(b + 1/2) / 256``; any uniforms work for the rule itself).
    """
    v = v.astype(jnp.float32)
    q, inv_q = _quantum(v, grid)
    t = v * inv_q
    lo = jnp.floor(t)
    frac = t - lo
    r = lo + (u < frac).astype(jnp.float32)
    out = jnp.minimum(r * q, grid.max_value)
    if not grid.has_zero:
        out = jnp.maximum(out, grid.min_value)
    return out
