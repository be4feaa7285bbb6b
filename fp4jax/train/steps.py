"""The step functions of a training run, each a pure function compiled by ``jax.jit``: the
loss (``loss_fn``), the initial state (``make_init_state``), the train step
(``make_train_step``: loss, gradients, AdamW update; on several devices in ``jax.shard_map``,
``parallel``), the validation loss (``make_eval_step``) and the two measurements kept apart
from the train step: per-layer quantization statistics (``make_stats_step``, ``--stats-every``)
and the gradient-to-noise ratio (``make_grad_noise_step``, ``--grad-noise-every``).

A model here is anything with flax linen's ``init(rngs, tokens)`` and ``apply({"params":
params}, tokens, rngs=...)``: a linen ``Module`` (fp4jax's ``Llama``, a model under
``fp4jax.nn.quantize_model``) or ``fp4jax.train.models.NnxModel`` (an NNX model, split into
a pure state). Keys: step ``s`` draws its stochastic-rounding bits from ``fold_in(base, s)``
(stream ``"fp4"``), every step the same per-layer RHT key ``fold_in(base, LAYER_KEY_INDEX)``
(stream ``"fp4_layer"``), evaluation ``fold_in(base, EVAL_KEY_INDEX)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fp4jax import diagnostics
from fp4jax import sharding as fp4_sharding
from fp4jax.models import moe
from fp4jax.models.llama import layer_name
from fp4jax.outcontrol import CHANNEL_NORM_COLLECTION, OUTCONTROL_COLLECTION
from fp4jax.train import channel_split, oscillation, parallel
from fp4jax.train.config import TrainConfig

NameFn = Callable[[tuple[str, ...], tuple[int, ...]], str]

# fold_in index of the run's layer key (constant per-layer RHT signs) under the base key;
# steps use their own index and evaluation EVAL_KEY_INDEX.
LAYER_KEY_INDEX = 2**31 - 2
EVAL_KEY_INDEX = 2**31 - 1


def loss_fn(model: Any, params: Any, batch: jax.Array, key: jax.Array,
            layer_key: jax.Array | None = None, extra: dict | None = None) -> jax.Array:
    """Mean next-token cross-entropy (nats), plus the load-balancing losses a
    mixture-of-experts model sows (``fp4jax.models.moe.aux_loss``; none for a dense model,
    whose loss is the cross-entropy itself). ``batch (B, T+1)`` int32 -> float32 scalar
    (the model's logits ``(B, T, vocab)``, any float dtype, taken in float32).
    ``key``: the step's stochastic-rounding key; ``layer_key``: the run's constant key of
    per-layer RHT signs (stream ``"fp4_layer"``; needed by ``hadamard_signs="layer"``).
    ``extra``: more variable collections for a linen model (OutControl's channel split,
    ``{OUTCONTROL_COLLECTION: ...}``)."""
    rngs = {"fp4": key} if layer_key is None else {"fp4": key, "fp4_layer": layer_key}
    aux = None
    if isinstance(model, nn.Module):  # a mixture of experts sows its load-balancing losses
        logits, state = model.apply({"params": params, **(extra or {})}, batch[:, :-1],
                                    rngs=rngs, mutable=[moe.AUX_COLLECTION])
        if jax.tree.leaves(state):
            aux = moe.aux_loss(state)
    else:
        logits = model.apply({"params": params}, batch[:, :-1], rngs=rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(
        jnp.asarray(logits, jnp.float32), batch[:, 1:]).mean()
    return loss if aux is None else loss + aux


def _global_norm(tree: Any) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


# Times each step function was traced (once per compilation):
# {"init", "train", "eval", "stats", "noise"}.
TRACE_COUNTS: dict[str, int] = {"init": 0, "train": 0, "eval": 0, "stats": 0, "noise": 0}


def _traced(kind: str) -> None:
    TRACE_COUNTS[kind] += 1


def make_init_state(model: Any, tx: optax.GradientTransformation,
                    cfg: TrainConfig, osci: Any = None, outcontrol: Any = None
                    ) -> Callable[..., dict]:
    """``init(root=None) -> {"step", "params", "opt_state"}``: parameters from
    ``fold_in(root, 0)``, ``root`` defaulting to ``jax.random.key(cfg.seed)``; ``train`` passes
    the root key, so the seed is data and one compilation serves every seed. ``osci``:
    ``(OsciReset, tracked weights)`` (``fp4jax.train.oscillation``) adds its state under
    ``"osci"``; ``outcontrol``: ``(OutControlPlan, the record's shapes)``
    (``fp4jax.train.channel_split``) its zero sums and placeholder splits under
    ``"outcontrol"``."""

    def init_state(root=None):
        _traced("init")
        root = jax.random.key(cfg.seed) if root is None else root
        x0 = jnp.zeros((1, cfg.seq_len), jnp.int32)
        params = model.init(jax.random.fold_in(root, 0), x0)["params"]
        state = {"step": jnp.zeros((), jnp.int32), "params": params,
                 "opt_state": tx.init(params)}
        if osci is not None:
            state["osci"] = oscillation.init_state(params, osci[1])
        if outcontrol is not None:
            state["outcontrol"] = channel_split.init_state(*outcontrol)
        return state

    return init_state


# The train state's layout without --fsdp: every array replicated (a prefix of the state).
REPLICATED = {"step": P(), "params": P(), "opt_state": P()}


def _jit_on(mesh: Mesh, fn: Callable, **kwargs: Any) -> Callable:
    """``jax.jit(fn, **kwargs)`` for ``mesh``: on a one-device mesh ``fn`` is traced inside
    ``fp4jax.sharding.one_device()``, so a one-GPU run on a multi-GPU host takes the Hopper
    kernels as on a one-GPU host (the automatic choice keeps the XLA path whenever JAX sees
    several devices: 0.26x bf16's throughput instead of 0.60x at ``small``); on several
    devices the loss runs in ``shard_map`` under ``data_parallel`` instead. Same program
    otherwise (the name is ``fn``'s)."""
    one = mesh.devices.size == 1

    @functools.wraps(fn)
    def traced(*args: Any, **kw: Any) -> Any:
        with fp4_sharding.one_device(one):
            return fn(*args, **kw)

    return jax.jit(traced, **kwargs)


def make_train_step(model: Any, tx: optax.GradientTransformation,
                    base_key: jax.Array | None, mesh: Mesh, specs: Any = None,
                    fp4_gather: Any = None, osci: Any = None,
                    outcontrol: bool = False) -> Callable:
    """A jit-compiled ``step(state, batch) -> (state, metrics)``. The stochastic-rounding key
    of step ``s`` is ``fold_in(base_key, s)``. With ``base_key=None`` (what ``train`` uses)
    the key is an argument, ``step(state, batch, base_key)``, so one compilation serves
    every seed.

    ``specs``: the state's ``PartitionSpec``s (``parallel.state_specs``; None: replicated,
    which an ``fsdp`` axis larger than 1 does not allow). On several devices the loss and
    gradients run in ``jax.shard_map`` (``parallel.sharded_value_and_grad``: each device its
    rows of the batch, the Pallas kernels on, every quantized tensor's amax and random bits
    those of the whole batch, parameters gathered over ``fsdp``); the optimizer update runs
    on the state as it is laid out. ``fp4_gather``: which parameters are gathered in FP4
    (``parallel.fp4_gather_plan``'s tree; None: all as stored). ``osci``: ``(OsciReset,
    tracked weights)``: after the update, TetraJet-v2's oscillation reset
    (``fp4jax.train.oscillation.apply``) on the state's ``"osci"``; the metrics gain
    ``"osci_reset"`` (the fraction of tracked elements reset at this step). A state's
    ``"outcontrol"`` (TetraJet-v2's OutControl, ``outcontrol_state``) passes through; with
    ``outcontrol`` the model runs its channel split (``state["outcontrol"]["split"]``)."""
    if tuple(mesh.axis_names) != parallel.AXES:
        raise ValueError(f"make_train_step needs a mesh with axes {parallel.AXES} "
                         f"(parallel.make_mesh), got {tuple(mesh.axis_names)}")
    if specs is None:
        if mesh.shape["fsdp"] > 1:
            raise ValueError("make_train_step on an fsdp mesh needs the state's specs "
                             "(parallel.state_specs)")
        specs = REPLICATED

    def loss_of(params, batch, key, layer_key, *split):
        extra = {OUTCONTROL_COLLECTION: split[0]} if split else None
        return loss_fn(model, params, batch, key, layer_key, extra)

    value_and_grad = jax.value_and_grad(loss_of)
    if mesh.devices.size > 1:
        value_and_grad = parallel.sharded_value_and_grad(loss_of, specs["params"], mesh,
                                                         fp4_gather)

    def step(state, batch, key_arg=None):
        _traced("train")
        base = base_key if key_arg is None else key_arg
        key = jax.random.fold_in(base, state["step"])
        layer_key = jax.random.fold_in(base, LAYER_KEY_INDEX)
        split = (state["outcontrol"]["split"],) if outcontrol else ()
        loss, grads = value_and_grad(state["params"], batch, key, layer_key, *split)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss, "grad_norm": _global_norm(grads)}
        new = {"step": state["step"] + 1, "params": params, "opt_state": opt_state}
        if "outcontrol" in state:
            new["outcontrol"] = state["outcontrol"]
        if osci is not None:
            new["params"], new["osci"], metrics["osci_reset"] = oscillation.apply(
                osci[0], params, state["osci"], state["step"], osci[1])
        return new, metrics

    return _jit_on(mesh, step, out_shardings=(parallel.shardings(specs, mesh),
                                              NamedSharding(mesh, P())), donate_argnums=0)


def make_eval_step(model: Any, base_key: jax.Array | None, mesh: Mesh,
                   fp4_gather: Any = None, outcontrol: bool = False) -> Callable:
    """A jit-compiled ``eval(params, batch) -> mean loss`` (``base_key=None``: ``eval(params,
    batch, base_key)``, as for ``make_train_step``). On several devices the loss runs in
    ``jax.shard_map`` as the train step's does (``parallel.sharded_value``; parameters laid
    out by ``parallel.state_specs``), so cuDNN's attention sees per-device arrays.
    ``fp4_gather``: as ``make_train_step``'s. ``outcontrol``: ``eval(params, batch,
    base_key, split)`` runs OutControl's channel split."""

    def loss_of(p, b, key, layer_key, *split):
        extra = {OUTCONTROL_COLLECTION: split[0]} if split else None
        return loss_fn(model, p, b, key, layer_key, extra)

    def ev(p, b, key_arg=None, *split):
        _traced("eval")
        k = base_key if key_arg is None else key_arg
        f = loss_of
        if mesh.devices.size > 1:
            f = parallel.sharded_value(loss_of, parallel.state_specs(p, mesh), mesh,
                                       fp4_gather)
        return f(p, b, jax.random.fold_in(k, EVAL_KEY_INDEX),
                 jax.random.fold_in(k, LAYER_KEY_INDEX), *split[:1 if outcontrol else 0])

    return _jit_on(mesh, ev, out_shardings=NamedSharding(mesh, P()))


def make_stats_step(model: Any, mesh: Mesh, name_fn: NameFn = layer_name) -> Callable:
    """A jit-compiled ``stats(params, batch, base_key, step) -> {layer: gemm_stats}``: the
    quantization statistics (``fp4jax.diagnostics.gemm_stats``) of every fp4jax linear layer
    of ``model`` on ``batch (B, T+1)`` int32, each on its own operands at train step
    ``step`` (int32 scalar): its input, its weight (both in the compute dtype) and the
    cotangent of the loss with respect to its output, with the stochastic-rounding key
    ``fold_in(base_key, step)`` and layer key that ``make_train_step`` uses, so the errors
    are those of that step's GEMMs. Layer names are ``name_fn``'s (default: Llama's
    ``layer_name``, ``"block_3/q"``;
    layers the policy keeps in BF16 are plain ``nn.Dense`` and absent). Values are float32
    scalars, replicated. A function apart from the train step, which it leaves unchanged."""

    def stats(params, batch, key_arg, step):
        _traced("stats")
        rngs = {"fp4": jax.random.fold_in(key_arg, step),
                "fp4_layer": jax.random.fold_in(key_arg, LAYER_KEY_INDEX)}

        def loss(logits: jax.Array) -> jax.Array:
            return optax.softmax_cross_entropy_with_integer_labels(
                jnp.asarray(logits, jnp.float32), batch[:, 1:]).mean()

        return diagnostics.layer_stats(model, {"params": params}, batch[:, :-1], loss=loss,
                                       rngs=rngs, name_fn=name_fn)

    return _jit_on(mesh, stats, out_shardings=NamedSharding(mesh, P()))


def noise_gradients(model: Any, model_hp: Any) -> Callable:
    """``grads(params, batch, base_key, step) -> (g, g_q)``: the gradients of the loss of
    train step ``step`` (its SR key ``fold_in(base_key, step)`` and the run's layer key, as
    ``make_train_step`` derives them) through ``model_hp`` (``g``) and ``model`` (``g_q``)."""

    def grads(params, batch, key_arg, step):
        key = jax.random.fold_in(key_arg, step)
        layer_key = jax.random.fold_in(key_arg, LAYER_KEY_INDEX)
        g_q = jax.grad(lambda p: loss_fn(model, p, batch, key, layer_key))(params)
        g = jax.grad(lambda p: loss_fn(model_hp, p, batch, key, layer_key))(params)
        return g, g_q

    return grads


def flat_kernels(tree: Any) -> Any:
    """``tree`` with every ``"kernel"`` leaf of 3 or more dimensions reshaped to 2-D
    (``(-1, last)``): one layer each for ``diagnostics.gradient_noise``, which would take
    the leading axes of a ``DenseGeneral``/``Einsum`` kernel for a scanned stack."""

    def flat(path: Any, x: Any) -> Any:
        last = path[-1] if path else None
        name = str(getattr(last, "key", getattr(last, "name", last)))
        return x.reshape(-1, x.shape[-1]) if name == "kernel" and x.ndim > 2 else x

    return jax.tree_util.tree_map_with_path(flat, tree)


def make_grad_noise_step(model: Any, model_hp: Any, mesh: Mesh,
                         name_fn: NameFn = layer_name, flat: bool = False,
                         scan_axes: Callable[[tuple[str, ...], tuple[int, ...]], int] | None
                         = None, layers: tuple[str, ...] | None = None) -> Callable:
    """A jit-compiled ``noise(params, batch, base_key, step) ->
    fp4jax.diagnostics.gradient_noise(g, g_q)``: the gradient-to-noise ratio of train step
    ``step`` (FP4-all-the-way Section 4), globally and per layer (named by ``name_fn``,
    default Llama's ``layer_name``). ``g_q`` is the gradient of ``model`` (the train step's
    own: the same batch, SR key ``fold_in(base_key, step)`` and layer key), ``g`` that of
    ``model_hp``, the same
    model with its backward GEMMs in high precision (``switched_recipe(recipe, "bwd")``: the
    same forward pass and parameters). Float32 scalars, replicated. A function apart from
    the train step, which it leaves unchanged. ``flat``: every kernel is one layer
    (``flat_kernels``; a foreign model whose scans are not known); ``scan_axes``: how many
    leading axes of each kernel stack scanned layers (``gradient_noise``'s; a foreign
    model's ``fp4jax.nn.report(...).scan_axes``); ``layers``: the linear layers' paths,
    whose weights under any name are layers too (``gradient_noise``'s; a foreign model's
    reported layers)."""

    grads = noise_gradients(model, model_hp)

    def noise(params, batch, key_arg, step):
        _traced("noise")
        g, g_q = grads(params, batch, key_arg, step)
        if flat:
            g, g_q = flat_kernels(g), flat_kernels(g_q)
        return diagnostics.gradient_noise(g, g_q, name_fn=name_fn, scan_axes=scan_axes,
                                          layers=layers)

    return _jit_on(mesh, noise, out_shardings=NamedSharding(mesh, P()))


def make_outcontrol_record(model: Any, mesh: Mesh) -> Callable:
    """A jit-compiled ``record(params, batch, base_key, step) -> norms``: OutControl's
    statistic of train step ``step`` (TetraJet-v2, ``fp4jax.outcontrol``): the model's
    forward pass on ``batch (B, T+1)`` with that step's keys, each quantized dense layer's
    per-input-channel L2 norm over the whole batch's tokens, float32 ``(K,)`` (a scanned
    stack: ``(L, K)``), in the tree of ``CHANNEL_NORM_COLLECTION`` (leaves ``"sq"``). Apart
    from the train step (a forward pass more at each recorded step); replicated."""

    def record(params, batch, key_arg, step):
        rngs = {"fp4": jax.random.fold_in(key_arg, step),
                "fp4_layer": jax.random.fold_in(key_arg, LAYER_KEY_INDEX)}
        _, state = model.apply({"params": params}, batch[:, :-1], rngs=rngs,
                               mutable=[CHANNEL_NORM_COLLECTION, moe.AUX_COLLECTION])
        # each call of a layer sowed its sums of squares: add them, then the square root
        return jax.tree.map(lambda calls: jnp.sqrt(sum(calls)),
                            state.get(CHANNEL_NORM_COLLECTION, {}),
                            is_leaf=lambda x: isinstance(x, tuple))

    return _jit_on(mesh, record, out_shardings=NamedSharding(mesh, P()))
