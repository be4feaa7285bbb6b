"""NVFP4 x NVFP4 GEMM on Blackwell's block-scaled tensor cores with the tensor scales in the
epilogue, Pallas Mosaic GPU (``plgpu.tcgen05_mma(..., a_scale=, b_scale=)``).

UNVERIFIED: this kernel has never run. There is no Blackwell GPU here; what was checked
is that it traces and lowers to a Mosaic GPU custom call for an sm_100 target on the CPU
(``tests/kernels/test_blackwell.py``: ``jax.export`` for CUDA with Mosaic GPU's target arch set to
10.0, which runs Mosaic GPU's Python-side checks of ``tcgen05_mma``: operand and scale
dtypes, shapes, TMEM layouts, the instruction descriptor). Not checked: PTX generation
and ptxas for sm_100a, execution, numerics, speed. It is therefore chosen only when
``FP4JAX_KERNELS=tcgen05`` asks for it on an sm_100+ GPU (``dispatch.native_mode``); by
default Blackwell runs ``blockscale_sm100`` (``jax.nn.scaled_matmul``).
The Blackwell check's ``tcgen05`` step (docs/blackwell.md) is the test it must pass on
hardware before it may be chosen by default.

What it computes: ``out = bf16(alpha * acc)``, ``acc = sum_k (q_a s_a)(q_b s_b)`` in float32
on the tensor cores (``kind::mxf4nvf4``: E2M1 operands, E4M3 scales, one scale per 16
elements along K), ``alpha = dec_a * dec_b`` (the NVFP4 tensor decode scales, cuBLAS'
alpha, NVFP4 paper Eq. 5): the product with alpha in float32 and the one rounding to bf16
in the epilogue, which XLA's ``scaled_matmul`` path does in a separate pass over a float32
result. Same value as ``blockscale_sm100.gemm`` up to float32 accumulation order.

Operands (from ``blockscale_sm100.kmajor_operand``): a (M, K) and b (N, K) E2M1, K-major
(4-bit tcgen05 operands must be K-major); scales in the 128x4 tiled layout of
``blockscale_sm100.swizzle_scales_128x4``, which ``plgpu.async_copy_scales_to_tmem`` copies
from shared to tensor memory (JAX's own test, ``tests/pallas/mosaic_gpu_test.py``
``test_collective_scaled_matmul``, tag jax-v0.10.2 and jax-v0.11.0, lays scales out so).

Kernel: deliberately minimal. One CTA per 128 x 128 output tile; K in steps of 256
elements (128 bytes a row: the 128-byte swizzle), each step: TMA loads of both operand
tiles and their scale tiles into shared memory, the scales copied to tensor memory, one
block-scaled MMA into the tensor-memory accumulator, wait. No multi-stage pipeline, no
warp specialization, no 2-CTA MMA: performance is not the point until it is shown exact.

API: ``plgpu.tcgen05_mma`` with ``a_scale``/``b_scale``, ``plgpu.async_copy_scales_to_tmem``
and ``plgpu.TMEMLayout.SCALES_LAYOUT`` exist in JAX 0.10.2 and 0.11.0 (read in the source at
those tags, ``jax/_src/pallas/mosaic_gpu/primitives.py`` and
``jax/experimental/mosaic/gpu/tcgen05.py``: E4M3 scales select block 16 in 0.10.2, and
0.11.0 infers the block from the scale shape and checks E4M3 => 16); ``available()``
gates on them.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_compat as mc
from pallas_kernels.gemm import blockscale_sm100 as bs

__all__ = ["TILE_K", "TILE_M", "TILE_N", "available", "gemm", "gemm_alpha_nvfp4",
           "supported"]

TILE_M = 128  # tcgen05 M of a 1-CTA block-scaled MMA (M=64 is unsupported there)
TILE_N = 128
TILE_K = 256  # E2M1 elements per row per step: 128 bytes, one 128-byte swizzle span
_SWIZZLE = 128


def available() -> bool:
    """Whether this JAX has the block-scaled ``tcgen05_mma`` API the kernel uses."""
    mma = getattr(plgpu, "tcgen05_mma", None)
    layout = getattr(plgpu, "TMEMLayout", None)
    return (mma is not None and hasattr(plgpu, "async_copy_scales_to_tmem")
            and layout is not None and hasattr(layout, "SCALES_LAYOUT")
            and "a_scale" in inspect.signature(mma).parameters)


def supported(m: int, k: int, n: int) -> bool:
    """M % 128, N % 128 and K % 256 == 0 (K after ``kmajor_operand``'s padding)."""
    return m > 0 and n > 0 and k > 0 and not (m % TILE_M or n % TILE_N or k % TILE_K)


@jax.jit
def gemm_alpha_nvfp4(a: jax.Array, b: jax.Array, sa: jax.Array, sb: jax.Array,
                     alpha: jax.Array) -> jax.Array:
    """``bf16(alpha * sum_k (a s_a)(b s_b))`` on the tensor cores. UNVERIFIED (module
    docstring).

    Args:
      a: (M, K) ``float4_e2m1fn``, b: (N, K) ``float4_e2m1fn`` (K-major both).
      sa: (M/128, K/64, 32, 16), sb: (N/128, K/64, 32, 16) ``float8_e4m3fn``: the (M, K/16)
        and (N, K/16) block scales through ``blockscale_sm100.swizzle_scales_128x4``.
      alpha: float32 scalar.
    Returns:
      (M, N) bfloat16.
    """
    (m, k), (n, k2) = a.shape, b.shape
    if a.dtype != jnp.float4_e2m1fn or b.dtype != jnp.float4_e2m1fn:
        raise ValueError(f"gemm_alpha_nvfp4: a and b must be float4_e2m1fn, got {a.dtype}, "
                         f"{b.dtype}")
    if k != k2 or not supported(m, k, n):
        raise ValueError(f"gemm_alpha_nvfp4 needs a (M, K), b (N, K) with M % {TILE_M}, "
                         f"N % {TILE_N}, K % {TILE_K} == 0, got a {a.shape}, b {b.shape}")
    want_sa, want_sb = (m // 128, k // 64, 32, 16), (n // 128, k // 64, 32, 16)
    if sa.shape != want_sa or sb.shape != want_sb or not (
            sa.dtype == sb.dtype == jnp.float8_e4m3fn):
        raise ValueError(f"gemm_alpha_nvfp4: scales must be float8_e4m3fn {want_sa} and "
                         f"{want_sb} (swizzle_scales_128x4), got {sa.dtype} {sa.shape}, "
                         f"{sb.dtype} {sb.shape}")
    groups = TILE_K // (bs.BLOCK * 4)  # 128x4 scale tiles per K step
    k_steps = k // TILE_K
    elems = 8 * _SWIZZLE // 4  # E2M1 elements per 128-byte swizzled row
    op_tf = (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(_SWIZZLE))
    alpha = jnp.asarray(alpha, jnp.float32).reshape(1)

    def body(alpha_gmem, a_gmem, b_gmem, sa_gmem, sb_gmem, out_gmem,
             a_smem, b_smem, sa_smem, sb_smem, out_smem, tma_bar, mma_bar,
             acc_tmem, sa_tmem, sb_tmem):
        mi, ni = jax.lax.axis_index("m"), jax.lax.axis_index("n")
        rows, cols = pl.ds(mi * TILE_M, TILE_M), pl.ds(ni * TILE_N, TILE_N)

        @pl.loop(0, k_steps)
        def _step(ks):
            ksl = pl.ds(ks * TILE_K, TILE_K)
            gsl = pl.ds(ks * groups, groups)
            plgpu.copy_gmem_to_smem(a_gmem.at[rows, ksl], a_smem, tma_bar)
            plgpu.copy_gmem_to_smem(b_gmem.at[cols, ksl], b_smem, tma_bar)
            plgpu.copy_gmem_to_smem(sa_gmem.at[pl.ds(mi, 1), gsl], sa_smem, tma_bar)
            plgpu.copy_gmem_to_smem(sb_gmem.at[pl.ds(ni, 1), gsl], sb_smem, tma_bar)
            plgpu.barrier_wait(tma_bar)
            plgpu.async_copy_scales_to_tmem(sa_smem, sa_tmem)
            plgpu.async_copy_scales_to_tmem(sb_smem, sb_tmem)
            plgpu.tcgen05_mma(acc_tmem, a_smem, mc.transpose(b_smem, (1, 0)),
                              a_scale=sa_tmem, b_scale=sb_tmem, accumulate=ks > 0)
            plgpu.tcgen05_commit_arrive(mma_bar)
            plgpu.barrier_wait(mma_bar)  # the next step overwrites the shared tiles

        acc = plgpu.async_load_tmem(acc_tmem)
        plgpu.wait_load_tmem()
        out_smem[...] = (acc * alpha_gmem[0]).astype(jnp.bfloat16)  # the one rounding
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[rows, cols])
        plgpu.wait_smem_to_gmem(0)

    scratch = (
        plgpu.SMEM((TILE_M, TILE_K), jnp.float4_e2m1fn, transforms=op_tf),
        plgpu.SMEM((TILE_N, TILE_K), jnp.float4_e2m1fn, transforms=op_tf),
        plgpu.SMEM((1, groups, 32, 16), jnp.float8_e4m3fn),
        plgpu.SMEM((1, groups, 32, 16), jnp.float8_e4m3fn),
        plgpu.SMEM((TILE_M, TILE_N), jnp.bfloat16),
        plgpu.Barrier(num_arrivals=4),
        plgpu.Barrier(orders_tensor_core=True),
        plgpu.TMEM((TILE_M, TILE_N), jnp.float32),
        plgpu.TMEM((TILE_M, TILE_K // bs.BLOCK), jnp.float8_e4m3fn,
                   layout=plgpu.TMEMLayout.SCALES_LAYOUT),
        plgpu.TMEM((TILE_N, TILE_K // bs.BLOCK), jnp.float8_e4m3fn,
                   layout=plgpu.TMEMLayout.SCALES_LAYOUT),
    )
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
        grid=(m // TILE_M, n // TILE_N),
        grid_names=("m", "n"),
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Lane),
    )(alpha, a, b, sa, sb)


def gemm(subscripts: str, qa, qb) -> jax.Array | None:
    """``blockscale_sm100.gemm(subscripts, qa, qb, bfloat16)`` on this kernel, or None where
    it does not tile the problem (a batch dimension B > 1, M or N not a multiple of 128, K
    after ``K_ALIGN`` padding not a multiple of 256). UNVERIFIED (module docstring)."""
    ca, cb = bs.SUBSCRIPTS[subscripts]
    a, sa = bs.kmajor_operand(qa, ca)
    b, sb = bs.kmajor_operand(qb, cb)
    if a.shape[0] != 1 or not supported(a.shape[1], a.shape[2], b.shape[1]):
        return None
    swz = functools.partial(bs.swizzle_scales_128x4)
    y = gemm_alpha_nvfp4(a[0], b[0], swz(sa[0]), swz(sb[0]),
                         qa.global_scale * qb.global_scale)
    return y[None]
