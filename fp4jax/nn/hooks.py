"""The hooks of ``fp4jax.nn.quantize_model``: the public JAX product functions replaced
while a quantized model runs (``jax.lax.dot_general``, ``jax.numpy.einsum``/``dot``/
``matmul``, ``jax.lax.ragged_dot``), the thread-local stack of the modules whose own code
is running (``Frame``, one ``Session`` per ``quantize_model`` call), what a product seen by
a hook becomes (which operand is the module's weight, which recipe, the quantized call),
and linen's side: ``flax.linen.intercept_methods`` and the ``nn.scan``s around a module
(``quantize_linen``). See ``fp4jax.nn.model`` for what is covered and why this way; NNX
models are rewritten by ``fp4jax.nn.nnx_rewrite``, and ``fp4jax.nn.layer_report`` reads what
the hooks recorded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from fp4jax.diagnostics import observe_product
from fp4jax.nn import linen as fnn
from fp4jax.nn.taps import DEFAULT_TAPS
from fp4jax.recipes import Recipe
from fp4jax.rules import (
    Rule,
    einsum_dimension_numbers,
    match_rule,
    match_rule_in_stack,
    weight_dot_general,
)

__all__ = ["ACT_SCOPE", "ORIG_DOT_GENERAL", "SEEN_SCOPE", "Frame", "Record", "Session", "patched",
           "push", "quantize_linen", "quantized", "record_layer", "seen"]

# the public names the hooks replace while a quantized model runs, and their originals
_ORIGINALS = {
    (jax.lax, "dot_general"): jax.lax.dot_general,
    (jax.numpy, "einsum"): jax.numpy.einsum,
    (jax.numpy, "dot"): jax.numpy.dot,
    (jax.numpy, "matmul"): jax.numpy.matmul,
    (jax.lax, "ragged_dot"): jax.lax.ragged_dot,
}
ORIG_DOT_GENERAL = jax.lax.dot_general
_ORIG_EINSUM = jax.numpy.einsum
_ORIG_DOT = jax.numpy.dot
_ORIG_MATMUL = jax.numpy.matmul
_ORIG_RAGGED_DOT = jax.lax.ragged_dot

_patch_lock = threading.Lock()
_patch_depth = 0


class _Local(threading.local):
    def __init__(self) -> None:
        self.frames: list[Frame | None] = []
        self.sessions: list[Session] = []
        self.scans: list[tuple[str, int]] = []  # (path, length) of the nn.scans running
        self.busy = 0


_local = _Local()


@dataclasses.dataclass
class Record:
    """What ``report`` collects while the model is traced."""

    layers: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    activation: list[str] = dataclasses.field(default_factory=list)
    uncovered: list[str] = dataclasses.field(default_factory=list)
    seen: int = 0


@dataclasses.dataclass(eq=False)
class Session:
    """One ``quantize_model`` call: its rules and stream names."""

    rules: tuple[Rule, ...]
    rng_collection: str
    layer_rng_collection: str
    record: Record | None = None
    # linen: the product taps of every quantized product (fp4jax.nn.taps)
    taps: tuple[Any, ...] = DEFAULT_TAPS
    # NNX: the rule each layer got from quantize_model (a stacked layer's, by its blocks)
    resolved: dict[str, int | None] = dataclasses.field(default_factory=dict)

    def rule_index(self, path: str, stacks: Sequence[tuple[str, int]] = ()) -> int | None:
        """The rule of the layer at ``path``, inside the stacked blocks ``stacks`` (``(stack
        path, blocks)``: ``match_rule_in_stack``, which raises where blocks disagree)."""
        if not stacks:
            return match_rule(self.rules, path)
        return match_rule_in_stack(self.rules, path, stacks)


@dataclasses.dataclass
class Frame:
    """A module whose own code is running: linen (``module`` bound) or NNX."""

    session: Session
    path: str
    module: Any
    kind: str  # "linen" | "nnx"


@contextlib.contextmanager
def patched() -> Iterator[None]:
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
def push(frame: Frame | None) -> Iterator[None]:
    """``frame`` on top of this thread's stack of running modules meanwhile (``None``: code
    outside any module, e.g. the call that starts a quantized model: its products are not
    a layer's)."""
    _local.frames.append(frame)
    try:
        yield
    finally:
        _local.frames.pop()


