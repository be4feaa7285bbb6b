"""Packed NVFP4 quantize along the token axis (16x1 blocks along axis 0), optionally after
the 16-point random Hadamard transform along that axis: Hopper (sm_90), Pallas Mosaic GPU.

This is Transformer Engine's "columnwise" copy of an activation or gradient: the wgrad
GEMM contracts over the tokens, so it wants each column of x (R tokens, C features) as a
row of K = R packed codes. One pass over a bf16 x (R, C) writes

* ``codes``: uint8 (C, R // 2): row ``c`` holds column ``c`` of the quantized tensor, two
  tokens a byte (token 2t in the low nibble of byte t, 2t+1 in the high nibble; code bits
  ``s e1 e0 m``): ``fp4jax.pack_e2m1(q.data.T)``;
* ``scale_bits``: uint8 (C, R // 16): E4M3 bits of the block (token block b, column c) at
  ``[c, b]``: ``bitcast(q.scale.T, uint8)``;
* ``dec``: float32, the tensor decode scale ``q.global_scale``;

for ``q = fp4jax.quantize(xin, NVFP4, axis=0, rounding=..., key=...)`` with ``xin =
fp4jax.hadamard.random_hadamard_transform(x, axis=0, size=16, signs=signs)`` (float32)
when ``signs`` is given, else ``xin = x``. Bit-identical to it, NaN/Inf blocks included
(scale byte 0x7F, codes 0: what ``fp4jax.quantize`` gives a positive NaN there).
The codes are K-major like a 1x16 packed operand (``quantize_nvfp4_sm90``), with the
tokens as K: a GEMM contracting the tokens reads both wgrad operands the same way.

Numerics (each step is the core's, as in ``fakequant_nvfp4_sm90.fq_cols``, whose bf16
``data * scale`` these codes and scales make): the rotation ``_fwht16`` (the float32
butterfly of ``fp4jax.hadamard.fwht_tiles``); block amax, E4M3 block scale
``_block_scale`` and element encode scale ``_elem_scale`` (``recip_rn``: ``div_rn``'s
bits) from ``quantize_nvfp4_sm90`` (TE ``core_nvfp4.cuh``, ``fp4jax.quantize``);
element rounding ``_e2m1_value`` (``numerics.round_to_grid`` / ``stochastic_round_to_grid``
on E2M1), then the code of that value (``e2m1_code_of_value``). Stochastic rounding draws
8 bits per element in the kernel (``numerics.uniform_from_key`` on x's stored (R, C)
order: element (n, k) takes byte ``2 (n % 2) + (k % 2)`` of word y0 (n % 4 < 2) or y1 of
the 64-bit draw ``(n // 4) * C/2 + k // 2``, ``(y0, y1) = threefry2x32(k1, k2, 0, d)``):
one draw per word (two columns) of four rows. The tensor amax is a separate pass
(``fakequant_nvfp4_sm90.rht_cols_amax`` for the rotated tensor, an XLA reduction else;
``cols_amaxes`` gives both from one read).

Kernel layout. x is read as uint32 words (two neighbouring columns each); a CTA takes
``ns`` strips of 16 tokens x ``w`` words (2w columns). Every token row of a strip is one
register array of w words in a 1D tiled layout (thread t of the warpgroup holds words t,
t + 128, ...: coalesced loads), so a column block's amax, the butterfly and the rounding
are elementwise across the 16 arrays (no shuffles), and each thread ends with the 16
codes of its columns. It ORs the codes of tokens 8q .. 8q+7 into one int32 word (token
8q + j in bits 4j .. 4j+3: little-endian, the byte order of ``codes``) and stores it at
``[word, half, 2 s + q]`` of a (w, 2, 2 ns) int32 shared-memory tile: element (c, t) of
the (2w, 2 ns) tile of the transposed int32 output (C, R/8), column ``c = 2 word + half``.
Those stores are 4-byte scalar stores with a stride (the register layout has vector
length 1, so Mosaic GPU accepts a strided destination): the transposition happens
there. The scale bytes go to a (w, 2, ns) uint8 tile the same way. Both tiles are
TMA-stored once per CTA (the pipeline over the ns strips keeps them resident): ns = 16
makes the scale box 16 bytes wide, TMA's minimum. The kernel is lowered with Lane semantics
(named explicitly: JAX >= 0.11 defaults to Warpgroup semantics, whose layout inference
refuses SMEM refs with a minor stride other than 1, i.e. these strided stores).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from fp4jax.numerics import threefry2x32
from pallas_kernels.fakequant_nvfp4_sm90 import (
    _SC_SIGNS,
    _e2m1_value,
    _fwht16,
    _sr_uniform,
    cols_amaxes,
    key_words,
    rht_cols_amax,
    scalars,
)
from pallas_kernels.fakequant_nvfp4_sm90 import supported_cols as fq_supported_cols
from pallas_kernels.quantize_nvfp4_sm90 import (
    _block_scale,
    _by_mode,
    _elem_scale,
    _f32,
    _i32,
    _mode,
    e2m1_code_of_value,
    global_scales,
)

__all__ = ["quantize_cols_nvfp4", "quantize_cols_nvfp4_scaled", "supported_cols",
           "rht_cols_amax", "cols_amaxes"]

NS = 16  # token strips (of 16) per CTA: the scale tile's TMA box is NS bytes wide (>= 16)
W = (128, 256)  # words (2 columns each) per CTA tile, first that divides C/2 (GPU default)
LANE_WORDS = 128  # the register layout spreads a row over the warpgroup's 128 threads


def _layout():
    """1D tiled register layout of a (n,) array, n % 128 == 0: element 128 i + 32 warp +
    lane in thread (warp, lane), vector length 1 (so stores may be strided)."""
    return plgpu.Layout.TILED(plgpu.Tiling(((LANE_WORDS,), (32,), (1,))), warp_dims=(-3,),
                              lane_dims=(-2,), vector_dim=-1)


def _load_row(x_ref, k, n: int, plain: bool):
    """Token row ``k`` of a strip, x_ref (16, n) uint32 words, as int32 (n,)."""
    if plain:
        w = x_ref[k]
    else:
        w = plgpu.load(x_ref.at[k], (), layout=_layout())
    return lax.bitcast_convert_type(w, jnp.int32)


def _iota(n: int, plain: bool):
    if plain:
        return lax.broadcasted_iota(jnp.int32, (n,), 0)
    return plgpu.broadcasted_iota(jnp.int32, (n,), 0, layout=_layout())


def _quant_strip(sc_ref, kw_ref, x_ref, o_ref, s_ref, *, n: int, s, row0, col0,
                 n_cols: int, plain: bool, mode: str, sr: bool, rht: bool):
    """One strip of 16 tokens x ``n`` words: x_ref (16, n) uint32 words in (row k of the
    strip is x_ref[k]; word i holds columns ``col0 + 2 i`` (low half) and ``+ 1``);
    o_ref (n, 2, T) int32 and s_ref (n, 2, S) uint8 out: this strip writes
    ``o_ref[:, h, 2 s + q]`` (the codes of tokens ``row0 + 8 q ..  + 7`` of column ``col0
    + 2 i + h``, token ``row0 + 8 q + j`` in bits 4j .. 4j+3) and ``s_ref[:, h, s]`` (the
    E4M3 bits of its block). Rules: see the module docstring."""
    words = [_load_row(x_ref, k, n, plain) for k in range(16)]
    draws = None
    if sr:  # the draw of (rows row0 + 4p .. + 3; the word's column pair), p < 4
        d0 = lax.shift_right_logical(row0, 2) * (n_cols // 2) + lax.shift_right_logical(
            col0, 1) + _iota(n, plain)
        draws = []
        for p in range(4):
            d = d0 + p * (n_cols // 2)
            draws.append(threefry2x32(kw_ref[0], kw_ref[1], d - d, d))
    for h in range(2):
        v = [_f32(w << 16) if h == 0 else _f32(w & -0x10000) for w in words]
        if rht:
            v = _fwht16([v[k] * sc_ref[_SC_SIGNS + k] for k in range(16)])
        amax = jnp.abs(v[0])  # float max: NaN propagates, Inf stays above every finite
        for k in range(1, 16):
            amax = jnp.maximum(amax, jnp.abs(v[k]))
        s_val, s_byte, finite = _block_scale(_i32(amax), sc_ref[0])
        e = _elem_scale(sc_ref, s_val, s_byte, mode)
        for q in range(2):
            word = None
            for j in range(8):
                k = 8 * q + j
                u = _sr_uniform(draws[k // 4][(k % 4) // 2], 2 * (k % 2) + h) if sr else None
                code = e2m1_code_of_value(_e2m1_value(v[k] * e, u, plain))
                word = code if j == 0 else word | (code << (4 * j))
            o_ref.at[:, h, 2 * s + q][...] = jnp.where(finite, word, 0)
        s_ref.at[:, h, s][...] = jnp.where(finite, s_byte, 0x7F).astype(jnp.uint8)


def supported_cols(shape, dtype) -> bool:
    """bf16 (R, C) with R % 256 == 0 (16 strips of 16 tokens a CTA), C % 256 == 0 (128
    words a CTA tile at least) and R*C < 2^31."""
    if len(shape) != 2 or jnp.dtype(dtype) != jnp.bfloat16:
        return False
    r, c = shape
    return r % (16 * NS) == 0 and c % (2 * W[0]) == 0 and r * c < 2**31


def unsupported_reason(shape, dtype) -> str | None:
    """None when the kernel takes x of this shape and dtype, else why not (names ``x``)."""
    if jnp.dtype(dtype) != jnp.bfloat16:
        return f"x must be bfloat16, got {jnp.dtype(dtype).name}"
    if len(shape) != 2:
        return f"x must be 2D (tokens, features), got shape {tuple(shape)}"
    if not supported_cols(shape, dtype):
        return (f"x (R, C) needs R % {16 * NS} == 0, C % {2 * W[0]} == 0 and R*C < 2^31, "
                f"got {tuple(shape)}")
    return None


@functools.partial(jax.jit, static_argnames=("interpret", "recip", "sr", "rht", "w",
                                             "steps"))
def quantize_cols_nvfp4_scaled(x: jax.Array, sc: jax.Array, kw: jax.Array, *,
                               interpret=False, recip: str = "rn", sr: bool = False,
                               rht: bool = False, w: int | None = None,
                               steps: int = 2) -> tuple[jax.Array, jax.Array]:
    """Kernel call. x: (R, C) bfloat16 (``supported_cols``); ``sc = scalars(enc, dec,
    signs)`` (``fakequant_nvfp4_sm90.scalars``), ``kw = key_words(key)``; ``sr``: stochastic
    rounding; ``rht``: rotate the token axis in tiles of 16 first (signs from ``sc``).

    ``w``: words (2 columns) per CTA tile (default: the first of ``W`` that divides C/2;
    in interpret mode all of C/2 unless given, so tests can run the GPU's column tiling);
    ``steps``: strips in flight (the input pipeline's buffers). ``recip``: ``"rn"``
    (``recip_rn``, exact for every dec) or ``"auto"`` (the table where it is exact).

    Returns (codes uint8 (C, R//2), scale_bits uint8 (C, R//16)), see the module
    docstring.
    """
    reason = unsupported_reason(x.shape, x.dtype)
    if reason is not None:
        raise ValueError(f"quantize_cols_nvfp4: {reason}")
    mode = _mode(recip, None)
    r, c = x.shape
    nw = c // 2
    if w is None:
        w = nw if interpret else next(v for v in W if nw % v == 0)
    if nw % w or w % LANE_WORDS or (w > 256 and not interpret):
        raise ValueError(f"quantize_cols_nvfp4 tiling: w={w} must divide C/2={nw}, be a "
                         f"multiple of {LANE_WORDS} and (on the GPU: a TMA box) at most 256")
    xw = lax.bitcast_convert_type(x.reshape(r // 16, 16, nw, 2), jnp.uint32)
    out_type = (jax.ShapeDtypeStruct((nw, 2, r // 8), jnp.int32),
                jax.ShapeDtypeStruct((nw, 2, r // 16), jnp.uint8))

    def result(o, s):
        codes = lax.bitcast_convert_type(o.reshape(c, r // 8), jnp.uint8).reshape(c, r // 2)
        return codes, s.reshape(c, r // 16)

    def strip(sc_ref, kw_ref, x_ref, o_ref, s_ref, s, row0, col0, plain):
        _by_mode(sc_ref, mode, lambda md: _quant_strip(
            sc_ref, kw_ref, x_ref, o_ref, s_ref, n=w, s=s, row0=row0, col0=col0, n_cols=c,
            plain=plain, mode=md, sr=sr, rht=rht))

    if interpret:
        def interp_body(sc_ref, kw_ref, x_ref, o_ref, s_ref):
            @pl.loop(0, r // 16)
            def _(i):
                for j in range(nw // w):
                    cols = pl.ds(j * w, w)
                    strip(sc_ref, kw_ref, x_ref.at[i, :, cols], o_ref.at[cols],
                          s_ref.at[cols], i, 16 * i, 2 * w * j, True)

        o, s = pl.pallas_call(interp_body, out_shape=out_type, interpret=interpret,
                              compiler_params=plgpu.CompilerParams())(sc, kw, xw)
        return result(o, s)

    steps = max(1, min(steps, NS))

    def body(sc_gmem, kw_gmem, x_gmem, o_gmem, s_gmem):
        i = lax.axis_index("rows")
        j = lax.axis_index("cols")

        def step(idx, x_smem, o_smem, s_smem):
            st = idx[0]
            strip(sc_gmem, kw_gmem, x_smem.at[0], o_smem, s_smem, st, 16 * (i * NS + st),
                  2 * w * j, False)

        plgpu.emit_pipeline(
            step, grid=(NS,),
            in_specs=[plgpu.BlockSpec((1, 16, w), lambda st: (i * NS + st, 0, j))],
            out_specs=[plgpu.BlockSpec((w, 2, 2 * NS), lambda st: (j, 0, i)),
                       plgpu.BlockSpec((w, 2, NS), lambda st: (j, 0, i))],
            max_concurrent_steps=steps,
        )(x_gmem, o_gmem, s_gmem)

    o, s = plgpu.kernel(
        body, out_type=out_type, grid=(r // (16 * NS), nw // w), grid_names=("rows", "cols"),
        # Lane semantics explicitly: the default became Warpgroup in JAX 0.11, whose layout
        # inference rejects the strided SMEM views of the transposing stores above
        # (_is_valid_smem_layout_assignment: "We cannot apply swizzle to non-contiguous
        # refs" for any SMEM ref whose minor stride is not 1, swizzled or not).
        compiler_params=plgpu.CompilerParams(
            unsafe_no_auto_barriers=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
    )(sc, kw, xw)
    return result(o, s)


def quantize_cols_nvfp4(x: jax.Array, key: jax.Array | None = None, *,
                        signs: jax.Array | None = None, interpret=False,
                        amax: jax.Array | None = None, **kw
                        ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Token-axis (16x1) NVFP4 quantization of x (R, C) bfloat16, packed transposed.

    Args:
      x: (R, C) bfloat16, R the token axis (``supported_cols``).
      key: a threefry ``jax.random`` key for stochastic rounding (None: round to nearest).
      signs: 16 RHT signs (+-1) to rotate the token axis first (None: no rotation).
      amax: the finite amax of the tensor that is quantized (rotated, with ``signs``) if
        already known (e.g. from ``cols_amaxes``); else ``rht_cols_amax`` (a Pallas pass)
        or an XLA reduction computes it.
      **kw: ``quantize_cols_nvfp4_scaled``'s tiling options.
    Returns:
      (codes uint8 (C, R//2), scale_bits uint8 (C, R//16), dec float32): ``pack_e2m1(
      q.data.T)``, ``bitcast(q.scale.T, uint8)`` and ``q.global_scale`` of ``q =
      fp4jax.quantize(rht(x, axis=0, signs) if signs is not None else x, NVFP4, axis=0,
      rounding="stochastic" if key is not None else "nearest", key=key)``.
    """
    if amax is None and signs is not None:
        signs = jnp.asarray(signs, jnp.float32).reshape(16)
        if fq_supported_cols(x.shape, x.dtype):
            amax = rht_cols_amax(x, signs, interpret=interpret)
        else:  # the amax pass needs C % 1024 == 0: XLA rotates and reduces
            from fp4jax.hadamard import random_hadamard_transform

            a = jnp.abs(random_hadamard_transform(x, axis=0, size=16, signs=signs))
            amax = jnp.max(jnp.where(jnp.isfinite(a), a, 0.0))
    if key is not None and not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)  # raw uint32 key: the default implementation
    enc, dec = global_scales(x, amax)
    codes, sbits = quantize_cols_nvfp4_scaled(
        x, scalars(enc, dec, signs), key_words(key), sr=key is not None,
        rht=signs is not None, interpret=interpret, **kw)
    return codes, sbits, dec
