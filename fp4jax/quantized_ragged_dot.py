"""``fp4jax.ragged_dot``: a recipe's three GEMMs on grouped (mixture-of-experts) GEMMs.

``jax.lax.ragged_dot`` semantics: ``lhs (M, K)`` holds the tokens routed to expert 0, then
those of expert 1, ... (``group_sizes (G,)`` of them each), ``rhs (G, K, N)`` one weight per
expert; output row ``r`` of expert ``g`` is ``lhs[r] @ rhs[g]``, rows past
``sum(group_sizes)`` are zero.

**The rule (one sentence): every expert is its own** ``fp4jax.dot``. Expert ``g``'s rows
``lhs_g = lhs[o_g : o_g + m_g]`` (``o_g = m_0 + ... + m_{g-1}``) and weight ``rhs[g]`` run
the recipe exactly as ``fp4jax.dot(lhs_g, rhs[g], recipe=recipe, key=fold_in(key, g),
rht_key=fold_in(rht_key, g))`` would, forward and backward, bit for bit: output rows,
``dx`` rows and ``dw[g]``. So

* **per-expert tensor scales**: each expert's activation rows, gradient rows and weight
  get their own tensor amax, hence their own FP32 tensor scale (NVFP4), as Transformer
  Engine's grouped NVFP4 does: its grouped quantize ``tex.split_quantize(x,
  split_sections, quantizers)`` takes one ``NVFP4Quantizer`` per split (per expert) and
  gives each split its own amax, checked bit for bit against quantizing each split alone
  (TE ``tests/pytorch/nvfp4/test_nvfp4_group_quantize.py``, commit ``01e50c5e``: per-split
  ``_amax_rowwise``/``_amax_columnwise``, RHT and post-RHT amax included; TE's test
  splits are multiples of 64 rows, fp4jax takes any size). One expert's outlier does not
  coarsen another's scales;
* **per-expert random bits**: stochastic rounding and ``"random"``/``"layer"`` RHT signs
  of expert ``g`` come from ``fold_in(key, g)`` (``fold_in(rht_key, g)``), drawn at the
  expert's own row positions (``numerics.uniform_rows``), as if its rows were a tensor of
  their own;
* **blocks never straddle experts**: the 1x16 (1x32) blocks of the forward and dgrad
  operands run along K (N): rows are independent, any group size works. The Wgrad
  operands are blocked (16x1) and rotated (16-point RHT) along the tokens: each expert's
  rows are laid out from a multiple of ``A = lcm(RHT size, block sizes)`` (zero rows
  between experts), which is how ``fp4jax.dot`` zero-pads one expert's ``m_g`` rows to
  a multiple of the RHT and block size. Sizes that do not divide 16 (odd sizes, empty
  experts, ``sum(group_sizes) < M``) are therefore exact, not an approximation.

GEMMs run as ``fp4jax.dot``'s XLA reference runs them (``data * scale`` of each operand
in bfloat16 when exact there, float32 accumulation, the two tensor decode scales
multiplied in afterwards, now one pair per expert) through ``jax.lax.ragged_dot_general``:
fprop and dgrad with the expert weights grouped, wgrad as a ragged contraction over the
tokens (output ``(G, K, N)``). The values entering each GEMM are the per-expert call's bit
for bit; the float32 accumulation order is the backend's (on the CPU, JAX 0.10.2, the
results equal the per-expert ``fp4jax.dot``'s bit for bit in ``tests/dot/test_ragged.py``).
The Pallas kernels do not cover grouped GEMMs: this always runs on XLA.

**Data parallel.** Inside ``fp4jax.sharding.data_parallel(axis)`` (``jax.shard_map`` over
the batch, weights replicated) each device's call is its own grouped GEMM: every device
quantizes its own rows of each expert with their own amax (Transformer Engine's
data-parallel semantics, ``Recipe.amax_scope="local"``, whatever the recipe's scope: an
expert's rows on one device are not a block of rows of one global tensor, so the
single-device bits are not reachable without moving tokens), with the key folded with the
device's index first (``fold_in(fold_in(key, device), g)`` for expert ``g``); each
device returns its experts' partial ``dw``, which the caller's ``pmean``/``psum`` adds.
Bits depend on the device count.

Supported recipes: every operand spec with the ``"max"`` block scale rule and
round-to-nearest or stochastic rounding, 1D or (weights) 2D blocks, with or without RHTs
(``nvfp4``, ``mxfp4``, ``fp4_all_the_way``, ``bf16``, ``nvfp4_fwd_only``, ``mxfp8``,
...); 4over6, MS-EDEN and row-scaled operands raise a ``ValueError``.
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
from fp4jax.hadamard import random_hadamard_transform
from fp4jax.numerics import reciprocal_rn, uniform_rows
from fp4jax.quantized_dot import (
    call_key,
    gemm_inputs,
    gemm_rht_signs,
    operand_key,
    reference_operand,
)
from fp4jax.recipes import QuantSpec, Recipe, nvfp4

__all__ = ["expert_keys", "ragged_dot", "ragged_row_multiple"]

_RAGGED_DN = jax.lax.RaggedDotDimensionNumbers


def ragged_row_multiple(recipe: Recipe) -> int:
    """``A``: where each expert's rows start in the Wgrad operands' layout (a multiple of
    ``A``): the least common multiple of the Wgrad RHT size and the block sizes of the
    quantized Wgrad operands (1 when neither applies), so that no RHT tile or 16x1 block
    along the tokens holds rows of two experts."""
    w = recipe.wgrad
    sizes = [w.hadamard or 1] + [q.fmt.block_size for q in (w.lhs, w.rhs) if q.quantized]
    return math.lcm(*sizes)


def expert_keys(key: jax.Array, n_experts: int) -> jax.Array:
    """The call keys of the ``n_experts`` experts from a call's key (``call_key``'s: one key,
    or a ``(2,)`` pair of the step key and the layer's RHT key): ``jax.random.fold_in(k,
    g)`` of each, so expert ``g`` runs as ``fp4jax.dot(..., key=fold_in(key, g),
    rht_key=fold_in(rht_key, g))``. Returns keys of shape ``(G,)`` (or ``(G, 2)``)."""
    ids = jnp.arange(n_experts, dtype=jnp.uint32)
    if key.ndim:
        return jax.vmap(lambda i: jax.vmap(lambda k: jax.random.fold_in(k, i))(key))(ids)
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(ids)


def _check_spec(q: QuantSpec, where: str) -> None:
    if not q.quantized:
        return
    if q.block_scale_rule != "max" or q.row_scaled or q.rounding not in ("nearest",
                                                                          "stochastic"):
        raise ValueError(
            f"fp4jax.ragged_dot: {where} uses block_scale_rule={q.block_scale_rule!r}, "
            f"rounding={q.rounding!r}, row_scaled={q.row_scaled}: grouped GEMMs support the "
            "'max' rule with round-to-nearest or stochastic rounding only (use e.g. "
            "recipes.nvfp4(), mxfp4(), fp4_all_the_way() or bf16())")


def _device_key(key: jax.Array, shard: Any) -> jax.Array:
    """Inside ``fp4jax.sharding.data_parallel(shard)``: the call's key folded with the
    device's index along ``shard`` (both keys of a packed pair), so that each device's rows
    run as their own call (``ragged_dot``'s data-parallel rule)."""
    try:
        idx = jax.lax.axis_index(shard)
    except NameError as e:
        raise ValueError(
            f"fp4jax.sharding.data_parallel({shard!r}) is active but fp4jax.ragged_dot is "
            f"not traced inside jax.shard_map over {shard!r} ({e}): call it inside the "
            "shard_map'd function, or leave the data_parallel block") from e
    if key.ndim:
        return jax.vmap(lambda k: jax.random.fold_in(k, idx))(key)
    return jax.random.fold_in(key, idx)


def _threefry(key: jax.Array) -> bool:
    return "threefry" in str(jax.random.key_impl(key)).lower()


# ---------------------------------------------------------------------------
# group layout
# ---------------------------------------------------------------------------


def _group_of(r: jax.Array, ends: jax.Array) -> jax.Array:
    """The group of each row index ``r``: the number of group ends at or before it (G for
    rows past the last group), by comparison with every end (G is small)."""
    return jnp.sum(r[:, None] >= ends[None, :], axis=1, dtype=jnp.int32)


def _layout(group_sizes: jax.Array, M: int, G: int) -> dict[str, jax.Array]:
    """Row metadata: clipped sizes (their sum <= M, as ``ragged_dot`` reads them), each
    row's expert ``gid`` (clamped to G-1), whether it belongs to one (``valid``) and its
    index inside its expert (``local``)."""
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), M)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    sizes = ends - starts
    r = jnp.arange(M, dtype=jnp.int32)
    gid = _group_of(r, ends)
    valid = gid < G
    gid = jnp.minimum(gid, G - 1)
    return {"sizes": sizes, "starts": starts, "gid": gid, "valid": valid,
            "local": r - starts[gid]}


