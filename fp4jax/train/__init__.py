"""The training harness: train a byte-level Llama-style model with fp4jax recipes and compare
recipes (the ``fp4jax-train`` command, also ``python -m fp4jax.train``).
``pip install 'fp4jax[train]'`` adds the optional progress bar (tqdm), orbax checkpoints and
the comparison plot (matplotlib), each imported on first use.

Each run writes ``metrics.jsonl`` (one JSON object per log/eval record), ``result.json`` and
orbax checkpoints (``checkpoints/``) under ``--out``; ``--resume`` continues the latest
checkpoint exactly (batches and stochastic-rounding keys are pure functions of seed and step);
``--resume-override lr,clip_norm`` lets named optimizer keys change on resume (recorded in
``metrics.jsonl``), e.g. to get past a divergence. Checkpoint ``N`` holds the state before
step ``N`` (steps are 0-based), so it is known good once step ``N`` gave a finite loss; a
checkpoint whose step diverges is deleted.
``--compare`` trains each recipe on the same data and seed into ``OUT/<recipe>/`` and writes
``OUT/compare.png``, ``OUT/compare.md`` and ``OUT/compare.json``.

Modules: ``config`` (``TrainConfig``, schedules, optimizer, precision policy), ``checkpoint``
(orbax checkpoints, ``metrics.jsonl`` helpers), ``loop`` (train/eval steps, ``train``),
``comparison`` (``compare``, the table and the plot) and ``cli`` (``main``). Every public name
is re-exported here: ``from fp4jax import train as T; T.train(T.TrainConfig(...))``.
"""

from fp4jax.train.checkpoint import Checkpointer, config_diff
from fp4jax.train.cli import build_parser, enable_compile_cache, main
from fp4jax.train.comparison import compare, comparison_table, plot_losses
from fp4jax.train.config import (
    OVERRIDABLE_KEYS,
    RESUMABLE_KEYS,
    SCHEDULES,
    SWITCH_MODES,
    TrainConfig,
    last_bf16_blocks,
    make_optimizer,
    make_policy,
    make_schedule,
    model_config,
    switched_recipe,
)
from fp4jax.train.loop import (
    TrainingDiverged,
    loss_fn,
    make_eval_step,
    make_init_state,
    make_mesh,
    make_train_step,
    train,
)

__all__ = [
    "OVERRIDABLE_KEYS",
    "RESUMABLE_KEYS",
    "SCHEDULES",
    "SWITCH_MODES",
    "Checkpointer",
    "TrainConfig",
    "TrainingDiverged",
    "build_parser",
    "compare",
    "comparison_table",
    "config_diff",
    "enable_compile_cache",
    "last_bf16_blocks",
    "loss_fn",
    "main",
    "make_eval_step",
    "make_init_state",
    "make_mesh",
    "make_optimizer",
    "make_policy",
    "make_schedule",
    "make_train_step",
    "model_config",
    "plot_losses",
    "switched_recipe",
    "train",
]
