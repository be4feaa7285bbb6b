"""``fp4jax.dot``'s Hopper (sm_90) backend: each quantized operand as its bfloat16
``data * scale`` from a fused Pallas kernel, each GEMM of two such operands on the alpha
GEMM (``alpha = dec_a * dec_b`` in its epilogue). ``implementation="pallas"``.

Reference: ``fp4jax.backends.XLA`` (``fp4jax.quantize`` + ``scaled_data``; einsum times
alpha). Kernels: ``quantize/operand_sm90.py`` (rows 1x16/1x32, columns 16x1/32x1 with the
RHT in registers, 16x16 tiles; the amax passes), ``gemm/alpha_sm90.py``. The same bits as
the reference: bit for bit for every operand, to float32 accumulation order for the GEMM.

Not supported, because ... (each falls back to the reference, operand by operand):

* specs the kernels do not implement (``support.spec_unsupported_reason``: FP6/FP8 and
  other block formats, 4over6, row-scaled, MS-EDEN), unquantized operands (they enter as
  the tensor itself), MX FP4 32x32 weight tiles (a strip of 64 such tiles, the least the
  kernel's register layout takes, outgrows shared memory), operands of a float32 GEMM
  (the kernels write bfloat16), batched calls (the kernels take one matrix), non-threefry
  keys for stochastic rounding (the kernels compute Threefry draws), shapes the kernels do
  not tile (``operand_kernel``); a JAX on whose Mosaic GPU the kernels have not been run
  (``support.mosaic_api_reason``: JAX 0.12's CUDA run is unverified), on the GPU;
* GEMMs with an unquantized operand, a float32 GEMM, per-row decode scales, a batched call,
  a float32 output or sizes below ``alpha_sm90.MIN_MKN`` / not tile-aligned (XLA's GEMM was
  as fast or faster there);
* under ``jax.vmap`` the operands take the reference (vmapped): Pallas calls have no
  batching rule here.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from fp4jax.backends import (
    WHOLE,
    XLA,
    Backend,
    DotCall,
    NotSupported,
    Operand,
    OperandRequest,
    RowShard,
    gemm_dtype,
)
from fp4jax.formats import get_format
from pallas_kernels.support import (
    interpret_params,
    is_mx_fp4,
    is_threefry,
    mosaic_api_reason,
    on_sm90,
    spec_unsupported_reason,
)

__all__ = ["FP8_ALIGN", "FP8_PROVIDER", "GEMM_IMPLS", "KERNEL_AUTO_MIN_MKN", "LAYOUTS",
           "PROVIDER", "HopperBackend", "HopperProvider", "fp8_gemms", "fp8_operand_reason",
           "gemm_backend", "make_operands", "operand_kernel", "recipe_reason", "scaled_gemm"]

KERNEL_AUTO_MIN_MKN = 2**30
"""The automatic choice (``FP4JAX_KERNELS`` unset or ``auto``) takes the kernels for
unbatched GEMMs with ``M*K*N`` at least this (8192 x 512 x 256); smaller ones stay on the
reference. The measurements behind the bound are in ``docs/performance.md``."""

LAYOUTS = {"bmk,bkn->bmn": (False, False),  # fprop x @ w
           "bmn,bkn->bmk": (False, True),   # dgrad dy @ w^T
           "bmk,bmn->bkn": (True, False)}   # wgrad x^T @ dy
"""Whether the alpha GEMM transposes (lhs, rhs) for each of ``fp4jax.dot``'s GEMMs."""


GEMM_IMPLS = ("pallas", "fp8", "xla")
"""The GEMM choices of the Hopper backend: ``pallas`` (every GEMM of two quantized
operands on the alpha GEMM, bfloat16 tensor cores), ``fp8`` (GEMMs of two MX FP4
operands on FP8 tensor cores, ``gemm/mxfp4_fp8wgmma_sm90``, the others as ``pallas``),
``xla`` (the reference's GEMM: bit-identical to it)."""


