"""Block-scaled FP4 formats: NVFP4, MXFP4 (paper and OCP scale rules) and any ``BlockFormat``.

Every format stores E2M1 elements (values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and
negatives) with one scale per block of ``block_size`` contiguous elements, and
optionally one FP32 scale per tensor (NVFP4's two-level scaling).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

from fp4jax import numerics

ScaleRule = Literal["nearest", "up", "ocp"]

__all__ = ["BlockFormat", "NVFP4", "MXFP4", "MXFP4_OCP", "get_format", "FORMATS"]


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """A block-scaled E2M1 format (frozen, hashable: usable as a static jit argument).

    Attributes:
      name: display name.
      block_size: elements per block (8..128). 2D scaling uses
        ``block_size x block_size`` tiles.
      scale_exp_bits, scale_man_bits: the unsigned ``ExMy`` block-scale format
        (E1M6 .. E8M0). E4M3 is ``float8_e4m3fn``'s magnitudes (max 448); E8M0 is
        OCP's UE8M0 (powers of two 2**-127 .. 2**127).
      tensor_scale: whether a per-tensor FP32 scale maps the tensor's amax to
        ``scale_max * 6`` first (NVFP4 paper Appendix B.1). Without it the global
        decode scale is 1.0.
      scale_rule: how the block decode scale is put on the scale grid:
        ``"nearest"`` (RNE, satfinite: NVFP4/Transformer Engine), ``"up"`` (round
        up: the NVFP4 paper's MXFP4, Appendix B.4, never saturates the block
        amax) or ``"ocp"`` (OCP MX v1.0 section 6.3: ``2**(floor(log2 amax) - 2)``,
        power-of-two scale formats only).

    Example:
      >>> fmt = BlockFormat("nvfp4-b32", block_size=32)          # NVFP4 with 32-blocks
      >>> fmt = BlockFormat("e3m4-b16", 16, scale_exp_bits=3, scale_man_bits=4)
    """

    name: str
    block_size: int = 16
    scale_exp_bits: int = 4
    scale_man_bits: int = 3
    tensor_scale: bool = True
    scale_rule: ScaleRule = "nearest"

    def __post_init__(self):
        if not isinstance(self.block_size, int) or not 8 <= self.block_size <= 128:
            raise ValueError(
                f"BlockFormat.block_size must be an int in 8..128, got {self.block_size!r}"
            )
        # Validates the ExMy combination (raises ValueError naming the format).
        numerics.unsigned_grid(self.scale_exp_bits, self.scale_man_bits)
        if self.scale_rule not in ("nearest", "up", "ocp"):
            raise ValueError(
                f"BlockFormat.scale_rule must be 'nearest', 'up' or 'ocp', got {self.scale_rule!r}"
            )
        if self.scale_rule == "ocp" and self.scale_man_bits != 0:
            raise ValueError("BlockFormat.scale_rule='ocp' needs a power-of-two scale (ExM0)")

    @property
    def scale_grid(self) -> numerics.FloatGrid:
        """The block-scale grid (unsigned ExMy, NaN code reserved)."""
        return numerics.unsigned_grid(self.scale_exp_bits, self.scale_man_bits)

    @property
    def scale_dtype(self):
        """Storage dtype of ``QuantizedArray.scale``.

        ``float8_e4m3fn`` for E4M3, ``float8_e8m0fnu`` for E8M0; other ExMy
        formats have no JAX dtype and are stored in float32 (every value is
        exactly on the format's grid).
        """
        if (self.scale_exp_bits, self.scale_man_bits) == (4, 3):
            return jnp.float8_e4m3fn
        if (self.scale_exp_bits, self.scale_man_bits) == (8, 0):
            return jnp.float8_e8m0fnu
        return jnp.float32

    @property
    def scale_max(self) -> float:
        return self.scale_grid.max_value

    @property
    def tensor_scale_target(self) -> float:
        """The block-scale value the tensor amax is mapped to by the tensor scale.

        ``scale_max`` (448 for E4M3: NVFP4 paper Eq. 1), capped at ``2**17`` for
        the wide formats (E6M1, E7M0, E8M0) whose ``scale_max * 6`` would overflow
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

FORMATS = {f.name: f for f in (NVFP4, MXFP4, MXFP4_OCP)}


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
