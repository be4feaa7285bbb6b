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

from fp4jax import quantization as qz
from fp4jax import sharding
from fp4jax.formats import NVFP4
from fp4jax.hadamard import random_hadamard_transform, resolve_signs
from fp4jax.recipes import GemmSpec, QuantSpec, Recipe, nvfp4
from pallas_kernels import dispatch

__all__ = ["dot", "dot_general"]

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
           use_kernels: bool = False, shard: Any = None, group: int = 0) -> Operand:
    """Quantize one operand per its spec (or pass it through when unquantized).

    With ``use_kernels`` the dispatcher's packed NVFP4 quantize kernels take the cases
    they cover (round-to-nearest bf16; 1x16 blocks along the last axis, or 16x16 tiles;
    the ``"max"`` block scale rule, one tensor scale); everything else runs the XLA
    reference. ``shard``: ``x`` is a row block of a data-parallel tensor
    (``fp4jax.sharding``). ``group``: MS-EDEN's group, the GEMM's RHT size.
    """
    if not spec.quantized:
        return x
    if (spec.fmt == NVFP4 and spec.rounding == "nearest" and use_kernels and shard is None
            and (spec.block_2d or axis % x.ndim == x.ndim - 1)):
        if dispatch.is_supported("quantize", x.shape, x.dtype, fmt=spec.fmt, axis=-1,
                                 block_2d=spec.block_2d,
                                 block_scale_rule=spec.block_scale_rule,
                                 row_scaled=spec.row_scaled):
            return dispatch.quantize(x, spec.fmt, axis=-1, block_2d=spec.block_2d,
                                     backend="pallas")
    return qz._quantize_impl(x, key if spec.random else None, spec.fmt, axis % x.ndim,
                             spec.block_2d, spec.rounding, spec.block_scale_rule, shard,
                             row_scaled=spec.row_scaled,
                             eden_group=group if spec.rounding == "ms_eden" else 0)


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


def _gemm(subscripts: str, a: Operand, b: Operand, precision: Any) -> jax.Array:
    """``einsum(subscripts)`` of two operands, f32 accumulation, global scales last."""
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
# The kernel path: every operand as its bf16 ``data * scale`` (Pallas kernels on sm_90).
# ---------------------------------------------------------------------------


def _scaled_path_applies(recipe: Recipe) -> bool:
    """The kernel path covers recipes whose six operands are all NVFP4 with one tensor
    scale each and no MS-EDEN rounding (row-scaled and MS-EDEN operands make the whole
    call take the XLA path: its GEMMs need their per-row scales, ``_einsum_scaled``)."""
    return all(q.quantized and q.fmt == NVFP4 and not q.row_scaled and q.rounding != "ms_eden"
               for g in (recipe.fprop, recipe.dgrad, recipe.wgrad) for q in (g.lhs, g.rhs))


def _kernel_for(x: jax.Array, g: GemmSpec, spec: QuantSpec, axis: int, key: jax.Array):
    """The dispatcher's fused kernel for this operand (``"rows"``, ``"cols"``, ``"2d"``) or
    None (the XLA path). ``x`` is canonical (B, R, C); ``axis`` 1 or 2 is the blocked axis."""
    return dispatch.operand_kernel(x, block_2d=spec.block_2d, axis=axis,
                                   stochastic=spec.stochastic, rht=g.hadamard,
                                   key=_step_key(key),
                                   block_scale_rule=spec.block_scale_rule, fmt=spec.fmt,
                                   row_scaled=spec.row_scaled, rounding=spec.rounding)


@_scoped("fp4_operands")
def _scaled_operands(x: jax.Array, ops: tuple, key: jax.Array, kmode: str, shard: Any = None
                     ) -> list[tuple[jax.Array, jax.Array]]:
    """Operands made from one tensor ``x``, each ``(scaled_data(Q(x)) in bf16, tensor
    decode scale)``; ``ops``: ``(gemm_spec, quant_spec, axis, gemm, which)`` per operand.
    Each comes from a fused kernel when one covers it, else from the XLA path (the same
    bits either way). A rows operand and an RHT'd cols operand of the same tensor take
    both tensor amaxes from one read (``cols_amaxes``). ``shard``: as ``_quant``'s."""
    def xla(x, key, op):
        g, spec, axis, gemm, which = op
        q = _quant(_rht(x, g, axis, key, gemm), spec, axis, _subkey(key, gemm, which),
                   shard=shard, group=g.hadamard)
        return qz.scaled_data(q, jnp.bfloat16), q.global_scale

    kinds = [_kernel_for(x, op[0], op[1], op[2], key) for op in ops]
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
                                        key, kmode, shard))

    @f.def_vmap
    def _(axis_size, in_batched, x, key):
        del axis_size
        res = jax.vmap(xla_all, in_axes=[0 if b else None for b in in_batched])(x, key)
        return res, [(True, True)] * len(todo)

    for i, r in zip(todo, f(x, key), strict=True):
        out[i] = tuple(r)
    return out


