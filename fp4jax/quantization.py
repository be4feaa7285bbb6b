"""Quantize / dequantize tensors to block-scaled formats (the XLA reference backend): FP4
(NVFP4, MXFP4), and the OCP MX FP6/FP8 element types of ``BlockFormat``.

The scale formulas live in ``global_encode_scale``, ``block_decode_scale`` and
``element_encode_scale``, each citing its source; Transformer Engine's 4over6 adaptive
block scaling lives in ``four_over_six``, Quartet II's MS-EDEN rounding in ``ms_eden``; the
element rounding lives in ``fp4jax.numerics``. This module only arranges blocks.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax import numerics
from fp4jax.formats import NVFP4, BlockFormat, get_format

__all__ = [
    "QuantizedArray",
    "quantize",
    "dequantize",
    "global_encode_scale",
    "block_decode_scale",
    "element_encode_scale",
    "four_over_six",
    "ms_eden",
    "row_amax",
    "BLOCK_SCALE_RULES",
    "oas_block_scale",
    "ROUNDINGS",
    "FOUR_OVER_SIX_VARIANTS",
    "pack_e2m1",
    "unpack_e2m1",
    "E2M1_VALUES",
]

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
"""Magnitudes of the eight non-negative E2M1 codes 0b0000 .. 0b0111."""

_F4 = jnp.float4_e2m1fn
ROUNDINGS = ("nearest", "stochastic", "ms_eden")
"""Element rounding modes: round-to-nearest-even, stochastic rounding (unbiased per element,
``numerics.stochastic_round_to_grid``) and Quartet II's MS-EDEN (``ms_eden``: RNE elements,
a per-group EDEN correction of the block scales, stochastically rounded scales)."""
_ROUNDINGS = ROUNDINGS

FOUR_OVER_SIX_VARIANTS: dict[str, tuple[str, int]] = {
    "4over6": ("mae", 256),
    "4over6-mse": ("mse", 256),
    "4over6-448": ("mae", 448),
    "4over6-mse-448": ("mse", 448),
}
"""The 4over6 block scale rules: ``(error metric, E4M3 bound of the tensor scale)`` each.
``"4over6"`` is Transformer Engine's default configuration (``NVFP4BlockScaling``:
``nvfp4_4over6_err_mode="MAE"``, ``nvfp4_4over6_e4m3_use_256="all"``); the others are
its ``MSE`` metric and its 448 bound (``nvfp4_4over6_e4m3_use_256="none"``)."""

BLOCK_SCALE_RULES = ("max", *FOUR_OVER_SIX_VARIANTS)
"""How a block's decode scale is chosen: ``"max"`` (the block amax maps to the element
maximum, 6 for E2M1: NVFP4 paper Appendix B.2) or a 4over6 rule (``four_over_six``)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """A block-scaled tensor (a pytree; ``fmt``, ``axis``, ``block_2d`` are static).

    Attributes:
      data: the elements in ``fmt.data_dtype`` (``float4_e2m1fn`` for E2M1, ``float8_e4m3fn``
        for E4M3 and the FP6 types, ``float8_e5m2`` for E5M2), the logical (unpacked)
        shape of the source tensor.
      scale: block decode scales in ``fmt.scale_dtype``. 1D: ``data.shape`` with
        ``axis`` of length ``ceil(n / block)``. 2D: ``(..., ceil(R/b), ceil(C/b))``
        over the last two axes. A block holding NaN/Inf has a NaN scale.
      global_scale: float32 decode scale (``1/enc``; 1.0 without a tensor scale): a scalar,
        or for a row-scaled tensor (``quantize(..., row_scaled=True)``) one per row, shaped
        like ``data`` with the blocked axis of length 1.
      fmt: the ``BlockFormat``.
      axis: the blocked axis for 1D scaling, counted from the end (negative, so that a
        ``QuantizedArray`` batched by ``vmap``/``scan`` still names the right axis);
        ``None`` for 2D.
      block_2d: whether scales are per ``b x b`` tile over the last two axes.

    The represented value of element ``i`` is ``(data[i] * scale[block(i)]) * global_scale``
    (``global_scale[row(i)]`` when row-scaled).
    """

    data: jax.Array
    scale: jax.Array
    global_scale: jax.Array
    fmt: BlockFormat = dataclasses.field(metadata=dict(static=True))
    axis: int | None = dataclasses.field(metadata=dict(static=True))
    block_2d: bool = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def ndim(self) -> int:
        return len(self.data.shape)

    def dequantize(self, dtype: Any = jnp.float32) -> jax.Array:
        return dequantize(self, dtype)

    def nbytes_packed(self) -> int:
        """Bytes in packed storage: ``fmt.elem_bits`` bits an element (4, 6 or 8, rounded up
        to whole bytes), the scales (their storage dtype), the tensor scale(s) (4 each: one,
        or one per row when row-scaled)."""
        n = int(np.prod(self.shape))
        return (n * self.fmt.elem_bits + 7) // 8 + int(np.prod(self.scale.shape)) * jnp.dtype(
            self.scale.dtype
        ).itemsize + 4 * int(np.prod(jnp.shape(self.global_scale)))


# ---------------------------------------------------------------------------
# The scale rules (one function each).
# ---------------------------------------------------------------------------


def global_encode_scale(amax: jax.Array, fmt: BlockFormat,
                        target: float | None = None) -> jax.Array:
    """Per-tensor FP32 encode scale ``enc`` (NVFP4 paper Appendix B.1, Eq. 1).

    ``enc = (target * elem_max) / amax`` in float32, clamped to FLT_MAX, and 1.0 when
    ``amax == 0`` or the result is 0; exactly Transformer Engine's
    ``compute_global_encode_scaling_factor_FP4`` (``core_nvfp4.cuh``: ``fminf(fp8_max *
    fp4_max / global_amax, FLT_MAX)``, 1 when ``global_amax == 0`` or the scale is 0;
    TE's ``reference_nvfp4.py`` clamps to ``torch.finfo(torch.float32).max`` the same way)
    with ``target = 448`` and ``elem_max = 6`` for NVFP4 (``BlockFormat.tensor_scale_target``:
    the scale format's max, capped for very wide formats; ``BlockFormat.elem_max``: the
    element format's max, Eq. 1's ``M_FP4``, for other element types the same rule).
    Formats without a tensor scale return 1.0.

    Tiny tensors (amax below ``2688 * 2**-126``, ~3.2e-35): ``enc`` exceeds ``2**126``
    and the decode scale ``1/enc`` is a float32 subnormal, as in TE.
    ``numerics.reciprocal_rn`` computes it exactly on every backend (XLA on the CPU flushes
    subnormal results of arithmetic to zero), ``element_encode_scale`` and ``dequantize``
    multiply by it without a flush (``numerics.recip_scaled_subnormal_rn``,
    ``numerics.mul_decode_scale``). (Before 2026-12 fp4jax clamped ``enc`` to ``2**126``
    instead, so such tensors got block scales 1/4 of TE's.)
    The decode scale stored in ``QuantizedArray.global_scale`` is ``1/enc``.

    Row-scaled NVFP4 (``quantize(..., row_scaled=True)``): the same formula applied to each
    row's amax (``row_amax``), one FP32 scale per row of the blocked axis instead of one per
    tensor: Transformer Engine's ``row_scaled_nvfp4`` (PR #2931, TE commit ``c74e5aa3``;
    read at ``d0067d0d``: ``quantize_transpose_nvfp4.cuh`` l. 711-733,
    ``S_enc_rowwise_block = compute_global_encode_scaling_factor_FP4(amax_rowwise_ptr[row])``,
    and ``pytorch/custom_recipes/reference_nvfp4.py`` l. 704-724, ``global_amax`` of shape
    ``(m, 1, 1)``). ``amax`` is then an array and the result has its shape.

    Args:
      amax: float32 scalar, max |x| over the finite entries of the tensor (or an array of
        row amaxes: elementwise).
      target: the block-scale value the tensor amax maps to, instead of
        ``fmt.tensor_scale_target`` (4over6 maps it to 256: ``four_over_six``).
    """
    if not fmt.tensor_scale:
        return jnp.float32(1.0)
    target = fmt.tensor_scale_target if target is None else float(target)
    amax = amax.astype(jnp.float32)
    enc = numerics.div_rn(jnp.float32(target * fmt.elem_max), amax)
    enc = jnp.minimum(enc, jnp.float32(numerics.FLT_MAX))
    return numerics.where((amax == 0) | (enc == 0), jnp.float32(1.0), enc)


