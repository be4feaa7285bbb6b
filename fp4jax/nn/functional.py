"""Precision rules for plain JAX functions (Equinox models, pure functions), by
``jax.named_scope`` path.

``quantize_function(fn, rules)`` returns a function with ``fn``'s signature plus the keyword
arguments ``fp4_key`` (stochastic rounding) and ``fp4_layer_key`` (per-layer RHT signs) that
computes ``fn`` with every matched linear product run by ``fp4jax.dot_general``::

    def mlp(params, x):
        with jax.named_scope("block_0/up"):
            h = jax.nn.relu(x @ params["w_up"])
        with jax.named_scope("block_0/down"):
            return h @ params["w_down"]

    qmlp = fp4jax.nn.quantize_function(mlp, [fp4jax.nn.Rule(r".*/down", None),
                                             fp4jax.nn.Rule(r".*", "nvfp4")])
    loss = lambda p, x, k: qmlp(p, x, fp4_key=k).sum()
    g = jax.grad(loss)(params, x, jax.random.key(0))

**How.** ``fn`` is traced to a jaxpr (``jax.make_jaxpr``, on the call's own arguments, so it
runs under ``jit``, ``grad`` and ``vmap`` of the returned function) and the jaxpr is
evaluated again with each ``dot_general`` equation that a rule matches replaced by
``fp4jax.dot_general``. Every way of writing a product reaches it (``x @ w``,
``jnp.einsum``, ``jnp.dot``, ``lax.dot_general`` imported by name, ``eqx.nn.Linear``'s
``weight @ x``), and no global function is patched.

**Paths.** A product's path is the ``/``-joined ``jax.named_scope`` names around it (scopes
of the function's own nested ``jit`` and ``scan`` calls included; the scope ``jnp.einsum``
names after its subscripts and the names of transformations, ``vmap()``, are dropped); the
rules are matched with ``re.fullmatch``, the first match wins (``fp4jax.nn.Rule``: ``None``
keeps a layer in high precision), and a product no rule matches runs unchanged. Attention
rules do not apply here.

With ``paths="params"`` the rules match the weight's own path in the parameter pytree
instead (``param_path``: ``layers/0/weight``), for models that open no scopes (Equinox).

**Weights.** A product is a linear layer when exactly one operand is a parameter: a leaf of
the arguments named by ``params_argnums`` (default ``0``) or ``params_argnames``, possibly
reshaped, transposed, cast, broadcast, sliced (a block of a scanned stack) or split (a fused
weight's parts). A value computed from a parameter by any other op (``w * mask``) is not a
weight: its products run as written and ``function_report`` lists them as not covered; so
does a weight the function closes over instead of taking it as an argument (it is a
constant to the trace: the report's unused rules show it). That operand takes the recipe's
weight role (the RHS of fprop, 2D scaling), as in ``quantize_model``; products of two
activations or of two parameters are left alone.

**Keys.** The product at path ``p`` draws its stochastic-rounding key as
``fold_in(layer_key(fp4_key, p), n)`` with ``n`` its call count at that path within the call,
and inside a ``lax.scan`` also the iteration (``fold_in(..., i)``), so every block of a
scanned stack and every step (pass ``fold_in(seed_key, step)``) rounds independently; the
per-layer RHT signs (``hadamard_signs="layer"``) use ``layer_key(fp4_layer_key, p)``.

**Not covered** (left unchanged; ``function_report`` lists them): products inside
``custom_jvp``/``custom_vjp`` functions, ``cond``/``switch`` branches, ``while`` loops,
``shard_map``/``pmap`` bodies and any other equation holding a jaxpr other than ``jit``,
``checkpoint`` and ``scan``.
``jax.checkpoint`` (remat) is kept around the rewritten body with its policy.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax.rules import (
    Rule,
    as_rules,
    layer_key,
    match_rule,
    sub_jaxprs,
    weight_dot_general,
)

__all__ = ["FunctionReport", "function_report", "param_path", "quantize_function"]

# unary equations through which an operand stays "the parameter" (its layout or dtype only)
_LAYOUT = frozenset({"reshape", "transpose", "convert_element_type", "squeeze",
                     "expand_dims", "broadcast_in_dim", "copy", "reduce_precision",
                     "sharding_constraint", "device_put", "optimization_barrier"})
# equations whose outputs are pieces of their first operand (a block of a stacked weight,
# the parts of a fused weight)
_PIECES = frozenset({"slice", "dynamic_slice", "gather", "index_in_dim", "split", "rev"})
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call"})
_REMAT = frozenset({"checkpoint", "remat", "remat2"})


# the names JAX's transformations add to a name stack (``vmap()``, ``jvp(f)``, ...)
_TRANSFORM = re.compile(r"(vmap|pmap|jvp|vjp|transpose|jit|pjit|remat|checkpoint|"
                        r"shard_map|xmap|custom_jvp_call|custom_vjp_call)\(.*\)")


def _scope_path(outer: str, eqn: Any) -> str:
    """``outer`` joined with ``eqn``'s named scopes, without the scope ``jnp.einsum`` opens
    for its subscripts (a component holding ``->``) and the names transformations add
    (``vmap()``, ``jvp(...)``)."""
    inner = str(getattr(eqn.source_info, "name_stack", "") or "")
    parts = [p for p in (outer.split("/") + inner.split("/"))
             if p and "->" not in p and not _TRANSFORM.fullmatch(p)]
    return "/".join(parts)


@dataclasses.dataclass
class FunctionReport:
    """What ``function_report`` found.

    Attributes:
      layers: ``{path: {"weight": shape, "rule": index or None, "recipe": name or None,
        "calls": n}}``: every product with exactly one parameter operand.
      unused_rules: ``(index, Rule)`` of the linear rules no layer took.
      activation_products: ``"path: shapes"`` of products of two activations (left alone).
      uncovered: ``"path: shapes (why)"`` of products that were not rewritten although a
        rule would have quantized them, or that have two parameter operands.
    """

    layers: dict[str, dict[str, Any]]
    unused_rules: list[tuple[int, Rule]]
    activation_products: list[str]
    uncovered: list[str]

    def __str__(self) -> str:
        lines = [f"{p or '/'}: {d['recipe'] or 'high precision'} (rule "
                 f"{'-' if d['rule'] is None else d['rule']}, weight {d['weight']}"
                 f"{', x' + str(d['calls']) if d['calls'] > 1 else ''})"
                 for p, d in self.layers.items()]
        n_q = sum(d["recipe"] is not None for d in self.layers.values())
        lines.append(f"{n_q} of {len(self.layers)} linear layers quantized")
        if self.unused_rules:
            lines.append("rules that matched no layer: " + ", ".join(
                f"[{i}] {r.pattern!r} -> {r.spec}" for i, r in self.unused_rules))
        lines += [f"not covered: {u}" for u in self.uncovered]
        if self.activation_products:
            lines.append(f"{len(self.activation_products)} activation x activation products "
                         "left alone")
        return "\n".join(lines)


@dataclasses.dataclass
class _Ctx:
    """One call of a quantized function: rules, keys, counters, and what it saw."""

    rules: tuple[Rule, ...]
    key: Any
    layer_key: Any
    by: str = "scope"  # what a layer's path is: "scope" or "params"
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    record: FunctionReport | None = None
    index: tuple[Any, ...] = ()  # the scan iterations around the current equation

    def at(self, i: Any) -> _Ctx:
        return dataclasses.replace(self, index=self.index + (i,))


def _product(ctx: _Ctx, eqn: Any, path: str, invals: list[Any], roles: list[str | None],
             derived: Sequence[str | None] = (None, None)) -> Any:
    """One ``dot_general`` equation: through fp4jax when exactly one operand is a
    parameter and a linear rule gives a recipe, else as written."""
    lhs, rhs = invals
    p = eqn.params

    def orig():
        return eqn.primitive.bind(lhs, rhs, **p)

    rec = ctx.record
    shapes = " x ".join(str(tuple(jnp.shape(v))) for v in invals)
    if ctx.by == "params" and sum(r is not None for r in roles) == 1:
        path = roles[0] if roles[0] is not None else roles[1]
    roles = [r is not None for r in roles]
    if not any(roles) or all(roles):
        if rec is not None:
            if all(roles):
                rec.uncovered.append(f"{path or '/'}: {shapes} (both operands are parameters)")
            elif any(d is not None for d in derived) and _quantizing(ctx, path):
                d = next(d for d in derived if d is not None)
                rec.uncovered.append(f"{path or '/'}: {shapes} (an operand is computed from "
                                     f"the parameter {d}: not a weight, left as written)")
            else:
                rec.activation_products.append(f"{path or '/'}: {shapes}")
        return orig()
    idx = match_rule(ctx.rules, path)
    recipe = ctx.rules[idx].recipe if idx is not None else None
    weight = rhs if roles[1] else lhs
    if rec is not None:
        d = rec.layers.setdefault(path, {"weight": tuple(jnp.shape(weight)), "rule": idx,
                                         "recipe": None if recipe is None else recipe.name,
                                         "calls": 0})
        d["calls"] += 1
    if recipe is None:
        return orig()
    n = ctx.counts.get(path, 0)
    ctx.counts[path] = n + 1
    key = rht_key = None
    if recipe.needs_key:
        if ctx.key is None:
            raise ValueError(f"quantize_function: the layer at {path!r} runs recipe "
                             f"{recipe.name!r}, which rounds stochastically: pass "
                             "fp4_key=jax.random.fold_in(seed_key, step)")
        key = jax.random.fold_in(layer_key(ctx.key, path), n)
        for i in ctx.index:
            key = jax.random.fold_in(key, i)
    if recipe.needs_layer_key:
        if ctx.layer_key is None:
            raise ValueError(f"quantize_function: the layer at {path!r} runs recipe "
                             f"{recipe.name!r}, whose RHT signs are drawn per layer: pass "
                             "fp4_layer_key=<one fixed key per run>")
        rht_key = layer_key(ctx.layer_key, path)

    def dot(x, w, dn, precision, preferred_element_type, out_sharding):
        import fp4jax

        return fp4jax.dot_general(x, w, dn, precision, preferred_element_type,
                                  recipe=recipe, key=key, rht_key=rht_key)

    dt = p.get("preferred_element_type")
    y = weight_dot_general(dot, lhs, rhs, p["dimension_numbers"], roles[0], p.get("precision"),
                           dt)
    want = eqn.outvars[0].aval.dtype
    return y if y.dtype == want else y.astype(want)


def _quantizing(ctx: _Ctx, path: str) -> bool:
    """Whether a rule would give the product at ``path`` a recipe."""
    i = match_rule(ctx.rules, path)
    return i is not None and ctx.rules[i].recipe is not None


def _is_literal(v: Any) -> bool:
    return type(v).__name__ == "Literal"


def _closed(eqn: Any) -> Any:
    """The closed jaxpr of a call equation (``pjit``: ``jaxpr``; ``closed_call``:
    ``call_jaxpr``)."""
    return eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))


def _has_product(jaxpr: Any) -> bool:
    return any(e.primitive.name == "dot_general" or any(_has_product(j) for j in
                                                        sub_jaxprs(e))
               for e in jaxpr.eqns)


def _note_opaque(ctx: _Ctx, eqn: Any, path: str) -> None:
    """Products inside an equation that is not rewritten (custom rules, control flow)."""
    if ctx.record is None:
        return

    def walk(j: Any, outer: str) -> None:
        for e in j.eqns:
            p = _scope_path(outer, e)
            if e.primitive.name == "dot_general":
                shapes = " x ".join(str(tuple(v.aval.shape)) for v in e.invars)
                if _quantizing(ctx, p):
                    ctx.record.uncovered.append(
                        f"{p or '/'}: {shapes} (inside {eqn.primitive.name}: not rewritten)")
            for sub in sub_jaxprs(e):
                walk(sub, p)

    for sub in sub_jaxprs(eqn):
        walk(sub, path)


def _eval(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any],
          is_param: Sequence[str | None], ctx: _Ctx, outer: str) -> list[Any]:
    """Evaluates ``jaxpr`` like ``jax.core.eval_jaxpr``, rewriting the matched products;
    ``is_param`` gives the parameter path of each invar that is a parameter (else None)."""
    env: dict[Any, Any] = {}
    param: dict[Any, str] = {}
    derived: dict[Any, str] = {}  # var -> "param path (op)": computed from parameters only
    act: set[Any] = set()  # vars computed from an activation (a non-parameter input)

    def read(v: Any) -> Any:
        return v.val if _is_literal(v) else env[v]

    def pr(v: Any) -> str | None:
        return None if _is_literal(v) else param.get(v)

    for v, c in zip(jaxpr.constvars, consts, strict=True):
        env[v] = c
    for v, a, isp in zip(jaxpr.invars, args, is_param, strict=True):
        env[v] = a
        if isp is not None:
            param[v] = isp
        else:
            act.add(v)
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        invals = [read(v) for v in eqn.invars]
        roles = [pr(v) for v in eqn.invars]
        path = _scope_path(outer, eqn)
        from_act = any(not _is_literal(v) and v in act for v in eqn.invars)
        if from_act:
            act.update(eqn.outvars)
        if name == "dot_general":
            outs = [_product(ctx, eqn, path, invals, roles,
                             [None if _is_literal(v) else derived.get(v) for v in eqn.invars])]
        elif name in _CALLS and _has_product(_closed(eqn).jaxpr):
            cj = _closed(eqn)
            outs = _eval(cj.jaxpr, cj.consts, invals, roles, ctx, path)
        elif name in _REMAT and _has_product(eqn.params["jaxpr"]):
            inner = eqn.params["jaxpr"]
            body = functools.partial(_eval, inner, [], is_param=roles, ctx=ctx, outer=path)
            outs = jax.checkpoint(lambda *a: body(list(a)),  # noqa: B023 (called at once)
                                  prevent_cse=eqn.params.get("prevent_cse", True),
                                  policy=eqn.params.get("policy"))(*invals)
        elif name == "scan" and _has_product(eqn.params["jaxpr"].jaxpr):
            outs = _scan(eqn, invals, roles, ctx, path)
        else:
            if sub_jaxprs(eqn):  # custom rules, control flow, shard_map, pmap, ...
                _note_opaque(ctx, eqn, path)
            outs = _bind(eqn, invals)
            if not eqn.primitive.multiple_results:
                outs = [outs]
            first = roles[0] if roles else None
            if first is not None and (name in _LAYOUT or (
                    name in _PIECES and all(r is None for r in roles[1:]))):
                param.update({o: first for o in eqn.outvars})
                act.difference_update(eqn.outvars)  # a weight's piece (at an index)
            elif not from_act:  # computed from parameters by another op: not a weight
                src = next((r for r in roles if r is not None), None)
                src = src or next((derived[v] for v in eqn.invars
                                   if not _is_literal(v) and v in derived), None)
                if src is not None:
                    derived.update({o: src if "(" in src else f"{src} ({name})"
                                    for o in eqn.outvars})
        for v, o in zip(eqn.outvars, outs, strict=True):
            env[v] = o
    return [read(v) for v in jaxpr.outvars]


def _bind(eqn: Any, invals: list[Any]) -> Any:
    """``eqn``'s primitive applied to ``invals``, as ``jax.core.eval_jaxpr`` does (JAX
    versions whose ``get_bind_params`` return ``(subfuns, params)`` or ``params``)."""
    bp = eqn.primitive.get_bind_params(eqn.params)
    subfuns, bp = bp if isinstance(bp, tuple) else ((), bp)
    ctx = getattr(getattr(eqn, "ctx", None), "manager", None)
    if ctx is None:
        return eqn.primitive.bind(*subfuns, *invals, **bp)
    with ctx:
        return eqn.primitive.bind(*subfuns, *invals, **bp)


def _scan_counts(params: dict[str, Any]) -> tuple[int, int]:
    """How many of a ``scan`` equation's operands are constants and carries, ``(n_consts,
    n_carry)`` (the rest are the scanned inputs): the ``num_consts``/``num_carry``
    parameters of JAX <= 0.11, or the groups of the ``ft_in`` flat tree (constants, carry,
    xs) that JAX 0.12's scan equation carries instead."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    ft = params.get("ft_in")
    if ft is None:
        raise NotImplementedError("quantize_function: this JAX's scan equation has neither "
                                  "num_consts/num_carry nor ft_in parameters: parameters "
                                  f"{sorted(params)}")
    consts, carry, _ = ft.unpack()
    return len(list(consts.vals)), len(list(carry.vals))


