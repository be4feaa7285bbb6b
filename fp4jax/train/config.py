"""The configuration of a training run and what is built from it alone: ``TrainConfig`` (every
knob, also the CLI flags), the config-key constants (``SWITCH_MODES``, ``SCHEDULES``,
``RESUMABLE_KEYS``, ``OVERRIDABLE_KEYS``), the model config of a run (``model_config``), its
precision policy and precision switch (``make_policy``, ``last_bf16_blocks``,
``switched_recipe``), and its learning-rate schedule and optimizer (``make_schedule``,
``make_optimizer``). Nothing here touches devices, data or files.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import optax

import fp4jax.recipes
from fp4jax.models.llama import LlamaConfig, get_preset
from fp4jax.nn.policy import PrecisionPolicy
from fp4jax.recipes import GemmSpec, Recipe

SWITCH_MODES = ("fwd", "bwd", "both")
SCHEDULES = ("wsd", "cosine")
# Config keys that may change between a run and its resumption.
RESUMABLE_KEYS = frozenset(
    {"out", "resume", "stop_at", "progress", "cache_dir", "checkpoint_every", "log_every",
     "devices", "compare", "resume_override"}
)
# Config keys that ``--resume-override`` may change (they leave the state's structure alone).
OVERRIDABLE_KEYS = ("lr", "min_lr_ratio", "clip_norm", "weight_decay", "beta1", "beta2")


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


def switched_recipe(recipe: Recipe, mode: str) -> Recipe:
    """``recipe`` with the forward (``"fwd"``), backward (``"bwd"``) or all (``"both"``) GEMMs
    in high precision (NVFP4 paper Appendix D; FP4-all-the-way QAF is ``"bwd"``)."""
    hp = GemmSpec()
    if mode == "fwd":
        return recipe.replace(name=f"{recipe.name}>bf16-fwd", fprop=hp)
    if mode == "bwd":
        return recipe.replace(name=f"{recipe.name}>bf16-bwd", dgrad=hp, wgrad=hp)
    if mode == "both":
        return fp4jax.recipes.bf16()
    raise ValueError(f"unknown switch mode {mode!r}; valid modes: {list(SWITCH_MODES)}")


def make_policy(cfg: TrainConfig, mc: LlamaConfig, recipe: Recipe) -> PrecisionPolicy:
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

