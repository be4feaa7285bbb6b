"""``fp4jax.dot`` / ``fp4jax.dot_general``: quantized GEMMs with the recipe's backward pass.

Every call is brought to a canonical batched form ``lhs (B, M, K) @ rhs (B, K, N)``
and runs a ``jax.custom_vjp`` whose three GEMMs follow the ``Recipe``:

* forward:  ``y  = Qf(x)  @ Qf(w)``                          (contract K)
* backward: ``dx = Qd(dy) @ Qd(w).T``                        (contract N)
            ``dw = Qw(H x).T @ Qw(H dy)``, H the RHT on M    (contract M)

Residuals are quantized wherever the recipe quantizes: the forward pass saves
the dgrad-ready weight (the fprop one itself when 2D-scaled) and the
wgrad-ready (Hadamard-rotated, token-blocked) activation, not ``x`` and ``w``.

GEMM emulation follows the tensor-core semantics of NVFP4 (paper Eq. 5):
``sum_k (q_a s_a)(q_b s_b)`` accumulated in float32, then times the two global
decode scales. ``q * s`` has at most ``fmt.scaled_bits`` significant bits (element plus
scale significand bits): where both operands have <= 8 (E2M1 times a scale of <= 5
mantissa bits, MXFP8/MXFP6 with E8M0 scales, E4M3 x E4M3) it is exact in bfloat16 and
the GEMM runs in bf16 with f32 accumulation; otherwise in float32 with
``Precision.HIGHEST``. Either way the operands and each product of two (at most
``2 * 12 = 24`` bits) are exact; only the float32 accumulation rounds.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax import numerics, sharding
from fp4jax import quantization as qz
from fp4jax.hadamard import random_hadamard_transform, resolve_signs
from fp4jax.recipes import GemmSpec, QuantSpec, Recipe, nvfp4
from pallas_kernels import dispatch

__all__ = ["OPERAND_AXES", "call_key", "dot", "dot_general", "gemm_inputs", "gemm_rht_signs",
           "operand_key", "reference_gemms", "reference_operand", "token_row_multiple"]

Operand = Any  # QuantizedArray | jax.Array

# fold_in indices of the per-call key: one per quantization point, one per RHT.
_KEY_IDX = {
    ("fprop", "lhs"): 0, ("fprop", "rhs"): 1,
    ("dgrad", "lhs"): 2, ("dgrad", "rhs"): 3,
    ("wgrad", "lhs"): 4, ("wgrad", "rhs"): 5,
    ("fprop", "rht"): 6, ("dgrad", "rht"): 7, ("wgrad", "rht"): 8,
}


def _step_key(key: jax.Array) -> jax.Array:
    """The call's key. Recipes with per-layer RHT signs carry ``(key, rht_key)`` stacked in
    one key array of shape (2,) (``_pack_keys``); every other recipe a scalar key."""
    return key[0] if key.ndim else key


def _pack_keys(key: jax.Array, rht_key: jax.Array) -> jax.Array:
    """``(key, rht_key)`` as one key array of shape (2,) (one argument through the
    custom_vjp and the kernels' custom_vmap)."""
    if jax.random.key_impl(rht_key) != jax.random.key_impl(key):
        raise ValueError(
            f"rht_key uses the PRNG implementation {jax.random.key_impl(rht_key)} and key "
            f"{jax.random.key_impl(key)}: make both with the same one (e.g. jax.random.key)"
        )
    data = jnp.stack([jax.random.key_data(key), jax.random.key_data(rht_key)])
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(key))


def _subkey(key: jax.Array, gemm: str, which: str) -> jax.Array:
    return jax.random.fold_in(_step_key(key), _KEY_IDX[(gemm, which)])


def operand_key(key: jax.Array, gemm: str, which: str) -> jax.Array:
    """The key operand ``which`` (``"lhs"``, ``"rhs"``) of ``gemm`` (``"fprop"``,
    ``"dgrad"``, ``"wgrad"``) draws its stochastic-rounding (or MS-EDEN) bits from, in a
    call with ``key`` (``call_key``'s): ``jax.random.fold_in`` of the call's step key by the
    operand's index (``_KEY_IDX``)."""
    return _subkey(key, gemm, which)


def gemm_rht_signs(recipe: Recipe, gemm: str, key: jax.Array) -> jax.Array:
    """The float32 +-1 sign vector of ``gemm``'s RHT (length ``hadamard``) in a call of
    ``recipe`` with ``key`` (``call_key``'s): the recipe's fixed vector, or drawn from the
    call's key (``"random"``) or its layer key (``"layer"``). The GEMM must have an RHT."""
    return _rht_signs(getattr(recipe, gemm), key, gemm)


def _scoped(name: str):
    """Runs the function under ``jax.named_scope(name)``: HLO metadata only (the op names
    that ``experiments/profile_step.py`` reads to attribute kernel time), same program."""
    def deco(f):
        @functools.wraps(f)
        def wrapped(*args, **kwargs):
            with jax.named_scope(name):
                return f(*args, **kwargs)
        return wrapped
    return deco


