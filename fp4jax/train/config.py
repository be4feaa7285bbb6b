"""The configuration of a training run and what is built from it alone: ``TrainConfig`` (every
knob, also the CLI flags), the config-key constants (``SWITCH_MODES``, ``SCHEDULES``,
``RESUMABLE_KEYS``, ``OVERRIDABLE_KEYS``), the model config of a run (``model_config``), its
precision policy and precision switch (``make_policy``, ``last_bf16_blocks``,
``switched_recipe``), and its learning-rate schedule and optimizer (``make_schedule``,
``make_optimizer``), and the checks of a config's values (``validate_config``, run by
``TrainConfig`` itself: a bad value raises ``ConfigError``, a ``ValueError`` naming the field).
The fields stay flat (the CLI's flags, the records); ``TrainConfig`` gives them as frozen
groups that check their own values (``cfg.arch``, ``dataset``, ``optim``, ``precision``,
``rundir``, ``research``, ``parallel``: ``fp4jax.train.groups``), and ``validate_config``
adds the rules that span groups.
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
from collections.abc import Mapping
from typing import Any

import optax

import fp4jax.recipes
from fp4jax.models.llama import LlamaConfig
from fp4jax.nn.policy import PrecisionPolicy
from fp4jax.recipes import GemmSpec, Recipe, RunSpec
from fp4jax.train.groups import (
    INT32_MAX,
    MAX_BATCH_IDS,
    MAX_SEED,
    OVERRIDABLE_KEYS,
    SCHEDULES,
    SWITCH_MODES,
    ArchConfig,
    ConfigError,
    DataConfig,
    OptimConfig,
    ParallelConfig,
    PrecisionConfig,
    ResearchConfig,
    RunDirConfig,
    check_int,
    is_int,
    is_real,
    override_keys,
)

__all__ = ["AUTO", "INT32_MAX", "MAX_BATCH_IDS", "MAX_SEED", "OVERRIDABLE_KEYS",
           "RESUMABLE_KEYS", "SCHEDULES", "SWITCH_MODES", "ConfigError", "TrainConfig",
           "compare_names", "derive", "last_bf16_blocks", "make_optimizer", "make_policy",
           "make_schedule", "model_config", "override_keys", "parsed_spec", "run_recipe",
           "run_spec", "split_run_spec", "split_specs", "switched_recipe", "validate_config",
           "with_recipe"]

# Config keys that may change between a run and its resumption.
RESUMABLE_KEYS = frozenset(
    {"out", "resume", "stop_at", "progress", "cache_dir", "checkpoint_every", "log_every",
     "devices", "fsdp", "compare", "resume_override", "overwrite", "keep_checkpoints",
     "stats_every", "scan_remat", "attention", "fp4_param_gather"}
)


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

    # The groups of the fields (``fp4jax.train.groups``), each checking its own values.
    @property
    def arch(self) -> ArchConfig:
        """The model: the Llama preset and overrides (``arch.llama``) or a ``--model``."""
        return ArchConfig.of(self)

    @property
    def dataset(self) -> DataConfig:
        """The corpus, tokenizer and batches."""
        return DataConfig.of(self)

    @property
    def optim(self) -> OptimConfig:
        """The schedule and AdamW (``optim.optimizer(steps)``)."""
        return OptimConfig.of(self)

    @property
    def precision(self) -> PrecisionConfig:
        """The recipe spec, BF16 layers, precision switch and rules file."""
        return PrecisionConfig.of(self)

    @property
    def rundir(self) -> RunDirConfig:
        """The run directory, checkpoints and resume."""
        return RunDirConfig.of(self)

    @property
    def research(self) -> ResearchConfig:
        """Measurements, OsciReset and OutControl."""
        return ResearchConfig.of(self)

    @property
    def parallel(self) -> ParallelConfig:
        """Devices, FSDP and the FP4 weight gather."""
        return ParallelConfig.of(self)

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
        "first_bf16": is_int(v) and v >= 0,
        "last_bf16": is_int(v) and v >= -1,
        "switch_at": v == "auto" or (is_real(v) and math.isfinite(v) and 0.0 <= v <= 1.0),
        "switch": v in SWITCH_MODES,
        "bf16_layers": isinstance(v, str) and bool(v.strip()),
        "bf16_budget": is_real(v) and math.isfinite(v) and 0.0 <= v <= 1.0,
        "grad_noise_every": is_int(v) and v >= 0,
        "switch_threshold": is_real(v) and math.isfinite(v) and v > 0,
        "switch_window": is_int(v) and v >= 0,
        "attn_recipe": isinstance(v, str) and _is_attention_recipe(v),
        "osci_reset": is_real(v) and math.isfinite(v) and 0.0 <= v <= 1.0,
        "osci_period": is_int(v) and v >= 3,
        "osci_iters": is_int(v) and v >= 1,
        "osci_threshold": is_real(v) and math.isfinite(v) and v > 0,
        "outcontrol": is_real(v) and math.isfinite(v) and 0.0 < v < 1.0,
        "outcontrol_start": is_int(v) and v >= 0,
        "outcontrol_iters": is_int(v) and v >= 1,
        "outcontrol_multiple": is_int(v) and v >= 16 and v % 16 == 0,
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


LOOP_INTS = ("steps", "eval_every", "eval_batches", "log_every")
"""The loop's integer fields (the rest of the top level: ``seed``, ``stop_at``, ``progress``,
``compare``)."""


def validate_config(cfg: TrainConfig) -> None:
    """Checks every value of ``cfg`` that can be checked without devices, data or files: the
    loop's own fields, each group's (``fp4jax.train.groups``: ``Group.validate``), then the
    rules that span groups, the recipe specs (parsed once, kept: ``parsed_spec``) and the
    runs they describe.

    Raises:
      ConfigError: the first field whose value makes no sense (a ``ValueError`` that names the
        field and its CLI flag).
    """
    for field in LOOP_INTS:  # every size a user types: a range, then the fix
        check_int(field, getattr(cfg, field))
    if not is_int(cfg.seed) or not 0 <= cfg.seed <= MAX_SEED:
        raise ConfigError("seed", f"must be an integer in 0..{MAX_SEED} (the batch order's "
                          f"numpy generator takes no negative seed), got {cfg.seed!r}")
    if cfg.stop_at is not None and (not is_int(cfg.stop_at)
                                    or not 0 <= cfg.stop_at <= INT32_MAX):
        raise ConfigError("stop_at", f"must be an integer in 0..{INT32_MAX} (or None), got "
                          f"{cfg.stop_at!r}")
    if not isinstance(cfg.progress, bool):
        raise ConfigError("progress", f"must be True or False, got {cfg.progress!r}")
    data = cfg.dataset
    for group in (data, cfg.optim, cfg.arch, cfg.precision, cfg.rundir, cfg.research,
                  cfg.parallel):
        group.validate()
    ids = data.batch_ids
    if ids * cfg.eval_batches > MAX_BATCH_IDS:
        raise ConfigError("eval_batches", f"--eval-batches {cfg.eval_batches} x {ids} token "
                          f"ids a batch = {ids * cfg.eval_batches} validation ids held in "
                          f"memory, more than {MAX_BATCH_IDS}: lower --eval-batches")
    validate_research(cfg)
    if cfg.fp4_param_gather and cfg.model is not None:
        raise ConfigError("fp4_param_gather", "works with the built-in Llama only: a --model's"
                          " layer may transform its kernel before the product (which the FP4 "
                          "gather must see unchanged); drop --fp4-param-gather")
    try:
        parsed_spec(cfg, cfg.recipe)
    except ValueError as e:
        raise ConfigError("recipe", str(e)) from None
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
    validate_precision(cfg)
    validate_runs(cfg)


def validate_research(cfg: TrainConfig) -> None:
    """The rules of OsciReset and OutControl against the rest of the run (their own values:
    ``groups.ResearchConfig.validate``).

    Raises:
      ConfigError: naming the field, why, and the fix.
    """
    osci, oc = cfg.research.osci, cfg.research.outcontrol
    if osci.on:
        if cfg.model is not None:
            raise ConfigError("osci_reset", "works with the built-in Llama only (its weights' "
                              "quantizers are known); drop --osci-reset")
        if cfg.switch_at is not None:
            raise ConfigError("osci_reset", "with --switch-at: the forward weights' quantizer "
                              "changes at the switch, which OsciReset does not follow; drop "
                              "one")
    if not oc.on:
        defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
        for field in ("outcontrol_start", "outcontrol_iters", "outcontrol_multiple"):
            if getattr(cfg, field) != defaults[field]:
                raise ConfigError(field, f"sets OutControl, which is off: pass --outcontrol "
                                  f"RATIO too (e.g. 0.1), or drop --{field.replace('_', '-')}")
        return
    split = oc.split_step
    if split >= cfg.steps:
        raise ConfigError("outcontrol_start", f"OutControl records steps "
                          f"{cfg.outcontrol_start}..{split - 1} and splits from step "
                          f"{split}, which a run of {cfg.steps} steps never reaches: "
                          "lower --outcontrol-start or --outcontrol-iters")
    if cfg.n_experts > 0:
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
    if cfg.fsdp > 1:
        raise ConfigError("outcontrol", "with --fsdp is not built (its statistic pass "
                          "runs on replicated parameters); drop --outcontrol or --fsdp")


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
LLAMA_ONLY = (*ArchConfig.LLAMA_ONLY, "attn_recipe")


def validate_model(cfg: TrainConfig) -> None:
    """The rules of a ``--model MODULE:FACTORY`` against the rest of the run (its own form and
    the Llama-only model flags: ``groups.ArchConfig.validate``): FP4 attention sets the
    built-in Llama's attention, and a rules file needs a ``--model``.

    Raises:
      ConfigError: naming the field, why, and the fix.
    """
    if cfg.model is not None:
        if cfg.attn_recipe is not None:
            raise ConfigError("attn_recipe", f"sets the built-in Llama; --model {cfg.model} "
                              "builds its own model: leave it out (pass the model's "
                              "options in --model-args)")
        for spec in [cfg.recipe] + (compare_names(cfg.compare) if cfg.compare else []):
            if "attn_recipe" in parsed_spec(cfg, spec).extra:
                raise ConfigError("recipe", f"spec {spec!r}: attn_recipe sets the built-in "
                                  f"Llama's attention; --model {cfg.model} builds its own: "
                                  "call fp4jax.attention in its attention instead")
    if cfg.rules is not None and cfg.model is None:
        raise ConfigError("rules", "applies to a model given by --model MODULE:FACTORY "
                          "(the built-in Llama takes --preset and the recipe flags)")


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
    ``n_experts``/``top_k``) overrides applied (``cfg.arch.llama``)."""
    return cfg.arch.llama(cfg.seq_len)


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
    ``decay_fraction`` of the steps to ``min_lr_ratio * lr``) or warmup + cosine
    (``cfg.optim.schedule_fn``)."""
    return cfg.optim.schedule_fn(cfg.steps)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Gradient clipping then AdamW (decoupled weight decay on matrices only):
    ``cfg.optim.optimizer``."""
    return cfg.optim.optimizer(cfg.steps)
