"""The groups of a training run's knobs, each a frozen dataclass that checks its own values:
``ArchConfig`` (the model: the built-in Llama's preset and overrides, or a ``--model``
factory; ``ArchConfig.llama`` is the model's own ``LlamaConfig``), ``DataConfig`` (corpus,
tokenizer, batches), ``OptimConfig`` (schedule and AdamW; ``OptimConfig.optimizer``),
``PrecisionConfig`` (the recipe spec, the BF16 layers, the precision switch, the rules file),
``RunDirConfig`` (output directory, checkpoints, resume), ``ResearchConfig`` (measurements,
TetraJet-v2's OsciReset and OutControl) and ``ParallelConfig`` (devices, FSDP).

``fp4jax.train.config.TrainConfig`` keeps the flat fields (the CLI's flags, the records in
``result.json`` and checkpoints) and gives each group as a property (``cfg.optim``, ...);
its validation runs each group's ``validate`` and then the checks that span groups. A group's
fields carry the flat names, so a ``ConfigError`` names the field and flag either way.
Defaults live in ``TrainConfig`` alone: a group is built from a config.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import optax

import fp4jax.recipes
from fp4jax.models.llama import ATTENTION, SCAN_REMAT, LlamaConfig, get_preset
from fp4jax.train.tokens import MAX_VOCAB, parse_tokenizer_spec

SWITCH_MODES = ("fwd", "bwd", "both")
SCHEDULES = ("wsd", "cosine")
# Config keys that ``--resume-override`` may change (they leave the state's structure alone);
# ``data`` lets the corpus (its path and its content, see ``ByteDataset.fingerprint``) change.
OVERRIDABLE_KEYS = ("lr", "min_lr_ratio", "clip_norm", "weight_decay", "beta1", "beta2", "data",
                    "model")


class ConfigError(ValueError):
    """A config value that makes no sense: ``field`` names the ``TrainConfig`` field (the CLI
    flag is ``flag``), ``reason`` says why."""

    def __init__(self, field: str, reason: str) -> None:
        self.field, self.reason = field, reason
        super().__init__(f"TrainConfig.{field} ({self.flag}): {reason}")

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")


def is_int(v: Any) -> bool:
    """An integer that is not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_real(v: Any) -> bool:
    """A real number that is not a bool."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


# integer field -> its lowest allowed value
INT_MIN: dict[str, int] = {
    "seq_len": 2, "batch_size": 1, "steps": 1, "warmup_steps": 0, "first_bf16": 0,
    "last_bf16": -1, "eval_every": 0, "eval_batches": 1, "log_every": 1, "checkpoint_every": 0,
    "devices": 0, "fsdp": 1, "keep_checkpoints": 1, "stats_every": 0,
    "switch_window": 0, "grad_noise_every": 0, "bf16_warmup": 1, "osci_period": 3,
    "osci_iters": 1, "outcontrol_start": 0, "outcontrol_iters": 1, "outcontrol_multiple": 16,
}
INT32_MAX = 2**31 - 1
MAX_SEED = 2**63 - 1  # jax.random.key takes a signed 64-bit seed
# integer field -> its highest allowed value (the others: INT32_MAX, the step counter's and
# XLA's int32 range) and why
INT_MAX: dict[str, tuple[int, str]] = {
    "seq_len": (1 << 20, "tokens per sequence"),
    "batch_size": (1 << 20, "sequences per step"),
    "n_experts": (1 << 12, "experts per mixture (the largest models use a few hundred)"),
    "outcontrol_multiple": (1 << 16, "channels"),
}
# the largest number of token ids one batch (batch_size x (seq_len + 1)) or the validation
# batches (x eval_batches, held in host and device memory for the whole run) may hold: 1 GiB
# of int32 ids, ~8x a batch of 4096 sequences of 8192 tokens
MAX_BATCH_IDS = 1 << 28
# real field -> (low, low included?, high or None, high included?); NaN and infinities are
# always refused
REAL_RANGES: dict[str, tuple[float, bool, float | None, bool]] = {
    "val_fraction": (0.0, False, 1.0, False), "lr": (0.0, True, None, False),
    "min_lr_ratio": (0.0, True, None, False), "decay_fraction": (0.0, True, 1.0, True),
    "weight_decay": (0.0, True, None, False), "beta1": (0.0, True, 1.0, False),
    "beta2": (0.0, True, 1.0, False), "clip_norm": (0.0, False, None, False),
    "switch_threshold": (0.0, False, None, False), "bf16_budget": (0.0, True, 1.0, True),
    "osci_threshold": (0.0, False, None, False),
}
# boolean fields
BOOLS = ("resume", "progress", "scan_layers", "overwrite", "fp4_param_gather")


def check_int(field: str, v: Any) -> None:
    """``v`` within ``INT_MIN[field]`` .. ``INT_MAX[field]`` (else ``INT32_MAX``).

    Raises:
      ConfigError: the range, then the value.
    """
    lo = INT_MIN[field]
    hi, what = INT_MAX.get(field, (INT32_MAX, ""))
    if not is_int(v) or v < lo:
        raise ConfigError(field, f"must be an integer >= {lo}, got {v!r}")
    if v > hi:
        raise ConfigError(field, f"must be an integer in {lo}..{hi}"
                          f"{f' ({what})' if what else ''}, got {v!r}")


def check_real(field: str, v: Any, lo: float, lo_in: bool, hi: float | None,
               hi_in: bool) -> None:
    """``v`` a finite number above ``lo`` (included if ``lo_in``) and below ``hi`` (None: no
    bound; included if ``hi_in``).

    Raises:
      ConfigError: the wanted range and the value.
    """
    want = (f"a finite number {'>=' if lo_in else '>'} {lo:g}" if hi is None else
            f"a number in {'[' if lo_in else '('}{lo:g}, {hi:g}{']' if hi_in else ')'}")
    if not is_real(v):
        raise ConfigError(field, f"must be {want}, got {v!r}")
    x = float(v)
    ok = math.isfinite(x) and (x >= lo if lo_in else x > lo)
    if hi is not None:
        ok = ok and (x <= hi if hi_in else x < hi)
    if not ok:
        raise ConfigError(field, f"must be {want}, got {v!r}")


def override_keys(spec: str | None) -> list[str]:
    """The keys of a ``--resume-override`` list (comma-separated, blanks dropped)."""
    return [k.strip() for k in (spec or "").split(",") if k.strip()]


@dataclasses.dataclass(frozen=True)
class Group:
    """A group of ``TrainConfig`` fields (the same names). ``validate`` checks what the group
    alone decides: ranges and types of its fields (``INT_MIN``, ``REAL_RANGES``, ``BOOLS``)
    and the rules among them."""

    @classmethod
    def of(cls, cfg: Any) -> Group:
        """The group's fields of ``cfg`` (a ``TrainConfig``)."""
        return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})

    def validate(self) -> None:
        """Checks the group's values.

        Raises:
          ConfigError: the first field whose value makes no sense.
        """
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in INT_MIN:
                check_int(f.name, v)
            elif f.name in REAL_RANGES:
                check_real(f.name, v, *REAL_RANGES[f.name])
            elif f.name in BOOLS and not isinstance(v, bool):
                raise ConfigError(f.name, f"must be True or False, got {v!r}")


