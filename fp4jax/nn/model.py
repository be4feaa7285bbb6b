"""``quantize_model``: precision rules applied to an unedited linen or NNX model; ``report``.

::

    rules = [fp4jax.nn.Rule(r".*(embed|lm_head).*", None), fp4jax.nn.Rule(r".*", "nvfp4")]
    qmodel = fp4jax.nn.quantize_model(model, rules)          # linen: same parameter tree
    params = qmodel.init(key, tokens)
    logits = qmodel.apply(params, tokens, rngs={"fp4": jax.random.fold_in(key, step)})

    qmodel = fp4jax.nn.quantize_model(nnx_model, rules, rngs=nnx.Rngs(fp4=0))  # in place
    print(fp4jax.nn.report(qmodel, tokens))   # every linear layer's path -> recipe

**What is a linear layer.** A product ``lax.dot_general(a, b)`` (through the public names
``jax.lax.dot_general``, ``jax.numpy.einsum``, ``jax.numpy.dot`` or ``jax.numpy.matmul``)
made by a module's own code in which exactly one operand is one of that module's own
parameters (the same array, a copy cast to another dtype: the module's compute dtype,
or a 2-D parameter transposed; an activation that merely has a parameter's shape and dtype
is not one, ``_param_match``). That parameter takes the
weight role of the recipe (the RHS of fprop: 2-D block scales where the recipe asks, the
RHS of dgrad, the RHS of wgrad's ``dw``); dimension numbers are transposed and the operands
reshaped so that ``fp4jax.dot_general`` computes the same product, ``x (..., K) @ w (K, N)``
(several contracting or output axes, as in ``DenseGeneral``, flattened in order; batch
dimensions kept). ``flax.linen`` ``Dense``, ``DenseGeneral`` and ``Einsum``, NNX
``Linear``, ``LinearGeneral`` and ``Einsum`` are covered this way. A product of two
activations (attention scores) is not a linear layer and stays as it is; so does a product
whose both operands look like parameters (``report`` lists it).

**Experts.** A grouped GEMM ``jax.lax.ragged_dot(x (M, K), w (G, K, N), group_sizes)``
whose ``w`` is the module's own parameter (a mixture-of-experts layer, one weight per
expert: ``fp4jax.models.moe.Experts``) is a linear layer too: ``w`` takes the weight role of
each expert and the product runs ``fp4jax.ragged_dot`` (every expert its own
``fp4jax.dot``: per-expert tensor scales, expert ``g``'s keys ``fold_in(key, g)``); its keys
come from a ``fp4jax.nn.linen.RaggedDot`` submodule (``RaggedDot_0``) as a ``DotGeneral``'s
do, or from the NNX layer's ``fp4jax_dot``. A router is an ordinary linear layer: keep it
in high precision with a rule (``Rule(".*router", None)``; the Llama's ``policy_rules`` do).

**Paths.** linen: ``Module.path`` joined by ``/`` (``"decoder/layers_0/attn/query"``).
Under ``nn.scan`` the scanned body's modules keep the scan's own path for every iteration
(``"decoder/blocks/attn/query"``), and block ``i`` also answers to its block path, the index
after the scan's path (``"decoder/blocks/3/attn/query"``, ``fp4jax.rules.block_paths``);
the body is traced once, so rules that give the blocks of one scan different recipes raise
a ``ValueError`` when it is traced (``match_rule_in_stack``) rather than one recipe applying
to all. NNX: the attribute path from the root, list and dict keys included
(``"blocks/3/mlp/up"``); an ``nnx.vmap`` stack of layers is one module (``"blocks/mlp/up"``)
with the same block paths (``"blocks/3/mlp/up"``), checked by ``quantize_model``.

**Keys.** linen: the product runs through a ``fp4jax.nn.linen.DotGeneral`` submodule that
the layer creates at the call (auto-named ``DotGeneral_0`` under the layer, no
parameters), exactly what ``nn.Dense(dot_general_cls=functools.partial(DotGeneral,
recipe=r))`` or ``fp4jax.nn.linen.Dense`` does: stochastic-rounding keys are
``make_rng(rng_collection)`` in that submodule's scope (one draw per call; distinct per
layer, per call, and per step when ``rngs={"fp4": fold_in(key, step)}``), per-layer RHT
keys ``make_rng(layer_rng_collection)`` (the same at every step, different per layer path).
A hand-wired model using those layers draws the same keys, bit for bit. Under ``nn.scan``,
iterations get distinct keys only when the scan splits the stream (``split_rngs={...,
"fp4": True}``); a scan that broadcasts it gives every block the same key in one call.
Modules whose method is not ``nn.compact`` (``setup``-style) cannot create a submodule
there: their keys come from ``make_rng`` in the layer's own scope. The ``perturb``/``sow``
statistics collections of ``DotGeneral`` (``fp4jax.diagnostics.layer_stats``) work on
every covered unbatched product, under the paths ``{layer}/DotGeneral_0``.

NNX: each quantized layer gets a ``fp4jax.nn.nnx.DotGeneral`` (attribute ``dot_general``
of ``Linear``/``LinearGeneral``, ``einsum_op`` of ``Einsum``, ``fp4jax_dot`` of another
module) with its own RNG stream seeded ``layer_key(rngs[rng_collection](), path)`` and,
for per-layer RHT signs, the constant key ``layer_key(rngs[layer_rng_collection](), path)``
(one draw of each stream per ``quantize_model`` call). A layer stacked by ``nnx.vmap`` (its
kernel has leading axes) gets one stream per stacked layer (keys split along those axes), so
``nnx.scan`` over the stack slices them like the parameters. Parameters are untouched; the
streams and RHT keys are new NNX state of the model (``nnx.RngState``, ``RHTKey``).

**How (and why this way).** linen: ``flax.linen.intercept_methods`` (public, made for
this) sees every module method call and keeps a thread-local stack of the module whose own
code is running; for the duration of ``qmodel.init``/``apply`` the four public JAX names
above (and ``jax.lax.ragged_dot``) are replaced by hooks that read that stack (other
threads, and code outside a module, get the original functions). Patching the public names
rather than the ``dot_general_cls`` attributes reaches modules that have no hook
(``nn.Einsum``, raw ``jnp.einsum``), and replacing ``jnp.einsum`` itself (translated to
one ``dot_general``, ``einsum_dimension_numbers``) keeps key draws out of ``jnp.einsum``'s
internal ``jit`` (where drawing fails: ``TraceContextError``). NNX layers keep their
``dot_general`` / ``einsum_op`` as attributes, so the covered layers are changed by graph
traversal (``nnx.iter_graph``), with no patching; other NNX modules with parameters get a
subclass whose ``__call__`` runs under the same hooks. google/qwix (``quantize_model``,
``QuantizationRule(module_path=...)``) patches functions' code objects and disables
``jit`` inside intercepted calls to reach ``jnp`` internals; fp4jax stays with public
names and leaves ``jit`` alone (qwix is not a dependency). What neither reaches: a product
written ``x @ w`` (the operator), ``lax.dot_general`` imported by name before the call
(``from jax.lax import dot_general``), and products inside a function the module jits
itself: ``report`` lists every ``dot_general`` of the traced model that no hook saw.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.extend import core as jex_core

from fp4jax.diagnostics import observe_product
from fp4jax.nn import linen as fnn
from fp4jax.nn import nnx as fnnx
from fp4jax.recipes import Recipe
from fp4jax.rules import (
    Rule,
    as_rules,
    einsum_dimension_numbers,
    layer_key,
    match_rule,
    match_rule_in_stack,
    sub_jaxprs,
    weight_dot_general,
)

__all__ = ["Report", "quantize_model", "report"]

# the public names the hooks replace while a quantized model runs, and their originals
_ORIGINALS = {
    (jax.lax, "dot_general"): jax.lax.dot_general,
    (jax.numpy, "einsum"): jax.numpy.einsum,
    (jax.numpy, "dot"): jax.numpy.dot,
    (jax.numpy, "matmul"): jax.numpy.matmul,
    (jax.lax, "ragged_dot"): jax.lax.ragged_dot,
}
_ORIG_DOT_GENERAL = jax.lax.dot_general
_ORIG_EINSUM = jax.numpy.einsum
_ORIG_DOT = jax.numpy.dot
_ORIG_MATMUL = jax.numpy.matmul
_ORIG_RAGGED_DOT = jax.lax.ragged_dot

_patch_lock = threading.Lock()
_patch_depth = 0


class _Local(threading.local):
    def __init__(self) -> None:
        self.frames: list[_Frame | None] = []
        self.sessions: list[_Session] = []
        self.scans: list[tuple[str, int]] = []  # (path, length) of the nn.scans running
        self.busy = 0


_local = _Local()


@dataclasses.dataclass
class _Record:
    """What ``report`` collects while the model is traced."""

    layers: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    activation: list[str] = dataclasses.field(default_factory=list)
    uncovered: list[str] = dataclasses.field(default_factory=list)
    seen: int = 0


@dataclasses.dataclass(eq=False)
class _Session:
    """One ``quantize_model`` call: its rules and stream names."""

    rules: tuple[Rule, ...]
    rng_collection: str
    layer_rng_collection: str
    record: _Record | None = None
    # NNX: the rule each layer got from quantize_model (a stacked layer's, by its blocks)
    resolved: dict[str, int | None] = dataclasses.field(default_factory=dict)

    def rule_index(self, path: str, stacks: Sequence[tuple[str, int]] = ()) -> int | None:
        """The rule of the layer at ``path``, inside the stacked blocks ``stacks`` (``(stack
        path, blocks)``: ``match_rule_in_stack``, which raises where blocks disagree)."""
        if not stacks:
            return match_rule(self.rules, path)
        return match_rule_in_stack(self.rules, path, stacks)


@dataclasses.dataclass
class _Frame:
    """A module whose own code is running: linen (``module`` bound) or NNX."""

    session: _Session
    path: str
    module: Any
    kind: str  # "linen" | "nnx"


@contextlib.contextmanager
def _patched():
    """Replaces the public product functions by the hooks (reference-counted, so nested
    and concurrent quantized calls restore them once, at the end of the last)."""
    global _patch_depth
    with _patch_lock:
        if _patch_depth == 0:
            jax.lax.dot_general = _hook_dot_general
            jax.numpy.einsum = _hook_einsum
            jax.numpy.dot = _hook_dot
            jax.numpy.matmul = _hook_matmul
            jax.lax.ragged_dot = _hook_ragged_dot
        _patch_depth += 1
    try:
        yield
    finally:
        with _patch_lock:
            _patch_depth -= 1
            if _patch_depth == 0:
                for (mod, name), fn in _ORIGINALS.items():
                    setattr(mod, name, fn)


@contextlib.contextmanager
def _push(frame: _Frame | None):
    _local.frames.append(frame)
    try:
        yield
    finally:
        _local.frames.pop()


def _current() -> _Frame | None:
    if _local.busy or not _local.frames:
        return None
    return _local.frames[-1]


# ---------------------------------------------------------------------------
# the hooks
# ---------------------------------------------------------------------------

def _hook_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                      **kw):
    frame = _current()

    def orig():
        return _ORIG_DOT_GENERAL(lhs, rhs, dimension_numbers, precision,
                                 preferred_element_type, **kw)

    if frame is None:
        return orig()
    return _product(frame, "dot_general", orig, lhs, rhs, dimension_numbers, None, precision,
                    preferred_element_type, kw.get("out_sharding"))


def _hook_einsum(subscripts, *operands, **kw):
    frame = _current()

    def orig():
        return _ORIG_EINSUM(subscripts, *operands, **kw)

    if (frame is None or not isinstance(subscripts, str) or len(operands) != 2
            or set(kw) - {"precision", "preferred_element_type", "out_sharding",
                          "optimize"}):
        return orig()
    lhs, rhs = operands
    form = einsum_dimension_numbers(subscripts, jnp.ndim(lhs), jnp.ndim(rhs))
    if form is None:
        return _product(frame, "einsum", orig, lhs, rhs, None, None, None, None, None,
                        why=f"einsum {subscripts!r} is not one dot_general")
    dims, perm = form
    return _product(frame, "einsum", orig, lhs, rhs, dims, perm, kw.get("precision"),
                    kw.get("preferred_element_type"), kw.get("out_sharding"))


def _matmul_form(a: Any, b: Any, op: str) -> tuple[Any, None] | None:
    """``jnp.dot``/``jnp.matmul`` of ``a (..., K)`` and a 2-D ``b (K, N)``, or of a 2-D
    ``a (M, K)`` and ``b (K,)``, as a dot_general; None for other ranks."""
    na, nb = jnp.ndim(a), jnp.ndim(b)
    if nb == 2 and na >= 1:
        return (((na - 1,), (0,)), ((), ())), None
    if na == 2 and nb == 1:
        return (((1,), (0,)), ((), ())), None
    return None


def _matmul_hook(name: str, original):
    """The hook of ``jnp.dot``/``jnp.matmul`` (``name``): a two-operand product in the
    ``x @ w`` form goes to ``_product``; any other call runs ``original`` unchanged."""

    def hook(a, b, *args, **kw):
        frame = _current()

        def orig():
            return original(a, b, *args, **kw)

        form = _matmul_form(a, b, name)
        if (frame is None or args
                or set(kw) - {"precision", "preferred_element_type", "out_sharding"}
                or not form):
            return orig()
        return _product(frame, name, orig, a, b, form[0], None, kw.get("precision"),
                        kw.get("preferred_element_type"), kw.get("out_sharding"))

    return hook


_hook_dot = _matmul_hook("dot", _ORIG_DOT)
_hook_matmul = _matmul_hook("matmul", _ORIG_MATMUL)


def _hook_ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None,
                     **kw):
    """The hook of ``jax.lax.ragged_dot`` (grouped GEMMs: ``rhs (G, K, N)``, one weight per
    expert): a call whose ``rhs`` is the module's own parameter (and ``lhs`` is not) is a
    linear layer of experts (``_ragged_product``); others run unchanged."""
    frame = _current()

    def orig():
        return _ORIG_RAGGED_DOT(lhs, rhs, group_sizes, precision, preferred_element_type,
                                **kw)

    if frame is None or any(v is not None for v in kw.values()):
        return orig()
    return _ragged_product(frame, orig, lhs, rhs, group_sizes, precision,
                           preferred_element_type)


# ---------------------------------------------------------------------------
# one product: which operand is the weight, which recipe, the quantized call
# ---------------------------------------------------------------------------

def _own_params(frame: _Frame) -> list[Any]:
    """The module's own parameter arrays (not its submodules'), unboxed."""
    if frame.kind == "linen":
        m = frame.module
        try:
            params = m.variables.get("params", {})
        except Exception:  # noqa: BLE001 (an unbound module: no parameters to find)
            return []
        return [nn.meta.unbox(v) for v in params.values()
                if not hasattr(v, "items")]
    out = []
    for v in vars(frame.module).values():
        if isinstance(v, nnx.Param):
            out.append(v[...])
    return out


def _subtree_params(frame: _Frame) -> list[Any]:
    """The parameter arrays of the module's submodules (for ``report`` only: a product
    on one of them is not covered, since only a module's own parameters are weights)."""
    if frame.kind == "linen":
        try:
            params = frame.module.variables.get("params", {})
        except Exception:  # noqa: BLE001 (unbound)
            return []
        return [nn.meta.unbox(v) for v in jax.tree.leaves(
            params, is_leaf=lambda v: isinstance(v, nn.meta.AxisMetadata))
            if not hasattr(v, "items")]
    if not isinstance(frame.module, nnx.Module):
        return []
    return [v[...] for _, v in nnx.iter_graph(frame.module) if isinstance(v, nnx.Param)]


