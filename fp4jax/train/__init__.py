"""The training harness: train a byte-level Llama-style model, or any linen or NNX model a
factory returns (``--model MODULE:FACTORY``, under ``--rules``), with fp4jax recipes and
compare recipes (the ``fp4jax-train`` command, also ``python -m fp4jax.train``).
``pip install 'fp4jax[train]'`` adds the optional progress bar (tqdm), orbax checkpoints and
the comparison plot (matplotlib), each imported on first use.

Each run writes ``metrics.jsonl`` (one JSON object per log/eval record), ``result.json`` and
orbax checkpoints (``checkpoints/``) under ``--out``; ``--resume`` continues the latest
checkpoint exactly (batches and stochastic-rounding keys are pure functions of seed and step);
``--resume-override lr,clip_norm`` lets named optimizer keys change on resume (recorded in
``metrics.jsonl``), e.g. to get past a divergence. Checkpoint ``N`` holds the state before
step ``N`` (steps are 0-based), so it is known good once step ``N`` gave a finite loss; a
checkpoint whose step diverges is deleted. ``--stats-every N`` adds a ``"stats"`` record
every N steps: the per-GEMM quantization statistics of every quantized linear layer on that
step's batch (``fp4jax.diagnostics.layer_stats``, in a separate jitted function).
``--bf16-layers auto`` keeps in BF16 the layers with the largest measured quantization error
(an FP4 warm-up, or ``auto:RUN_DIR``'s stats; the set is recorded and reused on resume);
``--grad-noise-every N`` logs the gradient-to-noise ratio of FP4-all-the-way and
``--switch-at auto`` switches precision when it stays below sqrt(3) (``precision``,
``fp4jax.diagnostics.gradient_noise``, ``SwitchMonitor``).
``--compare`` trains each recipe (a name or a spec such as ``nvfp4(sr=False, rht=0)``) on the
same data and seed into ``OUT/<slug>/`` and writes ``OUT/compare.png``, ``OUT/compare.md`` and
``OUT/compare.json``; with ``--seeds 0,1,2`` every spec trains with every seed (the same batch
order per seed, one compiled step per spec) into ``OUT/<slug>/seed<s>/``, and the outputs give
mean ± std over seeds and the gap to the first spec; a repeated sweep skips finished runs and
resumes cut-off ones.

What is guaranteed:

* A run is never destroyed by a repeated command: an ``--out`` that holds a run
  (``metrics.jsonl``, ``result.json`` or a checkpoint) is refused without ``--resume``;
  ``--overwrite`` moves it aside to ``OUT.old-<time>`` (nothing is deleted).
* Every value is checked before anything runs (``validate_config``, run by ``TrainConfig``
  itself; the CLI reports the flag in argparse's one-line error).
* Each checkpoint records its config, the data fingerprint (SHA-256 of the split corpus), a
  SHA-256 of every state array and, beside it, the size and SHA-256 of each of its files.
  ``--resume`` verifies all of it and restores the newest checkpoint that restores
  completely; damaged newer ones are named (with how they are damaged) and moved to
  ``OUT/checkpoints.damaged/``. A changed config or corpus is refused, naming the keys and
  ``--resume-override`` (``data`` for the corpus). A torn final ``metrics.jsonl`` record is
  dropped (and said); a damaged record before it stops the resume, naming file and line.
* A non-finite training or validation loss, gradient norm or state (checked before every
  checkpoint, the last one too) is a divergence: exit status 1, no non-finite checkpoint kept,
  ``result.json`` and ``metrics.jsonl`` say ``diverged``.
* Checkpoints are pruned to the newest ``--keep-checkpoints`` (default 3), never deleting the
  newest one known to be good.

Modules: ``config`` (``TrainConfig``, its checks, schedules, optimizer, precision policy),
``rundir`` (the output directory: writable, holds a run, moved aside), ``precision`` (the
BF16 layer set of ``--bf16-layers``, the GEMM work run in BF16), ``checkpoint`` (orbax
checkpoints and their verification, ``metrics.jsonl`` helpers, ``RunCheckpoints``: a run's
use of them), ``models`` (the run's model and rules: the built-in Llama or ``--model``'s,
the precision switch), ``steps`` (the jitted init/train/eval/measurement functions),
``evaluation`` (validation loss, per-layer statistics, gradient noise), ``runlog``
(``metrics.jsonl``, progress, throughput), ``loop`` (``train``: the parts in order),
``comparison`` (``compare``, the table and the plot), ``cli`` (``main``), ``data`` (byte-level
corpora, ``ByteDataset``) and ``tokens`` (tokenizers and token files, ``fp4jax-tokenize``). Every
public name is re-exported here: ``from fp4jax import train as T; T.train(T.TrainConfig(...))``.
"""

from fp4jax.train.checkpoint import CheckpointDamaged, Checkpointer, config_diff, state_checksum
from fp4jax.train.cli import build_parser, enable_compile_cache, main, set_threefry_lowering
from fp4jax.train.comparison import (
    SweepFailed,
    compare,
    comparison_table,
    parse_seeds,
    plot_losses,
    plot_sweep,
    slug,
    spec_slugs,
    summarize,
    summary_table,
)
from fp4jax.train.config import (
    OVERRIDABLE_KEYS,
    RESUMABLE_KEYS,
    RUN_KEYS,
    SCHEDULES,
    SWITCH_MODES,
    ConfigError,
    TrainConfig,
    last_bf16_blocks,
    make_optimizer,
    make_policy,
    make_schedule,
    model_config,
    run_recipe,
    run_spec,
    split_run_spec,
    split_specs,
    switched_recipe,
    validate_config,
)
from fp4jax.train.loop import (
    TrainingDiverged,
    loss_fn,
    make_eval_step,
    make_grad_noise_step,
    make_init_state,
    make_mesh,
    make_stats_step,
    make_train_step,
    train,
)
from fp4jax.train.plan import RunPlan, plan_run, plan_runs
from fp4jax.train.rundir import RunExists, check_out, run_contents

__all__ = [
    "OVERRIDABLE_KEYS",
    "RESUMABLE_KEYS",
    "SCHEDULES",
    "SWITCH_MODES",
    "CheckpointDamaged",
    "Checkpointer",
    "ConfigError",
    "RunExists",
    "TrainConfig",
    "TrainingDiverged",
    "build_parser",
    "check_out",
    "compare",
    "parse_seeds",
    "plot_sweep",
    "slug",
    "spec_slugs",
    "split_specs",
    "split_run_spec",
    "run_recipe",
    "run_spec",
    "RunPlan",
    "plan_run",
    "plan_runs",
    "RUN_KEYS",
    "SweepFailed",
    "summarize",
    "summary_table",
    "comparison_table",
    "config_diff",
    "enable_compile_cache",
    "set_threefry_lowering",
    "last_bf16_blocks",
    "loss_fn",
    "main",
    "make_eval_step",
    "make_grad_noise_step",
    "make_init_state",
    "make_mesh",
    "make_optimizer",
    "make_policy",
    "make_schedule",
    "make_stats_step",
    "make_train_step",
    "model_config",
    "plot_losses",
    "run_contents",
    "state_checksum",
    "switched_recipe",
    "train",
    "validate_config",
]
