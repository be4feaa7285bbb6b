"""bf16 x bf16 GEMM with a runtime float32 scale in the epilogue, Hopper (sm_90), Pallas
Mosaic GPU.

``gemm_alpha(a, b, alpha)`` computes ``(alpha * (op(a) @ op(b))).astype(out_dtype)``: bf16
operands, float32 accumulation (``wgmma``), and the product with ``alpha`` (a float32
scalar in device memory) taken in float32 on the accumulator before the one rounding to
the output type. This is the GEMM of ``fp4jax.dot``'s kernel path: its operands are the
exact bf16 ``data * scale`` of NVFP4 tensors (``quantize.operand_sm90``) and ``alpha`` is
the product of the two tensor decode scales (NVFP4 paper Eq. 5; cuBLAS' alpha in
Transformer Engine's NVFP4 GEMM). XLA applies a runtime scalar only after the GEMM (cuBLAS
fuses constant alphas alone): the f32 result goes to memory and a separate pass scales and
converts it (~94 us per 8192^3 GEMM on an H200, plus the wider f32 write); here the scale
costs nothing.

Numerics: ``out = round(alpha * acc)``, ``acc`` the float32 sum of the exact bf16 products
in the tensor cores' accumulation order. XLA's path (``dot_general(...,
preferred_element_type=float32) * alpha``) rounds the same way from its own accumulation
order, so the two agree up to float32 accumulation-order rounding (not bit for bit).

Layouts: ``trans_a``: ``a`` is stored (K, M) (the wgrad GEMM's ``x``, contracted over
its first axis); ``trans_b``: ``b`` is stored (N, K) (the dgrad GEMM's weight). Both are
read by TMA in their stored orientation and handed to ``wgmma`` as transposed shared-
memory operands (16-bit types support both majors), so no transposed copy is written.

Kernel: persistent (one CTA per SM, output tiles in a planar snake order for L2 reuse),
warp-specialized (one memory warpgroup issuing TMA loads into a ``stages``-deep ring, two
compute warpgroups each owning a (tile_m, tile_n) accumulator: the CTA tile is
(tile_m, 2 tile_n)), epilogue through shared memory and TMA stores.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_compat as mc

__all__ = ["GemmConfig", "MIN_MKN", "gemm_alpha", "preferred", "reference", "supported"]


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tile shape: each of the two compute warpgroups owns a (tile_m, tile_n) f32
    accumulator; K advances by tile_k through a ``stages``-deep shared-memory ring;
    ``snake``: output tiles per band of the planar snake (L2 locality). The default was
    the fastest of three on an H200 at 8192^3 (run 27: 1,369-1,378 us, 0.97-0.98x XLA's
    bf16 cuBLAS dot for all three layouts; 128x128x64 with 4 stages 1,384-1,390 us)."""
    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 128
    stages: int = 2
    snake: int = 8


DEFAULT = GemmConfig()
EPI = 64  # epilogue piece (rows and columns) written per TMA store


MIN_MKN = 2**36
"""``preferred`` takes ``gemm_alpha`` over XLA's dot for ``M*K*N`` at least this (4096^3).
Measured on an H200 against XLA's f32 dot times a runtime alpha, per GEMM (run 30 sweep,
run 27): 0.94-0.96x at 4096^3 and 8192^3, 0.96-0.97x at 8192x2048x2048, 0.91-0.93x at
16384x512x2048 but 1.02-1.07x at 16384x2048x512 and 16384x512x256; and training the
`small` preset (GEMMs up to 16384x512x2048) ran at 448.5k tokens/s with every GEMM on
``gemm_alpha`` vs 488.5k with XLA's (run 30, same call). So below 2^36 XLA's GEMM stays."""


def preferred(m: int, k: int, n: int) -> bool:
    """Whether to use ``gemm_alpha`` (default tiles) for an M x K x N GEMM: supported and
    at least ``MIN_MKN``."""
    return supported(m, k, n) and m * k * n >= MIN_MKN


def supported(m: int, k: int, n: int, config: GemmConfig = DEFAULT) -> bool:
    """M % tile_m == 0, N % (2 tile_n) == 0, K % tile_k == 0."""
    tiles_ok = config.tile_m % EPI == 0 and config.tile_n % EPI == 0
    return (tiles_ok and m % config.tile_m == 0 and n % (2 * config.tile_n) == 0
            and k % config.tile_k == 0 and m > 0 and n > 0 and k > 0)


def _num_sms() -> int:
    try:
        return int(jax.devices()[0].core_count)
    except Exception:  # noqa: BLE001  (CPU lowering: an H100/H200 count)
        return 132


def reference(a, b, alpha, *, trans_a=False, trans_b=False, out_dtype=jnp.bfloat16):
    """XLA: ``(alpha * dot(op(a), op(b), f32)).astype(out_dtype)``."""
    a2 = a.T if trans_a else a
    b2 = b.T if trans_b else b
    acc = jnp.dot(a2, b2, preferred_element_type=jnp.float32,
                  precision=lax.Precision.HIGHEST)
    return (acc * jnp.asarray(alpha, jnp.float32)).astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("trans_a", "trans_b", "out_dtype", "config"))