def _param_match(x: Any, params: Sequence[Any]) -> int:
    """How surely ``x`` is one of the module's parameters ``params``: 3 the array itself
    (as the layer's code read it; an ``nnx.Variable`` by its value), 2 a copy cast to
    another dtype (a parameter of at least 2 dimensions, the same shape: ``kernel.astype(
    bf16)``, Flax's ``promote_dtype``), 1 a 2-D parameter transposed (``embedding.T``,
    maybe cast; not square), 0 none. An array of a parameter's shape and dtype that is not
    the parameter is not one (an activation that happens to have its shape: products of
    two activations stay unquantized); ``_roles`` reports it."""
    if isinstance(x, nnx.Variable):
        x = x[...]
    shape, dtype = jnp.shape(x), getattr(x, "dtype", None)
    best = 0
    for p in params:
        if x is p:
            return 3
        ps = jnp.shape(p)
        if len(ps) >= 2 and shape == ps and dtype != getattr(p, "dtype", None):
            best = max(best, 2)
        elif len(ps) == 2 and ps[0] != ps[1] and shape == ps[::-1]:
            best = max(best, 1)
    return best


def _lookalike(x: Any, params: Sequence[Any]) -> bool:
    """``x`` has a parameter's shape and dtype without being it (``_param_match`` 0)."""
    shape, dtype = jnp.shape(x), getattr(x, "dtype", None)
    return any(len(jnp.shape(p)) >= 2 and shape == jnp.shape(p)
               and dtype == getattr(p, "dtype", None) for p in params)


