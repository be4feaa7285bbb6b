"""One training run, ``train``, read top to bottom in its parts:

1. data: ``load_data`` (the corpus, its split and batches);
2. model and rules: ``fp4jax.train.models`` (``RunModels``: the model before and after its
   precision switch; ``PrecisionSwitch``);
3. state and sharding: ``run_mesh`` (the device mesh, the checks it implies),
   ``compiled_steps`` (the state's layout, the jitted init/train/eval functions, shared by
   runs that differ only in their seed, ``_step_fns``);
4. step: ``fp4jax.train.steps`` (``loss_fn``, ``make_train_step``, ...);
5. evaluation: ``fp4jax.train.evaluation`` (validation loss, ``--stats-every``,
   ``--grad-noise-every``);
6. checkpoints: ``fp4jax.train.checkpoint.RunCheckpoints`` (open, resume, save, prune,
   what a divergence keeps);
7. logging: ``fp4jax.train.runlog`` (``metrics.jsonl``, progress, throughput,
   ``TrainingDiverged``) and ``run_result`` (``result.json``).

Nothing on the host waits for a step while it runs: batches are built and put on the
devices ahead of their step (``BatchPrefetcher``, ``PREFETCH`` steps ahead), and a step's
metrics are read ``IN_FLIGHT`` steps after its dispatch (``RunLog.flush``); evaluations,
measurements and checkpoints read every step before them first, so what a run records
(losses, divergence, checkpoints) is that of a loop that waits for every step.

``TrainingDiverged`` is raised when a training or validation loss, the gradient norm or the
state becomes non-finite. The step builders are re-exported here (``make_train_step``, ...):
``train`` looks them up in this module when it compiles.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

import fp4jax.recipes
from fp4jax.quantized_dot import token_row_multiple
from fp4jax.recipes import Recipe
from fp4jax.train import channel_split, parallel, processes
from fp4jax.train.checkpoint import (
    RunCheckpoints,
    history_from_metrics,
    read_metrics,
    truncate_metrics,
)
from fp4jax.train.config import (
    TrainConfig,
    make_optimizer,
    make_schedule,
    model_config,
    override_keys,
)
from fp4jax.train.data import ByteDataset
from fp4jax.train.evaluation import Evaluation
from fp4jax.train.models import (
    PrecisionSwitch,
    RunModels,
    foreign_models,
    llama_models,
    quantized_backward,
)
from fp4jax.train.oscillation import OsciReset, tracked_weights
from fp4jax.train.parallel import make_mesh
from fp4jax.train.plan import plan_run
from fp4jax.train.rundir import check_out, check_resumable, claim_out, releases_locks
from fp4jax.train.runlog import Progress, RunLog, TrainingDiverged, empty_history
from fp4jax.train.steps import (
    LAYER_KEY_INDEX,
    REPLICATED,
    TRACE_COUNTS,
    loss_fn,
    make_eval_step,
    make_grad_noise_step,
    make_init_state,
    make_outcontrol_record,
    make_stats_step,
    make_train_step,
    noise_gradients,
)
from fp4jax.train.tokens import load_dataset, model_vocab_size

__all__ = ["LAYER_KEY_INDEX", "TRACE_COUNTS", "TrainingDiverged", "check_token_rows",
           "compiled_steps",
           "load_data", "loss_fn", "make_eval_step", "make_grad_noise_step",
           "make_init_state", "make_mesh", "make_stats_step", "make_train_step",
           "noise_gradients", "run_mesh", "run_result", "train"]

_REPLICATED = REPLICATED  # the state's layout without --fsdp (the name tests use)


# Config keys that leave the compiled init/train/eval functions unchanged (the seed enters as
# a key argument); runs whose other keys agree share them (``_step_fns``).
_NOT_COMPILED = frozenset({"seed", "out", "resume", "stop_at", "progress", "cache_dir",
                           "checkpoint_every", "log_every", "compare", "resume_override",
                           "overwrite", "keep_checkpoints", "data", "tokenizer", "val_fraction",
                           "eval_every", "eval_batches", "switch_at", "stats_every",
                           "switch_threshold", "switch_window", "grad_noise_every",
                           "bf16_budget", "bf16_warmup", "outcontrol_start",
                           "outcontrol_iters"})
_STEP_CACHE: dict[tuple, dict] = {}
_STEP_CACHE_SIZE = 4


def _step_fns(cfg: TrainConfig, recipe: Recipe, mesh: Mesh,
              build: Callable[[], dict], extra: tuple = ()) -> tuple[dict, bool]:
    """The jitted functions of ``cfg`` (``build()`` on a miss), shared by runs that differ only
    in keys of ``_NOT_COMPILED`` (e.g. the seeds of a sweep) or in how their recipe spec is
    written; ``cfg`` has the spec's run-level keys applied and ``recipe`` is its parsed
    recipe (``run_recipe``); ``extra``: more of the key (digests of the files a ``--model``
    run reads). The newest few are kept. Returns ``(functions, reused)``."""
    # the builders as looked up now: a monkeypatched one (tests) gets its own entry
    builders = (make_init_state, make_train_step, make_eval_step, make_outcontrol_record)
    fields = dataclasses.asdict(cfg)  # the recipe canonical: nvfp4(switch_at=0.8) ~ nvfp4
    fields["recipe"] = fp4jax.recipes.spec(recipe)
    key = (tuple(sorted((k, repr(v)) for k, v in fields.items() if k not in _NOT_COMPILED)),
           tuple(d.id for d in mesh.devices.flat),
           tuple(id(f) for f in builders), extra)
    reused = key in _STEP_CACHE
    if reused:
        _STEP_CACHE[key] = _STEP_CACHE.pop(key)  # most recently used last
    else:
        # JAX's trace caches (bounded LRUs) decide which of a program's identical inner
        # jitted calls (jnp.where, clip, round inside every quantizer) lower to one shared
        # private function: a program traced after others lowers to different text (the
        # micro NVFP4 stats step: 758 private functions instead of 683) and so to another
        # persistent compilation-cache key. Cleared here, a run's programs lower as in a
        # fresh process, so a resumed sweep or a second run of a config in one process
        # finds them in the cache (compiled executables of other functions are dropped:
        # they reload from that cache or recompile).
        jax.clear_caches()
        # the entry keeps the builders alive: their ids in the key are not reused meanwhile
        _STEP_CACHE[key] = {**build(), "builders": builders}
        while len(_STEP_CACHE) > _STEP_CACHE_SIZE:
            _STEP_CACHE.pop(next(iter(_STEP_CACHE)))
    return _STEP_CACHE[key], reused


def run_mesh(cfg: TrainConfig, rcfg: TrainConfig) -> Mesh:
    """The run's ``(data, fsdp)`` mesh (``parallel.make_mesh``), after the checks it implies.

    Raises:
      ValueError: ``--attention cudnn`` off GPUs, a batch not divisible by the devices, or
        a flag that keeps host state in ``--out`` in a multi-process run.
    """
    mesh = make_mesh(cfg.devices, cfg.fsdp)
    n_dev = mesh.devices.size
    if cfg.attention == "cudnn" and mesh.devices.flat[0].platform != "gpu":
        raise ValueError(f"--attention cudnn needs NVIDIA GPUs (this run has "
                         f"{mesh.devices.flat[0].platform} devices): use --attention xla")
    if cfg.batch_size % n_dev:
        raise ValueError(f"--batch-size {cfg.batch_size} is not divisible by {n_dev} devices")
    if processes.count() > 1:
        # these keep host-side state in --out (records, warm-up sub-runs) that only process 0
        # would see: not wired for several processes yet
        used = [flag for flag, on in (("--bf16-layers", rcfg.bf16_layers is not None),
                                      ("--switch-at auto", rcfg.switch_at == "auto"),
                                      ("--grad-noise-every", bool(rcfg.grad_noise_every))) if on]
        if used:
            raise ValueError(f"{', '.join(used)}: not supported in a multi-process run yet; "
                             "run them in one process (any number of its devices)")
    return mesh


def load_data(cfg: TrainConfig, dataset: Any = None) -> ByteDataset:
    """The run's dataset: ``dataset`` if given (a sweep loads it once), else ``cfg.data``
    with ``cfg.tokenizer`` (``fp4jax.train.tokens.load_dataset``: a text corpus split into
    training and validation tokens, or token files).

    Raises:
      ValueError: its ``seq_len`` is not the config's; a missing or too small corpus.
    """
    ds = dataset or load_dataset(cfg.data, cfg.seq_len, cfg.val_fraction, cfg.cache_dir,
                                 cfg.tokenizer)
    if ds.seq_len != cfg.seq_len:
        raise ValueError(f"dataset seq_len {ds.seq_len} != config seq_len {cfg.seq_len}")
    return ds


def build_models(cfg: TrainConfig, rcfg: TrainConfig, recipe: Recipe, ds: Any) -> RunModels:
    """The run's model and its precision: the built-in Llama (``llama_models``: the preset,
    the precision policy, ``--bf16-layers`` resolved), or ``--model``'s
    (``foreign_models``: the factory's model under ``--rules`` and the default rules), its
    vocabulary ``--vocab-size`` or the dataset's (``fp4jax.train.tokens.model_vocab_size``: 256
    for bytes), also set in ``rcfg`` (in the compiled steps' cache key)."""
    vocab = model_vocab_size(ds, cfg.vocab_size)
    rcfg = rcfg.replace(vocab_size=vocab)
    if cfg.model is not None:
        return foreign_models(cfg, rcfg, recipe, vocab, train, ds)
    return llama_models(cfg, rcfg, recipe, model_config(cfg).replace(vocab_size=vocab),
                        train, ds)


def check_token_rows(cfg: TrainConfig, rm: RunModels, mesh: Mesh) -> None:
    """Checks, before anything is written, what the first sharded step would refuse: each
    device's token rows (``batch_size / devices * seq_len``) a multiple of
    ``fp4jax.quantized_dot.token_row_multiple`` of every recipe the run uses (before and
    after its precision switch, and every ``--rules`` recipe of a ``--model``). One device:
    nothing to check.

    Raises:
      ValueError: naming the recipe, the rows per device and a batch size that works.
    """
    n_dev = mesh.devices.size
    if n_dev == 1:
        return
    used = {r.name: r for r in rm.recipes.values() if r is not None}
    for r in (rm.layer_recipes or {}).values():
        if r is not None:
            used.setdefault(r.name, r)
    rows = cfg.batch_size // n_dev * cfg.seq_len
    for r in used.values():
        mult = token_row_multiple(r)
        if rows % mult:
            per_dev = mult // math.gcd(mult, cfg.seq_len)  # sequences a device needs, at least
            raise ValueError(
                f"--batch-size {cfg.batch_size} over {n_dev} devices with --seq-len "
                f"{cfg.seq_len} gives {rows} token rows a device; recipe {r.name!r} needs a "
                f"multiple of {mult} (its quantization blocks and RHT along the tokens must "
                f"not straddle devices): use a --batch-size that is a multiple of "
                f"{n_dev * per_dev}, or a --seq-len that is a multiple of {mult}")


def osci_reset_plan(rm: RunModels, params: Any) -> tuple[OsciReset, list]:
    """``--osci-reset``: the run's ``(OsciReset, tracked weights)``
    (``fp4jax.train.oscillation``) from its config and its model's linear layers
    (``params``: the parameters' shapes, ``ShapeDtypeStruct``s).

    Raises:
      ValueError: a model whose layers are not known (a ``--model``), a precision switch
        (``--switch-at``: the weights' quantizer would change mid-run), or no weight the
        recipe quantizes in its forward GEMM."""
    rcfg = rm.rcfg
    if rm.weight_layers is None:
        raise ValueError("--osci-reset works with the built-in Llama only (its weights' "
                         "quantizers are known)")
    if rcfg.switch_at is not None:
        raise ValueError("--osci-reset with --switch-at: the forward weights' quantizer "
                         "changes at the switch, which OsciReset does not follow; drop one")
    cfg = OsciReset(start=math.ceil(rcfg.osci_reset * rcfg.steps), period=rcfg.osci_period,
                    iters=rcfg.osci_iters, threshold=float(rcfg.osci_threshold))
    tracked, skipped = tracked_weights(params, rm.weight_layers(False),
                                       model_config(rcfg).dtype)
    if not tracked:
        raise ValueError("--osci-reset: no weight of this run is quantized in its forward "
                         "GEMM (" + "; ".join(f"{k}: {v}" for k, v in skipped.items())
                         + "); drop the flag")
    return cfg, tracked


def fp4_gather_plans(rm: RunModels, params: Any, specs: Any, mesh: Mesh
                     ) -> tuple[dict[bool, Any], dict[bool, dict[str, str | None]]]:
    """``--fp4-param-gather``: per model of the run (before and after its precision switch),
    ``parallel.fp4_gather_plan`` of its parameters (``params``: their shapes, ``specs``:
    their layout) from its linear layers (``rm.weight_layers``) and compute dtype. Returns
    ``(plans, notes)``, each by ``switched``.

    Raises:
      ValueError: a model whose layers are not known (a ``--model``), or no weight of the
        run gathered in FP4 (naming why not for each)."""
    if rm.weight_layers is None:
        raise ValueError("--fp4-param-gather works with the built-in Llama only (its layers "
                         "are known to multiply their kernels unchanged)")
    dtype = model_config(rm.rcfg).dtype
    plans, notes = {}, {}
    for k in rm.models:
        plans[k], notes[k] = parallel.fp4_gather_plan(params, specs, mesh,
                                                      rm.weight_layers(k), dtype)
    if not any(why is None for n in notes.values() for why in n.values()):
        raise ValueError("--fp4-param-gather: no weight of this run can be gathered in FP4 ("
                         + parallel.describe_plan(notes[False]) + "); drop the flag")
    return plans, notes


def compiled_steps(cfg: TrainConfig, rm: RunModels, recipe: Recipe, mesh: Mesh,
                   root: jax.Array) -> tuple[dict, bool]:
    """The jitted functions of the run: ``{"init": init(root) -> state, "train":
    {switched: step}, "eval": {switched: eval}, "param_gather": {switched: notes} or
    None}`` (``switched``: the precision switch), the state laid out replicated or
    (``--fsdp > 1``) by ``parallel.state_specs``, with ``--fp4-param-gather`` the weights
    gathered as ``fp4_gather_plans`` says (its notes); shared with earlier runs of the same
    compiled config (``_step_fns``). Returns ``(functions, reused)``."""
    tx = make_optimizer(cfg)

    def build() -> dict:
        osci = oc = None
        plain = make_init_state(rm.models[False], tx, cfg)
        if rm.rcfg.osci_reset is not None:  # its tracked weights from the parameters' shapes
            osci = osci_reset_plan(rm, jax.eval_shape(plain, root)["params"])
        if rm.rcfg.outcontrol is not None:  # its layers from the record's output shapes
            oc = outcontrol_plan(cfg, rm, mesh, jax.eval_shape(plain, root)["params"])
        init_fn = make_init_state(rm.models[False], tx, cfg, osci, oc[1:] if oc else None)
        # the state's layout: replicated, or (--fsdp > 1) each array's fsdp_spec, from its
        # shapes (an abstract evaluation of init: one more "init" trace)
        shapes = jax.eval_shape(init_fn, root) if mesh.shape["fsdp"] > 1 else None
        specs = parallel.state_specs(shapes, mesh) if shapes is not None else _REPLICATED
        if shapes is None and osci is not None:
            specs = {**specs, "osci": jax.sharding.PartitionSpec()}
        if oc is not None:  # (no --fsdp: config.validate_config)
            specs = {**specs, "outcontrol": jax.sharding.PartitionSpec()}
        plans: dict[bool, Any] = {k: None for k in rm.models}
        notes = None
        if cfg.fp4_param_gather:
            plans, notes = fp4_gather_plans(rm, shapes["params"], specs["params"], mesh)
        return {
            "init": jax.jit(init_fn, out_shardings=parallel.shardings(specs, mesh)),
            "train": {k: make_train_step(m, tx, None, mesh, specs, plans[k], osci)
                      for k, m in rm.models.items()},
            "eval": {k: make_eval_step(m, None, mesh, plans[k])
                     for k, m in rm.models.items()},
            "param_gather": notes,
            **({} if oc is None else {
                "outcontrol": {"record": oc[0], "plan": oc[1],
                               "train": make_train_step(rm.models[False], tx, None, mesh, specs,
                                                        None, osci, outcontrol=True),
                               "eval": make_eval_step(rm.models[False], None, mesh,
                                                      outcontrol=True)}})}

    return _step_fns(rm.rcfg, recipe, mesh, build, _file_digests(cfg))


def outcontrol_plan(cfg: TrainConfig, rm: RunModels, mesh: Mesh, params: Any
                    ) -> tuple[Callable, channel_split.OutControlPlan, Any] | None:
    """``--outcontrol``: the run's statistic pass (``make_outcontrol_record``), its plan
    (``channel_split.make_plan``: which layers split how many channels; its schedule is
    set per run, ``train``) and the record's output shapes, from the parameters' shapes
    ``params``; None when no layer of the run quantizes (a ``bf16`` run of a comparison:
    OutControl has nothing to do there).

    Raises:
      ValueError: quantized dense layers, none wide enough to split."""
    rcfg = rm.rcfg
    record = make_outcontrol_record(rm.models[False], mesh)
    batch = jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len + 1), jnp.int32)
    shapes = jax.eval_shape(record, params, batch, jax.random.key(0), jnp.int32(0))
    plan = channel_split.make_plan(shapes, rcfg.outcontrol, rcfg.outcontrol_multiple,
                                   rcfg.outcontrol_start, rcfg.outcontrol_iters)
    if not plan.counts and not plan.skipped:
        return None
    if not plan.counts:
        why = "; ".join(f"{k}: {v}" for k, v in list(plan.skipped.items())[:3])
        raise ValueError("--outcontrol: no quantized linear layer of this run can split its "
                         "input channels (a layer needs at least 2 x --outcontrol-multiple "
                         f"= {2 * rcfg.outcontrol_multiple} of them{'; ' + why if why else ''}"
                         "): lower --outcontrol-multiple or drop --outcontrol")
    return record, plan, shapes