@dataclasses.dataclass(frozen=True)
class ArchConfig(Group):
    """The model: the built-in Llama's preset and its overrides (``llama``: the model's own
    config), or a ``--model MODULE:FACTORY`` with its JSON keyword arguments."""

    preset: str
    ffn: str | None
    dtype: str | None
    n_experts: int
    top_k: int
    scan_layers: bool
    scan_remat: str | None
    attention: str
    model: str | None
    model_args: str | None

    LLAMA_ONLY: ClassVar[tuple[str, ...]] = ("ffn", "dtype", "scan_layers", "scan_remat",
                                             "n_experts")

    def validate(self) -> None:
        super().validate()
        for field, lo in (("n_experts", 0), ("top_k", 1)):
            v = getattr(self, field)
            hi = INT_MAX["n_experts"][0]
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:  # a Python int
                raise ConfigError(field, f"must be an integer >= {lo}, got {v!r}")
            if v > hi:
                raise ConfigError(field, f"must be an integer in {lo}..{hi}, got {v!r}")
        try:
            get_preset(self.preset)
        except ValueError as e:
            raise ConfigError("preset", str(e)) from None
        if self.scan_remat is not None:
            if self.scan_remat not in SCAN_REMAT:
                raise ConfigError("scan_remat", f"must be one of {list(SCAN_REMAT)} (or None: "
                                  f"'dots' with --scan-layers), got {self.scan_remat!r}")
            if not self.scan_layers:
                raise ConfigError("scan_remat", "applies to scanned blocks: pass --scan-layers "
                                  "too, or leave --scan-remat out")
        if self.attention not in ATTENTION:
            raise ConfigError("attention", f"must be one of {list(ATTENTION)}, got "
                              f"{self.attention!r}")
        if self.n_experts and self.top_k > self.n_experts:
            raise ConfigError("top_k", f"must be at most n_experts={self.n_experts}, got "
                              f"{self.top_k}")
        if self.n_experts and self.ffn == "smooth_swiglu":
            raise ConfigError("ffn", "smooth_swiglu has no mixture-of-experts form: use swiglu "
                              "or relu2 with --n-experts")
        if self.ffn is not None and self.ffn not in ("relu2", "swiglu", "smooth_swiglu"):
            raise ConfigError("ffn", f"must be 'relu2', 'swiglu' or 'smooth_swiglu', got "
                                     f"{self.ffn!r}")
        if self.dtype is not None:
            try:
                floating = jnp.issubdtype(jnp.dtype(self.dtype), jnp.floating)
            except TypeError:
                floating = False
            if not floating:
                raise ConfigError("dtype", f"must name a floating dtype (bfloat16, float32), "
                                  f"got {self.dtype!r}")
        self._validate_factory()

    def _validate_factory(self) -> None:
        if self.model is not None:
            where, colon, name = (self.model.rpartition(":") if isinstance(self.model, str)
                                  else ("", "", ""))
            if not colon or not where.strip() or not name.strip():
                raise ConfigError("model", f"must be MODULE:FACTORY (a dotted module "
                                  f"importable from the current directory, or "
                                  f"path/to/file.py), got {self.model!r}")
            for field in self.LLAMA_ONLY:
                if getattr(self, field) not in (None, False, 0):
                    raise ConfigError(field, f"sets the built-in Llama; --model {self.model} "
                                      "builds its own model: leave it out (pass the model's "
                                      "options in --model-args)")
            if self.attention not in ("xla", "auto"):
                raise ConfigError("attention", f"sets the built-in Llama's attention; --model "
                                  f"{self.model} builds its own: leave it out")
        if self.model_args is not None:
            if self.model is None:
                raise ConfigError("model_args", "applies to a model given by --model "
                                  "MODULE:FACTORY (the built-in Llama takes --preset and the "
                                  "recipe flags)")
            try:
                ok = isinstance(json.loads(self.model_args), dict)
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise ConfigError("model_args", f"must be a JSON object such as "
                                  f"'{{\"d_model\": 64}}', got {self.model_args!r}")

    def llama(self, seq_len: int) -> LlamaConfig:
        """The built-in Llama's config: the preset with the overrides applied and
        ``max_seq_len`` at least ``seq_len``."""
        mc = get_preset(self.preset)
        changes: dict[str, Any] = {"max_seq_len": max(mc.max_seq_len, seq_len)}
        if self.ffn is not None:
            changes["ffn"] = self.ffn
        if self.dtype is not None:
            changes["dtype"] = self.dtype
        if self.scan_layers:
            changes["scan_layers"] = True
        if self.scan_remat is not None:
            changes["scan_remat"] = self.scan_remat
        if self.n_experts:
            changes.update(n_experts=self.n_experts, top_k=self.top_k)
        changes["attention"] = self.attention
        return mc.replace(**changes)