def block_decode_scale(amax_block: jax.Array, enc: jax.Array, fmt: BlockFormat) -> jax.Array:
    """Block decode scale on the format's scale grid (NVFP4 paper Appendix B.2, Eq. 2-3).

    With ``M = fmt.elem_max`` (6 for E2M1) and ``1/M`` the float32 constant:

    * ``"nearest"`` (NVFP4): ``s = rne_satfinite(amax_block * (enc * (1/M)))``, the
      float32 product in that order, as Transformer Engine's ``core_nvfp4.cuh``.
    * ``"up"`` (the paper's MXFP4, Appendix B.4): the same value rounded up onto
      the scale grid, so the block amax never saturates (it lands at most on ``M``, up to
      the float32 rounding of the scale arithmetic, which rounds back to ``M``). Without
      a tensor scale (``enc = 1``) and with E8M0 scales this is Transformer Engine's MXFP8
      scale, ``float_to_e8m0(amax * max_norm_rcp)`` rounded toward +inf
      (``quantize_mxfp8.cuh``).
    * ``"ocp"`` (OCP MX v1.0 sec. 6.3): ``2**(floor(log2(amax_block * enc)) - emax)``,
      ``emax = floor(log2 M)`` the element format's largest exponent (2 for E2M1 and
      E2M3, 4 for E3M2, 8 for E4M3, 15 for E5M2), clamped to the scale range.
    * ``"oas"`` (Overflow-Aware Scaling, MXFP4): ``oas_block_scale(amax_block * enc)``.

    A block with a non-finite amax gets a NaN scale, so it dequantizes to NaN.

    For power-of-two scale formats (E8M0: MXFP4, MXFP4_OCP) every operation here (and in
    ``numerics.round_to_grid``'s ``"up"`` path for them) is integer or compare/select
    arithmetic that Mosaic GPU lowers: the Hopper MX quantize kernels call this very
    function on register arrays (``pallas_kernels/quantize/common_sm90.mx_word_scales``).

    Args:
      amax_block: float32 block amaxes (any shape).
      enc: float32 scalar from ``global_encode_scale``.
    Returns:
      float32 array of scale values, exactly on ``fmt.scale_grid`` (or NaN).
    """
    grid = fmt.scale_grid
    amax_block = amax_block.astype(jnp.float32)
    if fmt.scale_rule == "oas":
        s = oas_block_scale(amax_block * enc, fmt)
    elif fmt.scale_rule == "ocp":
        w = amax_block * enc
        e = numerics.clip(numerics.floor_log2(w) - fmt.elem_grid.max_exp, grid.min_exp,
                          grid.max_exp)
        s = numerics.pow2(e)
    else:
        v = amax_block * (enc * jnp.float32(1.0 / fmt.elem_max))
        s = numerics.round_to_grid(v, grid, fmt.scale_rule)
    # |amax| < inf: isfinite, in compares the Pallas kernels lower (they call this function)
    return numerics.where(jnp.abs(amax_block) < jnp.inf, s, jnp.float32(jnp.nan))


def oas_block_scale(w: jax.Array, fmt: BlockFormat) -> jax.Array:
    """Overflow-Aware Scaling (OAS) of a power-of-two block scale, for E2M1 elements: the
    rule of ``BlockFormat.scale_rule="oas"`` (``fp4jax.MXFP4_OAS``).

    Sources: "Unveiling the Potential of Quantization with MXFP4: Strategies for
    Quantization Error Reduction" (arXiv 2603.08713, Overflow-Aware Scaling, which "reduces
    overall errors by increasing effective dynamic range under power-of-two block
    scaling"), as google/qwix implements it (commit 901efed, ``qwix/_src/core/qarray.py``
    ``compute_scale_zero_point``: ``scale = absmax / 6``, times ``c = 12/7``, "Bias = 0.5 -
    log2(7/6). C = 2**(bias + 0.5) = 12 / 7", then the exponent of the result kept, its
    mantissa dropped; qwix's test: block amax 6.5 gives scale 1, 7.5 gives 2). Only the
    paper's abstract and qwix's code could be read here.

    Rule: ``s = 2**floor(log2(w * c / 6))`` with ``c = 12/7``, i.e. ``2**floor(log2(w /
    3.5))``, ``w`` the block amax (times the tensor encode scale, 1 for MXFP4): the
    smallest power of two with ``w / s < 7``, 7 being the midpoint between E2M1's max 6
    and the next value of its binade, 8. So the block amax maps into [3.5, 7): below 6 it
    is on the grid's range, in [6, 7) it saturates to 6, which round-to-nearest would give
    it anyway (the OCP rule maps it into [4, 8), saturating [6, 8); the NVIDIA paper's
    round-up rule into (3, 6], never saturating but using a coarser scale for amaxes
    whose significand is in (1.5, 1.75)). Exact: with ``w = 2**e * m``, ``m`` in [1, 2),
    the exponent is ``e - 1`` when ``m >= 1.75`` and ``e - 2`` otherwise, read from the
    float32 bits (the significand's top two fraction bits both set); then clamped to the
    scale grid ([2**-126, 2**127] for E8M0; a zero or subnormal ``w`` gets 2**-126).
    Difference from qwix: qwix rounds ``(amax / 6) * c`` to bfloat16 first, so an amax
    within about 2**-9 (relative) below ``7 * 2**k`` gets the next scale there.

    Args:
      w: float32 block amaxes times the tensor encode scale (finite; a NaN/Inf block's
        scale is set by ``block_decode_scale``).
      fmt: the format (E2M1 elements, ExM0 scale: checked by ``BlockFormat``).
    Returns:
      float32 powers of two on ``fmt.scale_grid``.
    """
    grid = fmt.scale_grid
    bits = jax.lax.bitcast_convert_type(w.astype(jnp.float32), jnp.int32)
    e = numerics.floor_log2(w) - 2 + ((bits & 0x600000) == 0x600000).astype(jnp.int32)
    return numerics.pow2(numerics.clip(e, grid.min_exp, grid.max_exp))


def element_encode_scale(s: jax.Array, dec: jax.Array) -> jax.Array:
    """Per-block element encode scale (NVFP4 paper Appendix B.2-B.3, Eq. 4).

    ``min(1 / (f32(s) * dec), FLT_MAX)``: Transformer Engine's
    ``compute_scaling_coefficient<float>`` (``core_nvfp4.cuh``: ``S_dec = 1.0f / S_enc;
    fminf(1.0f / (static_cast<float>(S_dec_block) * S_dec), FLT_MAX)``, used by
    ``quantize_transpose_nvfp4.cuh``) and its PyTorch reference (``reference_nvfp4.py``,
    ``_quantize_blockwise_reference``: ``torch.min(torch.div(1.0, decode_scale *
    global_decode_scale), torch.finfo(torch.float32).max)``). A block whose E4M3 scale
    underflows to 0 while holding nonzero values (amax below ~2**-10 of the scale that
    maps the tensor amax to 448) therefore gets FLT_MAX, so its nonzero elements saturate
    to +-6 (codes 7/15; zeros stay 0), as in TE; it dequantizes to 0 all the same
    (``6 * 0``). (Before 2026-12 fp4jax returned 0 there, writing codes +-0.)

    The correctly rounded reciprocal is ``numerics.div_rn(1, s * dec)`` (on the CPU XLA's
    IEEE float32 division, elsewhere one float64 division rounded to float32), for a
    scalar ``dec`` as for one per row (row-scaled tensors, broadcastable against ``s``). A
    subnormal ``dec`` (a tiny tensor, ``global_encode_scale``) takes
    ``numerics.recip_scaled_subnormal_rn``: IEEE arithmetic without the CPU's flush.
    (Until 2026-12 a normal scalar ``dec`` took ``numerics.recip_scaled_rn``, a table of 128
    reciprocals, which gives the same bits as ``div_rn`` but lowered to about four times
    the ops.)
    """
    s = jnp.asarray(s, jnp.float32)
    dec = jnp.asarray(dec, jnp.float32)
    tiny = dec < jnp.float32(2.0**-126)
    if jnp.ndim(dec) == 0:
        e = jax.lax.cond(tiny, numerics.recip_scaled_subnormal_rn, _encode_normal, s, dec)
    else:
        e = jax.lax.cond(jnp.any(tiny), _encode_rows_tiny, _encode_normal, s, dec)
    return jnp.minimum(e, jnp.float32(numerics.FLT_MAX))


