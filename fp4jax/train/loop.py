"""The training loop: the loss, the jit-compiled train and eval steps, the data-parallel
mesh, initial state, and ``train`` (one run: data, model, optimizer, resume from a checkpoint,
the step loop with evaluation, logging to ``metrics.jsonl``, checkpoints and divergence
handling, and the result dict written to ``result.json``). ``TrainingDiverged`` is raised when
the loss or gradient norm becomes non-finite.
"""

from __future__ import annotations

import dataclasses
import json
import math
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
from fp4jax.data import ByteDataset
from fp4jax.models.llama import Llama
from fp4jax.train.checkpoint import (
    Checkpointer,
    _history_from_metrics,
    _truncate_metrics,
    config_diff,
)
from fp4jax.train.config import (
    OVERRIDABLE_KEYS,
    SWITCH_MODES,
    TrainConfig,
    make_optimizer,
    make_policy,
    make_schedule,
    model_config,
    switched_recipe,
)


class TrainingDiverged(RuntimeError):
    """The loss or gradient norm became non-finite."""



def make_mesh(n: int = 0) -> Mesh:
    """A 1-D ``("data",)`` mesh over the first ``n`` local devices (0: all)."""
    devs = jax.local_devices()
    n = n or len(devs)
    if not 1 <= n <= len(devs):
        raise ValueError(f"--devices {n}: only {len(devs)} local devices ({devs[0].platform})")
    return Mesh(np.array(devs[:n]), ("data",))


def loss_fn(model: Llama, params: Any, batch: jax.Array, key: jax.Array) -> jax.Array:
    """Mean next-byte cross-entropy (nats). ``batch (B, T+1)`` int32 -> float32 scalar."""
    logits = model.apply({"params": params}, batch[:, :-1], rngs={"fp4": key})
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def _global_norm(tree: Any) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def make_init_state(model: Llama, tx: optax.GradientTransformation,
                    cfg: TrainConfig) -> Callable[[], dict]:
    """``init() -> {"step", "params", "opt_state"}``: parameters from ``fold_in(seed, 0)``."""

    def init_state():
        x0 = jnp.zeros((1, cfg.seq_len), jnp.int32)
        params = model.init(jax.random.fold_in(jax.random.key(cfg.seed), 0), x0)["params"]
        return {"step": jnp.zeros((), jnp.int32), "params": params,
                "opt_state": tx.init(params)}

    return init_state


def make_train_step(model: Llama, tx: optax.GradientTransformation, base_key: jax.Array,
                    mesh: Mesh) -> Callable:
    """A jit-compiled ``step(state, batch) -> (state, metrics)``; state stays replicated."""

    def step(state, batch):
        key = jax.random.fold_in(base_key, state["step"])
        loss, grads = jax.value_and_grad(lambda p: loss_fn(model, p, batch, key))(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss, "grad_norm": _global_norm(grads)}
        return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

    repl = NamedSharding(mesh, P())
    return jax.jit(step, out_shardings=(repl, repl), donate_argnums=0)


def make_eval_step(model: Llama, base_key: jax.Array, mesh: Mesh) -> Callable:
    """A jit-compiled ``eval(params, batch) -> mean loss``."""
    key = jax.random.fold_in(base_key, 2**31 - 1)
    return jax.jit(lambda p, b: loss_fn(model, p, b, key),
                   out_shardings=NamedSharding(mesh, P()))



class _Progress:
    def __init__(self, total: int, initial: int, enabled: bool, desc: str) -> None:
        self.bar = None
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
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _override_keys(cfg: TrainConfig) -> list[str]:
    keys = [k.strip() for k in (cfg.resume_override or "").split(",") if k.strip()]
    bad = [k for k in keys if k not in OVERRIDABLE_KEYS]
    if bad:
        raise ValueError(f"--resume-override: {bad} cannot be overridden; "
                         f"valid keys: {list(OVERRIDABLE_KEYS)}")
    if keys and not cfg.resume:
        raise ValueError("--resume-override needs --resume")
    return keys