def _split_evals(fn: Callable, split: Callable[[], Any]) -> dict[bool, Callable]:
    """The evaluation of an OutControl run after its split: ``fn(params, batch, key,
    split())`` as ``Evaluation``'s ``{switched: eval(params, batch, key)}`` (``split`` reads
    the current state's: each step donates the one before)."""
    return {False: lambda p, b, k: fn(p, b, k, split())}


def _model_files(cfg: TrainConfig) -> list[str]:
    """The files a ``--model`` run's model is built from: the rules file, the factory's
    file (given as a path, or the source of its dotted module)."""
    files = [cfg.rules] if cfg.rules else []
    where = cfg.model.rpartition(":")[0] if cfg.model else ""
    if where.endswith(".py") or "/" in where:
        files.append(where)
    elif where:
        import importlib.util

        try:
            spec = importlib.util.find_spec(where)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            files.append(spec.origin)
    return files


def model_digest(cfg: TrainConfig) -> str | None:
    """One SHA-256 over the files of ``_model_files`` (None when there are none: the
    built-in Llama): recorded with each checkpoint, so that a resume with edited model
    code is refused (``checkpoint.restore_newest``) instead of continuing another model."""
    import hashlib

    digests = _file_digests(cfg)
    if not digests:
        return None
    return hashlib.sha256("\n".join(str(d) for d in digests).encode()).hexdigest()