def _kernel_operands(x, ops, kinds, key, kmode, shard=None):
    sr_keys = [_subkey(key, gemm, which) if spec.stochastic else None
               for (_, spec, _, gemm, which) in ops]
    signs = [_rht_signs(op[0], key, op[3]) if kind == "cols" and op[0].hadamard else None
             for op, kind in zip(ops, kinds, strict=True)]
    return dispatch.make_operands(x, kinds, sr_keys, signs, kmode, shard=shard)


_GEMM_LAYOUTS = {"bmk,bkn->bmn": (False, False),  # fprop: x @ w
                 "bmn,bkn->bmk": (False, True),  # dgrad: dy @ w^T (w stored (K, N))
                 "bmk,bmn->bkn": (True, False)}  # wgrad: x^T @ dy (x stored (M, K))


def _gemm_kernel_path(subscripts: str, av: jax.Array, bv: jax.Array, sa: Any, sb: Any,
                      out_dtype: Any, kmode: str, gemm: str) -> jax.Array:
    """One GEMM of the kernel path: ``(sa * sb * einsum(av, bv)).astype(out_dtype)``, on
    the dispatcher's scaled GEMM kernel where it takes it (``dispatch.scaled_gemm``:
    unbatched bf16 operands, both tensor scales), else ``_einsum_scaled`` (XLA, the XLA
    path's bits)."""
    trans_a, trans_b = _GEMM_LAYOUTS[subscripts]
    if av.shape[0] == 1 and sa is not None and sb is not None:
        y = dispatch.scaled_gemm(av[0], bv[0], sa * sb, trans_a=trans_a, trans_b=trans_b,
                                 out_dtype=out_dtype, mode=kmode, gemm=gemm)
        if y is not None:
            return y[None]
    return _einsum_scaled(subscripts, av, bv, sa, sb,
                          jax.lax.Precision.HIGHEST).astype(out_dtype)


def _make_dot3_scaled(recipe: Recipe, out_dtype: Any, lhs_dtype: Any, rhs_dtype: Any,
                      kmode: str, gemm: str = "xla", shard: Any = None):
    """The custom_vjp of ``_make_dot3`` for the kernel path: same GEMMs, same bits; the
    residuals are the bf16 ``data * scale`` operands (as many bytes as the bf16 baseline's
    ``x`` and ``w``; the XLA path keeps FP4 residuals instead)."""
    fp, dg, wg = recipe.fprop, recipe.dgrad, recipe.wgrad
    reuse_w = dg.rhs == fp.rhs and fp.rhs.block_2d and not (fp.hadamard or dg.hadamard)

    x_fprop = (fp, fp.lhs, 2, "fprop", "lhs")
    w_fprop = (fp, fp.rhs, 1, "fprop", "rhs")

    def forward(x, w, key, with_x_res=False):
        xops = (x_fprop, (wg, wg.lhs, 1, "wgrad", "lhs")) if with_x_res else (x_fprop,)
        xo = _scaled_operands(x, xops, key, kmode, shard)
        (xs, sx), = xo[:1]
        (ws, sw), = _scaled_operands(w, (w_fprop,), key, kmode)
        y = _gemm_kernel_path("bmk,bkn->bmn", xs, ws, sx, sw, out_dtype, kmode, gemm)
        return y, (ws, sw), xo[1:]

    @jax.custom_vjp
    def dot3(x, w, key):
        return forward(x, w, key)[0]

    def fwd(x, w, key):
        y, w_res, (x_res,) = forward(x, w, key, with_x_res=True)
        if not reuse_w:
            w_res, = _scaled_operands(w, ((dg, dg.rhs, 2, "dgrad", "rhs"),), key, kmode)
        return y, (w_res, x_res, key)

    def bwd(res, g):
        (ws, sw), (xs, sx), key = res
        g = g.astype(jnp.float32) if g.dtype != jnp.bfloat16 else g
        (gs, sg), (gt, sgt) = _scaled_operands(
            g, ((dg, dg.lhs, 2, "dgrad", "lhs"), (wg, wg.rhs, 1, "wgrad", "rhs")), key, kmode,
            shard)
        dx = _gemm_kernel_path("bmn,bkn->bmk", gs, ws, sg, sw, lhs_dtype, kmode, gemm)
        dw = _gemm_kernel_path("bmk,bmn->bkn", xs, gt, sx, sgt, rhs_dtype, kmode, gemm)
        return dx, dw, None

    dot3.defvjp(fwd, bwd)
    return jax.jit(dot3)


