"""The training loop: the loss, the jit-compiled train and eval steps, the data-parallel
mesh, initial state, and ``train`` (one run: data, model, optimizer, resume from a checkpoint,
the step loop with evaluation, logging to ``metrics.jsonl``, checkpoints and divergence
handling, and the result dict written to ``result.json``). ``TrainingDiverged`` is raised when
a training or validation loss, the gradient norm or the state becomes non-finite.
``make_stats_step`` builds the separate jitted function that measures every quantized linear
layer every ``--stats-every`` steps (``fp4jax.diagnostics.layer_stats``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import fp4jax.recipes
from fp4jax import diagnostics
from fp4jax.data import ByteDataset
from fp4jax.models.llama import Llama, layer_name, layer_order
from fp4jax.recipes import Recipe
from fp4jax.tokens import load_dataset, model_vocab_size
from fp4jax.train import parallel, precision, processes
from fp4jax.train.checkpoint import (
    CheckpointDamaged,
    Checkpointer,
    _history_from_metrics,
    _note,
    _truncate_metrics,
    config_diff,
    host_leaves,
    nonfinite_leaves,
    read_metrics,
    state_checksum,
)
from fp4jax.train.config import (
    OVERRIDABLE_KEYS,
    TrainConfig,
    last_bf16_blocks,
    make_optimizer,
    make_policy,
    make_schedule,
    model_config,
    override_keys,
    run_recipe,
    switched_recipe,
    validate_config,
)
from fp4jax.train.parallel import make_mesh
from fp4jax.train.rundir import check_out, claim_out, lock_out, releases_locks


class TrainingDiverged(RuntimeError):
    """A training or validation loss, the gradient norm or the state became non-finite at
    step ``step`` (0-based; None when unknown)."""

    def __init__(self, msg: str, step: int | None = None) -> None:
        super().__init__(msg)
        self.step = step



# fold_in index of the run's layer key (constant per-layer RHT signs) under the base key;
# steps use their own index and evaluation 2**31 - 1.
LAYER_KEY_INDEX = 2**31 - 2


def loss_fn(model: Llama, params: Any, batch: jax.Array, key: jax.Array,
            layer_key: jax.Array | None = None) -> jax.Array:
    """Mean next-byte cross-entropy (nats). ``batch (B, T+1)`` int32 -> float32 scalar.
    ``key``: the step's stochastic-rounding key; ``layer_key``: the run's constant key of
    per-layer RHT signs (stream ``"fp4_layer"``; needed by ``hadamard_signs="layer"``)."""
    rngs = {"fp4": key} if layer_key is None else {"fp4": key, "fp4_layer": layer_key}
    logits = model.apply({"params": params}, batch[:, :-1], rngs=rngs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def _global_norm(tree: Any) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


# Times each step function was traced (once per compilation):
# {"init", "train", "eval", "stats", "noise"}.
TRACE_COUNTS: dict[str, int] = {"init": 0, "train": 0, "eval": 0, "stats": 0, "noise": 0}


def _traced(kind: str) -> None:
    TRACE_COUNTS[kind] += 1


def make_init_state(model: Llama, tx: optax.GradientTransformation,
                    cfg: TrainConfig) -> Callable[..., dict]:
    """``init(root=None) -> {"step", "params", "opt_state"}``: parameters from
    ``fold_in(root, 0)``, ``root`` defaulting to ``jax.random.key(cfg.seed)``; ``train`` passes
    the root key, so the seed is data and one compilation serves every seed."""

    def init_state(root=None):
        _traced("init")
        root = jax.random.key(cfg.seed) if root is None else root
        x0 = jnp.zeros((1, cfg.seq_len), jnp.int32)
        params = model.init(jax.random.fold_in(root, 0), x0)["params"]
        return {"step": jnp.zeros((), jnp.int32), "params": params,
                "opt_state": tx.init(params)}

    return init_state


# The train state's layout without --fsdp: every array replicated (a prefix of the state).
_REPLICATED = {"step": P(), "params": P(), "opt_state": P()}


def make_train_step(model: Llama, tx: optax.GradientTransformation,
                    base_key: jax.Array | None, mesh: Mesh, specs: Any = None) -> Callable:
    """A jit-compiled ``step(state, batch) -> (state, metrics)``. The stochastic-rounding key
    of step ``s`` is ``fold_in(base_key, s)``. With ``base_key=None`` (what ``train`` uses)
    the key is an argument, ``step(state, batch, base_key)``, so one compilation serves
    every seed.

    ``specs``: the state's ``PartitionSpec``s (``parallel.state_specs``; None: replicated,
    which an ``fsdp`` axis larger than 1 does not allow). On several devices the loss and
    gradients run in ``jax.shard_map`` (``parallel.sharded_value_and_grad``: each device its
    rows of the batch, the Pallas kernels on, every quantized tensor's amax and random bits
    those of the whole batch, parameters gathered over ``fsdp``); the optimizer update runs
    on the state as it is laid out."""
    if tuple(mesh.axis_names) != parallel.AXES:
        raise ValueError(f"make_train_step needs a mesh with axes {parallel.AXES} "
                         f"(parallel.make_mesh), got {tuple(mesh.axis_names)}")
    if specs is None:
        if mesh.shape["fsdp"] > 1:
            raise ValueError("make_train_step on an fsdp mesh needs the state's specs "
                             "(parallel.state_specs)")
        specs = _REPLICATED

    def loss_of(params, batch, key, layer_key):
        return loss_fn(model, params, batch, key, layer_key)

    value_and_grad = jax.value_and_grad(loss_of)
    if mesh.devices.size > 1:
        value_and_grad = parallel.sharded_value_and_grad(loss_of, specs["params"], mesh)

    def step(state, batch, key_arg=None):
        _traced("train")
        base = base_key if key_arg is None else key_arg
        key = jax.random.fold_in(base, state["step"])
        layer_key = jax.random.fold_in(base, LAYER_KEY_INDEX)
        loss, grads = value_and_grad(state["params"], batch, key, layer_key)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss, "grad_norm": _global_norm(grads)}
        return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

    return jax.jit(step, out_shardings=(parallel.shardings(specs, mesh), NamedSharding(mesh, P())),
                   donate_argnums=0)


def make_eval_step(model: Llama, base_key: jax.Array | None, mesh: Mesh) -> Callable:
    """A jit-compiled ``eval(params, batch) -> mean loss`` (``base_key=None``: ``eval(params,
    batch, base_key)``, as for ``make_train_step``). On several devices the loss runs in
    ``jax.shard_map`` as the train step's does (``parallel.sharded_value``; parameters laid
    out by ``parallel.state_specs``), so cuDNN's attention sees per-device arrays."""

    def loss_of(p, b, key, layer_key):
        return loss_fn(model, p, b, key, layer_key)

    def ev(p, b, key_arg=None):
        _traced("eval")
        k = base_key if key_arg is None else key_arg
        f = loss_of
        if mesh.devices.size > 1:
            f = parallel.sharded_value(loss_of, parallel.state_specs(p, mesh), mesh)
        return f(p, b, jax.random.fold_in(k, 2**31 - 1), jax.random.fold_in(k, LAYER_KEY_INDEX))

    return jax.jit(ev, out_shardings=NamedSharding(mesh, P()))


