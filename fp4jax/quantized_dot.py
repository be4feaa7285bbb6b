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
from fp4jax.backends import (
    SUBSCRIPTS,
    WHOLE,
    XLA,
    Backend,
    DotCall,
    Operand,
    OperandRequest,
    RowShard,
    gemm_dtype,
    reference_quantize,
    rotate,
    run_gemm,
    run_operands,
    select,
)
from fp4jax.hadamard import resolve_signs
from fp4jax.recipes import GemmSpec, Recipe, nvfp4

__all__ = ["OPERAND_AXES", "call_key", "dot", "dot_general", "gemm_dtypes", "gemm_inputs",
           "gemm_rht_signs", "operand_key", "operand_request", "reference_gemms",
           "reference_operand", "token_row_multiple"]

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


def _as_operand(op: Any) -> Operand:
    """A ``QuantizedArray`` or an unquantized array as an ``Operand``."""
    if isinstance(op, Operand):
        return op
    if isinstance(op, qz.QuantizedArray):
        return Operand.from_codes(op)
    return Operand.from_tensor(op)


def gemm_inputs(a: Any, b: Any, precision: Any
                ) -> tuple[jax.Array, jax.Array, Any, Any, Any]:
    """How the reference feeds a GEMM its two operands (each an ``Operand``, a
    ``QuantizedArray`` or an unquantized array): ``(a_value, b_value, a_scale, b_scale,
    precision)``. The values are ``data * scale`` (no tensor scale) of a quantized operand
    or the array itself, both in ``backends.gemm_dtype`` (bfloat16 when both are exact in
    it, else float32); the scales are the tensor decode scales (None when unquantized);
    the precision is ``Precision.HIGHEST`` when an operand is quantized, else
    ``precision``. Also the per-expert GEMMs of ``fp4jax.ragged_dot``."""
    oa, ob = _as_operand(a), _as_operand(b)
    compute = gemm_dtype(oa, ob)
    if oa.quantized or ob.quantized:
        precision = jax.lax.Precision.HIGHEST
    return oa.scaled(compute), ob.scaled(compute), oa.decode_scale, ob.decode_scale, precision


def gemm_dtypes(recipe: Recipe, x_dtype: Any, w_dtype: Any, g_dtype: Any) -> dict[str, Any]:
    """Per GEMM (``"fprop"``, ``"dgrad"``, ``"wgrad"``), the dtype it computes in
    (``backends.gemm_dtype``), known from the recipe before any operand is made: bfloat16
    when both operands are exact in it (a quantized one when its format's ``scaled_bits``
    <= 8, an unquantized one when it enters as bfloat16, i.e. its tensor is bfloat16 and
    the GEMM has no RHT: the RHT returns float32), else float32. ``x_dtype``, ``w_dtype``,
    ``g_dtype``: the dtypes of x, w and the cotangent dy as ``_make_dot3`` quantizes
    them."""
    tensors = {"fprop": (x_dtype, w_dtype), "dgrad": (g_dtype, w_dtype),
               "wgrad": (x_dtype, g_dtype)}
    out = {}
    for name, g in recipe.gemms.items():
        exact = [q.fmt.scaled_bits <= 8 if q.quantized
                 else jnp.dtype(t) == jnp.bfloat16 and not g.hadamard
                 for q, t in zip((g.lhs, g.rhs), tensors[name], strict=True)]
        out[name] = jnp.dtype(jnp.bfloat16 if all(exact) else jnp.float32)
    return out


OPERAND_AXES = {("fprop", "lhs"): 2, ("fprop", "rhs"): 1, ("dgrad", "lhs"): 2,
                ("dgrad", "rhs"): 2, ("wgrad", "lhs"): 1, ("wgrad", "rhs"): 1}
"""The blocked (quantized) axis of each canonical operand ``(gemm, which)``: x (1, M, K) and
dy (1, M, N) along their last axis for fprop/dgrad and along the tokens for wgrad; w (1, K,
N) along K for fprop, along N for dgrad (module docstring)."""

# the six operands of one call by the tensor they are made from
_OPERANDS = {"x_fprop": ("fprop", "lhs"), "w_fprop": ("fprop", "rhs"),
             "g_dgrad": ("dgrad", "lhs"), "w_dgrad": ("dgrad", "rhs"),
             "x_wgrad": ("wgrad", "lhs"), "g_wgrad": ("wgrad", "rhs")}


def operand_request(recipe: Recipe, gemm: str, which: str, key: jax.Array,
                    dtype: Any = jnp.float32) -> OperandRequest:
    """The ``backends.OperandRequest`` of operand ``which`` of ``gemm`` in a call of
    ``recipe`` with ``key`` (``call_key``'s): its spec, blocked axis (``OPERAND_AXES``),
    the GEMM's RHT size and sign vector, its stochastic-rounding key (``operand_key``) and
    ``dtype``, its GEMM's compute dtype (``gemm_dtypes``)."""
    g = getattr(recipe, gemm)
    return OperandRequest(gemm=gemm, which=which, spec=getattr(g, which),
                          axis=OPERAND_AXES[(gemm, which)], hadamard=g.hadamard,
                          signs=_rht_signs(g, key, gemm) if g.hadamard else None,
                          key=_subkey(key, gemm, which), dtype=jnp.dtype(dtype))