def _roles(lhs: Any, rhs: Any, params: Sequence[Any]) -> tuple[list[bool], str | None]:
    """Which operand of a product is the module's parameter (the weight): the one that
    ``_param_match`` finds surer; ``[False, False]`` when neither is one, ``[True, True]``
    when both are equally (two parameters, or a square input that is indistinguishable
    from a cast weight). The second item says why a product is left out (for
    ``report``), or None."""
    if not params:
        return [False, False], None
    a, b = _param_match(lhs, params), _param_match(rhs, params)
    if a == b == 0:
        if _lookalike(lhs, params) or _lookalike(rhs, params):
            return [False, False], ("an operand has the shape and dtype of the module's "
                                    "parameter but is not it: not quantized")
        return [False, False], None
    if a == b:
        return [True, True], "both operands look like parameters"
    return [a > b, b > a], None


def _shapes(a: Any, b: Any) -> str:
    return f"{tuple(jnp.shape(a))} x {tuple(jnp.shape(b))}"


def _product(frame: _Frame, op: str, orig: Callable[[], Any], lhs: Any, rhs: Any,
             dims: Any, perm: tuple[int, ...] | None, precision: Any,
             preferred_element_type: Any, out_sharding: Any, why: str | None = None) -> Any:
    """Runs one product seen by a hook inside ``frame``'s module: quantized when one
    operand is the module's parameter and a rule gives a recipe, else ``orig()``."""
    s, rec = frame.session, frame.session.record
    roles, left_out = _roles(lhs, rhs, _own_params(frame))
    if not any(roles):
        if rec is not None:
            sub = _subtree_params(frame)
            if left_out is not None:
                rec.uncovered.append(f"{frame.path or '/'}: {op} {_shapes(lhs, rhs)} "
                                     f"({left_out})")
            elif sub and (_param_match(lhs, sub) or _param_match(rhs, sub)):
                rec.uncovered.append(f"{frame.path or '/'}: {op} {_shapes(lhs, rhs)} (an "
                                     "operand looks like a submodule's parameter, not the "
                                     "module's own)")
        # an activation product: counted by report from the traced program (its scope),
        # so that one traced before, and cached inside jnp.einsum's jit, counts too
        return _seen(orig, _SEEN_SCOPE if left_out is not None
                     else f"{_ACT_SCOPE}:{op} {_shapes(lhs, rhs)}")
    if all(roles) or why is not None:
        if rec is not None:
            rec.uncovered.append(f"{frame.path or '/'}: {op} {_shapes(lhs, rhs)} "
                                 f"({why or left_out})")
        return _seen(orig)
    idx = s.rule_index(frame.path, _stacks_of(frame.path) if frame.kind == "linen" else ())
    recipe = s.rules[idx].recipe if idx is not None else None
    weight = rhs if roles[1] else lhs
    if rec is not None:
        _record_layer(rec, frame.path, op, weight, idx, recipe)
    if recipe is None:
        return _seen(orig)
    y = _seen(lambda: _quantized(frame, recipe, lhs, rhs, dims, roles[0], precision,
                                 preferred_element_type, out_sharding))
    return y if perm is None else jnp.transpose(y, perm)


def _record_layer(rec: _Record, path: str, op: str, weight: Any, rule: int | None,
                  recipe: Any) -> None:
    """One product of the linear layer at ``path`` for ``report``: its entry (the first
    product's op and weight shape) and every weight shape its products used (``weights``:
    a module may multiply several of its parameters; ``Report.scan_axes`` reads them)."""
    shape = tuple(jnp.shape(weight))
    d = rec.layers.setdefault(path, {
        "op": op, "weight": shape, "weights": [], "rule": rule,
        "recipe": None if recipe is None else recipe.name, "calls": 0})
    if shape not in d["weights"]:
        d["weights"].append(shape)
    d["calls"] += 1