def make_stats_step(model: Llama, mesh: Mesh) -> Callable:
    """A jit-compiled ``stats(params, batch, base_key, step) -> {layer: gemm_stats}``: the
    quantization statistics (``fp4jax.diagnostics.gemm_stats``) of every fp4jax linear layer
    of ``model`` on ``batch (B, T+1)`` int32, each on its own operands at train step
    ``step`` (int32 scalar): its input, its weight (both in the compute dtype) and the
    cotangent of the loss with respect to its output, with the stochastic-rounding key
    ``fold_in(base_key, step)`` and layer key that ``make_train_step`` uses, so the errors
    are those of that step's GEMMs. Layer names are ``layer_name``'s (``"block_3/q"``;
    layers the policy keeps in BF16 are plain ``nn.Dense`` and absent). Values are float32
    scalars, replicated. A function apart from the train step, which it leaves unchanged."""

    def stats(params, batch, key_arg, step):
        _traced("stats")
        rngs = {"fp4": jax.random.fold_in(key_arg, step),
                "fp4_layer": jax.random.fold_in(key_arg, LAYER_KEY_INDEX)}

        def loss(logits: jax.Array) -> jax.Array:
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

        return diagnostics.layer_stats(model, {"params": params}, batch[:, :-1], loss=loss,
                                       rngs=rngs, name_fn=layer_name)

    return jax.jit(stats, out_shardings=NamedSharding(mesh, P()))


def noise_gradients(model: Llama, model_hp: Llama) -> Callable:
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


def make_grad_noise_step(model: Llama, model_hp: Llama, mesh: Mesh) -> Callable:
    """A jit-compiled ``noise(params, batch, base_key, step) ->
    fp4jax.diagnostics.gradient_noise(g, g_q)``: the gradient-to-noise ratio of train step
    ``step`` (FP4-all-the-way Section 4), globally and per layer (named as ``layer_name``
    does). ``g_q`` is the gradient of ``model`` (the train step's own: the same batch, SR
    key ``fold_in(base_key, step)`` and layer key), ``g`` that of ``model_hp``, the same
    model with its backward GEMMs in high precision (``switched_recipe(recipe, "bwd")``: the
    same forward pass and parameters). Float32 scalars, replicated. A function apart from
    the train step, which it leaves unchanged."""

    grads = noise_gradients(model, model_hp)

    def noise(params, batch, key_arg, step):
        _traced("noise")
        g, g_q = grads(params, batch, key_arg, step)
        return diagnostics.gradient_noise(g, g_q, name_fn=layer_name)

    return jax.jit(noise, out_shardings=NamedSharding(mesh, P()))


