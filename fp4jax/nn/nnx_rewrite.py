"""NNX graph rewriting for ``fp4jax.nn.quantize_model`` (``quantize_nnx``): the covered
layers (``nnx.Linear``, ``LinearGeneral``, ``Einsum``) get their ``dot_general`` /
``einsum_op`` replaced by wrappers around a ``fp4jax.nn.nnx.DotGeneral`` of their own, with
RNG streams per layer (split along an ``nnx.vmap`` stack); other modules with parameters
get a subclass whose methods run under the hooks of ``fp4jax.nn.hooks``. See
``fp4jax.nn.model`` for the rules, paths and keys.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fp4jax.nn import nnx as fnnx
from fp4jax.nn.hooks import (
    ORIG_DOT_GENERAL,
    Frame,
    Session,
    patched,
    push,
    quantized,
    record_layer,
    seen,
)
from fp4jax.recipes import Recipe
from fp4jax.rules import einsum_dimension_numbers, layer_key

__all__ = ["quantize_nnx"]

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
                 session: Session, op: str) -> None:
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
        record_layer(rec, self.path, self.op, weight, idx,
                      None if self.dot is None else self.dot.recipe)

    def _run(self, inputs, kernel, dims, precision, preferred_element_type, out_sharding):
        frame = Frame(self.session, self.path, _DotHolder(self.dot), "nnx")
        return seen(lambda: quantized(frame, self.dot.recipe, inputs, kernel, dims, False,
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
            return seen(lambda: self.orig(subscripts, inputs, kernel, precision=precision,
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
            return seen(lambda: self.orig(lhs, rhs, dimension_numbers, precision,
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


def _make_nnx_dot(recipe: Recipe, path: str, session: Session, keys: dict[str, Any],
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


def quantize_nnx(model: nnx.Module, session: Session, rngs: Any) -> nnx.Module:
    """``quantize_model`` of an NNX ``model``, in place: every check (already quantized,
    rules, stacks, RNG streams in ``rngs``) and every key draw before the first change to
    the model, then each covered layer's product replaced and other modules with
    parameters (or parameter-free ones with methods) put under the hooks; returns
    ``model``."""
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
            node.dot_general = _as_data(_NnxLinearDot(orig or ORIG_DOT_GENERAL, dot, name,
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
        frame = Frame(self._fp4jax_session, path, self, "nnx")
        with patched(), push(frame), \
                jax.named_scope("fp4jax_module:" + path.replace("/", "|")):
            return orig(self, *args, **kwargs)
    method.__name__, method.__doc__ = orig.__name__, orig.__doc__
    return method


def _intercept_nnx(node: Any, path: str, session: Session) -> None:
    """Gives a non-covered NNX module with parameters a subclass whose ``__call__`` and
    other public methods (``_nnx_methods``) run under the hooks with the module on the
    frame stack (and its path as a named scope, for ``report``). ``node`` is not yet
    quantized (``quantize_nnx`` refuses a model that is)."""
    base = type(node)
    cls = _nnx_classes.get(base)
    if cls is None:
        methods = {n: _nnx_hooked(getattr(base, n)) for n in _nnx_methods(base)}
        cls = type(base.__name__, (base,), {"_fp4jax_base": base, **methods})
        _nnx_classes[base] = cls
    object.__setattr__(node, "__class__", cls)
    object.__setattr__(node, "_fp4jax_session", session)
    object.__setattr__(node, "_fp4jax_path", path)