def _ragged_product(frame: _Frame, orig: Callable[[], Any], lhs: Any, rhs: Any,
                    group_sizes: Any, precision: Any, preferred_element_type: Any) -> Any:
    """One ``jax.lax.ragged_dot`` seen by the hook: the expert weights ``rhs (G, K, N)``
    take the recipe's weight role (each expert's, ``fp4jax.ragged_dot``) when they are the
    module's own parameter and a rule gives the module a recipe, else ``orig()``."""
    s, rec = frame.session, frame.session.record
    params = _own_params(frame)
    a, b = _param_match(lhs, params), _param_match(rhs, params)
    is_w = jnp.ndim(rhs) == 3 and b > 0
    if not is_w or a >= b:
        if rec is not None:
            (rec.uncovered if is_w else rec.activation).append(
                f"{frame.path or '/'}: ragged_dot {_shapes(lhs, rhs)}"
                + (" (both operands look like parameters)" if is_w else ""))
        return _seen(orig)
    idx = s.rule_index(frame.path, _stacks_of(frame.path) if frame.kind == "linen" else ())
    recipe = s.rules[idx].recipe if idx is not None else None
    if rec is not None:
        _record_layer(rec, frame.path, "ragged_dot", rhs, idx, recipe)
    if recipe is None:
        return _seen(orig)
    return _seen(lambda: _ragged_fn(frame, recipe)(lhs, rhs, group_sizes, precision,
                                                   preferred_element_type))


def _nnx_dot(frame: _Frame) -> Any:
    """The ``fp4jax.nn.nnx.DotGeneral`` that ``quantize_model`` gave the NNX layer in
    ``frame`` (its ``fp4jax_dot``)."""
    dot = getattr(frame.module, "fp4jax_dot", None)
    if dot is None:
        raise ValueError(f"fp4jax.nn.quantize_model: NNX module at {frame.path!r} was "
                         "not prepared (call quantize_model on the model that runs)")
    return dot


def _ragged_fn(frame: _Frame, recipe: Recipe) -> Callable[..., jax.Array]:
    """The layer's ``fp4jax.ragged_dot`` with its keys (as ``_dot_fn``'s: a linen
    ``RaggedDot`` submodule, the layer's own scope for setup-style modules, or the NNX
    layer's ``fp4jax_dot``)."""
    s = frame.session
    if frame.kind == "nnx":
        return _nnx_dot(frame).ragged_dot
    try:
        return fnn.RaggedDot(recipe=recipe, rng_collection=s.rng_collection,
                             layer_rng_collection=s.layer_rng_collection)
    except Exception:  # noqa: BLE001 (not compact: no submodule here; keys from the layer)
        return _ScopeDot(frame.module, recipe, s.rng_collection,
                         s.layer_rng_collection).ragged


_SEEN_SCOPE = "fp4jax_seen"
_ACT_SCOPE = "fp4jax_seen_activations"  # a product of two activations, left alone


def _seen(f: Callable[[], Any], scope: str = _SEEN_SCOPE) -> Any:
    """``f()`` with the hooks off (its own products are not the model's), under a named
    scope that ``report`` recognises as a product some hook saw (``_ACT_SCOPE``: one of
    two activations)."""
    _local.busy += 1
    try:
        with jax.named_scope(scope):
            return f()
    finally:
        _local.busy -= 1


def _quantized(frame: _Frame, recipe: Recipe, lhs: Any, rhs: Any, dims: Any,
               weight_is_lhs: bool, precision: Any, preferred_element_type: Any,
               out_sharding: Any) -> jax.Array:
    """``lax.dot_general(lhs, rhs, dims)`` through fp4jax with the weight as the RHS: the
    operands transposed and reshaped to ``x (..., K) @ w (K, N)`` (or ``(B.., ..., K) @
    (B.., K, N)`` with batch dims), the output put back in ``lax.dot_general``'s order."""
    y = weight_dot_general(_dot_fn(frame, recipe), lhs, rhs, dims, weight_is_lhs, precision,
                           preferred_element_type)
    if out_sharding is not None:
        y = jax.lax.with_sharding_constraint(y, out_sharding)
    return y


def _dot_fn(frame: _Frame, recipe: Recipe) -> Callable[..., jax.Array]:
    """The fp4jax ``dot_general`` of the layer in ``frame`` (see the module docstring's
    Keys)."""
    s = frame.session
    if frame.kind == "nnx":
        return _nnx_dot(frame)
    try:
        return fnn.DotGeneral(recipe=recipe, rng_collection=s.rng_collection,
                              layer_rng_collection=s.layer_rng_collection)
    except Exception:  # noqa: BLE001 (not compact: no submodule here; keys from the layer)
        m = frame.module
        return _ScopeDot(m, recipe, s.rng_collection, s.layer_rng_collection)


@dataclasses.dataclass
class _ScopeDot:
    """fp4jax's dot_general with keys drawn in a linen module's own scope (setup-style
    modules, where no submodule can be created at call time)."""

    module: Any
    recipe: Recipe
    stream: str
    layer_stream: str

    def _draw(self, needed: bool, stream: str) -> jax.Array | None:
        m = self.module
        if not needed:
            return None
        if m.has_rng(stream):
            return m.make_rng(stream)
        if m.is_initializing() and m.has_rng("params"):
            return m.make_rng("params")
        raise ValueError(f"fp4jax recipe {self.recipe.name!r} needs the RNG stream "
                         f"{stream!r}: pass rngs={{{stream!r}: key}} to Module.apply")

    def ragged(self, lhs, rhs, group_sizes, precision=None, preferred_element_type=None):
        """``fp4jax.ragged_dot`` with keys drawn in the module's scope."""
        import fp4jax

        key = self._draw(self.recipe.needs_key, self.stream)
        rht_key = self._draw(self.recipe.needs_layer_key, self.layer_stream)
        return fp4jax.ragged_dot(lhs, rhs, group_sizes, recipe=self.recipe, key=key,
                                 rht_key=rht_key, precision=precision,
                                 preferred_element_type=preferred_element_type)

    def __call__(self, lhs, rhs, dims, precision=None, preferred_element_type=None,
                 out_sharding=None):
        key = self._draw(self.recipe.needs_key, self.stream)
        rht_key = self._draw(self.recipe.needs_layer_key, self.layer_stream)
        y = fnn.fp4_dot_general(lhs, rhs, dims, precision, preferred_element_type,
                                out_sharding, recipe=self.recipe, key=key, rht_key=rht_key)
        if self.module.is_initializing():
            return y
        return observe_product(self, "/".join(str(p) for p in self.module.path), lhs, rhs,
                               dims, y, recipe=self.recipe, key=key, rht_key=rht_key)


# ---------------------------------------------------------------------------
# linen
# ---------------------------------------------------------------------------

def _linen_interceptor(session: _Session) -> Callable[..., Any]:
    def interceptor(next_fun, args, kwargs, context):
        m = context.module
        if context.method_name == "setup" or isinstance(m, fnn.DotGeneral):
            frame = None
        else:
            try:
                path = "/".join(str(p) for p in m.path)
            except Exception:  # noqa: BLE001 (unbound: not part of this model's tree)
                path = None
            frame = None if path is None else _Frame(session, path, m, "linen")
        scans = [] if frame is None else _scans_around(m)
        with _push(frame), _scanning(scans):
            if frame is not None and session.record is not None:
                with jax.named_scope("fp4jax_module:" + frame.path.replace("/", "|")):
                    return next_fun(*args, **kwargs)
            return next_fun(*args, **kwargs)
    return interceptor