# Config keys that leave the compiled init/train/eval functions unchanged (the seed enters as
# a key argument); runs whose other keys agree share them (``_step_fns``).
_NOT_COMPILED = frozenset({"seed", "out", "resume", "stop_at", "progress", "cache_dir",
                           "checkpoint_every", "log_every", "compare", "resume_override",
                           "overwrite", "keep_checkpoints", "data", "tokenizer", "val_fraction",
                           "eval_every", "eval_batches", "switch_at", "stats_every",
                           "switch_threshold", "switch_window", "grad_noise_every",
                           "bf16_budget", "bf16_warmup"})
_STEP_CACHE: dict[tuple, dict] = {}
_STEP_CACHE_SIZE = 4


def _step_fns(cfg: TrainConfig, recipe: Recipe, mesh: Mesh,
              build: Callable[[], dict]) -> tuple[dict, bool]:
    """The jitted functions of ``cfg`` (``build()`` on a miss), shared by runs that differ only
    in keys of ``_NOT_COMPILED`` (e.g. the seeds of a sweep) or in how their recipe spec is
    written; ``cfg`` has the spec's run-level keys applied and ``recipe`` is its parsed
    recipe (``run_recipe``). The newest few are kept. Returns ``(functions, reused)``."""
    # the builders as looked up now: a monkeypatched one (tests) gets its own entry
    fields = dataclasses.asdict(cfg)  # the recipe canonical: nvfp4(switch_at=0.8) ~ nvfp4
    fields["recipe"] = fp4jax.recipes.spec(recipe)
    key = (tuple(sorted((k, repr(v)) for k, v in fields.items() if k not in _NOT_COMPILED)),
           tuple(d.id for d in mesh.devices.flat),
           tuple(id(f) for f in (make_init_state, make_train_step, make_eval_step)))
    reused = key in _STEP_CACHE
    if reused:
        _STEP_CACHE[key] = _STEP_CACHE.pop(key)  # most recently used last
    else:
        _STEP_CACHE[key] = build()
        while len(_STEP_CACHE) > _STEP_CACHE_SIZE:
            _STEP_CACHE.pop(next(iter(_STEP_CACHE)))
    return _STEP_CACHE[key], reused



class _Progress:
    def __init__(self, total: int, initial: int, enabled: bool, desc: str,
                 quiet: bool = False) -> None:
        self.bar = None
        self.quiet = quiet  # a process other than 0 of a multi-process run: says nothing
        if enabled:
            try:
                from tqdm.auto import tqdm

                tty = sys.stderr.isatty()
                self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True,
                                file=sys.stderr, mininterval=0.2 if tty else 10.0)
            except ImportError:  # tqdm is optional: fall back to log lines
                pass

    def update(self, postfix: dict) -> None:
        if self.bar is not None:
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(1)

    def write(self, msg: str) -> None:
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _restore_newest(ckpt: Checkpointer, target: dict, cfg_dict: dict, overrides: list[str],
                    data_sha: str, out: Path) -> tuple[dict, dict, list[CheckpointDamaged]]:
    """Restores the newest checkpoint that restores completely (metadata, arrays, checksum)
    after checking that its config and data fingerprint match; damaged newer checkpoints are
    moved to ``OUT/checkpoints.damaged/`` and reported. Returns ``(state, meta, damaged)``."""
    where = ckpt.directory

    def check_meta(meta: dict) -> None:
        # with a recorded fingerprint the corpus is checked by content: its path may change
        free = [*overrides, *(["data"] if meta.get("data_sha256") else [])]
        free += ["tokenizer"] if "data" in free else []  # the fingerprint covers it
        diff = config_diff({**meta["config"], **{k: cfg_dict[k] for k in free}}, cfg_dict)
        if diff:
            raise ValueError("refusing to resume with a changed config; differing keys: "
                             + "; ".join(diff) + f" (only {list(OVERRIDABLE_KEYS)} can change, "
                             "named in --resume-override)")
        saved = meta.get("data_sha256")
        if saved is not None and saved != data_sha and "data" not in overrides:
            raise ValueError(
                f"refusing to resume: the training data differ from those of checkpoint "
                f"{meta['step']} (SHA-256 of the split corpus {saved[:12]}... then, "
                f"{data_sha[:12]}... now; --data {cfg_dict['data']!r}, --val-fraction "
                f"{cfg_dict['val_fraction']}): resume on the data the run started with, or pass "
                "--resume-override data to continue on these (recorded in metrics.jsonl)")

    damaged: list[CheckpointDamaged] = []
    steps = ckpt.all_steps()
    for c in reversed(steps):
        try:
            state, meta, note = ckpt.restore_verified(c, target, check_meta)
            if int(state["step"]) != c:
                raise CheckpointDamaged(c, f"it holds the state of step {int(state['step'])}")
        except CheckpointDamaged as e:
            damaged.append(e)
            continue
        for e in damaged:
            moved = ckpt.set_aside(e.step, out / "checkpoints.damaged")
            _note(f"{e}; moved it to {moved}")
        if damaged:
            _note(f"resuming from checkpoint {c}, the newest in {where} that restores completely")
        if note:
            _note(note)
        return state, meta, damaged
    if not steps:
        raise ValueError(f"--resume: no checkpoint in {where}: nothing to resume; start a fresh "
                         "run without --resume (with --overwrite if --out holds an earlier run, "
                         "which moves it aside)")
    raise ValueError(
        f"--resume: no checkpoint in {where} restores completely ("
        + "; ".join(str(e) for e in damaged) + "). Options: start afresh with --overwrite "
        f"(moves this run aside to {out}.old-<time>), or put back an intact copy of "
        f"{where} and resume again")


