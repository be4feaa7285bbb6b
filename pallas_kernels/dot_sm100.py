"""``fp4jax.dot``'s Blackwell (sm_100+) backend: the recipe's NVFP4 GEMMs on block-scaled
FP4 tensor cores. ``implementation="native"``. **Not run on Blackwell hardware.**

Reference: ``fp4jax.backends.XLA``'s GEMM (einsum of ``scaled_data``, times alpha); the
operands are the reference's (``fp4jax.quantize``: SR, RHT, 2D, 4over6 as everywhere).
Kernels: ``gemm/blockscale_sm100.py`` (``jax.nn.scaled_matmul``), ``gemm/tcgen05_sm100.py``
(a Pallas ``tcgen05_mma`` GEMM, only under ``FP4JAX_KERNELS=tcgen05``). Equal to the
reference up to float32 accumulation order.

Not supported, because ... (each GEMM falls back to the reference): an operand that is not
NVFP4 blocked along the contracted axis (high precision, MXFP4, FP6/FP8: the block-scaled
instruction takes E2M1 with E4M3 scales of 16 along K, ``blockscale_sm100.operand_reason``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from fp4jax.backends import Backend, DotCall, NotSupported
from pallas_kernels.support import on_sm100

__all__ = ["NATIVE_MODES", "PROVIDER", "BlackwellBackend", "BlackwellProvider", "native_gemm",
           "native_mode"]

NATIVE_MODES = ("off", "scaled_matmul", "tcgen05")


def native_mode(setting: str | None = None) -> str:
    """Which backend runs ``fp4jax.dot``'s NVFP4 GEMMs natively under the
    ``FP4JAX_KERNELS`` setting (``fp4jax.backends.kernels_setting()``, read when None):
    ``"off"`` (the reference, or the Hopper kernels), ``"scaled_matmul"`` (``jax.nn.
    scaled_matmul`` on the library's quantized operands) or ``"tcgen05"`` (the Pallas
    kernel where it applies, else ``"scaled_matmul"``).

    Unset/``auto`` and ``on`` give ``"scaled_matmul"`` on an sm_100+ (Blackwell) GPU and
    ``"off"`` anywhere else; ``off``/``interpret`` give ``"off"``; ``native`` forces
    ``"scaled_matmul"`` on any device, the CPU included (JAX's CPU lowering of
    ``scaled_matmul`` from 0.11, the documented definition computed by
    ``blockscale_sm100.emulate`` before: for tests); ``tcgen05`` asks for the Pallas kernel,
    which is never chosen otherwise: it has not run on Blackwell hardware."""
    if setting is None:
        from fp4jax.backends import kernels_setting

        setting = kernels_setting()
    if setting == "native":
        return "scaled_matmul"
    if setting == "tcgen05":
        return "tcgen05"
    if setting in ("on", "auto"):
        return "scaled_matmul" if on_sm100() else "off"
    return "off"


def native_gemm(subscripts: str, a: Any, b: Any, *, out_dtype: Any,
                mode: str) -> jax.Array | None:
    """One of ``fp4jax.dot``'s GEMMs on the Blackwell backend ``mode`` (``native_mode``),
    or None where it does not apply (``mode == "off"``, or an operand that is not NVFP4
    blocked along the contracted axis: high-precision, MXFP4, FP6/FP8; the caller then runs
    the reference GEMM).

    ``a``, ``b``: ``fp4jax.dot``'s canonical quantized operands (``QuantizedArray``) for
    ``subscripts`` (``"bmk,bkn->bmn"``, ``"bmn,bkn->bmk"``, ``"bmk,bmn->bkn"``). Returns
    ``(sum_k (q_a s_a)(q_b s_b) * (dec_a * dec_b)).astype(out_dtype)``: the reference's
    value up to float32 accumulation order (``gemm/blockscale_sm100``)."""
    if mode not in NATIVE_MODES:
        raise ValueError(f"mode must be one of {NATIVE_MODES}, got {mode!r}")
    if mode == "off":
        return None
    from pallas_kernels.gemm import blockscale_sm100 as bs

    axes = bs.SUBSCRIPTS.get(subscripts)
    if axes is None:
        raise ValueError(f"native_gemm: unknown GEMM layout {subscripts!r}: use one of "
                         f"{sorted(bs.SUBSCRIPTS)}")
    if any(bs.operand_reason(q, ax) is not None for q, ax in zip((a, b), axes, strict=True)):
        return None
    if mode == "tcgen05" and on_sm100() and jnp.dtype(out_dtype) == jnp.bfloat16:
        from pallas_kernels.gemm import tcgen05_sm100 as tc

        if tc.available():
            y = tc.gemm(subscripts, a, b)  # None for shapes the kernel does not tile
            if y is not None:
                return y
    return bs.gemm(subscripts, a, b, out_dtype)


@dataclasses.dataclass(frozen=True)
class BlackwellBackend(Backend):
    """The sm_100+ backend: no operands of its own (the reference's), the NVFP4 GEMMs on
    ``native_gemm`` with ``mode`` ``"scaled_matmul"`` or ``"tcgen05"``."""

    name: ClassVar[str] = "native"
    mode: str = "scaled_matmul"

    def gemm_reason(self, subscripts, a, b, out_dtype):
        from pallas_kernels.gemm import blockscale_sm100 as bs

        axes = bs.SUBSCRIPTS.get(subscripts)
        if axes is None:
            return f"unknown GEMM layout {subscripts!r}"
        for op, ax in zip((a, b), axes, strict=True):
            if op.codes is None:
                return "an operand without codes (unquantized, or materialized values)"
            reason = bs.operand_reason(op.codes, ax)
            if reason is not None:
                return reason
        return None

    def gemm(self, subscripts, a, b, *, out_dtype, precision=None):
        return native_gemm(subscripts, a.codes, b.codes, out_dtype=out_dtype, mode=self.mode)


@dataclasses.dataclass(frozen=True)
class BlackwellProvider:
    """Chooses ``BlackwellBackend`` (``fp4jax.backends.Provider``): by name where this JAX
    lowers ``jax.nn.scaled_matmul`` on the default device (CUDA, and the CPU from JAX
    0.11); automatically where ``native_mode`` is not ``"off"``."""

    name: str = "native"
    priority: int = 20
    env_modes: tuple[str, ...] = ("native", "tcgen05")

    def backend(self, call: DotCall, mode: str, explicit: bool) -> Backend:
        if explicit:
            from pallas_kernels.gemm import blockscale_sm100 as bs

            platform = jax.devices()[0].platform
            if not bs.jax_lowers_on(platform):
                raise NotSupported(f"this JAX ({jax.__version__}) does not lower "
                                   f"jax.nn.scaled_matmul on {platform!r} (CUDA, or the CPU "
                                   "from JAX 0.11)")
            return BlackwellBackend("tcgen05" if mode == "tcgen05" else "scaled_matmul")
        native = native_mode(mode)
        if native == "off":
            raise NotSupported("no sm_100+ GPU (FP4JAX_KERNELS=native forces this backend)")
        return BlackwellBackend(native)


PROVIDER = BlackwellProvider()
"""The entry point ``fp4jax.backends`` loads (``pyproject.toml``)."""