def _file_digests(cfg: TrainConfig) -> tuple:
    """SHA-256 of the files a ``--model`` run's functions are built from
    (``_model_files``): a changed file is compiled anew."""
    import hashlib

    files = _model_files(cfg)
    out = []
    for f in files:
        try:
            out.append(hashlib.sha256(Path(f).expanduser().read_bytes()).hexdigest())
        except OSError:
            out.append(None)
    return tuple(out)


def measurement_steps(fns: dict, rm: RunModels, mesh: Mesh) -> tuple[dict | None, dict | None]:
    """The ``--stats-every`` and ``--grad-noise-every`` functions of the run (None when
    not asked for), built once and kept with its compiled steps ``fns`` (jit compiles them
    on their first call)."""
    rcfg = rm.rcfg
    stats = (fns.setdefault("stats", {k: make_stats_step(m, mesh, rm.name_fn)
                                      for k, m in rm.models.items()})
             if rcfg.stats_every else None)
    noise = (fns.setdefault("noise", {k: make_grad_noise_step(
        m, rm.hp_backward(k), mesh, rm.name_fn, rm.flat_kernels, rm.scan_axes,
        None if rm.layers is None else tuple(rm.layers))
        for k, m in rm.models.items()})
        if rcfg.grad_noise_every else None)
    return stats, noise