def _stacks_of(path: str) -> list[tuple[str, int]]:
    """The ``nn.scan``s running around the module at ``path``: ``(scan path, length)``."""
    return [(p, n) for p, n in _local.scans if path == p or path.startswith(p + "/")]


@contextlib.contextmanager
def _scanning(scans: list[tuple[str, int]]):
    """``scans`` (``_scans_around``) on the thread's stack of running scans meanwhile."""
    if not scans:
        yield
        return
    new = [sc for sc in reversed(scans) if sc not in _local.scans]
    _local.scans.extend(new)
    try:
        yield
    finally:
        del _local.scans[len(_local.scans) - len(new):]


def _scans_around(m: Any) -> list[tuple[str, int]]:
    """The ``nn.scan``s whose traced body ``m`` is the root of (its ``parent`` is the lifted
    scope, not a module), as ``(scan path, length)``, innermost first; ``[]`` elsewhere.

    flax offers no public accessor, and the scanned module's own call is not seen by
    ``nn.intercept_methods``: the calls being run are read off the Python stack, the
    frames of ``flax.linen.transforms``' lifted method (``wrapped_fn(self, *args)``,
    closing over the lifting ``transform``, ``flax.core.lift.scan``, and its keyword
    arguments). A flax whose code differs finds no scan here and rules match the stack's
    path only, as before (tests/nn/test_rules.py's scan tests notice)."""
    if isinstance(getattr(m, "parent", None), nn.Module) or not getattr(m, "path", ()):
        return []
    out = []
    f = inspect.currentframe()
    depth = 0
    while f is not None and depth < 200:
        code = f.f_code
        if (code.co_name == "wrapped_fn" and "flax" in code.co_filename
                and "transform" in code.co_freevars):
            loc = f.f_locals
            t, self_ = loc.get("transform"), loc.get("self")
            if (getattr(t, "__name__", None) == "scan"
                    and getattr(t, "__module__", "").startswith("flax.core")
                    and isinstance(self_, nn.Module)):
                kw = loc.get("trafo_kwargs")
                n = _scan_length(kw if isinstance(kw, dict) else {}, loc.get("args", ()))
                try:
                    path = "/".join(str(p) for p in self_.path)
                except Exception:  # noqa: BLE001 (unbound)
                    path = None
                if n and path:
                    out.append((path, n))
        f, depth = f.f_back, depth + 1
    return out


def _scan_length(kw: dict, args: Sequence[Any]) -> int | None:
    """The iterations of an ``nn.scan`` with keyword arguments ``kw`` called on ``args``:
    its ``length``, else the leading (``in_axes``) axis of its first scanned input."""
    if kw.get("length") is not None:
        return int(kw["length"])
    in_axes = kw.get("in_axes", 0)
    axes = in_axes if isinstance(in_axes, (tuple, list)) else (in_axes,) * len(args)
    for a, ax in zip(args, axes, strict=False):
        if isinstance(ax, int):
            leaves = jax.tree.leaves(a)
            if leaves and jnp.ndim(leaves[0]) > ax:
                return int(jnp.shape(leaves[0])[ax])
    return None


@contextlib.contextmanager
def _active(session: _Session):
    if any(x is session for x in _local.sessions):  # init -> init_with_output -> apply: once
        yield
        return
    _local.sessions.append(session)
    try:
        with _patched(), nn.intercept_methods(_linen_interceptor(session)), _push(None):
            yield
    finally:
        _local.sessions.pop()


def _quantize_linen(model: nn.Module, session: _Session) -> nn.Module:
    base = getattr(type(model), "_fp4jax_base", type(model))

    def wrap(name: str) -> Callable[..., Any]:
        method = getattr(base, name)

        def run(self, *args, **kwargs):
            with _active(session):
                return method(self, *args, **kwargs)
        run.__name__, run.__doc__ = name, method.__doc__
        return nn.nowrap(run)

    ns = {"_fp4jax_base": base, "_fp4jax_session": session,
          **{n: wrap(n) for n in ("init", "init_with_output", "apply")}}
    cls = type(base.__name__, (base,), ns)
    q = model.clone()
    object.__setattr__(q, "__class__", cls)
    return q


# ---------------------------------------------------------------------------
# NNX
# ---------------------------------------------------------------------------

_NNX_COVERED = (nnx.Linear, nnx.LinearGeneral, nnx.Einsum)


class _NnxWrapped(nnx.Module):
    """The ``dot_general`` (``Linear``, ``LinearGeneral``) or ``einsum_op`` (``Einsum``) of
    a covered NNX layer under rules: the layer's own function (``orig``) where its rule
    gives no recipe, else the product flattened to ``x (..., K) @ w (K, N)`` and run by the
    layer's ``fp4jax.nn.nnx.DotGeneral`` (``dot``); the kernel (the RHS) is the weight."""

    def __init__(self, orig: Callable[..., Any], dot: fnnx.DotGeneral | None, path: str,
                 session: _Session, op: str) -> None:
        self.orig = orig
        self.dot = dot
        self.path = path
        self.session = session
        self.op = op

    def _record(self, weight: Any, why: str | None = None) -> None:
        rec = self.session.record
        if rec is None:
            return
        if why is not None:
            rec.uncovered.append(f"{self.path}: {self.op} ({why})")
            return
        idx = self.session.resolved.get(self.path, self.session.rule_index(self.path))
        _record_layer(rec, self.path, self.op, weight, idx,
                      None if self.dot is None else self.dot.recipe)

    def _run(self, inputs, kernel, dims, precision, preferred_element_type, out_sharding):
        frame = _Frame(self.session, self.path, _DotHolder(self.dot), "nnx")
        return _seen(lambda: _quantized(frame, self.dot.recipe, inputs, kernel, dims, False,
                                        precision, preferred_element_type, out_sharding))


class _NnxEinsum(_NnxWrapped):
    def __call__(self, subscripts, inputs, kernel, *, precision=None,
                 preferred_element_type=None, out_sharding=None, **kw):
        form = einsum_dimension_numbers(subscripts, jnp.ndim(inputs), jnp.ndim(kernel))
        if form is None or kw or self.dot is None:
            if form is None or kw:
                self._record(kernel, f"einsum {subscripts!r} is not one dot_general")
            else:
                self._record(kernel)
            extra = {} if out_sharding is None else {"out_sharding": out_sharding}
            return _seen(lambda: self.orig(subscripts, inputs, kernel, precision=precision,
                                           preferred_element_type=preferred_element_type,
                                           **extra, **kw))
        self._record(kernel)
        dims, perm = form
        y = self._run(inputs, kernel, dims, precision, preferred_element_type, out_sharding)
        return jnp.transpose(y, perm)


class _NnxLinearDot(_NnxWrapped):
    def __call__(self, lhs, rhs, dimension_numbers, precision=None,
                 preferred_element_type=None, **kw):
        self._record(rhs)
        if self.dot is None:
            return _seen(lambda: self.orig(lhs, rhs, dimension_numbers, precision,
                                           preferred_element_type, **kw))
        return self._run(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                         kw.get("out_sharding"))


@dataclasses.dataclass
class _DotHolder:
    fp4jax_dot: Any


def _nnx_own_params(m: Any) -> list[Any]:
    return [v for v in vars(m).values() if isinstance(v, nnx.Param)]


