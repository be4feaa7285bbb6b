"""Packed-NVFP4 weight GEMM for Hopper (sm_90), Pallas Mosaic GPU: ``y = x @ W``.

W4A16: ``x`` (M, K) bfloat16, ``W`` (K, N) NVFP4 (E2M1 codes, E4M3 scale per 16
consecutive k, FP32 tensor decode scale). The kernel computes ``y^T = W^T x^T`` so that
the FP4 operand is wgmma's register operand A (rows = n) and the activations are the
shared-memory operand B = ``x^T`` (K, M):

* A chunk for one 16-k scale block: the 64x16 E2M1 codes of a warpgroup's rows are
  decoded to bf16 with integer bit operations (Mosaic GPU on Hopper cannot convert
  float4): code ``s e1 e0 m`` -> bf16 bits ``s`` at 15, ``e1 e0 m`` at 8..6, times 2^126;
  code magnitude 1 (0.5) would pass through a bf16 subnormal, so it is selected
  directly (no reliance on denormal handling). The result is multiplied by the block
  scale (E4M3 decoded with integer ops, broadcast along the row): ``q * s`` is exact
  in bf16 (2 x 4 significant bits), so wgmma sees exactly the dequantized weights
  (without the tensor scale).
* wgmma m64 nM k16 accumulates in float32; the tensor decode scale multiplies the
  accumulator in the epilogue. Results equal ``x @ dequantize(W)`` up to float32
  accumulation order.

Kernel-native weight layout (made once by :func:`prepare_weight`):

* ``wq`` (N, K/2) uint8: for each pair of 16-blocks (g0, g1) of a row, 16 bytes whose
  byte j holds the code of element j of g0 (low nibble) and of g1 (high nibble), so
  that the low (high) nibbles of a 16-byte group are one whole scale block;
* ``ws`` (K/16, N) uint8: E4M3 scale bits, one row per k-block (contiguous along n).

Grid: one CTA per 64 rows of ``W^T`` and per K split (split-K; the partial f32
results are summed by XLA), each pipelining its K range through shared memory (TMA).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

TILE_N = 64  # rows of W^T per warpgroup (wgmma M)


# ---------------------------------------------------------------------------
# Kernel-native weight layout (XLA, done once per weight).
# ---------------------------------------------------------------------------


def native_from_codes(codes_kn: jax.Array, scale_bits_kn: jax.Array):
    """(K, N) uint8 codes and (K/16, N) uint8 E4M3 scale bits -> (wq, ws) kernel layout."""
    k, n = codes_kn.shape
    if k % 32:
        raise ValueError(f"K must be a multiple of 32, got {k}")
    c = codes_kn.T.reshape(n, k // 32, 2, 16).astype(jnp.uint8)
    wq = (c[:, :, 0, :] | (c[:, :, 1, :] << 4)).reshape(n, k // 2)
    return wq, scale_bits_kn.astype(jnp.uint8)


def prepare_weight(q):
    """Kernel layout of an ``fp4jax.QuantizedArray`` W (K, N) scaled along K.

    Accepts 1x16 blocks along axis 0 (scale (K/16, N)) or 16x16 tiles (scale
    (K/16, N/16), repeated along n). Returns (wq, ws, dec).
    """
    from fp4jax.quantize import e2m1_codes

    if q.fmt.block_size != 16 or not q.fmt.tensor_scale:
        raise ValueError("prepare_weight supports NVFP4 weights")
    codes = e2m1_codes(q.data)
    sb = lax.bitcast_convert_type(q.scale, jnp.uint8)
    if q.block_2d:
        sb = jnp.repeat(sb, 16, axis=1)[:, : codes.shape[1]]
    elif q.axis % q.ndim != 0:
        raise ValueError("W must be quantized along its contraction axis (axis=0)")
    wq, ws = native_from_codes(codes, sb)
    return wq, ws, q.global_scale


# ---------------------------------------------------------------------------
# In-register decoding.
# ---------------------------------------------------------------------------


def _decode_e2m1(c, safe_subnormal: bool = False):
    """int16 codes (0..15) -> bfloat16 values times 2^-126, with integer ops.

    Code bits ``s e1 e0 m`` go to bf16 bits 15 and 8..6, which is the code's value times
    2^-126 (the caller folds 2^126 into the scale). Code 1 (0.5) becomes the bf16
    subnormal 2^-127: exact wherever the following multiply keeps subnormals (bf16
    multiplies on sm_90 do; experiments/gpu_check_matmul.py checks it).
    ``safe_subnormal=True`` selects a subnormal-free path (about 2x the decode cost).
    """
    if safe_subnormal:
        m = c & 7
        v = lax.bitcast_convert_type(m << 6, jnp.bfloat16) * jnp.bfloat16(2.0**126)
        v = jnp.where(m == 1, jnp.bfloat16(0.5), v)
        bits = lax.bitcast_convert_type(v, jnp.int16) | ((c & 8) << 12)
        return lax.bitcast_convert_type(bits, jnp.bfloat16) * jnp.bfloat16(2.0**-126)
    bits = ((c << 12) & -0x8000) | ((c << 6) & 0x1C0)
    return lax.bitcast_convert_type(bits, jnp.bfloat16)


def _decode_e2m1_hi(b):
    """Like _decode_e2m1 for the high nibble of int16 bytes ``b`` (no shift needed)."""
    bits = ((b << 8) & -0x8000) | ((b << 2) & 0x1C0)
    return lax.bitcast_convert_type(bits, jnp.bfloat16)


def _decode_e4m3(b):
    """uint8 E4M3 bits (non-negative scales) -> float32 values, with integer ops."""
    b = b.astype(jnp.int32)
    e = lax.shift_right_logical(b, 3)
    m = b & 7
    normal = lax.bitcast_convert_type(((e + 120) << 23) | (m << 20), jnp.float32)
    sub = m.astype(jnp.float32) * jnp.float32(2.0**-9)
    return jnp.where(e == 0, sub, normal)


# ---------------------------------------------------------------------------
# W4A16 kernel.
# ---------------------------------------------------------------------------


def _swizzle_transforms(row_bytes: int, itemsize: int):
    swz = plgpu.find_swizzle(row_bytes * 8)
    return (plgpu.TilingTransform((8, swz // itemsize)), plgpu.SwizzleTransform(swz))


@functools.partial(
    jax.jit, static_argnames=("tile_k", "split_k", "stages", "out_dtype", "safe_subnormal")
)
def w4a16_matmul(
    x: jax.Array,
    wq: jax.Array,
    ws: jax.Array,
    dec: jax.Array,
    *,
    tile_k: int = 256,
    split_k: int | None = None,
    stages: int | None = None,
    out_dtype=jnp.bfloat16,
    safe_subnormal: bool = False,
):
    """``x (M, K) bf16 @ W`` with W in the kernel layout (``prepare_weight``) -> (M, N)."""
    m, k = x.shape
    n = wq.shape[0]
    if wq.shape != (n, k // 2) or ws.shape != (k // 16, n):
        raise ValueError(f"weight layout mismatch: x {x.shape}, wq {wq.shape}, ws {ws.shape}")
    if n % TILE_N or k % tile_k:
        raise ValueError(f"N must be a multiple of {TILE_N} and K of {tile_k}: N={n}, K={k}")
    if m > 256:
        raise ValueError(f"M <= 256 supported by the W4A16 kernel, got {m}")
    mp = next(p for p in (16, 32, 64, 128, 256) if p >= m)  # B rows of >= 32 bytes
    k_iters = k // tile_k
    n_tiles = n // TILE_N
    if split_k is None:  # several CTAs per SM (132 SMs) to hide memory latency
        split_k = next((s for s in (1, 2, 4, 8, 16) if n_tiles * s >= 512), 16)
        while k_iters % split_k:
            split_k //= 2
    ks = k_iters // split_k  # k tiles per CTA
    stage_bytes = tile_k * mp * 2 + TILE_N * tile_k // 2 + (tile_k // 16) * TILE_N
    if stages is None:
        stages = max(1, min(2 if split_k > 1 else 4, (160 * 1024) // stage_bytes))
    xt = jnp.pad(x.astype(jnp.bfloat16), ((0, mp - m), (0, 0))).T  # (K, Mp): B operand
    sc = jnp.pad(jnp.reshape(dec.astype(jnp.float32) * jnp.float32(512.0), (1,)), (0, 3))
    x_tf = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))  # 16-k row chunks
    w_tf = _swizzle_transforms(tile_k // 2, 1)
    nblk = tile_k // 16

    def body(sc_gmem, xt_gmem, wq_gmem, ws_gmem, out_gmem, out_smem):
        ni = lax.axis_index("n")
        si = lax.axis_index("split")

        @functools.partial(pl.run_scoped, acc=plgpu.ACC((TILE_N, mp), jnp.float32))
        def _(acc):
            def step(_, xt_smem, wq_smem, ws_smem):
                byts = wq_smem[...]  # (64, tile_k / 2) uint8, WGMMA register layout
                b16 = byts.astype(jnp.int16)
                if safe_subnormal:
                    lo_all = _decode_e2m1(b16 & 15, True)
                    hi_all = _decode_e2m1(lax.shift_right_logical(b16, jnp.int16(4)), True)
                else:
                    lo_all, hi_all = _decode_e2m1(b16), _decode_e2m1_hi(b16)
                for p in range(nblk // 2):
                    cols = slice(16 * p, 16 * p + 16)
                    for h, vals in enumerate((lo_all[:, cols], hi_all[:, cols])):
                        g = 2 * p + h
                        srow = plgpu.load(
                            ws_smem, (g, slice(None)), layout=plgpu.Layout.WGMMA.reduce(1)
                        )
                        # block scale * 2^117: with the codes' 2^-126 the products are
                        # q * s * 2^-9, exact normal bf16; 2^9 goes to the epilogue
                        s = (_decode_e4m3(srow) * jnp.float32(2.0**117)).astype(jnp.bfloat16)
                        a = vals * lax.broadcast_in_dim(s, (TILE_N, 16), (0,))
                        plgpu.wgmma(acc, a, xt_smem.at[pl.ds(16 * g, 16), :])
                plgpu.wgmma_wait(0)

            plgpu.emit_pipeline(
                step,
                grid=(ks,),
                in_specs=[
                    plgpu.BlockSpec((tile_k, mp), lambda j: (si * ks + j, 0), transforms=x_tf),
                    plgpu.BlockSpec((TILE_N, tile_k // 2), lambda j: (ni, si * ks + j),
                                    transforms=w_tf),
                    plgpu.BlockSpec((nblk, TILE_N), lambda j: (si * ks + j, ni)),
                ],
                max_concurrent_steps=min(stages, ks),
            )(xt_gmem, wq_gmem, ws_gmem)
            out_smem[...] = acc[...] * sc_gmem[0]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[si, pl.ds(ni * TILE_N, TILE_N)])
            plgpu.wait_smem_to_gmem(0)

    out = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((split_k, n, mp), jnp.float32),
        grid=(n_tiles, split_k),
        grid_names=("n", "split"),
        scratch_types=dict(out_smem=plgpu.SMEM((TILE_N, mp), jnp.float32)),
    )(sc, xt, wq, ws)
    y = out.sum(0) if split_k > 1 else out[0]
    return y[:, :m].T.astype(out_dtype)


def reference_w4a16(x, wq, ws, dec):
    """XLA reference on the kernel layout: x @ ((q * s) * dec) in float32."""
    n, kh = wq.shape
    k = kh * 2
    lo = (wq & 15).reshape(n, k // 32, 1, 16)
    hi = (wq >> 4).reshape(n, k // 32, 1, 16)
    codes = jnp.concatenate([lo, hi], axis=2).reshape(n, k)
    lut = jnp.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6],
                    jnp.float32)
    q = lut[codes.astype(jnp.int32)]
    s = lax.bitcast_convert_type(ws, jnp.float8_e4m3fn).astype(jnp.float32).T  # (N, K/16)
    w = (q * jnp.repeat(s, 16, axis=1)) * dec
    return jnp.dot(x.astype(jnp.float32), w.T, precision=lax.Precision.HIGHEST)