# Train steps whose metrics stay unread after each dispatch: the host waits for step
# s - IN_FLIGHT, so IN_FLIGHT steps stay queued on the device while it logs and dispatches.
IN_FLIGHT = 2
# Training batches built and put on the devices ahead of the step that takes them.
PREFETCH = 2


class BatchPrefetcher:
    """The training batches of steps ``start .. end - 1``, each built on the host
    (``rows(step, slice)``: the rows of that slice of batch ``step``, a pure function of
    its arguments) and laid out by ``sharding`` (``processes.global_array``: each process
    builds the rows its devices hold) in a background thread, up to ``depth`` steps ahead
    of the one the loop asks for (``get``), so neither the host's work nor the copy to the
    devices is in the step's path. The arrays are those the loop would build itself, step
    by step. ``depth``: None is ``PREFETCH`` as it is when the prefetcher is made (0: each
    batch built when its step asks for it). ``close`` stops the thread (a batch being
    built is finished and dropped)."""

    def __init__(self, rows: Callable[[int, slice], Any], shape: tuple[int, ...],
                 sharding: Any, start: int, end: int, depth: int | None = None) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.rows, self.shape, self.sharding = rows, shape, sharding
        self.end, self.depth = end, PREFETCH if depth is None else depth
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="fp4jax-batches")
        self.futures: dict[int, Any] = {}
        self.next = start  # the first step not submitted yet
        if self.depth:
            self._fill(start + self.depth)

    def _build(self, s: int) -> jax.Array:
        return processes.global_array(self.shape, self.sharding,
                                      lambda r: self.rows(s, r))

    def _fill(self, last: int) -> None:
        """Submits every step not submitted yet up to ``last`` (and before ``end``)."""
        while self.next <= last and self.next < self.end:
            self.futures[self.next] = self.pool.submit(self._build, self.next)
            self.next += 1

    def get(self, s: int) -> jax.Array:
        """Batch ``s`` (an error raised while building it is raised here): built ahead, or
        (``depth`` 0, or a step not asked for in order) built now."""
        fut = self.futures.pop(s, None)
        self.next = max(self.next, s + 1)  # step s is taken now
        self._fill(s + self.depth)  # the next ones start while this one is taken
        return fut.result() if fut is not None else self._build(s)

    def close(self) -> None:
        for f in self.futures.values():
            f.cancel()
        self.futures.clear()
        self.pool.shutdown(wait=True)


