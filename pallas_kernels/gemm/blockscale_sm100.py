"""The recipe's GEMMs on Blackwell's (sm_100+) block-scaled FP4 tensor cores, through XLA:
``jax.nn.scaled_matmul`` on fp4jax's own quantized operands.

``fp4jax.dot`` quantizes every operand with the library's quantizers (``fp4jax.quantize``:
stochastic rounding, the RHT, 16x16 weight tiles, 4over6 stay exactly the library's); this
module only re-lays the resulting ``QuantizedArray``s out for the hardware and runs

    y = scaled_matmul(codes_a, codes_b, scales_a, scales_b) [float32] * (dec_a * dec_b)

cast once to the output dtype: the block scales inside the GEMM, the two tensor decode
scales as cuBLAS' alpha on the float32 result (NVFP4 paper Eq. 5; Transformer Engine's
NVFP4 GEMM), as ``fp4jax.dot``'s XLA path computes ``einsum(data * scale) * alpha``.

Semantics of ``jax.nn.scaled_matmul(lhs (B, M, K), rhs (B, N, K), lhs_scales (B, M, K/16),
rhs_scales (B, N, K/16), preferred_element_type)`` (read in JAX's source, tags
``jax-v0.10.2`` and ``jax-v0.11.0``: ``jax/_src/nn/functions.py``,
``jax/_src/cudnn/scaled_matmul_stablehlo.py``): ``einsum('BMK,BNK->BMN', a * repeat(sa, 16),
b * repeat(sb, 16))``; the block size is ``K // scales.shape[-1]``; cuDNN on Blackwell takes
``float4_e2m1fn`` operands with ``float8_e4m3fn`` scales at block 16 (NVFP4). On CUDA it
lowers to the custom call ``__op$block_scaled_dot``, which XLA's
``BlockScalingRewriter`` (openxla/xla ``xla/service/gpu/transforms/
block_scaling_rewriter.cc``) turns into a cuDNN fusion when cuDNN supports it, padding and
swizzling the scales itself (``swizzle_scales_128x4`` is that layout), and otherwise into
an XLA "dequantize to ``preferred_element_type``, then dot" composite. JAX 0.10.2 has no
CPU lowering (``NotImplementedError: MLIR translation rule for primitive 'scaled_matmul'
not found for platform cpu``); JAX 0.11.0 added one that upcasts operands and scales to
``preferred_element_type``, multiplies and calls ``dot_general``. Where JAX has none,
``scaled_matmul`` here computes the documented definition itself (``emulate``).

Numerics. Every product ``(q_a s_a)(q_b s_b)`` is exact in float32 (E2M1 x E4M3 values
have at most 6 significant bits), so the result equals the XLA path's up to the order of
the float32 accumulation; the alpha product and the final cast are the same operations in
the same order. On the CPU both paths run XLA's float32 dot over the same values and agree
bit for bit (``tests/kernels/test_blackwell.py``); on a Blackwell GPU cuDNN's accumulation order is
its own, measured by the Blackwell check of docs/blackwell.md. Not run on Blackwell hardware.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax.quantization import QuantizedArray

__all__ = ["BLOCK", "K_ALIGN", "SUBSCRIPTS", "emulate", "gemm", "jax_lowers_on",
           "kmajor_operand", "operand_reason", "scaled_matmul", "swizzle_scales_128x4"]

BLOCK = 16
"""NVFP4's block: 16 E2M1 elements share one E4M3 scale (the only block size cuDNN and
tcgen05 take with E4M3 scales)."""

K_ALIGN = 64
"""The contraction axis is zero-padded to a multiple of this (codes +0, scales +0: each
padded product is exactly 0). Assumed, not measured: tcgen05's ``kind::mxf4nvf4`` MMA
steps K by 64 and one 128x4 scale tile (``swizzle_scales_128x4``) spans 64 elements of K;
cuDNN's own alignment rule for FP4 is not documented in the sources read here."""

SUBSCRIPTS = {  # fp4jax.dot's three GEMMs: (contracted axis of a, of b)
    "bmk,bkn->bmn": (2, 1),  # fprop: x (B, M, K) @ w (B, K, N)
    "bmn,bkn->bmk": (2, 2),  # dgrad: dy (B, M, N) @ w^T, w stored (B, K, N)
    "bmk,bmn->bkn": (1, 1),  # wgrad: x^T @ dy, contracted over the tokens M
}