OPERAND_PASSES = ("separate", "fused")
"""How the Hopper backend makes an NVFP4 tensor's 1x16 rows operand and its (RHT'd) 16x1
columns operand (x: fprop + wgrad; dy: dgrad + wgrad): ``separate`` (one kernel each, the
default: as fast or faster, docs/performance.md) or ``fused`` (one read of the tensor,
``quantize/operand_sm90.fq_rows_cols_scaled``, where ``supported_rows_cols`` takes the
shape). The same bits either way."""


def operand_passes() -> str:
    """``FP4JAX_KERNEL_OPERANDS``: the default of the Hopper backend's operand-pass choice
    (``OPERAND_PASSES``; unset: ``separate``)."""
    env = os.environ.get("FP4JAX_KERNEL_OPERANDS", "separate").lower()
    if env not in OPERAND_PASSES:
        raise ValueError(f"FP4JAX_KERNEL_OPERANDS={env!r}: use one of "
                         f"{', '.join(OPERAND_PASSES)}")
    return env


def gemm_backend() -> str:
    """``FP4JAX_KERNEL_GEMM``: the default of the Hopper backend's GEMM choice
    (``GEMM_IMPLS``; unset: ``pallas``)."""
    env = os.environ.get("FP4JAX_KERNEL_GEMM", "pallas").lower()
    if env not in GEMM_IMPLS:
        raise ValueError(f"FP4JAX_KERNEL_GEMM={env!r}: use one of {', '.join(GEMM_IMPLS)}")
    return env


FP8_ALIGN = 128
"""Every dimension of an operand the FP8 MXFP4 GEMM takes is a multiple of this (its tiles:
two warpgroups of 64 rows, 128 columns, 128 of K per stage)."""


def fp8_gemms(recipe: Any) -> frozenset[str]:
    """The GEMMs of ``recipe`` (``"fprop"``, ``"dgrad"``, ``"wgrad"``) whose two operands
    are both MX FP4 operands the FP8 GEMM reads as codes: E2M1 elements, E8M0 scales, no
    tensor scale (``support.is_mx_fp4``), the ``max`` block-scale rule, not row-scaled,
    rounded to nearest or stochastically (1x32 blocks, or 32x32 tiles: a tile's scale is
    each of its 32 rows' block scale)."""
    out = set()
    for name in ("fprop", "dgrad", "wgrad"):
        g = getattr(recipe, name)
        if all(_kernels_quantize(q) and is_mx_fp4(q.fmt) for q in (g.lhs, g.rhs)):
            out.add(name)
    return frozenset(out)


def _contracted(subscripts: str) -> tuple[int, int]:
    """The contracted axis of each operand of a ``LAYOUTS`` GEMM (1 or 2)."""
    ins = subscripts.split("->")[0].split(",")
    c = (set(ins[0]) & set(ins[1])) - {"b"}
    (letter,) = c
    return ins[0].index(letter), ins[1].index(letter)


def _k_major(q: Any, axis: int) -> tuple[jax.Array, jax.Array]:
    """One MX FP4 operand's codes (``QuantizedArray`` of a canonical (1, R, C) tensor,
    contracted along ``axis``) as the FP8 GEMM reads it: E2M1 values in float8_e4m3fn
    (exact: every E2M1 value is an E4M3 value) and E8M0 exponent bits (uint8), both
    (rows, contraction), the codes transposed by XLA where the contraction is not the last
    axis. A 32x32 tile's scale is repeated over its 32 rows."""
    codes = q.data[0].astype(jnp.bfloat16).astype(jnp.float8_e4m3fn)
    scale = q.scale[0]
    if q.block_2d:  # (R/32, C/32): one 1x32 scale per row along the contraction
        scale = jnp.repeat(scale, q.fmt.block_size, axis=1 if axis == 1 else 0)
    exps = jax.lax.bitcast_convert_type(scale.astype(jnp.float8_e8m0fnu), jnp.uint8)
    if axis == 1:
        from pallas_kernels.gemm import mxfp4_fp8wgmma_sm90 as mx

        return mx.k_major(codes, exps)
    return codes, exps