def _scan(eqn: Any, invals: list[Any], roles: list[bool], ctx: _Ctx, path: str) -> list[Any]:
    """A ``lax.scan`` equation rebuilt around the rewritten body; the iteration index is
    scanned along, and folded into every stochastic-rounding key of the body."""
    p = eqn.params
    nc, nk = _scan_counts(p)
    cj = p["jaxpr"]
    consts, init, xs = invals[:nc], invals[nc:nc + nk], invals[nc + nk:]
    is_param = roles[:nc] + [None] * nk + roles[nc + nk:]

    def body(carry, x):
        xs_i, i = x
        outs = _eval(cj.jaxpr, cj.consts, [*consts, *carry, *xs_i], is_param, ctx.at(i), path)
        return outs[:nk], outs[nk:]

    length = p["length"]
    carry, ys = jax.lax.scan(body, init, (xs, jnp.arange(length, dtype=jnp.uint32)),
                             length=length, reverse=p["reverse"], unroll=p.get("unroll", 1))
    return [*carry, *ys]


def _key_name(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def param_path(key_path: Sequence[Any]) -> str:
    """A pytree key path (``jax.tree_util.tree_flatten_with_path``) as a ``/``-joined
    parameter path: dict keys, attribute names and sequence indices (``layers/0/weight``
    for an Equinox ``MLP``'s first weight, ``block_0/up`` for ``params["block_0"]["up"]``)."""
    return "/".join(_key_name(k) for k in key_path)


def _parameter_paths(args: Sequence[Any], kwargs: dict[str, Any],
                     params_argnums: Sequence[int], params_argnames: Sequence[str]
                     ) -> list[str | None]:
    """The parameter path of every leaf of ``(args, kwargs)`` (None: not a parameter);
    a keyword parameter's path starts with its name."""
    paths: list[str | None] = []
    for i, a in enumerate(args):
        leaves = jax.tree_util.tree_flatten_with_path(a)[0]
        paths += [param_path(kp) if i in params_argnums else None for kp, _ in leaves]
    for kp, _ in jax.tree_util.tree_flatten_with_path(kwargs)[0]:
        paths.append(param_path(kp) if _key_name(kp[0]) in params_argnames else None)
    return paths


def _run(fn: Callable[..., Any], rules: tuple[Rule, ...],
         params: tuple[tuple[int, ...], tuple[str, ...]], by: str, args: tuple[Any, ...],
         kwargs: dict[str, Any], key: Any, lkey: Any, record: FunctionReport | None) -> Any:
    params_argnums, params_argnames = params
    missing = [n for n in params_argnames if n not in kwargs]
    if missing:
        raise ValueError(f"quantize_function: params_argnames names {missing}, which the "
                         "call does not pass by keyword")
    for i in params_argnums:
        if not -len(args) <= i < len(args):
            raise ValueError(f"quantize_function: params_argnums={params_argnums} names "
                             f"argument {i}, but the call has {len(args)} positional "
                             "arguments; pass the parameters positionally")
    argnums = tuple(i % len(args) for i in params_argnums)
    arrays, rebuild = _split((args, kwargs))
    paths = [p for p, leaf in zip(_parameter_paths(args, kwargs, argnums, params_argnames),
                                  jax.tree_util.tree_leaves((args, kwargs)), strict=True)
             if _is_array(leaf)]

    def flat_fn(*arrays):
        a, k = rebuild(arrays)
        return fn(*a, **k)

    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*arrays)
    ctx = _Ctx(rules, key, lkey, by, record=record)
    outs = _eval(closed.jaxpr, closed.consts, arrays, paths, ctx, "")
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)