def _current() -> Frame | None:
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
        return ORIG_DOT_GENERAL(lhs, rhs, dimension_numbers, precision,
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


def _own_params(frame: Frame) -> list[Any]:
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


def _subtree_params(frame: Frame) -> list[Any]:
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


def _product(frame: Frame, op: str, orig: Callable[[], Any], lhs: Any, rhs: Any,
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
        return seen(orig, SEEN_SCOPE if left_out is not None
                     else f"{ACT_SCOPE}:{op} {_shapes(lhs, rhs)}")
    if all(roles) or why is not None:
        if rec is not None:
            rec.uncovered.append(f"{frame.path or '/'}: {op} {_shapes(lhs, rhs)} "
                                 f"({why or left_out})")
        return seen(orig)
    idx = s.rule_index(frame.path, _stacks_of(frame.path) if frame.kind == "linen" else ())
    recipe = s.rules[idx].recipe if idx is not None else None
    weight = rhs if roles[1] else lhs
    if rec is not None:
        record_layer(rec, frame.path, op, weight, idx, recipe)
    if recipe is None:
        return seen(orig)
    y = seen(lambda: quantized(frame, recipe, lhs, rhs, dims, roles[0], precision,
                                 preferred_element_type, out_sharding))
    return y if perm is None else jnp.transpose(y, perm)


def record_layer(rec: Record, path: str, op: str, weight: Any, rule: int | None,
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


def _ragged_product(frame: Frame, orig: Callable[[], Any], lhs: Any, rhs: Any,
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
        return seen(orig)
    idx = s.rule_index(frame.path, _stacks_of(frame.path) if frame.kind == "linen" else ())
    recipe = s.rules[idx].recipe if idx is not None else None
    if rec is not None:
        record_layer(rec, frame.path, "ragged_dot", rhs, idx, recipe)
    if recipe is None:
        return seen(orig)
    return seen(lambda: _ragged_fn(frame, recipe)(lhs, rhs, group_sizes, precision,
                                                   preferred_element_type))


def _nnx_dot(frame: Frame) -> Any:
    """The ``fp4jax.nn.nnx.DotGeneral`` that ``quantize_model`` gave the NNX layer in
    ``frame`` (its ``fp4jax_dot``)."""
    dot = getattr(frame.module, "fp4jax_dot", None)
    if dot is None:
        raise ValueError(f"fp4jax.nn.quantize_model: NNX module at {frame.path!r} was "
                         "not prepared (call quantize_model on the model that runs)")
    return dot


def _ragged_fn(frame: Frame, recipe: Recipe) -> Callable[..., jax.Array]:
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


SEEN_SCOPE = "fp4jax_seen"
ACT_SCOPE = "fp4jax_seen_activations"  # a product of two activations, left alone


def seen(f: Callable[[], Any], scope: str = SEEN_SCOPE) -> Any:
    """``f()`` with the hooks off (its own products are not the model's), under a named
    scope that ``report`` recognises as a product some hook saw (``ACT_SCOPE``: one of
    two activations)."""
    _local.busy += 1
    try:
        with jax.named_scope(scope):
            return f()
    finally:
        _local.busy -= 1


def quantized(frame: Frame, recipe: Recipe, lhs: Any, rhs: Any, dims: Any,
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


def _dot_fn(frame: Frame, recipe: Recipe) -> Callable[..., jax.Array]:
    """The fp4jax ``dot_general`` of the layer in ``frame`` (see the module docstring's
    Keys)."""
    s = frame.session
    if frame.kind == "nnx":
        return _nnx_dot(frame)
    try:
        return fnn.DotGeneral(recipe=recipe, rng_collection=s.rng_collection,
                              layer_rng_collection=s.layer_rng_collection, taps=s.taps)
    except Exception:  # noqa: BLE001 (not compact: no submodule here; keys from the layer)
        if s.taps != DEFAULT_TAPS:
            raise ValueError(
                f"quantize_model: the layer {frame.path!r} computes its product outside a "
                "compact method (setup-style), where no fp4jax DotGeneral submodule can run "
                "the product taps passed to quantize_model; leave taps at their default, or "
                "define the layer with @nn.compact") from None
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


def _linen_interceptor(session: Session) -> Callable[..., Any]:
    def interceptor(next_fun, args, kwargs, context):
        m = context.module
        if context.method_name == "setup" or isinstance(m, fnn.DotGeneral):
            frame = None
        else:
            try:
                path = "/".join(str(p) for p in m.path)
            except Exception:  # noqa: BLE001 (unbound: not part of this model's tree)
                path = None
            frame = None if path is None else Frame(session, path, m, "linen")
        scans = [] if frame is None else _scans_around(m)
        with push(frame), _scanning(scans):
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
def _active(session: Session):
    if any(x is session for x in _local.sessions):  # init -> init_with_output -> apply: once
        yield
        return
    _local.sessions.append(session)
    try:
        with patched(), nn.intercept_methods(_linen_interceptor(session)), push(None):
            yield
    finally:
        _local.sessions.pop()


def quantize_linen(model: nn.Module, session: Session) -> nn.Module:
    """``quantize_model`` of an unbound linen ``model``: a copy whose class is a subclass of
    the model's (the same fields and parameter tree) with ``init``/``init_with_output``/
    ``apply`` running under ``session``'s hooks."""
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