def operand_reason(q, contract_axis: int) -> str | None:
    """None when ``q`` (a canonical 3-D ``fp4jax.QuantizedArray``) can feed the native GEMM
    contracted over ``contract_axis`` (1 or 2), else why not: it must be NVFP4-shaped
    (E2M1 elements, E4M3 block scales, block 16, a float32 tensor scale) and blocked along
    the contracted axis (1x16 along it, or 16x16 tiles)."""
    if not isinstance(q, QuantizedArray):
        return "operand is not quantized (high precision)"
    f = q.fmt
    if (f.elem_exp_bits, f.elem_man_bits) != (2, 1) or q.data.dtype != jnp.float4_e2m1fn:
        return f"elements must be E2M1 (float4_e2m1fn), got format {f.name!r}"
    if q.scale.dtype != jnp.float8_e4m3fn or f.block_size != BLOCK:
        return (f"block scales must be float8_e4m3fn at block {BLOCK} (NVFP4), got "
                f"{q.scale.dtype} at block {f.block_size}")
    if q.ndim != 3 or jnp.ndim(q.global_scale) != 0:
        return f"need a canonical (B, R, C) operand with one tensor scale, got {q.shape}"
    if not q.block_2d and q.axis % q.ndim != contract_axis:
        return (f"blocks run along axis {q.axis % q.ndim}, the GEMM contracts axis "
                f"{contract_axis}")
    return None