def fp8_operand_reason(q: Any, axis: int) -> str | None:
    """None when the codes ``q`` (an ``Operand``'s ``QuantizedArray``) of a canonical
    (1, R, C) tensor contracted along ``axis`` are an operand of the FP8 MXFP4 GEMM, else
    why not."""
    if q is None:
        return "the operand is materialized values, not codes"
    if not is_mx_fp4(q.fmt) or jnp.dtype(q.data.dtype) != jnp.float4_e2m1fn:
        return "the operand is not MX FP4 codes"
    if q.data.ndim != 3 or q.data.shape[0] != 1:
        return "the FP8 GEMM takes one matrix (B == 1)"
    if not q.block_2d and q.axis is not None and q.axis % 3 != axis:
        return "the operand is blocked along another axis than its contraction"
    if jnp.ndim(q.global_scale):
        return "per-row decode scales are applied on the reference"
    return None


def _kernels_quantize(q: Any) -> bool:
    """Whether the operand spec ``q`` is quantized with a spec the kernels implement."""
    return q.quantized and spec_unsupported_reason(
        q.fmt, block_scale_rule=q.block_scale_rule, row_scaled=q.row_scaled,
        rounding=q.rounding) is None


def recipe_reason(recipe: Any) -> str | None:
    """None when some operand of ``recipe`` is quantized with a spec the kernels implement
    (``spec_unsupported_reason``), else why the backend does not take the recipe. The
    recipe's other operands, quantized or not, ride along on the reference."""
    for g in (recipe.fprop, recipe.dgrad, recipe.wgrad):
        for q in (g.lhs, g.rhs):
            if _kernels_quantize(q):
                return None
    return ("the recipe has no operand the kernels implement (they quantize NVFP4 with one "
            "tensor scale and MXFP4, with the 'max' block scale rule, rounding to nearest or "
            "stochastically; this recipe's operands are all FP6/FP8, 4over6, row-scaled, "
            "MS-EDEN or unquantized)")


def operand_kernel(x: jax.Array, *, block_2d: bool, axis: int, stochastic: bool,
                   rht: int, key: jax.Array, block_scale_rule: str = "max",
                   fmt: Any = None, row_scaled: bool = False,
                   rounding: str | None = None) -> str | None:
    """Which fused kernel of ``quantize/operand_sm90`` makes the GEMM operand
    ``scaled_data(quantize(RHT(x)), bfloat16)``: ``"rows"`` (1x16 along the last axis),
    ``"cols"`` (16x1 along the token axis, with the 16-point RHT if ``rht``), ``"2d"``
    (16x16 tiles), or None (the reference). MX FP4 operands (``fmt`` MXFP4/MXFP4_OCP): 1x32
    ``"rows"`` and 32x1 ``"cols"`` (RHT of size 32, or none), bfloat16 only; their 32x32
    weight tiles take the reference.

    ``x`` is ``fp4jax.dot``'s canonical (B, R, C) operand; ``axis`` (1 or 2) its blocked
    axis; ``rht`` the RHT size (0: none) along ``axis``; ``key`` a key of the call
    (stochastic-rounding kernels compute Threefry draws, so other key implementations
    take the reference); ``block_scale_rule``, ``fmt``, ``row_scaled``, ``rounding``: the
    operand's spec (``spec_unsupported_reason``)."""
    if spec_unsupported_reason(fmt, block_scale_rule=block_scale_rule,
                               row_scaled=row_scaled,
                               rounding=rounding or ("stochastic" if stochastic else "nearest")
                               ) is not None:
        return None
    from pallas_kernels.quantize import operand_sm90 as fq

    mx = is_mx_fp4(fmt)
    b = 32 if mx else 16
    if x.shape[0] != 1 or x.dtype not in (jnp.bfloat16, jnp.float32):
        return None
    if x.dtype == jnp.float32 and (mx or not block_2d):
        return None  # float32 input: the NVFP4 16x16 kernel only (a float32 master weight)
    if stochastic and not is_threefry(key):
        return None  # the kernels compute threefry draws (numerics.draws_from_key)
    mat = x.shape[1:]
    if block_2d:
        ok = not mx and not rht and not stochastic and fq.supported_2d(mat, x.dtype)
        return "2d" if ok else None
    if axis == 2:
        ok = not rht and fq.supported_rows(mat, x.dtype, stochastic, padded=True, block=b)
        return "rows" if ok else None
    return "cols" if rht in (0, b) and fq.supported_cols(mat, x.dtype, b) else None


