"""The plan of a run, resolved once from its ``TrainConfig``: the recipe spec parsed (by the
config when it validated itself, ``config.parsed_spec``), its run-level keys applied to the
config, the recipe the precision switch changes to. ``train``, a sweep and its checks take
the plan's objects instead of parsing the spec strings again. The layer rules need the model
(and, for ``--bf16-layers auto``, data): they are resolved later, in ``models.RunModels``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from fp4jax.recipes import Recipe, RunSpec
from fp4jax.train.config import TrainConfig, compare_names, parsed_spec, run_recipe, switched_recipe


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """One run of a config, resolved: what ``train`` builds the run from.

    Attributes:
      config: the config as given (its ``recipe`` is the whole spec: results and checkpoints
        record it).
      spec: the parsed spec (``fp4jax.recipes.RunSpec``: the recipe, the run-level keys).
      run_config: ``config`` with the spec's run-level keys applied (``nvfp4(last_bf16=0)``
        sets ``last_bf16``): the config the model, its precision and the switch are built
        from.
    """

    config: TrainConfig
    spec: RunSpec
    run_config: TrainConfig

    @property
    def recipe(self) -> Recipe:
        """The run's recipe (run-level keys stripped)."""
        return self.spec.recipe

    @property
    def run_keys(self) -> Mapping[str, Any]:
        """The run-level keys of the spec and their values."""
        return self.spec.extra

    @property
    def switched(self) -> Recipe:
        """The recipe after the precision switch (``switch_at``): the GEMMs of ``switch`` in
        BF16."""
        return switched_recipe(self.recipe, self.run_config.switch)


def plan_run(cfg: TrainConfig) -> RunPlan:
    """The plan of the single run ``cfg`` describes (its ``recipe``; ``compare`` is the
    sweep's, ``plan_runs``). Parses nothing: the spec is the one ``cfg`` parsed when it was
    built.

    Raises:
      ValueError: a bad spec (only for a config whose validation was bypassed).
    """
    run_config, _ = run_recipe(cfg)
    return RunPlan(config=cfg, spec=parsed_spec(cfg, cfg.recipe), run_config=run_config)


def plan_runs(cfg: TrainConfig) -> tuple[RunPlan, ...]:
    """One plan per run ``cfg`` describes: its ``recipe``, or each spec of its ``compare``
    sweep (the sub-run's config: ``recipe`` that spec, ``compare`` None)."""
    if not cfg.compare:
        return (plan_run(cfg),)
    return tuple(plan_run(cfg.replace(recipe=s, compare=None))
                 for s in compare_names(cfg.compare))