@_scoped("fp4_quantize")
def _quant(x: jax.Array, spec: QuantSpec, axis: int, key: jax.Array,
           packed_kernels: bool = False, shard: Any = None, group: int = 0,
           local_amax: bool = False) -> Operand:
    """Quantize one operand per its spec (or pass it through when unquantized).

    With ``packed_kernels`` (``DotBackend.packed_quantize``) the dispatcher's packed NVFP4
    quantize kernels take the round-to-nearest operands they cover
    (``dispatch.quantize_unsupported_reason``); everything else runs the XLA reference.
    ``shard``: ``x`` is a row block of a data-parallel tensor (``fp4jax.sharding``).
    ``group``: MS-EDEN's group, the GEMM's RHT size. ``local_amax``: with ``shard``, the
    shard's own tensor amax (``Recipe.amax_scope="local"``).
    """
    if not spec.quantized:
        return x
    if (packed_kernels and shard is None and spec.rounding == "nearest"
            and dispatch.is_supported("quantize", x.shape, x.dtype, fmt=spec.fmt, axis=axis,
                                      block_2d=spec.block_2d,
                                      block_scale_rule=spec.block_scale_rule,
                                      row_scaled=spec.row_scaled)):
        return dispatch.quantize(x, spec.fmt, axis=-1, block_2d=spec.block_2d,
                                 backend="pallas")
    return qz.quantize_unchecked(x, key if spec.random else None, spec.fmt, axis % x.ndim,
                                 spec.block_2d, spec.rounding, spec.block_scale_rule, shard,
                                 row_scaled=spec.row_scaled,
                                 eden_group=group if spec.rounding == "ms_eden" else 0,
                                 local_amax=local_amax)


def _rht_signs(g: GemmSpec, key: jax.Array, gemm: str) -> jax.Array:
    """The GEMM's RHT sign vector (float32 +-1 of length ``g.hadamard``)."""
    signs = g.hadamard_signs
    if signs == "random":
        signs = _subkey(key, gemm, "rht")
    elif signs == "layer":  # the layer's constant key (dot_general's rht_key)
        signs = jax.random.fold_in(key[1], _KEY_IDX[(gemm, "rht")])
    elif isinstance(signs, tuple):
        signs = np.asarray(signs, np.float32)
    return resolve_signs(signs, g.hadamard)


@_scoped("fp4_rht")
def _rht(x: jax.Array, g: GemmSpec, axis: int, key: jax.Array, gemm: str) -> jax.Array:
    """Zero-pad ``axis`` to the Hadamard size and rotate (no-op when the GEMM has no RHT)."""
    if not g.hadamard:
        return x
    pad = (-x.shape[axis]) % g.hadamard
    if pad:
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, pad)
        x = jnp.pad(x, widths)
    return random_hadamard_transform(x, axis=axis, size=g.hadamard,
                                     signs=_rht_signs(g, key, gemm))


def _bf16_exact(op: Operand) -> bool:
    """Whether ``op`` (its ``data * scale`` for a quantized one) is exact in bfloat16: 8
    significant bits at most (``BlockFormat.scaled_bits``)."""
    if isinstance(op, qz.QuantizedArray):
        return op.fmt.scaled_bits <= 8
    return op.dtype == jnp.bfloat16


def gemm_inputs(a: Operand, b: Operand, precision: Any
                ) -> tuple[jax.Array, jax.Array, Any, Any, Any]:
    """How the XLA path feeds a GEMM its two operands (each a ``QuantizedArray`` or an
    unquantized array): ``(a_value, b_value, a_scale, b_scale, precision)``. The values are
    ``scaled_data`` (``data * scale``, no tensor scale) of a quantized operand or the array
    itself, both in bfloat16 when both are exact in it (``_bf16_exact``), else float32; the
    scales are the tensor decode scales (None when unquantized); the precision is
    ``Precision.HIGHEST`` when an operand is quantized, else ``precision``. Also the
    per-expert GEMMs of ``fp4jax.ragged_dot``."""
    compute = jnp.bfloat16 if (_bf16_exact(a) and _bf16_exact(b)) else jnp.float32
    quantized = isinstance(a, qz.QuantizedArray) or isinstance(b, qz.QuantizedArray)
    if quantized:
        precision = jax.lax.Precision.HIGHEST

    def unpack(op):
        if isinstance(op, qz.QuantizedArray):
            with jax.named_scope("fp4_decode"):
                return qz.scaled_data(op, compute), op.global_scale
        return op.astype(compute), None

    av, sa = unpack(a)
    bv, sb = unpack(b)
    return av, bv, sa, sb, precision


def _gemm(subscripts: str, a: Operand, b: Operand, precision: Any) -> jax.Array:
    """``einsum(subscripts)`` of two operands, f32 accumulation, global scales last."""
    av, bv, sa, sb, precision = gemm_inputs(a, b, precision)
    return _einsum_scaled(subscripts, av, bv, sa, sb, precision)


def _gemm_out(subscripts: str, a: Operand, b: Operand, precision: Any, out_dtype: Any,
              native: str = "off") -> jax.Array:
    """``_gemm(...).astype(out_dtype)``, or the same GEMM on the dispatcher's Blackwell
    backend (``native``: ``dispatch.native_mode()``) when it takes these operands (NVFP4
    quantized along the contracted axis); equal up to float32 accumulation order."""
    if native != "off":
        y = dispatch.native_gemm(subscripts, a, b, out_dtype=out_dtype, mode=native)
        if y is not None:
            return y
    return _gemm(subscripts, a, b, precision).astype(out_dtype)


