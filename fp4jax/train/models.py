"""The model of a training run and its precision: which model trains (fp4jax's Llama, the
default), the recipe of each of its linear layers, and the precision switch.

* ``RunModels``: the run's model before and after its precision switch (``models[False]``,
  ``models[True]``), each with ``init``/``apply`` as a flax linen module, with what the loop
  says about them (parameter count, which layers are quantized) and how the measurements
  name their layers. ``llama_models`` builds it for the built-in Llama.
* ``PrecisionSwitch``: the step from which the switched model trains (``--switch-at``, a
  fraction, or ``auto``: the gradient-to-noise monitor, ``diagnostics.SwitchMonitor``).
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import fp4jax.recipes
from fp4jax import diagnostics
from fp4jax.models.llama import (
    LlamaConfig,
    every_block_attention,
    layer_name,
    layer_order,
    llama_rules,
    policy_rules,
    quantized_llama,
    scan_runs,
)
from fp4jax.recipes import Recipe, recipe_quantizes
from fp4jax.rules import (
    Rule,
    as_rules,
    block_rule,
    high_precision_rules,
    load_rules,
    match_rule,
    replace_quantizing,
    rule_recipe,
    rules_quantize,
)
from fp4jax.train import precision
from fp4jax.train.config import (
    TrainConfig,
    explicit_bf16_layers,
    gradient_noise_problem,
    last_bf16_blocks,
    make_policy,
    switched_recipe,
)


def quantized_backward(recipe: Recipe | None) -> bool:
    """Whether ``recipe`` quantizes a backward GEMM (else its gradients carry no
    quantization noise to measure)."""
    return recipe is not None and (recipe.dgrad.quantized or recipe.wgrad.quantized)


@dataclasses.dataclass
class RunModels:
    """The model of a run, before and after its precision switch.

    Attributes:
      models: ``{False: model, True: the model with switched_recipe(recipe, switch)}``,
        each with linen's ``init(rngs, tokens)`` and ``apply({"params": p}, tokens,
        rngs=...) -> logits (B, T, vocab)``.
      recipes: the recipe of each (its quantized layers').
      rcfg: the run's config with its spec's run-level keys and the resolved BF16 layers
        applied.
      bf16: the ``--bf16-layers`` record (``precision.resolve_bf16_layers``) or None.
      describe: what the header says of the model (``"0.82M params (tiny, relu2,
        bfloat16)"``).
      summary: which linear layers run quantized (one line, also ``result.json``'s
        ``"policy"``).
      hp_backward: ``hp_backward(switched)``: that model with its backward GEMMs in high
        precision (the reference of the gradient-to-noise ratio).
      fp4_names: the layers whose recipe quantizes a GEMM (as the measurements name them).
      name_fn, order: the measurements' layer names (``diagnostics.layer_stats``'s
        ``name_fn``) and their sort key.
      gemm_fraction: ``gemm_fraction(steps, switch_step)``: the fraction of the linear
        layers' GEMM work in high precision (``precision.bf16_gemm_fraction``).
      flat_kernels: the gradient-to-noise ratio takes each kernel as one layer
        (``steps.flat_kernels``: a foreign model whose scanned stacks are not known).
      layers: what the model's linear layers run, ``{path: recipe spec or None}`` (a
        foreign model; written as the run's ``"precision"`` record), or None.
      layer_recipes: the same as recipe objects, ``{path: Recipe or None}`` (what the run's
        checks read: the specs of ``layers`` are a record, not parsed back), or None.
      scan_axes: ``scan_axes(path, shape) -> n`` for ``diagnostics.gradient_noise``: how
        many leading axes of a kernel stack scanned layers (a foreign model:
        ``fp4jax.nn.report(...).scan_axes``), or None.
      weight_layers: ``weight_layers(switched) -> {kernel path: (recipe, weight shape,
        reason or None)}`` of ``models[switched]`` (``llama_weight_layers``: what
        ``--fp4-param-gather`` plans from, ``parallel.fp4_gather_plan``), or None (a
        foreign model).
    """

    models: dict[bool, Any]
    recipes: dict[bool, Recipe]
    rcfg: TrainConfig
    bf16: dict | None
    describe: str
    summary: str
    hp_backward: Callable[[bool], Any]
    fp4_names: list[str]
    name_fn: Callable[[tuple[str, ...], tuple[int, ...]], str]
    order: Callable[[str], Any]
    gemm_fraction: Callable[[int, int], float | None]
    flat_kernels: bool = False
    layers: dict[str, str | None] | None = None
    scan_axes: Callable[[tuple[str, ...], tuple[int, ...]], int] | None = None
    weight_layers: Callable[[bool], dict[str, tuple[Any, tuple[int, ...], str | None]]] | None \
        = None
    layer_recipes: dict[str, Recipe | None] | None = None


def llama_weight_layers(mc: LlamaConfig, model: Any, rules: Sequence[Rule], seq_len: int
                        ) -> dict[str, tuple[Recipe | None, tuple[int, ...], str | None]]:
    """The linear layers of ``model`` (a Llama of ``mc`` under ``fp4jax.nn.quantize_model``
    with ``rules``), by the path of their kernel (``"block_0/q/kernel"``,
    ``"blocks_0_3/block/q/kernel"`` for a scanned stack): ``(recipe or None, the weight
    shape their product uses, why the kernel is not what the product quantizes, or
    None)``, from ``fp4jax.nn.report`` (one abstract trace). The Llama's layers multiply
    their kernel as it is stored, cast to the compute dtype, except Smooth-SwiGLU's down
    projection (``ChannelScaledDense``), whose kernel is divided by a per-channel scale
    first. A mixture of experts' kernel ``(G, K, N)`` (``fp4jax.ragged_dot``: every expert
    its own ``fp4jax.dot``) is listed with the expert's weight shape ``(K, N)``, its
    leading axis stacking matrices quantized each on its own."""
    from fp4jax import nn as fnn

    rep = fnn.report(model, jnp.zeros((1, seq_len), jnp.int32))
    out = {}
    for path, d in rep.layers.items():
        j = d["rule"]
        known = j is None or j < len(rules)
        recipe = rules[j].recipe if known and j is not None else None
        if not known or getattr(recipe, "name", None) != d["recipe"]:
            raise ValueError(f"llama_weight_layers: rule {d['rule']} of the rules given is not "
                             f"the one that quantized {path!r} ({d['recipe']!r}): pass the "
                             "rules the model was built with (llama_rules)")
        why = None
        if mc.ffn == "smooth_swiglu" and path.rsplit("/", 1)[-1] == "down":
            why = ("Smooth-SwiGLU divides its kernel by a per-channel scale before the "
                   "product")
        weight = tuple(d["weight"])
        if d["op"] == "ragged_dot":  # experts (G, K, N): each its own fp4jax.dot of (K, N)
            weight = weight[1:]
        out[f"{path}/kernel"] = (recipe, weight, why)
    return out


def llama_models(cfg: TrainConfig, rcfg: TrainConfig, recipe: Recipe, mc: LlamaConfig,
                 train: Callable[..., dict], dataset: Any) -> RunModels:
    """The built-in Llama of ``mc`` under the run's precision policy (``make_policy``:
    first/last BF16 blocks, ``--bf16-layers``, resolved here: ``auto`` runs an FP4 warm-up
    with ``train`` on ``dataset``), and the same model after its precision switch."""
    # --bf16-layers: names, or measured once (auto: an FP4 warm-up sub-run; resumed: the
    # recorded set); rcfg then names them, its BF16 blocks explicit
    bf16 = precision.resolve_bf16_layers(cfg, rcfg, recipe, mc, train, dataset)
    if bf16 is not None:
        rcfg = rcfg.replace(last_bf16=last_bf16_blocks(rcfg, mc.n_layers),
                            bf16_layers=",".join(bf16["layers"]) or None)
    policy = make_policy(rcfg, mc, recipe)
    policies = {False: policy,
                True: policy.replace(recipe=switched_recipe(recipe, rcfg.switch))}
    # the run's rules, built once (by block-level path: fp4jax.models.llama.policy_rules),
    # before and after the switch and with the backward GEMMs in high precision (the
    # gradient-to-noise reference); the plain Llama runs under them
    # (fp4jax.nn.quantize_model). The models share their parameters, so their scanned
    # runs are those of the run's own rules. --attn-recipe: FP4 attention in every block,
    # before and after the switch (which moves the linear layers only)
    rules = {k: policy_rules(mc, p) for k, p in policies.items()}
    hp_rules = {k: policy_rules(mc, p.replace(recipe=switched_recipe(p.recipe, "bwd")))
                for k, p in policies.items()}
    attn = every_block_attention(rcfg.attn_recipe)
    runs = scan_runs(mc, (*rules[False], *attn))
    models = {k: quantized_llama(mc, rs, runs, attn) for k, rs in rules.items()}

    def hp_backward(switched: bool) -> Any:
        return quantized_llama(mc, hp_rules[switched], runs, attn)

    def weight_layers(switched: bool) -> dict:  # the rules quantized_llama built it with
        built = llama_rules(mc, (*rules[switched], *attn), runs)
        return llama_weight_layers(mc, models[switched], built, rcfg.seq_len)

    return RunModels(
        models=models, recipes={k: p.recipe for k, p in policies.items()}, rcfg=rcfg,
        bf16=bf16, describe=(f"{mc.num_params() / 1e6:.2f}M params ({cfg.preset}, {mc.ffn}, "
                             f"{mc.dtype})" + (f"; FP4 attention {attn[0].recipe.name}"
                                               if attn else "")),
        summary=policy.summary(mc.n_layers, mc.linear_layers), hp_backward=hp_backward,
        fp4_names=precision.fp4_layer_names(mc, rules[False]), name_fn=layer_name,
        order=layer_order,
        gemm_fraction=lambda steps, switch_step: precision.bf16_gemm_fraction(
            mc, rules[False], rules[True], steps, switch_step), weight_layers=weight_layers)


class PrecisionSwitch:
    """When a run switches to its switched model: ``switch_step`` (``steps + 1``: never),
    fixed by ``--switch-at FRACTION`` or decided on the measured gradient-to-noise ratio
    (``--switch-at auto``: ``monitor``)."""

    def __init__(self, rcfg: TrainConfig, steps: int) -> None:
        self.mode = rcfg.switch
        self.switch_at = rcfg.switch_at
        self.step = (steps + 1 if rcfg.switch_at in (None, "auto")
                     else int(round(rcfg.switch_at * steps)))
        if self.step >= steps:  # --switch-at 1.0 (or rounding to the end): never switches
            self.step = steps + 1
        self.steps = steps
        # --switch-at auto: the host-side decision on the measured gradient-to-noise ratio
        self.monitor = (diagnostics.SwitchMonitor(rcfg.switch_threshold, rcfg.switch_window)
                        if rcfg.switch_at == "auto" else None)

    def __call__(self, s: int) -> bool:
        """Whether step ``s`` runs the switched model."""
        return s >= self.step

    def restore(self, meta: dict, bf16: dict | None) -> None:
        """The auto switch's state from a checkpoint's ``meta`` (the switch step, if it
        fired), after checking that the checkpoint used the BF16 layers ``bf16``.

        Raises:
          ValueError: the checkpoint trained with other BF16 layers.
        """
        saved = meta.get("bf16_layers")
        if bf16 is not None and saved is not None and saved.get("layers") != bf16["layers"]:
            raise ValueError(f"refusing to resume: checkpoint {meta['step']} trained with BF16 "
                             f"layers {saved.get('layers')}, the run's record says "
                             f"{bf16['layers']} ({precision.RECORD} changed?)")
        if self.monitor is None:
            return
        st = meta.get("auto_switch") or {}
        self.monitor = diagnostics.SwitchMonitor(
            self.monitor.threshold, self.monitor.window,
            **{k: st.get(k) for k in ("below_since", "switched_at", "last_step")})
        if self.monitor.switched_at is not None:
            self.step = self.monitor.switched_at

    def state(self) -> dict | None:
        """The monitor's state, for checkpoints (None without ``--switch-at auto``)."""
        return self.monitor.state() if self.monitor is not None else None

    def observe(self, s: int, ratio: float, log: Any) -> bool:
        """Feeds the ratio measured at step ``s`` to the monitor; when it fires, the switch
        step becomes ``s``, a ``"switch"`` record is written to ``log`` and True returned."""
        m = self.monitor
        if m is None or not m.update(s, ratio):
            return False
        log.write({"type": "switch", "step": s, "mode": self.mode, "ratio": ratio,
                   "threshold": m.threshold, "window": m.window,
                   "below_since": m.below_since})
        log.say(f"step {s}: gradient-to-noise ratio {ratio:.3f} below {m.threshold:.4g} "
                f"since step {m.below_since}: switching {self.mode} to BF16 from step {s}")
        self.step = s
        return True

    def describe(self) -> str:
        """The header's words on the switch ("" without one)."""
        if self.step <= self.steps:
            return f"; switch {self.mode} to BF16 at step {self.step}"
        if self.monitor is not None:
            return (f"; switch {self.mode} to BF16 once the gradient-to-noise ratio stays "
                    f"below {self.monitor.threshold:.4g} for {self.monitor.window} steps")
        if self.switch_at is not None:
            return f"; switch_at {self.switch_at}: never switches (past the last step)"
        return ""