@dataclasses.dataclass(frozen=True)
class DataConfig(Group):
    """The corpus (``data``: text or token files; None: the built-in sample), its tokenizer
    and vocabulary, the token cache, the validation split and the batches (``batch_size``
    sequences of ``seq_len`` tokens a step)."""

    data: str | None
    tokenizer: str | None
    vocab_size: int | None
    cache_dir: str | None
    val_fraction: float
    seq_len: int
    batch_size: int

    @property
    def batch_ids(self) -> int:
        """Token ids a batch holds: ``batch_size x (seq_len + 1)``."""
        return self.batch_size * (self.seq_len + 1)

    def validate(self) -> None:
        super().validate()
        ids = self.batch_ids
        if ids > MAX_BATCH_IDS:
            raise ConfigError("batch_size", f"--batch-size {self.batch_size} x (--seq-len "
                              f"{self.seq_len} + 1) = {ids} token ids a batch, more than "
                              f"{MAX_BATCH_IDS}: lower --batch-size or --seq-len")
        if self.tokenizer is not None:
            if not isinstance(self.tokenizer, str):
                raise ConfigError("tokenizer", f"must be bytes, bpe:N or a tokenizer.json "
                                  f"path, got {self.tokenizer!r}")
            try:
                parse_tokenizer_spec(self.tokenizer)
            except ValueError as e:
                raise ConfigError("tokenizer", str(e)) from None
        if self.vocab_size is not None and (not is_int(self.vocab_size)
                                            or not 2 <= self.vocab_size <= MAX_VOCAB):
            raise ConfigError("vocab_size", f"must be an integer in 2..{MAX_VOCAB} (the "
                              f"model's embedding and logits are vocabulary x width; or None: "
                              f"the data's vocabulary), got {self.vocab_size!r}")
        for field in ("data", "cache_dir"):
            v = getattr(self, field)
            if v is not None and (not isinstance(v, str | os.PathLike) or not str(v).strip()):
                raise ConfigError(field, f"must be a path (or left out), got {v!r}")


