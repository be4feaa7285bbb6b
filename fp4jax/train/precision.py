"""Automatic precision choices of a training run: which linear layers stay in
BF16 (``--bf16-layers``) and how much of the run's GEMM work ran in high precision.

* ``resolve_bf16_layers``: the BF16 layer set of a run, from ``--bf16-layers``: names as
  given; ``auto``: a short FP4 warm-up on the run's own data and seed (a sub-run into
  ``OUT/bf16_warmup/`` with ``--stats-every``), its per-layer statistics averaged
  (``fp4jax.diagnostics.mean_layer_stats``) and ranked by
  ``fp4jax.diagnostics.recommend_high_precision_layers`` (wgrad error first: NVIDIA NVFP4
  paper, Appendix E.2); ``auto:PATH``: the same from the ``"stats"`` records of an earlier
  run (a run directory or its ``metrics.jsonl``). The chosen set is written to
  ``OUT/bf16_layers.json`` (and into every checkpoint), so a resumed run uses the same set
  without measuring again.
* ``gemm_work``/``bf16_gemm_fraction``: the fraction of the linear layers' GEMM FLOPs that
  ran in high precision over a run, given its policy and its precision switch.

The automatic precision switch itself (``--switch-at auto``) is a host-side decision on the
gradient-to-noise ratio (``fp4jax.diagnostics.gradient_noise``, ``SwitchMonitor``), made in
``fp4jax.train.loop.train``. Nothing here imports the loop (``train`` is passed in).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fp4jax import diagnostics
from fp4jax.models.llama import (
    LlamaConfig,
    block_layer_names,
    layer_order,
    policy_layer_name,
    policy_rules,
)
from fp4jax.nn.policy import PrecisionPolicy
from fp4jax.recipes import Recipe, recipe_quantizes
from fp4jax.rules import Rule, as_rules, rule_recipe
from fp4jax.train.config import (
    AUTO,
    TrainConfig,
    explicit_bf16_layers,
    last_bf16_blocks,
    with_recipe,
)
from fp4jax.train.rundir import claim_out

RECORD = "bf16_layers.json"  # OUT/RECORD: the BF16 layer set a run chose, and why
WARMUP_DIR = "bf16_warmup"  # OUT/WARMUP_DIR: the FP4 warm-up sub-run of --bf16-layers auto


def _note(msg: str) -> None:
    print(f"fp4jax-train: {msg}", file=sys.stderr, flush=True)


def choose_from_records(records: list[dict], budget: float, mc: LlamaConfig,
                        source: str) -> dict[str, Any]:
    """The BF16 layer set that the ``"stats"`` records ``records`` recommend at ``budget``
    (``mean_layer_stats`` then ``recommend_high_precision_layers``), as the record
    ``resolve_bf16_layers`` writes.

    Raises:
      ValueError: no records, or a recommended layer that this model does not have (stats
        of another model).
    """
    if not records:
        raise ValueError(f"--bf16-layers: {source} holds no per-layer stats record (train "
                         "it with --stats-every N)")
    mean = diagnostics.mean_layer_stats(records)
    names = sorted(diagnostics.recommend_high_precision_layers(mean, budget), key=layer_order)
    for n in names:
        try:
            policy_layer_name(n, mc)
        except ValueError as e:
            raise ValueError(f"--bf16-layers: {source} recommends {n!r}: {e} (stats of "
                             "another model?)") from None
    used = [r["step"] for r in records if r["step"] > 0] or [r["step"] for r in records]
    return {"layers": names, "source": source, "budget": budget,
            "measured_layers": len(mean), "stats_steps": used,
            "wgrad_rel_error": {n: mean[n]["wgrad"]["rel_error"]
                                for n in sorted(mean, key=layer_order)}}


def choose_rules_from_records(records: list[dict], budget: float, layers: list[str],
                              source: str) -> dict[str, Any]:
    """``choose_from_records`` for a model given by ``--model`` (its linear layers'
    module paths ``layers``): the recommendation as precision rules
    (``recommend_high_precision_layers(..., rules=True)``: one high-precision rule per module
    path, a scanned stack's blocks sharing theirs), the record's ``"layers"`` the paths of
    ``layers`` they match and ``"rules"`` their patterns.

    Raises:
      ValueError: no records, or a recommended rule that matches none of ``layers`` (stats
        of another model).
    """
    if not records:
        raise ValueError(f"--bf16-layers: {source} holds no per-layer stats record (train "
                         "it with --stats-every N)")
    mean = diagnostics.mean_layer_stats(records)
    rules = diagnostics.recommend_high_precision_layers(mean, budget, rules=True)
    names: list[str] = []
    for r in rules:
        hit = [n for n in layers if r.matches(n)]
        if not hit:
            raise ValueError(f"--bf16-layers: {source} recommends {r.pattern!r}, which is not a "
                             f"linear layer of this model (stats of another model?); its "
                             f"layers: {', '.join(layers)}")
        names += [n for n in hit if n not in names]
    used = [r["step"] for r in records if r["step"] > 0] or [r["step"] for r in records]
    return {"layers": [n for n in layers if n in names], "source": source, "budget": budget,
            "rules": [r.pattern for r in rules], "measured_layers": len(mean),
            "stats_steps": used,
            "wgrad_rel_error": {n: mean[n]["wgrad"]["rel_error"] for n in sorted(mean)}}


def read_stats_source(path: str | os.PathLike, flag: str) -> list[dict]:
    """The ``"stats"`` records of ``path`` (a run directory or its ``metrics.jsonl``:
    ``diagnostics.read_stats``), each checked to be ``{"step": int, "layers": {layer: {gemm:
    {stat: number}}}}`` with at least one layer.

    Raises:
      ValueError: one line naming ``flag``, the file and the bad record (its line of
        ``metrics.jsonl`` and step): an unreadable or binary file, a record without layers,
        a statistic that is not a number.
    """
    p = Path(path)
    file = p / "metrics.jsonl" if p.is_dir() else p
    try:
        records = diagnostics.read_stats(path)
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag}: {file} is not a metrics.jsonl (not UTF-8 text: byte "
                         f"{e.start}); give a run directory or its metrics.jsonl") from None
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {file}: {e.strerror or e}") from None
    for i, r in enumerate(records, 1):
        where = f"{flag}: {file}: stats record {i} (step {r.get('step')!r})"
        if isinstance(r.get("step"), bool) or not isinstance(r.get("step"), int):
            raise ValueError(f"{where}: 'step' must be an integer")
        layers = r.get("layers")
        if not isinstance(layers, dict) or not layers:
            raise ValueError(f"{where}: 'layers' must map layer names to their GEMM "
                             f"statistics, got {layers!r:.60}")
        for name, layer in layers.items():
            if not isinstance(layer, dict):
                raise ValueError(f"{where}: layer {name!r}: expected {{gemm: {{stat: "
                                 f"number}}}}, got {layer!r:.60}")
            for gemm, row in layer.items():
                if not isinstance(row, dict):
                    raise ValueError(f"{where}: {name}/{gemm}: expected {{stat: number}}, "
                                     f"got {row!r:.60}")
                for k, v in row.items():
                    if isinstance(v, bool) or not isinstance(v, (int, float)):
                        raise ValueError(f"{where}: {name}/{gemm}/{k} = {v!r:.40} is not "
                                         "a number")
    return records


def read_record(out: str | os.PathLike) -> dict | None:
    """The BF16 layer record of the run in ``out``: ``OUT/bf16_layers.json``, else the one in
    its newest checkpoint whose metadata reads (None when neither exists)."""
    out = Path(out)
    try:
        rec = json.loads((out / RECORD).read_text())
        if isinstance(rec, dict) and isinstance(rec.get("layers"), list):
            return rec
    except (OSError, ValueError):
        pass
    ckdir = out / "checkpoints"
    if not ckdir.is_dir():
        return None
    try:
        from fp4jax.train.checkpoint import Checkpointer

        ck = Checkpointer(ckdir)
    except ImportError:
        return None
    try:
        for step in reversed(ck.all_steps()):
            try:
                rec = ck.meta(step).get("bf16_layers")
            except Exception:  # noqa: BLE001 - a damaged checkpoint: try an older one
                continue
            if isinstance(rec, dict):
                return rec
        return None
    finally:
        ck.close()


def _write_record(out: Path, rec: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (RECORD + ".tmp")
    tmp.write_text(json.dumps(rec, indent=1))
    os.replace(tmp, out / RECORD)


def warmup_config(cfg: TrainConfig, rcfg: TrainConfig, recipe: Recipe,
                  mc: LlamaConfig | int) -> TrainConfig:
    """The config of the FP4 warm-up of ``--bf16-layers auto``: the run's recipe, data, seed,
    schedule and BF16 blocks, no BF16 layers and no switch, stopped after ``bf16_warmup``
    steps, measuring every layer ``max(1, bf16_warmup // 4)`` steps, into
    ``OUT/bf16_warmup/`` (a run there is moved aside). ``mc``: the Llama's config, or the
    number of blocks of a ``--model`` model (0: not recognized)."""
    w = cfg.bf16_warmup
    n_blocks = mc if isinstance(mc, int) else mc.n_layers
    last = (last_bf16_blocks(rcfg, n_blocks) if n_blocks or isinstance(mc, LlamaConfig)
            else max(rcfg.last_bf16, 0))
    return with_recipe(
        rcfg, recipe, bf16_layers=None,
        last_bf16=last, switch_at=None, grad_noise_every=0,
        stats_every=max(1, w // 4), stop_at=w, eval_every=0, checkpoint_every=0,
        keep_checkpoints=1, out=str(Path(cfg.out) / WARMUP_DIR), resume=False,
        overwrite=True, compare=None, resume_override=None)


def resolve_bf16_layers(cfg: TrainConfig, rcfg: TrainConfig, recipe: Recipe,
                        mc: LlamaConfig | None, train: Callable[..., dict], dataset: Any = None,
                        *, layers: list[str] | None = None, n_blocks: int = 0) -> dict | None:
    """The BF16 layer set of the run ``cfg`` (``rcfg``: with its spec's run-level keys
    applied; ``recipe``: its parsed recipe), as a record ``{"layers": [names], "source":
    ..., ...}``, or None without ``--bf16-layers``. The built-in Llama: ``mc`` its config;
    a ``--model`` model: ``mc`` None, ``layers`` its linear layers' module paths and
    ``n_blocks`` its blocks (0: not recognized); ``auto`` then recommends precision rules
    (``choose_rules_from_records``), the record's ``"layers"`` the paths they match.

    Explicit names are taken as given. ``auto``/``auto:PATH`` (see the module docstring) is
    measured once: a fresh run measures and writes ``OUT/bf16_layers.json``; a resumed run
    reads the set its start chose (the file, else its checkpoints). ``train`` is
    ``fp4jax.train.loop.train`` (it runs the warm-up), ``dataset`` the run's data.

    Raises:
      ValueError: the stats file does not exist or holds no stats; a resumed run whose
        record is lost; names that the model does not have.
    """
    value = rcfg.bf16_layers
    if value is None:
        return None
    out = Path(cfg.out)
    names = explicit_bf16_layers(value)
    if names is not None:
        if mc is None:  # a --model's paths: checked by its rules (default_rules)
            return {"layers": list(dict.fromkeys(names)), "source": "--bf16-layers"}
        for n in names:
            policy_layer_name(n, mc)  # checked by TrainConfig already; raises if not
        return {"layers": sorted(dict.fromkeys(names), key=layer_order),
                "source": "--bf16-layers"}
    if cfg.resume:
        rec = read_record(out)
        if rec is None:
            raise ValueError(
                f"--resume with --bf16-layers {value}: neither {out / RECORD} nor a "
                f"checkpoint in {out / 'checkpoints'} records the BF16 layers this run "
                "chose when it started; start afresh with --overwrite (or pass the layers "
                "by name: --bf16-layers block_I/NAME,...)")
        return rec
    if value == AUTO:
        claim_out(cfg)  # --overwrite moves an earlier run aside before the warm-up writes
        wcfg = warmup_config(cfg, rcfg, recipe, n_blocks if mc is None else mc)
        _note(f"--bf16-layers auto: {wcfg.stop_at} FP4 warm-up steps (stats every "
              f"{wcfg.stats_every}) into {wcfg.out}")
        train(wcfg, dataset)
        records = diagnostics.read_stats(wcfg.out)
        source = (f"warm-up: {wcfg.stop_at} steps of {wcfg.recipe} with the run's data and "
                  f"seed ({wcfg.out})")
        shutil.rmtree(Path(wcfg.out) / "checkpoints", ignore_errors=True)  # not needed
    else:
        path = Path(value[len(AUTO) + 1:]).expanduser()
        if not path.exists():
            raise ValueError(f"--bf16-layers {value}: {path} does not exist (give a run "
                             "directory or its metrics.jsonl, trained with --stats-every N)")
        records = read_stats_source(path, f"--bf16-layers {value}")
        source = str(path)
        claim_out(cfg)  # after reading: PATH may be inside the run moved aside
    rec = (choose_from_records(records, rcfg.bf16_budget, mc, source) if mc is not None
           else choose_rules_from_records(records, rcfg.bf16_budget, layers or [], source))
    _write_record(out, rec)
    _note(f"--bf16-layers {value}: {len(rec['layers'])} of {rec['measured_layers']} "
          f"measured layers in BF16 (budget {rcfg.bf16_budget}): "
          f"{', '.join(rec['layers']) or 'none'}; recorded in {out / RECORD}")
    return rec


def linear_layer_shapes(mc: LlamaConfig) -> dict[str, tuple[int, int]]:
    """``{layer name: (K, N)}`` of every linear layer of the model: the blocks' (named as
    ``block_layer_names``) and the LM head (``"lm_head"``)."""
    d, hd = mc.d_model, mc.head_dim
    shape = {"q": (d, mc.n_heads * hd), "k": (d, mc.n_kv_heads * hd),
             "v": (d, mc.n_kv_heads * hd), "o": (mc.n_heads * hd, d), "gate": (d, mc.d_ff),
             "up": (d, mc.d_ff), "down": (mc.d_ff, d)}
    out = {n: shape[n.split("/")[1]] for n in block_layer_names(mc)}
    out["lm_head"] = (d, mc.vocab_size)
    return out


def llama_layer_recipes(mc: LlamaConfig, precision: PrecisionPolicy | Sequence[Rule]
                        ) -> dict[str, Recipe | None]:
    """``{layer name: recipe or None}`` of every linear layer of a Llama of ``mc``
    (``linear_layer_shapes``: the blocks' and ``"lm_head"``) under ``precision``:
    precision rules by block-level path (``fp4jax.models.llama.policy_rules``: what
    ``quantized_llama`` runs), or a ``PrecisionPolicy`` (its ``policy_rules``); first
    match (``fp4jax.rules.rule_recipe``), None for high precision."""
    rules = (policy_rules(mc, precision) if isinstance(precision, PrecisionPolicy)
             else as_rules(precision, "precision"))
    return {name: rule_recipe(rules, name) for name in linear_layer_shapes(mc)}


def gemm_work(mc: LlamaConfig, policy: PrecisionPolicy | Sequence[Rule]) -> dict[str, float]:
    """The linear layers' GEMM work of one training step under ``policy`` (a
    ``PrecisionPolicy`` or the run's rules, ``llama_layer_recipes``), in units of ``2 *
    tokens`` FLOPs (each of a layer's fprop, dgrad and wgrad GEMMs is ``2 * tokens * K * N``
    FLOPs): ``{"total", "high_precision"}``, a GEMM counting as high precision when neither
    operand is quantized. The attention's score matmuls, which no recipe quantizes, are
    not linear layers and not counted."""
    total = hp = 0.0
    recipes = llama_layer_recipes(mc, policy)
    for name, (k, n) in linear_layer_shapes(mc).items():
        r = recipes[name]
        for g in ("fprop", "dgrad", "wgrad"):
            total += k * n
            hp += k * n * (r is None or not r.gemms[g].quantized)
    return {"total": total, "high_precision": hp}


def fp4_layer_names(mc: LlamaConfig, policy: PrecisionPolicy | Sequence[Rule]) -> list[str]:
    """The block linear layers (``block_layer_names``) whose recipe under ``policy`` (a
    ``PrecisionPolicy`` or the run's rules) quantizes (``recipe_quantizes``)."""
    recipes = llama_layer_recipes(mc, policy)
    return [name for name in block_layer_names(mc) if recipe_quantizes(recipes[name])]


def bf16_gemm_fraction(mc: LlamaConfig, policy: PrecisionPolicy | Sequence[Rule],
                       switched: PrecisionPolicy | Sequence[Rule], steps: int,
                       switch_step: int | None) -> float:
    """The fraction of a run's linear-layer GEMM FLOPs (``gemm_work``) that ran in high
    precision: steps ``[0, switch_step)`` under ``policy``, ``[switch_step, steps)`` under
    ``switched`` (each a ``PrecisionPolicy`` or rules; ``switch_step`` None or >=
    ``steps``: no switch)."""
    a, b = gemm_work(mc, policy), gemm_work(mc, switched)
    s = steps if switch_step is None else min(max(switch_step, 0), steps)
    total = s * a["total"] + (steps - s) * b["total"]
    return (s * a["high_precision"] + (steps - s) * b["high_precision"]) / total if total else 0.0


def add_flags(add: Callable[..., Any], d: TrainConfig | type[TrainConfig]) -> None:
    """Adds the automatic-precision flags to ``fp4jax-train``'s parser (``add`` is its
    ``add_argument``, ``d`` the default config, or ``TrainConfig`` whose class attributes are
    the defaults)."""
    add("--switch-threshold", type=float, default=d.switch_threshold,
        help="--switch-at auto: switch once the gradient-to-noise ratio ||grad|| / (sigma_q "
             "sqrt(d)) stays below this (default sqrt(3), FP4-all-the-way Section 4)")
    add("--switch-window", type=int, default=d.switch_window,
        help="--switch-at auto: steps the ratio must stay below the threshold (every "
             "measurement over them below it) before the switch")
    add("--grad-noise-every", type=int, default=d.grad_noise_every,
        help="every N steps (0: never), measure the gradient-to-noise ratio, globally and "
             "per layer (fp4jax.diagnostics.gradient_noise: the step's gradient against the "
             "same step with the backward GEMMs in high precision), written to "
             "metrics.jsonl as a 'grad_noise' record; needed by --switch-at auto")
    add("--bf16-layers", default=d.bf16_layers,
        help="linear layers kept in BF16 (then --last-bf16 defaults to 0): comma-separated "
             "names (block_3/q,block_5/down); 'auto': chosen by their measured quantization "
             "error (wgrad first) after --bf16-warmup FP4 steps on the same data; "
             "'auto:PATH': chosen from the stats records of an earlier run (its directory or "
             "metrics.jsonl). The set is recorded in OUT/bf16_layers.json and reused on "
             "--resume")
    add("--bf16-budget", type=float, default=d.bf16_budget,
        help="--bf16-layers auto: the fraction of the measured layers kept in BF16 (floor)")
    add("--bf16-warmup", type=int, default=d.bf16_warmup,
        help="--bf16-layers auto: steps of the FP4 warm-up (its own sub-run in "
             "OUT/bf16_warmup/, stats every max(1, N // 4) steps)")