@functools.cache
def _make_dot3(recipe: Recipe, out_dtype: Any, lhs_dtype: Any, rhs_dtype: Any, precision: Any,
               kmode: str = "off", forced: bool = False, gemm: str = "xla", shard: Any = None,
               native: str = "off"):
    """The custom_vjp for canonical ``(B, M, K) @ (B, K, N)``, specialized on static args
    (``forced``: ``FP4JAX_KERNELS`` forces the kernels; ``gemm``: ``FP4JAX_KERNEL_GEMM``;
    ``shard``: the ``fp4jax.sharding.data_parallel`` axes, x and dy being row shards;
    ``native``: ``dispatch.native_mode()``, the Blackwell GEMM backend for the quantized
    operands of this XLA path; all part of the cache key)."""
    if kmode != "off" and _scaled_path_applies(recipe):
        return _make_dot3_scaled(recipe, out_dtype, lhs_dtype, rhs_dtype, kmode, gemm, shard)
    # the older packed-quantize kernels of _quant: only when explicitly forced
    use_kernels = kmode == "on" and forced
    fp, dg, wg = recipe.fprop, recipe.dgrad, recipe.wgrad
    reuse_w = dg.rhs == fp.rhs and (not fp.rhs.quantized or fp.rhs.block_2d) and not (
        fp.hadamard or dg.hadamard
    )

    def forward(x, w, key):
        xq = _quant(_rht(x, fp, 2, key, "fprop"), fp.lhs, 2, _subkey(key, "fprop", "lhs"),
                    use_kernels, shard, fp.hadamard)
        wq = _quant(_rht(w, fp, 1, key, "fprop"), fp.rhs, 1, _subkey(key, "fprop", "rhs"),
                    use_kernels, group=fp.hadamard)
        return _gemm_out("bmk,bkn->bmn", xq, wq, precision, out_dtype, native), wq

    @jax.custom_vjp
    def dot3(x, w, key):
        return forward(x, w, key)[0]

    def fwd(x, w, key):
        y, wq = forward(x, w, key)
        if reuse_w:
            wq_d = wq
        else:
            wq_d = _quant(_rht(w, dg, 2, key, "dgrad"), dg.rhs, 2, _subkey(key, "dgrad", "rhs"),
                          use_kernels, group=dg.hadamard)
        xq_w = _quant(_rht(x, wg, 1, key, "wgrad"), wg.lhs, 1, _subkey(key, "wgrad", "lhs"),
                      use_kernels, shard, wg.hadamard)
        return y, (wq_d, xq_w, key)

    def bwd(res, g):
        wq_d, xq_w, key = res
        g = g.astype(jnp.float32) if g.dtype != jnp.bfloat16 else g
        gq_d = _quant(_rht(g, dg, 2, key, "dgrad"), dg.lhs, 2, _subkey(key, "dgrad", "lhs"),
                      use_kernels, shard, dg.hadamard)
        dx = _gemm_out("bmn,bkn->bmk", gq_d, wq_d, precision, lhs_dtype, native)
        gq_w = _quant(_rht(g, wg, 1, key, "wgrad"), wg.rhs, 1, _subkey(key, "wgrad", "rhs"),
                      use_kernels, shard, wg.hadamard)
        dw = _gemm_out("bmk,bmn->bkn", xq_w, gq_w, precision, rhs_dtype, native)
        return dx, dw, None

    dot3.defvjp(fwd, bwd)
    return jax.jit(dot3)


def _call_key(recipe: Recipe, key: Any, rht_key: Any) -> jax.Array:
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

    Returns:
      ``lax.dot_general``'s output shape: batch dims, lhs free dims, rhs free dims.
      Gradients flow to ``lhs`` and ``rhs`` through the recipe's dgrad and wgrad.
    """
    from fp4jax.recipes import get as get_recipe

    recipe = nvfp4() if recipe is None else get_recipe(recipe)
    lhs = qz._check_float(lhs, "lhs", "fp4jax.dot_general")
    rhs = qz._check_float(rhs, "rhs", "fp4jax.dot_general")
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
    key = _call_key(recipe, key, rht_key)

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
    fn = _make_dot3(recipe, out_dtype, jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype),
                    _hashable_precision(precision),
                    dispatch.kernel_mode(M * K * N if B == 1 else 0),  # kernels need B == 1
                    dispatch.kernels_forced(), dispatch.gemm_backend(), shard,
                    dispatch.native_mode())
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

    Returns:
      ``(..., N)`` array.

    Example:
      >>> y = fp4jax.dot(x, w, recipe=fp4jax.recipes.nvfp4(), key=jax.random.key(0))
    """
    x = qz._check_float(x, "x", "fp4jax.dot")
    w = qz._check_float(w, "w", "fp4jax.dot")
    if w.ndim != 2:
        raise ValueError(f"fp4jax.dot: w must be 2-D (K, N), got shape {w.shape}")
    if x.ndim < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(
            f"fp4jax.dot: contraction sizes differ: x shape {x.shape} (last dim) vs "
            f"w shape {w.shape} (first dim)"
        )
    return dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())),
                       preferred_element_type=preferred_element_type, recipe=recipe, key=key,
                       rht_key=rht_key)
