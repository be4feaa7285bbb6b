"""The configuration of a training run and what is built from it alone: ``TrainConfig`` (every
knob, also the CLI flags), the config-key constants (``SWITCH_MODES``, ``SCHEDULES``,
``RESUMABLE_KEYS``, ``OVERRIDABLE_KEYS``), the model config of a run (``model_config``), its
precision policy and precision switch (``make_policy``, ``last_bf16_blocks``,
``switched_recipe``), and its learning-rate schedule and optimizer (``make_schedule``,
``make_optimizer``), and the checks of a config's values (``validate_config``, run by
``TrainConfig`` itself: a bad value raises ``ConfigError``, a ``ValueError`` naming the field).
A config parses each of its recipe specs once, when it validates itself (``run_spec``, through
``fp4jax.recipes.parse_run_spec``), and keeps them (``parsed_spec``); the configs derived from
it (``replace``, ``derive``, ``with_recipe``) inherit them, so nothing below the config parses
a spec string again (``fp4jax.train.plan``). Nothing here touches devices, data or files.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import math
import numbers
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

import fp4jax.recipes
from fp4jax.models.llama import ATTENTION, SCAN_REMAT, LlamaConfig, get_preset
from fp4jax.nn.policy import PrecisionPolicy
from fp4jax.recipes import GemmSpec, Recipe, RunSpec
from fp4jax.train.tokens import MAX_VOCAB, parse_tokenizer_spec

SWITCH_MODES = ("fwd", "bwd", "both")
SCHEDULES = ("wsd", "cosine")
# Config keys that may change between a run and its resumption.
RESUMABLE_KEYS = frozenset(
    {"out", "resume", "stop_at", "progress", "cache_dir", "checkpoint_every", "log_every",
     "devices", "fsdp", "compare", "resume_override", "overwrite", "keep_checkpoints",
     "stats_every", "scan_remat", "attention", "fp4_param_gather"}
)
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


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Every knob of a training run (also the CLI flags, with ``_`` as ``-``)."""

    preset: str = "tiny"
    recipe: str = "nvfp4"
    ffn: str | None = None
    dtype: str | None = None
    n_experts: int = 0  # > 0: the Llama's FFNs as mixtures of experts (fp4jax.models.moe)
    top_k: int = 2
    data: str | None = None
    tokenizer: str | None = None  # None: bytes for text, the files' own for token files
    vocab_size: int | None = None  # None: the data's vocabulary
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
    switch_at: float | str | None = None
    switch: str = "both"
    switch_threshold: float = math.sqrt(3.0)
    switch_window: int = 50
    grad_noise_every: int = 0
    bf16_layers: str | None = None
    bf16_budget: float = 0.15
    bf16_warmup: int = 50
    eval_every: int = 20
    eval_batches: int = 4
    log_every: int = 10
    checkpoint_every: int = 0
    seed: int = 0
    devices: int = 0
    fsdp: int = 1
    out: str = "runs/train"
    resume: bool = False
    stop_at: int | None = None
    progress: bool = True
    compare: str | None = None
    resume_override: str | None = None
    scan_layers: bool = False
    scan_remat: str | None = None  # None: the model's default with scan_layers ("dots")
    attention: str = "auto"  # cuDNN's fused attention where it runs, else XLA's
    attn_recipe: str | None = None  # FP4 attention in every block (fp4jax.attention)
    overwrite: bool = False
    keep_checkpoints: int = 3
    stats_every: int = 0
    model: str | None = None  # MODULE:FACTORY (fp4jax.train.models.FACTORY_PROTOCOL)
    model_args: str | None = None  # JSON object: the factory's keyword arguments
    rules: str | None = None  # JSON/TOML file of pattern -> recipe spec (with --model)
    # with --fsdp > 1: gather the weights of 2D-NVFP4 layers as packed FP4 codes (the same
    # bits; fp4jax.sharding.fp4_all_gather)
    fp4_param_gather: bool = False
    # TetraJet-v2's OsciReset (fp4jax.train.oscillation): the fraction of the steps from
    # which it runs (None: off), its period, tracking steps and ratio threshold
    osci_reset: float | None = None
    osci_period: int = 200
    osci_iters: int = 50
    osci_threshold: float = 8.0
    # TetraJet-v2's OutControl (fp4jax.outcontrol): the ratio of each quantized layer's input
    # channels kept in MXFP8 (None: off), the first step whose forward passes record the
    # channels' norms, the number of recorded steps (the split runs from start + iters on)
    # and the multiple the channel count is rounded up to (the authors': 128)
    outcontrol: float | None = None
    outcontrol_start: int = 501
    outcontrol_iters: int = 50
    outcontrol_multiple: int = 128

    def __post_init__(self) -> None:
        validate_config(self)

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes`` (field names) applied, validated. The recipe specs this
        config parsed are not parsed again (``parsed_spec``).

        Raises:
          TypeError: an unknown field.
          ConfigError: a bad value.
        """
        return derive(self, {}, **changes)


def derive(cfg: TrainConfig, parsed: Mapping[str, RunSpec], **changes: Any) -> TrainConfig:
    """``cfg.replace(**changes)`` that knows more parsed specs: ``parsed`` maps a spec's text
    to its ``RunSpec`` (what ``run_spec`` would give), so a config whose recipe comes from a
    recipe object (``with_recipe``) or from a spec's base is validated without parsing it.
    The specs ``cfg`` parsed are not parsed again either.

    Raises:
      TypeError: an unknown field.
      ConfigError: a bad value.
    """
    inspect.signature(type(cfg)).bind_partial(**changes)  # the constructor's TypeError
    new = copy.copy(cfg)  # no __init__: validated below, with the specs already parsed
    for k, v in changes.items():
        object.__setattr__(new, k, v)
    object.__setattr__(new, "_specs", {**(cfg.__dict__.get("_specs") or {}), **parsed})
    validate_config(new)
    return new


def with_recipe(cfg: TrainConfig, recipe: Recipe, **changes: Any) -> TrainConfig:
    """``cfg`` running the recipe object ``recipe`` (and ``changes``): its ``recipe`` field is
    the spec ``fp4jax.recipes.spec(recipe)`` (results and checkpoints record it), which is
    not parsed back (``derive``).

    Raises:
      ConfigError: a bad value.
    """
    text = fp4jax.recipes.spec(recipe)
    return derive(cfg, {text: RunSpec.plain(text, recipe)}, recipe=text, **changes)


def split_specs(text: str | None) -> list[str]:
    """The recipe specs of a ``--compare`` list: split at commas outside parentheses, brackets
    and quotes, blanks dropped (``"nvfp4,nvfp4(sr=False, rht=0),bf16"`` gives three specs).

    Raises:
      ValueError: unbalanced parentheses.
    """
    return fp4jax.recipes.split_list(text or "")


# run-level keys a spec may carry beside the recipe's (``nvfp4(last_bf16=0)``,
# ``nvfp4(switch_at=0.8, switch=fwd)``): they set the TrainConfig field of the same name
RUN_KEYS: dict[str, str] = {
    "first_bf16": "leading blocks kept in BF16 (int >= 0)",
    "last_bf16": "trailing blocks kept in BF16 (int >= -1; -1: the last ~15%)",
    "switch_at": "fraction of training after which the GEMMs of `switch` run in BF16 "
                 "(number in [0, 1], or auto: by the gradient-to-noise monitor; as "
                 "--switch-at)",
    "switch": f"GEMMs switched to BF16 at switch_at: one of {list(SWITCH_MODES)}",
    "bf16_layers": "linear layers kept in BF16 (as --bf16-layers: auto, auto:PATH, or "
                   "quoted comma-separated names such as 'block_3/q,block_5/down')",
    "bf16_budget": "fraction of the measured layers --bf16-layers auto keeps in BF16 "
                   "(number in [0, 1])",
    "grad_noise_every": "steps between gradient-to-noise measurements (int >= 0, as "
                        "--grad-noise-every)",
    "switch_threshold": "ratio below which switch_at=auto switches (number > 0)",
    "switch_window": "steps the ratio must stay below the threshold (int >= 0)",
    "attn_recipe": "FP4 attention in every block of the built-in Llama (as --attn-recipe: "
                   "attn_nvfp4, attn_mxfp4, attn_nvfp4_all, attn_bf16, or a recipe spec)",
    "osci_reset": "fraction of training from which TetraJet-v2's OsciReset runs (number in "
                  "[0, 1]; as --osci-reset)",
    "osci_period": "steps between OsciReset's snapshots (int >= 3)",
    "osci_iters": "steps OsciReset tracks after a snapshot (int in [1, osci_period - 2])",
    "osci_threshold": "OsciReset's distance ratio at or above which a weight is reset "
                      "(number > 0)",
    "outcontrol": "ratio of each quantized layer's input channels TetraJet-v2's OutControl "
                  "keeps in MXFP8 (number in (0, 1); as --outcontrol)",
    "outcontrol_start": "first step whose forward pass records OutControl's channel norms "
                        "(int >= 0)",
    "outcontrol_iters": "steps OutControl records before it splits the channels (int >= 1)",
    "outcontrol_multiple": "OutControl's channel count is rounded up to a multiple of this "
                           "(int >= 16, a multiple of 16)",
}


def _is_attention_recipe(name: str) -> bool:
    try:
        fp4jax.recipes.get_attention(name)
    except (TypeError, ValueError):
        return False
    return True


def _run_value(key: str, text: str) -> Any:
    """The value of the run-level key ``key`` given as ``text`` in a spec, checked (the
    converter of ``key`` in ``fp4jax.recipes.parse_run_spec``).

    Raises:
      ValueError saying what the key takes (the spec and the item are added by the parser).
    """
    import ast

    try:
        v = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        v = text  # a bare word: switch=fwd
    want = RUN_KEYS[key]
    ok = {
        "first_bf16": _is_int(v) and v >= 0,
        "last_bf16": _is_int(v) and v >= -1,
        "switch_at": v == "auto" or (_is_real(v) and math.isfinite(v) and 0.0 <= v <= 1.0),
        "switch": v in SWITCH_MODES,
        "bf16_layers": isinstance(v, str) and bool(v.strip()),
        "bf16_budget": _is_real(v) and math.isfinite(v) and 0.0 <= v <= 1.0,
        "grad_noise_every": _is_int(v) and v >= 0,
        "switch_threshold": _is_real(v) and math.isfinite(v) and v > 0,
        "switch_window": _is_int(v) and v >= 0,
        "attn_recipe": isinstance(v, str) and _is_attention_recipe(v),
        "osci_reset": _is_real(v) and math.isfinite(v) and 0.0 <= v <= 1.0,
        "osci_period": _is_int(v) and v >= 3,
        "osci_iters": _is_int(v) and v >= 1,
        "osci_threshold": _is_real(v) and math.isfinite(v) and v > 0,
        "outcontrol": _is_real(v) and math.isfinite(v) and 0.0 < v < 1.0,
        "outcontrol_start": _is_int(v) and v >= 0,
        "outcontrol_iters": _is_int(v) and v >= 1,
        "outcontrol_multiple": _is_int(v) and v >= 16 and v % 16 == 0,
    }[key]
    if not ok:
        raise ValueError(f"{key} is {want}")
    if key == "bf16_layers":
        return v.strip()
    return (float(v) if key in ("switch_at", "bf16_budget", "switch_threshold", "osci_reset",
                                 "osci_threshold", "outcontrol") and v != "auto"
            else v)


# the converters of the run-level keys, as fp4jax.recipes.parse_run_spec takes them
_RUN_KEY_VALUES = {k: functools.partial(_run_value, k) for k in RUN_KEYS}


def run_spec(spec: str) -> RunSpec:
    """Parses a recipe spec with the run-level keys (``RUN_KEYS``) it may carry beside the
    recipe's (``fp4jax.recipes.parse_run_spec``): ``"nvfp4(sr=False, last_bf16=0)"`` gives
    the recipe ``nvfp4(sr=False)``, the base spec ``"nvfp4(sr=False)"`` and the run-level
    values ``{"last_bf16": 0}``. A run-level key in the spec takes precedence over the same
    flag (``--last-bf16``) for that spec.

    Raises:
      TypeError: ``spec`` is not a string.
      ValueError: a bad run-level value, or a bad recipe spec, naming the key and listing
        the valid ones.
    """
    return fp4jax.recipes.parse_run_spec(spec, _RUN_KEY_VALUES)


def parsed_spec(cfg: TrainConfig, spec: str) -> RunSpec:
    """``run_spec(spec)`` for a spec of ``cfg`` (its ``recipe`` or a ``compare`` spec),
    parsed once: ``TrainConfig`` parses its specs when it validates itself and keeps them,
    and the configs its ``replace`` derives inherit them.

    Raises:
      TypeError, ValueError: as ``run_spec``.
    """
    known = cfg.__dict__.get("_specs")
    if known is None:
        known = {}
        object.__setattr__(cfg, "_specs", known)
    rs = known.get(spec)
    if rs is None:
        rs = known[spec] = run_spec(spec)
    return rs


def split_run_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """Splits the run-level keys (``RUN_KEYS``: first/last BF16 blocks, precision switch) out
    of a spec, so that every row of an ablation table is one string: ``"nvfp4(sr=False,
    last_bf16=0)"`` gives ``("nvfp4(sr=False)", {"last_bf16": 0})``. A run-level key in the
    spec takes precedence over the same flag (``--last-bf16``) for that spec. (``run_spec``
    gives the parsed recipe too.)

    Raises:
      ValueError: a bad run-level value, or a bad recipe spec (``fp4jax.recipes.parse``),
        naming the key and listing the valid ones.
    """
    rs = run_spec(spec)
    return rs.base, dict(rs.extra)


def run_recipe(cfg: TrainConfig) -> tuple[TrainConfig, Recipe]:
    """``cfg`` with the run-level keys of its recipe spec applied (``split_run_spec``), and the
    parsed recipe. ``cfg.recipe`` stays the whole spec (results and checkpoints record it).
    The spec is the one ``cfg`` parsed when it was built (``parsed_spec``): not parsed again.

    Raises:
      ValueError: a bad spec.
    """
    rs = parsed_spec(cfg, cfg.recipe)
    return cfg.replace(**rs.extra), rs.recipe


def compare_names(spec: str | None) -> list[str]:
    """The recipe specs of a ``--compare`` list (``split_specs``)."""
    return split_specs(spec)


def override_keys(spec: str | None) -> list[str]:
    """The keys of a ``--resume-override`` list (comma-separated, blanks dropped)."""
    return [k.strip() for k in (spec or "").split(",") if k.strip()]


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


# integer field -> its lowest allowed value
_INT_MIN: dict[str, int] = {
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
_INT_MAX: dict[str, tuple[int, str]] = {
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
_REAL_RANGES: dict[str, tuple[float, bool, float | None, bool]] = {
    "val_fraction": (0.0, False, 1.0, False), "lr": (0.0, True, None, False),
    "min_lr_ratio": (0.0, True, None, False), "decay_fraction": (0.0, True, 1.0, True),
    "weight_decay": (0.0, True, None, False), "beta1": (0.0, True, 1.0, False),
    "beta2": (0.0, True, 1.0, False), "clip_norm": (0.0, False, None, False),
    "switch_threshold": (0.0, False, None, False), "bf16_budget": (0.0, True, 1.0, True),
    "osci_threshold": (0.0, False, None, False),
}


def _check_real(field: str, v: Any, lo: float, lo_in: bool, hi: float | None,
                hi_in: bool) -> None:
    want = (f"a finite number {'>=' if lo_in else '>'} {lo:g}" if hi is None else
            f"a number in {'[' if lo_in else '('}{lo:g}, {hi:g}{']' if hi_in else ')'}")
    if not _is_real(v):
        raise ConfigError(field, f"must be {want}, got {v!r}")
    x = float(v)
    ok = math.isfinite(x) and (x >= lo if lo_in else x > lo)
    if hi is not None:
        ok = ok and (x <= hi if hi_in else x < hi)
    if not ok:
        raise ConfigError(field, f"must be {want}, got {v!r}")


def validate_config(cfg: TrainConfig) -> None:
    """Checks every value of ``cfg`` that can be checked without devices, data or files.

    Raises:
      ConfigError: the first field whose value makes no sense (a ``ValueError`` that names the
        field and its CLI flag).
    """
    for field, lo in _INT_MIN.items():  # every size a user types: a range, then the fix
        v = getattr(cfg, field)
        hi, what = _INT_MAX.get(field, (INT32_MAX, ""))
        if not _is_int(v) or v < lo:
            raise ConfigError(field, f"must be an integer >= {lo}, got {v!r}")
        if v > hi:
            raise ConfigError(field, f"must be an integer in {lo}..{hi}"
                              f"{f' ({what})' if what else ''}, got {v!r}")
    ids = cfg.batch_size * (cfg.seq_len + 1)
    if ids > MAX_BATCH_IDS:
        raise ConfigError("batch_size", f"--batch-size {cfg.batch_size} x (--seq-len "
                          f"{cfg.seq_len} + 1) = {ids} token ids a batch, more than "
                          f"{MAX_BATCH_IDS}: lower --batch-size or --seq-len")
    if ids * cfg.eval_batches > MAX_BATCH_IDS:
        raise ConfigError("eval_batches", f"--eval-batches {cfg.eval_batches} x {ids} token "
                          f"ids a batch = {ids * cfg.eval_batches} validation ids held in "
                          f"memory, more than {MAX_BATCH_IDS}: lower --eval-batches")
    for field, bounds in _REAL_RANGES.items():
        _check_real(field, getattr(cfg, field), *bounds)
    if not _is_int(cfg.seed) or not 0 <= cfg.seed <= MAX_SEED:
        raise ConfigError("seed", f"must be an integer in 0..{MAX_SEED} (the batch order's "
                          f"numpy generator takes no negative seed), got {cfg.seed!r}")
    if cfg.stop_at is not None and (not _is_int(cfg.stop_at)
                                    or not 0 <= cfg.stop_at <= INT32_MAX):
        raise ConfigError("stop_at", f"must be an integer in 0..{INT32_MAX} (or None), got "
                          f"{cfg.stop_at!r}")
    if cfg.switch_at is not None and cfg.switch_at != "auto":
        if isinstance(cfg.switch_at, str):
            raise ConfigError("switch_at", f"must be a number in [0, 1] or 'auto', got "
                              f"{cfg.switch_at!r}")
        _check_real("switch_at", cfg.switch_at, 0.0, True, 1.0, True)
    for field in ("resume", "progress", "scan_layers", "overwrite", "fp4_param_gather"):
        if not isinstance(getattr(cfg, field), bool):
            raise ConfigError(field, f"must be True or False, got {getattr(cfg, field)!r}")
    if cfg.fp4_param_gather and isinstance(cfg.fsdp, int) and cfg.fsdp < 2:
        raise ConfigError("fp4_param_gather", f"gathers the weights that --fsdp shards: it "
                          f"needs --fsdp 2 or more (got --fsdp {cfg.fsdp})")
    if cfg.osci_reset is not None:
        _check_real("osci_reset", cfg.osci_reset, 0.0, True, 1.0, True)
        if cfg.osci_iters > cfg.osci_period - 2:
            raise ConfigError("osci_iters", f"must be at most --osci-period - 2 = "
                              f"{cfg.osci_period - 2} (the reset step follows the tracking "
                              f"steps within a period), got {cfg.osci_iters}")
        if cfg.model is not None:
            raise ConfigError("osci_reset", "works with the built-in Llama only (its weights' "
                              "quantizers are known); drop --osci-reset")
        if cfg.switch_at is not None:
            raise ConfigError("osci_reset", "with --switch-at: the forward weights' quantizer "
                              "changes at the switch, which OsciReset does not follow; drop "
                              "one")
    if cfg.outcontrol is None:
        defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
        for field in ("outcontrol_start", "outcontrol_iters", "outcontrol_multiple"):
            if getattr(cfg, field) != defaults[field]:
                raise ConfigError(field, f"sets OutControl, which is off: pass --outcontrol "
                                  f"RATIO too (e.g. 0.1), or drop --{field.replace('_', '-')}")
    if cfg.outcontrol is not None:
        _check_real("outcontrol", cfg.outcontrol, 0.0, False, 1.0, False)
        if cfg.outcontrol_multiple % 16:
            raise ConfigError("outcontrol_multiple", f"must be a multiple of 16 (the NVFP4 "
                              f"block), got {cfg.outcontrol_multiple}")
        split = cfg.outcontrol_start + cfg.outcontrol_iters
        if split >= cfg.steps:
            raise ConfigError("outcontrol_start", f"OutControl records steps "
                              f"{cfg.outcontrol_start}..{split - 1} and splits from step "
                              f"{split}, which a run of {cfg.steps} steps never reaches: "
                              "lower --outcontrol-start or --outcontrol-iters")
        if _is_int(cfg.n_experts) and cfg.n_experts > 0:
            raise ConfigError("outcontrol", "with --n-experts is not built (the experts' "
                              "grouped GEMMs are not split); drop one of them")
        for field, why in (("model", "works with the built-in Llama only"),
                           ("osci_reset", "with --osci-reset is not built (TetraJet-v2 tracks "
                            "only the FP4 channels)"),
                           ("switch_at", "with --switch-at is not built")):
            if getattr(cfg, field) is not None:
                raise ConfigError("outcontrol", f"{why}; drop --outcontrol or --"
                                  f"{field.replace('_', '-')}")
        if cfg.stats_every or cfg.grad_noise_every or str(cfg.bf16_layers or "").startswith(
                "auto"):
            raise ConfigError("outcontrol", "with --stats-every, --grad-noise-every or "
                              "--bf16-layers auto is not built (their measurements would not "
                              "see the channel split); drop one of them")
        if isinstance(cfg.fsdp, int) and cfg.fsdp > 1:
            raise ConfigError("outcontrol", "with --fsdp is not built (its statistic pass "
                              "runs on replicated parameters); drop --outcontrol or --fsdp")
    if cfg.fp4_param_gather and cfg.model is not None:
        raise ConfigError("fp4_param_gather", "works with the built-in Llama only: a --model's"
                          " layer may transform its kernel before the product (which the FP4 "
                          "gather must see unchanged); drop --fp4-param-gather")
    try:
        get_preset(cfg.preset)
    except ValueError as e:
        raise ConfigError("preset", str(e)) from None
    if not isinstance(cfg.recipe, str) or not cfg.recipe.strip():
        raise ConfigError("recipe", f"must be a recipe name or spec, got {cfg.recipe!r}")
    try:
        parsed_spec(cfg, cfg.recipe)
    except ValueError as e:
        raise ConfigError("recipe", str(e)) from None
    if cfg.scan_remat is not None:
        if cfg.scan_remat not in SCAN_REMAT:
            raise ConfigError("scan_remat", f"must be one of {list(SCAN_REMAT)} (or None: "
                              f"'dots' with --scan-layers), got {cfg.scan_remat!r}")
        if not cfg.scan_layers:
            raise ConfigError("scan_remat", "applies to scanned blocks: pass --scan-layers "
                              "too, or leave --scan-remat out")
    if cfg.attention not in ATTENTION:
        raise ConfigError("attention", f"must be one of {list(ATTENTION)}, got "
                          f"{cfg.attention!r}")
    if cfg.attn_recipe is not None:
        try:
            fp4jax.recipes.get_attention(cfg.attn_recipe)
        except (TypeError, ValueError) as e:
            raise ConfigError("attn_recipe", str(e)) from None
    for field, lo in (("n_experts", 0), ("top_k", 1)):
        v = getattr(cfg, field)
        hi = _INT_MAX["n_experts"][0]
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ConfigError(field, f"must be an integer >= {lo}, got {v!r}")
        if v > hi:
            raise ConfigError(field, f"must be an integer in {lo}..{hi}, got {v!r}")
    if cfg.n_experts and cfg.top_k > cfg.n_experts:
        raise ConfigError("top_k", f"must be at most n_experts={cfg.n_experts}, got "
                          f"{cfg.top_k}")
    if cfg.n_experts and cfg.ffn == "smooth_swiglu":
        raise ConfigError("ffn", "smooth_swiglu has no mixture-of-experts form: use swiglu or "
                          "relu2 with --n-experts")
    if cfg.ffn is not None and cfg.ffn not in ("relu2", "swiglu", "smooth_swiglu"):
        raise ConfigError("ffn", f"must be 'relu2', 'swiglu' or 'smooth_swiglu', got "
                                 f"{cfg.ffn!r}")
    if cfg.dtype is not None:
        try:
            floating = jnp.issubdtype(jnp.dtype(cfg.dtype), jnp.floating)
        except TypeError:
            floating = False
        if not floating:
            raise ConfigError("dtype", f"must name a floating dtype (bfloat16, float32), "
                              f"got {cfg.dtype!r}")
    if cfg.schedule not in SCHEDULES:
        raise ConfigError("schedule",
                          f"unknown schedule {cfg.schedule!r}; valid: {list(SCHEDULES)}")
    if cfg.switch not in SWITCH_MODES:
        raise ConfigError("switch", f"unknown switch mode {cfg.switch!r}; valid modes: "
                          f"{list(SWITCH_MODES)}")
    if not isinstance(cfg.out, str) or not cfg.out.strip():
        raise ConfigError("out", f"must be a directory path, got {cfg.out!r}")
    if cfg.tokenizer is not None:
        if not isinstance(cfg.tokenizer, str):
            raise ConfigError("tokenizer", f"must be bytes, bpe:N or a tokenizer.json path, "
                              f"got {cfg.tokenizer!r}")
        try:
            parse_tokenizer_spec(cfg.tokenizer)
        except ValueError as e:
            raise ConfigError("tokenizer", str(e)) from None
    if cfg.vocab_size is not None and (not _is_int(cfg.vocab_size)
                                       or not 2 <= cfg.vocab_size <= MAX_VOCAB):
        raise ConfigError("vocab_size", f"must be an integer in 2..{MAX_VOCAB} (the model's "
                          f"embedding and logits are vocabulary x width; or None: the data's "
                          f"vocabulary), got {cfg.vocab_size!r}")
    for field in ("data", "cache_dir"):
        v = getattr(cfg, field)
        if v is not None and (not isinstance(v, str | os.PathLike) or not str(v).strip()):
            raise ConfigError(field, f"must be a path (or left out), got {v!r}")
    if cfg.compare is not None:
        try:
            names = compare_names(cfg.compare)
        except ValueError as e:
            raise ConfigError("compare", str(e)) from None
        if not names:
            raise ConfigError("compare", f"names no recipe (got {cfg.compare!r}); give "
                              "comma-separated names or specs, e.g. bf16,nvfp4(sr=False)")
        canon = []
        for name in names:
            try:
                rs = parsed_spec(cfg, name)
            except ValueError as e:
                raise ConfigError("compare", str(e)) from None
            eff = {k: rs.extra.get(k, getattr(cfg, k)) for k in RUN_KEYS}  # as the run uses
            if eff["switch_at"] is None:
                eff["switch"] = None  # no switch: its mode does not matter
            canon.append((fp4jax.recipes.spec(rs.recipe), tuple(sorted(eff.items()))))
        twice = sorted({n for n, c in zip(names, canon, strict=True) if canon.count(c) > 1})
        if twice:
            raise ConfigError("compare", f"names {', '.join(twice)} more than once")
    validate_model(cfg)
    keys = override_keys(cfg.resume_override)
    bad = [k for k in keys if k not in OVERRIDABLE_KEYS]
    if bad:
        raise ConfigError("resume_override", f"{bad} cannot be overridden; valid keys: "
                          f"{list(OVERRIDABLE_KEYS)}")
    if keys and not cfg.resume:
        raise ConfigError("resume_override", "needs --resume (resume=True)")
    if cfg.resume and cfg.overwrite:
        raise ConfigError("overwrite", "--overwrite starts afresh and --resume continues: "
                          "give one of them")
    validate_precision(cfg)
    validate_runs(cfg)


def validate_runs(cfg: TrainConfig) -> None:
    """Validates each run ``cfg`` describes as that run alone would be: one run, or every
    run of a ``compare`` sweep (whatever the order of its specs), each with the run-level
    keys of its spec applied (``split_run_spec``: ``nvfp4(switch_at=0.5)`` sets
    ``switch_at``), and the checks that need the run's recipe (``validate_run_recipe``).

    Raises:
      ConfigError: naming the field, why, the fix and, when a spec's run-level keys or a
        sweep take part, the spec.
    """
    specs = compare_names(cfg.compare) if cfg.compare else [cfg.recipe]
    for spec in specs:
        rs = parsed_spec(cfg, spec)
        if not rs.extra and cfg.compare is None:  # the run is cfg itself (checked above)
            validate_run_recipe(cfg, rs.recipe)
            continue
        try:  # validates the run: the base spec, parsed already, has no run-level keys
            derive(cfg, {rs.base: RunSpec.plain(rs.base, rs.recipe)}, recipe=rs.base,
                   compare=None, **rs.extra)
        except ConfigError as e:
            where = "of --compare" if cfg.compare else "of --recipe"
            raise ConfigError(e.field, f"{e.reason} (the run of recipe spec {spec!r} "
                              f"{where})") from None


def validate_run_recipe(cfg: TrainConfig, recipe: Recipe) -> None:
    """The checks of one run's flags against its recipe (run-level keys applied) that need
    no model, data or devices: ``--osci-reset`` needs a weight quantized (round-to-nearest
    or stochastically) in the forward GEMM, ``--fp4-param-gather`` a recipe whose weights
    gather as FP4 (``fp4jax.sharding.param_gather_unsupported_reason``). The run itself
    checks the rest (the layers' shapes).

    Raises:
      ConfigError: naming the flag, the recipe and the fix.
    """
    import fp4jax.sharding

    if cfg.osci_reset is not None and cfg.model is None:
        q = recipe.fprop.rhs
        if not q.quantized or q.rounding not in ("nearest", "stochastic"):
            raise ConfigError("osci_reset", f"recipe {recipe.name!r} does not quantize the "
                              "weights of its forward GEMM to nearest or stochastically: "
                              "OsciReset has no weight to track; drop --osci-reset, or set it "
                              "per spec (nvfp4(osci_reset=0.64))")
    if cfg.fp4_param_gather and cfg.model is None:
        why = fp4jax.sharding.param_gather_unsupported_reason(recipe)
        if why is not None:
            raise ConfigError("fp4_param_gather", f"{why}: no weight of the run would be "
                              "gathered in FP4; drop --fp4-param-gather")


# flags of the built-in Llama that a --model run refuses (their non-default values)
LLAMA_ONLY = ("ffn", "dtype", "scan_layers", "scan_remat", "attn_recipe", "n_experts")


def validate_model(cfg: TrainConfig) -> None:
    """The checks of ``model``, ``model_args`` and ``rules`` (``--model MODULE:FACTORY``):
    their forms (the factory itself is loaded by the run), the Llama-only flags, and the
    features that do not take a foreign model yet.

    Raises:
      ConfigError: naming the field, why, and the fix.
    """
    import json

    if cfg.model is not None:
        where, colon, name = str(cfg.model).rpartition(":") if isinstance(cfg.model, str) \
            else ("", "", "")
        if not colon or not where.strip() or not name.strip():
            raise ConfigError("model", f"must be MODULE:FACTORY (a dotted module importable "
                              f"from the current directory, or path/to/file.py), got "
                              f"{cfg.model!r}")
        for field in LLAMA_ONLY:
            if getattr(cfg, field) not in (None, False):
                raise ConfigError(field, f"sets the built-in Llama; --model {cfg.model} "
                                  "builds its own model: leave it out (pass the model's "
                                  "options in --model-args)")
        for spec in [cfg.recipe] + (compare_names(cfg.compare) if cfg.compare else []):
            if "attn_recipe" in parsed_spec(cfg, spec).extra:
                raise ConfigError("recipe", f"spec {spec!r}: attn_recipe sets the built-in "
                                  f"Llama's attention; --model {cfg.model} builds its own: "
                                  "call fp4jax.attention in its attention instead")
        if cfg.attention not in ("xla", "auto"):
            raise ConfigError("attention", f"sets the built-in Llama's attention; --model "
                              f"{cfg.model} builds its own: leave it out")
    for field in ("model_args", "rules"):
        v = getattr(cfg, field)
        if v is not None and cfg.model is None:
            raise ConfigError(field, "applies to a model given by --model MODULE:FACTORY "
                              "(the built-in Llama takes --preset and the recipe flags)")
    if cfg.model_args is not None:
        try:
            ok = isinstance(json.loads(cfg.model_args), dict)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ConfigError("model_args", f"must be a JSON object such as "
                              f"'{{\"d_model\": 64}}', got {cfg.model_args!r}")
    if cfg.rules is not None and (not isinstance(cfg.rules, str) or not cfg.rules.strip()):
        raise ConfigError("rules", f"must be a path to a JSON or TOML rules file, got "
                          f"{cfg.rules!r}")


AUTO = "auto"


def switch_at_arg(text: str) -> float | str:
    """``--switch-at``'s value: ``"auto"`` or a number (range checked by ``TrainConfig``).

    Raises:
      argparse.ArgumentTypeError: neither.
    """
    import argparse

    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a fraction of the steps in [0, 1] or 'auto', got {text!r}") from None


def explicit_bf16_layers(value: str | None) -> list[str] | None:
    """The layer names of a ``bf16_layers`` value: ``[]`` for None, the comma-separated
    names of a list (``"block_3/q, block_5/down"``), None for ``"auto"``/``"auto:PATH"``
    (chosen by measurement, ``fp4jax.train.precision.resolve_bf16_layers``)."""
    if value is None:
        return []
    if value == AUTO or value.startswith(AUTO + ":"):
        return None
    return [x.strip() for x in value.split(",") if x.strip()]


def bf16_layer_patterns(cfg: TrainConfig, mc: LlamaConfig) -> tuple[str, ...]:
    """The ``PrecisionPolicy.high_precision_layers`` patterns of ``cfg.bf16_layers``.

    Raises:
      ValueError: ``bf16_layers`` is still ``auto`` (resolve it first) or names a layer the
        model does not have.
    """
    from fp4jax.models.llama import policy_layer_name

    names = explicit_bf16_layers(cfg.bf16_layers)
    if names is None:
        raise ValueError(f"bf16_layers={cfg.bf16_layers!r} must be resolved to layer names "
                         "first (fp4jax.train.precision.resolve_bf16_layers)")
    return tuple(policy_layer_name(n, mc) for n in names)


def gradient_noise_problem(recipe: Recipe) -> str | None:
    """Why the gradient-to-noise criterion (FP4-all-the-way Section 4: unbiased stochastic
    rounding of the gradients) does not apply to ``recipe``, or None when it does: the
    recipe must quantize a backward GEMM and round every quantized gradient operand (dy, in
    dgrad and wgrad) stochastically."""
    dys = {"dgrad": recipe.dgrad.lhs, "wgrad": recipe.wgrad.rhs}
    if not (recipe.dgrad.quantized or recipe.wgrad.quantized):
        return ("quantizes no backward GEMM (dgrad, wgrad): its gradients carry no "
                "quantization noise to monitor")
    rtn = [g for g, q in dys.items() if q.quantized and not q.stochastic]
    if rtn:
        return (f"rounds the gradient dy of {' and '.join(rtn)} to nearest: the sqrt(3) "
                "criterion assumes the zero-mean noise of stochastic rounding "
                "(FP4-all-the-way Section 4.1); round-to-nearest errors are biased (its "
                "Appendix B.2)")
    if not any(q.stochastic for q in dys.values()):
        return ("does not quantize the gradient dy in dgrad or wgrad: the sqrt(3) criterion "
                "is about the stochastic-rounding noise of the gradients")
    return None


def validate_precision(cfg: TrainConfig) -> None:
    """The checks of the automatic precision keys (``bf16_layers``, ``switch_at="auto"``),
    for ``cfg.recipe`` and every ``compare`` spec with its run-level keys applied.

    Raises:
      ConfigError: naming the field, why, and the fix.
    """
    from fp4jax.models.llama import policy_layer_name

    specs = [cfg.recipe] + (compare_names(cfg.compare) if cfg.compare else [])
    for spec in specs:
        rs = parsed_spec(cfg, spec)
        rest, run = rs.base, rs.extra
        eff = {k: run.get(k, getattr(cfg, k)) for k in RUN_KEYS}
        where = f" (recipe spec {spec!r})" if run or cfg.compare else ""
        bl = eff["bf16_layers"]
        if bl is not None:
            if not isinstance(bl, str) or not bl.strip():
                raise ConfigError("bf16_layers", f"must be auto, auto:PATH or comma-separated "
                                  f"layer names (e.g. block_3/q,block_5/down), got {bl!r}")
            names = explicit_bf16_layers(bl)
            if names is None and bl != AUTO and not bl[len(AUTO) + 1:].strip():
                raise ConfigError("bf16_layers", f"{bl!r}: give the run directory or "
                                  "metrics.jsonl after auto: (auto:runs/nvfp4)")
            if names is not None and cfg.model is None:  # a --model's: checked by the run
                mc = model_config(cfg)
                for n in names or [""]:
                    try:
                        policy_layer_name(n, mc)
                    except ValueError as e:
                        raise ConfigError("bf16_layers", f"{e}{where}") from None
            if bl == AUTO and cfg.bf16_warmup > cfg.steps:
                raise ConfigError("bf16_warmup", f"the FP4 warm-up of --bf16-layers auto "
                                  f"({cfg.bf16_warmup} steps) is longer than the run "
                                  f"({cfg.steps} steps): give --bf16-warmup <= --steps")
        if eff["switch_at"] == AUTO:
            if not eff["grad_noise_every"]:
                raise ConfigError("switch_at", "auto decides on the gradient-to-noise ratio, "
                                  "measured every --grad-noise-every N steps: give "
                                  f"--grad-noise-every N (e.g. 10){where}")
            problem = gradient_noise_problem(rs.recipe)
            if problem:
                raise ConfigError("switch_at", f"auto needs a recipe with stochastically "
                                  f"rounded FP4 gradients; recipe {rest!r} {problem}. Use "
                                  f"a fixed --switch-at FRACTION instead{where}")



def model_config(cfg: TrainConfig) -> LlamaConfig:
    """The model config: the preset with ``ffn``/``dtype``/``seq_len`` (and
    ``n_experts``/``top_k``) overrides applied."""
    mc = get_preset(cfg.preset)
    changes: dict[str, Any] = {"max_seq_len": max(mc.max_seq_len, cfg.seq_len)}
    if cfg.ffn is not None:
        changes["ffn"] = cfg.ffn
    if cfg.dtype is not None:
        changes["dtype"] = cfg.dtype
    if cfg.scan_layers:
        changes["scan_layers"] = True
    if cfg.scan_remat is not None:
        changes["scan_remat"] = cfg.scan_remat
    if cfg.n_experts:
        changes.update(n_experts=cfg.n_experts, top_k=cfg.top_k)
    changes["attention"] = cfg.attention
    return mc.replace(**changes)


def last_bf16_blocks(cfg: TrainConfig, n_layers: int) -> int:
    """``last_bf16``, or when negative the paper's default: the last ~15% of the blocks, or
    none when ``bf16_layers`` chooses the BF16 layers instead."""
    if cfg.last_bf16 >= 0:
        return cfg.last_bf16
    return 0 if cfg.bf16_layers else math.ceil(0.15 * n_layers)


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
    """The precision policy of a run: ``recipe`` except the first/last BF16 blocks and the
    ``bf16_layers`` (names; ``"auto"`` must have been resolved first, see
    ``fp4jax.train.precision.resolve_bf16_layers``)."""
    return PrecisionPolicy(
        recipe, first_high_precision=cfg.first_bf16,
        last_high_precision=last_bf16_blocks(cfg, mc.n_layers),
        high_precision_layers=bf16_layer_patterns(cfg, mc),
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