def _quantized_backward(model: Llama) -> bool:
    """Whether ``model``'s recipe quantizes a backward GEMM (else its gradients carry no
    quantization noise to measure)."""
    r = model.policy.recipe
    return r is not None and (r.dgrad.quantized or r.wgrad.quantized)


def _resume_precision(meta: dict, bf16: dict | None, monitor: Any, switch_step: int
                      ) -> tuple[Any, int]:
    """The auto switch's state from the checkpoint's ``meta`` (the switch step, if it
    fired), after checking that the checkpoint used the BF16 layers ``bf16``."""
    saved = meta.get("bf16_layers")
    if bf16 is not None and saved is not None and saved.get("layers") != bf16["layers"]:
        raise ValueError(f"refusing to resume: checkpoint {meta['step']} trained with BF16 "
                         f"layers {saved.get('layers')}, the run's record says "
                         f"{bf16['layers']} ({precision.RECORD} changed?)")
    if monitor is None:
        return None, switch_step
    st = meta.get("auto_switch") or {}
    monitor = diagnostics.SwitchMonitor(monitor.threshold, monitor.window,
                                        **{k: st.get(k) for k in ("below_since", "switched_at",
                                                                  "last_step")})
    return monitor, (switch_step if monitor.switched_at is None else monitor.switched_at)