def _einsum_scaled(subscripts: str, av: jax.Array, bv: jax.Array, sa: Any, sb: Any,
                   precision: Any) -> jax.Array:
    """``einsum(av, bv)`` accumulated in f32, times the tensor decode scales present.

    A row-scaled operand's decode scales (one per row: its shape with the contracted axis
    of length 1, ``fp4jax.quantization.global_encode_scale``) are indexed by its free and batch
    axes only, so they factor out of the sum over the contracted axis exactly: they are laid
    out along the output's axes (``_scale_to_output``) and multiplied in with the other
    operand's scale as one factor per output element, ``y * (dec_a[m] * dec_b[n])``, as a
    scalar pair is (Transformer Engine's row-scaled GEMM, ``pytorch/cpp_extensions/
    gemm.py`` l. 341-353, folds the two into one factor likewise when one side is a scalar;
    with row scales on both sides it multiplies twice)."""
    y = jnp.einsum(subscripts, av, bv, preferred_element_type=jnp.float32, precision=precision)
    # cuBLAS-style alpha = dec_a * dec_b (NVFP4 paper Eq. 5). Applying the two scales one
    # at a time would avoid the underflow of alpha for two tiny tensors
    # (amax_a * amax_b < ~1e-31), but XLA may re-associate it differently per call site,
    # which breaks bit-reproducibility between equivalent programs.
    ins, out = subscripts.split("->")
    scales = [_scale_to_output(s, sub, out) for s, sub in zip((sa, sb), ins.split(","),
                                                              strict=True) if s is not None]
    if scales:
        y = y * functools.reduce(jnp.multiply, scales)
    return y


def _scale_to_output(s: jax.Array, sub: str, out: str) -> jax.Array:
    """An operand's decode scale(s) broadcastable against the einsum output ``out``: a
    scalar as is; per-row scales (the operand's shape, ``sub``, with its contracted axes of
    length 1) with those axes dropped and the rest moved to their output positions."""
    if jnp.ndim(s) == 0:
        return s
    letters = [c for c in sub if c in out]
    s = s.reshape([d for d, c in zip(s.shape, sub, strict=True) if c in out])
    order = [c for c in out if c in letters]
    s = jnp.transpose(s, [letters.index(c) for c in order])
    return s.reshape([s.shape[order.index(c)] if c in order else 1 for c in out])


# ---------------------------------------------------------------------------
# The kernel path: each quantized operand as its ``data * scale`` (Pallas kernels on sm_90),
# each unquantized one as the XLA path feeds it.
# ---------------------------------------------------------------------------


def _kernel_spec_reason(q: QuantSpec) -> str | None:
    """None when the Hopper operand kernels implement the quantized operand spec ``q``,
    else why not (``dispatch.spec_unsupported_reason``, the one statement of their
    coverage)."""
    return dispatch.spec_unsupported_reason(q.fmt, block_scale_rule=q.block_scale_rule,
                                            row_scaled=q.row_scaled, rounding=q.rounding)


def _scaled_path_applies(recipe: Recipe) -> bool:
    """Whether the kernel path (``DotBackend`` ``"pallas"``) takes the recipe: some operand
    is quantized with a spec the kernels implement (``dispatch.spec_unsupported_reason``:
    NVFP4 with one tensor scale or MX FP4, the ``"max"`` block scale rule, round-to-nearest
    or stochastic rounding). The other operands ride along, each as the XLA path makes it:
    a quantized one with another spec (FP6/FP8, 4over6, row-scaled, MS-EDEN) from the XLA
    quantizer, an unquantized one (a high-precision GEMM: ``nvfp4_fwd_only``, a precision
    switch) as the tensor itself, its GEMM on XLA as the XLA path runs it
    (``_gemm_kernel_path``), so the bits are the XLA path's. A recipe with no such operand
    (``bf16``, ``mxfp8``, ``quartet2``) runs wholly on the XLA path."""
    return any(q.quantized and _kernel_spec_reason(q) is None
               for g in (recipe.fprop, recipe.dgrad, recipe.wgrad) for q in (g.lhs, g.rhs))


def _gemm_dtypes(recipe: Recipe, x_dtype: Any, w_dtype: Any, g_dtype: Any) -> dict[str, Any]:
    """Per GEMM (``"fprop"``, ``"dgrad"``, ``"wgrad"``), the dtype ``_gemm`` computes it in
    on the XLA path, known before any operand is made: bfloat16 when both operands are exact
    in it (``_bf16_exact``: a quantized one when its format's ``scaled_bits`` <= 8, an
    unquantized one when it enters as bfloat16, i.e. its tensor is bfloat16 and the GEMM has
    no RHT: the RHT returns float32), else float32. ``x_dtype``, ``w_dtype``, ``g_dtype``:
    the dtypes of x, w and the cotangent dy as ``_make_dot3`` quantizes them."""
    tensors = {"fprop": (x_dtype, w_dtype), "dgrad": (g_dtype, w_dtype),
               "wgrad": (x_dtype, g_dtype)}
    out = {}
    for name, g in recipe.gemms.items():
        exact = [q.fmt.scaled_bits <= 8 if q.quantized
                 else jnp.dtype(t) == jnp.bfloat16 and not g.hadamard
                 for q, t in zip((g.lhs, g.rhs), tensors[name], strict=True)]
        out[name] = jnp.dtype(jnp.bfloat16 if all(exact) else jnp.float32)
    return out


def _kernel_for(x: jax.Array, g: GemmSpec, spec: QuantSpec, axis: int, key: jax.Array):
    """The dispatcher's fused kernel for this operand (``"rows"``, ``"cols"``, ``"2d"``) or
    None (the XLA path). ``x`` is canonical (B, R, C); ``axis`` 1 or 2 is the blocked axis."""
    return dispatch.operand_kernel(x, block_2d=spec.block_2d, axis=axis,
                                   stochastic=spec.stochastic, rht=g.hadamard,
                                   key=_step_key(key),
                                   block_scale_rule=spec.block_scale_rule, fmt=spec.fmt,
                                   row_scaled=spec.row_scaled, rounding=spec.rounding)