@dataclasses.dataclass(frozen=True)
class OptimConfig(Group):
    """The learning-rate schedule and AdamW (``optimizer``)."""

    lr: float
    min_lr_ratio: float
    warmup_steps: int
    schedule: str
    decay_fraction: float
    weight_decay: float
    beta1: float
    beta2: float
    clip_norm: float

    def validate(self) -> None:
        super().validate()
        if self.schedule not in SCHEDULES:
            raise ConfigError("schedule",
                              f"unknown schedule {self.schedule!r}; valid: {list(SCHEDULES)}")

    def schedule_fn(self, steps: int) -> optax.Schedule:
        """Warmup-Stable-Decay (linear warmup, constant, linear decay over the last
        ``decay_fraction`` of ``steps`` to ``min_lr_ratio * lr``) or warmup + cosine."""
        warm = max(0, min(self.warmup_steps, steps - 1))
        end = self.lr * self.min_lr_ratio
        if self.schedule == "cosine":
            return optax.warmup_cosine_decay_schedule(0.0, self.lr, warm, steps, end)
        if self.schedule != "wsd":
            raise ValueError(f"unknown schedule {self.schedule!r}; valid: {list(SCHEDULES)}")
        decay = max(1, int(round(self.decay_fraction * steps)))
        stable = max(0, steps - warm - decay)
        return optax.join_schedules(
            [
                optax.linear_schedule(0.0, self.lr, warm),
                optax.constant_schedule(self.lr),
                optax.linear_schedule(self.lr, end, decay),
            ],
            [warm, warm + stable],
        )

    def optimizer(self, steps: int) -> optax.GradientTransformation:
        """Gradient clipping then AdamW (decoupled weight decay on matrices only) on the
        schedule of a run of ``steps``."""
        return optax.chain(
            optax.clip_by_global_norm(self.clip_norm),
            optax.adamw(
                self.schedule_fn(steps), b1=self.beta1, b2=self.beta2, eps=1e-8,
                weight_decay=self.weight_decay,
                mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p),
            ),
        )


@dataclasses.dataclass(frozen=True)
class PrecisionConfig(Group):
    """What runs in which precision: the recipe spec (parsed by the config), the BF16 blocks
    and layers (``first_bf16``, ``last_bf16``, ``bf16_layers`` with the ``auto`` search's
    budget and warm-up), FP4 attention (``attn_recipe``), the rules file of a ``--model``,
    and the precision switch (``switch_at``, mode ``switch``, the ``auto`` criterion's
    threshold and window)."""

    recipe: str
    first_bf16: int
    last_bf16: int
    bf16_layers: str | None
    bf16_budget: float
    bf16_warmup: int
    attn_recipe: str | None
    rules: str | None
    switch_at: float | str | None
    switch: str
    switch_threshold: float
    switch_window: int

    def validate(self) -> None:
        super().validate()
        if self.switch_at is not None and self.switch_at != "auto":
            if isinstance(self.switch_at, str):
                raise ConfigError("switch_at", f"must be a number in [0, 1] or 'auto', got "
                                  f"{self.switch_at!r}")
            check_real("switch_at", self.switch_at, 0.0, True, 1.0, True)
        if not isinstance(self.recipe, str) or not self.recipe.strip():
            raise ConfigError("recipe", f"must be a recipe name or spec, got {self.recipe!r}")
        if self.attn_recipe is not None:
            try:
                fp4jax.recipes.get_attention(self.attn_recipe)
            except (TypeError, ValueError) as e:
                raise ConfigError("attn_recipe", str(e)) from None
        if self.switch not in SWITCH_MODES:
            raise ConfigError("switch", f"unknown switch mode {self.switch!r}; valid modes: "
                              f"{list(SWITCH_MODES)}")
        if self.rules is not None and (not isinstance(self.rules, str)
                                       or not self.rules.strip()):
            raise ConfigError("rules", f"must be a path to a JSON or TOML rules file, got "
                              f"{self.rules!r}")