def gemm_alpha(a: jax.Array, b: jax.Array, alpha: jax.Array, *, trans_a: bool = False,
               trans_b: bool = False, out_dtype=jnp.bfloat16,
               config: GemmConfig = DEFAULT) -> jax.Array:
    """``(alpha * (op(a) @ op(b))).astype(out_dtype)``.

    Args:
      a: bf16 (M, K), or (K, M) with ``trans_a``.
      b: bf16 (K, N), or (N, K) with ``trans_b``.
      alpha: float32 scalar (a traced value: read by the kernel from device memory).
      out_dtype: bfloat16 (default) or float32.
    Returns:
      (M, N) ``out_dtype``.
    """
    if a.dtype != jnp.bfloat16 or b.dtype != jnp.bfloat16:
        raise ValueError(f"gemm_alpha needs bf16 operands, got a {a.dtype}, b {b.dtype}")
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"gemm_alpha needs 2-D operands, got a {a.shape}, b {b.shape}")
    m, k = a.shape[::-1] if trans_a else a.shape
    k2, n = b.shape[::-1] if trans_b else b.shape
    if k != k2:
        raise ValueError(f"gemm_alpha: contraction sizes differ: a gives {k}, b {k2}")
    cfg = config
    if not supported(m, k, n, cfg):
        raise ValueError(f"gemm_alpha needs M % {cfg.tile_m} == 0, N % {2 * cfg.tile_n} == 0 "
                         f"and K % {cfg.tile_k} == 0, got M={m}, K={k}, N={n}")
    tm, tn, tk = cfg.tile_m, cfg.tile_n, cfg.tile_k
    ctn = 2 * tn  # CTA tile along N: two compute warpgroups side by side
    m_tiles, n_tiles, k_steps = m // tm, n // ctn, k // tk
    alpha = jnp.asarray(alpha, jnp.float32).reshape(1)

    a_block = (tk, tm) if trans_a else (tm, tk)
    b_block = (ctn, tk) if trans_b else (tk, ctn)

    def body(alpha_gmem, a_gmem, b_gmem, out_gmem):
        wg = lax.axis_index("wg")

        def pipeline(mma_body, compute_context):
            return plgpu.emit_pipeline_warp_specialized(
                mma_body,
                grid=(k_steps,),
                memory_registers=40,
                in_specs=[
                    plgpu.BlockSpec(a_block, (lambda s: (s, 0)) if trans_a
                                    else (lambda s: (0, s))),
                    plgpu.BlockSpec(b_block, (lambda s: (0, s)) if trans_b
                                    else (lambda s: (s, 0))),
                ],
                wg_axis="wg",
                num_compute_wgs=2,
                max_concurrent_steps=cfg.stages,
                compute_context=compute_context,
            )

        def ignore(*_, **__):
            return None

        @functools.partial(
            pl.run_scoped,
            allocs=pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem),
            out_smem=plgpu.SMEM((2, 2, EPI, EPI), out_gmem.dtype),  # (wg, slot, ...)
            collective_axes="wg",
        )
        def _scope(allocs, out_smem):
            @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sms")
            def _tile(info: plgpu.NDLoopInfo):
                (lin,) = info.index
                mi, ni = plgpu.planar_snake(lin, (m_tiles, n_tiles), 1, cfg.snake)
                rows = pl.ds(mi * tm, tm)
                cols = pl.ds(ni * ctn, ctn)
                my_cols = pl.ds(wg * tn, tn)

                def mma(_, a_smem, b_smem, acc_ref):
                    lhs = mc.transpose(a_smem, (1, 0)) if trans_a else a_smem
                    if trans_b:
                        rhs = mc.transpose(b_smem.at[my_cols, :], (1, 0))
                    else:
                        rhs = b_smem.at[:, my_cols]
                    plgpu.wgmma(acc_ref, lhs, rhs)
                    plgpu.wgmma_wait(0)
                    return acc_ref

                def epilogue(run):
                    @functools.partial(pl.run_scoped,
                                       acc_ref=plgpu.ACC((tm, tn), jnp.float32))
                    def _acc(acc_ref):
                        run(acc_ref)
                        out = (acc_ref[...] * alpha_gmem[0]).astype(out_gmem.dtype)
                        dst = out_gmem.at[rows, cols].at[:, my_cols]
                        # (EPI, EPI) pieces through two alternating slots: a slot is
                        # rewritten once the TMA store issued two pieces ago has read it
                        for i in range(tm // EPI):
                            for j in range(tn // EPI):
                                slot = (i * (tn // EPI) + j) % 2
                                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                                out_smem[wg, slot] = out[i * EPI:(i + 1) * EPI,
                                                         j * EPI:(j + 1) * EPI]
                                plgpu.commit_smem()
                                plgpu.copy_smem_to_gmem(
                                    out_smem.at[wg, slot],
                                    dst.at[pl.ds(i * EPI, EPI), pl.ds(j * EPI, EPI)])

                pipeline(mma, epilogue)(
                    a_gmem.at[:, rows] if trans_a else a_gmem.at[rows, :],
                    b_gmem.at[cols, :] if trans_b else b_gmem.at[:, cols],
                    allocations=allocs,
                )

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(_num_sms(),),
        grid_names=("sms",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(alpha, a, b)
