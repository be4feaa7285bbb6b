"""W4A16 GEMM for decode and small batches on Hopper (sm_90), Pallas Mosaic GPU.

``y = x @ W``: ``x`` (M, K) bfloat16 with M <= 256, ``W`` (K, N) NVFP4 (E2M1 codes, one
E4M3 scale per 16 consecutive k, an FP32 tensor decode scale). At decode sizes the
kernel is bound by how many instructions it spends per weight, so the weight is stored
in a kernel layout (made once, :func:`prepare_weight`) that makes the decode cheap:

* **Codes** ``wp`` (N, K/8) uint32. Each 32-bit word holds 8 codes whose bits sit where
  rotates and masks turn them into four bf16x2 registers of wgmma's A fragment
  (:func:`decode_words`, 9 integer operations per 8 weights): code bits ``s e1 e0 m``
  land on bf16 bits 15 and 8..6, which is the code's value times 2^-126 (code 0.5 is
  the bf16 subnormal 2^-127, kept by the bf16 multiply that follows; checked on the GPU).
  Word ``8c + 2q + v`` of row n carries, for slot i = 0..3 and half t = 0..1, the code of
  ``k = 64c + 16i + 8v + 2q + t``: exactly the (row n, columns ``8v + 2q + t``) elements
  that thread ``q`` of a quad holds in the WGMMA register layout of the 64x16 A tile of
  the k-block ``4c + i`` (:func:`word_layout` is the single place this is defined).
* **Scales** ``ws`` (K/16, N) bfloat16: the E4M3 block scales times 2^117 (exact in
  bf16), so the kernel needs one bf16 multiply per two weights and no E4M3 decode;
  ``(q * 2^-126) * (s * 2^117) = q * s * 2^-9`` is exact in bf16 (2 x 4 significant
  bits, normal for every E4M3 scale), and the epilogue multiplies the f32 accumulator by
  ``2^9 * dec``. The results equal ``x @ dequantize(W)`` up to f32 accumulation order.

The kernel computes ``y^T = W^T x^T``: the weights are wgmma's register operand A (rows =
n, 64 per warpgroup), the activations its shared-memory operand B = ``x^T`` (K, Mp).
Grid: one CTA per 64 rows of ``W^T`` and per K split (split-K, partial f32 results
summed by XLA), each pipelining its K range through shared memory (TMA).

Sources: the NVFP4 format and scale rule are the NVIDIA paper's Appendix B (see
``fp4jax.numerics``); the idea of an offline weight permutation into the tensor-core
register fragment order so that a few 32-bit integer operations decode several weights
is Marlin's (Frantar et al., 2024, "MARLIN: Mixed-Precision Auto-Regressive Parallel
Inference on Large Language Models"), applied here to E2M1 codes and wgmma.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from fp4jax.quantization import e2m1_codes
from pallas_kernels import mosaic_compat as mc

TILE_N = 64  # rows of W^T per warpgroup (wgmma M)
SCALE_SHIFT = 117  # block scales are stored times 2^117; codes decode to value * 2^-126
MASK = 0x81C081C0  # bf16x2 bits 15, 8..6 of both halves

# Where the code bits (s, e1, e0, m) of slot i (0..3), half t (0..1) sit in a word.
# Decoded, they must land on bf16x2 bits (15, 8, 7, 6) + 16 t. Slots 0..2 are those
# positions rotated right by 0, 4, 10 (decoded by one rotate and one mask); slot 3 takes
# the 8 remaining bits, decoded by a left shift by 6 and a right shift by 2 and two
# masks. Three translates of the decoded positions cannot tile 32 bits with a fourth
# (checked exhaustively), so 9 operations per word is the floor of this scheme. (Slot 3
# uses plain shifts: a rotate whose mask needs both of its halves became shl + shr + or
# in the PTX of run 35.)
_ROT = (0, 4, 10)
_DECODED = ((15, 8, 7, 6), (31, 24, 23, 22))
_SLOT3 = ((9, 10, 1, 0), (25, 26, 17, 16))  # << 6 brings s, e0, m home; >> 2 brings e1
_SLOT_BITS = tuple(
    tuple(tuple((p - r) % 32 for p in _DECODED[t]) for t in range(2)) for r in _ROT
) + (_SLOT3,)
_SLOT3_MASK6 = 0x80C080C0  # bits 15, 7, 6 of both halves
_SLOT3_MASK2 = 0x01000100  # bit 8 of both halves


def word_layout(k: int) -> np.ndarray:
    """Index map of the packed words: ``(K/8, 8)`` array of k indices.

    Row ``w`` of the result lists the k of the 8 codes of word ``w`` of a weight row, in
    (slot i, half t) order ``(0,0), (0,1), (1,0), ..., (3,1)``: word ``8c + 2q + v``
    holds ``k = 64c + 16i + 8v + 2q + t``. This is wgmma's m64nNk16 A-fragment layout
    (PTX ISA, "Register Fragments" of ``wgmma.mma_async`` for .bf16: thread ``q = lane % 4``
    of a quad holds columns ``2q, 2q+1, 8+2q, 8+2q+1`` of a row), with four k-blocks of 16
    sharing each word so that one 32-bit load feeds four wgmma steps.
    """
    if k % 64:
        raise ValueError(f"K must be a multiple of 64, got {k}")
    c, q, v, i, t = np.meshgrid(np.arange(k // 64), np.arange(4), np.arange(2),
                                np.arange(4), np.arange(2), indexing="ij")
    return (64 * c + 16 * i + 8 * v + 2 * q + t).reshape(k // 8, 8)


def pack_codes(codes_nk: jax.Array) -> jax.Array:
    """(N, K) E2M1 codes (uint8, 0..15) -> (N, K/8) uint32 words of the kernel layout."""
    n, k = codes_nk.shape
    idx = word_layout(k)  # (K/8, 8)
    c = codes_nk.astype(jnp.uint32)[:, idx]  # (N, K/8, 8)
    word = jnp.zeros((n, k // 8), jnp.uint32)
    for slot in range(8):
        i, t = divmod(slot, 2)
        for bit, pos in zip((3, 2, 1, 0), _SLOT_BITS[i][t], strict=True):
            word = word | (((c[:, :, slot] >> bit) & 1) << pos)
    return word


def _rotl(w, r: int):
    """Rotate uint32 left by r (one funnel shift, SHF.L.W, on the GPU)."""
    if r == 0:
        return w
    u = jnp.uint32
    return (w << u(r)) | (w >> u(32 - r))


def decode_words(w):
    """uint32 words -> the four bf16x2 bit patterns (uint32) of slots 0..3.

    The kernel's decode, written once: it runs on register arrays in the kernel and on
    plain arrays in the tests. Each result holds two bf16 values (low half: t = 0), each
    the code's value times 2^-126. 9 integer operations per 8 codes.
    """
    u = jnp.uint32
    return tuple(_rotl(w, r) & u(MASK) for r in _ROT) + (
        ((w << u(6)) & u(_SLOT3_MASK6)) | ((w >> u(2)) & u(_SLOT3_MASK2)),)


def prepare_weight(q):
    """Kernel layout of an NVFP4 ``fp4jax.QuantizedArray`` W (K, N) scaled along K.

    Accepts 1x16 blocks along axis 0 (scale (K/16, N)) or 16x16 tiles (scale (K/16,
    N/16)). Returns ``(wp, ws, dec)``: (N, K/8) uint32, (K/16, N) bfloat16, f32 scalar.
    """
    if q.fmt.block_size != 16 or not q.fmt.tensor_scale or q.data.ndim != 2:
        raise ValueError("prepare_weight expects a 2-D NVFP4 QuantizedArray (K, N)")
    if not q.block_2d and q.axis % q.ndim != 0:
        raise ValueError("W must be quantized along its contraction axis (axis=0) or 16x16")
    k, n = q.data.shape
    if k % 64:
        raise ValueError(f"K must be a multiple of 64, got {k}")
    s = q.scale.astype(jnp.float32)
    if q.block_2d:
        s = jnp.repeat(s, 16, axis=1)[:, :n]
    ws = (s * jnp.float32(2.0**SCALE_SHIFT)).astype(jnp.bfloat16)
    return pack_codes(e2m1_codes(q.data).T), ws, q.global_scale


def _as_bf16_fragment(words):
    """(64, 8) uint32 WGMMA-layout array -> (64, 16) bf16 WGMMA-layout array, same bits.

    Register ``v`` (0, 1) of a thread's vector<2 x i32> becomes its bf16x2 register of
    column group ``v``: element (r, 2q + v) of the words holds A columns 8v + 2q + (0, 1).
    """
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir import ir

    layout = plgpu.Layout.WGMMA

    @plgpu.inline_mgpu(
        arg_types=(layout,),
        return_type=plgpu.ShapeDtypeStruct((TILE_N, 16), jnp.bfloat16, layout=layout),
    )
    def reinterpret(_, arr):
        regs = arr.registers
        out = np.empty(mgpu.WGMMA_LAYOUT.registers_shape((TILE_N, 16)), dtype=object)
        v4 = ir.VectorType.get((4,), ir.BF16Type.get())
        for idx in np.ndindex(regs.shape):
            quad = mgpu_utils.bitcast(regs[idx], v4)
            for v in range(2):
                o = list(idx)
                o[1] = 2 * idx[1] + v
                out[tuple(o)] = mgpu_utils.vector_slice(quad, slice(2 * v, 2 * v + 2))
        return mgpu.FragmentedArray(_registers=out, _layout=mgpu.WGMMA_LAYOUT,
                                    _is_signed=None)

    return reinterpret(words)


def fragment_reference(words: np.ndarray) -> np.ndarray:
    """NumPy model of :func:`_as_bf16_fragment`: (R, 8) uint32 -> (R, 16) uint16 bits."""
    w = np.asarray(words, np.uint32).reshape(-1, 4, 2)  # (R, q, v)
    halves = np.stack([w & 0xFFFF, w >> 16], axis=-1).astype(np.uint16)  # (R, q, v, t)
    return halves.transpose(0, 2, 1, 3).reshape(-1, 16)  # column 8v + 2q + t


SMEM_BUDGET = 220 * 1024  # bytes of shared memory per CTA (227 KiB on sm_90, less slack)


def _stage_bytes(mp: int, tile_k: int, cta_n: int) -> int:
    """Shared memory of one pipeline stage: x tile, codes tile, scales tile."""
    return tile_k * mp * 2 + cta_n * tile_k // 2 + (tile_k // 16) * cta_n * 2


def _smem_bytes(mp: int, tile_k: int, compute_wgs: int, stages: int) -> int:
    """Pipeline stages plus the f32 epilogue buffer (one (64, Mp) tile per warpgroup)."""
    wgs = max(compute_wgs, 1)
    return stages * _stage_bytes(mp, tile_k, TILE_N * wgs) + wgs * TILE_N * mp * 4


def default_config(m: int, k: int, n: int, *, compute_wgs: int | None = None,
                   tile_k: int | None = None) -> dict:
    """Kernel configuration for x (m, k) @ W (k, n): compute_wgs, tile_k, split_k, stages.

    Two compute warpgroups when N allows (run 34: 17.6 µs vs 19.1 µs for one warpgroup
    per CTA at M=16, K=N=8192); the largest k tile (<= 512) for which two pipeline
    stages and the epilogue buffer fit in shared memory (else one compute warpgroup);
    split-K so that the CTAs make about one wave on 132 SMs (run 35: split 2 17.4 µs,
    split 4 19.4 µs, split 1 29.6 µs at M=16, K=N=8192); three stages if they fit.
    """
    mp = next(p for p in (16, 32, 64, 128, 256) if p >= m)
    if compute_wgs is None:
        options = (2, 1) if n % (2 * TILE_N) == 0 else (1,)
    else:
        options = (compute_wgs,)
    tiles = (512, 256, 128, 64) if tile_k is None else (tile_k,)
    fits = [(cw, t) for cw in options for t in tiles
            if k % t == 0 and _smem_bytes(mp, t, cw, 2) <= SMEM_BUDGET]
    compute_wgs, tile_k = fits[0] if fits else (options[-1], tiles[-1])
    cta_n = TILE_N * max(compute_wgs, 1)
    k_iters = k // tile_k
    ctas = n // cta_n
    split_k = 1
    for s in (2, 4, 8, 16):
        if ctas * s <= 140 and k_iters % s == 0 and k_iters // s >= 2:
            split_k = s
    stages = 2 if fits else 1
    if _smem_bytes(mp, tile_k, compute_wgs, 3) <= SMEM_BUDGET:
        stages = 3
    stages = max(1, min(stages, k_iters // split_k))
    return dict(compute_wgs=compute_wgs, tile_k=tile_k, split_k=split_k, stages=stages)


@functools.partial(jax.jit, static_argnames=("tile_k", "split_k", "stages", "out_dtype",
                                             "x_direct", "compute_wgs", "nacc", "k_wgs",
                                             "_mode"))
def w4a16_matmul(
    x: jax.Array,
    wp: jax.Array,
    ws: jax.Array,
    dec: jax.Array,
    *,
    tile_k: int | None = None,
    split_k: int | None = None,
    stages: int | None = None,
    out_dtype=jnp.bfloat16,
    x_direct: bool = True,
    compute_wgs: int | None = None,
    nacc: int = 1,
    k_wgs: int = 0,
    _mode: str = "full",
) -> jax.Array:
    """``x (M, K) bf16 @ W`` with W in the kernel layout (:func:`prepare_weight`) -> (M, N).

    Defaults (:func:`default_config`, from the H200 sweeps of runs 31-35): two compute
    warpgroups, the largest k tile that fits, split-K to about one wave of CTAs.
    ``tile_k`` (multiple of 64) k per pipeline step; ``split_k`` CTAs along K;
    ``stages`` pipeline depth; ``x_direct``: wgmma reads B
    from tiles of x through a transposed view (no XLA transpose of x before the kernel);
    ``compute_wgs``: 0 runs one warpgroup per CTA that both loads and computes; n >= 1
    runs a warp-specialized CTA (one memory warpgroup issuing the TMA loads, n compute
    warpgroups of 64 rows each sharing the tile of x); ``nacc`` f32 accumulators per
    warpgroup, used in turn by consecutive k-blocks and summed in the epilogue.
    ``k_wgs`` (>= 2; overrides ``compute_wgs``): a warp-specialized CTA of one 64-row tile
    whose ``k_wgs`` compute warpgroups split the k range of every pipeline step (64-k word
    columns dealt round-robin, rotating from step to step so that each warpgroup gets the
    same share over the CTA), each with its own accumulator; the partial results are
    summed with the split-K ones: more compute warps per SM for the same rows. Exact but
    slower than the default on the H200 (run 38, M=16, K=N=8192: 20.3 µs vs 17.2 µs):
    a 64-row CTA re-reads as many bytes of x as it streams of W.
    ``_mode`` (diagnostics only, wrong results): "nodecode" feeds the raw words to wgmma,
    "noscale" skips the block-scale multiply, "mma1of4" issues one wgmma in four.
    """
    m, k = x.shape
    n = wp.shape[0]
    if wp.shape != (n, k // 8) or wp.dtype != jnp.uint32:
        raise ValueError(f"wp must be (N, K/8) uint32 for x {x.shape}, got {wp.shape} "
                         f"{wp.dtype} (make it with prepare_weight)")
    if ws.shape != (k // 16, n) or ws.dtype != jnp.bfloat16:
        raise ValueError(f"ws must be (K/16, N) bfloat16, got {ws.shape} {ws.dtype}")
    if not 1 <= m <= 256:
        raise ValueError(f"M must be in 1..256 for the W4A16 kernel, got {m}")
    if n % TILE_N or k % 64:
        raise ValueError(f"N must be a multiple of {TILE_N} and K of 64: N={n}, K={k}")
    mp = next(p for p in (16, 32, 64, 128, 256) if p >= m)
    if k_wgs == 1 or k_wgs < 0:
        raise ValueError(f"k_wgs must be 0 (off) or >= 2, got {k_wgs}")
    if k_wgs:
        cfg = default_config(m, k, n, compute_wgs=1, tile_k=tile_k)
        if stages is None:  # as many stages (<= 4) as fit beside the k_wgs epilogue tiles
            st_b = _stage_bytes(mp, cfg["tile_k"], TILE_N)
            cfg["stages"] = max(1, min(4, (SMEM_BUDGET - k_wgs * TILE_N * mp * 4) // st_b,
                                       k // cfg["tile_k"] // (split_k or cfg["split_k"])))
        compute_wgs = k_wgs
    else:
        cfg = default_config(m, k, n, compute_wgs=compute_wgs, tile_k=tile_k)
    compute_wgs = cfg["compute_wgs"] if compute_wgs is None else compute_wgs
    tile_k = cfg["tile_k"] if tile_k is None else tile_k
    if tile_k % 64 or k % tile_k:
        raise ValueError(f"tile_k must be a multiple of 64 dividing K={k}, got {tile_k}")
    k_iters = k // tile_k
    split_k = cfg["split_k"] if split_k is None else split_k
    if k_iters % split_k:
        raise ValueError(f"split_k={split_k} must divide K / tile_k = {k_iters}")
    ks = k_iters // split_k
    stages = cfg["stages"] if stages is None else stages
    xp = x.astype(jnp.bfloat16)
    if mp != m:
        xp = jnp.pad(xp, ((0, mp - m), (0, 0)))
    xt = xp if x_direct else xp.T  # (Mp, K) or (K, Mp)
    sc = jnp.reshape(dec.astype(jnp.float32), (1,))
    x_tf = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))
    wrow = tile_k // 8 * 4  # bytes of one row of a codes tile
    swz = plgpu.find_swizzle(wrow * 8)
    w_tf = (plgpu.TilingTransform((8, swz // 4)), plgpu.SwizzleTransform(swz))
    nblk = tile_k // 16
    wgs = max(compute_wgs, 1)  # warpgroups computing, 64 rows of W^T each (k_wgs: all 64)
    cta_n = TILE_N * (1 if k_wgs else wgs)
    ncols = tile_k // 64  # word columns (64 k each) of a pipeline step
    if n % cta_n:
        raise ValueError(f"N must be a multiple of {cta_n} for compute_wgs={compute_wgs}")

    def mma_step(wp_smem, ws_smem, xt_smem, accs, rows, cols=None):
        """One pipeline step of one warpgroup: decode its 64 rows, 4 wgmma per word column
        (all word columns of the step, or those in ``cols``)."""
        words = mc.load(wp_smem.at[rows], layout=plgpu.Layout.WGMMA)
        for c in range(ncols) if cols is None else cols:
            parts = decode_words(words[:, 8 * c: 8 * c + 8])
            for i, part in enumerate(parts):
                b = 4 * c + i
                if _mode == "nodecode":
                    part = words[:, 8 * c: 8 * c + 8]
                elif _mode not in ("full", "noscale", "mma1of4"):
                    raise ValueError(f"unknown _mode {_mode!r}")
                a = _as_bf16_fragment(part)
                if _mode == "full":
                    s = mc.load(ws_smem.at[:, rows], (b, slice(None)),
                                layout=plgpu.Layout.WGMMA.reduce(1))
                    a = a * lax.broadcast_in_dim(s, (TILE_N, 16), (0,))
                if x_direct:
                    xb = mc.transpose(xt_smem.at[:, pl.ds(16 * b, 16)], (1, 0))
                else:
                    xb = xt_smem.at[pl.ds(16 * b, 16), :]
                if _mode == "mma1of4" and i:  # timing only: one wgmma in four
                    continue
                plgpu.wgmma(accs[b % nacc], a, xb)
        plgpu.wgmma_wait(0)

    def specs(ni, si):
        return [
            plgpu.BlockSpec((mp, tile_k), lambda j: (0, si * ks + j), transforms=x_tf)
            if x_direct else
            plgpu.BlockSpec((tile_k, mp), lambda j: (si * ks + j, 0), transforms=x_tf),
            plgpu.BlockSpec((cta_n, tile_k // 8), lambda j: (ni, si * ks + j), transforms=w_tf),
            plgpu.BlockSpec((nblk, cta_n), lambda j: (si * ks + j, ni)),
        ]

    def epilogue(accs, sc_gmem, out_smem, out_gmem, ni, si, wg):
        total = accs[0][...]
        for extra in accs[1:]:
            total = total + extra[...]
        mc.store_untiled(out_smem, total * (sc_gmem[0] * jnp.float32(2.0**9)))
        plgpu.commit_smem()
        if k_wgs:  # partial sums of the same rows: one output slice per warpgroup
            dst = out_gmem.at[si * k_wgs + wg, pl.ds(ni * cta_n, TILE_N)]
        else:
            dst = out_gmem.at[si, pl.ds(ni * cta_n + wg * TILE_N, TILE_N)]
        plgpu.copy_smem_to_gmem(out_smem, dst)
        plgpu.wait_smem_to_gmem(0)

    def body(sc_gmem, xt_gmem, wp_gmem, ws_gmem, out_gmem, out_smem):
        ni = lax.axis_index("n")
        si = lax.axis_index("split")
        if not compute_wgs:
            @functools.partial(pl.run_scoped, accs=[plgpu.ACC((TILE_N, mp), jnp.float32)] * nacc)
            def _(accs):
                def step(_, xt_smem, wp_smem, ws_smem):
                    mma_step(wp_smem, ws_smem, xt_smem, accs, slice(None))

                plgpu.emit_pipeline(step, grid=(ks,), in_specs=specs(ni, si),
                                    max_concurrent_steps=min(stages, ks),
                                    )(xt_gmem, wp_gmem, ws_gmem)
                epilogue(accs, sc_gmem, out_smem.at[0], out_gmem, ni, si, 0)
            return
        wg = lax.axis_index("wg")
        rows = slice(None) if k_wgs else pl.ds(wg * TILE_N, TILE_N)

        def step(idx, xt_smem, wp_smem, ws_smem, accs):
            if not k_wgs:
                mma_step(wp_smem, ws_smem, xt_smem, accs, rows)
                return accs
            # word column c of step j goes to warpgroup (ncols * j + c) % k_wgs, i.e. this
            # warpgroup takes the columns c = r, r + k_wgs, ... with r as below
            j = idx[0] if isinstance(idx, (tuple, list)) else idx
            r = lax.rem(wg + (k_wgs - ncols % k_wgs) * j, k_wgs)
            for rr in range(k_wgs):
                @pl.when(r == rr)
                def _(cols=range(rr, ncols, k_wgs)):
                    mma_step(wp_smem, ws_smem, xt_smem, accs, rows, cols=cols)
            return accs

        def context(run):
            @functools.partial(pl.run_scoped, accs=[plgpu.ACC((TILE_N, mp), jnp.float32)] * nacc)
            def _(accs):
                accs = run(accs)
                epilogue(accs, sc_gmem, out_smem.at[wg], out_gmem, ni, si, wg)

        plgpu.emit_pipeline_warp_specialized(
            step, grid=(ks,), memory_registers=40, in_specs=specs(ni, si), wg_axis="wg",
            num_compute_wgs=compute_wgs, max_concurrent_steps=min(stages, ks),
            compute_context=context,
        )(xt_gmem, wp_gmem, ws_gmem)

    threads = dict(num_threads=compute_wgs + 1, thread_name="wg") if compute_wgs else {}
    out = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((split_k * max(k_wgs, 1), n, mp), jnp.float32),
        grid=(n // cta_n, split_k),
        grid_names=("n", "split"),
        scratch_types=dict(out_smem=plgpu.SMEM((wgs, TILE_N, mp), jnp.float32)),
        # Lane semantics explicitly (the register-level reinterpretation in
        # _as_bf16_fragment is written for it; JAX 0.11 defaults to Warpgroup)
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        **threads,
    )(sc, xt, wp, ws)
    y = out.sum(0) if out.shape[0] > 1 else out[0]
    return y[:, :m].T.astype(out_dtype)


def reference_w4a16(x: jax.Array, wp: jax.Array, ws: jax.Array, dec: jax.Array) -> jax.Array:
    """NumPy-free XLA reference on the kernel layout: ``x @ ((q * s) * dec)`` in float32.

    Unpacks the words with :func:`word_layout` and ``_SLOT_BITS`` (not with
    :func:`decode_words`), so it checks the packing independently of the kernel decode.
    """
    n, kw = wp.shape
    k = kw * 8
    idx = word_layout(k)
    codes = jnp.zeros((n, k), jnp.int32)
    for slot in range(8):
        i, t = divmod(slot, 2)
        c = jnp.zeros((n, kw), jnp.int32)
        for bit, pos in zip((3, 2, 1, 0), _SLOT_BITS[i][t], strict=True):
            c = c | (((wp >> pos) & 1).astype(jnp.int32) << bit)
        codes = codes.at[:, idx[:, slot]].set(c)
    lut = jnp.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6],
                    jnp.float32)
    s = ws.astype(jnp.float32).T * jnp.float32(2.0**-SCALE_SHIFT)  # (N, K/16)
    w = (lut[codes] * jnp.repeat(s, 16, axis=1)) * dec
    return jnp.dot(x.astype(jnp.float32), w.T, precision=lax.Precision.HIGHEST)
