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

**Where the code is.** This module holds ``quantize_model`` (and re-exports ``report`` and
``Report``); ``fp4jax.nn.hooks`` the hooks, the product handling and linen's side
(``nn.intercept_methods``, the ``nn.scan``s around a module); ``fp4jax.nn.nnx_rewrite``
the NNX graph rewriting; ``fp4jax.nn.layer_report`` the report (``report``, ``Report``).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
from flax import nnx

from fp4jax.nn import linen as fnn
from fp4jax.nn.hooks import Session, quantize_linen
from fp4jax.nn.layer_report import Report, report
from fp4jax.nn.nnx_rewrite import quantize_nnx
from fp4jax.nn.taps import DEFAULT_TAPS, check_taps
from fp4jax.rules import as_rules

__all__ = ["Report", "quantize_model", "report"]


def quantize_model(model: Any, rules: Any, *, rngs: Any = None,
                   rng_collection: str = fnn.DEFAULT_RNG_STREAM,
                   layer_rng_collection: str = fnn.DEFAULT_LAYER_RNG_STREAM,
                   taps: tuple[Any, ...] = DEFAULT_TAPS) -> Any:
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
      taps: linen only: the product taps run around every quantized product
        (``fp4jax.nn.taps``; default ``DEFAULT_TAPS``, the statistics and OutControl's).
        Other taps need the product to run through a ``DotGeneral`` submodule: a
        setup-style layer (no submodule at call time) refuses them at its call.

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
    taps = check_taps(taps, "quantize_model")
    if taps != DEFAULT_TAPS and not isinstance(model, nn.Module):
        raise ValueError("quantize_model: taps are for linen models (the NNX DotGeneral "
                         "runs no taps); leave taps at its default for an NNX model")
    session = Session(rules_t, rng_collection, layer_rng_collection, taps=taps)
    if isinstance(model, nn.Module):
        if rngs is not None:
            raise ValueError("quantize_model: rngs is for NNX models; a linen model draws "
                             f"its keys from apply(..., rngs={{{rng_collection!r}: key}})")
        if model.scope is not None:
            raise ValueError("quantize_model: model must be an unbound linen Module "
                             "(not one bound with .bind or inside another's method)")
        return quantize_linen(model, session)
    if isinstance(model, nnx.Module):
        return quantize_nnx(model, session, rngs)
    raise ValueError(f"quantize_model: model must be a flax.linen.Module or an nnx.Module, "
                     f"got {type(model).__name__}")