def _threefry_lowering() -> str:
    return "kernel" if jax.config.jax_threefry_gpu_kernel_lowering else "xla"


def run_result(cfg: TrainConfig, rm: RunModels, log: RunLog, mesh: Mesh, *, status: str,
               end: int, diverged_at: int | None, n_params: int, data_sha: str,
               switch: PrecisionSwitch, wall: float, out: Path | None,
               segments: list[dict] | None = None) -> dict:
    """The result dict of a run (also written to ``out/result.json`` when ``out``).
    ``segments``: ``{"step", "xla_flags", "threefry_lowering"}`` of each part of the run
    (the first, then each resumption), as ``metrics.jsonl``'s ``"segment"`` records."""
    history = log.history
    vs, vl = history["val_step"], history["val_loss"]
    finished = status == "finished" and bool(vs) and vs[-1] == cfg.steps
    ran = end if diverged_at is None else diverged_at
    res = {
        "recipe": rm.recipes[False].name, "spec": cfg.recipe, "seed": cfg.seed,
        "preset": cfg.preset, **({"model": cfg.model} if cfg.model is not None else {}),
        "params": n_params, "policy": rm.summary,
        "status": status, "diverged_at": diverged_at,
        "steps": ran,
        "final_val_loss": vl[-1] if finished else None,
        "last_val_step": vs[-1] if vs else None, "last_val_loss": vl[-1] if vl else None,
        "final_train_loss": history["loss"][-1] if history["loss"] else None,
        "tokens_per_s": log.tokens_per_s, "devices": mesh.devices.size,
        "processes": processes.count(),
        "platform": mesh.devices.flat[0].platform,
        "device_kind": mesh.devices.flat[0].device_kind, "wall_s": wall,
        "data_sha256": data_sha, "config": dataclasses.asdict(cfg), "history": history,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "threefry_lowering": _threefry_lowering(),
        "segments": segments,
        "bf16_layers": rm.bf16["layers"] if rm.bf16 is not None else None,
        "switch_step": switch.step if switch.step < end else None,
        "bf16_gemm_fraction": rm.gemm_fraction(ran, switch.step),
    }
    if out is not None:
        tmp = out / "result.json.tmp"
        tmp.write_text(json.dumps(res, indent=1))
        os.replace(tmp, out / "result.json")
    return res