def make_operands(x: jax.Array, kinds: list[str], sr_keys: list[Any], signs: list[Any],
                  mode: str, rows: RowShard = WHOLE, fmts: list[Any] | None = None,
                  fused: bool = False) -> list[tuple[jax.Array, jax.Array]]:
    """Run the fused operand kernels on one tensor ``x`` (1, R, C) bfloat16 (or float32 when
    every operand is ``"2d"``).

    ``kinds[i]`` is ``operand_kernel``'s answer for operand ``i``, ``sr_keys[i]`` its
    stochastic-rounding key (None: round to nearest), ``signs[i]`` its RHT sign vector
    (``"cols"`` only; None: no RHT). Returns ``(scaled_data in bf16 (1, R, C), tensor
    decode scale)`` per operand. A rows operand and one RHT'd cols operand of the same
    tensor take both tensor amaxes from one read (``cols_amaxes``).

    ``rows``: where ``x``'s rows sit (``fp4jax.backends.RowShard``): for one device's token
    rows of a data-parallel tensor, the tensor amaxes are ``rows.reduce_amax`` of the local
    ones (all of this tensor's operands in one vector: the same bits as one per operand)
    and the stochastic-rounding draws start at ``rows.draw_offset``, so the operands are
    the whole tensor's rows.

    ``fmts[i]``: operand ``i``'s format (None or NVFP4; or MXFP4/MXFP4_OCP, whose kernels
    take no tensor amax: their decode scale is 1, ``global_encode_scale``'s for formats
    without a tensor scale). Default: all NVFP4.

    ``fused``: an NVFP4 ``"rows"`` operand and an NVFP4 ``"cols"`` operand of ``x`` come
    from one read (``fq_rows_cols_scaled``) where ``supported_rows_cols`` takes the shape;
    the same bits as the two kernels (``OPERAND_PASSES``)."""
    from pallas_kernels.quantize import operand_sm90 as fq
    from pallas_kernels.quantize.common_sm90 import finite_amax, global_scales, key_words, scalars

    kw = interpret_params(mode)
    m = x[0]
    fmts = [get_format(f) if is_mx_fp4(f) else None
            for f in (fmts if fmts is not None else [None] * len(kinds))]
    nv = [i for i, f in enumerate(fmts) if f is None]  # NVFP4: a tensor amax each
    amax = rht_amax = None
    rot = [i for i in nv if signs[i] is not None]
    if [kinds[i] for i in nv].count("rows") == 1 and len(rot) == 1:  # x or dy of nvfp4
        amax, rht_amax = fq.cols_amaxes(m, signs[rot[0]], **kw)
    amaxes = [rht_amax if sg is not None else amax for sg in signs]
    for i, sg in enumerate(signs):  # every amax explicit (as fq_rows/fq_cols/fq_2d get them)
        if fmts[i] is not None:  # MX: amax 0 gives enc = dec = 1 (no tensor scale)
            amaxes[i] = jnp.float32(0.0)
        elif amaxes[i] is None:
            if sg is None:
                amax = finite_amax(m) if amax is None else amax
                amaxes[i] = amax
            else:
                amaxes[i] = fq.rht_cols_amax(m, sg, **kw)
    offset = None
    if rows.axes is not None:
        if not rows.local_amax:
            amaxes = list(rows.reduce_amax(jnp.stack([jnp.asarray(a, jnp.float32)
                                                      for a in amaxes])))
        offset = rows.draw_offset(m.shape)
    # The tensor scales and the kernels' scalar vectors of all operands at once (elementwise
    # over a vector: the same bits as one operand at a time, in one XLA fusion instead of a
    # chain of tiny ones per operand)
    enc, dec = global_scales(None, jnp.stack([jnp.asarray(a, jnp.float32) for a in amaxes]))

    def sign_row(sg):  # 16 (NVFP4) or 32 (MX) signs, padded to 32 with ones
        sg = jnp.ones((32,), jnp.float32) if sg is None else jnp.asarray(sg, jnp.float32)
        return jnp.pad(sg.reshape(-1), (0, 32 - sg.size), constant_values=1.0)

    sc = scalars(enc, dec, jnp.stack([sign_row(sg) for sg in signs]))
    sc = sc.reshape(-1)  # every kernel takes the whole batch and reads its own row
    made = {}
    pair = _rows_cols_pair(m, kinds, sr_keys, fmts) if fused else None
    if pair is not None:
        i_r, i_c = pair
        o_r, o_c = fq.fq_rows_cols_scaled(
            m, sc, sc, key_words(sr_keys[i_r], offset), key_words(sr_keys[i_c], offset),
            sr_rows=sr_keys[i_r] is not None, sr_cols=sr_keys[i_c] is not None,
            rht=signs[i_c] is not None, sc_row_rows=i_r, sc_row_cols=i_c, **kw)
        made = {i_r: o_r, i_c: o_c}
    res = []
    for i, (kind, sr_key, sg) in enumerate(zip(kinds, sr_keys, signs, strict=True)):
        if i in made:
            o = made[i]
        elif kind == "2d":
            o = fq.fq_2d_scaled(m, sc, sc_row=i, **kw)
        elif kind == "rows":
            o = fq.fq_rows_scaled(m, sc, key_words(sr_key, offset), sr=sr_key is not None,
                                  sc_row=i, fmt=fmts[i], **kw)
        else:
            o = fq.fq_cols_scaled(m, sc, key_words(sr_key, offset), sr=sr_key is not None,
                                  rht=sg is not None, sc_row=i, fmt=fmts[i], **kw)
        res.append((o[None], dec[i]))
    return res