def _stack_shape(m: Any) -> tuple[int, ...]:
    """Leading (``nnx.vmap``-stacked) axes of a covered layer's kernel."""
    k = getattr(m, "kernel", None)
    if k is None:
        return ()
    shape = jnp.shape(k[...])
    if isinstance(m, nnx.Linear):
        return tuple(shape[:-2])
    if isinstance(m, nnx.LinearGeneral):
        n = len(m.in_features) + len(m.out_features) + len(getattr(m, "batch_axis", {}))
        return tuple(shape[:len(shape) - n])
    return ()


def _nnx_stacks(path: Sequence[Any], node: Any, modules: dict[tuple, Any]
                ) -> list[tuple[str, int]]:
    """The stack of a covered NNX layer stacked by ``nnx.vmap`` (one leading axis of ``L``
    layers on its kernel): ``[(stack path, L)]``, the stack being the outermost module on
    its path whose every parameter has that leading axis (the vmapped block), or ``[]``."""
    lead = _stack_shape(node)
    if len(lead) != 1:
        return []
    path = tuple(path)
    for k in range(1, len(path)):
        m = modules.get(path[:k])
        if m is None:
            continue
        shapes = [jnp.shape(v[...]) for _, v in nnx.iter_graph(m) if isinstance(v, nnx.Param)]
        if shapes and all(sh[:1] == lead for sh in shapes):
            return [("/".join(str(p) for p in path[:k]), lead[0])]
    return [("/".join(str(p) for p in path), lead[0])]


def _make_nnx_dot(recipe: Recipe, path: str, session: _Session, keys: dict[str, Any],
                  lead: tuple[int, ...]) -> fnnx.DotGeneral:
    def per_layer(k: jax.Array) -> jax.Array:
        k = layer_key(k, path)
        n = int(np.prod(lead)) if lead else 0
        return jax.random.split(k, n).reshape(*lead) if lead else k

    rngs = None
    if recipe.needs_key:
        rngs = nnx.Rngs(**{session.rng_collection: per_layer(keys["key"])})
    rht = per_layer(keys["layer"]) if recipe.needs_layer_key else None
    return fnnx.DotGeneral(recipe, rngs=rngs, rng_stream=session.rng_collection,
                           rht_key=rht, layer_path=path)


def _quantize_nnx(model: nnx.Module, session: _Session, rngs: Any) -> nnx.Module:
    nodes = [(path, node) for path, node in nnx.iter_graph(model)
             if isinstance(node, nnx.Module)]
    done = [p for p, n in nodes if isinstance(n, _NnxWrapped) or "_fp4jax_base" in
            vars(type(n))]
    if done:
        raise ValueError(
            "fp4jax.nn.quantize_model: this NNX model was already quantized (in place) by "
            f"quantize_model (e.g. at {'/'.join(str(p) for p in done[0]) or '/'!r}); new "
            "rules would not replace the old ones: quantize a fresh model, or keep an "
            "nnx.clone of the original and quantize that")
    # every check (rules, stacks, RNG streams) before the first change to the model: a
    # refused call leaves the model (and rngs) as they were
    modules = {tuple(path): node for path, node in nodes}
    plan = []
    hooked: list[tuple[str, Any]] = []  # parameter-free modules to intercept
    for path, node in nodes:
        name = "/".join(str(p) for p in path)
        if isinstance(node, fnnx.DotGeneral):
            continue
        covered = isinstance(node, _NNX_COVERED)
        if not covered and not _nnx_own_params(node):
            # a parameter-free module (a block holding layers, an attention): its own
            # products (attention scores) run under the hooks in its own frame, so
            # report counts them as activation products rather than unseen ones
            if _nnx_methods(type(node)):
                hooked.append((name, node))
            continue
        idx = session.rule_index(name, _nnx_stacks(path, node, modules) if covered else ())
        session.resolved[name] = idx
        recipe = session.rules[idx].recipe if idx is not None else None
        if isinstance(getattr(node, "dot_general", None), fnnx.DotGeneral):
            continue  # already an fp4jax layer (quantized before: refused above)
        plan.append((name, node, covered, recipe))
    streams: dict[str, Any] = {}
    needs = [(r.needs_key, r.needs_layer_key) for *_, r in plan if r is not None]
    for needed, stream, slot in ((any(n for n, _ in needs), session.rng_collection, "key"),
                                 (any(n for _, n in needs), session.layer_rng_collection,
                                  "layer")):
        if not needed:
            continue
        if rngs is None:
            raise ValueError(
                "fp4jax.nn.quantize_model: a rule's recipe draws random bits (stochastic "
                f"rounding or per-layer RHT signs): pass rngs=nnx.Rngs({stream}=seed) for "
                "an NNX model (the model was left unchanged)")
        try:  # the stream itself (indexing draws nothing); drawn once all are found
            streams[slot] = rngs[stream]
        except (KeyError, AttributeError, TypeError):
            streams[slot] = None
        if not callable(streams[slot]):
            raise ValueError(f"fp4jax.nn.quantize_model: rngs has no stream {stream!r}: "
                             f"pass rngs=nnx.Rngs(..., {stream}=seed) (the model was left "
                             "unchanged)")
    keys = {slot: draw() for slot, draw in streams.items()}
    dots = [None if recipe is None
            else _make_nnx_dot(recipe, name, session, keys, _stack_shape(node))
            for name, node, _, recipe in plan]
    for name, node in hooked:
        _intercept_nnx(node, name, session)
    for (name, node, covered, _), dot in zip(plan, dots, strict=True):
        if isinstance(node, nnx.Einsum):
            node.einsum_op = _as_data(_NnxEinsum(node.einsum_op, dot, name, session, "einsum"))
        elif covered:
            orig = node.dot_general
            if getattr(node, "dot_general_cls", None) is not None:
                orig = node.dot_general_cls()
                node.dot_general_cls = None
            node.dot_general = _as_data(_NnxLinearDot(orig or _ORIG_DOT_GENERAL, dot, name,
                                                      session, "dot_general"))
        else:
            if dot is not None:
                node.fp4jax_dot = _as_data(dot)
            _intercept_nnx(node, name, session)
    return model


def _as_data(m: nnx.Module) -> Any:
    """``nnx.data(m)``: a module assigned to an attribute that held a static value (a
    function) must say it is data now (flax >= 0.12; older versions need nothing)."""
    data = getattr(nnx, "data", None)
    return m if data is None else data(m)


_nnx_classes: dict[type, type] = {}


def _nnx_methods(base: type) -> list[str]:
    """The methods of an NNX module class that run under the hooks, as linen's
    ``nn.intercept_methods`` runs every method: ``__call__`` and each public method its
    classes define (``nnx.Embed.attend``), not those of ``nnx.Module`` itself."""
    skip = set(nnx.Module.__mro__)
    names: list[str] = []
    for c in base.__mro__:
        if c in skip:
            continue
        for n, v in vars(c).items():
            if ((n == "__call__" or not n.startswith("_")) and inspect.isfunction(v)
                    and n not in names):
                names.append(n)
    return names