@releases_locks
def train(cfg: TrainConfig, dataset: ByteDataset | None = None) -> dict:
    """Runs one training run; returns its result dict (also written to ``out/result.json``).

    A fresh run (``resume`` false) refuses an ``out`` that holds a run unless ``overwrite``
    (which moves it aside to ``OUT.old-<time>``). ``resume`` restores the newest checkpoint
    that restores completely and matches its checksum; damaged newer ones are moved to
    ``OUT/checkpoints.damaged/`` (said on stderr). The config and the data fingerprint must
    match the checkpoint's, except keys named in ``resume_override``.

    Raises:
      TrainingDiverged: non-finite loss, validation loss, grad norm or state (the last good
        checkpoint is kept; ``result.json`` says ``"status": "diverged"``).
      ValueError: bad config (``ConfigError``), ``out`` holds a run (``RunExists``), or
        ``resume`` with a config or data that differ from the checkpoint's, or with no
        checkpoint that restores.
    """
    # cfg validated itself when it was built (TrainConfig): its spec is parsed (plan_run)
    # several processes (jax.distributed): process 0 owns --out; its errors stop every process
    main = processes.is_main()
    processes.on_main(lambda: check_out(cfg.out), what="checking --out")
    out = Path(cfg.out)
    if not cfg.resume:  # refuse before loading data and compiling
        processes.on_main(lambda: claim_out(cfg, dry_run=True), what="checking --out")
    else:  # nothing to resume: refused before anything is compiled or written
        processes.on_main(lambda: check_resumable(cfg.out), what="checking --out")
    # run-level keys of the spec (nvfp4(last_bf16=0, switch_at=0.8)) applied: rcfg builds
    # the model; cfg (the spec as given) is what results and checkpoints record
    plan = plan_run(cfg)
    rcfg, recipe = plan.run_config, plan.recipe
    overrides = override_keys(cfg.resume_override)
    # state and sharding: the devices; data; the model and its precision
    mesh = run_mesh(cfg, rcfg)
    ds = load_data(cfg, dataset)
    rm = build_models(cfg, rcfg, recipe, ds)
    rcfg = rm.rcfg
    check_token_rows(cfg, rm, mesh)  # before --out is claimed (the first step would find it)
    switch = PrecisionSwitch(rcfg, cfg.steps)

    # the step functions, the initial state
    schedule = make_schedule(cfg)
    root = jax.random.key(cfg.seed)
    sr_key = jax.random.fold_in(root, 1)
    data_sharding = NamedSharding(mesh, parallel.BATCH)
    fns, reused = compiled_steps(cfg, rm, recipe, mesh, root)
    state = fns["init"](root)
    n_params = sum(int(x.size) for x in jax.tree.leaves(state["params"]))
    cfg_dict = dataclasses.asdict(cfg)
    data_sha = ds.fingerprint()
    model_sha = model_digest(cfg)
    metrics_path = out / "metrics.jsonl"

    # checkpoints: open the run directory, resume
    ckpts = RunCheckpoints(out, cfg.keep_checkpoints, main)
    processes.on_main(lambda: ckpts.open(cfg), what="opening --out")
    start = 0
    overridden: dict[str, list] = {}
    damaged: list = []
    if cfg.resume:
        resumed = ckpts.resume(state, cfg_dict, overrides, data_sha,
                               lambda meta: switch.restore(meta, rm.bf16), model_sha,
                               plan.run_keys)
        state, start = resumed.state, resumed.step
        overridden, damaged = resumed.overridden, resumed.damaged
        if main:
            truncate_metrics(metrics_path, start)
    end = cfg.steps if cfg.stop_at is None else min(cfg.steps, cfg.stop_at)

    # evaluation and measurements
    stats_fn, noise_fn = measurement_steps(fns, rm, mesh)
    val_np = ds.val_batches(cfg.eval_batches, cfg.batch_size)
    val = [processes.global_array(b.shape, data_sharding, lambda r, b=b: b[r]) for b in val_np]

    # logging: the header, the records of the run's start
    header = (f"[{recipe.name}] {rm.describe}; {rm.summary}; {mesh.devices.size} "
              f"{mesh.devices.flat[0].platform} device(s); "
              f"{len(ds.train) / 1e6:.2f}M train / {len(ds.val) / 1e6:.2f}M val {ds.unit}")
    if rcfg.vocab_size != 256 or getattr(ds, "tokenizer", "bytes") != "bytes":
        header += f"; vocabulary {rcfg.vocab_size} ({getattr(ds, 'tokenizer', '') or 'ids'})"
    if reused:
        header += "; compiled steps reused from an earlier run (the seed is an argument)"
    header += switch.describe()
    if rcfg.grad_noise_every:
        header += (f"; gradient-to-noise ratio every {rcfg.grad_noise_every} steps"
                   if quantized_backward(rm.recipes[False]) else "; gradient-to-noise ratio: "
                   "not measured (the recipe quantizes no backward GEMM)")
    if rm.bf16 is not None:
        header += f"; BF16 layers ({rm.bf16['source']}): {', '.join(rm.bf16['layers']) or 'none'}"
    if cfg.stats_every:
        header += f"; per-layer stats every {cfg.stats_every} steps"
    if fns.get("param_gather"):
        header += "; " + parallel.describe_plan(fns["param_gather"][False])
    if processes.count() > 1:
        header += f"; {processes.count()} processes"
    pbar = Progress(end, start, cfg.progress and main, recipe.name, quiet=not main)
    pbar.write(header)
    # resumed runs continue the recorded curves (truncated to the checkpoint above)
    history = history_from_metrics(metrics_path) if cfg.resume and main else empty_history()
    log = RunLog(metrics_path if main else None, pbar, recipe.name, cfg.batch_size * cfg.seq_len,
                 cfg.log_every, end, schedule, lambda s: rm.recipes[switch(s)].name,
                 ckpts.drop_bad, history)
    if rm.bf16 is not None and not cfg.resume:
        log.write({"type": "bf16_layers", "step": 0, **rm.bf16})
    if rm.layers is not None and not cfg.resume:  # a --model's: what each layer runs
        log.write({"type": "precision", "step": 0, "layers": rm.layers})
    if fns.get("param_gather") and not cfg.resume:  # --fp4-param-gather: which kernels
        log.write({"type": "param_gather", "step": 0,
                   "kernels": {str(k): v for k, v in fns["param_gather"].items()}})
    if overridden or damaged:
        rec: dict[str, Any] = {"type": "resume", "step": start}
        if overridden:
            rec["overrides"] = overridden
        if damaged:
            rec["damaged_checkpoints"] = {str(e.step): e.reason for e in damaged}
        log.write(rec)
    # the XLA flags of this segment (a resumed run may run under other flags, e.g. without
    # --deterministic): every segment's are recorded, and result.json lists them
    segment = {"type": "segment", "step": start, "xla_flags": os.environ.get("XLA_FLAGS", ""),
               "threefry_lowering": _threefry_lowering()}
    segments = ([{k: v for k, v in r.items() if k != "type"}
                 for _, r in read_metrics(metrics_path) if r.get("type") == "segment"]
                if cfg.resume and main else [])
    segments.append({k: v for k, v in segment.items() if k != "type"})
    log.write(segment)
    if len({s["xla_flags"] for s in segments}) > 1:
        log.say(f"resumed at step {start} with XLA_FLAGS {segment['xla_flags']!r}, other "
                "than an earlier segment's (result.json 'segments' lists them)")
    if overridden:
        log.say(f"resuming at step {start} with overrides: "
                + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in overridden.items()))
    ev = Evaluation(log, sr_key, fns["eval"], val, stats_fn, noise_fn, rm.fp4_names, rm.order)
    oc = fns.get("outcontrol")
    replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())
    if oc is not None:  # this run's schedule (the compiled functions do not depend on it)
        oc = {**oc, "plan": dataclasses.replace(oc["plan"], start=rcfg.outcontrol_start,
                                                iters=rcfg.outcontrol_iters)}
    elif rcfg.outcontrol is not None:
        log.say("OutControl: off in this run: none of its linear layers is quantized")

    def current_split() -> Any:  # the state's (each step donates the one before)
        return state["outcontrol"]["split"]

    if oc is not None:
        log.say(oc["plan"].describe())
        if start > oc["plan"].split_step:  # resumed after the split: evaluation runs it too
            ev.evals = _split_evals(oc["eval"], current_split)

    def save(s: int) -> None:
        meta = {"config": cfg_dict, "step": s, "data_sha256": data_sha,
                **({"model_sha256": model_sha} if model_sha is not None else {}),
                **({"bf16_layers": rm.bf16} if rm.bf16 is not None else {}),
                **({"auto_switch": switch.state()} if switch.monitor is not None else {})}
        ckpts.save(s, state, meta, log)

    def result(status: str, diverged_at: int | None = None) -> dict:
        return run_result(cfg, rm, log, mesh, status=status, end=end, diverged_at=diverged_at,
                          n_params=n_params, data_sha=data_sha, switch=switch,
                          wall=time.perf_counter() - t_start, out=out if main else None,
                          segments=segments)

    batches = BatchPrefetcher(  # each process builds the rows its devices hold
        lambda s, r: ds.train_batch(s, cfg.batch_size, cfg.seed, r),
        (cfg.batch_size, cfg.seq_len + 1), data_sharding, start, end)
    t_start = time.perf_counter()
    try:
        if start == 0 and cfg.eval_every:
            ev.val_loss(0, state["params"], switch(0))
        elif (start and ((cfg.eval_every and start % cfg.eval_every == 0) or start == cfg.steps)
              and history["val_step"][-1:] != [start]):
            # its record was lost (a torn metrics.jsonl): the same value again
            ev.val_loss(start, state["params"], switch(start))
        for s in range(start, end):
            batch = batches.get(s)  # built and put on the devices while earlier steps ran
            if (noise_fn is not None and s % rcfg.grad_noise_every == 0
                    and quantized_backward(rm.recipes[switch(s)])):
                log.flush()
                r = ev.noise(s, state["params"], batch, state["step"], switch(s))
                switch.observe(s, r["ratio"], log)  # fired: step s runs switched
            if stats_fn is not None and s % cfg.stats_every == 0:
                log.flush()
                # before the step, which donates the state
                ev.stats(s, state["params"], batch, state["step"], switch(s))
            step_fn = fns["train"][switch(s)]
            if oc is not None:  # OutControl: record, split (fp4jax.train.channel_split)
                plan = oc["plan"]
                if plan.recording(s):
                    norms = oc["record"](state["params"], batch, sr_key, state["step"])
                    state = {**state, "outcontrol": jax.device_put(channel_split.accumulate(
                        plan, state["outcontrol"], norms), replicated)}
                if s == plan.split_step:
                    state = {**state, "outcontrol": jax.device_put(channel_split.select(
                        plan, state["outcontrol"]), replicated)}
                    log.flush()
                    log.write(channel_split.counts_record(plan, state["outcontrol"], s))
                    ev.evals = _split_evals(oc["eval"], current_split)
                if s >= plan.split_step:
                    step_fn = oc["train"]
            state, m = step_fn(state, batch, sr_key)
            log.dispatched(s, m)
            log.flush(keep=IN_FLIGHT)  # the metrics of step s - IN_FLIGHT while s runs
            done = s + 1
            if (cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.steps:
                log.flush()
                ev.val_loss(done, state["params"], switch(done))
            if (cfg.checkpoint_every and done % cfg.checkpoint_every == 0) or done == end:
                log.flush()
                save(done)
        log.flush()
        ckpts.finish()  # the run ended good: the newest N stay
    except TrainingDiverged as e:
        result("diverged", e.step)
        raise
    finally:
        batches.close()
        log.close()
        ckpts.close()
    return result("finished" if end == cfg.steps else "stopped")