def _rows_cols_pair(m: jax.Array, kinds: list[str], sr_keys: list[Any], fmts: list[Any]
                    ) -> tuple[int, int] | None:
    """The (rows, cols) operand indices ``make_operands`` makes in one pass: the first NVFP4
    ``"rows"`` and the first NVFP4 ``"cols"`` operand, where ``supported_rows_cols`` takes
    ``m``'s shape (SR rows in quads); else None."""
    from pallas_kernels.quantize import operand_sm90 as fq

    nv_rows = [i for i, k in enumerate(kinds) if k == "rows" and fmts[i] is None]
    nv_cols = [i for i, k in enumerate(kinds) if k == "cols" and fmts[i] is None]
    if not nv_rows or not nv_cols:
        return None
    i_r, i_c = nv_rows[0], nv_cols[0]
    if not fq.supported_rows_cols(m.shape, m.dtype, sr_rows=sr_keys[i_r] is not None):
        return None
    return i_r, i_c


def scaled_gemm(a: jax.Array, b: jax.Array, alpha: jax.Array, *, trans_a: bool,
                trans_b: bool, out_dtype: Any, mode: str, gemm: str | None = None
                ) -> jax.Array | None:
    """``(alpha * op(a) @ op(b)).astype(out_dtype)`` on the Pallas ``gemm_alpha`` kernel
    (``gemm/alpha_sm90``: alpha in the epilogue, one rounding), or None where XLA's GEMM
    runs instead: unless ``gemm`` (default: ``gemm_backend()``) is ``pallas``, ``mode`` is
    ``"on"`` (an sm_90 GPU), the output bf16 and the sizes tile-aligned and at least
    ``alpha_sm90.MIN_MKN``. ``a``, ``b``: 2D bf16, ``op`` the transpose where asked."""
    from pallas_kernels.gemm import alpha_sm90 as ga

    m, k = a.shape[::-1] if trans_a else a.shape
    n = b.shape[0] if trans_b else b.shape[1]
    gemm = gemm_backend() if gemm is None else gemm
    if (gemm == "pallas" and mode == "on"
            and jnp.dtype(out_dtype) == jnp.bfloat16 and ga.preferred(m, k, n)):
        return ga.gemm_alpha(a, b, alpha, trans_a=trans_a, trans_b=trans_b)
    return None