def _nnx_hooked(orig: Callable[..., Any]) -> Callable[..., Any]:
    def method(self, *args, **kwargs):
        path = self._fp4jax_path
        frame = _Frame(self._fp4jax_session, path, self, "nnx")
        with _patched(), _push(frame), \
                jax.named_scope("fp4jax_module:" + path.replace("/", "|")):
            return orig(self, *args, **kwargs)
    method.__name__, method.__doc__ = orig.__name__, orig.__doc__
    return method


def _intercept_nnx(node: Any, path: str, session: _Session) -> None:
    """Gives a non-covered NNX module with parameters a subclass whose ``__call__`` and
    other public methods (``_nnx_methods``) run under the hooks with the module on the
    frame stack (and its path as a named scope, for ``report``). ``node`` is not yet
    quantized (``_quantize_nnx`` refuses a model that is)."""
    base = type(node)
    cls = _nnx_classes.get(base)
    if cls is None:
        methods = {n: _nnx_hooked(getattr(base, n)) for n in _nnx_methods(base)}
        cls = type(base.__name__, (base,), {"_fp4jax_base": base, **methods})
        _nnx_classes[base] = cls
    object.__setattr__(node, "__class__", cls)
    object.__setattr__(node, "_fp4jax_session", session)
    object.__setattr__(node, "_fp4jax_path", path)


# ---------------------------------------------------------------------------
# the public functions
# ---------------------------------------------------------------------------

def quantize_model(model: Any, rules: Any, *, rngs: Any = None,
                   rng_collection: str = fnn.DEFAULT_RNG_STREAM,
                   layer_rng_collection: str = fnn.DEFAULT_LAYER_RNG_STREAM) -> Any:
    """Applies precision rules to an unedited Flax model (see the module docstring).

    Args:
      model: a ``flax.linen.Module`` (unbound) or an ``nnx.Module``.
      rules: a list of :class:`~fp4jax.nn.Rule` (or ``(pattern, recipe)`` pairs); the
        first rule whose pattern ``re.fullmatch``-es a layer's path decides its recipe
        (``None``: the layer's own dot_general); unmatched layers run unchanged.
      rngs: NNX only: ``nnx.Rngs`` with the streams ``rng_collection`` (stochastic
        rounding) and ``layer_rng_collection`` (per-layer RHT signs), each drawn once,
        needed when a matched recipe uses them.
      rng_collection: the RNG stream of stochastic-rounding keys (linen: pass
        ``rngs={rng_collection: key}`` to ``apply``).
      layer_rng_collection: the stream of per-layer constant RHT keys.

    Returns:
      linen: a copy of ``model`` (a subclass of its class with the same fields) whose
      ``init``/``init_with_output``/``apply`` run the rules; its parameter tree is the
      model's. NNX: ``model`` itself, its matched layers quantized in place (parameters
      untouched; RNG streams and RHT keys added as state); ``nnx.clone`` first to keep
      the original.

    Raises:
      ValueError: ``model`` is not a Flax module, a bad rule (naming the entry), a bad
        stream name, or (NNX) a recipe needing keys without ``rngs`` (or a stream it lacks).
        A refused call leaves ``model`` and ``rngs`` as they were: every check runs, and
        every key is drawn, before the first change to the model.
    """
    rules_t = as_rules(rules)
    for name, v in (("rng_collection", rng_collection),
                    ("layer_rng_collection", layer_rng_collection)):
        if not isinstance(v, str) or not v:
            raise ValueError(f"quantize_model: {name} must be a non-empty stream name, "
                             f"got {v!r}")
    session = _Session(rules_t, rng_collection, layer_rng_collection)
    if isinstance(model, nn.Module):
        if rngs is not None:
            raise ValueError("quantize_model: rngs is for NNX models; a linen model draws "
                             f"its keys from apply(..., rngs={{{rng_collection!r}: key}})")
        if model.scope is not None:
            raise ValueError("quantize_model: model must be an unbound linen Module "
                             "(not one bound with .bind or inside another's method)")
        return _quantize_linen(model, session)
    if isinstance(model, nnx.Module):
        return _quantize_nnx(model, session, rngs)
    raise ValueError(f"quantize_model: model must be a flax.linen.Module or an nnx.Module, "
                     f"got {type(model).__name__}")


def _session_of(model: Any) -> _Session | None:
    s = getattr(type(model), "_fp4jax_session", None)
    if s is not None:
        return s
    if isinstance(model, nnx.Module):
        for _, node in nnx.iter_graph(model):
            s = getattr(node, "_fp4jax_session", None) or getattr(node, "session", None)
            if isinstance(s, _Session):
                return s
    return None


