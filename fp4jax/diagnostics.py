"""Quantization diagnostics of one linear layer: how much error each of its three quantized
GEMMs adds on a given batch, and how its operands use the format.

``gemm_stats(x, w, dy, recipe=..., key=...)`` returns, for each GEMM of the recipe
(``fprop`` ``y = x @ w``, ``dgrad`` ``dx = dy @ w.T``, ``wgrad`` ``dw = x.T @ dy``):

* ``rel_error``: ``||P_q - P||_F / ||P||_F``, ``P_q`` the product ``fp4jax.dot`` computes
  (forward, or its VJP with cotangent ``dy``, SR draws included), as its XLA reference does
  (``fp4jax.quantized_dot.reference_gemms``: the same bits; the kernel backends differ in
  their GEMMs' float32 accumulation order only), and ``P`` the product of the unquantized
  float32 tensors (``Precision.HIGHEST``);
  0 for a GEMM the recipe leaves unquantized;
* per operand (``lhs``/``rhs`` in the GEMM's order: fprop ``x, w``; dgrad ``dy, w``; wgrad
  ``x, dy``), as the recipe quantizes it (after the GEMM's RHT, along its blocked axis; the
  very operand that GEMM consumed):
  ``underflow`` (fraction of the nonzero finite elements that quantize to 0),
  ``saturation`` (fraction whose encoded magnitude, times the quantizer's element encode
  scale, exceeds the element format's largest value, 6 for E2M1, 448 for E4M3
  (``BlockFormat.elem_max``): rounding clips them; with NVFP4's
  round-to-nearest block scales, the block maxima whose scale rounded down),
  ``scale_min``/``scale_max`` (range of the nonzero block decode scales times the tensor
  decode scale: the magnitudes the blocks resolve) and ``amax`` (of the tensor as
  quantized). Unquantized operands have only ``amax``.

All values are float32 scalars (a pytree of dicts), cheap enough to compute every N steps
inside a jitted step.

``layer_stats(model, variables, *args, loss=..., rngs=...)`` measures every fp4jax linen
layer of a Flax model on one batch at once: each layer's own operands (its input ``x``, its
weight ``w`` and the cotangent ``dy`` of the loss with respect to its output, found with
zero perturbations of the outputs) and the keys its GEMMs draw in that call (see
``fp4jax.nn.linen``); the training harness calls it every ``--stats-every`` steps and
writes ``flatten_stats`` of it to ``metrics.jsonl`` as a ``"stats"`` record, which
``read_stats`` and ``stats_from_metrics`` read back.

``recommend_high_precision_layers(stats, budget)`` ranks layers by their measured wgrad
error (then dgrad, then fprop: the order NVIDIA's Appendix E.2 observed to matter) and
returns the names to keep in BF16, at most ``budget`` of them (a fraction of the layers);
``mean_layer_stats(records)`` averages the statistics of several ``"stats"`` records first
(what ``fp4jax-train --bf16-layers auto`` ranks).

The gradient-to-noise monitor (FP4-all-the-way, Chmiel et al. 2025, Section 4 and Appendix
B.1): ``gradient_noise(grads, grads_q)`` measures ``r = ||grad L|| / (sigma_q sqrt(d))``,
globally and per layer, from the gradient ``grads_q`` of the recipe's quantized backward
pass and ``grads`` of the same step with the backward GEMMs in high precision (see its
docstring for the exact definition); below ``sqrt(3)`` (``SQRT3``) quantized gradients stop
helping. ``SwitchMonitor`` (and its pure form ``auto_switch_step``) decides, from the
measured ratios, when to switch precision: once the ratio has stayed below a threshold for a
window of steps (``fp4jax-train --switch-at auto``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import os
import re
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax import numerics
from fp4jax import quantization as qz
from fp4jax.quantized_dot import call_key, reference_gemms
from fp4jax.recipes import Recipe, get, nvfp4
from fp4jax.rules import Rule

# the variable collections through which fp4jax's linen layers hand their operands to
# ``layer_stats`` (defined here, used by ``fp4jax.nn.linen.DotGeneral``; see its module
# docstring)
PERTURB_COLLECTION = "fp4_perturbations"
COTANGENT_COLLECTION = "fp4_cotangents"
STATS_COLLECTION = "fp4_stats"

__all__ = ["SQRT3", "SwitchMonitor", "UnmeasuredLayerWarning", "auto_switch_step",
           "combine_noise", "flatten_noise", "flatten_stats", "gemm_stats", "gradient_noise",
           "is_dense_product", "layer_stats", "mean_layer_stats", "note_unmeasured",
           "observe_product", "probing", "read_stats", "recommend_high_precision_layers",
           "stats_from_metrics"]

SQRT3 = math.sqrt(3.0)  # FP4-all-the-way Section 4.1: the critical gradient-to-noise ratio


def _operand_stats(op: tuple[jax.Array, Any], spec: Any) -> dict[str, jax.Array]:
    """Format usage of one GEMM operand ``op = (r, q)`` as
    ``fp4jax.quantized_dot.reference_gemms`` returns it (``r`` the quantizer's input, after
    the GEMM's RHT; ``q`` its ``QuantizedArray``) for its quantization spec ``spec``."""
    r, q = op
    r = numerics.exact_float32(r)
    amax = qz.finite_amax(r)
    if not spec.quantized:
        return {"amax": amax}
    # each element in the quantizer's encoded domain (its encode scale, Eq. 4): beyond the
    # element maximum there (6 for E2M1), rounding clipped it
    # (a block whose scale underflowed to 0 holds codes +-6 with encode scale FLT_MAX, as in
    # Transformer Engine: its elements count as underflowed, not saturated)
    s_el = qz.expand_scale(q)
    enc = qz.element_encode_scale(s_el, q.global_scale)
    finite_nz = jnp.isfinite(r) & (r != 0)
    n_nz = jnp.maximum(jnp.sum(finite_nz), 1)
    under = jnp.sum(finite_nz & ((q.data.astype(jnp.float32) == 0) | (s_el == 0))) / n_nz
    sat = jnp.sum(finite_nz & (s_el > 0) & (jnp.abs(r * enc) > spec.fmt.elem_max)) / n_nz
    dec = q.scale.astype(jnp.float32) * q.global_scale
    used = jnp.isfinite(dec) & (dec > 0)
    return {"underflow": under.astype(jnp.float32), "saturation": sat.astype(jnp.float32),
            "scale_min": jnp.min(jnp.where(used, dec, jnp.inf)),
            "scale_max": jnp.max(jnp.where(used, dec, 0.0)), "amax": amax}


def _rel(a: jax.Array, b: jax.Array) -> jax.Array:
    """``||a - b||_F / ||b||_F`` in float32 (0 when both are 0)."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    num = jnp.sqrt(jnp.sum(jnp.square(a - b)))
    den = jnp.sqrt(jnp.sum(jnp.square(b)))
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), jnp.where(num > 0, jnp.inf, 0.0))


def gemm_stats(x: jax.Array, w: jax.Array, dy: jax.Array, *,
               recipe: Recipe | str | None = None, key: jax.Array | None = None,
               rht_key: jax.Array | None = None) -> dict[str, dict[str, Any]]:
    """Quantization statistics of the layer ``y = x @ w`` on one batch (see the module doc).

    Args:
      x: activations ``(..., K)`` (leading dims are tokens, as in ``fp4jax.dot``).
      w: weight ``(K, N)``.
      dy: cotangent of ``y``, ``(..., N)`` with ``x``'s leading dims.
      recipe, key, rht_key: as for ``fp4jax.dot`` (``key`` required when the recipe
        draws random bits; ``rht_key`` for per-layer RHT signs).

    Returns:
      ``{"fprop"|"dgrad"|"wgrad": {"rel_error": f32, "lhs": {...}, "rhs": {...}}}``.
    """
    recipe = nvfp4() if recipe is None else get(recipe)
    x, w, dy = (qz.check_float(a, n, "fp4jax.diagnostics.gemm_stats")
                for a, n in ((x, "x"), (w, "w"), (dy, "dy")))
    if w.ndim != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"gemm_stats: need x (..., K) and w (K, N), got {x.shape} and {w.shape}")
    if dy.shape != x.shape[:-1] + (w.shape[1],):
        raise ValueError(f"gemm_stats: dy must have shape {x.shape[:-1] + (w.shape[1],)} "
                         f"(y's), got {dy.shape}")
    call_key(recipe, key, rht_key)  # fp4jax.dot's checks, before tracing
    return _gemm_stats(x, w, dy, recipe, key, rht_key)


@functools.partial(jax.jit, static_argnums=(3,))
def _gemm_stats(x: jax.Array, w: jax.Array, dy: jax.Array, recipe: Recipe,
                key: jax.Array | None, rht_key: jax.Array | None) -> dict[str, dict[str, Any]]:
    """``gemm_stats``' computation as one compiled program (inlined inside a caller's jit;
    called eagerly, it compiles once per recipe and shapes instead of dispatching each of
    its few hundred operations on its own)."""
    k = call_key(recipe, key, rht_key)  # fp4jax.dot's key packing
    K, N = w.shape
    # the three quantized GEMMs as fp4jax.dot computes them (its XLA reference: forward,
    # and backward with cotangent dy), each operand quantized once for its GEMM and its
    # statistics
    gemms = reference_gemms(x.reshape(1, -1, K), w[None], dy.reshape(1, -1, N), recipe, k)
    hi = jax.lax.Precision.HIGHEST
    x32, w32, dy32 = (numerics.exact_float32(a) for a in (x, w, dy))
    y = jnp.matmul(x32, w32, precision=hi)
    dx = jnp.matmul(dy32, w32.T, precision=hi)
    x2, dy2 = x32.reshape(-1, K), dy32.reshape(-1, N)
    exact = {"fprop": y, "dgrad": dx, "wgrad": jnp.matmul(x2.T, dy2, precision=hi)}
    out = {}
    for gemm, (p_q, lhs, rhs) in gemms.items():
        spec = getattr(recipe, gemm)
        out[gemm] = {"rel_error": _rel(p_q.reshape(exact[gemm].shape), exact[gemm]),
                     "lhs": _operand_stats(lhs, spec.lhs),
                     "rhs": _operand_stats(rhs, spec.rhs)}
    return out


def _default_name(path: tuple[str, ...], index: tuple[int, ...]) -> str:
    """``"a/b/c"``, with ``"[i]"`` per scan axis (``"blocks/q[3]"``)."""
    return "/".join(path) + "".join(f"[{i}]" for i in index)


# ---------------------------------------------------------------------------
# the probe: how layers that are not linen DotGeneral modules (NNX layers, linen modules
# quantized in their own scope) hand their operands to ``layer_stats``
# ---------------------------------------------------------------------------

class UnmeasuredLayerWarning(UserWarning):
    """``layer_stats`` met quantized products it cannot measure (named in the message)."""


def is_dense_product(lhs: Any, rhs: Any, dimension_numbers: Any) -> bool:
    """Whether ``lax.dot_general(lhs, rhs, dimension_numbers)`` is ``lhs (..., K) @ rhs (K,
    N)``: the one form ``gemm_stats`` measures (``fp4jax.nn.quantize_model`` flattens
    every covered product to it, batch dimensions aside)."""
    try:
        (lc, rc), (lb, rb) = dimension_numbers
        return (jnp.ndim(rhs) == 2 and tuple(lc) == (jnp.ndim(lhs) - 1,) and tuple(rc) == (0,)
                and not tuple(lb) and not tuple(rb))
    except (TypeError, ValueError):
        return False


def _trace_state() -> Any:
    """The current JAX trace (what Flax NNX compares to refuse cross-trace mutation)."""
    from jax.extend.core import get_opaque_trace_state

    return get_opaque_trace_state(convention="nnx")


@dataclasses.dataclass(eq=False)
class _Probe:
    """One pass of ``layer_stats`` over the model: ``"shapes"`` (records each product's
    output shape, and the products it cannot measure), ``"perturb"`` (adds ``values[name]``,
    zeros, to each output: their gradients are the cotangents ``dy``) or ``"stats"``
    (``gemm_stats`` of each product with ``values[name]`` as ``dy``)."""

    mode: str
    trace: Any
    values: dict[str, Any] = dataclasses.field(default_factory=dict)
    names: dict[int, str] = dataclasses.field(default_factory=dict)
    calls: dict[str, int] = dataclasses.field(default_factory=dict)
    shapes: dict[str, Any] = dataclasses.field(default_factory=dict)
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)
    unmeasured: dict[str, str] = dataclasses.field(default_factory=dict)


class _Probes(threading.local):
    def __init__(self) -> None:
        self.stack: list[_Probe] = []


_probes = _Probes()


@contextmanager
def _probing(probe: _Probe) -> Iterator[_Probe]:
    _probes.stack.append(probe)
    try:
        yield probe
    finally:
        _probes.stack.pop()


def probing() -> str | None:
    """The pass ``layer_stats`` is running in this thread (``"shapes"``, ``"perturb"``,
    ``"stats"``), or None outside it."""
    return _probes.stack[-1].mode if _probes.stack else None


def note_unmeasured(name: str, why: str) -> None:
    """Records, while ``layer_stats`` runs, that the quantized product of layer ``name``
    cannot be measured and ``why`` (``layer_stats`` names it in an
    ``UnmeasuredLayerWarning``); nothing outside ``layer_stats``."""
    if _probes.stack and _probes.stack[-1].mode == "shapes":
        _probes.stack[-1].unmeasured.setdefault(name, why)


def observe_product(layer: Any, name: str | None, lhs: jax.Array, rhs: jax.Array,
                    dimension_numbers: Any, y: jax.Array, *, recipe: Recipe,
                    key: jax.Array | None = None, rht_key: jax.Array | None = None
                    ) -> jax.Array:
    """The statistics hook of a quantized product outside a linen ``DotGeneral`` module
    (``fp4jax.nn.nnx.DotGeneral``, the products ``fp4jax.nn.quantize_model`` runs in a
    setup-style linen module's own scope): returns ``y = dot_general(lhs, rhs,
    dimension_numbers)`` as computed by ``recipe`` with ``key``/``rht_key``, unchanged
    outside ``layer_stats``; inside it, records the product's shape, adds its perturbation
    or measures ``gemm_stats(lhs, rhs, dy, recipe=recipe, key=key, rht_key=rht_key)``.

    ``name`` is the layer's module path (None: the name ``layer_stats`` found for the
    object ``layer`` in the model's graph); a second call of the same layer in one pass is
    ``name#2``. A product that is not ``x (..., K) @ w (K, N)``, or that runs inside a
    transform of the model (``nnx.scan``/``vmap``/``jit``/``remat``, a ``jax.lax.scan``:
    its operands cannot leave that trace), is named as not measured."""
    if not _probes.stack:
        return y
    p = _probes.stack[-1]
    base = name or p.names.get(id(layer)) or f"<{type(layer).__name__} {id(layer):x}>"
    n = p.calls.get(base, 0) + 1
    p.calls[base] = n
    full = base if n == 1 else f"{base}#{n}"
    if p.mode == "shapes":
        if _trace_state() != p.trace:
            p.unmeasured.setdefault(full, "runs inside a transform of the model (scan, "
                                    "vmap, jit or remat): its operands cannot leave it; "
                                    "measure it on the model built without that transform "
                                    "(the same parameters)")
        elif not is_dense_product(lhs, rhs, dimension_numbers):
            p.unmeasured.setdefault(full, f"not an x (..., K) @ w (K, N) product "
                                    f"({_shape_str(lhs, rhs)}, dimension numbers "
                                    f"{dimension_numbers}; a batch axis on the weight: "
                                    "gemm_stats on one block's x and w measures it)")
        else:
            p.shapes[full] = jax.ShapeDtypeStruct(jnp.shape(y), jnp.result_type(y))
        return y
    if full not in p.values:
        return y
    if p.mode == "perturb":
        return y + p.values[full]
    p.stats[full] = gemm_stats(lhs, rhs, p.values[full], recipe=recipe, key=key,
                               rht_key=rht_key)
    return y


def _shape_str(a: Any, b: Any) -> str:
    return f"{tuple(jnp.shape(a))} x {tuple(jnp.shape(b))}"


def _graph_names(model: Any) -> dict[int, str]:
    """``{id(node): path of its parent}`` of an NNX graph: the layer an unnamed
    ``fp4jax.nn.nnx.DotGeneral`` (``layer.dot_general``) measures for."""
    from flax import nnx

    return {id(node): "/".join(str(k) for k in path[:-1])
            for path, node in nnx.iter_graph(model) if path}


def layer_stats(model: Any, variables: Mapping[str, Any] | None, *args: Any,
                loss: Callable[[Any], jax.Array], rngs: Mapping[str, jax.Array] | None = None,
                name_fn: Callable[[tuple[str, ...], tuple[int, ...]], str] | None = None,
                unmeasured: str = "warn", **kwargs: Any) -> dict[str, dict[str, dict[str, Any]]]:
    """``gemm_stats`` of every quantized linear layer of a model on one batch, each on its
    own operands. Traceable: call it inside ``jax.jit``.

    Measured: fp4jax's linen layers (``fp4jax.nn.linen.DotGeneral``, inside
    ``fp4jax.nn.linen.Dense`` or ``nn.Dense(dot_general_cls=...)``), NNX layers
    (``fp4jax.nn.nnx.DotGeneral``), and every layer that ``fp4jax.nn.quantize_model`` runs
    in a recipe (linen or NNX: ``Dense``, ``DenseGeneral`` with several axes and ``Einsum``
    products flattened to ``x (..., K) @ w (K, N)``, raw ``jnp.einsum``/``dot`` on a
    parameter), named by the module path its rules match.

    Three passes of the model: one traced only for the shapes of the layers' outputs; a
    forward and backward pass of ``loss`` with zero perturbations added to those outputs
    (linen: ``Module.perturb``), whose gradients are the cotangents ``dy`` (the backward
    pass of the model's own recipes, as in training); and a forward pass given ``dy``, in
    which each layer computes ``gemm_stats(x, w, dy, recipe=its recipe, key=its key,
    rht_key=its RHT key)`` on its inputs (in their compute dtype) with the keys it draws in
    that call: the same ones as in an ``apply`` with the same ``rngs`` (NNX: each pass runs
    on a copy of the model's state, so each draws what one call of the model draws), so
    with the train step's keys the errors are those of that step's GEMMs.

    Not measured (named in an ``UnmeasuredLayerWarning``, or see ``unmeasured``): products
    other than ``x (..., K) @ w (K, N)`` (an einsum with batch dimensions on the weight);
    NNX layers inside ``nnx.scan``/``vmap``/``jit``/``remat`` of the model; linen layers
    inside an ``nn.scan``/``nn.vmap`` whose ``variable_axes`` do not carry the statistics
    collections (``PERTURB_COLLECTION``, ``COTANGENT_COLLECTION``, ``STATS_COLLECTION``:
    list them with axis 0, as fp4jax's Llama does, to measure each scanned block).

    Args:
      model: a ``flax.linen.Module``, an ``nnx.Module``, or any object with linen's
        ``apply(variables, *args, rngs=...)`` whose layers are NNX
        (``fp4jax.train.models.NnxModel``).
      variables: linen (and ``apply`` objects): its variables (``{"params": ...}``); NNX:
        None (the module holds its state).
      *args, **kwargs: the call's inputs (e.g. tokens ``(B, T)`` int32).
      loss: ``loss(model output) -> float scalar``, the function whose gradient ``dy`` is.
      rngs: the call's RNG streams (``"fp4"``, ``"fp4_layer"``); NNX: None (its streams
        are state).
      name_fn: ``name_fn(path, index) -> str``: the name of the layer at module ``path``
        (a tuple of module names, the ``DotGeneral`` submodule left out) and, for layers
        inside ``flax.linen.scan``, ``index`` (the iteration, one int per scan level);
        default ``"/".join(path)`` plus ``"[i]"`` per scan level.
      unmeasured: what to do about quantized products it cannot measure, or a model that
        ran none (nothing quantized: rules that match no layer): ``"warn"`` (default: one
        ``UnmeasuredLayerWarning`` naming each and why, when traced), ``"raise"``
        (ValueError) or ``"ignore"``.

    Returns:
      ``{layer name: gemm_stats(...)}``, float32 scalars; layers not quantized (plain
      ``nn.Dense``, layers a rule keeps in high precision) are absent; a layer called more
      than once gets ``"#2"``, ``"#3"``, ... after its name for the later calls.

    Raises:
      ValueError: a bad ``unmeasured``; NNX with ``variables`` or ``rngs``; with
        ``unmeasured="raise"``, a product it cannot measure.
    """
    if unmeasured not in ("warn", "raise", "ignore"):
        raise ValueError(f"layer_stats: unmeasured must be 'warn', 'raise' or 'ignore', got "
                         f"{unmeasured!r}")
    name_fn = name_fn or _default_name
    import flax.linen as nn
    from flax import nnx

    if getattr(model, "fp4jax_fn", None) is not None:
        raise ValueError("layer_stats: model is a function from fp4jax.nn.quantize_function, "
                         "whose products run inside its re-evaluated program: not measured "
                         "here. fp4jax.nn.function_report(qfn, *args) lists its layers; "
                         "measure one with fp4jax.diagnostics.gemm_stats(x, w, dy, recipe=...)"
                         " on its operands, or use quantize_model for a Flax model")
    if not isinstance(model, nn.Module | nnx.Module) and not hasattr(model, "apply"):
        raise TypeError(f"layer_stats: model must be a flax.linen.Module, an nnx.Module or "
                        f"have linen's apply(variables, *args, rngs=...), got "
                        f"{type(model).__name__}")

    if isinstance(model, nnx.Module):
        if variables is not None or rngs is not None:
            raise ValueError("layer_stats: an NNX model holds its parameters and RNG streams: "
                             "pass variables=None and no rngs")
        graphdef, state = nnx.split(model)

        def call(extra: dict, mutable: Any) -> Any:
            # new Variables (tree.map) in the pass's own trace: NNX refuses to advance an
            # RNG counter created in another
            m = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))
            if _probes.stack:
                _probes.stack[-1].names = _graph_names(m)
            return m(*args, **kwargs), {}
        linen = False
    else:
        variables = {k: v for k, v in dict(variables or {}).items()
                     if k not in (PERTURB_COLLECTION, COTANGENT_COLLECTION, STATS_COLLECTION)}
        linen = isinstance(model, nn.Module)

        def call(extra: dict, mutable: Any) -> Any:
            if not linen:
                return model.apply(variables, *args, rngs=rngs, **kwargs), {}
            out = model.apply({**variables, **extra}, *args, rngs=rngs, mutable=mutable,
                              **kwargs)
            return out if mutable else (out, {})

    def run(mode: str, values: dict, extra: dict, mutable: Any) -> tuple[Any, dict, _Probe]:
        with _probing(_Probe(mode, _trace_state(), dict(values))) as p:
            out, state = call(extra, mutable)
        return out, dict(state), p

    found: dict[str, _Probe] = {}

    def shapes_pass() -> dict:
        _, state, p = run("shapes", {}, {}, [PERTURB_COLLECTION] if linen else False)
        found["p"] = p
        return state

    shapes = jax.eval_shape(shapes_pass)
    probe = found["p"]
    if probe.unmeasured and unmeasured != "ignore":
        msg = ("layer_stats: quantized products not measured: " + "; ".join(
            f"{n}: {why}" for n, why in probe.unmeasured.items()))
        if unmeasured == "raise":
            raise ValueError(msg)
        warnings.warn(msg, UnmeasuredLayerWarning, stacklevel=2)
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                         (dict(shapes.get(PERTURB_COLLECTION, {})), probe.shapes))
    if not zeros[0] and not zeros[1]:
        if unmeasured != "ignore" and not probe.unmeasured:
            msg = ("layer_stats: the model ran no quantized linear layer (its recipe or rules "
                   "quantize nothing, e.g. rules that match no layer: see "
                   "fp4jax.nn.report): nothing to measure")
            if unmeasured == "raise":
                raise ValueError(msg)
            warnings.warn(msg, UnmeasuredLayerWarning, stacklevel=2)
        return {}

    def perturbed_loss(z: tuple[dict, dict]) -> jax.Array:
        extra = {PERTURB_COLLECTION: z[0]} if z[0] else {}
        return loss(run("perturb", z[1], extra, False)[0])

    dys = jax.grad(perturbed_loss)(zeros)
    extra = {COTANGENT_COLLECTION: dys[0]} if dys[0] else {}
    _, state, p = run("stats", dys[1], extra, [STATS_COLLECTION] if linen else False)

    out: dict[str, dict] = {}

    def walk(node: Any, path: tuple[str, ...]) -> None:
        for k, v in node.items():
            if k != "stats" or not isinstance(v, tuple):
                walk(v, (*path, k))
                continue
            layer = path[:-1] if path and re.fullmatch(r"DotGeneral_\d+", path[-1]) else path
            for call_i, st in enumerate(v):
                shape = jnp.shape(st["fprop"]["rel_error"])  # the scan axes
                for index in np.ndindex(*shape):
                    name = name_fn(layer, tuple(int(i) for i in index))
                    name += f"#{call_i + 1}" if call_i else ""
                    out[name] = jax.tree.map(lambda a, i=index: a[i], st)

    walk(dict(state.get(STATS_COLLECTION, {})), ())
    for full, st in p.stats.items():
        base, _, n = full.partition("#")
        name = name_fn(tuple(base.split("/")), ()) + (f"#{n}" if n else "")
        if name in out:  # the path of a product measured above (two layers sharing one
            stem, k = name.partition("#")[0], 2  # scope, nn.share_scope): the next call
            while f"{stem}#{k}" in out:
                k += 1
            name = f"{stem}#{k}"
        out[name] = st
    return out


def flatten_stats(stats: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """One layer's ``gemm_stats`` result as plain floats, operand stats prefixed:
    ``{"fprop": {"rel_error": ..., "lhs.underflow": ..., "rhs.amax": ...}, ...}`` (the form
    of the layers of a ``metrics.jsonl`` ``"stats"`` record; non-finite values stay floats,
    written by ``json`` as ``NaN``/``Infinity``)."""
    flat: dict[str, dict[str, float]] = {}
    for gemm, g in stats.items():
        row: dict[str, float] = {}
        for k, v in g.items():
            if isinstance(v, Mapping):
                row.update({f"{k}.{s}": float(x) for s, x in v.items()})
            else:
                row[k] = float(v)
        flat[gemm] = row
    return flat


def read_stats(path: str | os.PathLike) -> list[dict]:
    """The ``"stats"`` records of a ``metrics.jsonl`` (a file, or the run directory holding
    it), in file order: ``{"type": "stats", "step": s, "layers": {name: {gemm: {stat:
    float}}}, ...}``. Lines that do not parse (a torn last record) are skipped."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    recs = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("type") == "stats" and "layers" in rec:
                recs.append(rec)
    return recs


def stats_from_metrics(path: str | os.PathLike, step: int | None = None
                       ) -> dict[str, dict[str, dict[str, float]]]:
    """The per-layer statistics of the last ``"stats"`` record of a run's ``metrics.jsonl``
    (or of the one at ``step``), ready for ``recommend_high_precision_layers``::

        recommend_high_precision_layers(stats_from_metrics("runs/nvfp4"), budget=0.15)

    Raises:
      ValueError: the file holds no stats record (run with ``--stats-every N``), or none at
        ``step``.
    """
    recs = read_stats(path)
    if step is not None:
        recs = [r for r in recs if r["step"] == step]
    if not recs:
        at = f" at step {step}" if step is not None else ""
        raise ValueError(f"{os.fspath(path)}: no per-layer stats record{at} (train with "
                         "fp4jax-train --stats-every N)")
    return recs[-1]["layers"]


def recommend_high_precision_layers(stats: dict[str, dict], budget: float = 0.15, *,
                                    rules: bool = False) -> list[Any]:
    """The layers to keep in high precision: the ``floor(budget * len(stats))`` layers with
    the largest measured error, ranked by wgrad error, then dgrad, then fprop.

    Args:
      stats: ``{layer name: gemm_stats(...) result}`` (values may be arrays or floats; the
        flattened form of ``flatten_stats``/``stats_from_metrics`` works too).
      budget: the fraction of layers that may stay in high precision, in [0, 1].

    Returns:
      layer names, largest error first, as ``stats`` names them (``layer_stats`` of the
      harness's Llama: ``"block_3/q"``; ``fp4jax.models.llama.policy_layer_name`` turns those
      into ``PrecisionPolicy.high_precision_layers`` patterns). With ``rules=True``, the
      same as ``fp4jax.nn.Rule(re.escape(path), None)`` (high precision) for
      ``fp4jax.nn.quantize_model``, to put before the model's other rules; a name's scan
      index (``"[3]"``) and call suffix (``"#2"``) are dropped: a rule names a module path,
      and every iteration of a scan shares its module's.
    """
    if not 0.0 <= budget <= 1.0 or math.isnan(budget):
        raise ValueError(f"budget must be a fraction in [0, 1], got {budget!r}")
    n = math.floor(budget * len(stats) + 1e-9)

    def rank(name: str) -> tuple[float, ...]:
        s = stats[name]
        return tuple(-float(s[g]["rel_error"]) for g in ("wgrad", "dgrad", "fprop"))

    names = sorted(stats, key=lambda name: (rank(name), name))[:n]
    if not rules:
        return names
    out: list[Any] = []
    for name in names:
        path = re.sub(r"(\[\d+\])+$", "", name.split("#", 1)[0])
        if all(r.pattern != re.escape(path) for r in out):
            out.append(Rule(re.escape(path), None))
    return out


def mean_layer_stats(records: list[Mapping[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """The per-layer statistics of several ``"stats"`` records (``read_stats``) averaged:
    ``{layer: {gemm: {stat: mean over the records that measured it}}}`` (NaN and infinite
    values are left out of a mean; a statistic with no finite value is NaN). The record at
    step 0, taken on the untrained initialization, is left out when later ones exist.

    Raises:
      ValueError: no records.
    """
    if not records:
        raise ValueError("mean_layer_stats: no stats records (train with --stats-every N)")
    recs = [r for r in records if r.get("step", 0) > 0] or list(records)
    sums: dict[str, dict[str, dict[str, list[float]]]] = {}
    for r in recs:
        for name, layer in r["layers"].items():
            for gemm, row in layer.items():
                for k, v in row.items():
                    sums.setdefault(name, {}).setdefault(gemm, {}).setdefault(k, []).append(
                        float(v))
    return {name: {gemm: {k: (float(np.mean([x for x in v if math.isfinite(x)]))
                              if any(math.isfinite(x) for x in v) else math.nan)
                          for k, v in row.items()} for gemm, row in layer.items()}
            for name, layer in sums.items()}


def _noise_entry(g_sq: jax.Array, e_sq: jax.Array, q_sq: jax.Array, d: int
                 ) -> dict[str, jax.Array]:
    """The monitor's numbers from ``||grad||^2``, ``||eps||^2``, ``||grad_q||^2`` and ``d``."""
    g_norm, e_norm = jnp.sqrt(g_sq), jnp.sqrt(e_sq)
    sigma = jnp.sqrt(e_sq / d)
    ratio = jnp.where(e_norm > 0, g_norm / jnp.where(e_norm > 0, e_norm, 1.0),
                      jnp.where(g_norm > 0, jnp.inf, jnp.nan))
    # d exactly (an int32 while it fits, the count of a ~1e9-parameter model as float32)
    return {"ratio": ratio, "grad_norm": g_norm, "noise_norm": e_norm, "sigma_q": sigma,
            "grad_q_norm": jnp.sqrt(q_sq),
            "d": jnp.asarray(d, jnp.int32 if d < 2**31 else jnp.float32)}


def _owned(owners: Mapping[str, set[int] | None], keys: tuple[str, ...],
           shape: tuple[int, ...], scan_axes: Any) -> bool:
    """Whether the parameter at ``keys`` (not a ``"kernel"``) is a weight of one of the
    linear layers ``owners`` (``gradient_noise``'s ``layers``): directly under a layer's
    path, not a ``"bias"``, and (where the layer's weight shapes are known) as many
    elements, past the scanned axes, as one of them."""
    path = "/".join(keys[:-1])
    if path not in owners or keys[-1] == "bias":
        return False
    sizes = owners[path]
    if sizes is None:
        return True
    lead = len(shape) - 2 if scan_axes is None else int(scan_axes(keys[:-1], tuple(shape)))
    return int(np.prod(shape[lead:])) in sizes


def gradient_noise(grads: Any, grads_q: Any, *,
                   name_fn: Callable[[tuple[str, ...], tuple[int, ...]], str] | None = None,
                   scan_axes: Callable[[tuple[str, ...], tuple[int, ...]], int] | None = None,
                   layers: Iterable[str] | None = None) -> dict[str, Any]:
    """The gradient-to-noise ratio of FP4-all-the-way (Chmiel et al. 2025, Section 4.1 and
    Appendix B.1), globally and per layer. Traceable: call it inside ``jax.jit``.

    The paper models the quantized gradient of the parameters ``theta`` in ``R^d`` as
    ``g_q = grad L + eps`` with stochastic-rounding noise ``E[eps] = 0``,
    ``E[eps eps^T] = sigma_q^2 I``, and shows that quantized training stops making progress
    once ``r = ||grad L||_2 / (sigma_q sqrt(d)) < sqrt(3)`` (Section 4.1; "we monitor the ratio
    ||grad L|| / (sigma_q sqrt(d))", Section 4.2, Figure 5). Measured here on one batch:

    * ``grad L`` = ``grads``: the full-precision gradient, i.e. the same step's gradient
      (same parameters, batch, forward pass and keys) with the backward GEMMs (dgrad, wgrad)
      in high precision: what a switch of the backward pass (QAF) would use;
    * ``eps = grads_q - grads``: ``grads_q`` the gradient of the recipe's quantized backward
      pass (the train step's own), so ``eps`` is all the noise that the backward pass's
      quantization adds, propagated through the dgrad chain as in training;
    * ``d``: the number of coordinates (all parameters for ``"global"``; a layer's kernel
      elements for ``"layers"``);
    * ``sigma_q^2 = (1/d) sum_i eps_i^2``: the measured variance of the noise with its mean
      known to be 0 (the paper's assumption for SR), so ``sigma_q sqrt(d) = ||eps||_2`` and
      ``r = ||grads|| / ||grads_q - grads||``: the inverse relative error of the gradient.

    With round-to-nearest gradients ``eps`` is biased, not the zero-mean noise the threshold
    assumes (the paper's Appendix B.2): the number is still computed, its meaning differs.

    Args:
      grads: the high-precision-backward gradient, a pytree of float arrays.
      grads_q: the quantized-backward gradient, the same structure.
      name_fn: ``name_fn(path, index) -> str`` names a layer from the path of its
        ``"kernel"`` leaf (without ``"kernel"``) and, for a kernel with leading axes
        (``flax.linen.scan``: ``(n, K, N)``), the index along them (as for ``layer_stats``;
        default ``"/".join(path)`` plus ``"[i]"``). Boxed parameters
        (``nn.LogicallyPartitioned``, an ``nnx.State``'s variables) are named by the
        path of the box (a trailing ``.value`` is dropped); the gradients of a whole
        variables dict name their layers as its ``"params"``' (a leading ``"params"``
        dropped: the names of ``layer_stats``, ``report`` and the rules).
      scan_axes: ``scan_axes(path, shape) -> n``: how many leading axes of the kernel at
        ``path`` (as for ``name_fn``) stack scanned layers. Default: every axis before
        the last two (fp4jax's Llama, whose kernels are 2-D); for a model with
        multi-axis kernels (``DenseGeneral``) pass ``fp4jax.nn.report(...).scan_axes``,
        which splits only the stacks of actual scans.
      layers: the module paths of the model's linear layers (``fp4jax.nn.report(...)
        .layers``, whose weight shapes are then checked): every parameter of 2 or more
        dimensions directly under one of them (not a ``"bias"``) is a layer's weight too,
        whatever its name (``self.param("w")`` multiplied in the
        module's own code, an einsum's weight, the second weight of a shared scope, a tied
        embedding), named ``name_fn(path, index) + ":" + leaf`` (``"h_0/ffn:w_down"``),
        its leading axes split as a kernel's. None: ``"kernel"`` leaves only.

    Returns:
      ``{"global": entry, "layers": {name: entry}}``, each entry ``{"ratio", "grad_norm"
      (||grads||), "noise_norm" (||eps||), "sigma_q", "grad_q_norm" (||grads_q||), "d"}``
      (float32 scalars, ``d`` an int32), ``ratio`` infinite
      where the noise is 0 (a layer kept in high precision whose gradient no quantized
      GEMM reaches) and NaN where both are 0. ``"layers"`` holds every ``"kernel"`` leaf
      (2D or more), and the weights under ``layers``.

    Raises:
      ValueError: the two pytrees differ in structure or shapes.
    """
    name_fn = name_fn or _default_name
    # the weights' sizes of each layer path (a report's "weights" shapes; None: any size)
    owners: dict[str, set[int] | None] = {}
    for p in layers if layers is not None else ():
        info = layers[p] if isinstance(layers, Mapping) else None
        ws = info.get("weights") if isinstance(info, Mapping) else None
        owners[str(p)] = ({int(np.prod(w)) for w in ws} if ws else None)
    # the gradients of a whole variables dict ({"params": ...}) name their layers as those
    # of its parameters (the names of layer_stats, report and the rules)
    variables = isinstance(grads, Mapping) and "params" in grads
    leaves, tree = jax.tree_util.tree_flatten_with_path(grads)
    leaves_q, tree_q = jax.tree_util.tree_flatten(grads_q)
    if tree != tree_q or any(jnp.shape(a) != jnp.shape(b[1]) for a, b in zip(leaves_q, leaves,
                                                                             strict=True)):
        raise ValueError("gradient_noise: grads and grads_q must have the same structure and "
                         "shapes (the same model's parameters)")
    g_tot = e_tot = q_tot = jnp.zeros((), jnp.float32)
    d_tot = 0
    out: dict[str, dict] = {}
    for (path, g), gq in zip(leaves, leaves_q, strict=True):
        g32, q32 = jnp.asarray(g, jnp.float32), jnp.asarray(gq, jnp.float32)
        e32 = q32 - g32
        keys = tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                     for k in path)
        while keys and keys[-1] in ("value", "raw_value"):  # a box's (or Variable's) leaf
            keys = keys[:-1]
        if variables and keys[:1] == ("params",):  # a variables dict: named as its params
            keys = keys[1:]
        kernel = bool(keys) and keys[-1] == "kernel"
        if g32.ndim >= 2 and keys and (kernel or _owned(owners, keys, g32.shape, scan_axes)):
            lead = (g32.ndim - 2 if scan_axes is None
                    else int(scan_axes(keys[:-1], tuple(g32.shape))))
            if not 0 <= lead <= g32.ndim - 1:
                raise ValueError(f"gradient_noise: scan_axes gave {lead} for the kernel "
                                 f"{'/'.join(keys)} of shape {g32.shape}")
            inner = tuple(range(lead, g32.ndim))
            gs, es, qs = (jnp.sum(jnp.square(a), axis=inner) for a in (g32, e32, q32))
            n = int(np.prod(g32.shape[lead:]))
            for index in np.ndindex(*g32.shape[:lead]):
                name = name_fn(keys[:-1], tuple(int(i) for i in index))
                out[name if kernel else f"{name}:{keys[-1]}"] = _noise_entry(
                    gs[index], es[index], qs[index], n)
        g_tot = g_tot + jnp.sum(jnp.square(g32))
        e_tot = e_tot + jnp.sum(jnp.square(e32))
        q_tot = q_tot + jnp.sum(jnp.square(q32))
        d_tot += int(np.prod(g32.shape))
    return {"global": _noise_entry(g_tot, e_tot, q_tot, max(d_tot, 1)), "layers": out}


def flatten_noise(result: Mapping[str, Any]) -> dict[str, Any]:
    """A ``gradient_noise`` result as plain numbers, the global entry at the top level:
    ``{"ratio", "grad_norm", "noise_norm", "sigma_q", "grad_q_norm", "d", "layers": {name:
    {...}}}`` (the
    form of a ``metrics.jsonl`` ``"grad_noise"`` record; ``d`` an int)."""
    def one(e: Mapping[str, Any]) -> dict[str, Any]:
        return {k: (int(round(float(v))) if k == "d" else float(v)) for k, v in e.items()}

    return {**one(result["global"]),
            "layers": {name: one(e) for name, e in result["layers"].items()}}


def combine_noise(entries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The ``gradient_noise`` entry of the union of disjoint parameter groups, from their
    flattened entries (``flatten_noise``): norms combine as root sums of squares, ``d`` adds
    up, ``ratio = ||grads|| / ||eps||`` (e.g. the ratio over the layers a recipe quantizes,
    beside the global one over every parameter). Empty: NaN norms, ``d`` 0."""
    def rss(k: str) -> float:
        return math.sqrt(sum(float(e[k]) ** 2 for e in entries)) if entries else math.nan

    g, e, q = rss("grad_norm"), rss("noise_norm"), rss("grad_q_norm")
    d = sum(int(x["d"]) for x in entries)
    ratio = g / e if e > 0 else (math.inf if g > 0 else math.nan)
    return {"ratio": ratio, "grad_norm": g, "noise_norm": e,
            "sigma_q": e / math.sqrt(d) if d else math.nan, "grad_q_norm": q, "d": d}


@dataclasses.dataclass
class SwitchMonitor:
    """The automatic precision switch's decision (``fp4jax-train --switch-at auto``): fed
    the gradient-to-noise ratio measured every few steps (``update``), it fires at the
    first measurement at which the ratio has stayed below ``threshold`` for ``window``
    steps: the measurements at steps ``a, ..., s`` are all below it (none above in between)
    and ``s - a >= window``. A NaN ratio counts as not below, an infinite one too. It fires
    once; the state (``state``/``from_state``) is a small JSON dict, kept in checkpoints so a
    resumed run continues the same decision.

    Attributes:
      threshold: the ratio below which quantized gradients stop helping (default
        ``sqrt(3)``, FP4-all-the-way Section 4.1).
      window: steps the ratio must stay below the threshold (0: the first measurement
        below it fires).
      below_since: step of the first measurement of the current run below the threshold.
      switched_at: the step it fired at (None: not yet).
      last_step: the step of the last measurement fed.
    """

    threshold: float = SQRT3
    window: int = 0
    below_since: int | None = None
    switched_at: int | None = None
    last_step: int | None = None

    def __post_init__(self) -> None:
        t = self.threshold
        if not (isinstance(t, numbers.Real) and not isinstance(t, bool) and math.isfinite(t)
                and t > 0):
            raise ValueError(f"SwitchMonitor: threshold must be a finite number > 0, got "
                             f"{self.threshold!r}")
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 0:
            raise ValueError(f"SwitchMonitor: window must be an integer >= 0, got "
                             f"{self.window!r}")

    def update(self, step: int, ratio: float) -> bool:
        """Feeds the ratio measured at ``step``; True when the switch fires at this step
        (then, and after it fired, further measurements change nothing).

        Raises:
          ValueError: ``step`` is not after the last one fed.
        """
        if self.switched_at is not None:
            return False
        if self.last_step is not None and step <= self.last_step:
            raise ValueError(f"SwitchMonitor.update: step {step} is not after the last "
                             f"measurement's ({self.last_step})")
        self.last_step = step
        if not float(ratio) < self.threshold:  # NaN: not below
            self.below_since = None
            return False
        if self.below_since is None:
            self.below_since = step
        if step - self.below_since >= self.window:
            self.switched_at = step
            return True
        return False

    def state(self) -> dict[str, Any]:
        """The monitor as a JSON-ready dict (``from_state`` reads it back)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> SwitchMonitor:
        return cls(**{f.name: state[f.name] for f in dataclasses.fields(cls)
                      if f.name in state})


def auto_switch_step(trace: Sequence[tuple[int, float]], threshold: float = SQRT3,
                     window: int = 0) -> int | None:
    """The step at which ``SwitchMonitor(threshold, window)`` fires on the measurements
    ``trace`` (``(step, ratio)`` pairs, steps increasing), or None when it does not."""
    m = SwitchMonitor(threshold, window)
    for step, ratio in trace:
        if m.update(step, ratio):
            return step
    return None
