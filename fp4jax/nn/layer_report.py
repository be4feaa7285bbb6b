"""``report`` (``fp4jax.nn.report``): what ``quantize_model`` did to a model, traced on
example inputs (shapes only): every linear layer's path and recipe, the rules that matched
nothing, the products of two activations, and the products no hook covered (found in the
traced program, ``jaxpr``, by their operands' provenance).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
from flax import nnx
from jax.extend import core as jex_core

from fp4jax.nn.hooks import ACT_SCOPE, SEEN_SCOPE, Record, Session, patched, push
from fp4jax.rules import Rule, sub_jaxprs

__all__ = ["Report", "report", "session_of"]


def session_of(model: Any) -> Session | None:
    """The ``Session`` of a model returned by ``quantize_model`` (linen: on its class; NNX:
    on one of its rewritten modules), or None for any other model."""
    s = getattr(type(model), "_fp4jax_session", None)
    if s is not None:
        return s
    if isinstance(model, nnx.Module):
        for _, node in nnx.iter_graph(model):
            s = getattr(node, "_fp4jax_session", None) or getattr(node, "session", None)
            if isinstance(s, Session):
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
        weights = d["weights"]  # record_layer: every entry lists them, as tuples
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
      method: linen: the method to trace (as ``Module.init``'s ``method``); NNX: a
        callable ``method(model, *example_args, **kwargs)`` traced instead of
        ``model(*example_args, **kwargs)`` (e.g. one that makes positions and takes the
        logits out of a returned structure).

    Returns:
      a :class:`Report`.
    """
    session = session_of(qmodel)
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
            with patched(), push(None):
                m = nnx.merge(graphdef, params, rest)
                if method is None:
                    return m(*example_args, **kwargs)
                return method(m, *example_args, **kwargs)
        attempts = [(fn_nnx, (params, rest))]
    for i, (fn, args) in enumerate(attempts):
        rec = Record()
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
                act = [q for q in stack.split("/") if q.startswith(ACT_SCOPE + ":")]
                if act:  # as the hook described it, where it runs now
                    activation.append(f"{where}: {act[-1].split(':', 1)[1]}")
                elif SEEN_SCOPE not in stack:
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