def _kernel_of(t: jax.Array, r: OperandRequest) -> str | None:
    s = r.spec
    return operand_kernel(t, block_2d=s.block_2d, axis=r.axis, stochastic=s.stochastic,
                          rht=r.hadamard, key=r.key, block_scale_rule=s.block_scale_rule,
                          fmt=s.fmt, row_scaled=s.row_scaled, rounding=s.rounding)


@dataclasses.dataclass(frozen=True)
class HopperBackend(Backend):
    """The sm_90 backend. ``mode``: ``"on"`` (the GPU) or ``"interpret"`` (Mosaic GPU's
    interpret mode: CPU tests; its GEMMs run on the reference); ``gemm_impl``:
    ``gemm_backend()``'s value; ``operand_passes``: ``operand_passes()``'s."""

    name: ClassVar[str] = "pallas"
    mode: str = "on"
    gemm_impl: str = "pallas"
    fp8: frozenset[str] = frozenset()
    operand_passes: str = "separate"

    def operand_reason(self, t, request):
        if request.gemm in self.fp8 and t.shape[0] == 1 and all(
                d % FP8_ALIGN == 0 for d in t.shape[1:]):
            return ("an operand of an FP8 MXFP4 GEMM is made as codes and scales (the "
                    "reference's quantizer), not as bfloat16 values")
        if not request.spec.quantized:
            return "an unquantized operand enters its GEMM as the tensor itself (reference)"
        if jnp.dtype(request.dtype) != jnp.bfloat16:
            return "the operand kernels write bfloat16 and this operand's GEMM is float32"
        if _kernel_of(t, request) is None:
            return ("no fused operand kernel covers this spec, shape, dtype and key "
                    "(operand_kernel)")
        return None

    def make_operands(self, t, requests, rows=WHOLE):
        requests = list(requests)
        kinds = [_kernel_of(t, r) for r in requests]
        sr_keys = [r.key if r.spec.stochastic else None for r in requests]
        signs = [r.signs if kind == "cols" and r.hadamard else None
                 for r, kind in zip(requests, kinds, strict=True)]
        mode = self.mode

        def kernels(x, sr_keys, signs):
            made = make_operands(x, kinds, sr_keys, signs, mode, rows,
                                 fmts=[r.spec.fmt for r in requests],
                                 fused=self.operand_passes == "fused")
            return [Operand.from_scaled(v, d) for v, d in made]

        # Pallas calls have no batching rule here: under jax.vmap these operands take the
        # reference (vmapped), which is what the unbatched kernels compute per example.
        f = jax.custom_batching.custom_vmap(kernels)

        @f.def_vmap
        def _(axis_size, in_batched, x, sr_keys, signs):
            del axis_size

            def reference(x, sr_keys, signs):
                reqs = [dataclasses.replace(r, key=k if k is not None else r.key, signs=s)
                        for r, k, s in zip(requests, sr_keys, signs, strict=True)]
                ops = XLA.make_operands(x, reqs, rows)
                return [Operand.from_scaled(op.scaled(r.dtype), op.decode_scale)
                        for op, r in zip(ops, reqs, strict=True)]

            in_axes = jax.tree.map(lambda b: 0 if b else None, in_batched)
            res = jax.vmap(reference, in_axes=tuple(in_axes))(x, sr_keys, signs)
            return res, jax.tree.map(lambda _: True, res)

        with jax.named_scope("fp4_operands"):
            return f(t, sr_keys, signs)

    def fp8_reason(self, subscripts, a, b, out_dtype):
        """None when the FP8 MXFP4 GEMM runs this GEMM, else why not."""
        if self.gemm_impl != "fp8":
            return f"FP4JAX_KERNEL_GEMM is {self.gemm_impl!r}"
        if subscripts not in LAYOUTS:
            return f"unknown GEMM layout {subscripts!r}"
        if jnp.dtype(out_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
            return "the FP8 GEMM writes bfloat16 or float32"
        ax = _contracted(subscripts)
        for op, axis in zip((a, b), ax, strict=True):
            if (why := fp8_operand_reason(op.codes, axis)) is not None:
                return why
        from pallas_kernels.gemm import mxfp4_fp8wgmma_sm90 as mx

        (_, ra, ca), (_, rb, cb) = a.shape, b.shape
        m, k = (ra, ca) if ax[0] == 2 else (ca, ra)
        n = rb if ax[1] == 2 else cb
        return mx.unsupported_reason(m, k, n)

    def gemm_reason(self, subscripts, a, b, out_dtype):
        if self.fp8_reason(subscripts, a, b, out_dtype) is None:
            return None
        if self.mode != "on" or self.gemm_impl == "xla":
            return (f"the alpha GEMM runs on the GPU only (mode {self.mode!r}, "
                    f"FP4JAX_KERNEL_GEMM {self.gemm_impl!r})")
        if subscripts not in LAYOUTS:
            return f"unknown GEMM layout {subscripts!r}"
        if not (a.quantized and b.quantized):
            return "a GEMM with an unquantized operand runs on the reference"
        if gemm_dtype(a, b) != jnp.bfloat16:
            return "a float32 GEMM runs on the reference"
        if jnp.ndim(a.decode_scale) or jnp.ndim(b.decode_scale):
            return "per-row decode scales are applied on the reference"
        if a.shape[0] != 1:
            return "the alpha GEMM takes one matrix (B == 1)"
        if jnp.dtype(out_dtype) != jnp.bfloat16:
            return "the alpha GEMM writes bfloat16"
        from pallas_kernels.gemm import alpha_sm90 as ga

        trans_a, trans_b = LAYOUTS[subscripts]
        (_, ra, ca), (_, rb, cb) = a.shape, b.shape
        m, k = (ca, ra) if trans_a else (ra, ca)
        n = rb if trans_b else cb
        if not ga.preferred(m, k, n):
            return (f"M, K, N = {m}, {k}, {n}: below alpha_sm90.MIN_MKN or not tile-aligned "
                    "(XLA's GEMM is as fast there)")
        return None

    def gemm(self, subscripts, a, b, *, out_dtype, precision=None):
        if self.fp8_reason(subscripts, a, b, out_dtype) is None:
            from pallas_kernels.gemm import mxfp4_fp8wgmma_sm90 as mx

            ax = _contracted(subscripts)
            ac, ae = _k_major(a.codes, ax[0])
            bc, be = _k_major(b.codes, ax[1])
            # MX formats have no tensor scale: the decode scales are 1.0 (fp8_operand_reason)
            run = mx.mxfp4_gemm if self.mode == "on" else mx.emulate
            with jax.named_scope("fp4_fp8_gemm"):
                return run(ac, ae, bc, be, out_dtype=out_dtype)[None]
        from pallas_kernels.gemm import alpha_sm90 as ga

        trans_a, trans_b = LAYOUTS[subscripts]
        y = ga.gemm_alpha(a.scaled(jnp.bfloat16)[0], b.scaled(jnp.bfloat16)[0],
                          a.decode_scale * b.decode_scale, trans_a=trans_a, trans_b=trans_b)
        return y[None]


@dataclasses.dataclass(frozen=True)
class HopperProvider:
    """Chooses ``HopperBackend`` for a call (``fp4jax.backends.Provider``).

    Asked by name (``implementation="pallas"``): an sm_90 GPU (or ``FP4JAX_KERNELS=
    interpret``), an unbatched call and a recipe with an operand the kernels implement
    (``recipe_reason``), at every size and device count. Automatically: under
    ``FP4JAX_KERNELS=on`` on an sm_90 GPU at every size; under ``interpret`` everywhere;
    under ``auto`` on an sm_90 GPU for unbatched calls of ``M*K*N >= KERNEL_AUTO_MIN_MKN``
    that XLA does not partition over several devices (a Pallas call inside a multi-device,
    sharded ``jit`` is not partitioned: data-parallel runs keep the reference unless
    inside ``fp4jax.sharding.data_parallel``/``one_device``)."""

    name: str = "pallas"
    priority: int = 10
    env_modes: tuple[str, ...] = ("interpret",)
    gemm: str | None = None

    def backend(self, call: DotCall, mode: str, explicit: bool) -> Backend:
        reason = recipe_reason(call.recipe)
        if explicit:
            if reason is not None:
                raise NotSupported(reason)
            if call.batch != 1:
                raise NotSupported("the call is batched (dot_general batch dimensions): "
                                   "kernels take B == 1")
            if mode == "interpret":
                return self.make("interpret", call)
            if not on_sm90():
                raise NotSupported("no sm_90 (Hopper) GPU is the default device (set "
                                   "FP4JAX_KERNELS=interpret to run the kernels in interpret "
                                   "mode on CPU)")
            if (why := mosaic_api_reason()) is not None:
                raise NotSupported(why)
            return self.make("on", call)
        if reason is not None:
            raise NotSupported(reason)
        if mode == "interpret":
            return self.make("interpret", call)
        if mode not in ("on", "auto") or not on_sm90():
            raise NotSupported(f"no sm_90 GPU, or FP4JAX_KERNELS={mode!r} asks for another "
                               "backend")
        if (why := mosaic_api_reason()) is not None:
            raise NotSupported(why)
        if mode == "auto":
            if call.batch != 1 or call.m * call.k * call.n < KERNEL_AUTO_MIN_MKN:
                raise NotSupported("batched, or M*K*N below KERNEL_AUTO_MIN_MKN")
            if call.partitioned:
                raise NotSupported("XLA partitions this call over several devices")
        return self.make("on", call)

    def make(self, mode: str, call: DotCall) -> HopperBackend:
        """The backend of ``call`` in ``mode``: the GEMM choice is ``self.gemm``, else
        ``gemm_backend()``; under ``fp8`` the recipe's all-MX-FP4 GEMMs (``fp8_gemms``)
        get their operands as codes; the operand passes are ``operand_passes()``."""
        impl = self.gemm or gemm_backend()
        return HopperBackend(mode, impl, fp8_gemms(call.recipe) if impl == "fp8"
                             else frozenset(), operand_passes())


PROVIDER = HopperProvider()
"""The entry point ``fp4jax.backends`` loads (``pyproject.toml``)."""

FP8_PROVIDER = HopperProvider(name="pallas_fp8", priority=11, gemm="fp8")
"""``implementation="pallas_fp8"``: the Hopper backend with the FP8 MXFP4 GEMM whatever
``FP4JAX_KERNEL_GEMM`` says (``pyproject.toml``'s entry point ``pallas_fp8``)."""