def reference_operand(t: jax.Array, recipe: Recipe, gemm: str, which: str, key: jax.Array
                      ) -> tuple[jax.Array, Any]:
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
    req = operand_request(recipe, gemm, which, key)
    r = rotate(t, req.hadamard, req.axis, req.signs)
    op = reference_quantize(r, req)
    return r, (op.codes if op.quantized else op.values)


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
        out = XLA.gemm(SUBSCRIPTS[gemm], _as_operand(lhs[1]), _as_operand(rhs[1]),
                       out_dtype=dtypes[gemm])
        res[gemm] = (out, lhs, rhs)
    return res


@functools.cache
def _make_dot3(recipe: Recipe, out_dtype: Any, lhs_dtype: Any, rhs_dtype: Any, precision: Any,
               chain: tuple[Backend, ...], shard: Any = None):
    """The one custom_vjp of canonical ``(B, M, K) @ (B, K, N)`` (the module docstring's
    three GEMMs), specialized on static args (all part of the cache key): ``chain``
    (``backends.select``: who makes each operand and runs each GEMM, the same bits on
    each); ``shard``: the ``fp4jax.sharding.data_parallel`` axes, x and dy being row
    shards.

    Residuals: the dgrad-ready weight (the fprop one itself when the two specs are equal
    and 2D-scaled, or both unquantized, with no RHT) and the wgrad-ready activation, as the
    backend made them (``backends.Operand``: codes on the reference, ``data * scale`` from
    fused kernels; an unquantized operand is the tensor itself)."""
    fp, dg = recipe.fprop, recipe.dgrad
    g_dtype = jnp.dtype(jnp.bfloat16 if jnp.dtype(out_dtype) == jnp.bfloat16 else jnp.float32)
    dtypes = gemm_dtypes(recipe, lhs_dtype, rhs_dtype, g_dtype)
    reuse_w = dg.rhs == fp.rhs and (not fp.rhs.quantized or fp.rhs.block_2d) and not (
        fp.hadamard or dg.hadamard)
    rows = RowShard(shard, recipe.amax_scope == "local")

    def operands(t, names, key, where=WHOLE):
        reqs = [operand_request(recipe, *_OPERANDS[n], key, dtypes[_OPERANDS[n][0]])
                for n in names]
        return run_operands(chain, t, reqs, where)

    def gemm(name, a, b, dtype):
        return run_gemm(chain, SUBSCRIPTS[name], a, b, dtype, precision)

    def forward(x, w, key, with_res=False):
        xo = operands(x, ("x_fprop", "x_wgrad") if with_res else ("x_fprop",), key, rows)
        wq, = operands(w, ("w_fprop",), key)
        return gemm("fprop", xo[0], wq, out_dtype), wq, xo[1:]

    @jax.custom_vjp
    def dot3(x, w, key):
        return forward(x, w, key)[0]

    def fwd(x, w, key):
        y, wq, (xq_w,) = forward(x, w, key, with_res=True)
        wq_d = wq if reuse_w else operands(w, ("w_dgrad",), key)[0]
        return y, (wq_d, xq_w, key)

    def bwd(res, g):
        wq_d, xq_w, key = res
        g = g.astype(jnp.float32) if g.dtype != jnp.bfloat16 else g
        gq_d, gq_w = operands(g, ("g_dgrad", "g_wgrad"), key, rows)
        dx = gemm("dgrad", gq_d, wq_d, lhs_dtype)
        dw = gemm("wgrad", xq_w, gq_w, rhs_dtype)
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
      implementation: which backend makes the operands and runs the GEMMs
        (``fp4jax.backends.select``); every one computes the XLA reference's bits (GEMMs up
        to float32 accumulation order off XLA's einsum), and each operand or GEMM a backend
        does not take runs on the reference. ``None`` (default): automatic, the first
        registered backend that takes the call (the Hopper kernels of ``pallas_kernels`` on
        an sm_90 GPU for large unbatched calls of recipes with NVFP4 or MXFP4 operands,
        Blackwell's native FP4 GEMMs on sm_100+), else ``"xla"``; the ``FP4JAX_KERNELS``
        environment variable sets this choice only (``off``: always XLA, ``on``: kernels at
        every size, ``native``). ``"xla"``: the reference. ``"pallas"``: the Hopper kernels;
        raises a ValueError where they cannot run the call (no sm_90 GPU, a batched call, a
        recipe with no operand the kernels implement: all FP6/FP8, row-scaled, MS-EDEN,
        4over6 or unquantized). ``"native"``: ``jax.nn.scaled_matmul`` for the NVFP4 GEMMs
        (raises where this JAX does not lower it).

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
    chain = select(implementation, DotCall(recipe, B, M, K, N, sharding.xla_partitions()))
    fn = _make_dot3(recipe, out_dtype, jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype),
                    _hashable_precision(precision), chain, shard)
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