def _encode_normal(s: jax.Array, dec: jax.Array) -> jax.Array:
    """``element_encode_scale`` for normal decode scales (before the FLT_MAX clamp)."""
    return numerics.div_rn(jnp.float32(1.0), s * dec)


def _encode_rows_tiny(s: jax.Array, dec: jax.Array) -> jax.Array:
    """``element_encode_scale`` for per-row decode scales some of which are subnormal."""
    return numerics.where(dec < jnp.float32(2.0**-126),
                          numerics.recip_scaled_subnormal_rn(s, dec), _encode_normal(s, dec))


def _round_elements(y: jax.Array, grid: numerics.FloatGrid, rounding: str,
                    u: jax.Array | None) -> jax.Array:
    """Conversion of scaled elements ``y`` (sign kept) onto the element ``grid``,
    RNE-satfinite or SR, saturating to its max (``numerics.element_grid``); NaN ``y``
    become 0 (their block's NaN scale carries the NaN: a block holding NaN or Inf has a NaN
    scale, hence NaN ``y``). An infinite ``y`` is a finite element times the FLT_MAX encode
    scale of a block whose scale underflowed (``element_encode_scale``): it saturates to the
    grid's max, as TE's ``satfinite`` conversion of ``x * FLT_MAX`` does."""
    mag = jnp.abs(y)
    if rounding == "nearest":
        r = numerics.round_to_grid(mag, grid, "nearest")
    else:
        r = numerics.stochastic_round_to_grid(mag, grid, u)
    r = numerics.where(jnp.isnan(y), 0.0, r)  # the block scale carries the NaN
    return numerics.where(numerics.signbit(y), -r, r)


_TE_4OVER6 = ("Transformer Engine commit d0067d0da6cb01811b8072a7d304f0e00344ce2b, "
              "transformer_engine/common/cast/nvfp4/quantize_4over6_nvfp4.cuh")