@_scoped("fp4_operands")
def _scaled_operands(x: jax.Array, ops: tuple, key: jax.Array, kmode: str, shard: Any = None,
                     local_amax: bool = False, dtypes: dict[str, Any] | None = None
                     ) -> list[tuple[jax.Array, Any]]:
    """Operands made from one tensor ``x`` as the kernel path's GEMMs take them; ``ops``:
    ``(gemm_spec, quant_spec, axis, gemm, which)`` per operand; ``dtypes``: per GEMM name
    the dtype it computes in (``_gemm_dtypes``; default bfloat16 for all).

    A quantized operand is ``(scaled_data(Q(x)) in its GEMM's dtype, tensor decode scale)``:
    from a fused kernel when one covers it (its spec, shape and dtype; the kernels write
    bfloat16, so an operand of a float32 GEMM is never theirs), else from the XLA path (the
    same bits either way). An unquantized operand is ``(x, None)``: ``x`` itself (rotated
    when its GEMM has an RHT), exactly the XLA path's operand. A rows operand and an RHT'd
    cols operand of the same tensor take both tensor amaxes from one read
    (``cols_amaxes``). ``shard``: as ``_quant``'s."""
    def dtype(op):
        return jnp.dtype(jnp.bfloat16) if dtypes is None else dtypes[op[3]]

    def xla(x, key, op):
        g, spec, axis, gemm, which = op
        q = _quant(_rht(x, g, axis, key, gemm), spec, axis, _subkey(key, gemm, which),
                   shard=shard, group=g.hadamard, local_amax=local_amax)
        if not spec.quantized:
            return q, None
        return qz.scaled_data(q, dtype(op)), q.global_scale

    kinds = [_kernel_for(x, op[0], op[1], op[2], key)
             if op[1].quantized and dtype(op) == jnp.bfloat16 else None for op in ops]
    out: list = [None] * len(ops)
    for i, (op, kind) in enumerate(zip(ops, kinds, strict=True)):
        if kind is None:
            out[i] = xla(x, key, op)
    todo = [i for i, kind in enumerate(kinds) if kind is not None]
    if not todo:
        return out

    def xla_all(x, key):
        return [xla(x, key, ops[i]) for i in todo]

    # Pallas calls have no correct batching rule here: under jax.vmap these operands take
    # the XLA path (vmapped), which is what the unbatched kernels compute per example.
    f = jax.custom_batching.custom_vmap(
        lambda x, key: _kernel_operands(x, [ops[i] for i in todo], [kinds[i] for i in todo],
                                        key, kmode, shard, local_amax))

    @f.def_vmap
    def _(axis_size, in_batched, x, key):
        del axis_size
        res = jax.vmap(xla_all, in_axes=[0 if b else None for b in in_batched])(x, key)
        return res, [(True, True)] * len(todo)

    for i, r in zip(todo, f(x, key), strict=True):
        out[i] = tuple(r)
    return out


def _kernel_operands(x, ops, kinds, key, kmode, shard=None, local_amax=False):
    sr_keys = [_subkey(key, gemm, which) if spec.stochastic else None
               for (_, spec, _, gemm, which) in ops]
    signs = [_rht_signs(op[0], key, op[3]) if kind == "cols" and op[0].hadamard else None
             for op, kind in zip(ops, kinds, strict=True)]
    return dispatch.make_operands(x, kinds, sr_keys, signs, kmode, shard=shard,
                                  local_amax=local_amax, fmts=[op[1].fmt for op in ops])


# each GEMM of one dot call on the canonical tensors x (B, M, K), w (B, K, N), dy (B, M, N)
_GEMM_SUBSCRIPTS = {"fprop": "bmk,bkn->bmn",  # x @ w
                    "dgrad": "bmn,bkn->bmk",  # dy @ w^T (w stored (K, N))
                    "wgrad": "bmk,bmn->bkn"}  # x^T @ dy (x stored (M, K))
# whether the kernel path transposes (lhs, rhs) for each
_GEMM_LAYOUTS = {_GEMM_SUBSCRIPTS["fprop"]: (False, False),
                 _GEMM_SUBSCRIPTS["dgrad"]: (False, True),
                 _GEMM_SUBSCRIPTS["wgrad"]: (True, False)}


def _gemm_kernel_path(subscripts: str, av: jax.Array, bv: jax.Array, sa: Any, sb: Any,
                      out_dtype: Any, kmode: str, gemm: str, precision: Any = None
                      ) -> jax.Array:
    """One GEMM of the kernel path on ``_scaled_operands``' operands, ``(value, decode
    scale)`` each (scale None: unquantized), computing what ``_gemm(...).astype(out_dtype)``
    computes on the XLA path's operands.

    Both operands bfloat16 ``data * scale`` with one tensor scale each: the dispatcher's
    scaled GEMM kernel where it takes it (``dispatch.scaled_gemm``: unbatched, ``alpha =
    sa * sb`` in its epilogue; equal up to float32 accumulation order). Otherwise (an
    unquantized operand, a float32 GEMM, per-row scales, or a shape the kernel does not
    tile) the XLA path's own GEMM: both values in bfloat16 when both are bfloat16, else
    float32 (the casts ``_gemm`` makes: a quantized value is already in its GEMM's dtype,
    ``_gemm_dtypes``), ``Precision.HIGHEST`` when an operand is quantized and ``precision``
    otherwise, then ``_einsum_scaled``: the XLA path's bits."""
    trans_a, trans_b = _GEMM_LAYOUTS[subscripts]
    bf16 = av.dtype == jnp.bfloat16 and bv.dtype == jnp.bfloat16
    if (av.shape[0] == 1 and bf16 and sa is not None and sb is not None
            and jnp.ndim(sa) == 0 and jnp.ndim(sb) == 0):
        y = dispatch.scaled_gemm(av[0], bv[0], sa * sb, trans_a=trans_a, trans_b=trans_b,
                                 out_dtype=out_dtype, mode=kmode, gemm=gemm)
        if y is not None:
            return y[None]
    compute = jnp.bfloat16 if bf16 else jnp.float32
    if sa is not None or sb is not None:
        precision = jax.lax.Precision.HIGHEST
    return _einsum_scaled(subscripts, av.astype(compute), bv.astype(compute), sa, sb,
                          precision).astype(out_dtype)


