"""MXFP4 x MXFP4 GEMM on Hopper's FP8 tensor cores (sm_90a), Pallas Mosaic GPU.

``mxfp4_gemm(a_codes, a_scales, bt_codes, bt_scales)`` computes

    C[m, n] = sum_kb 2^(ea[m, kb] - 127) 2^(eb[n, kb] - 127) P_kb[m, n],
    P_kb[m, n] = sum_{k in block kb} a[m, k] b[n, k]

for MXFP4 operands (OCP MX v1.0: E2M1 elements, one UE8M0 scale per 32 elements along
K) given as their E2M1 values in ``float8_e4m3fn`` (every E2M1 value is an E4M3 value)
and their biased E8M0 exponents. Both operands are K-major: ``a_codes`` (M, K) and
``bt_codes`` (N, K), i.e. the GEMM is ``A @ Bt^T``. That is the only layout Hopper's
8-bit ``wgmma`` reads (PTX ISA, "wgmma.mma_async": for ``.e4m3``/``.e5m2`` operands in
shared memory only K-major is supported), so the three GEMMs of a linear layer map onto
it by which operand copy the quantizer writes: fprop ``x (T, K) @ W (K, N)`` takes ``x``
and ``W^T`` quantized along K; dgrad ``dy (T, N) @ W^T`` takes ``dy`` and ``W (K, N)``
(already N-contiguous); wgrad ``x^T (K, T) @ dy (T, N)`` takes ``x^T`` and ``dy^T``,
both quantized along T (the column-wise copies the recipe quantizes anyway).
:func:`k_major` turns a contraction-first operand into this layout with an XLA transpose.

Numerics (one rule, :func:`promote`; emulated in XLA by :func:`emulate`):
* each block's partial sum ``P_kb`` comes from one ``wgmma`` K=32 step into a zeroed
  accumulator and is exact: E2M1 x E2M1 products are multiples of 1/4 with magnitude
  <= 36, so a 32-long sum is an integer number of quarters of magnitude <= 1152 * 4 =
  4608 < 2^13, representable with 13 significant bits; it is exact in any adder that
  keeps >= 13 significant bits of a sum aligned to the largest product (<= 36 < 2^6, so
  a resolution of 2^(6-13) <= 1/4 suffices). Hopper's FP8 ``wgmma`` accumulation keeps
  about 14 bits (DeepSeek-V3 technical report, arXiv 2412.19437, sec. 3.3.2: "limited to
  retaining around 14 bits"), enough; tests/kernels/test_mxfp4_fp8wgmma.py checks the
  bound on every code pair and on adversarial blocks, and the GPU check compares
  bit for bit.
* promotion: ``acc <- acc + (P_kb * 2^(ea-127)) * 2^(eb-127)`` in float32, blocks in K
  order. ``P_kb * 2^(ea-127)`` is exact (13 significant bits; results down to 2^-149
  keep them, since P is a multiple of 1/4 and 2^(ea-127) >= 2^-127), so each block
  contributes its exact term rounded once (a second rounding only when the term itself
  leaves float32's normal range: below 2^-126 or above the largest float) and the sum
  rounds once per block. A zero block stays zero at any scale (no 0 * Inf); an E8M0 NaN
  (255) gives NaN.
So the GEMM equals the exact sum of the dequantized products up to float32 summation
rounding over K/32 terms: the class of difference of the XLA reference
(``fp4jax.dequantize`` then a float32 GEMM), which sums per element in its own order.

Kernel: persistent (one CTA per SM, planar-snake tile order), warp-specialized (one
memory warpgroup issuing TMA loads of codes and scales into a ``stages``-deep ring; two
compute warpgroups, each owning a (tile_m, tile_n) float32 accumulator in registers: CTA
tile (2 tile_m, tile_n)); per MX block a ``wgmma`` m64nNk32 into a fresh accumulator,
then the promotion on the CUDA cores, so one warpgroup's promotion overlaps the other's
``wgmma``. Scales travel as float32 powers of two (K/32, rows) prepared in XLA.
Cost model and measurements: docs/performance.md, "MXFP4 on FP8 tensor cores".
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

__all__ = ["BLOCK", "Config", "DEFAULT", "balanced_scales", "emulate", "k_major", "mxfp4_gemm",
           "promote", "scale_f32", "unsupported_reason"]

BLOCK = 32
"""MX block size along K (OCP MX v1.0), equal to one FP8 ``wgmma`` K step (PTX ISA:
``wgmma.mma_async.sp.sync.aligned.m64nNk32`` for ``.e4m3``/``.e5m2``)."""

E8M0_BIAS = 127
_F8 = jnp.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class Config:
    """Tiles: each of the two compute warpgroups owns a (tile_m, tile_n) float32
    accumulator (CTA tile (2 tile_m, tile_n)); K advances by tile_k (tile_k / 32 MX
    blocks) through a ``stages``-deep shared-memory ring; ``snake``: output tiles per band
    of the planar snake order (L2 locality)."""
    tile_m: int = 64
    tile_n: int = 128
    tile_k: int = 128
    stages: int = 4
    snake: int = 8


DEFAULT = Config()
EPI = 64  # epilogue piece (rows and columns) written per TMA store


# ---------------------------------------------------------------------------
# Numerics: the one rule, and its XLA emulation.
# ---------------------------------------------------------------------------


def _bits(e8m0) -> jax.Array:
    e = jnp.asarray(e8m0)
    if e.dtype == jnp.float8_e8m0fnu:
        e = lax.bitcast_convert_type(e, jnp.uint8)
    if e.dtype != jnp.uint8:
        raise TypeError(f"E8M0 scales must be uint8 exponent bits or float8_e8m0fnu, got {e.dtype}")
    return e


def scale_f32(e8m0) -> jax.Array:
    """Biased UE8M0 exponents (uint8 bits, or ``float8_e8m0fnu``) -> float32 ``2^(e-127)``
    (OCP MX v1.0 sec. 5.4: E8M0 value ``2^(e-127)``, ``0xFF`` NaN). ``e = 0`` gives 2^-127,
    a float32 subnormal, exact."""
    e = _bits(e8m0)
    ei = e.astype(jnp.int32) - E8M0_BIAS
    # exact: ldexp of 1 over the whole range (2^-127 subnormal, 2^127 normal)
    s = jnp.ldexp(jnp.ones(ei.shape, jnp.float32), ei)
    return jnp.where(e == 255, jnp.float32(jnp.nan), s)


def balanced_scales(a_exps, b_exps):
    """Per-block float32 factors ``(sa', sb')`` with ``sa'[m, kb] sb'[n, kb] = 2^(ea-127)
    2^(eb-127)``, shifted by a power of two per block column so that the promotion's
    intermediate ``P * sa'`` stays in float32's normal range.

    E8M0 spans 2^-127 .. 2^127 and a block sum |P| lies in [1/4, 1152], so ``P * 2^(ea-127)``
    alone leaves float32's normal range for ea < 3 or ea > 243. Block column kb moves A's
    exponents by ``c = 127 - floor((max_m ea + min_m ea) / 2)`` (centred on 2^0) and B's
    by ``-c``; a factor above 2^127 is clamped to 2^127 (finite: a zero block stays 0, never
    0 * Inf = NaN) and one below 2^-126 is 0 (no subnormal factor, whatever the hardware's
    denormal mode). Exponent 255 (NaN) stays NaN. For operands quantized from finite
    float32/bf16 data (E8M0 exponents 0 .. 253) both clamps act only on blocks whose terms
    are themselves outside float32's normal range, unless one block column of A spans
    more than ~2^116 across its rows.

    Args:
      a_exps: (M, K/32) E8M0 exponent bits (uint8 or float8_e8m0fnu); b_exps: (N, K/32).
    Returns:
      (sa' (K/32, M), sb' (K/32, N)) float32.
    """
    ea = _bits(a_exps).astype(jnp.int32).T  # (kb, M)
    eb = _bits(b_exps).astype(jnp.int32).T
    valid = ea != 255
    hi = jnp.max(jnp.where(valid, ea, 0), axis=1, keepdims=True)
    lo = jnp.min(jnp.where(valid, ea, 254), axis=1, keepdims=True)
    c = E8M0_BIAS - (hi + jnp.minimum(lo, hi)) // 2

    def pow2(e, nan):
        s = jnp.ldexp(jnp.ones(e.shape, jnp.float32), jnp.clip(e, -126, 127))
        s = jnp.where(e < -126, jnp.float32(0), s)  # below float32's normal range: 0
        return jnp.where(nan, jnp.float32(jnp.nan), s)

    return (pow2(ea - E8M0_BIAS + c, ~valid), pow2(eb - E8M0_BIAS - c, eb == 255))


def promote(acc, partial, sa_rows, sb_cols):
    """One MX block's promotion: ``acc + (partial * sa_rows[:, None]) * sb_cols[None, :]``
    in float32, with ``sa_rows``/``sb_cols`` the block's :func:`balanced_scales`. The
    product of a block sum (<= 13 significant bits) with normal powers of two is exact
    while it stays normal, so the block's term enters ``acc`` with one rounding.

    Args:
      acc: (M, N) float32 running sum.
      partial: (M, N) float32 exact block partial sums ``P_kb``.
      sa_rows: (M,) float32; sb_cols: (N,) float32.
    """
    return acc + (partial * sa_rows[:, None]) * sb_cols[None, :]


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def emulate(a_codes, a_scales, bt_codes, bt_scales, *, out_dtype=jnp.float32):
    """The kernel's arithmetic in XLA: per-32-block partial sums (exact in float32,
    computed at HIGHEST precision), promoted by :func:`promote` in K order.

    Args as :func:`mxfp4_gemm`. Returns (M, N) ``out_dtype``.
    """
    m, k = a_codes.shape
    n = bt_codes.shape[0]
    kb = k // BLOCK
    a = a_codes.astype(jnp.float32).reshape(m, kb, BLOCK)
    b = bt_codes.astype(jnp.float32).reshape(n, kb, BLOCK)
    parts = jnp.einsum("mbk,nbk->bmn", a, b, precision=lax.Precision.HIGHEST,
                       preferred_element_type=jnp.float32)
    sa, sb = balanced_scales(a_scales, bt_scales)  # (kb, M), (kb, N)

    def step(acc, xs):
        p, ra, rb = xs
        return promote(acc, p, ra, rb), None

    acc, _ = lax.scan(step, jnp.zeros((m, n), jnp.float32), (parts, sa, sb))
    return acc.astype(out_dtype)


# ---------------------------------------------------------------------------
# The kernel.
# ---------------------------------------------------------------------------


def unsupported_reason(m: int, k: int, n: int, *, a_dtype=_F8, b_dtype=_F8,
                       config: Config = DEFAULT) -> str | None:
    """None when :func:`mxfp4_gemm` runs an (M, K) x (N, K)^T problem, else why not."""
    c = config
    if jnp.dtype(a_dtype) != _F8 or jnp.dtype(b_dtype) != _F8:
        return f"codes must be float8_e4m3fn (E2M1 values), got {a_dtype} and {b_dtype}"
    if min(m, k, n) <= 0:
        return f"empty problem M={m}, K={k}, N={n}"
    if k % c.tile_k:
        return f"K={k} must be a multiple of tile_k={c.tile_k} (whole MX blocks per stage)"
    if m % (2 * c.tile_m):
        return f"M={m} must be a multiple of 2 tile_m = {2 * c.tile_m} (two warpgroups)"
    if n % c.tile_n:
        return f"N={n} must be a multiple of tile_n={c.tile_n}"
    if c.tile_m % 64 or c.tile_n % EPI or c.tile_k % BLOCK:
        return "tile_m must be a multiple of 64, tile_n of 64 and tile_k of 32"
    if c.tile_n > 128 or c.tile_m > 64:
        return "accumulator and partial must fit the registers: tile_m 64, tile_n <= 128"
    return None


def k_major(codes: jax.Array, scales: jax.Array):
    """An operand stored contraction-first, codes (K, R) with scales (K/32, R) (a weight
    ``W (K, N)`` for fprop; ``x (T, K)`` or ``dy (T, N)`` as wgrad operands, blocked along
    T), as the kernel reads it: codes (R, K), scales (R, K/32). FP8 ``wgmma`` reads only
    K-major operands, so this is an XLA transpose (one pass over the 1-byte codes); a
    quantizer that writes the K-major copy directly saves it."""
    if codes.ndim != 2 or scales.shape != (codes.shape[0] // BLOCK, codes.shape[1]):
        raise ValueError(f"k_major: codes (K, R) and scales (K/32, R) expected, got "
                         f"{codes.shape} and {scales.shape}")
    return codes.T, scales.T


def _num_sms() -> int:
    try:
        return int(jax.devices()[0].core_count)
    except Exception:  # noqa: BLE001  (CPU lowering: an H100/H200 count)
        return 132


@functools.partial(jax.jit, static_argnames=("out_dtype", "config"))
def mxfp4_gemm(a_codes: jax.Array, a_scales: jax.Array, bt_codes: jax.Array,
               bt_scales: jax.Array, *, out_dtype=jnp.bfloat16,
               config: Config = DEFAULT) -> jax.Array:
    """MXFP4 GEMM ``A @ Bt^T`` on FP8 ``wgmma`` with per-block float32 promotion.

    Args:
      a_codes: (M, K) float8_e4m3fn, E2M1 values of A (MX blocks along K).
      a_scales: (M, K/32) uint8 biased E8M0 exponents (or float8_e8m0fnu).
      bt_codes: (N, K) float8_e4m3fn, E2M1 values of B^T (blocks along K).
      bt_scales: (N, K/32) like ``a_scales``.
      out_dtype: bfloat16 (default) or float32: the float32 sum rounded once.
    Returns:
      (M, N) ``out_dtype``, equal to :func:`emulate` bit for bit where every promoted term
      is a normal float32 (module docstring).
    """
    m, k = a_codes.shape
    n, k2 = bt_codes.shape
    if k != k2:
        raise ValueError(f"mxfp4_gemm: contraction sizes differ: A has {k}, Bt {k2}")
    if a_scales.shape != (m, k // BLOCK) or bt_scales.shape != (n, k // BLOCK):
        raise ValueError(f"mxfp4_gemm: scales must be (M, K/32) and (N, K/32), got "
                         f"{a_scales.shape} and {bt_scales.shape}")
    reason = unsupported_reason(m, k, n, a_dtype=a_codes.dtype, b_dtype=bt_codes.dtype,
                                config=config)
    if reason is not None:
        raise ValueError(f"mxfp4_gemm: {reason}")
    cfg = config
    tm, tn, tk = cfg.tile_m, cfg.tile_n, cfg.tile_k
    ctm = 2 * tm  # CTA tile along M: two compute warpgroups stacked
    nb = tk // BLOCK
    m_tiles, n_tiles, k_steps = m // ctm, n // tn, k // tk
    sa, sb = balanced_scales(a_scales, bt_scales)  # (K/32, M), (K/32, N) float32
    # 32-byte swizzle with (8, 32) tiles: one MX block of K is one tile column, so a
    # block's slice of the stage is tile-aligned for wgmma
    transforms = (plgpu.TilingTransform((8, BLOCK)), plgpu.SwizzleTransform(BLOCK))

    def body(a_gmem, b_gmem, sa_gmem, sb_gmem, out_gmem):
        wg = lax.axis_index("wg")

        def pipeline(mma_body, compute_context):
            return plgpu.emit_pipeline_warp_specialized(
                mma_body,
                grid=(k_steps,),
                memory_registers=40,
                in_specs=[
                    plgpu.BlockSpec((ctm, tk), lambda s: (0, s), transforms=transforms),
                    plgpu.BlockSpec((tn, tk), lambda s: (0, s), transforms=transforms),
                    plgpu.BlockSpec((nb, ctm), lambda s: (s, 0)),
                    plgpu.BlockSpec((nb, tn), lambda s: (s, 0)),
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
            allocs=pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem, sa_gmem, sb_gmem),
            out_smem=plgpu.SMEM((2, 2, EPI, EPI), out_gmem.dtype),  # (wg, slot, ...)
            collective_axes="wg",
        )
        def _scope(allocs, out_smem):
            @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sms")
            def _tile(info: plgpu.NDLoopInfo):
                (lin,) = info.index
                mi, ni = plgpu.planar_snake(lin, (m_tiles, n_tiles), 1, cfg.snake)
                rows = pl.ds(mi * ctm, ctm)
                cols = pl.ds(ni * tn, tn)
                my_rows = pl.ds(wg * tm, tm)

                def mma(_, a_smem, b_smem, sa_smem, sb_smem, acc):
                    for j in range(nb):
                        ks = pl.ds(j * BLOCK, BLOCK)

                        def block(part_ref, ks=ks):
                            plgpu.wgmma(part_ref, a_smem.at[my_rows, ks],
                                        mc.transpose(b_smem.at[:, ks], (1, 0)))
                            return part_ref[...]

                        part = pl.run_scoped(block, plgpu.ACC((tm, tn), jnp.float32))
                        ra = mc.load(sa_smem.at[j, my_rows], layout=plgpu.Layout.WGMMA.reduce(1))
                        rb = mc.load(sb_smem.at[j], layout=plgpu.Layout.WGMMA.reduce(0))
                        acc = acc + ((part * lax.broadcast_in_dim(ra, (tm, tn), [0]))
                                     * lax.broadcast_in_dim(rb, (tm, tn), [1]))
                    return acc

                def epilogue(run):
                    acc0 = plgpu.layout_cast(jnp.zeros((tm, tn), jnp.float32),
                                             plgpu.Layout.WGMMA)
                    out = run(acc0).astype(out_gmem.dtype)
                    dst = out_gmem.at[rows, cols].at[my_rows, :]
                    for i in range(tm // EPI):
                        for jj in range(tn // EPI):
                            slot = (i * (tn // EPI) + jj) % 2
                            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                            out_smem[wg, slot] = out[i * EPI:(i + 1) * EPI,
                                                     jj * EPI:(jj + 1) * EPI]
                            plgpu.commit_smem()
                            plgpu.copy_smem_to_gmem(
                                out_smem.at[wg, slot],
                                dst.at[pl.ds(i * EPI, EPI), pl.ds(jj * EPI, EPI)])

                pipeline(mma, epilogue)(
                    a_gmem.at[rows, :], b_gmem.at[cols, :],
                    sa_gmem.at[:, rows], sb_gmem.at[:, cols],
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
    )(a_codes, bt_codes, sa, sb)