def four_over_six(blocks: jax.Array, amax: jax.Array, rule: str = "4over6", *,
                  block_2d: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Transformer Engine's 4over6 adaptive NVFP4 block scaling (Cook et al., "Four Over
    Six", arXiv 2512.02010): per block, quantize with two scales and keep the one with the
    lower error.

    Source: Transformer Engine commit ``d0067d0d`` (d0067d0da6cb01811b8072a7d304f0e00344ce2b),
    ``transformer_engine/common/cast/nvfp4/quantize_4over6_nvfp4.cuh`` (the kernel:
    ``compute_scale_pair`` l. 125-146, ``accumulate_dequant_error`` l. 190-202,
    ``make_candidates`` l. 321-345, ``reduce_group_sum_16`` l. 347-356, the choice
    l. 474-496), ``core_nvfp4.cuh`` l. 81-95 (the tensor scale) and its PyTorch reference
    ``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py`` l. 513-648, which TE
    tests bit for bit against the kernel. All arithmetic is float32, one rounding per
    operation, in this order (``rule`` picks the metric and ``B``, see
    ``FOUR_OVER_SIX_VARIANTS``; ``"4over6"``: MAE and ``B = 256``, TE's defaults):

    * tensor scale: ``enc = B*6 / amax`` (``global_encode_scale`` with target ``B``;
      1 when ``amax == 0``), ``dec = 1/enc``;
    * ``base = (amax_b / 6) * enc`` (a division then a product: not the ``"max"`` rule's
      ``amax_b * (enc * (1/6))``);
    * map-to-6: ``s6 = e4m3_rne_satfinite(min(base, 448))``; map-to-4:
      ``s4 = e4m3_rne_satfinite(min(base * 1.5, 448))`` (the E2M1 value 4 then reaches
      what 6 reaches under ``s6``);
    * each candidate ``s``: element encode scale ``element_encode_scale(s, dec)`` and
      ``q = e2m1_rne_satfinite(x * e)``, as the ``"max"`` rule;
    * error per element: ``v = ((q * s) * amax) / (6*B)`` (the tensor amax itself, not
      ``dec``), ``d = v - x``; ``|d|`` (MAE) or ``d * d`` (MSE); summed in float32 in
      element order (``((e0 + e1) + e2) + ...``). 2D (16x16 tiles over the last two axes):
      each row's sum along the last axis, then the 16 row sums added as a tree
      ``r[i] + r[i+8]``, ``+ [i+4]``, ``+ [i+2]``, ``+ [i+1]`` (TE's warp shuffle;
      this is TE's rowwise output for the array as stored: TE's transposed output of the
      same tile adds the columns instead, so its choice may differ where the two sums
      differ in the last bit);
    * the block takes ``s4`` iff ``err4 < err6``; ties (all-zero and all-equal blocks
      among them) take ``s6``.

    Choices where TE is silent or differs, as for the ``"max"`` rule: a block holding NaN
    or Inf takes ``s6`` and gets a NaN scale (TE's ``fmaxf`` amax skips NaN); divisions by
    the constants 6 and ``6*B`` are correctly rounded on every backend
    (``numerics.div_rn``: XLA rewrites ``a / c`` into ``a * (1/c)``), and the MSE
    square is kept out of an FMA with the sum (XLA on CPU contracts ``acc + d*d``; TE
    uses ``__fmul_rn``/``__fadd_rn``). XLA on CPU flushes float32 subnormal results to
    zero, so error terms below ``2**-126`` (MSE: ``|d| < 2**-63``) are 0 there; TE keeps
    them, and so does XLA on an H100 (JAX 0.11.2), where ``tests/core/test_four_over_six.py``
    passes against TE's unflushed math.
    TE refuses 4over6 with stochastic rounding and with the RHT (``quantizer.cpp``
    l. 2561-2564); ``fp4jax.quantize`` and the recipes refuse them too.

    Args:
      blocks: float32 blocks with the elements last, ``(..., nb, 16)``; with
        ``block_2d``, tiles ``(..., nr, 16, nc, 16)`` (rows, then columns). Zero padding
        adds nothing to the errors.
      amax: float32 scalar, the tensor's max ``|x|`` over finite entries; or, row-scaled
        (1D blocks only: TE's ``ROW_SCALED_NVFP4`` 4over6 path, ``global_amax =
        amax[global_row]``, ``quantize_4over6_nvfp4.cuh`` l. 478-481), one amax per row,
        shaped ``blocks.shape[:-2] + (1,)``: every formula above then uses its row's.
      rule: a key of ``FOUR_OVER_SIX_VARIANTS``.
      block_2d: whether ``blocks`` are 16x16 tiles.
    Returns:
      ``(dec, s, q)``: the tensor decode scale (float32 scalar; row-scaled: shaped like
        ``amax``), the chosen block scales
      (float32 on the E4M3 grid, NaN for non-finite blocks; ``(..., nb)`` or
      ``(..., nr, nc)``) and the elements (float32 E2M1 values, shaped like ``blocks``).
    """
    if rule not in FOUR_OVER_SIX_VARIANTS:
        raise ValueError(f"four_over_six: rule must be one of {list(FOUR_OVER_SIX_VARIANTS)},"
                         f" got {rule!r}")
    metric, bound = FOUR_OVER_SIX_VARIANTS[rule]
    f32 = jnp.float32
    amax = jnp.asarray(amax, f32)
    enc = global_encode_scale(amax, NVFP4, target=bound)
    dec = numerics.reciprocal_rn(enc)
    amax_b = block_amax(blocks, axis=(-3, -1) if block_2d else -1)
    finite = jnp.isfinite(amax_b)
    base = numerics.div_rn(amax_b, f32(6.0)) * enc

    def per_element(a):  # block values broadcast against the elements of ``blocks``
        return a[..., :, None, :, None] if block_2d else a[..., None]

    # both candidates at once (axis 0: map-to-4, map-to-6): one division and one
    # reciprocal table for the two
    v = jnp.stack([base * f32(1.5), base])
    s = numerics.round_to_grid(jnp.minimum(v, f32(numerics.E4M3.max_value)), numerics.E4M3,
                               "nearest")
    s = numerics.where(finite, s, f32(jnp.nan))
    q = _round_elements(blocks * per_element(element_encode_scale(s, dec)), numerics.E2M1,
                        "nearest", None)
    amax_e = amax if amax.ndim == 0 else amax[..., None]  # row-scaled: (..., 1, 1)
    val = numerics.div_rn((q * per_element(s)) * amax_e, f32(6.0 * bound))
    d = val - blocks
    if metric == "mae":
        t = jnp.abs(d)
    else:  # the select keeps XLA from fusing d*d into an FMA with the sum below
        t = numerics.where(jnp.isnan(d), d, d * d)
    err = t[..., 0]
    for i in range(1, t.shape[-1]):  # element order, as TE's per-thread loop
        err = err + t[..., i]
    if block_2d:  # (2, ..., nr, 16, nc): the 16 row sums, TE's shuffle-down tree
        n = err.shape[-2]
        while n > 1:
            n //= 2
            err = err[..., :n, :] + err[..., n:, :]
        err = err[..., 0, :]
    pick4 = finite & (err[0] < err[1])
    return dec, numerics.where(pick4, s[0], s[1]), numerics.where(per_element(pick4), q[0], q[1])


_QUARTET2 = ("IST-DASLab/Quartet-II commit 8776a90b7aa0c0a400ad858a3c05a66f7ec55b73, "
             "src/models/quantization/schemes/quartet_2.py")
EDEN_SCALE_OVERRIDE = (17 / 16) * 0.93
"""Quartet II's ``backward_scale_override`` (``quartet_2.py``, ``Quartet_II_fn``): the block
amax maps to ``6 / EDEN_SCALE_OVERRIDE`` (~6.072), leaving the EDEN correction room."""
_EDEN_VAL_MAX = float(np.float32(6.0 / EDEN_SCALE_OVERRIDE))  # Triton: 6.0 / scale_override
_EDEN_SCALES_MAX = float(np.float32(255.99))  # "Not 448 because eden needs space to rescale"


def ms_eden(groups: jax.Array, amax: jax.Array, u: jax.Array
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Quartet II's MS-EDEN rounding of NVFP4 (Panferov et al., "Quartet II", arXiv
    2601.22813): elements rounded to nearest, then per group of ``G`` elements (the RHT tile:
    128 in Quartet II) the EDEN correction ``<x, x> / <x, q>`` rescales the group's E4M3 block
    scales, which are then rounded stochastically, so that in expectation over the random
    rotation and the scale rounding the dequantized tensor is unbiased.

    Source: IST-DASLab/Quartet-II commit ``8776a90b``
    (8776a90b7aa0c0a400ad858a3c05a66f7ec55b73), ``src/models/quantization/schemes/
    quartet_2.py``, ``eden_1x16s_fp4_kernel`` (the scheme the repository's README points to),
    with the element conversion and product order of its CUDA kernel
    ``kernels/csrc/round_eden_fp4.cu`` (``eden_fp4_kernel``). In float32, in this order,
    with ``V = f32(6 / EDEN_SCALE_OVERRIDE)`` (~6.072, ``EDEN_SCALE_OVERRIDE`` = 17/16 * 0.93)
    and ``S = f32(255.99)``:

    * tensor decode scale ``dec = (amax / S) / V`` (1 when ``amax == 0``; clamped to
      ``>= 2**-126`` so it stays a normal float32: Quartet II's own code is silent there);
    * block scale ``s = e4m3_rne((amax_b / V) / dec)`` (never above ``S``, so never
      saturated), and ``s = 1`` where that is 0;
    * scaled elements ``y = x * element_encode_scale(s, dec)`` (the CUDA kernel's ``x *
      (1 / (s * scale))``) and ``q = e2m1_rne_satfinite(y)`` (``cudaRoundNearest``);
    * per group, ``num = sum y*y`` and ``den = sum y*q`` over its ``G`` elements, in a fixed
      pairwise order (element ``i`` plus element ``i + G/2``, then halves again, as the
      kernel's xor-shuffle reduction), products kept out of an FMA with the sums;
      ``c = num / den`` (1 when ``den == 0``);
    * the block's final scale is ``s * c`` rounded stochastically onto the E4M3 grid
      (``numerics.stochastic_round_to_grid``: up with probability ``(s*c - lo) / (hi - lo)``,
      the Triton kernel's ``prob_up``), with the uniform ``u`` of the block;
    * the elements stay ``q``: the value is ``(q * s_final) * dec``.

    Differences from their code: the uniforms are fp4jax's (``u``: 8-bit lattice uniforms
    from ``numerics.uniform_from_key``, so the scale rounding's bias is at most 2**-9 of an
    E4M3 step; their Triton kernel draws ``tl.rand`` per block, their CUDA kernel 16 bits
    with a bit-mask rule, and rounds scales below 2**-6 to nearest); the E4M3 grid's
    subnormal scales are rounded stochastically too; the sums have this fixed order (theirs
    is the hardware's); divisions are correctly rounded (``numerics.div_rn``); a non-finite
    element gives its block a NaN scale and +0 elements and counts as 0 in its group's sums
    (theirs: NaN for the group). Their newer ``rht128_eden.cu`` kernel computes the
    correction per block of 16 from truncated bf16 scales and derives the tensor scale from
    the largest corrected scale in a second pass: not implemented. Checked against a CPU
    transcription of their Triton kernel on shared inputs and uniforms: the same bits
    (docs/performance.md lists the comparison), including the method's small residual
    shrink (~-0.05% of ``|x|^2`` over random rotations, from ``c``
    being computed on block-scaled values).

    Args:
      groups: float32 ``(..., ng, G // 16, 16)``: the elements, blocks of 16 along the last
        axis, ``G // 16`` blocks per EDEN group (zero padding adds nothing to the sums).
      amax: float32 scalar, the tensor's max ``|x|`` over finite entries (after the RHT).
      u: float32 uniforms in (0, 1), one per block, ``(..., ng, G // 16)``.
    Returns:
      ``(dec, s, q)``: the tensor decode scale (float32 scalar), the block scales (float32 on
      the E4M3 grid, NaN for blocks holding NaN/Inf; ``(..., ng, G // 16)``) and the elements
      (float32 E2M1 values shaped like ``groups``).
    """
    f32 = jnp.float32
    amax = jnp.asarray(amax, f32)
    val_max = f32(_EDEN_VAL_MAX)
    dec = numerics.div_rn(numerics.div_rn(amax, f32(_EDEN_SCALES_MAX)), val_max)
    dec = numerics.where(amax == 0, f32(1.0), jnp.maximum(dec, f32(2.0**-126)))
    amax_b = block_amax(groups, axis=-1)  # (..., ng, G/16)
    finite = jnp.isfinite(amax_b)
    s = numerics.round_to_grid(numerics.div_rn(numerics.div_rn(amax_b, val_max), dec),
                               numerics.E4M3, "nearest")
    s = numerics.where(finite & (s == 0), f32(1.0), s)
    y = groups * element_encode_scale(s, dec)[..., None]
    q = _round_elements(y, numerics.E2M1, "nearest", None)
    q = numerics.where(finite[..., None], q, f32(0.0))  # a NaN block: NaN scale, +0 elements
    y = numerics.where(jnp.isfinite(y), y, f32(0.0))
    flat = (*y.shape[:-2], y.shape[-2] * y.shape[-1])
    # the selects keep XLA from fusing the products into FMAs with the sums below
    yy = numerics.where(jnp.isnan(y), y, y * y).reshape(flat)
    yq = numerics.where(jnp.isnan(y), y, y * q).reshape(flat)
    n = flat[-1]
    while n > 1:  # pairwise: element i + element i + n/2
        n //= 2
        yy = yy[..., :n] + yy[..., n:]
        yq = yq[..., :n] + yq[..., n:]
    num, den = yy[..., 0], yq[..., 0]
    c = numerics.where(den == 0, f32(1.0), numerics.div_rn(num, numerics.where(den == 0, 1.0, den)))
    s = numerics.stochastic_round_to_grid(s * c[..., None], numerics.E4M3, u)
    return dec, numerics.where(finite, s, f32(jnp.nan)), q


def check_row_scaled(row_scaled: bool, fmt: BlockFormat | None, *, block_2d: bool = False,
                     rounding: str = "nearest", where: str = "quantize") -> None:
    """Raise a ValueError naming the argument and the fix when row-scaling (one FP32 tensor
    scale per row, ``global_encode_scale``) does not apply: it needs a quantized format
    with a tensor scale, 1D blocks (Transformer Engine: "Row-scaled NVFP4 quantization does
    not support 2D quantization", ``quantize_transpose_nvfp4.cuh`` l. 1419-1420) and not
    MS-EDEN (which has its own tensor scale rule, ``ms_eden``)."""
    if not isinstance(row_scaled, (bool, np.bool_)):
        raise TypeError(f"{_arg('row_scaled', where)} must be a bool, got {row_scaled!r}")
    if not row_scaled:
        return
    arg = _arg("row_scaled", where)
    if fmt is None:
        raise ValueError(f"{arg}=True needs a quantized operand, got fmt=None (high "
                         f"precision): set fmt=fp4jax.NVFP4 or {arg}=False")
    if not fmt.tensor_scale:
        raise ValueError(
            f"{arg}=True replaces the FP32 tensor scale by one per row, but format "
            f"{fmt.name!r} has no tensor scale (tensor_scale=False): use a two-level format "
            f"such as fp4jax.NVFP4, or {arg}=False")
    if block_2d:
        raise ValueError(
            f"{arg}=True with {_arg('block_2d', where)}=True: row scales need 1D blocks "
            "(Transformer Engine: 'Row-scaled NVFP4 quantization does not support 2D "
            f"quantization'); set {_arg('block_2d', where)}=False or {arg}=False")
    if rounding == "ms_eden":
        raise ValueError(
            f"{arg}=True with {_arg('rounding', where)}='ms_eden': MS-EDEN has its own tensor "
            f"scale rule (fp4jax.quantization.ms_eden); set {arg}=False or another rounding")


def check_ms_eden(fmt: BlockFormat | None, *, block_2d: bool = False,
                  block_scale_rule: str = "max", where: str = "quantize") -> None:
    """Raise a ValueError naming the argument and the fix when MS-EDEN rounding (``ms_eden``)
    does not apply: it is defined for NVFP4 (E2M1 elements, E4M3 scales, blocks of 16, a
    tensor scale: Quartet II's ``eden_1x16s_fp4_kernel``), 1D blocks, the ``"max"`` block
    scale rule."""
    arg = _arg("rounding", where)
    if fmt is None:
        raise ValueError(f"{arg}='ms_eden' needs a quantized operand, got fmt=None: set "
                         "fmt=fp4jax.NVFP4")
    if not _nvfp4_like(fmt):
        raise ValueError(
            f"{arg}='ms_eden' is defined for NVFP4 only (E2M1 elements, E4M3 scales, blocks "
            f"of 16, an FP32 tensor scale: {_QUARTET2}), got format {fmt.name!r}: use "
            f"fmt=fp4jax.NVFP4 or {arg}='stochastic'")
    if block_2d:
        raise ValueError(
            f"{arg}='ms_eden' with {_arg('block_2d', where)}=True: MS-EDEN scales 1x16 blocks "
            f"(Quartet II); set {_arg('block_2d', where)}=False or {arg}='nearest'")
    if block_scale_rule != "max":
        raise ValueError(
            f"{arg}='ms_eden' with {_arg('block_scale_rule', where)}={block_scale_rule!r}: "
            f"MS-EDEN sets the block scales itself; use {_arg('block_scale_rule', where)}="
            "'max'")


def _arg(name: str, where: str) -> str:
    """An argument's name in an error: ``name`` for ``quantize``, ``where.name`` else."""
    return name if where == "quantize" else f"{where}.{name}"


def _nvfp4_like(fmt: BlockFormat) -> bool:
    return (fmt.scale_exp_bits, fmt.scale_man_bits, fmt.block_size, fmt.tensor_scale,
            fmt.scale_rule, fmt.elem_exp_bits, fmt.elem_man_bits, fmt.scale_ieee) == (
                4, 3, 16, True, "nearest", 2, 1, False)


def check_block_scale_rule(rule: str, fmt: BlockFormat | None, rounding: str = "nearest",
                           where: str = "quantize") -> None:
    """Raise a ValueError naming the argument and the fix when ``rule`` is unknown or does
    not apply: a 4over6 rule needs an NVFP4 format (E4M3 scales, blocks of 16, a tensor
    scale, RNE scales) and round-to-nearest (Transformer Engine refuses 4over6 with
    stochastic rounding: ``quantize_4over6_nvfp4.cuh`` l. 673). ``where`` prefixes the
    argument names (``"quantize"``: ``block_scale_rule``; ``"QuantSpec"``:
    ``QuantSpec.block_scale_rule``)."""
    arg = "block_scale_rule" if where == "quantize" else f"{where}.block_scale_rule"
    rnd = "rounding" if where == "quantize" else f"{where}.rounding"
    if rule not in BLOCK_SCALE_RULES:
        raise ValueError(f"{arg} must be one of {BLOCK_SCALE_RULES}, got {rule!r}")
    if rule == "max":
        return
    if fmt is None:
        raise ValueError(
            f"{arg}={rule!r} needs a quantized operand, got fmt=None (high precision): set "
            f"fmt=fp4jax.NVFP4 or {arg}='max'")
    if not _nvfp4_like(fmt):
        raise ValueError(
            f"{arg}={rule!r} is defined for NVFP4 only (E2M1 elements, E4M3 scales, blocks of "
            f"16, an FP32 tensor scale: {_TE_4OVER6}), got format {fmt.name!r} (elements "
            f"e{fmt.elem_exp_bits}m{fmt.elem_man_bits}, scales e{fmt.scale_exp_bits}"
            f"m{fmt.scale_man_bits}{' ieee' if fmt.scale_ieee else ''}, block "
            f"{fmt.block_size}, tensor_scale={fmt.tensor_scale}, scale_rule="
            f"{fmt.scale_rule!r}): use fmt=fp4jax.NVFP4 or {arg}='max'")
    if rounding != "nearest":
        raise ValueError(
            f"{arg}={rule!r} needs {rnd}='nearest', got {rounding!r}: Transformer Engine "
            "refuses 4over6 with stochastic rounding ('NVFP4 4over6 quantization does not "
            f"support stochastic rounding'); set {rnd}='nearest' or {arg}='max'")


# ---------------------------------------------------------------------------
# Validation helpers.
# ---------------------------------------------------------------------------


def check_float(x: Any, argname: str, where: str = "") -> jax.Array:
    """Validation for public functions: ``x`` as an array; TypeError naming ``argname`` (and
    the function ``where``) if it is not floating point, or if it is a ``QuantizedArray``
    (already quantized: the public functions quantize their inputs themselves)."""
    prefix = f"{where}: " if where else ""
    if isinstance(x, QuantizedArray):
        raise TypeError(
            f"{prefix}{argname} is a fp4jax.QuantizedArray (shape {x.shape}, {x.fmt.name}); "
            f"pass the high-precision array (quantization follows the recipe), or "
            f"fp4jax.dequantize({argname}) to use its quantized values"
        )
    x = jnp.asarray(x) if not isinstance(x, jax.Array) else x
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"{prefix}{argname} must have a floating dtype (float32, bfloat16, float16), got "
            f"{x.dtype}; cast it first, e.g. {argname}.astype(jnp.float32)"
        )
    return x


def _check_rounding(rounding: str, key: Any, argname: str = "key") -> None:
    if rounding not in _ROUNDINGS:
        raise ValueError(f"rounding must be one of {_ROUNDINGS}, got {rounding!r}")
    if rounding != "nearest" and key is None:
        raise ValueError(
            f"{rounding!r} rounding draws random bits and needs a PRNG key: pass "
            f"{argname}=jax.random.key(seed) (a new key per call, e.g. from jax.random.split)"
        )


def normalize_key(key: Any, name: str = "key") -> jax.Array:
    """A typed PRNG key array from a typed (``jax.random.key``) or raw (``PRNGKey``) key.

    Typed keys keep their implementation (threefry, rbg, ...); raw uint32 keys are
    wrapped with the default implementation, as ``jax.random`` itself does. One key only:
    a batch of keys (e.g. ``jax.random.split(key)``) raises a ValueError. ``name`` is the
    argument named in the errors.
    """
    if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return _check_one_key(key, name)
    if isinstance(key, (int, float)) or not hasattr(key, "dtype"):
        raise TypeError(
            f"{name} must be a jax PRNG key, got {type(key).__name__}: pass "
            f"{name}=jax.random.key(seed)"
        )
    key = jnp.asarray(key)
    if key.dtype != jnp.uint32:
        raise TypeError(
            f"{name} must be a jax PRNG key, got an array of dtype {key.dtype}: pass "
            f"{name}=jax.random.key(seed)"
        )
    try:
        wrapped = jax.random.wrap_key_data(key)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"{name} must be one jax PRNG key, got a uint32 array of shape {key.shape} that is "
            f"not one: pass {name}=jax.random.key(seed)"
        ) from e
    return _check_one_key(wrapped, name)


def _check_one_key(key: jax.Array, name: str = "key") -> jax.Array:
    if key.shape != ():
        raise ValueError(
            f"{name} must be one PRNG key, got a batch of keys of shape {key.shape} (e.g. from "
            "jax.random.split): pass one of them, e.g. keys[0], or jax.vmap over the batch"
        )
    return key


# ---------------------------------------------------------------------------
# quantize / dequantize
# ---------------------------------------------------------------------------


def finite_amax(x: jax.Array) -> jax.Array:
    """The tensor amax: ``max |x|`` over the finite entries of ``x`` (0 when none is finite),
    a float32 scalar (``x`` read through ``numerics.exact_float32``: a bfloat16 tensor's
    amax is that of its bfloat16 values). NaN/Inf are skipped so that one bad value does not
    poison the whole tensor's scale (its block gets a NaN scale instead, ``block_amax``)."""
    with jax.named_scope("fp4_amax"):  # op-name metadata for profiles; same program
        a = jnp.abs(numerics.exact_float32(x))
        return jnp.max(numerics.where(jnp.isfinite(a), a, 0.0), initial=0.0)


def block_amax(blocks: jax.Array, axis) -> jax.Array:
    """``max |x|`` over each block (``axis``: the block's element axes); NaN where the block
    holds a NaN or an Inf, so that ``block_decode_scale`` gives it a NaN scale.

    One integer max over the bits of ``|x|`` (the Pallas kernels' ``_block_amax_bits``
    rule): for non-negative floats the bit order is the value order, and NaN/Inf bits
    (``>= 0x7F800000``) are above every finite one, so the block is non-finite exactly when
    its max is; no float max is trusted with NaN (XLA's vectorized float max reduction on
    CPU did not always propagate it: JAX 0.10.2 lost a NaN from most positions of a
    16-element block of a (64, 1024) float32 tensor, which would have turned NaN into
    finite FP4 codes), and no second any-reduction is needed. Several block axes (16x16
    and 32x32 tiles) are reduced one at a time, the minor first: exact in any order, and
    faster on XLA:GPU.
    """
    m = jax.lax.bitcast_convert_type(jnp.abs(blocks.astype(jnp.float32)), jnp.int32)
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    for a in sorted((a % blocks.ndim for a in axes), reverse=True):  # the minor axis first
        m = jnp.max(m, axis=a)
    return numerics.where(m >= 0x7F800000, jnp.float32(jnp.nan),
                          jax.lax.bitcast_convert_type(m, jnp.float32))


def _pad_to(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    n = x.shape[axis]
    pad = (-n) % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def quantize(
    x: jax.Array,
    fmt: BlockFormat | str = NVFP4,
    *,
    axis: int = -1,
    block_2d: bool = False,
    rounding: str = "nearest",
    key: jax.Array | None = None,
    block_scale_rule: str = "max",
    row_scaled: bool = False,
    eden_group: int = 128,
) -> QuantizedArray:
    """Quantize ``x`` to a block-scaled format (FP4, or the FP6/FP8 elements of OCP MX).

    Args:
      x: float array (float32, bfloat16, float16), any shape (>= 1 dim; >= 2 for 2D).
      fmt: a ``BlockFormat`` or a name (``"nvfp4"``, ``"mxfp4"``, ``"mxfp4_ocp"``,
        ``"mxfp8_e4m3"``, ``"mxfp8_e5m2"``, ``"mxfp6_e2m3"``, ``"mxfp6_e3m2"`` and their
        ``"_up"`` variants: ``fp4jax.formats.FORMATS``).
      axis: the axis along which contiguous blocks of ``fmt.block_size`` are formed
        (1D scaling). Lengths that are not a multiple of the block are zero-padded
        in the last block.
      block_2d: one scale per ``block x block`` tile over the last two axes
        (NVFP4 paper sec. 4.2: weights, so that ``Q(W).T == Q(W.T)``); ``axis``
        is then ignored.
      rounding: ``"nearest"`` (RNE) or ``"stochastic"`` (unbiased SR, needs ``key``), onto
        the format's element grid, saturating to its max; or ``"ms_eden"`` (Quartet II's
        MS-EDEN, ``ms_eden``: NVFP4 and 1D only, needs ``key``; unbiased in expectation
        over a random Hadamard rotation of ``x`` along ``axis``, which the caller applies:
        ``fp4jax.dot`` does, with the GEMM's RHT).
      key: a ``jax.random`` key for stochastic rounding and MS-EDEN.
      block_scale_rule: ``"max"`` (the block amax maps to 6) or a 4over6 rule
        (``"4over6"``, ``"4over6-mse"``, ``"4over6-448"``, ``"4over6-mse-448"``:
        Transformer Engine's adaptive map-to-4 / map-to-6 choice, ``four_over_six``;
        NVFP4 and round-to-nearest only, 1D or 2D).
      row_scaled: one FP32 tensor scale per row (each vector along ``axis``: the tokens
        when ``axis`` is the last one) instead of one per tensor, from the row's amax
        (Transformer Engine's row-scaled NVFP4, ``global_encode_scale``); formats with a
        tensor scale, 1D blocks. ``global_scale`` then has ``x``'s shape with ``axis`` of
        length 1.
      eden_group: elements per MS-EDEN correction group along ``axis`` (the RHT tile: 128
        in Quartet II; a power of two >= 16); ``axis`` is zero-padded to a multiple of it.

    Returns:
      A ``QuantizedArray`` (``data`` in ``fmt.data_dtype``, ``scale`` in
      ``fmt.scale_dtype``). Formulas: ``global_encode_scale``, ``block_decode_scale``,
      ``element_encode_scale`` and ``numerics.round_to_grid`` (NVFP4 paper App. B;
      bit-exact with Transformer Engine for NVFP4), or ``four_over_six``.

    Example:
      >>> q = fp4jax.quantize(jnp.ones((4, 32)), fp4jax.NVFP4)
      >>> q.data.dtype, q.scale.shape
      (dtype(float4_e2m1fn), (4, 2))
    """
    x = check_float(x, "x")
    fmt = get_format(fmt)
    _check_rounding(rounding, key)
    if x.ndim == 0:
        raise ValueError("x must have at least one dimension to be block-quantized")
    if block_2d and x.ndim < 2:
        raise ValueError(f"block_2d=True needs x with >= 2 dims, got shape {x.shape}")
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise TypeError(f"axis must be an int, got {axis!r}")
    if not block_2d and not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis={axis} is out of range for x of shape {x.shape}")
    check_block_scale_rule(block_scale_rule, fmt, rounding)
    check_row_scaled(row_scaled, fmt, block_2d=block_2d, rounding=rounding)
    if rounding == "ms_eden":
        check_ms_eden(fmt, block_2d=block_2d, block_scale_rule=block_scale_rule)
        check_eden_group(eden_group)
    key = normalize_key(key) if rounding != "nearest" else None
    return _quantize_jit(x, key, fmt, axis % x.ndim - x.ndim, bool(block_2d), rounding,
                         block_scale_rule, bool(row_scaled),
                         int(eden_group) if rounding == "ms_eden" else 0)


def check_eden_group(eden_group: Any, where: str = "eden_group") -> None:
    """ValueError naming ``where`` unless ``eden_group`` is a power of two in 16..256."""
    if (isinstance(eden_group, bool) or not isinstance(eden_group, (int, np.integer))
            or eden_group < 16 or eden_group > 256 or eden_group & (eden_group - 1)):
        raise ValueError(f"{where} must be a power of two in 16..256 (a multiple of the "
                         f"16-element blocks; Quartet II: 128), got {eden_group!r}")


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6, 7, 8))
def _quantize_jit(x, key, fmt, axis, block_2d, rounding, block_scale_rule="max",
                  row_scaled=False, eden_group=0):
    return quantize_unchecked(x, key, fmt, axis, block_2d, rounding, block_scale_rule,
                          row_scaled=row_scaled, eden_group=eden_group)