def train(cfg: TrainConfig, dataset: ByteDataset | None = None) -> dict:
    """Runs one training run; returns its result dict (also written to ``out/result.json``).

    Raises:
      TrainingDiverged: non-finite loss/grad norm (the last good checkpoint is kept).
      ValueError: bad config, or ``resume`` with a config that differs from the checkpoint's.
    """
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    recipe = fp4jax.recipes.get(cfg.recipe)
    if cfg.switch not in SWITCH_MODES:
        raise ValueError(f"unknown switch mode {cfg.switch!r}; valid modes: {list(SWITCH_MODES)}")
    if cfg.switch_at is not None and not 0.0 <= cfg.switch_at <= 1.0:
        raise ValueError(f"--switch-at must be a fraction in [0, 1], got {cfg.switch_at}")
    if cfg.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {cfg.steps}")
    overrides = _override_keys(cfg)
    mc = model_config(cfg)
    mesh = make_mesh(cfg.devices)
    n_dev = mesh.devices.size
    if cfg.batch_size % n_dev:
        raise ValueError(f"--batch-size {cfg.batch_size} is not divisible by {n_dev} devices")
    ds = dataset or ByteDataset.load(cfg.data, cfg.seq_len, cfg.val_fraction, cfg.cache_dir)
    if ds.seq_len != cfg.seq_len:
        raise ValueError(f"dataset seq_len {ds.seq_len} != config seq_len {cfg.seq_len}")

    policy = make_policy(cfg, mc, recipe)
    model = Llama(mc, policy)
    switch_step = cfg.steps + 1 if cfg.switch_at is None else int(round(cfg.switch_at * cfg.steps))
    if switch_step >= cfg.steps:  # --switch-at 1.0 (or rounding to the end): never switches
        switch_step = cfg.steps + 1
    model2 = Llama(mc, policy.replace(recipe=switched_recipe(recipe, cfg.switch)))

    tx = make_optimizer(cfg)
    schedule = make_schedule(cfg)
    root = jax.random.key(cfg.seed)
    sr_key = jax.random.fold_in(root, 1)
    repl, data_sharding = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    state = jax.jit(make_init_state(model, tx, cfg), out_shardings=repl)()
    n_params = sum(int(x.size) for x in jax.tree.leaves(state["params"]))
    cfg_dict = dataclasses.asdict(cfg)
    try:
        ckpt: Checkpointer | None = Checkpointer(out / "checkpoints")
    except ImportError:  # orbax-checkpoint is optional: train without checkpoints
        ckpt = None
        print("fp4jax-train: orbax-checkpoint is not installed: no checkpoints will be written "
              "(pip install orbax-checkpoint)", file=sys.stderr)
    metrics_path = out / "metrics.jsonl"
    start = 0
    overridden: dict[str, list] = {}
    if cfg.resume:
        if ckpt is None:
            raise ValueError("--resume needs orbax-checkpoint (pip install orbax-checkpoint)")
        last = ckpt.latest_step()
        if last is None:
            raise ValueError(f"--resume: no checkpoint in {out / 'checkpoints'}")
        saved_cfg = ckpt.meta(last)["config"]
        overridden = {k: [saved_cfg.get(k), cfg_dict[k]] for k in overrides
                      if saved_cfg.get(k) != cfg_dict[k]}
        diff = config_diff({**saved_cfg, **{k: cfg_dict[k] for k in overrides}}, cfg_dict)
        if diff:
            raise ValueError("refusing to resume with a changed config; differing keys: "
                             + "; ".join(diff) + f" (only {list(OVERRIDABLE_KEYS)} can change, "
                             "named in --resume-override)")
        state = ckpt.restore(last, state)
        start = int(state["step"])
        _truncate_metrics(metrics_path, start)
    else:
        if metrics_path.exists():
            metrics_path.unlink()
        for s in list(ckpt.mngr.all_steps()) if ckpt is not None else []:
            ckpt.mngr.delete(s)
    end = cfg.steps if cfg.stop_at is None else min(cfg.steps, cfg.stop_at)

    steps_fn = {False: make_train_step(model, tx, sr_key, mesh),
                True: make_train_step(model2, tx, sr_key, mesh)}
    evals_fn = {False: make_eval_step(model, sr_key, mesh),
                True: make_eval_step(model2, sr_key, mesh)}
    val_np = ds.val_batches(cfg.eval_batches, cfg.batch_size)
    val = [jax.device_put(b, data_sharding) for b in val_np]
    tokens_per_step = cfg.batch_size * cfg.seq_len

    summary = model.summary()
    header = (f"[{recipe.name}] {mc.num_params() / 1e6:.2f}M params ({cfg.preset}, {mc.ffn}, "
              f"{mc.dtype}); {summary}; {n_dev} {mesh.devices.flat[0].platform} device(s); "
              f"{len(ds.train) / 1e6:.2f}M train / {len(ds.val) / 1e6:.2f}M val bytes")
    if switch_step <= cfg.steps:
        header += f"; switch {cfg.switch} to BF16 at step {switch_step}"
    elif cfg.switch_at is not None:
        header += f"; --switch-at {cfg.switch_at}: never switches (past the last step)"
    pbar = _Progress(end, start, cfg.progress, recipe.name)
    pbar.write(header)
    log = metrics_path.open("a")

    def write(rec: dict) -> None:
        log.write(json.dumps(rec) + "\n")
        log.flush()

    if overridden:
        write({"type": "resume", "step": start, "overrides": overridden})
        pbar.write(f"[{recipe.name}] resuming at step {start} with overrides: "
                   + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in overridden.items()))
    # resumed runs continue the recorded curves (truncated to the checkpoint above)
    history = _history_from_metrics(metrics_path) if cfg.resume else {
        "step": [], "loss": [], "val_step": [], "val_loss": []}
    timing = {"t": time.perf_counter(), "train_s": 0.0, "train_tokens": 0, "seen": 0}
    window = {"t": time.perf_counter(), "tokens": 0}
    pending: list[tuple[int, dict]] = []

    def process() -> None:
        """Reads the metrics of dispatched steps (one step behind the device)."""
        while pending:
            s, m = pending.pop(0)
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
                    f"(0-based); stopped. {_drop_bad_checkpoints(s)}")
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
        v = float(np.mean([float(fn(state["params"], b)) for b in val]))
        write({"type": "eval", "step": s, "val_loss": v})
        history["val_step"].append(s)
        history["val_loss"].append(v)
        pbar.write(f"[{recipe.name}] step {s}: val loss {v:.4f}")
        timing["t"] += time.perf_counter() - t0  # keep eval time out of throughput
        window["t"] += time.perf_counter() - t0
        return v

    def _drop_bad_checkpoints(s: int) -> str:
        """Deletes checkpoints whose parameters give the non-finite step ``s`` (checkpoint
        ``s`` itself: step ``s`` starts from it) and says which checkpoint is good."""
        if ckpt is None:
            return "no checkpoints are written (orbax-checkpoint is not installed)"
        bad = [c for c in ckpt.mngr.all_steps() if c >= s]
        for c in bad:
            ckpt.mngr.delete(c)
        good = [c for c in ckpt.mngr.all_steps() if c < s]
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
        if ckpt is None:
            return
        t0 = time.perf_counter()
        ckpt.save(s, state, {"config": cfg_dict, "step": s})
        timing["t"] += time.perf_counter() - t0
        window["t"] += time.perf_counter() - t0

    t_start = time.perf_counter()
    try:
        if start == 0 and cfg.eval_every:
            evaluate(0)
        for s in range(start, end):
            batch = jax.device_put(ds.train_batch(s, cfg.batch_size, cfg.seed), data_sharding)
            state, m = steps_fn[s >= switch_step](state, batch)
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
    finally:
        pbar.close()
        log.close()
        if ckpt is not None:
            ckpt.close()
    wall = time.perf_counter() - t_start
    tps = timing["train_tokens"] / timing["train_s"] if timing["train_s"] > 0 else None
    vs, vl = history["val_step"], history["val_loss"]
    finished = end == cfg.steps and bool(vs) and vs[-1] == cfg.steps
    result = {
        "recipe": recipe.name, "preset": cfg.preset, "params": n_params, "policy": summary,
        "steps": end, "final_val_loss": vl[-1] if finished else None,
        "last_val_step": vs[-1] if vs else None, "last_val_loss": vl[-1] if vl else None,
        "final_train_loss": history["loss"][-1] if history["loss"] else None,
        "tokens_per_s": tps, "devices": n_dev, "platform": mesh.devices.flat[0].platform,
        "device_kind": mesh.devices.flat[0].device_kind, "wall_s": wall, "history": history,
    }
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return result