OPERAND_AXES = {("fprop", "lhs"): 2, ("fprop", "rhs"): 1, ("dgrad", "lhs"): 2,
                ("dgrad", "rhs"): 2, ("wgrad", "lhs"): 1, ("wgrad", "rhs"): 1}
"""The blocked (quantized) axis of each canonical operand ``(gemm, which)``: x (1, M, K) and
dy (1, M, N) along their last axis for fprop/dgrad and along the tokens for wgrad; w (1, K,
N) along K for fprop, along N for dgrad (module docstring)."""


def _operand_specs(recipe: Recipe) -> dict[str, tuple]:
    """The six operands as ``(gemm spec, quant spec, blocked axis, gemm, which)``."""
    def op(gemm, which):
        g = getattr(recipe, gemm)
        return (g, getattr(g, which), OPERAND_AXES[(gemm, which)], gemm, which)

    return {"x_fprop": op("fprop", "lhs"), "w_fprop": op("fprop", "rhs"),
            "g_dgrad": op("dgrad", "lhs"), "w_dgrad": op("dgrad", "rhs"),
            "x_wgrad": op("wgrad", "lhs"), "g_wgrad": op("wgrad", "rhs")}


def reference_operand(t: jax.Array, recipe: Recipe, gemm: str, which: str, key: jax.Array
                      ) -> tuple[jax.Array, Operand]:
    """One GEMM operand as ``fp4jax.dot``'s XLA reference makes it.

    Args:
      t: the canonical tensor: x ``(1, M, K)``, w ``(1, K, N)`` or dy ``(1, M, N)`` (the
        operands of ``gemm``: fprop ``x @ w``, dgrad ``dy @ w.T``, wgrad ``x.T @ dy``).
      recipe: the ``Recipe``; gemm: ``"fprop"``, ``"dgrad"`` or ``"wgrad"``; which:
        ``"lhs"`` or ``"rhs"``.
      key: the call's key as ``call_key`` returns it.

    Returns:
      ``(r, q)``: ``r`` is ``t`` zero-padded and rotated by the GEMM's RHT along the blocked
      axis (``OPERAND_AXES``; ``t`` itself without RHT), the quantizer's input; ``q`` its
      ``QuantizedArray`` (``r`` itself when the operand is unquantized).
    """
    g = getattr(recipe, gemm)
    axis = OPERAND_AXES[(gemm, which)]
    r = _rht(t, g, axis, key, gemm)
    return r, _quant(r, getattr(g, which), axis, _subkey(key, gemm, which), group=g.hadamard)


def reference_gemms(x: jax.Array, w: jax.Array, dy: jax.Array, recipe: Recipe, key: jax.Array,
                    out_dtype: Any = jnp.float32) -> dict[str, tuple[jax.Array, tuple, tuple]]:
    """The three GEMMs of one ``fp4jax.dot`` call on the XLA reference, with their operands:
    what ``fp4jax.diagnostics.gemm_stats`` measures, without the custom VJP (each operand
    quantized once, for its GEMM and for its statistics).

    Args:
      x: ``(B, M, K)``, w: ``(B, K, N)``, dy: ``(B, M, N)`` (the cotangent of ``y``):
        ``dot``'s canonical tensors (``B = 1`` unbatched), float (bf16/f16/f32).
      recipe: the ``Recipe``; key: the call's key as ``call_key`` returns it.
      out_dtype: ``y``'s dtype (``dot``'s ``preferred_element_type``).

    Returns:
      ``{"fprop": (y, lhs, rhs), "dgrad": (dx, lhs, rhs), "wgrad": (dw, lhs, rhs)}``:
      ``y (B, M, N)`` in ``out_dtype``, ``dx (B, M, K)`` in ``x``'s dtype, ``dw (B, K, N)``
      in ``w``'s dtype, the same bits as ``dot``'s forward and its VJP with cotangent
      ``dy`` on the XLA path (``implementation="xla"``, outside
      ``fp4jax.sharding.data_parallel``, whose amaxes span the devices; the other backends
      compute these bits up to the float32 accumulation order of their GEMMs);
      ``lhs``/``rhs`` are each GEMM's operands as ``reference_operand`` returns them
      (fprop ``x, w``, dgrad ``dy, w``, wgrad ``x, dy``).

    Raises:
      ValueError: tensors not in that form.
    """
    if (x.ndim, w.ndim, dy.ndim) != (3, 3, 3) or x.shape[0] != w.shape[0] or (
            x.shape[2] != w.shape[1]) or dy.shape != (x.shape[0], x.shape[1], w.shape[2]):
        raise ValueError("reference_gemms: need x (B, M, K), w (B, K, N) and dy (B, M, N) "
                         f"(dot's canonical form), got x {x.shape}, w {w.shape}, dy {dy.shape}")
    # the cotangent as dot's backward takes it: y's dtype, then float32 unless bf16; widened
    # by numerics.exact_float32 (the same value), since XLA may fold away the plain convert
    # of a bf16 dy that it computed in float32 (excess precision) and quantize dy unrounded
    g = dy.astype(out_dtype)
    if g.dtype != jnp.bfloat16:
        g = numerics.exact_float32(dy if jnp.dtype(out_dtype) == jnp.float32 else g)
    tensors = {"fprop": (x, w), "dgrad": (g, w), "wgrad": (x, g)}
    dtypes = {"fprop": out_dtype, "dgrad": x.dtype, "wgrad": w.dtype}
    res = {}
    for gemm, (a, b) in tensors.items():
        lhs = reference_operand(a, recipe, gemm, "lhs", key)
        rhs = reference_operand(b, recipe, gemm, "rhs", key)
        out = _gemm_out(_GEMM_SUBSCRIPTS[gemm], lhs[1], rhs[1], None, dtypes[gemm])
        res[gemm] = (out, lhs, rhs)
    return res