@dataclasses.dataclass(frozen=True)
class RunDirConfig(Group):
    """The run directory (``out``), what a repeated command does with it (``resume``,
    ``overwrite``, ``resume_override``), and the checkpoints."""

    out: str
    resume: bool
    overwrite: bool
    keep_checkpoints: int
    checkpoint_every: int
    resume_override: str | None

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.out, str) or not self.out.strip():
            raise ConfigError("out", f"must be a directory path, got {self.out!r}")
        keys = override_keys(self.resume_override)
        bad = [k for k in keys if k not in OVERRIDABLE_KEYS]
        if bad:
            raise ConfigError("resume_override", f"{bad} cannot be overridden; valid keys: "
                              f"{list(OVERRIDABLE_KEYS)}")
        if keys and not self.resume:
            raise ConfigError("resume_override", "needs --resume (resume=True)")
        if self.resume and self.overwrite:
            raise ConfigError("overwrite", "--overwrite starts afresh and --resume continues: "
                              "give one of them")


@dataclasses.dataclass(frozen=True)
class OsciResetConfig(Group):
    """TetraJet-v2's OsciReset (``fp4jax.train.oscillation``): from the fraction
    ``osci_reset`` of the steps (None: off), every ``osci_period`` steps, tracking
    ``osci_iters`` steps, resetting weights whose oscillation ratio passes the threshold."""

    osci_reset: float | None
    osci_period: int
    osci_iters: int
    osci_threshold: float

    @property
    def on(self) -> bool:
        return self.osci_reset is not None

    def validate(self) -> None:
        super().validate()
        if self.on:
            check_real("osci_reset", self.osci_reset, 0.0, True, 1.0, True)
            if self.osci_iters > self.osci_period - 2:
                raise ConfigError("osci_iters", f"must be at most --osci-period - 2 = "
                                  f"{self.osci_period - 2} (the reset step follows the "
                                  f"tracking steps within a period), got {self.osci_iters}")


@dataclasses.dataclass(frozen=True)
class OutControlConfig(Group):
    """TetraJet-v2's OutControl (``fp4jax.outcontrol``): the ratio of each quantized layer's
    input channels kept in MXFP8 (None: off), the first step whose forward passes record the
    channels' norms, the number of recorded steps (the split runs from start + iters on) and
    the multiple the channel count is rounded up to (the authors': 128)."""

    outcontrol: float | None
    outcontrol_start: int
    outcontrol_iters: int
    outcontrol_multiple: int

    @property
    def on(self) -> bool:
        return self.outcontrol is not None

    @property
    def split_step(self) -> int:
        """The first step of the channel split."""
        return self.outcontrol_start + self.outcontrol_iters

    def validate(self) -> None:
        super().validate()
        if self.on:
            check_real("outcontrol", self.outcontrol, 0.0, False, 1.0, False)
            if self.outcontrol_multiple % 16:
                raise ConfigError("outcontrol_multiple", f"must be a multiple of 16 (the "
                                  f"NVFP4 block), got {self.outcontrol_multiple}")


@dataclasses.dataclass(frozen=True)
class ResearchConfig(Group):
    """Measurements (per-layer statistics every ``stats_every`` steps, the gradient-to-noise
    ratio every ``grad_noise_every``) and TetraJet-v2's training fixes (``osci``,
    ``outcontrol``)."""

    stats_every: int
    grad_noise_every: int
    osci: OsciResetConfig
    outcontrol: OutControlConfig

    @classmethod
    def of(cls, cfg: Any) -> ResearchConfig:
        return cls(cfg.stats_every, cfg.grad_noise_every, OsciResetConfig.of(cfg),
                   OutControlConfig.of(cfg))

    def validate(self) -> None:
        super().validate()
        self.osci.validate()
        self.outcontrol.validate()


@dataclasses.dataclass(frozen=True)
class ParallelConfig(Group):
    """Devices (0: all local ones), the FSDP split of the state, and the FP4 gather of
    2D-NVFP4 weights under FSDP (``fp4jax.sharding.fp4_all_gather``)."""

    devices: int
    fsdp: int
    fp4_param_gather: bool

    def validate(self) -> None:
        super().validate()
        if self.fp4_param_gather and self.fsdp < 2:
            raise ConfigError("fp4_param_gather", f"gathers the weights that --fsdp shards: it "
                              f"needs --fsdp 2 or more (got --fsdp {self.fsdp})")