def _is_array(leaf: Any) -> bool:
    """Whether a pytree leaf is traced (arrays; other leaves, e.g. an Equinox module's
    activation function or a Python number, stay static)."""
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def _split(tree: Any) -> tuple[list[Any], Callable[[Sequence[Any]], Any]]:
    """``tree``'s array leaves, and the function that puts (traced) arrays back among its
    static leaves."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    mask = [_is_array(leaf) for leaf in leaves]

    def rebuild(arrays: Sequence[Any]) -> Any:
        it = iter(arrays)
        return jax.tree_util.tree_unflatten(
            treedef, [next(it) if m else leaf for leaf, m in zip(leaves, mask, strict=True)])
    return [leaf for leaf, m in zip(leaves, mask, strict=True) if m], rebuild


def quantize_function(fn: Callable[..., Any], rules: Any, *,
                      params_argnums: int | Sequence[int] | None = 0,
                      params_argnames: str | Sequence[str] = (),
                      paths: str = "scope") -> Callable[..., Any]:
    """``fn`` with its linear products quantized by rules on ``jax.named_scope`` paths.

    Args:
      fn: a JAX-traceable function (e.g. ``loss(params, x)``, or an Equinox model's
        ``lambda model, x: model(x)``).
      rules: ``fp4jax.nn.Rule`` objects or ``(pattern, recipe)`` pairs (a ``Recipe``, a spec
        string, or ``None`` for high precision), matched in order (module docstring).
      params_argnums: the positional argument(s) whose leaves are parameters (weights);
        ``None`` or ``()`` when the parameters are passed by keyword only.
      params_argnames: the keyword argument(s) whose leaves are parameters (e.g.
        ``params_argnums=None, params_argnames="params"`` for ``fn(x, *, params)``).
      paths: what the rules match: ``"scope"`` (default) the ``jax.named_scope`` path
        around the product; ``"params"`` the weight's own path in the parameter pytree
        (``param_path``: ``layers/0/weight`` in an Equinox ``MLP``, which opens no scopes).

    Returns:
      ``qfn(*args, fp4_key=None, fp4_layer_key=None, **kwargs)``: ``fn``'s result with the
      matched products computed by ``fp4jax.dot_general`` (keys as the module docstring
      says; ``fp4_key`` is required when a matched recipe rounds stochastically).
    """
    rs = tuple(r for r in as_rules(rules, "quantize_function: rules") if not r.attention)
    if paths not in ("scope", "params"):
        raise ValueError(f"quantize_function: paths must be 'scope' or 'params', got "
                         f"{paths!r}")
    nums = ((params_argnums,) if isinstance(params_argnums, int)
            else () if params_argnums is None else tuple(params_argnums))
    names = (params_argnames,) if isinstance(params_argnames, str) else tuple(params_argnames)
    if not all(isinstance(i, int) for i in nums) or not all(isinstance(n, str)
                                                            for n in names):
        raise TypeError("quantize_function: params_argnums must be ints and params_argnames "
                        f"strings, got {params_argnums!r}, {params_argnames!r}")
    if not nums and not names:
        raise ValueError("quantize_function: no parameters: give params_argnums or "
                         "params_argnames")

    @functools.wraps(fn)
    def qfn(*args: Any, fp4_key: Any = None, fp4_layer_key: Any = None, **kwargs: Any) -> Any:
        return _run(fn, rs, (nums, names), paths, args, kwargs, fp4_key, fp4_layer_key, None)

    qfn.fp4jax_rules = rs  # type: ignore[attr-defined]
    qfn.fp4jax_fn = fn  # type: ignore[attr-defined]
    qfn.fp4jax_params = (nums, names)  # type: ignore[attr-defined]
    qfn.fp4jax_paths = paths  # type: ignore[attr-defined]
    return qfn


def function_report(qfn: Callable[..., Any], *args: Any, **kwargs: Any) -> FunctionReport:
    """Traces ``qfn`` (from ``quantize_function``) on example arguments (shapes only) and
    lists every linear product's path and recipe, the rules no product took, the products
    of two activations and the products it could not cover.

    Returns:
      a :class:`FunctionReport`.
    """
    fn = getattr(qfn, "fp4jax_fn", None)
    if fn is None:
        raise ValueError("function_report: qfn must be a function returned by "
                         "fp4jax.nn.quantize_function")
    rules, nums = qfn.fp4jax_rules, qfn.fp4jax_params
    rec = FunctionReport({}, [], [], [])
    k = jax.random.key(0)
    by = qfn.fp4jax_paths
    arrays, rebuild = _split((args, kwargs))
    jax.eval_shape(lambda arrs: _run(fn, rules, nums, by, *rebuild(arrs), k, k, rec), arrays)
    used = {d["rule"] for d in rec.layers.values() if d["rule"] is not None}
    rec.unused_rules = [(i, r) for i, r in enumerate(rules) if i not in used]
    return rec