def _operands(t: jax.Array, ops: tuple, key: jax.Array, backend: dispatch.DotBackend,
              shard: Any = None, local_amax: bool = False,
              dtypes: dict[str, Any] | None = None) -> list:
    """The GEMM operands ``ops`` made from one tensor ``t``, as ``backend`` consumes them:
    on the kernel path ``(scaled_data, tensor decode scale)`` pairs, ``(t, None)`` where the
    spec is unquantized (``_scaled_operands``; ``dtypes``: each GEMM's dtype,
    ``_gemm_dtypes``), otherwise the reference's ``QuantizedArray`` (or ``t`` itself where
    the spec is unquantized). ``shard``: ``t`` is a token-row shard (x and dy);
    ``local_amax``: its operands take the shard's own amax (``Recipe.amax_scope``)."""
    if backend.kmode != "off":
        return _scaled_operands(t, ops, key, backend.kmode, shard, local_amax, dtypes)
    return [_quant(_rht(t, g, axis, key, gemm), spec, axis, _subkey(key, gemm, which),
                   backend.packed_quantize, shard, g.hadamard, local_amax)
            for g, spec, axis, gemm, which in ops]


def _run_gemm(subscripts: str, a: Any, b: Any, out_dtype: Any, precision: Any,
              backend: dispatch.DotBackend) -> jax.Array:
    """One of the three GEMMs on ``backend``'s operands (``_operands``)."""
    if backend.kmode != "off":
        (av, sa), (bv, sb) = a, b
        return _gemm_kernel_path(subscripts, av, bv, sa, sb, out_dtype, backend.kmode,
                                 backend.gemm, precision)
    return _gemm_out(subscripts, a, b, precision, out_dtype, backend.native)


@functools.cache
def _make_dot3(recipe: Recipe, out_dtype: Any, lhs_dtype: Any, rhs_dtype: Any, precision: Any,
               backend: dispatch.DotBackend, shard: Any = None):
    """The one custom_vjp of canonical ``(B, M, K) @ (B, K, N)`` (the module docstring's
    three GEMMs), specialized on static args (all part of the cache key): ``backend``
    (``dispatch.dot_backend``: how operands and GEMMs run, the same bits on each);
    ``shard``: the ``fp4jax.sharding.data_parallel`` axes, x and dy being row shards.

    Residuals: the dgrad-ready weight (the fprop one itself when the two specs are equal
    and 2D-scaled, or both unquantized, with no RHT) and the wgrad-ready activation, in the
    backend's operand form (the XLA path: FP4 ``QuantizedArray``; the kernel path: bf16
    ``data * scale``, as many bytes as the bf16 baseline's ``x`` and ``w``; an unquantized
    operand is the tensor itself on both)."""
    fp, dg = recipe.fprop, recipe.dgrad
    ops = _operand_specs(recipe)
    g_dtype = jnp.dtype(jnp.bfloat16 if jnp.dtype(out_dtype) == jnp.bfloat16 else jnp.float32)
    dtypes = _gemm_dtypes(recipe, lhs_dtype, rhs_dtype, g_dtype)  # the kernel path's
    reuse_w = dg.rhs == fp.rhs and (not fp.rhs.quantized or fp.rhs.block_2d) and not (
        fp.hadamard or dg.hadamard) and (backend.kmode == "off"
                                         or dtypes["fprop"] == dtypes["dgrad"])
    local = recipe.amax_scope == "local"

    def forward(x, w, key, with_res=False):
        xo = _operands(x, (ops["x_fprop"], ops["x_wgrad"]) if with_res else (ops["x_fprop"],),
                       key, backend, shard, local, dtypes)
        wq, = _operands(w, (ops["w_fprop"],), key, backend, dtypes=dtypes)
        y = _run_gemm(_GEMM_SUBSCRIPTS["fprop"], xo[0], wq, out_dtype, precision, backend)
        return y, wq, xo[1:]

    @jax.custom_vjp
    def dot3(x, w, key):
        return forward(x, w, key)[0]

    def fwd(x, w, key):
        y, wq, (xq_w,) = forward(x, w, key, with_res=True)
        wq_d = wq if reuse_w else _operands(w, (ops["w_dgrad"],), key, backend,
                                            dtypes=dtypes)[0]
        return y, (wq_d, xq_w, key)

    def bwd(res, g):
        wq_d, xq_w, key = res
        g = g.astype(jnp.float32) if g.dtype != jnp.bfloat16 else g
        gq_d, gq_w = _operands(g, (ops["g_dgrad"], ops["g_wgrad"]), key, backend, shard,
                               local, dtypes)
        dx = _run_gemm(_GEMM_SUBSCRIPTS["dgrad"], gq_d, wq_d, lhs_dtype, precision, backend)
        dw = _run_gemm(_GEMM_SUBSCRIPTS["wgrad"], xq_w, gq_w, rhs_dtype, precision, backend)
        return dx, dw, None

    dot3.defvjp(fwd, bwd)
    return jax.jit(dot3)