def _padded_layout(lay: dict[str, jax.Array], M: int, G: int, A: int) -> dict[str, Any]:
    """The Wgrad layout: expert ``g``'s rows at ``P_g = sum_{h<g} ceil(m_h / A) * A``, zero
    rows up to the next multiple of ``A``, in a static ``Mp = ceil((M + G (A-1)) / A) * A``
    rows. ``src``: each padded row's source row (valid where ``take``)."""
    psizes = -(-lay["sizes"] // A) * A
    pends = jnp.cumsum(psizes)
    pstarts = pends - psizes
    Mp = -(-(M + G * (A - 1)) // A) * A
    p = jnp.arange(Mp, dtype=jnp.int32)
    pg = _group_of(p, pends)
    pvalid = pg < G
    pg = jnp.minimum(pg, G - 1)
    local = p - pstarts[pg]
    take = pvalid & (local < lay["sizes"][pg])
    src = jnp.clip(lay["starts"][pg] + local, 0, max(M - 1, 0))
    return {"Mp": Mp, "psizes": psizes, "gid": pg, "valid": pvalid, "local": local,
            "take": take, "src": src}


def _to_padded(t: jax.Array, pl: dict[str, Any]) -> jax.Array:
    """Rows of ``t (M, C)`` into the Wgrad layout ``(Mp, C)`` (zeros between experts)."""
    if t.shape[0] == 0:
        return jnp.zeros((pl["Mp"], t.shape[1]), t.dtype)
    return jnp.where(pl["take"][:, None], t[pl["src"]], jnp.zeros((), t.dtype))


# ---------------------------------------------------------------------------
# operands
# ---------------------------------------------------------------------------


def _segment_amax(row_amax: jax.Array, gid: jax.Array, valid: jax.Array, G: int
                  ) -> jax.Array:
    """Each expert's tensor amax (float32 ``(G,)``) from its rows' amaxes: the max over the
    expert's rows, 0 for an empty expert (``quantization.finite_amax``'s ``initial=0``)."""
    a = jnp.where(valid, row_amax, 0.0)
    return jnp.maximum(jax.ops.segment_max(a, gid, num_segments=G), 0.0)


def _row_rht(t: jax.Array, signs_rows: jax.Array, size: int) -> jax.Array:
    """``fp4jax.dot``'s RHT along the last axis (zero-padded to ``size``), each row rotated
    with its own expert's signs (``signs_rows (R, size)``): ``random_hadamard_transform`` per
    row, the same float32 operations."""
    pad = (-t.shape[1]) % size
    if pad:
        t = jnp.pad(t, ((0, 0), (0, pad)))
    return jax.vmap(lambda row, s: random_hadamard_transform(row, axis=0, size=size,
                                                             signs=s))(t, signs_rows)


def _tile_rht(t: jax.Array, signs_tiles: jax.Array, size: int) -> jax.Array:
    """The RHT along the rows of ``t (Mp, C)`` (``Mp`` a multiple of ``size``), tile ``j``
    (rows ``j*size .. (j+1)*size - 1``, one expert's) rotated with ``signs_tiles[j]``."""
    tiles = t.reshape(t.shape[0] // size, size, t.shape[1])
    out = jax.vmap(lambda tile, s: random_hadamard_transform(tile, axis=0, size=size,
                                                             signs=s))(tiles, signs_tiles)
    return out.reshape(t.shape)


class _Ragged:
    """One call's static data: recipe, shapes, and how its operands are made."""

    def __init__(self, recipe: Recipe, G: int, M: int):
        self.recipe, self.G, self.M = recipe, G, M

    def signs(self, keys: jax.Array, gemm: str) -> jax.Array:
        """``(G, h)``: each expert's RHT signs of ``gemm``."""
        return jax.vmap(lambda k: gemm_rht_signs(self.recipe, gemm, k))(keys)

    def decs(self, amax: jax.Array, spec: QuantSpec) -> jax.Array:
        """``(G,)``: each expert's tensor decode scale (``1/enc``, as ``quantize`` stores)."""
        enc = qz.global_encode_scale(amax, spec.fmt)
        return jnp.broadcast_to(reciprocal_rn(enc), (self.G,))

    def row_operand(self, t: jax.Array, lay: dict, keys: jax.Array, gemm: str, which: str
                    ) -> tuple[Any, jax.Array | None]:
        """A 1D-blocked operand along its last axis (fprop's x, dgrad's dy), ``t (M, C)``:
        ``(operand, per-expert decode scales or None)``; the operand is a ``(1, M, C')``
        ``QuantizedArray`` or the (rotated) tensor."""
        g = getattr(self.recipe, gemm)
        spec = getattr(g, which)
        if g.hadamard:
            t = _row_rht(t, self.signs(keys, gemm)[lay["gid"]], g.hadamard)
        if not spec.quantized:
            return t[None], None
        xf = numerics.exact_float32(t)
        amax = _segment_amax(qz.row_amax(xf, -1)[:, 0], lay["gid"], lay["valid"], self.G)
        u = None
        if spec.stochastic:
            b = spec.fmt.block_size
            words = jax.vmap(lambda k: jax.random.key_data(operand_key(k, gemm, which)))(keys)
            u = uniform_rows(words[lay["gid"]], lay["local"], -(-t.shape[1] // b) * b)[None]
        q = qz.quantize_unchecked(t[None], None, spec.fmt, 2, False, spec.rounding,
                                  tensor_amax=amax[lay["gid"]][None, :, None], uniforms=u)
        return q, self.decs(amax, spec)

    def token_operand(self, t: jax.Array, pl: dict, keys: jax.Array, which: str
                      ) -> tuple[Any, jax.Array | None]:
        """A Wgrad operand (x or dy, ``t (M, C)``) in the padded layout ``(1, Mp, C)``,
        rotated and blocked along the tokens, expert by expert."""
        g = self.recipe.wgrad
        spec = getattr(g, which)
        t = _to_padded(t, pl)
        if g.hadamard:
            h = g.hadamard
            t = _tile_rht(t, self.signs(keys, "wgrad")[pl["gid"][::h]], h)
        if not spec.quantized:
            return t[None], None
        xf = numerics.exact_float32(t)
        amax = _segment_amax(qz.row_amax(xf, -1)[:, 0], pl["gid"], pl["valid"], self.G)
        b = spec.fmt.block_size
        block_amax = jnp.where(pl["valid"][::b], amax[pl["gid"][::b]], 0.0)
        u = None
        if spec.stochastic:
            words = jax.vmap(lambda k: jax.random.key_data(operand_key(k, "wgrad", which)))(
                keys)
            u = uniform_rows(words[pl["gid"]], pl["local"], t.shape[1])[None]
        q = qz.quantize_unchecked(t[None], None, spec.fmt, 1, False, spec.rounding,
                                  tensor_amax=block_amax[None, :, None], uniforms=u)
        return q, self.decs(amax, spec)

    def weight_operand(self, w: jax.Array, keys: jax.Array, gemm: str
                       ) -> tuple[Any, jax.Array | None]:
        """The experts' weights ``(G, K, N)`` as the per-expert calls make them
        (``reference_operand`` of each, vmapped): ``(operand (G, 1, K', N'), decode scales
        (G,) or None)``."""
        spec = getattr(self.recipe, gemm).rhs
        _, q = jax.vmap(lambda wg, k: reference_operand(wg[None], self.recipe, gemm, "rhs",
                                                        k))(w, keys)
        if not spec.quantized:
            return q, None
        return q, q.global_scale.reshape(self.G)


def _alpha(*decs: jax.Array | None) -> jax.Array | None:
    """The per-expert product of the tensor decode scales present (``fp4jax.dot``'s
    ``alpha = dec_a * dec_b``, in that order), or None."""
    ds = [d for d in decs if d is not None]
    return functools.reduce(jnp.multiply, ds) if ds else None


def _rows_gemm(a: Any, b: Any, sizes: jax.Array, lay: dict, alpha: jax.Array | None,
               precision: Any, out_dtype: Any, rhs_contract: int) -> jax.Array:
    """``out[r] = (a[r] @ b[gid[r]]) * alpha[gid[r]]`` (zero past the groups): ``a (1, M,
    C)``, ``b (G, 1, ...)`` contracting its axis ``rhs_contract`` (1: ``(K, N)`` fprop, 2:
    ``(K, N)`` transposed, dgrad)."""
    av, bv, _, _, precision = gemm_inputs(a, b, precision)
    av, bv = av[0], bv[:, 0]
    dn = _RAGGED_DN(dot_dimension_numbers=(([1], [rhs_contract]), ([], [])),
                    lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    y = jax.lax.ragged_dot_general(av, bv, sizes, dn, precision=precision,
                                   preferred_element_type=jnp.float32)
    if alpha is not None:
        y = y * alpha[lay["gid"]][:, None]
    return jnp.where(lay["valid"][:, None], y, 0.0).astype(out_dtype)


def _wgrad_gemm(a: Any, b: Any, psizes: jax.Array, alpha: jax.Array | None,
                precision: Any, out_dtype: Any) -> jax.Array:
    """``dw[g] = (sum over expert g's padded rows of a[p]^T b[p]) * alpha[g]``: a ragged
    contraction over the tokens, ``(G, K, N)``."""
    av, bv, _, _, precision = gemm_inputs(a, b, precision)
    av, bv = av[0], bv[0]
    dn = _RAGGED_DN(dot_dimension_numbers=(([0], [0]), ([], [])),
                    lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    dw = jax.lax.ragged_dot_general(av, bv, psizes, dn, precision=precision,
                                    preferred_element_type=jnp.float32)
    if alpha is not None:
        dw = dw * alpha[:, None, None]
    return dw.astype(out_dtype)


def _poisoned(t: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``t`` where every group size is >= 0, else all NaN: the rule for negative sizes
    that only a traced call meets (``ragged_dot`` refuses concrete ones)."""
    return jnp.where(jnp.any(group_sizes < 0), jnp.asarray(jnp.nan, t.dtype), t)


@functools.cache
def _make_ragged(recipe: Recipe, out_dtype: Any, lhs_dtype: Any, rhs_dtype: Any,
                 precision: Any, G: int, M: int, K: int, N: int):
    """The custom_vjp of one grouped GEMM shape: ``(x (M, K), w (G, K, N), group_sizes (G,),
    keys (G,) or (G, 2)) -> y (M, N)``."""
    fp, dg = recipe.fprop, recipe.dgrad
    reuse_w = dg.rhs == fp.rhs and (not fp.rhs.quantized or fp.rhs.block_2d) and not (
        fp.hadamard or dg.hadamard)
    A = ragged_row_multiple(recipe)
    R = _Ragged(recipe, G, M)

    def fwd_parts(x, w, group_sizes, keys):
        lay = _layout(group_sizes, M, G)
        xq, xd = R.row_operand(x, lay, keys, "fprop", "lhs")
        wq, wd = R.weight_operand(w, keys, "fprop")
        y = _rows_gemm(xq, wq, lay["sizes"], lay, _alpha(xd, wd), precision, out_dtype, 1)
        return _poisoned(y, group_sizes), lay, wq, wd

    @jax.custom_vjp
    def rdot(x, w, group_sizes, keys):
        return fwd_parts(x, w, group_sizes, keys)[0]

    def fwd(x, w, group_sizes, keys):
        y, lay, wq, wd = fwd_parts(x, w, group_sizes, keys)
        pl = _padded_layout(lay, M, G, A)
        xw = R.token_operand(x, pl, keys, "lhs")
        wres = (wq, wd) if reuse_w else R.weight_operand(w, keys, "dgrad")
        return y, (wres, xw, group_sizes, keys)

    def bwd(res, gy):
        (wq_d, wd_d), (xq_w, xd_w), group_sizes, keys = res
        lay = _layout(group_sizes, M, G)
        pl = _padded_layout(lay, M, G, A)
        gy = gy.astype(jnp.float32) if gy.dtype != jnp.bfloat16 else gy
        gq_d, gd_d = R.row_operand(gy, lay, keys, "dgrad", "lhs")
        dx = _rows_gemm(gq_d, wq_d, lay["sizes"], lay, _alpha(gd_d, wd_d), precision,
                        lhs_dtype, 2)
        gq_w, gd_w = R.token_operand(gy, pl, keys, "rhs")
        dw = _wgrad_gemm(xq_w, gq_w, pl["psizes"], _alpha(xd_w, gd_w), precision, rhs_dtype)
        return _poisoned(dx, group_sizes), _poisoned(dw, group_sizes), None, None

    rdot.defvjp(fwd, bwd)
    return jax.jit(rdot)


def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    recipe: Recipe | str | None = None,
    key: jax.Array | None = None,
    rht_key: jax.Array | None = None,
    precision: Any = None,
    preferred_element_type: Any = None,
    implementation: str | None = None,
) -> jax.Array:
    """A drop-in for ``jax.lax.ragged_dot`` (grouped GEMM) whose GEMMs, forward and
    backward, run a recipe: every expert as its own ``fp4jax.dot`` (module docstring).

    Args:
      lhs: ``(M, K)`` float, rows sorted by group (expert): ``group_sizes[0]`` rows of
        expert 0, then expert 1's, ...
      rhs: ``(G, K, N)`` float, one weight per expert.
      group_sizes: ``(G,)`` integer, rows per expert, each >= 0 (a sum below M leaves the
        trailing rows zero, as ``jax.lax.ragged_dot`` does; the rows past M of a larger
        sum are dropped). ``G = 0`` (no expert) gives zeros, as ``jax.lax.ragged_dot``
        does. A negative size, which ``jax.lax.ragged_dot`` does not define, is refused
        when the sizes are concrete (a ``ValueError`` at the call); when they are traced
        (under ``jit``, ``vmap``, ``grad``) the call cannot see them, and the rule is
        checked on the device instead: a negative size makes the whole output, and the
        gradients ``dx`` and ``dw``, NaN (never a silent result). Nothing else is
        checked at run time.
      recipe: a ``fp4jax.Recipe`` or its name; default ``recipes.nvfp4()``.
      key: ``jax.random`` key (threefry, the default implementation, where the recipe
        rounds stochastically); required when the recipe draws random bits. Expert ``g``
        runs with ``jax.random.fold_in(key, g)``.
      rht_key: the layer's constant key for ``hadamard_signs="layer"`` recipes; expert
        ``g`` runs with ``jax.random.fold_in(rht_key, g)``.
      precision: passed to unquantized GEMMs (quantized GEMMs are exact emulations).
      preferred_element_type: output dtype (default ``result_type(lhs, rhs)``).
      implementation: ``None`` or ``"xla"``: the Pallas kernels and Blackwell's native
        GEMMs do not cover grouped GEMMs, so the XLA reference always runs.

    Inside ``fp4jax.sharding.data_parallel(axis)``: each device's rows as their own call,
    with ``key`` (and ``rht_key``) folded with the device's index along ``axis`` (module
    docstring, Data parallel).

    Returns:
      ``(M, N)``: row ``r`` of expert ``g`` is ``fp4jax.dot(lhs_g, rhs[g], recipe=recipe,
      key=fold_in(key, g), rht_key=fold_in(rht_key, g))``'s row, rows past
      ``sum(group_sizes)`` zero. Gradients flow to ``lhs`` and ``rhs`` through each
      expert's dgrad and wgrad (``dw[g]`` of an empty expert is zero).

    Example:
      >>> y = fp4jax.ragged_dot(x, w_experts, group_sizes, recipe="nvfp4",
      ...                       key=jax.random.key(0))
    """
    from fp4jax.recipes import get as get_recipe

    recipe = nvfp4() if recipe is None else get_recipe(recipe)
    lhs = qz.check_float(lhs, "lhs", "fp4jax.ragged_dot")
    rhs = qz.check_float(rhs, "rhs", "fp4jax.ragged_dot")
    if implementation not in (None, "xla"):
        raise ValueError(f"fp4jax.ragged_dot: implementation={implementation!r}: grouped "
                         "GEMMs run on XLA only (the Pallas kernels and native FP4 GEMMs do "
                         "not cover them); pass implementation=None or 'xla'")
    if lhs.ndim != 2 or rhs.ndim != 3:
        raise ValueError(f"fp4jax.ragged_dot: lhs must be (M, K) and rhs (G, K, N), got "
                         f"shapes {lhs.shape} and {rhs.shape}")
    if lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"fp4jax.ragged_dot: contraction sizes differ: lhs shape "
                         f"{lhs.shape} (K = dim 1) vs rhs shape {rhs.shape} (K = dim 1)")
    gs = jnp.asarray(group_sizes)
    if gs.shape != (rhs.shape[0],) or not jnp.issubdtype(gs.dtype, jnp.integer):
        raise ValueError(f"fp4jax.ragged_dot: group_sizes must be an integer array of shape "
                         f"({rhs.shape[0]},) (one size per expert of rhs), got "
                         f"{gs.dtype} {gs.shape}")
    for name, g in recipe.gemms.items():
        _check_spec(g.lhs, f"recipe {recipe.name!r} {name}.lhs")
        _check_spec(g.rhs, f"recipe {recipe.name!r} {name}.rhs")
    key = call_key(recipe, key, rht_key)
    shard = sharding.data_axis()
    if shard is not None:
        key = _device_key(key, shard)
    if any(q.stochastic for g in recipe.gemms.values() for q in (g.lhs, g.rhs)):
        k0 = key[0] if key.ndim else key
        if not _threefry(k0):
            raise ValueError(f"fp4jax.ragged_dot: stochastic rounding draws each expert's "
                             f"bits by position and needs a threefry key, got "
                             f"{jax.random.key_impl(k0)}: make it with jax.random.key(seed)")
    try:  # concrete sizes: checked now; traced ones cannot be read (NaN rule, above)
        sizes = np.asarray(gs)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        sizes = None
    if sizes is not None and (sizes < 0).any():
        raise ValueError(f"fp4jax.ragged_dot: group_sizes must be >= 0 (rows per expert), "
                         f"got {sizes.tolist()} (negative: {sizes[sizes < 0].tolist()}); "
                         "pass each expert's row count")
    G, M, K, N = rhs.shape[0], lhs.shape[0], lhs.shape[1], rhs.shape[2]
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype))
    if G == 0:  # no expert: no row belongs to one (jax.lax.ragged_dot's zeros)
        return jnp.zeros((M, N), out_dtype)
    if isinstance(precision, list):
        precision = tuple(precision)
    fn = _make_ragged(recipe, out_dtype, jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype),
                      precision, G, M, K, N)
    return fn(lhs, rhs, gs.astype(jnp.int32), expert_keys(key, G))