def kmajor_operand(q, contract_axis: int) -> tuple[jax.Array, jax.Array]:
    """The operand layout ``jax.nn.scaled_matmul`` reads, from a ``QuantizedArray``.

    ``q``: canonical (B, X, Y) NVFP4 (``operand_reason`` is None), contracted over
    ``contract_axis`` (1: X, 2: Y). Returns ``(codes, scales)``: ``codes``
    ``float4_e2m1fn`` (B, R, Kp), the contracted axis last (K-major: what tcgen05 reads
    for 4-bit operands) and zero-padded to ``Kp``, a multiple of ``K_ALIGN``; ``scales``
    ``float8_e4m3fn`` (B, R, Kp/16), scale ``[b, r, j]`` applying to ``codes[b, r,
    16j:16j+16]``. 16x16 weight tiles (NVFP4 paper sec. 4.2) are replicated to this 1x16
    layout: each tile's scale serves the 16 rows of the tile, the last tile sliced to the
    rows that exist. Padded blocks get scale +0. Values are unchanged: ``codes * scales``
    is ``fp4jax.quantization.scaled_data(q)`` with the contracted axis moved last.
    """
    if (reason := operand_reason(q, contract_axis)) is not None:
        raise ValueError(f"kmajor_operand: {reason}")
    b, x, y = q.shape
    data, s = q.data, q.scale
    if q.block_2d:  # (B, ceil(X/16), ceil(Y/16)): expand the free axis to single rows
        free = 3 - contract_axis
        s = jnp.repeat(s, BLOCK, axis=free)
        s = jax.lax.slice_in_dim(s, 0, q.shape[free], axis=free)
    if contract_axis == 1:
        data, s = jnp.swapaxes(data, 1, 2), jnp.swapaxes(s, 1, 2)
    k = data.shape[-1]
    kp = -(-k // K_ALIGN) * K_ALIGN
    if kp != k:
        data = jnp.pad(data, ((0, 0), (0, 0), (0, kp - k)))
    if s.shape[-1] != kp // BLOCK:
        s = jnp.pad(s, ((0, 0), (0, 0), (0, kp // BLOCK - s.shape[-1])))
    del b, x, y
    return data, s


def swizzle_scales_128x4(scales: jax.Array) -> jax.Array:
    """Block scales (R, C) in the hardware's tiled layout, as (ceil(R/128), ceil(C/4), 32, 16).

    The rule (one place in fp4jax): pad R to a multiple of 128 and C to a multiple of 4
    with zeros; scale ``[r, c]`` then goes to ``[r // 128, c // 4, r % 32,
    4 * ((r % 128) // 32) + c % 4]``, i.e. every 128x4 tile of scales is stored as 512
    contiguous bytes, tiles row-major over (row tile, column tile), and inside a tile the
    byte offset of ``(r, c)`` is ``16 * (r % 32) + 4 * (r // 32) + c``.

    Sources: the cuBLAS documentation, section "1D Block Scaling Factors Layout"
    (https://docs.nvidia.com/cuda/cublas/index.html#d-block-scaling-factors-layout), which
    is the PTX ISA's tcgen05 "scale factor A/B layout 1X"
    (https://docs.nvidia.com/cuda/parallel-thread-execution/#tcgen05-mma-scale-factor-a-layout-1x),
    as cited by the code this was checked against: XLA's ``PrepareScalingOperand``
    (openxla/xla commit 34e57fdc, ``xla/service/gpu/transforms/block_scaling_rewriter.cc``:
    reshape [N*128, C*4] -> [N, 4, 32, C, 4], transpose to [N, C, 32, 4, 4]; what XLA does to
    ``jax.nn.scaled_matmul``'s scales before cuDNN) and JAX's Mosaic GPU test of
    ``plgpu.tcgen05_mma(..., a_scale=, b_scale=)`` (``tests/pallas/mosaic_gpu_test.py``,
    ``format_scales``, tag ``jax-v0.11.0``: the shared-memory layout
    ``plgpu.async_copy_scales_to_tmem`` reads). Those two pages were not readable here;
    the per-element formula above is tested against a NumPy loop over it
    (``tests/kernels/test_blackwell.py``).

    Args:
      scales: (R, C), any dtype (E4M3 for NVFP4).
    Returns:
      (ceil(R/128), ceil(C/4), 32, 16), the same dtype.
    """
    if scales.ndim != 2:
        raise ValueError(f"swizzle_scales_128x4: scales must be 2-D (R, C), got shape "
                         f"{scales.shape}")
    r, c = scales.shape
    rp, cp = -(-r // 128) * 128, -(-c // 4) * 4
    s = jnp.pad(scales, ((0, rp - r), (0, cp - c)))
    s = s.reshape(rp // 128, 4, 32, cp // 4, 4)  # [rt, (r%128)//32, r%32, ct, c%4]
    return s.transpose(0, 3, 2, 1, 4).reshape(rp // 128, cp // 4, 32, 16)


def jax_lowers_on(platform: str) -> bool:
    """Whether this JAX lowers ``jax.nn.scaled_matmul`` on ``platform``: always on CUDA
    (cuDNN or XLA's dequantize-and-dot fallback) and ROCm; on the CPU from JAX 0.11.0
    (JAX 0.10.2 has no CPU lowering)."""
    if platform in ("cuda", "gpu", "rocm"):
        return True
    return tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11)


def emulate(a: jax.Array, b: jax.Array, sa: jax.Array, sb: jax.Array) -> jax.Array:
    """``jax.nn.scaled_matmul``'s documented definition in float32: ``einsum('BMK,BNK->BMN',
    a * repeat(sa, K // Ka), b * repeat(sb, K // Kb))`` (``jax/_src/nn/functions.py``),
    each product exact (E2M1 x E4M3), float32 accumulation. For JAX versions without a
    CPU lowering of ``scaled_matmul``."""
    def scaled(x, s):
        blk = x.shape[-1] // s.shape[-1]
        return x.astype(jnp.float32) * jnp.repeat(s.astype(jnp.float32), blk, axis=-1)

    return jnp.einsum("bmk,bnk->bmn", scaled(a, sa), scaled(b, sb),
                      preferred_element_type=jnp.float32,
                      precision=jax.lax.Precision.HIGHEST)


def scaled_matmul(a: jax.Array, b: jax.Array, sa: jax.Array, sb: jax.Array) -> jax.Array:
    """``jax.nn.scaled_matmul(a, b, sa, sb, preferred_element_type=float32)``: a (B, M, K),
    b (B, N, K) ``float4_e2m1fn``; sa (B, M, K/16), sb (B, N, K/16) ``float8_e4m3fn``;
    returns (B, M, N) float32. Where this JAX cannot lower it on the CPU (before 0.11), a
    computation placed on the CPU runs ``emulate`` (the same definition) instead: the
    choice is made per platform at lowering time (``lax.platform_dependent``)."""
    def native(a, b, sa, sb):
        return jax.nn.scaled_matmul(a, b, sa, sb, preferred_element_type=jnp.float32)

    if jax_lowers_on("cpu"):
        return native(a, b, sa, sb)
    return jax.lax.platform_dependent(a, b, sa, sb, cpu=emulate, default=native)


def gemm(subscripts: str, qa, qb, out_dtype) -> jax.Array:
    """One of ``fp4jax.dot``'s GEMMs on two NVFP4 ``QuantizedArray``s:
    ``(scaled_matmul(...) * (dec_a * dec_b)).astype(out_dtype)``.

    Args:
      subscripts: ``"bmk,bkn->bmn"`` (fprop), ``"bmn,bkn->bmk"`` (dgrad) or
        ``"bmk,bmn->bkn"`` (wgrad), the canonical layouts of ``fp4jax.dot``.
      qa, qb: canonical 3-D NVFP4 operands, blocked along the contracted axis
        (``operand_reason`` is None for both).
      out_dtype: the output dtype (the one rounding from float32).
    Returns:
      the einsum's output shape in ``out_dtype``.
    """
    ca, cb = SUBSCRIPTS[subscripts]
    a, sa = kmajor_operand(qa, ca)
    b, sb = kmajor_operand(qb, cb)
    y = scaled_matmul(a, b, sa, sb)
    # cuBLAS-style alpha = dec_a * dec_b, one float32 product, as fp4jax.dot's XLA path
    return (y * (qa.global_scale * qb.global_scale)).astype(out_dtype)


def numpy_reference(qa_codes: np.ndarray, qa_scales: np.ndarray, qb_codes: np.ndarray,
                    qb_scales: np.ndarray) -> np.ndarray:
    """float64 ``scaled_matmul`` of K-major NumPy operands (exact for K*max|product| below
    2^53 in magnitude terms): for tests and the hardware check."""
    a = qa_codes.astype(np.float64) * np.repeat(qa_scales.astype(np.float64), BLOCK, -1)
    b = qb_codes.astype(np.float64) * np.repeat(qb_scales.astype(np.float64), BLOCK, -1)
    return np.einsum("bmk,bnk->bmn", a, b)