def call_key(recipe: Recipe, key: Any, rht_key: Any = None) -> jax.Array:
    """The key a call of ``recipe`` runs with: ``key`` checked (required when the recipe
    draws random bits; ``key(0)``, never used, otherwise), packed with ``rht_key`` when the
    recipe draws RHT signs per layer (``_pack_keys``)."""
    if recipe.needs_key:
        if key is None:
            raise ValueError(
                f"recipe {recipe.name!r} draws random bits (stochastic rounding, MS-EDEN or "
                "random RHT signs): pass key=jax.random.key(seed) "
                "(a fresh key per step and layer, e.g. from jax.random.split or a Flax RNG stream)"
            )
        key = qz.normalize_key(key)
    else:
        key = jax.random.key(0) if key is None else qz.normalize_key(key)
    if recipe.needs_layer_key:
        if rht_key is None:
            raise ValueError(
                f"recipe {recipe.name!r} draws its RHT signs per layer "
                "(hadamard_signs='layer'): pass rht_key=, one key per layer that stays the "
                "same at every step (fp4jax.nn layers draw it from the 'fp4_layer' RNG stream)"
            )
        key = _pack_keys(key, qz.normalize_key(rht_key, "rht_key"))
    return key


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    *,
    recipe: Recipe | str | None = None,
    key: jax.Array | None = None,
    rht_key: jax.Array | None = None,
    implementation: str | None = None,
) -> jax.Array:
    """A drop-in for ``jax.lax.dot_general`` whose GEMMs (forward and backward) are FP4.

    Args:
      lhs, rhs: float arrays (bf16/f32/f16).
      dimension_numbers: ``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))`` as in
        ``lax.dot_general``. Several contracting dims are flattened (in the given
        order) into one blocked axis.
      precision: passed to unquantized GEMMs; quantized GEMMs are exact emulations.
      preferred_element_type: output dtype (default: ``result_type(lhs, rhs)``).
      recipe: a ``fp4jax.Recipe`` or its name; default ``recipes.nvfp4()``.
      key: ``jax.random`` key; required when the recipe uses stochastic rounding
        (use a fresh key per step and layer). Same key, same bits.
      rht_key: ``jax.random`` key the RHT signs are drawn from when a GEMM's
        ``hadamard_signs`` is ``"layer"`` (required then, ignored otherwise): one key per
        layer, the same at every step (the Flax layers draw it from the ``"fp4_layer"``
        stream).
      implementation: which backend runs the operands and GEMMs; every one computes the
        XLA reference's bits (GEMMs up to float32 accumulation order off XLA's einsum).
        ``None`` (default): automatic, the Hopper kernels on an sm_90 GPU for large
        unbatched calls of recipes with NVFP4 or MXFP4 operands, Blackwell's native FP4
        GEMMs on sm_100+, else ``"xla"``; the ``FP4JAX_KERNELS`` environment variable sets
        this choice only (``off``: always XLA, ``on``: kernels at every size, ``native``).
        ``"xla"``: the reference. ``"pallas"``: the Hopper kernel path; raises a ValueError
        where it cannot run the call (no sm_90 GPU, a batched call, a recipe with no operand
        the kernels implement: all FP6/FP8, row-scaled, MS-EDEN, 4over6 or unquantized);
        inside it the operands the kernels do not implement (those specs, or shapes they do
        not tile) and the unquantized ones (a high-precision GEMM, e.g. a precision switch)
        enter their GEMMs as on the reference, and a GEMM with an unquantized operand runs
        as on the reference. ``"native"``:
        ``jax.nn.scaled_matmul`` for the NVFP4 GEMMs (raises where this JAX does not lower
        it), the reference for the other GEMMs. See ``pallas_kernels.dispatch.dot_backend``.

    Returns:
      ``lax.dot_general``'s output shape: batch dims, lhs free dims, rhs free dims.
      Gradients flow to ``lhs`` and ``rhs`` through the recipe's dgrad and wgrad.
    """
    from fp4jax.recipes import get as get_recipe

    recipe = nvfp4() if recipe is None else get_recipe(recipe)
    lhs = qz.check_float(lhs, "lhs", "fp4jax.dot_general")
    rhs = qz.check_float(rhs, "rhs", "fp4jax.dot_general")
    try:
        (lc, rc), (lb, rb) = dimension_numbers
        lc, rc, lb, rb = (tuple(int(d) for d in ds) for ds in (lc, rc, lb, rb))
    except (TypeError, ValueError) as e:
        raise ValueError(
            "dimension_numbers must be ((lhs_contracting, rhs_contracting), "
            f"(lhs_batch, rhs_batch)), got {dimension_numbers!r}"
        ) from e
    for name, a, dims in (("lhs", lhs, lc + lb), ("rhs", rhs, rc + rb)):
        if any(not -a.ndim <= d < a.ndim for d in dims):
            raise ValueError(
                f"fp4jax.dot_general: dimension_numbers {dimension_numbers!r} name a dim out "
                f"of range for {name} of shape {a.shape}"
            )
        if len({d % a.ndim for d in dims}) != len(dims):
            raise ValueError(
                f"fp4jax.dot_general: dimension_numbers {dimension_numbers!r} repeat a dim "
                f"of {name} (each dim is contracting, batch or free, once)"
            )
    lc, lb = tuple(d % lhs.ndim for d in lc), tuple(d % lhs.ndim for d in lb)
    rc, rb = tuple(d % rhs.ndim for d in rc), tuple(d % rhs.ndim for d in rb)
    if len(lc) != len(rc) or len(lb) != len(rb):
        raise ValueError(f"dimension_numbers {dimension_numbers!r}: mismatched dim counts")
    for a, b, what in ((lc, rc, "contraction"), (lb, rb, "batch")):
        if tuple(lhs.shape[d] for d in a) != tuple(rhs.shape[d] for d in b):
            raise ValueError(
                f"fp4jax.dot_general: {what} sizes differ: lhs shape {lhs.shape} dims {a} vs "
                f"rhs shape {rhs.shape} dims {b}"
            )
    if not lc:
        raise ValueError("fp4jax.dot_general needs at least one contracting dimension")
    key = call_key(recipe, key, rht_key)

    lfree = [d for d in range(lhs.ndim) if d not in lc + lb]
    rfree = [d for d in range(rhs.ndim) if d not in rc + rb]
    bshape = [lhs.shape[d] for d in lb]
    lfshape = [lhs.shape[d] for d in lfree]
    rfshape = [rhs.shape[d] for d in rfree]
    B, M = int(np.prod(bshape)), int(np.prod(lfshape))
    K, N = int(np.prod([lhs.shape[d] for d in lc])), int(np.prod(rfshape))
    x3 = jnp.transpose(lhs, list(lb) + lfree + list(lc)).reshape(B, M, K)
    w3 = jnp.transpose(rhs, list(rb) + list(rc) + rfree).reshape(B, K, N)
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype))
    shard = _data_parallel_axis(B, M, recipe) if recipe.quantized else None
    backend = dispatch.dot_backend(implementation,
                                   mkn=M * K * N if B == 1 else 0,  # kernels need B == 1
                                   kernel_recipe=_scaled_path_applies(recipe))
    fn = _make_dot3(recipe, out_dtype, jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype),
                    _hashable_precision(precision), backend, shard)
    y3 = fn(x3, w3, key)
    return y3.reshape(*bshape, *lfshape, *rfshape)