# --- a model that a factory returns (--model MODULE:FACTORY) -----------------------------

FACTORY_PROTOCOL = """\
``factory(vocab_size: int, seq_len: int, **model_args)`` returns the model: a
``flax.linen.Module`` (unbound), or, when the factory takes a ``rngs`` keyword, a
``flax.nnx.Module`` built with ``rngs`` (``nnx.Rngs`` with the ``params`` stream seeded
from ``--seed``). Called on int32 token ids ``(batch, seq_len)``, the model returns logits
``(batch, seq_len, vocab_size)`` of any float dtype (the loss takes them in float32).
A model that returns a structure (a dataclass, a tuple) or needs other inputs
(positions, a mask): the factory returns ``(model, call)`` with ``call(model, tokens) ->
logits``; linen: run inside the model (``CalledModel``: the same parameters and layer
paths); NNX: called on the built model (``NnxModel.call``)."""


class CalledModel(nn.Module):
    """A linen ``model`` run by ``call(model, tokens) -> logits (B, T, vocab)`` (the
    factory's ``(model, call)``: make positions or a mask, take the logits out of a returned
    dataclass or tuple). The model shares this module's scope (``nn.share_scope``), so its
    parameter tree and module paths, which the rules match, are its own."""

    model: nn.Module
    call: Callable[[Any, jax.Array], jax.Array]

    def setup(self) -> None:
        nn.share_scope(self, self.model)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.call(self.model, tokens)