@dataclasses.dataclass
class Report:
    """What ``report`` found; ``str()`` prints it as a table.

    Attributes:
      layers: ``{path: {"op", "weight" (shape), "weights" (every weight shape the layer's
        products used), "rule" (index or None), "recipe" (name or None: high precision),
        "calls"}}``, every linear layer the hooks saw.
      unused_rules: the rules no layer took (matched nothing, or always after an earlier
        rule that matched), as ``(index, Rule)``; attention rules are not listed (a model
        with attention sites applies them, e.g. ``fp4jax.models.llama``).
      activation_products: products of two activations (left alone by design).
      uncovered: products that could not be covered: ``"path: op shapes (why)"``; those no
        hook saw (``x @ w``, a jitted helper, ``lax.dot_general`` imported by name) are
        listed from the traced program with the module path they ran in.
    """

    layers: dict[str, dict[str, Any]]
    unused_rules: list[tuple[int, Rule]]
    activation_products: list[str]
    uncovered: list[str]

    def scan_axes(self, path: Sequence[str], shape: Sequence[int]) -> int:
        """How many leading axes of the kernel at module ``path`` (a tuple of names, a
        leading ``"params"`` allowed) with
        ``shape`` stack scanned layers: those before the weight shape the layer's product
        used (``nn.scan``/``nnx.vmap`` stacks), 0 for a layer the report did not see. For
        ``fp4jax.diagnostics.gradient_noise(..., scan_axes=report.scan_axes)``: a 3-D
        ``DenseGeneral`` kernel is one layer, a scanned stack of 2-D kernels is several."""
        path = tuple(str(p) for p in path)
        d = self.layers.get("/".join(path))
        if d is None and path[:1] == ("params",):  # a variables tree's path
            d = self.layers.get("/".join(path[1:]))
        if d is None:
            return 0
        shape = tuple(shape)
        weights = d["weights"]  # _record_layer: every entry lists them, as tuples
        if shape in weights:  # one of the layer's own weights, whole (a 3-D DenseGeneral)
            return 0
        for n in range(1, len(shape)):  # the fewest leading axes that leave one of them
            if shape[n:] in weights:
                return n
        return 0

    def __str__(self) -> str:
        rows = [("layer", "recipe", "rule", "weight", "op")]
        for path, d in self.layers.items():
            rows.append((path or "/", d["recipe"] or "high precision",
                         "-" if d["rule"] is None else str(d["rule"]), str(d["weight"]),
                         d["op"] + (f" x{d['calls']}" if d["calls"] > 1 else "")))
        w = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = ["  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * x for x in w))
        n_q = sum(d["recipe"] is not None for d in self.layers.values())
        lines.append(f"{n_q} of {len(self.layers)} linear layers quantized")
        if self.unused_rules:
            lines.append("rules that matched no layer: " + ", ".join(
                f"[{i}] {r.pattern!r} -> {r.spec}" for i, r in self.unused_rules))
        if self.uncovered:
            lines.append("products not covered:")
            lines += [f"  {u}" for u in self.uncovered]
        if self.activation_products:
            lines.append(f"{len(self.activation_products)} activation x activation "
                         "products left alone")
        return "\n".join(lines)


def report(qmodel: Any, *example_args: Any, rngs: Any = None, method: Any = None,
           **kwargs: Any) -> Report:
    """Traces ``qmodel`` (from ``quantize_model``) on example inputs (shapes only, nothing
    is computed) and reports every linear layer's path and recipe, the rules that matched
    nothing, and the products it could not cover.

    Args:
      qmodel: a model returned by ``quantize_model`` (linen or NNX).
      *example_args, **kwargs: the model's call inputs (linen: ``init``'s after the keys).
      rngs: linen: the RNG streams for ``init`` (default ``{"params": key(0)}`` plus the
        quantization streams); NNX: unused.
      method: linen: the method to trace (as ``Module.init``'s ``method``).

    Returns:
      a :class:`Report`.
    """
    session = _session_of(qmodel)
    if session is None:
        raise ValueError("report: qmodel must be a model returned by "
                         "fp4jax.nn.quantize_model")
    if isinstance(qmodel, nn.Module):
        k = jax.random.key(0)
        streams = {"params": k, session.rng_collection: k,
                   session.layer_rng_collection: k, **(rngs or {})}
        kw = dict(kwargs) if method is None else {**kwargs, "method": method}
        # the variables' shapes (before recording), then ``apply`` traced from them, so
        # that report knows which of the program's inputs are parameters
        variables = jax.eval_shape(lambda: qmodel.init(streams, *example_args, **kw))
        params = variables.get("params", {})
        rest = {c: v for c, v in variables.items() if c != "params"}

        def fn(params, rest):
            return qmodel.apply({"params": params, **rest}, *example_args, rngs=streams,
                                mutable=True, **kw)

        def fn_init():  # when apply cannot run as init did (e.g. a stream not split)
            return qmodel.init(streams, *example_args, **kw)
        attempts = [(fn, (params, rest)), (fn_init, ())]
    else:
        # traced on a copy of the graph: the model's RNG counters do not advance
        graphdef, params, rest = nnx.split(qmodel, nnx.Param, ...)

        def fn_nnx(params, rest):
            with _patched(), _push(None):
                return nnx.merge(graphdef, params, rest)(*example_args, **kwargs)
        attempts = [(fn_nnx, (params, rest))]
    for i, (fn, args) in enumerate(attempts):
        rec = _Record()
        session.record = rec
        try:
            jaxpr = jax.make_jaxpr(fn)(*args)
            break
        except Exception:  # noqa: BLE001 (apply failed: the init trace, as before)
            if i == len(attempts) - 1:
                raise
        finally:
            session.record = None
    # which program inputs are parameters (none known for the init trace)
    n_params = len(jax.tree.leaves(args[0])) if args else None
    is_param = (None if n_params is None
                else [j < n_params for j in range(len(jaxpr.jaxpr.invars))])
    used = {d["rule"] for d in rec.layers.values() if d["rule"] is not None}
    unused = [(i, r) for i, r in enumerate(session.rules)
              if i not in used and not r.attention]  # attention rules: the model applies them
    unseen, products = _unseen_products(jaxpr, is_param)
    return Report(rec.layers, unused, rec.activation + products, rec.uncovered + unseen)


# the provenance of a traced value (``_unseen_products``): computed from nothing but
# literals and constants, from parameters only (a weight, maybe cast, transposed, scaled),
# or from anything else (an activation)
_CONST, _PARAM, _ACT = 0, 1, 2


def _unseen_products(closed: Any, param_invars: Sequence[bool] | None = None
                     ) -> tuple[list[str], list[str]]:
    """The ``dot_general`` equations of the traced program outside every product a hook
    saw, split by their operands' provenance: ``(uncovered, activation)``. A product with
    an operand computed from the parameters alone (``param_invars[i]``: whether the
    program's ``i``-th input is a parameter; None: every product counts as uncovered) is
    ``"module path: dot_general shapes (not seen by a hook: ...)"``; one of two activations
    (attention scores inside a library's attention function) is ``"path: dot_general
    shapes"``, left alone by design."""
    uncovered: list[str] = []
    activation: list[str] = []

    def join(states: Sequence[int]) -> int:
        return max(states, default=_CONST)

    def walk(jaxpr: Any, outer: str, states: Sequence[int]) -> list[int]:
        env = dict(zip(jaxpr.invars, states, strict=False))

        def st(v: Any) -> int:
            if isinstance(v, jex_core.Literal):
                return _CONST
            return env.get(v, _CONST)  # literals and closed-over constants

        for eqn in jaxpr.eqns:
            ins = [st(v) for v in eqn.invars]
            # a sub-jaxpr's name stacks are relative to the equation that holds it
            stack = outer + "/" + str(getattr(eqn.source_info, "name_stack", ""))
            subs = sub_jaxprs(eqn)
            if eqn.primitive.name == "dot_general":
                mods = [q.split(":", 1)[1].replace("|", "/") for q in stack.split("/")
                        if q.startswith("fp4jax_module:")]
                shapes = " x ".join(str(tuple(v.aval.shape)) for v in eqn.invars)
                where = (mods[-1] if mods else "") or "/"
                act = [q for q in stack.split("/") if q.startswith(_ACT_SCOPE + ":")]
                if act:  # as the hook described it, where it runs now
                    activation.append(f"{where}: {act[-1].split(':', 1)[1]}")
                elif _SEEN_SCOPE not in stack:
                    if param_invars is None or _PARAM in ins:
                        uncovered.append(f"{where}: dot_general {shapes} (not seen by a "
                                         "hook: an '@', a jitted helper or "
                                         "lax.dot_general imported by name)")
                    else:
                        activation.append(f"{where}: dot_general {shapes}")
                outs = [_ACT if any(ins) else _CONST] * len(eqn.outvars)
            elif subs:
                outs = None
                for sub in subs:
                    n = len(sub.invars)
                    # pjit, remat, custom_jvp/vjp and scan pass their inputs in order;
                    # cond (after its index) and while (after their consts): the tail
                    sub_in = ins[-n:] if n <= len(ins) else [join(ins)] * n
                    res = walk(sub, stack, sub_in)
                    if len(res) == len(eqn.outvars):  # cond's branches: joined
                        outs = res if outs is None else [max(a, b) for a, b in
                                                         zip(outs, res, strict=True)]
                if outs is None:
                    outs = [join(ins)] * len(eqn.outvars)
            else:
                outs = [join(ins)] * len(eqn.outvars)
            for v, o in zip(eqn.outvars, outs, strict=True):
                env[v] = o
        return [st(v) for v in jaxpr.outvars]

    n = len(closed.jaxpr.invars)
    states = ([_PARAM if p else _ACT for p in param_invars] if param_invars is not None
              else [_ACT] * n)
    walk(closed.jaxpr, "", states)
    return uncovered, activation
