"""Block-scaled formats: NVFP4, MXFP4 (paper and OCP scale rules), MXFP8 and MXFP6 (OCP MX
v1.0), and any ``BlockFormat``.

A format stores elements of an OCP MX element type (E2M1 by default: values 0, 0.5, 1,
1.5, 2, 3, 4, 6 and negatives; or FP6 E2M3/E3M2, FP8 E4M3/E5M2) with one scale per block
of ``block_size`` contiguous elements, and optionally one FP32 scale per tensor (NVFP4's
two-level scaling).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

from fp4jax import numerics

ScaleRule = Literal["nearest", "up", "ocp", "oas"]

__all__ = ["BlockFormat", "NVFP4", "NVFP4_E1M2", "MXFP4", "MXFP4_OCP", "MXFP4_OAS",
           "MXFP8_E4M3", "MXFP8_E5M2", "MXFP6_E2M3", "MXFP6_E3M2", "MXFP8_E4M3_UP",
           "MXFP8_E5M2_UP", "MXFP6_E2M3_UP", "MXFP6_E3M2_UP", "get_format", "FORMATS"]


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """A block-scaled format (frozen, hashable: usable as a static jit argument).

    Attributes:
      name: display name.
      block_size: elements per block (8..128). 2D scaling uses
        ``block_size x block_size`` tiles.
      scale_exp_bits, scale_man_bits: the unsigned ``ExMy`` block-scale format
        (E1M6 .. E8M0). E4M3 is ``float8_e4m3fn``'s magnitudes (max 448); E8M0 is
        OCP's UE8M0 (powers of two 2**-127 .. 2**127).
      tensor_scale: whether a per-tensor FP32 scale maps the tensor's amax to
        ``tensor_scale_target * elem_max`` first (NVFP4 paper Appendix B.1: 448 * 6).
        Without it the global decode scale is 1.0.
      scale_rule: how the block decode scale is put on the scale grid:
        ``"nearest"`` (RNE, satfinite: NVFP4/Transformer Engine), ``"up"`` (round
        up: the NVFP4 paper's MXFP4, Appendix B.4, and Transformer Engine's MXFP8; the
        block amax never exceeds ``elem_max`` after scaling, so it never saturates) or
        ``"ocp"`` (OCP MX v1.0 section 6.3: ``2**(floor(log2 amax) - emax_elem)``,
        ``emax_elem`` the element format's largest exponent; power-of-two scale formats
        only; a block amax may then saturate to ``elem_max``) or ``"oas"`` (Overflow-Aware
        Scaling, arXiv 2603.08713 as google/qwix implements it, its ``c = 12/7`` bias:
        ``2**floor(log2(amax * c / 6))``, the smallest power of two that keeps the block
        amax below 7, the rounding midpoint above 6; E2M1 elements and power-of-two scales
        only; ``fp4jax.quantization.oas_block_scale``).
      elem_exp_bits, elem_man_bits: the element data type, one of OCP MX v1.0's
        (section 5.3): ``(2, 1)`` E2M1 (FP4, the default), ``(2, 3)`` E2M3 and ``(3, 2)``
        E3M2 (FP6), ``(4, 3)`` E4M3 and ``(5, 2)`` E5M2 (FP8); or ``(1, 2)`` E1M2, the
        uniform 4-bit grid 0, 0.5, ..., 3.5 (UFP4's, arXiv 2606.20381); see
        ``numerics.element_grid``. Elements round to nearest even or stochastically and
        saturate to ``elem_max`` (never Inf/NaN). Every format, the two-level NVFP4-style
        scaling included, works with every element type: ``"nearest"``/``"up"`` map the
        block amax to ``elem_max``, a tensor scale maps the tensor amax to
        ``tensor_scale_target * elem_max``.
      scale_ieee: the block scale follows the IEEE convention (IEEE 754-2019 sec. 3.4:
        the all-ones exponent is Inf/NaN; E5M2 max 57,344, E4M3 max 240) instead of the
        ``e4m3fn`` one (only the all-ones code is NaN; E5M2 98,304, E4M3 448). Same grid
        for ExM0. See ``numerics.unsigned_grid``.

    Example:
      >>> fmt = BlockFormat("nvfp4-b32", block_size=32)          # NVFP4 with 32-blocks
      >>> fmt = BlockFormat("e3m4-b16", 16, scale_exp_bits=3, scale_man_bits=4)
      >>> fmt = BlockFormat("e5m2ieee-b16", 16, 5, 2, scale_ieee=True)
      >>> fmt = BlockFormat("nvfp8", 16, elem_exp_bits=4, elem_man_bits=3)  # E4M3 x E4M3
    """

    name: str
    block_size: int = 16
    scale_exp_bits: int = 4
    scale_man_bits: int = 3
    tensor_scale: bool = True
    scale_rule: ScaleRule = "nearest"
    elem_exp_bits: int = 2
    elem_man_bits: int = 1
    scale_ieee: bool = False

    def __post_init__(self):
        if not isinstance(self.block_size, int) or not 8 <= self.block_size <= 128:
            raise ValueError(
                f"BlockFormat.block_size must be an int in 8..128, got {self.block_size!r}"
            )
        if not isinstance(self.scale_ieee, bool):
            raise TypeError(f"BlockFormat.scale_ieee must be True or False, got "
                            f"{self.scale_ieee!r}")
        # Validates the ExMy combination (raises ValueError naming the format).
        numerics.unsigned_grid(self.scale_exp_bits, self.scale_man_bits, ieee=self.scale_ieee)
        elem = (self.elem_exp_bits, self.elem_man_bits)
        if elem not in numerics.ELEMENT_FORMATS:
            valid = ", ".join(f"{k} {g.name}" for k, g in numerics.ELEMENT_FORMATS.items())
            raise ValueError(
                f"BlockFormat(elem_exp_bits={self.elem_exp_bits!r}, elem_man_bits="
                f"{self.elem_man_bits!r}) is not an OCP MX element format: use one of "
                f"(elem_exp_bits, elem_man_bits) = {valid}")
        if self.scale_rule not in ("nearest", "up", "ocp", "oas"):
            raise ValueError(
                f"BlockFormat.scale_rule must be 'nearest', 'up', 'ocp' or 'oas', got "
                f"{self.scale_rule!r}")
        if self.scale_rule in ("ocp", "oas") and self.scale_man_bits != 0:
            raise ValueError(f"BlockFormat.scale_rule={self.scale_rule!r} needs a power-of-two "
                             f"scale (ExM0), got scale_man_bits={self.scale_man_bits}")
        if self.scale_rule == "oas" and elem != (2, 1):
            raise ValueError(
                "BlockFormat.scale_rule='oas' is defined for E2M1 elements (its bias, "
                f"c = 12/7, is derived for E2M1's max 6), got elem_exp_bits={elem[0]}, "
                f"elem_man_bits={elem[1]}: use scale_rule='up' or 'ocp' for other elements")

    @property
    def scale_grid(self) -> numerics.FloatGrid:
        """The block-scale grid (unsigned ExMy; ``e4m3fn`` or, with ``scale_ieee``, IEEE
        special codes: ``numerics.unsigned_grid``)."""
        return numerics.unsigned_grid(self.scale_exp_bits, self.scale_man_bits,
                                      ieee=self.scale_ieee)

    @property
    def elem_grid(self) -> numerics.FloatGrid:
        """The element grid (``numerics.element_grid``: OCP MX v1.0 section 5.3)."""
        return numerics.element_grid(self.elem_exp_bits, self.elem_man_bits)

    @property
    def elem_max(self) -> float:
        """Largest element magnitude: 6 (E2M1), 7.5 (E2M3), 28 (E3M2), 448 (E4M3), 57,344
        (E5M2)."""
        return self.elem_grid.max_value

    @property
    def elem_bits(self) -> int:
        """Bits of one stored element: 4 (FP4), 6 (FP6) or 8 (FP8)."""
        return 1 + self.elem_exp_bits + self.elem_man_bits

    @property
    def data_dtype(self):
        """Storage dtype of ``QuantizedArray.data``: ``float4_e2m1fn`` (E2M1),
        ``float8_e4m3fn`` (E4M3), ``float8_e5m2`` (E5M2). FP6 elements are held in
        ``float8_e4m3fn``, which represents every E2M3 and E3M2 value exactly (XLA has no
        float6 arrays on CPU); ``nbytes_packed`` still counts them as 6 bits."""
        return {(2, 1): jnp.float4_e2m1fn, (5, 2): jnp.float8_e5m2}.get(
            (self.elem_exp_bits, self.elem_man_bits), jnp.float8_e4m3fn)

    @property
    def scaled_bits(self) -> int:
        """Significant bits of an element times its block scale, ``data * scale``: at most
        ``(elem_man_bits + 1) + (scale_man_bits + 1)`` (the product of two binary
        significands). bfloat16 holds 8, float32 24: ``fp4jax.dot`` runs a format's GEMM
        on bfloat16 operands when this is <= 8 (E2M1 with scales of <= 5 mantissa bits,
        E4M3 or E2M3 elements with <= 3, E5M2 or E3M2 with <= 4), else on float32; either
        way each operand, and each product of two (<= 24 bits), is exact."""
        return (self.elem_man_bits + 1) + (self.scale_man_bits + 1)

    @property
    def scale_dtype(self):
        """Storage dtype of ``QuantizedArray.scale``.

        ``float8_e4m3fn`` for E4M3 (with ``scale_ieee`` too: its values are a subset),
        ``float8_e8m0fnu`` for E8M0, ``float8_e5m2`` for IEEE E5M2; other ExMy formats have
        no JAX dtype and are stored in float32 (every value is exactly on the format's
        grid).
        """
        bits = (self.scale_exp_bits, self.scale_man_bits)
        if bits == (4, 3):
            return jnp.float8_e4m3fn
        if bits == (8, 0):
            return jnp.float8_e8m0fnu
        if bits == (5, 2) and self.scale_ieee:
            return jnp.float8_e5m2
        return jnp.float32

    @property
    def scale_max(self) -> float:
        return self.scale_grid.max_value

    @property
    def tensor_scale_target(self) -> float:
        """The block-scale value the tensor amax is mapped to by the tensor scale (the
        tensor amax itself goes to ``tensor_scale_target * elem_max``).

        ``scale_max`` (448 for E4M3: NVFP4 paper Eq. 1), capped at ``2**17`` for
        the wide formats (E6M1, E7M0, E8M0) whose ``scale_max * elem_max`` would overflow
        float32 or push the decode scale into subnormals; E5M2 (98304) and
        narrower formats are uncapped.
        """
        return min(self.scale_max, 2.0**17)

    def replace(self, **changes) -> BlockFormat:
        """A copy with some fields changed (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)


NVFP4 = BlockFormat("nvfp4", block_size=16, scale_exp_bits=4, scale_man_bits=3,
                    tensor_scale=True, scale_rule="nearest")
"""NVFP4: E2M1, blocks of 16, E4M3 block scale (RNE), FP32 tensor scale (NVFP4 paper sec. 2)."""

MXFP4 = BlockFormat("mxfp4", block_size=32, scale_exp_bits=8, scale_man_bits=0,
                    tensor_scale=False, scale_rule="up")
"""MXFP4 as the NVFP4 paper runs it: blocks of 32, UE8M0 scale rounded up (Appendix B.4)."""

MXFP4_OCP = BlockFormat("mxfp4_ocp", block_size=32, scale_exp_bits=8, scale_man_bits=0,
                        tensor_scale=False, scale_rule="ocp")
"""MXFP4 per the OCP MX v1.0 spec: scale ``2**(floor(log2 amax) - 2)`` (may saturate)."""

MXFP4_OAS = MXFP4.replace(name="mxfp4_oas", scale_rule="oas")
"""MXFP4 with Overflow-Aware Scaling (arXiv 2603.08713; google/qwix's ``c = 12/7`` bias):
scale ``2**floor(log2(amax / 3.5))``, so the block amax maps into [3.5, 7) and at most the
part in [6, 7) saturates to 6 (which round-to-nearest would give it anyway); see
``fp4jax.quantization.oas_block_scale``."""


NVFP4_E1M2 = NVFP4.replace(name="nvfp4_e1m2", elem_exp_bits=1, elem_man_bits=2)
"""NVFP4's two-level scaling (blocks of 16, E4M3 block scales, FP32 tensor scale) with the
uniform E1M2 elements 0, 0.5, ..., 3.5 instead of E2M1: the block amax maps to 3.5, the
tensor amax to 448 x 3.5. The grid is UFP4's (arXiv 2606.20381, "uniform grids
(E1M2/INT4)"); the scaling is NVFP4's, a choice of fp4jax: the paper's block size, scale
format and scale rule could not be read here (only its abstract), so this is not claimed to
be UFP4's format."""


def _mx(name: str, elem: tuple[int, int], rule: str) -> BlockFormat:
    """An OCP MX v1.0 concrete format (section 5, table 1): blocks of 32, UE8M0 scales, no
    tensor scale, elements ``elem``."""
    return BlockFormat(name, block_size=32, scale_exp_bits=8, scale_man_bits=0,
                       tensor_scale=False, scale_rule=rule, elem_exp_bits=elem[0],
                       elem_man_bits=elem[1])


MXFP8_E4M3 = _mx("mxfp8_e4m3", (4, 3), "ocp")
"""MXFP8 with E4M3 elements per the OCP MX v1.0 spec: scale ``2**(floor(log2 amax) - 8)``,
so the block amax lands in [256, 512) and values above 448 saturate."""
MXFP8_E5M2 = _mx("mxfp8_e5m2", (5, 2), "ocp")
"""MXFP8 with E5M2 elements (OCP MX v1.0): scale ``2**(floor(log2 amax) - 15)``."""
MXFP6_E2M3 = _mx("mxfp6_e2m3", (2, 3), "ocp")
"""MXFP6 with E2M3 elements (OCP MX v1.0): scale ``2**(floor(log2 amax) - 2)``."""
MXFP6_E3M2 = _mx("mxfp6_e3m2", (3, 2), "ocp")
"""MXFP6 with E3M2 elements (OCP MX v1.0): scale ``2**(floor(log2 amax) - 4)``."""

MXFP8_E4M3_UP = MXFP8_E4M3.replace(name="mxfp8_e4m3_up", scale_rule="up")
"""MXFP8 E4M3 with the scale rounded up (``scale_rule="up"``: no block amax saturates), as
Transformer Engine's MXFP8 quantizer computes it: scale ``float_to_e8m0(amax * (1/448))``
rounded toward +inf (``quantize_mxfp8.cuh``; ``ptx::float_to_e8m0`` is
``cvt.rp.satfinite.ue8m0x2.f32``), elements the ``satfinite`` RNE cast of ``x * 2**-e``.
The formula is the same float32 arithmetic (not tested against TE itself here); where TE's
scale would be 2**-127 (all-zero blocks, and blocks with ``amax * (1/448) <= 2**-127``,
i.e. amax below ~6e-36) fp4jax's is 2**-126, its smallest float32-normal E8M0 value: the
same zeros for all-zero blocks, possibly other elements for such tiny ones."""
MXFP8_E5M2_UP = MXFP8_E5M2.replace(name="mxfp8_e5m2_up", scale_rule="up")
"""MXFP8 E5M2 with the scale rounded up (TE's MXFP8 rule with E5M2's max 57,344)."""
MXFP6_E2M3_UP = MXFP6_E2M3.replace(name="mxfp6_e2m3_up", scale_rule="up")
"""MXFP6 E2M3 with the scale rounded up (the NVFP4 paper's MXFP4 rule, Appendix B.4)."""
MXFP6_E3M2_UP = MXFP6_E3M2.replace(name="mxfp6_e3m2_up", scale_rule="up")
"""MXFP6 E3M2 with the scale rounded up (the NVFP4 paper's MXFP4 rule, Appendix B.4)."""

FORMATS = {f.name: f for f in (NVFP4, NVFP4_E1M2, MXFP4, MXFP4_OCP, MXFP4_OAS, MXFP8_E4M3,
                               MXFP8_E5M2, MXFP6_E2M3, MXFP6_E3M2, MXFP8_E4M3_UP, MXFP8_E5M2_UP,
                               MXFP6_E2M3_UP, MXFP6_E3M2_UP)}


def get_format(fmt: BlockFormat | str) -> BlockFormat:
    """Resolve a format or its name; unknown names raise ValueError listing the valid ones."""
    if isinstance(fmt, BlockFormat):
        return fmt
    if isinstance(fmt, str):
        key = fmt.lower()
        if key in FORMATS:
            return FORMATS[key]
        raise ValueError(
            f"unknown format {fmt!r}; valid names: {sorted(FORMATS)} "
            "(or pass a fp4jax.BlockFormat(...))"
        )
    raise TypeError(f"fmt must be a fp4jax.BlockFormat or a format name, got {type(fmt).__name__}")