def load_factory(spec: str) -> Callable[..., Any]:
    """The factory named by ``MODULE:FACTORY``: ``MODULE`` a dotted module importable from
    the current directory (``mypkg.models``) or a Python file (``path/to/model.py``, run
    with its folder on ``sys.path``, so that it imports its sibling modules), ``FACTORY`` a
    callable in it (dotted for an attribute of an attribute).

    Raises:
      ValueError: ``spec`` is not ``MODULE:FACTORY``, the module does not import or the
        factory is not there or not callable.
    """
    import importlib
    import os
    import runpy
    import sys

    where, colon, name = str(spec).rpartition(":")
    if not colon or not where or not name:
        raise ValueError(f"--model {spec!r}: give MODULE:FACTORY, e.g. mymodels:build or "
                         "path/to/model.py:build")
    try:
        if where.endswith(".py") or os.sep in where or "/" in where:
            path = os.path.abspath(os.path.expanduser(where))
            if not os.path.isfile(path):
                raise ValueError(f"--model {spec!r}: no file {path}")
            if os.path.dirname(path) not in sys.path:  # its sibling modules import, as
                sys.path.insert(0, os.path.dirname(path))  # when the file runs as a script
            namespace: Any = runpy.run_path(path, run_name=f"fp4jax_model_{abs(hash(path))}")
            obj = namespace.get(name.split(".")[0], None)
            rest = name.split(".")[1:]
        else:
            if os.getcwd() not in sys.path and "" not in sys.path:  # as `python -m` does
                sys.path.insert(0, os.getcwd())
            obj = importlib.import_module(where)
            rest = name.split(".")
        for part in rest:
            obj = getattr(obj, part, None)
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(f"--model {spec!r}: {where} does not import: "
                         f"{type(e).__name__}: {e}") from e
    if obj is None or not callable(obj):
        raise ValueError(f"--model {spec!r}: {where} has no callable {name!r}")
    return obj