def token_row_multiple(recipe: Recipe) -> int:
    """The multiple of token rows a device's shard needs under
    ``fp4jax.sharding.data_parallel`` so that no quantization block or RHT along the tokens
    straddles two devices (each device would zero-pad its own): the least common multiple
    of 16 (also a multiple of the 4 rows a stochastic-rounding draw spans), the wgrad RHT
    size and the block size of every quantized ``x``/``dy`` operand (its 2D tiles and
    16x1/32x1 wgrad blocks run along the tokens)."""
    sizes = [16, recipe.wgrad.hadamard or 1]
    for q in (recipe.fprop.lhs, recipe.dgrad.lhs, recipe.wgrad.lhs, recipe.wgrad.rhs):
        if q.quantized:
            sizes.append(q.fmt.block_size)
    return math.lcm(*sizes)


def _data_parallel_axis(B: int, M: int, recipe: Recipe) -> Any:
    """The active ``fp4jax.sharding.data_parallel`` axes (None outside one), checked: the
    call must be traced inside ``jax.shard_map`` over them, unbatched (``B == 1``: the
    token rows ``M`` of ``x`` are what is split) with ``M`` per device a multiple of
    ``token_row_multiple(recipe)``."""
    shard = sharding.data_axis()
    if shard is None:
        return None
    try:
        jax.lax.axis_index(shard)
    except NameError as e:
        raise ValueError(
            f"fp4jax.sharding.data_parallel({shard!r}) is active but fp4jax.dot is not traced "
            f"inside jax.shard_map over {shard!r} ({e}): call it inside the shard_map'd "
            "function, or leave the data_parallel block") from e
    if B != 1:
        raise ValueError(
            f"fp4jax.dot_general with batch dimensions (B={B}) inside "
            f"fp4jax.sharding.data_parallel({shard!r}): only unbatched calls (the token rows "
            "of x split over devices, weights replicated) are supported there")
    mult = token_row_multiple(recipe)
    if M % mult:
        raise ValueError(
            f"fp4jax.dot inside fp4jax.sharding.data_parallel({shard!r}) got {M} token rows "
            f"per device: recipe {recipe.name!r} needs a multiple of {mult} (its blocks and "
            "RHT along the tokens must not straddle devices), e.g. a larger per-device batch")
    return shard


def _hashable_precision(precision: Any) -> Any:
    if isinstance(precision, list):
        return tuple(precision)
    return precision


def dot(
    x: jax.Array,
    w: jax.Array,
    *,
    recipe: Recipe | str | None = None,
    key: jax.Array | None = None,
    preferred_element_type: Any = None,
    rht_key: jax.Array | None = None,
    implementation: str | None = None,
) -> jax.Array:
    """FP4 matrix product ``x @ w`` with the recipe's forward and backward quantization.

    Args:
      x: activations, shape ``(..., K)``, float dtype. All leading dims are tokens
        (the per-tensor scale and the Wgrad RHT span them all).
      w: weight, shape ``(K, N)``, float dtype.
      recipe: ``fp4jax.Recipe`` or name (default ``recipes.nvfp4()``).
      key: ``jax.random`` key, required for recipes with stochastic rounding.
      preferred_element_type: output dtype (default ``result_type(x, w)``).
      rht_key: the layer's constant key for ``hadamard_signs="layer"`` (see
        ``dot_general``).
      implementation: ``None`` (automatic), ``"xla"``, ``"pallas"`` or ``"native"``: the
        backend (see ``dot_general``); the same bits on each.

    Returns:
      ``(..., N)`` array.

    Example:
      >>> y = fp4jax.dot(x, w, recipe=fp4jax.recipes.nvfp4(), key=jax.random.key(0))
    """
    x = qz.check_float(x, "x", "fp4jax.dot")
    w = qz.check_float(w, "w", "fp4jax.dot")
    if w.ndim != 2:
        raise ValueError(f"fp4jax.dot: w must be 2-D (K, N), got shape {w.shape}")
    if x.ndim < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(
            f"fp4jax.dot: contraction sizes differ: x shape {x.shape} (last dim) vs "
            f"w shape {w.shape} (first dim)"
        )
    return dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())),
                       preferred_element_type=preferred_element_type, recipe=recipe, key=key,
                       rht_key=rht_key, implementation=implementation)