def row_amax(x: jax.Array, axis: int) -> jax.Array:
    """Each row's max ``|x|`` over its finite entries (a row: the vector along ``axis``), as
    float32 shaped like ``x`` with ``axis`` of length 1: the amax of row-scaled NVFP4
    (Transformer Engine's ``reference_nvfp4.py`` l. 877: ``torch.max(torch.abs(row_input),
    dim=1)``; fp4jax skips NaN/Inf, as the tensor amax does)."""
    a = jnp.abs(numerics.exact_float32(x))
    return jnp.max(numerics.where(jnp.isfinite(a), a, 0.0), axis=axis, keepdims=True, initial=0.0)


def quantize_unchecked(x, key, fmt: BlockFormat, axis: int, block_2d: bool, rounding: str,
                       block_scale_rule: str = "max", shard=None, *, row_scaled: bool = False,
                       eden_group: int = 0, local_amax: bool = False,
                       tensor_amax: jax.Array | None = None,
                       uniforms: jax.Array | None = None):
    """The traced body of ``quantize`` (arguments already validated). ``shard``: the mesh
    axis name(s) over which ``x`` is one block of rows of a larger tensor, inside
    ``jax.shard_map`` (``fp4jax.sharding``): the tensor amax is the ``pmax`` over them and
    the stochastic-rounding draws are taken at the block's rows in the whole tensor.
    ``row_scaled``: one tensor scale per row along ``axis`` (``row_amax``); with ``shard``
    the row amaxes are reduced over the shards only when ``axis`` is the sharded token axis
    (``x.ndim - 2``, the canonical ``(B, M, K)`` of ``fp4jax.dot``): a row along the last
    axis lies on one device, so it needs no cross-device reduction (TE's point). ``eden_group``:
    MS-EDEN's group size (``rounding="ms_eden"``). ``local_amax`` (with ``shard``): the
    block's own amax, no ``pmax`` (``Recipe.amax_scope="local"``); the draws stay at the
    block's rows in the whole tensor.

    ``tensor_amax`` (1D blocks, the ``"max"`` rule, no ``row_scaled``/``shard``): the tensor
    amax given instead of computed, float32 with ``x``'s rank, the blocked axis of length 1
    or the number of blocks along it, the others of ``x``'s length or 1: each block's tensor
    scale comes from its own entry (``global_encode_scale`` is elementwise), and
    ``global_scale`` has that shape. ``uniforms``: the stochastic-rounding uniforms given
    instead of drawn from ``key``, shaped as ``numerics.uniform_from_key`` draws them (``x``
    padded along ``axis`` to whole blocks, stored order). With both, quantizing the rows of
    several tensors stacked in one array gives each row the bits of its own tensor's
    quantization (``fp4jax.ragged_dot``'s experts)."""
    b = fmt.block_size
    xf = numerics.exact_float32(x)
    given = tensor_amax is not None
    if given and (block_2d or row_scaled or shard is not None or rounding == "ms_eden"
                  or block_scale_rule != "max"):
        raise ValueError("quantize_unchecked: tensor_amax is for 1D blocks with the 'max' "
                         "rule and round-to-nearest or stochastic rounding only")
    if given:
        amax = jnp.asarray(tensor_amax, jnp.float32)
    elif row_scaled:
        amax = row_amax(xf, axis)
        if shard is not None and not local_amax and axis % x.ndim == x.ndim - 2:
            amax = jax.lax.pmax(amax, shard)
    else:
        amax = finite_amax(xf)
        if shard is not None and not local_amax:
            amax = jax.lax.pmax(amax, shard)
    offset = None
    if shard is not None:
        if rounding != "nearest":
            padded = (_padded_shape(_padded_shape(x.shape, -2, b), -1, b) if block_2d
                      else _padded_shape(x.shape, axis % x.ndim - x.ndim, b))
            offset = numerics.row_shard_draw_offset(padded, jax.lax.axis_index(shard),
                                                    jax.lax.axis_size(shard))
    four6 = block_scale_rule != "max"
    if not four6 and not row_scaled and rounding != "ms_eden" and not given:
        enc = global_encode_scale(amax, fmt)
        dec = numerics.reciprocal_rn(enc)

    if block_2d:
        rows, cols = x.shape[-2:]
        xp = _pad_to(_pad_to(xf, -2, b), -1, b)
        lead = xp.shape[:-2]
        nr, nc = xp.shape[-2] // b, xp.shape[-1] // b
        tiles = xp.reshape(*lead, nr, b, nc, b)
        if four6:
            dec, s, q = four_over_six(tiles, amax, block_scale_rule, block_2d=True)
            q = q.reshape(xp.shape)[..., :rows, :cols]
            return QuantizedArray(q.astype(_F4), s.astype(fmt.scale_dtype), dec, fmt, None,
                                  True)
        amax_b = block_amax(tiles, axis=(-3, -1))  # (..., nr, nc)
        s = block_decode_scale(amax_b, enc, fmt)
        e = element_encode_scale(s, dec)[..., :, None, :, None]
        u = None
        if rounding == "stochastic":
            u = numerics.uniform_from_key(key, xp.shape, offset).reshape(tiles.shape)
        q = _round_elements(tiles * e, fmt.elem_grid, rounding, u).reshape(xp.shape)
        q = q[..., :rows, :cols]
        return QuantizedArray(q.astype(fmt.data_dtype), s.astype(fmt.scale_dtype), dec, fmt,
                              None, True)

    axis = axis % x.ndim - x.ndim  # stored negative: it survives vmap's leading batch dims
    n = x.shape[axis]
    if rounding == "ms_eden":
        return _quantize_ms_eden(xf, key, fmt, axis, amax, eden_group, offset)
    xm = _pad_to(jnp.moveaxis(xf, axis, -1), -1, b)
    blocks = xm.reshape(*xm.shape[:-1], xm.shape[-1] // b, b)
    if row_scaled or given:  # per row (or block): (..., 1 or nb) against the blocks
        amax = jnp.moveaxis(amax, axis, -1)
        if not four6:
            enc = global_encode_scale(amax, fmt)
            dec = numerics.reciprocal_rn(enc)
    if four6:
        dec, s, q = four_over_six(blocks, amax, block_scale_rule)
        q = q.reshape(xm.shape)[..., :n]
    else:
        amax_b = block_amax(blocks, axis=-1)  # (..., nb)
        s = block_decode_scale(amax_b, enc, fmt)
        e = element_encode_scale(s, dec)[..., None]
        u = None
        if rounding == "stochastic":  # drawn in the stored order (uniform_from_key)
            u = (numerics.uniform_from_key(key, _padded_shape(x.shape, axis, b), offset)
                 if uniforms is None else uniforms)
            u = jnp.moveaxis(u, axis, -1).reshape(blocks.shape)
        q = _round_elements(blocks * e, fmt.elem_grid, rounding, u).reshape(xm.shape)[..., :n]
    q = jnp.moveaxis(q, -1, axis).astype(fmt.data_dtype)
    scale = jnp.moveaxis(s, -1, axis).astype(fmt.scale_dtype)
    if (row_scaled or given) and jnp.ndim(dec):  # (formats with no tensor scale: 1.0)
        dec = jnp.moveaxis(dec, -1, axis)
    return QuantizedArray(q, scale, dec, fmt, axis, False)


def _quantize_ms_eden(xf, key, fmt: BlockFormat, axis: int, amax, group: int, offset):
    """MS-EDEN (``ms_eden``) of ``xf`` (float32) with 1x16 blocks along ``axis`` (negative),
    groups of ``group`` elements, zero-padded. Each block's scale uniform is the
    stochastic-rounding uniform (``numerics.uniform_from_key``, drawn over the array padded
    to whole blocks in its stored order, as SR draws them) of the block's first element."""
    b = fmt.block_size
    n = xf.shape[axis]
    u = numerics.uniform_from_key(key, _padded_shape(xf.shape, axis, b), offset)
    u = jnp.moveaxis(u, axis, -1)[..., ::b]  # (..., nb): each block's first element
    xm = _pad_to(jnp.moveaxis(xf, axis, -1), -1, group)
    per = group // b
    u = _pad_to(u, -1, per)
    groups = xm.reshape(*xm.shape[:-1], xm.shape[-1] // group, per, b)
    dec, s, q = ms_eden(groups, amax, u.reshape(groups.shape[:-1]))
    nb = -(-n // b)
    q = q.reshape(xm.shape)[..., :n]
    s = s.reshape(*xm.shape[:-1], xm.shape[-1] // b)[..., :nb]  # no -1: 0-size safe
    return QuantizedArray(jnp.moveaxis(q, -1, axis).astype(fmt.data_dtype),
                          jnp.moveaxis(s, -1, axis).astype(fmt.scale_dtype), dec, fmt, axis,
                          False)


def _padded_shape(shape: tuple[int, ...], axis: int, b: int) -> tuple[int, ...]:
    """``shape`` with ``axis`` rounded up to a multiple of ``b`` (the padded tensor)."""
    out = list(shape)
    out[axis] = -(-out[axis] // b) * b
    return tuple(out)


def expand_scale(q: QuantizedArray) -> jax.Array:
    """Block scales broadcast to ``q.shape`` as float32."""
    s = q.scale.astype(jnp.float32)
    b = q.fmt.block_size
    if q.block_2d:
        rows, cols = q.shape[-2:]
        s = jnp.repeat(jnp.repeat(s, b, axis=-2), b, axis=-1)
        return s[..., :rows, :cols]
    axis = q.axis % q.ndim
    s = jnp.repeat(s, b, axis=axis)
    return jax.lax.slice_in_dim(s, 0, q.shape[axis], axis=axis)


def _global_scale_like(q: QuantizedArray) -> jax.Array:
    """The tensor scale broadcastable against ``q.data``: a scalar, or one per leading
    (``vmap``/``scan``-added) batch index."""
    gs = q.global_scale
    return gs.reshape(gs.shape + (1,) * (q.ndim - gs.ndim))


def scaled_data(q: QuantizedArray, dtype: Any = jnp.float32) -> jax.Array:
    """``data * scale`` without the tensor scale: what a block-scaled tensor core sees.

    The product has at most ``q.fmt.scaled_bits`` significant bits (element and scale
    significands: 8 or fewer for E2M1 times a scale of <= 5 mantissa bits, or E4M3 times
    E8M0), so it is exact in bfloat16 when that is <= 8 and always exact in float32 (the
    GEMM emulation picks the dtype by this, ``fp4jax.dot``). Products beyond ``dtype``'s
    largest finite value (only possible with large power-of-two scales: MXFP4's rounded-up
    scale of a tensor near the float32 maximum) saturate to it (``_satfinite``); blocks
    that held NaN/Inf stay NaN.

    Args:
      q: a ``QuantizedArray`` of any format.
      dtype: output dtype (float32: exact for every format).
    Returns:
      array of ``q.shape`` in ``dtype``.
    """
    return _satfinite(q.data.astype(jnp.float32) * expand_scale(q), dtype)


def _satfinite(y: jax.Array, dtype: Any) -> jax.Array:
    """``y`` (float32) cast to ``dtype`` with values beyond its largest finite value
    clamped to it (the ``satfinite`` rule of PTX conversions); NaN stays NaN. A finite
    input never dequantizes to Inf."""
    lim = min(float(jnp.finfo(jnp.dtype(dtype)).max), float(numerics.FLT_MAX))
    return numerics.clip(y, -lim, lim).astype(dtype)


def dequantize(q: QuantizedArray, dtype: Any = jnp.float32) -> jax.Array:
    """Decode ``(data * scale) * global_scale`` (NVFP4 paper Appendix B.3) to ``dtype``.

    Args:
      q: a ``QuantizedArray``.
      dtype: output dtype (float32 is exact for every format).
    Returns:
      array of ``q.shape``; blocks that held NaN/Inf are NaN. Values beyond ``dtype``'s
      largest finite value saturate to it (never Inf from a finite input).
    """
    if not isinstance(q, QuantizedArray):
        raise TypeError(f"dequantize expects a fp4jax.QuantizedArray, got {type(q).__name__}")
    if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise TypeError(f"dequantize: dtype must be a float dtype, got {jnp.dtype(dtype)}")
    return _dequantize_jit(q, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=1)
def _dequantize_jit(q: QuantizedArray, dtype) -> jax.Array:
    return _satfinite(numerics.mul_decode_scale(scaled_data(q), _global_scale_like(q)), dtype)


# ---------------------------------------------------------------------------
# Packed storage: two E2M1 codes a byte.
# ---------------------------------------------------------------------------


def e2m1_codes(data: jax.Array) -> jax.Array:
    """4-bit E2M1 codes (``s e1 e0 m``, OCP MX v1.0 sec. 5.3.3) as uint8, from float4 data."""
    v = data.astype(jnp.float32)
    mag = jnp.abs(v)
    idx = sum((mag >= t).astype(jnp.uint8) for t in E2M1_VALUES[1:])
    return idx.astype(jnp.uint8) | (numerics.signbit(v).astype(jnp.uint8) << 3)


def pack_e2m1(data: jax.Array, axis: int = -1) -> jax.Array:
    """Pack float4 E2M1 values two a byte along ``axis``.

    Element ``2i`` goes to the low nibble, ``2i+1`` to the high nibble of byte ``i``
    (the layout of Transformer Engine's and PTX's ``e2m1x2``). An odd length is
    padded with a +0 code. Returns uint8 with ``axis`` of length ``ceil(n/2)``.
    """
    if data.dtype != _F4:
        raise TypeError(
            f"pack_e2m1 expects float4_e2m1fn data (4-bit E2M1 elements), got {data.dtype}: "
            "FP8 and FP6 formats keep one element per byte in QuantizedArray.data "
            "(fmt.data_dtype) and are not packed")
    axis = axis % data.ndim
    c = _pad_to(jnp.moveaxis(e2m1_codes(data), axis, -1), -1, 2)
    c = c.reshape(*c.shape[:-1], c.shape[-1] // 2, 2)
    packed = c[..., 0] | (c[..., 1] << 4)
    return jnp.moveaxis(packed, -1, axis)


def unpack_e2m1(packed: jax.Array, length: int, axis: int = -1) -> jax.Array:
    """Inverse of ``pack_e2m1``: uint8 codes to float4 E2M1 values, ``length`` along ``axis``.

    ``packed`` holds ``ceil(length / 2)`` bytes along ``axis`` (``pack_e2m1`` pads an odd
    length with one code); any other ``length`` raises a ValueError."""
    if not hasattr(packed, "dtype") or packed.dtype != jnp.uint8:
        raise TypeError(f"unpack_e2m1 expects uint8 codes, got "
                        f"{getattr(packed, 'dtype', type(packed).__name__)}")
    if packed.ndim == 0 or not -packed.ndim <= axis < packed.ndim:
        raise ValueError(f"unpack_e2m1: axis={axis} out of range for packed shape "
                         f"{packed.shape}")
    axis = axis % packed.ndim
    n = packed.shape[axis]
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or (
            (int(length) + 1) // 2 != n or length < 0):
        raise ValueError(
            f"unpack_e2m1: length={length!r} does not match the packed size: axis {axis} "
            f"holds {n} bytes, i.e. length {2 * n} or {max(2 * n - 1, 0)}"
        )
    p = jnp.moveaxis(packed, axis, -1)
    codes = jnp.stack([p & 0xF, p >> 4], axis=-1).reshape(*p.shape[:-1], -1)[..., :length]
    lut = jnp.asarray(np.concatenate([E2M1_VALUES, -E2M1_VALUES]))
    return jnp.moveaxis(lut[codes.astype(jnp.int32)], -1, axis).astype(_F4)