def model_kwargs(text: str | None) -> dict[str, Any]:
    """The keyword arguments of ``--model-args`` (a JSON object; None: none).

    Raises:
      ValueError: not a JSON object.
    """
    import json

    if text is None:
        return {}
    try:
        v = json.loads(text)
    except ValueError as e:
        raise ValueError(f"must be a JSON object such as '{{\"d_model\": 64}}': {e}") from None
    if not isinstance(v, dict):
        raise ValueError(f"must be a JSON object such as '{{\"d_model\": 64}}', got {text!r}")
    return v


def takes_rngs(factory: Callable[..., Any]) -> bool:
    """Whether ``factory`` names a ``rngs`` parameter (then it builds an NNX model)."""
    import inspect

    try:
        return "rngs" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


def _str_keys(tree: Any) -> Any:
    """``tree``'s nested dicts with every key a string (NNX list indices ``0`` -> ``"0"``),
    as orbax checkpoints keep them."""
    if isinstance(tree, dict):
        return {str(k): _str_keys(v) for k, v in tree.items()}
    return tree


class NnxModel:
    """An NNX model as a pure function with linen's ``init``/``apply``, so the harness
    trains it like a linen module.

    ``build(rngs) -> nnx.Module`` builds the model (the factory's); ``call(module, tokens)
    -> logits`` runs it (None: ``module(tokens)``; the factory's ``(model, call)``);
    ``quantize(module,
    rngs) -> module`` (None: none) puts it under the run's rules at every call
    (``fp4jax.nn.quantize_model(module, rules, rngs=nnx.Rngs(**rngs))``), so its layers'
    stochastic-rounding streams are seeded from the call's ``"fp4"`` key (distinct per
    layer, a new key every step) and their per-layer RHT keys from the run's constant
    ``"fp4_layer"`` key, as a linen model's ``make_rng`` draws them.

    The trained parameters are the model's ``nnx.Param`` variables, as a nested dict with
    string keys (``{"layers": {"0": {"q": {"kernel": ...}}}}``): ``init(key, tokens)``
    builds the model with ``nnx.Rngs(params=key)`` (inside ``jit``: nothing is materialized
    twice) and returns ``{"params": that dict}``; ``apply`` merges them into the model's
    graph and calls it. Any other variable of the built model must belong to an RNG stream
    (``nnx.Rngs`` kept by the model): at each call its key is the call's key of that stream
    (``rngs={"fp4": ..., "fp4_layer": ...}``; a stream the call does not name gets a fixed
    key) and its counter 0, so a step is a pure function of its keys.

    Raises (at construction):
      ValueError: the model holds variables other than parameters and RNG streams (batch
        statistics, caches): not supported by the harness.
    """

    def __init__(self, build: Callable[[Any], Any],
                 quantize: Callable[[Any, dict], Any] | None = None,
                 call: Callable[[Any, jax.Array], jax.Array] | None = None) -> None:
        from flax import nnx

        self.build, self.quantize, self.call = build, quantize, call
        abstract = nnx.eval_shape(lambda: build(nnx.Rngs(params=0)))
        self.graphdef, self.params, self.rest = nnx.split(abstract, nnx.Param, ...)
        other = sorted({type(v).__name__ for _, v in nnx.to_flat_state(self.rest)
                        if not isinstance(v, nnx.RngKey | nnx.RngCount)})
        if other:
            raise ValueError(f"--model: the NNX model holds variables other than nnx.Param "
                             f"and RNG streams ({', '.join(other)}): the harness trains "
                             "parameters only (no batch statistics or caches)")

    def init(self, rngs: Any, tokens: jax.Array) -> dict:
        """``{"params": ...}`` of a model built with ``nnx.Rngs(params=key)``."""
        from flax import nnx

        key = rngs["params"] if isinstance(rngs, dict) else rngs
        model = self.build(nnx.Rngs(params=key))
        state = nnx.state(model, nnx.Param)
        pure = nnx.to_pure_dict(state) if hasattr(nnx, "to_pure_dict") else state.to_pure_dict()
        return {"params": _str_keys(pure)}

    def module(self, params: Any, rngs: dict | None = None) -> Any:
        """The NNX model with ``params`` (as ``init`` returns them), its RNG streams keyed
        by ``rngs``, under the rules (``quantize``)."""
        from flax import nnx

        items = []
        for path, v in nnx.to_flat_state(self.params):
            d = params
            for k in path:
                d = d[str(k)]
            items.append((path, v.replace(value=d)))
        rngs = dict(rngs or {})
        fixed = jax.random.key(0)

        def fill(v: Any) -> Any:
            if isinstance(v, nnx.RngKey):
                return v.replace(value=rngs.get(v.tag, fixed))
            return v.replace(value=jnp.zeros((), jnp.uint32))

        rest = jax.tree.map(fill, self.rest, is_leaf=lambda v: isinstance(v, nnx.Variable))
        model = nnx.merge(self.graphdef, nnx.from_flat_state(items), rest)
        if self.quantize is not None:
            model = self.quantize(model, {k: rngs.get(k, fixed) for k in ("fp4", "fp4_layer")})
        return model

    def apply(self, variables: dict, tokens: jax.Array, rngs: dict | None = None) -> jax.Array:
        """The model's logits on ``tokens (B, T)`` int32 (through ``call`` if given)."""
        m = self.module(variables["params"], rngs)
        return m(tokens) if self.call is None else self.call(m, tokens)


# --- which layers of a foreign model run in which recipe ----------------------------------

HIGH_PRECISION_NAMES = r".*(embed|lm_head|logits).*"
"""The default rule's pattern of layers kept in high precision (embeddings, the LM head)."""