@releases_locks
def train(cfg: TrainConfig, dataset: ByteDataset | None = None) -> dict:
    """Runs one training run; returns its result dict (also written to ``out/result.json``).

    A fresh run (``resume`` false) refuses an ``out`` that holds a run unless ``overwrite``
    (which moves it aside to ``OUT.old-<time>``). ``resume`` restores the newest checkpoint
    that restores completely and matches its checksum; damaged newer ones are moved to
    ``OUT/checkpoints.damaged/`` (said on stderr). The config and the data fingerprint must
    match the checkpoint's, except keys named in ``resume_override``.

    Raises:
      TrainingDiverged: non-finite loss, validation loss, grad norm or state (the last good
        checkpoint is kept; ``result.json`` says ``"status": "diverged"``).
      ValueError: bad config (``ConfigError``), ``out`` holds a run (``RunExists``), or
        ``resume`` with a config or data that differ from the checkpoint's, or with no
        checkpoint that restores.
    """
    validate_config(cfg)
    # several processes (jax.distributed): process 0 owns --out; its errors stop every process
    main = processes.is_main()
    processes.on_main(lambda: check_out(cfg.out), what="checking --out")
    out = Path(cfg.out)
    if not cfg.resume:  # refuse before loading data and compiling
        processes.on_main(lambda: claim_out(cfg, dry_run=True), what="checking --out")
    # run-level keys of the spec (nvfp4(last_bf16=0, switch_at=0.8)) applied: rcfg builds
    # the model; cfg (the spec as given) is what results and checkpoints record
    rcfg, recipe = run_recipe(cfg)
    overrides = override_keys(cfg.resume_override)
    mc = model_config(cfg)
    mesh = make_mesh(cfg.devices, cfg.fsdp)
    n_dev = mesh.devices.size
    if cfg.attention == "cudnn" and mesh.devices.flat[0].platform != "gpu":
        raise ValueError(f"--attention cudnn needs NVIDIA GPUs (this run has "
                         f"{mesh.devices.flat[0].platform} devices): use --attention xla")
    if cfg.batch_size % n_dev:
        raise ValueError(f"--batch-size {cfg.batch_size} is not divisible by {n_dev} devices")
    if processes.count() > 1:
        # these keep host-side state in --out (records, warm-up sub-runs) that only process 0
        # would see: not wired for several processes yet
        used = [flag for flag, on in (("--bf16-layers", rcfg.bf16_layers is not None),
                                      ("--switch-at auto", rcfg.switch_at == "auto"),
                                      ("--grad-noise-every", bool(rcfg.grad_noise_every))) if on]
        if used:
            raise ValueError(f"{', '.join(used)}: not supported in a multi-process run yet; "
                             "run them in one process (any number of its devices)")
    ds = dataset or load_dataset(cfg.data, cfg.seq_len, cfg.val_fraction, cfg.cache_dir,
                                 cfg.tokenizer)
    if ds.seq_len != cfg.seq_len:
        raise ValueError(f"dataset seq_len {ds.seq_len} != config seq_len {cfg.seq_len}")
    mc = mc.replace(vocab_size=model_vocab_size(ds, cfg.vocab_size))
    rcfg = rcfg.replace(vocab_size=mc.vocab_size)  # in the compiled steps' cache key
    # --bf16-layers: names, or measured once (auto: an FP4 warm-up sub-run; resumed: the
    # recorded set); rcfg then names them, its BF16 blocks explicit
    bf16 = precision.resolve_bf16_layers(cfg, rcfg, recipe, mc, train, ds)
    if bf16 is not None:
        rcfg = rcfg.replace(last_bf16=last_bf16_blocks(rcfg, mc.n_layers),
                            bf16_layers=",".join(bf16["layers"]) or None)

    policy = make_policy(rcfg, mc, recipe)
    model = Llama(mc, policy)
    switch_step = (cfg.steps + 1 if rcfg.switch_at in (None, "auto")
                   else int(round(rcfg.switch_at * cfg.steps)))
    if switch_step >= cfg.steps:  # --switch-at 1.0 (or rounding to the end): never switches
        switch_step = cfg.steps + 1
    model2 = Llama(mc, policy.replace(recipe=switched_recipe(recipe, rcfg.switch)))
    # --switch-at auto: the host-side decision on the measured gradient-to-noise ratio
    monitor = (diagnostics.SwitchMonitor(rcfg.switch_threshold, rcfg.switch_window)
               if rcfg.switch_at == "auto" else None)

    tx = make_optimizer(cfg)
    schedule = make_schedule(cfg)
    root = jax.random.key(cfg.seed)
    sr_key = jax.random.fold_in(root, 1)
    data_sharding = NamedSharding(mesh, parallel.BATCH)
    init_fn = make_init_state(model, tx, cfg)

    def build() -> dict:
        # the state's layout: replicated, or (--fsdp > 1) each array's fsdp_spec, from its
        # shapes (an abstract evaluation of init: one more "init" trace)
        specs = (parallel.state_specs(jax.eval_shape(init_fn, root), mesh)
                 if mesh.shape["fsdp"] > 1 else _REPLICATED)
        return {
            "init": jax.jit(init_fn, out_shardings=parallel.shardings(specs, mesh)),
            "train": {False: make_train_step(model, tx, None, mesh, specs),
                      True: make_train_step(model2, tx, None, mesh, specs)},
            "eval": {False: make_eval_step(model, None, mesh),
                     True: make_eval_step(model2, None, mesh)}}

    fns, reused = _step_fns(rcfg, recipe, mesh, build)
    state = fns["init"](root)
    n_params = sum(int(x.size) for x in jax.tree.leaves(state["params"]))
    cfg_dict = dataclasses.asdict(cfg)
    data_sha = ds.fingerprint()
    metrics_path = out / "metrics.jsonl"
    ckpt: Checkpointer | None = None

    def open_run() -> None:
        nonlocal ckpt
        if cfg.resume:  # a damaged log stops before any change
            read_metrics(metrics_path, note=lambda _: None)
        else:
            claim_out(cfg)  # --overwrite: moves an earlier run aside
        out.mkdir(parents=True, exist_ok=True)
        lock_out(out)  # a second writer is refused (released when train returns)
        try:
            ckpt = Checkpointer(out / "checkpoints")
        except ImportError:  # orbax-checkpoint is optional: train without checkpoints
            print("fp4jax-train: orbax-checkpoint is not installed: no checkpoints will be "
                  "written (pip install orbax-checkpoint)", file=sys.stderr)

    processes.on_main(open_run, what="opening --out")
    start = 0
    overridden: dict[str, list] = {}
    damaged: list[CheckpointDamaged] = []
    if cfg.resume:
        multi = processes.count() > 1
        # several processes: process 0 restores host arrays and broadcasts them
        host_target = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), state) if multi else None

        def restore() -> Any:
            nonlocal damaged, overridden, monitor, switch_step
            if ckpt is None:
                raise ValueError("--resume needs orbax-checkpoint (pip install "
                                 "orbax-checkpoint)")
            restored, saved_meta, damaged = _restore_newest(
                ckpt, host_target if multi else state, cfg_dict, overrides, data_sha, out)
            saved_cfg = saved_meta["config"]
            overridden = {k: [saved_cfg.get(k), cfg_dict[k]] for k in overrides
                          if saved_cfg.get(k) != cfg_dict[k]}
            saved_sha = saved_meta.get("data_sha256")
            if "data" in overrides and saved_sha not in (None, data_sha):
                overridden["data_sha256"] = [saved_sha, data_sha]
            monitor, switch_step = _resume_precision(saved_meta, bf16, monitor, switch_step)
            return restored

        restored = processes.on_main(restore, template=host_target, what="restoring --resume")
        if multi:  # host arrays -> the state's layout over every process's devices
            state = jax.tree.map(lambda h, d: jax.make_array_from_callback(
                h.shape, d.sharding, lambda idx, h=h: h[idx]), restored, state)
        else:
            state = restored
        start = int(processes.host_value(state["step"]))
        if main:
            _truncate_metrics(metrics_path, start)
    end = cfg.steps if cfg.stop_at is None else min(cfg.steps, cfg.stop_at)

    steps_fn, evals_fn = fns["train"], fns["eval"]
    # built only when asked for (jit compiles on the first call), kept with the cached steps
    stats_fn = (fns.setdefault("stats", {False: make_stats_step(model, mesh),
                                         True: make_stats_step(model2, mesh)})
                if cfg.stats_every else None)
    fp4_names = precision.fp4_layer_names(mc, model.policy)
    noise_fn = (fns.setdefault("noise", {k: make_grad_noise_step(
        m, Llama(mc, m.policy.replace(recipe=switched_recipe(m.policy.recipe, "bwd"))), mesh)
        for k, m in ((False, model), (True, model2))}) if rcfg.grad_noise_every else None)
    val_np = ds.val_batches(cfg.eval_batches, cfg.batch_size)
    val = [processes.global_array(b.shape, data_sharding, lambda r, b=b: b[r]) for b in val_np]
    tokens_per_step = cfg.batch_size * cfg.seq_len

    summary = model.summary()
    header = (f"[{recipe.name}] {mc.num_params() / 1e6:.2f}M params ({cfg.preset}, {mc.ffn}, "
              f"{mc.dtype}); {summary}; {n_dev} {mesh.devices.flat[0].platform} device(s); "
              f"{len(ds.train) / 1e6:.2f}M train / {len(ds.val) / 1e6:.2f}M val {ds.unit}")
    if mc.vocab_size != 256 or getattr(ds, "tokenizer", "bytes") != "bytes":
        header += f"; vocabulary {mc.vocab_size} ({getattr(ds, 'tokenizer', '') or 'ids'})"
    if reused:
        header += "; compiled steps reused from an earlier run (the seed is an argument)"
    if switch_step <= cfg.steps:
        header += f"; switch {rcfg.switch} to BF16 at step {switch_step}"
    elif monitor is not None:
        header += (f"; switch {rcfg.switch} to BF16 once the gradient-to-noise ratio stays "
                   f"below {rcfg.switch_threshold:.4g} for {rcfg.switch_window} steps")
    elif rcfg.switch_at is not None:
        header += f"; switch_at {rcfg.switch_at}: never switches (past the last step)"
    if rcfg.grad_noise_every:
        header += (f"; gradient-to-noise ratio every {rcfg.grad_noise_every} steps"
                   if _quantized_backward(model) else "; gradient-to-noise ratio: not "
                   "measured (the recipe quantizes no backward GEMM)")
    if bf16 is not None:
        header += f"; BF16 layers ({bf16['source']}): {', '.join(bf16['layers']) or 'none'}"
    if cfg.stats_every:
        header += f"; per-layer stats every {cfg.stats_every} steps"
    if processes.count() > 1:
        header += f"; {processes.count()} processes"
    pbar = _Progress(end, start, cfg.progress and main, recipe.name, quiet=not main)
    pbar.write(header)
    log = metrics_path.open("a") if main else None

    def write(rec: dict) -> None:
        if log is not None:  # process 0 writes the run's files
            log.write(json.dumps(rec) + "\n")
            log.flush()

    if bf16 is not None and not cfg.resume:
        write({"type": "bf16_layers", "step": 0, **bf16})
    if overridden or damaged:
        rec: dict[str, Any] = {"type": "resume", "step": start}
        if overridden:
            rec["overrides"] = overridden
        if damaged:
            rec["damaged_checkpoints"] = {str(e.step): e.reason for e in damaged}
        write(rec)
    if overridden:
        pbar.write(f"[{recipe.name}] resuming at step {start} with overrides: "
                   + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in overridden.items()))
    # resumed runs continue the recorded curves (truncated to the checkpoint above)
    history = _history_from_metrics(metrics_path) if cfg.resume and main else {
        "step": [], "loss": [], "val_step": [], "val_loss": []}
    timing = {"t": time.perf_counter(), "train_s": 0.0, "train_tokens": 0, "seen": 0}
    window = {"t": time.perf_counter(), "tokens": 0}
    pending: list[tuple[int, dict]] = []

    def process() -> None:
        """Reads the metrics of dispatched steps (one step behind the device)."""
        while pending:
            s, m = pending.pop(0)
            m = processes.host_value(m)
            loss, gnorm = float(m["loss"]), float(m["grad_norm"])
            now = time.perf_counter()
            dt, timing["t"] = now - timing["t"], now
            timing["seen"] += 1
            if timing["seen"] > 2:  # skip compilation
                timing["train_s"] += dt
                timing["train_tokens"] += tokens_per_step
            if not (math.isfinite(loss) and math.isfinite(gnorm)):
                write({"type": "diverged", "step": s, "loss": loss, "grad_norm": gnorm})
                raise TrainingDiverged(
                    f"[{recipe.name}] loss became {loss} (grad norm {gnorm}) at step {s} "
                    f"(0-based); stopped. {_drop_bad_checkpoints(s)}", s)
            history["step"].append(s)
            history["loss"].append(loss)
            window["tokens"] += tokens_per_step
            tps = timing["train_tokens"] / timing["train_s"] if timing["train_s"] > 0 else 0.0
            pbar.update({"loss": f"{loss:.3f}", "tok/s": f"{tps:,.0f}"})
            if s % cfg.log_every == 0 or s == end - 1:
                wdt = now - window["t"]
                write({"type": "train", "step": s, "loss": loss, "grad_norm": gnorm,
                       "lr": float(schedule(s)), "tokens_per_s": window["tokens"] / wdt,
                       "recipe": (model2 if s >= switch_step else model).policy.recipe.name})
                window["t"], window["tokens"] = now, 0

    def evaluate(s: int) -> float:
        fn = evals_fn[s >= switch_step]
        t0 = time.perf_counter()
        v = float(np.mean([float(processes.host_value(fn(state["params"], b, sr_key)))
                           for b in val]))
        if not math.isfinite(v):
            write({"type": "diverged", "step": s, "val_loss": v})
            raise TrainingDiverged(
                f"[{recipe.name}] validation loss became {v} at step {s} (the state before "
                f"step {s}); stopped. {_drop_bad_checkpoints(s)}", s)
        write({"type": "eval", "step": s, "val_loss": v})
        history["val_step"].append(s)
        history["val_loss"].append(v)
        pbar.write(f"[{recipe.name}] step {s}: val loss {v:.4f}")
        timing["t"] += time.perf_counter() - t0  # keep eval time out of throughput
        window["t"] += time.perf_counter() - t0
        return v

    def measure(s: int, batch: jax.Array) -> None:
        """Writes the per-layer statistics of step ``s`` (the state before it, its batch and
        keys) as a ``"stats"`` record; their time stays out of the throughput."""
        t0 = time.perf_counter()
        st = processes.host_value(stats_fn[s >= switch_step](state["params"], batch, sr_key,
                                                              state["step"]))
        layers = {name: diagnostics.flatten_stats(st[name])
                  for name in sorted(st, key=layer_order)}
        dt = time.perf_counter() - t0
        write({"type": "stats", "step": s, "wall_s": dt, "layers": layers})
        timing["t"] += dt
        window["t"] += dt

    def measure_noise(s: int, batch: jax.Array) -> bool:
        """Writes the gradient-to-noise ratio of step ``s`` (the state before it, its batch
        and keys) as a ``"grad_noise"`` record (its time kept out of the throughput) and
        feeds the auto switch; True when the switch fires at ``s``."""
        t0 = time.perf_counter()
        r = diagnostics.flatten_noise(jax.device_get(noise_fn[s >= switch_step](
            state["params"], batch, sr_key, state["step"])))
        # beside the global ratio (the paper's, over every parameter): the FP4 layers'
        r["fp4_layers"] = diagnostics.combine_noise([r["layers"][n] for n in fp4_names
                                                     if n in r["layers"]])
        dt = time.perf_counter() - t0
        write({"type": "grad_noise", "step": s, "wall_s": dt, **r})
        timing["t"] += dt
        window["t"] += dt
        if monitor is None or not monitor.update(s, r["ratio"]):
            return False
        write({"type": "switch", "step": s, "mode": rcfg.switch, "ratio": r["ratio"],
               "threshold": monitor.threshold, "window": monitor.window,
               "below_since": monitor.below_since})
        pbar.write(f"[{recipe.name}] step {s}: gradient-to-noise ratio {r['ratio']:.3f} below "
                   f"{monitor.threshold:.4g} since step {monitor.below_since}: switching "
                   f"{rcfg.switch} to BF16 from step {s}")
        return True

    def _drop_bad_checkpoints(s: int) -> str:
        """Deletes checkpoints whose parameters give the non-finite step ``s`` (checkpoint
        ``s`` itself: step ``s`` starts from it) and says which checkpoint is good."""
        if not main:
            return "process 0 says which checkpoint is good"
        if ckpt is None:
            return "no checkpoints are written (orbax-checkpoint is not installed)"
        bad = [c for c in ckpt.all_steps() if c >= s]
        for c in bad:
            ckpt.delete(c)
        good = [c for c in ckpt.all_steps() if c < s]
        dropped = f" (deleted checkpoint {bad[0]}: step {s} starts from it)" if bad else ""
        rerun = ("resuming unchanged repeats the divergence exactly; resume with a change, e.g. "
                 "--resume --resume-override lr --lr SMALLER (overridable: "
                 f"{', '.join(OVERRIDABLE_KEYS)}), or retrain with a lower --lr or more blocks in "
                 "BF16 (--first-bf16/--last-bf16)")
        if not good:
            return (f"No good checkpoint was saved{dropped}; retrain with a lower --lr or more "
                    "blocks in BF16 (--first-bf16/--last-bf16)")
        c = max(good)
        return (f"Last good checkpoint: {c} (the state before step {c}) in "
                f"{out / 'checkpoints'}{dropped}; {rerun}")

    def save(s: int) -> None:
        """Checks that the state before step ``s`` is finite, then checkpoints it (with its
        checksum) and prunes: the newest ``keep_checkpoints`` stay, and the newest older one,
        known good (its step gave a finite loss) until this one is."""
        t0 = time.perf_counter()
        host = processes.host_value(state)  # checked below, then saved as it is (one copy)
        leaves = host_leaves(host)
        bad = nonfinite_leaves(leaves)
        if bad:
            write({"type": "diverged", "step": s, "nonfinite": bad})
            raise TrainingDiverged(
                f"[{recipe.name}] the state became non-finite in step {s - 1} (0-based; NaN or "
                f"Inf in {len(bad)} arrays: {', '.join(bad[:3])}{', ...' if bad[3:] else ''}); "
                f"stopped, not checkpointed. {_drop_bad_checkpoints(s)}", s - 1)

        def write_checkpoint() -> None:
            if ckpt is None:
                return
            meta = {"config": cfg_dict, "step": s, "data_sha256": data_sha,
                    **({"bf16_layers": bf16} if bf16 is not None else {}),
                    **({"auto_switch": monitor.state()} if monitor is not None else {})}
            try:
                ckpt.save(s, host, meta, checksum=state_checksum(leaves))
            except Exception as e:
                raise OSError(
                    f"checkpoint {s} could not be written to {ckpt.directory} ({e}); the "
                    "checkpoints before it are intact: free the space or fix the folder, then "
                    "rerun with --resume") from e
            ckpt.prune(cfg.keep_checkpoints, max((c for c in ckpt.all_steps() if c < s),
                                                 default=None))
            # the training stall of this checkpoint (synchronous: device-to-host copy,
            # finiteness check, checksum, write, prune), kept out of tokens/s. Writing in a
            # background thread was measured and made training slower (issue 16's note).
            write({"type": "checkpoint", "step": s, "seconds": time.perf_counter() - t0})

        processes.on_main(write_checkpoint, what=f"writing checkpoint {s}")
        timing["t"] += time.perf_counter() - t0
        window["t"] += time.perf_counter() - t0

    def result(status: str, diverged_at: int | None = None) -> dict:
        wall = time.perf_counter() - t_start
        tps = timing["train_tokens"] / timing["train_s"] if timing["train_s"] > 0 else None
        vs, vl = history["val_step"], history["val_loss"]
        finished = status == "finished" and bool(vs) and vs[-1] == cfg.steps
        res = {
            "recipe": recipe.name, "spec": cfg.recipe, "seed": cfg.seed, "preset": cfg.preset,
            "params": n_params, "policy": summary,
            "status": status, "diverged_at": diverged_at,
            "steps": end if diverged_at is None else diverged_at,
            "final_val_loss": vl[-1] if finished else None,
            "last_val_step": vs[-1] if vs else None, "last_val_loss": vl[-1] if vl else None,
            "final_train_loss": history["loss"][-1] if history["loss"] else None,
            "tokens_per_s": tps, "devices": n_dev, "processes": processes.count(),
            "platform": mesh.devices.flat[0].platform,
            "device_kind": mesh.devices.flat[0].device_kind, "wall_s": wall,
            "data_sha256": data_sha, "config": cfg_dict, "history": history,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "threefry_lowering": ("kernel" if jax.config.jax_threefry_gpu_kernel_lowering
                                  else "xla"),
            "bf16_layers": bf16["layers"] if bf16 is not None else None,
            "switch_step": switch_step if switch_step < end else None,
            "bf16_gemm_fraction": precision.bf16_gemm_fraction(
                mc, model.policy, model2.policy, end if diverged_at is None else diverged_at,
                switch_step),
        }
        if main:
            tmp = out / "result.json.tmp"
            tmp.write_text(json.dumps(res, indent=1))
            os.replace(tmp, out / "result.json")
        return res

    t_start = time.perf_counter()
    try:
        if start == 0 and cfg.eval_every:
            evaluate(0)
        elif (start and ((cfg.eval_every and start % cfg.eval_every == 0) or start == cfg.steps)
              and history["val_step"][-1:] != [start]):
            evaluate(start)  # its record was lost (a torn metrics.jsonl): the same value again
        for s in range(start, end):
            batch = processes.global_array(  # each process reads the rows it holds
                (cfg.batch_size, cfg.seq_len + 1), data_sharding,
                lambda r, s=s: ds.train_batch(s, cfg.batch_size, cfg.seed, r))
            if (noise_fn is not None and s % rcfg.grad_noise_every == 0
                    and _quantized_backward(model2 if s >= switch_step else model)):
                process()
                if measure_noise(s, batch):  # the auto switch fired: step s runs switched
                    switch_step = s
            if stats_fn is not None and s % cfg.stats_every == 0:
                process()
                measure(s, batch)  # before the step, which donates the state
            state, m = steps_fn[s >= switch_step](state, batch, sr_key)
            process()  # metrics of step s-1 while step s runs
            pending.append((s, m))
            done = s + 1
            if (cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.steps:
                process()
                evaluate(done)
            if (cfg.checkpoint_every and done % cfg.checkpoint_every == 0) or done == end:
                process()
                save(done)
        process()
        if ckpt is not None:
            ckpt.prune(cfg.keep_checkpoints)  # the run ended good: the newest N stay
    except TrainingDiverged as e:
        result("diverged", e.step)
        raise
    finally:
        pbar.close()
        if log is not None:
            log.close()
        if ckpt is not None:
            ckpt.close()
    return result("finished" if end == cfg.steps else "stopped")