def linear_layers(params: Any) -> dict[str, tuple[int, ...]]:
    """``{module path: kernel shape}`` of every linear layer of a parameter tree: each
    ``"kernel"`` leaf of 2 or more dimensions (``Dense``, ``DenseGeneral``, ``Einsum``, NNX
    ``Linear``/``Einsum``), its path joined by ``/`` without ``"kernel"`` (linen: the
    module path; NNX: the attribute path, list indices included)."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
        if keys and keys[-1] == "kernel" and len(getattr(leaf, "shape", ())) >= 2:
            out["/".join(keys[:-1])] = tuple(leaf.shape)
    return out


_BLOCK_SEGMENT = re.compile(r"(?:(.*?)_)?(\d+)")


def find_blocks(layers: list[str]) -> tuple[str, int] | None:
    """The transformer blocks of a model, from its layer paths: ``(prefix, n)`` where block
    ``i``'s layers are ``prefix + str(i) + "/..."``, for the prefix that names the most
    layers among path segments ``NAME_i`` (linen ``block_3``, ``layers_3``) or ``i`` (NNX
    list ``layers/3``), when its indices are ``0..n-1`` with ``n >= 2``; else None (a
    ``nn.scan``'d stack has no index in its paths)."""
    groups: dict[str, set[int]] = {}
    for path in layers:
        segs = path.split("/")
        for j, seg in enumerate(segs[:-1]):
            m = _BLOCK_SEGMENT.fullmatch(seg)
            if m:
                head = "/".join(segs[:j])
                prefix = (head + "/" if head else "") + (m[1] + "_" if m[1] else "")
                groups.setdefault(prefix, set()).add(int(m[2]))
                break
    best = max(groups.items(), key=lambda kv: len(kv[1]), default=None)
    if best is None or len(best[1]) < 2 or best[1] != set(range(len(best[1]))):
        return None
    return best[0], len(best[1])


Rules = tuple[Rule, ...]
"""A run's precision rules (``fp4jax.rules.Rule``: ``re.fullmatch`` on the module path, the
first match wins), the harness's one currency for layer precision."""


def first_match(rules: Any, path: str) -> tuple[int, Any]:
    """Deprecated (one release): ``fp4jax.rules.match_rule`` / ``fp4jax.rules.rule_recipe``.
    The index and recipe of the first rule of ``rules`` (``Rule``s or ``(pattern, recipe)``
    pairs, ``fp4jax.rules.as_rules``) matching ``path`` (``(-1, None)``: none)."""
    warnings.warn("fp4jax.train.models.first_match is deprecated: use "
                  "fp4jax.rules.match_rule or fp4jax.rules.rule_recipe",
                  DeprecationWarning, stacklevel=2)
    rules = as_rules(rules)
    i = match_rule(rules, path)
    return (-1, None) if i is None else (i, rules[i].recipe)


def quantizes(rules: Any) -> bool:
    """Deprecated (one release): ``fp4jax.rules.rules_quantize``. Whether a rule of
    ``rules`` (``Rule``s or ``(pattern, recipe)`` pairs) has a recipe that quantizes."""
    warnings.warn("fp4jax.train.models.quantizes is deprecated: use "
                  "fp4jax.rules.rules_quantize", DeprecationWarning, stacklevel=2)
    return rules_quantize(as_rules(rules))


def read_rules(path: str) -> Rules:
    """The rules of a ``--rules`` file, read by ``fp4jax.rules.load_rules`` (JSON or TOML:
    a list of pattern -> recipe spec, null or ``"bf16"``-like specs for high precision).

    Raises:
      ValueError: the file does not exist or does not read (naming it and the format), or
        a rule gives an attention recipe (naming it).
    """
    rules = load_rules(path)
    for i, r in enumerate(rules):
        if r.attention:
            raise ValueError(f"--rules {path}: rule [{i}] {r.pattern!r} -> {r.spec} is an "
                             "attention recipe, which applies to fp4jax's own attention "
                             "(a --model runs its own): give its linear layers' recipe")
    return tuple(rules)


def default_rules(recipe: Recipe, layers: list[str], rcfg: TrainConfig,
                  file_rules: Any = ()) -> tuple[Rules, list[str]]:
    """A ``--model`` run's rules: the ``--bf16-layers`` names in high precision (an
    explicit or measured choice of layers wins over a rules file's patterns), then
    ``file_rules`` (those of ``--rules``; ``Rule``s or ``(pattern, recipe)`` pairs), then
    embeddings and the LM head (``HIGH_PRECISION_NAMES``), then the first ``--first-bf16``
    and last ``--last-bf16`` blocks where ``find_blocks`` recognizes them, then ``recipe``
    for every other layer. Returns ``(rules, notes)``; the notes say what the header
    reports (blocks not recognized).

    Raises:
      ValueError: ``--bf16-layers`` names a layer the model does not have, or
        ``--first-bf16``/``--last-bf16`` > 0 on a model whose blocks are not recognized.
    """
    notes: list[str] = []
    names = explicit_bf16_layers(rcfg.bf16_layers) or []
    unknown = [n for n in names if n not in layers]
    if unknown:
        raise ValueError(f"--bf16-layers: {unknown} are not linear layers of this model; its "
                         f"layers: {', '.join(layers)}")
    rules = [*high_precision_rules(names), *as_rules(file_rules, "--rules"),
             Rule(HIGH_PRECISION_NAMES, None)]
    blocks = find_blocks(layers)
    first = rcfg.first_bf16
    last = last_bf16_blocks(rcfg, blocks[1]) if blocks else max(rcfg.last_bf16, 0)
    if blocks is None:
        if first or last:
            raise ValueError(f"--first-bf16 {rcfg.first_bf16} / --last-bf16 {rcfg.last_bf16}: "
                             "the model's blocks are not recognized in its layer paths "
                             "(NAME_i/... or NAME/i/...; a scanned stack has no index): "
                             "give --first-bf16 0 --last-bf16 0 and name the layers in "
                             "--rules")
        if rcfg.last_bf16 < 0:
            notes.append("blocks not recognized: no first/last blocks in BF16")
    else:
        prefix, n = blocks
        hp = block_rule(prefix, sorted({*range(min(first, n)), *range(max(n - last, 0), n)}))
        if hp is not None:
            rules.append(hp)
    rules.append(Rule(".*", recipe))
    return tuple(rules), notes


def switched_rules(rules: Any, mode: str) -> Rules:
    """``rules`` (``Rule``s or ``(pattern, recipe)`` pairs) with every quantizing recipe
    switched (``switched_recipe(r, mode)``; ``fp4jax.rules.replace_quantizing``)."""
    return replace_quantizing(as_rules(rules), lambda r: switched_recipe(r, mode))


def quantized_model(model: Any, rules: Rules, rngs: dict | None = None) -> Any:
    """``fp4jax.nn.quantize_model(model, rules)`` (NNX: with ``rngs=nnx.Rngs(**rngs)``);
    ``model`` itself, unchanged, when no rule quantizes (``fp4jax.rules.rules_quantize``).
    """
    import fp4jax.nn

    if not rules_quantize(rules):
        return model
    kw = {}
    if rngs is not None:
        from flax import nnx

        kw["rngs"] = nnx.Rngs(**rngs)
    return fp4jax.nn.quantize_model(model, list(rules), **kw)


def listing_model(model: Any, build: Callable[[Any], Any] | None = None,
                  call: Callable[[Any, jax.Array], jax.Array] | None = None) -> Any:
    """``model`` under ``fp4jax.nn.quantize_model`` with one rule keeping every layer in
    high precision, for ``fp4jax.nn.report`` to list its linear layers (every product of a
    weight, whatever its name); NNX (``build``, the factory's ``build(rngs)``): an
    ``NnxModel`` doing so (run by ``call``, the factory's, if any)."""
    import fp4jax.nn

    listing = [Rule(".*", None)]
    if build is None:
        return fp4jax.nn.quantize_model(model, listing)
    from flax import nnx

    return NnxModel(build, lambda m, rngs: fp4jax.nn.quantize_model(
        m, listing, rngs=nnx.Rngs(**rngs)), call)


def reported_recipes(rep: Any, rules: Rules, layers: list[str]
                     ) -> dict[str, Recipe | None]:
    """``{layer: its recipe}``: the rule ``fp4jax.nn.report`` ``rep`` says took the layer
    (the model was quantized with ``rules``, or rules with the same patterns), else the
    first rule matching its path (``layer_recipes``)."""
    out = layer_recipes(rules, layers)
    for n in layers:
        d = rep.layers.get(n) if rep is not None else None
        if d is not None:
            out[n] = None if d["rule"] is None else rules[d["rule"]].recipe
    return out


def layer_recipes(rules: Rules, layers: list[str]) -> dict[str, Recipe | None]:
    """``{layer: its recipe under rules}`` (None: high precision)."""
    return {n: rule_recipe(rules, n) for n in layers}


def describe_rules(recipes: dict[str, Recipe | None], recipe: Recipe,
                   weights: dict[str, int] | None = None) -> str:
    """One line: ``"10 of 14 linear layers in NVFP4 (71%); high precision: embed,
    lm_head"`` (the layers not quantized, or how many). ``weights``: how many weights each
    layer path multiplies (``fp4jax.nn.report``: a module that multiplies two of its
    parameters, an FFN sharing one scope, is two linear layers; default 1 each)."""
    weights = weights or {}
    q = [n for n, r in recipes.items() if recipe_quantizes(r)]
    total = sum(weights.get(n, 1) for n in recipes)
    n_q = sum(weights.get(n, 1) for n in q)
    if not q:
        return f"0 of {total} linear layers quantized (all high precision)"
    names = sorted({r.name for n, r in recipes.items() if n in q})
    line = (f"{n_q} of {total} linear layers in {'/'.join(x.upper() for x in names)} "
            f"({100.0 * n_q / total:.0f}%)")
    hp = [n for n in recipes if n not in q]
    if hp:
        line += "; high precision: " + (", ".join(hp) if len(hp) <= 6 else
                                        f"{len(hp)} layers ({', '.join(hp[:4])}, ...)")
    return line


def rules_gemm_fraction(shapes: dict[str, tuple[int, ...]], recipes: dict[bool, dict]
                        ) -> Callable[[int, int], float]:
    """``fraction(steps, switch_step)``: the fraction of the linear layers' GEMM work in
    high precision (each GEMM of a layer ``tokens * kernel size`` multiply-adds, as
    ``precision.gemm_work`` counts them), before and after the switch."""
    import math

    def work(rs: dict) -> tuple[float, float]:
        total = hp = 0.0
        for name, shape in shapes.items():
            size, r = float(math.prod(shape)), rs[name]
            for g in ("fprop", "dgrad", "wgrad"):
                total += size
                hp += size * (r is None or not r.gemms[g].quantized)
        return total, hp

    (ta, ha), (tb, hb) = work(recipes[False]), work(recipes[True])

    def fraction(steps: int, switch_step: int | None) -> float:
        s = steps if switch_step is None else min(max(switch_step, 0), steps)
        total = s * ta + (steps - s) * tb
        return (s * ha + (steps - s) * hb) / total if total else 0.0

    return fraction


def _say_report(model: Any, x0: jax.Array, name: str, say: bool = True) -> Any:
    """``fp4jax.nn.report`` of ``model`` (None if it fails), and (``say``) what it finds
    wrong with the rules on stderr: rules that matched no layer, products it could not
    cover (the table of every layer is the run's ``"precision"`` record). NNX: traced on an
    abstract build."""
    import sys

    import fp4jax.nn

    found: dict[str, Any] = {}
    try:
        if isinstance(model, NnxModel):
            def trace() -> jax.Array:
                params = model.init(jax.random.key(0), x0)["params"]
                k = jax.random.key(1)
                found["r"] = fp4jax.nn.report(model.module(params, {"fp4": k, "fp4_layer": k}),
                                              x0, method=model.call)
                return jnp.zeros(())

            jax.eval_shape(trace)
        else:
            found["r"] = fp4jax.nn.report(model, x0)
    except Exception as e:  # noqa: BLE001 - a report is advice: the run goes on
        print(f"fp4jax-train: --model {name}: fp4jax.nn.report failed ({type(e).__name__}: "
              f"{e}); training goes on", file=sys.stderr, flush=True)
        return None
    r = found["r"]
    if not say:
        return r
    for i, rule in getattr(r, "unused_rules", []):
        if rule.pattern not in (HIGH_PRECISION_NAMES, ".*"):
            print(f"fp4jax-train: --model {name}: rule [{i}] {rule.pattern!r} -> {rule.spec} "
                  "matched no layer", file=sys.stderr, flush=True)
    for u in getattr(r, "uncovered", []):
        print(f"fp4jax-train: --model {name}: a product not covered by the rules: {u}",
              file=sys.stderr, flush=True)
    return r


def path_name(path: tuple[str, ...], index: tuple[int, ...]) -> str:
    """A foreign model's layer name in the measurements: its module path, ``"[i]"`` per
    scan axis (``"blocks/query[3]"``; the rules match the path without it)."""
    return "/".join(path) + "".join(f"[{i}]" for i in index)


def check_logits(name: str, model: Any, x0: jax.Array, vocab_size: int) -> Any:
    """The parameter shapes of ``model`` (a linen module or an ``NnxModel``), after checking
    (abstractly: nothing is computed) that it maps token ids ``x0 (B, T)`` int32 to float
    logits ``(B, T, vocab_size)``, as ``FACTORY_PROTOCOL`` says: logits of another width
    would train on a wrong loss (targets past the last logit), other shapes fail later.

    Raises:
      ValueError: naming ``--model`` ``name``, what it returned and what it should.
    """
    b, t = x0.shape
    try:
        variables = jax.eval_shape(model.init, jax.random.key(0), x0)
        out = jax.eval_shape(lambda v: model.apply(v, x0), variables)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 (the user's model: one line naming --model)
        raise ValueError(f"--model {name}: the model does not run on token ids of shape "
                         f"{(b, t)} int32: {type(e).__name__}: {e} (a model needing "
                         "other inputs: return (model, call) from the factory, "
                         "call(model, tokens) -> logits; docs/byom.md)") from e
    shape, dtype = getattr(out, "shape", None), getattr(out, "dtype", None)
    if shape != (b, t, vocab_size) or not jnp.issubdtype(dtype, jnp.floating):
        got = (f"{type(out).__name__}" if shape is None
               else f"{dtype} {tuple(shape)}")
        raise ValueError(f"--model {name}: the model must return float logits of shape "
                         f"(batch, seq_len, vocab_size) = {(b, t, vocab_size)} for token ids "
                         f"{(b, t)}, got {got} (vocab_size is the factory's first argument). "
                         "A model returning a dataclass or tuple, or needing "
                         "positions or a mask: return (model, call) from the factory, "
                         "call(model, tokens) -> logits (docs/byom.md)")
    return variables["params"]


def foreign_models(cfg: TrainConfig, rcfg: TrainConfig, recipe: Recipe,
                   vocab_size: int, train: Callable[..., dict] | None = None,
                   dataset: Any = None) -> RunModels:
    """The model of ``--model MODULE:FACTORY`` (``FACTORY_PROTOCOL``) under the run's rules
    (``default_rules``, the ``--rules`` file's among them), before and after its precision
    switch.
    ``--bf16-layers`` is resolved here (``auto``: an FP4 warm-up with ``train`` on
    ``dataset``, its per-layer statistics recommending high-precision rules).

    Raises:
      ValueError: see ``load_factory``, ``read_rules``, ``default_rules``; the factory
        returns neither a linen nor an NNX module.
    """
    import flax.linen as nn
    from flax import nnx

    factory = load_factory(cfg.model)
    kwargs = model_kwargs(cfg.model_args)
    nnx_factory = takes_rngs(factory)
    x0 = jnp.zeros((1, cfg.seq_len), jnp.int32)
    how = (f"factory(vocab_size={vocab_size}, seq_len={cfg.seq_len}"
           + "".join(f", {k}=..." for k in kwargs) + (", rngs=...)" if nnx_factory else ")"))

    def call_factory(**extra: Any) -> Any:
        try:
            return factory(vocab_size, cfg.seq_len, **kwargs, **extra)
        except Exception as e:  # noqa: BLE001 (the user's code: one line naming --model)
            raise ValueError(f"--model {cfg.model}: {how} raised {type(e).__name__}: {e}"
                             ) from e

    if nnx_factory:
        called: dict[str, Callable[[Any, jax.Array], jax.Array]] = {}

        def build_plain(rngs: Any) -> Any:
            m = call_factory(rngs=rngs)
            if isinstance(m, tuple) and len(m) == 2 and isinstance(m[0], nnx.Module):
                if not callable(m[1]):
                    raise ValueError(f"--model {cfg.model}: the factory returned (model, "
                                     f"{type(m[1]).__name__}): the second item must be "
                                     "call(model, tokens) -> logits")
                called["call"] = m[1]
                m = m[0]
            if not isinstance(m, nnx.Module):
                raise ValueError(f"--model {cfg.model}: a factory that takes rngs must "
                                 "return a flax.nnx.Module (or a tuple (module, call) with "
                                 f"call(model, tokens) -> logits), got {type(m).__name__}")
            return m

        plain = NnxModel(build_plain)  # builds once (abstractly): ``called`` is known
        plain.call = nnx_call = called.get("call")
        kind = "nnx"
    else:
        plain = call_factory()
        if isinstance(plain, tuple) and len(plain) == 2 and isinstance(plain[0], nn.Module):
            if not callable(plain[1]):
                raise ValueError(f"--model {cfg.model}: the factory returned (model, "
                                 f"{type(plain[1]).__name__}): the second item must be "
                                 "call(model, tokens) -> logits")
            plain = CalledModel(*plain)
        if isinstance(plain, nnx.Module):
            raise ValueError(f"--model {cfg.model}: an NNX model's factory must take a rngs "
                             "keyword (nnx.Rngs): factory(vocab_size, seq_len, *, rngs)")
        if not isinstance(plain, nn.Module):
            raise ValueError(f"--model {cfg.model}: the factory must return a "
                             "flax.linen.Module (or a tuple (module, call) with "
                             "call(model, tokens) -> logits), or (taking rngs) a "
                             "flax.nnx.Module, got "
                             f"{type(plain).__name__}")
        kind = "linen"
    shapes_tree = check_logits(cfg.model, plain, x0, vocab_size)
    # the linear layers: what fp4jax.nn.report finds the model multiplying, whatever its
    # weights are called (the parameters named "kernel" if the report fails)
    found = _say_report(listing_model(plain, *((build_plain, nnx_call) if nnx_factory
                                               else ())), x0, cfg.model, say=False)
    if found is not None and found.layers:
        # each layer's weight elements, every weight it multiplies (the GEMM work's share)
        shapes = {n: (sum(math.prod(w) for w in d.get("weights") or [d["weight"]]),)
                  for n, d in found.layers.items()}
        n_weights = {n: max(len(d.get("weights") or [d["weight"]]), 1)
                     for n, d in found.layers.items()}
    else:
        shapes, n_weights = linear_layers(shapes_tree), {}
    layers = list(shapes)
    n_params = sum(int(math.prod(x.shape)) for x in jax.tree.leaves(shapes_tree))
    rules = read_rules(cfg.rules) if cfg.rules else ()
    if rcfg.switch_at == "auto":  # every quantizing rule's recipe, not --recipe's only
        for i, rule in enumerate(rules):
            r = rule.recipe
            problem = gradient_noise_problem(r) if recipe_quantizes(r) else None
            if problem:
                raise ValueError(f"--switch-at auto needs stochastically rounded FP4 "
                                 f"gradients in every quantized layer; --rules {cfg.rules} "
                                 f"rule [{i}] {rule.pattern!r} -> {fp4jax.recipes.spec(r)} "
                                 f"{problem}. Use a fixed --switch-at FRACTION instead")
    blocks = find_blocks(layers)
    bf16 = precision.resolve_bf16_layers(cfg, rcfg, recipe, None, train, dataset,
                                         layers=layers, n_blocks=blocks[1] if blocks else 0)
    if bf16 is not None:  # rcfg names them, its BF16 blocks explicit (as llama_models)
        rcfg = rcfg.replace(last_bf16=(last_bf16_blocks(rcfg, blocks[1]) if blocks
                                       else max(rcfg.last_bf16, 0)),
                            bf16_layers=",".join(bf16["layers"]) or None)
    rules, notes = default_rules(recipe, layers, rcfg, rules)
    sw_rules = switched_rules(rules, rcfg.switch)

    def make(rs: Rules) -> Any:
        if not nnx_factory:
            return quantized_model(plain, rs)
        return NnxModel(build_plain, (lambda m, rngs: quantized_model(m, rs, rngs))
                        if rules_quantize(rs) else None, nnx_call)

    models = {False: make(rules), True: make(sw_rules)}
    rep = _say_report(models[False], x0, cfg.model) if rules_quantize(rules) else None
    hp_rules = {k: switched_rules(r, "bwd") for k, r in ((False, rules), (True, sw_rules))}
    recipes = {False: reported_recipes(rep, rules, layers),
               True: reported_recipes(rep, sw_rules, layers)}
    summary = describe_rules(recipes[False], recipe, n_weights)
    if notes:
        summary += "; " + "; ".join(notes)
    return RunModels(
        models=models, recipes={False: recipe, True: switched_recipe(recipe, rcfg.switch)},
        rcfg=rcfg, bf16=bf16,
        describe=f"{n_params / 1e6:.2f}M params ({cfg.model}, {kind})", summary=summary,
        hp_backward=lambda k: make(hp_rules[k]),
        fp4_names=[n for n, r in recipes[False].items() if recipe_quantizes(r)],
        name_fn=path_name, order=str,
        gemm_fraction=rules_gemm_fraction(shapes, recipes),
        flat_kernels=(rep or found) is None,
        layers={n: None if r is None else fp4jax.recipes.spec(r)
                for n, r in recipes[False].items()},
        layer_recipes=dict(recipes[False]),
        scan_axes=(rep or found).scan_axes if (rep or found) is not None else None)
