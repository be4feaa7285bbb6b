"""Comparing recipes: ``compare`` trains each recipe spec (``nvfp4``, ``nvfp4(sr=False,
rht=0)``) with each seed on the same data and writes ``compare.md``, ``compare.json`` and
``compare.png`` (mean and spread over seeds, gaps to the first spec, the baseline);
``comparison_table`` (the markdown table of final losses and gaps to BF16) and ``plot_losses``
(the loss curves; matplotlib is optional and imported on first use) also work on results
loaded from ``result.json`` files. ``split_specs``, ``spec_slugs`` and ``parse_seeds`` turn
the ``--compare``/``--seeds`` strings into specs, directory names and seeds; ``summarize``,
``summary_table`` and ``plot_sweep`` aggregate the runs of a sweep.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fp4jax.train.checkpoint import config_diff
from fp4jax.train.config import (
    MAX_SEED,
    TrainConfig,
    parsed_spec,
    split_specs,
)
from fp4jax.train.loop import (
    TrainingDiverged,
    build_models,
    check_token_rows,
    fp4_gather_plans,
    osci_reset_plan,
    outcontrol_plan,
    run_mesh,
    train,
)
from fp4jax.train.rundir import (
    RunExists,
    check_out,
    check_resumable,
    check_unlocked,
    lock_out,
    refusal,
    releases_locks,
    run_contents,
)
from fp4jax.train.tokens import load_dataset

__all__ = ["SweepFailed", "compare", "comparison_table", "paired_cells", "paired_difference",
           "parse_seeds", "plot_losses", "plot_sweep", "slug", "spec_slugs", "split_specs",
           "summarize", "summary_table"]

class SweepFailed(RuntimeError):
    """A worker process of a parallel sweep failed (its log is named); the other runs'
    results and the summary were written."""


SWEEP_FILE = "sweep.json"  # marks OUT as written by compare(): a repeated sweep continues


def slug(spec: str) -> str:
    """A filesystem-safe directory name for a recipe spec: blanks dropped, ``=`` as ``-``,
    parentheses and commas as ``_``, other characters outside ``[A-Za-z0-9._+-]`` dropped
    (``nvfp4(sr=False, rht=0)`` -> ``nvfp4_sr-False_rht-0``; a name is its own slug); over 80
    characters, cut and suffixed with a hash of the spec."""
    s = re.sub(r"\s+", "", spec).replace("=", "-")
    s = re.sub(r"[(),\[\]]+", "_", s)
    s = re.sub(r"[^A-Za-z0-9._+-]+", "", s).strip("._-") or "recipe"
    if len(s) > 80:
        s = s[:71] + "-" + hashlib.sha1(spec.encode()).hexdigest()[:8]
    return s


def spec_slugs(specs: Sequence[str]) -> dict[str, str]:
    """``{spec: slug}``, unique: specs whose slugs collide get a hash of the spec appended."""
    plain = {sp: slug(sp) for sp in specs}
    taken = list(plain.values())
    return {sp: f"{sl}-{hashlib.sha1(sp.encode()).hexdigest()[:8]}"
            if taken.count(sl) > 1 or sl.lower() in ("compare", "sweep") else sl
            for sp, sl in plain.items()}


def parse_seeds(text: str | Sequence[int]) -> list[int]:
    """The seeds of ``--seeds 0,1,2`` (distinct integers, at least one).

    Raises:
      ValueError: not comma-separated integers, none, one given twice, or one outside
        ``0..MAX_SEED`` (``TrainConfig.seed``'s range).
    """
    if isinstance(text, str):
        try:
            seeds = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"must be comma-separated integers, e.g. 0,1,2; got {text!r}") \
                from None
    else:
        seeds = [int(x) for x in text]
    if not seeds:
        raise ValueError(f"names no seed (got {text!r})")
    bad = [x for x in seeds if not 0 <= x <= MAX_SEED]
    if bad:
        raise ValueError(f"seeds must be integers in 0..{MAX_SEED}, got {bad[0]}")
    twice = sorted({x for x in seeds if seeds.count(x) > 1})
    if twice:
        raise ValueError(f"names seed {', '.join(map(str, twice))} more than once")
    return seeds


def _note(msg: str) -> None:
    print(f"fp4jax-train: {msg}", file=sys.stderr, flush=True)


def _recorded_config(out: Path) -> dict | None:
    """The config a run in ``out`` recorded: its ``result.json``'s, else its newest
    checkpoint's; None when it recorded none."""
    try:
        cfg = json.loads((out / "result.json").read_text()).get("config")
        if cfg is not None:
            return cfg
    except (OSError, ValueError):
        pass
    ckdir = out / "checkpoints"
    if not ckdir.is_dir() or not any(p.name.isdigit() for p in ckdir.iterdir()):
        return None
    try:
        from fp4jax.train.checkpoint import Checkpointer

        ck = Checkpointer(ckdir)
        try:
            steps = ck.all_steps()
            return ck.meta(steps[-1])["config"] if steps else None
        finally:
            ck.close()
    except Exception:  # noqa: BLE001 - an unreadable checkpoint: nothing recorded
        return None


def _plan(sub: TrainConfig) -> tuple[str, TrainConfig, dict | None]:
    """What a repeated sweep does with the sub-run ``sub`` (its ``out`` holds a run):
    ``("skip", sub, result)`` for a finished (or diverged) run, ``("resume", ...)`` for a
    cut-off one with a checkpoint, ``("restart", ...)`` for one killed before its first
    checkpoint (moved aside, nothing deleted).

    Raises:
      RunExists: its recorded config differs from ``sub`` (outside ``RESUMABLE_KEYS``).
    """
    out = Path(sub.out)
    found = run_contents(out)
    recorded = _recorded_config(out)
    if recorded is not None:
        diff = config_diff(recorded, dataclasses.asdict(sub), parsed_spec(sub, sub.recipe).extra)
        if diff:
            raise RunExists(refusal(out, found) + "; its config differs from this sweep's: "
                            + "; ".join(diff))
    try:
        res = json.loads((out / "result.json").read_text())
    except (OSError, ValueError):
        res = None
    if res is not None and res.get("status") in ("finished", "diverged"):
        return "skip", sub, res
    ck = out / "checkpoints"
    if ck.is_dir() and any(p.name.isdigit() for p in ck.iterdir()):  # a step to resume from
        return "resume", sub.replace(resume=True, resume_override=None), None
    return "restart", sub.replace(overwrite=True), None


@releases_locks
def compare(cfg: TrainConfig, recipes: Sequence[str],
            seeds: Sequence[int] | None = None, jobs: int = 1) -> list[dict]:
    """Trains each recipe spec with each seed (default: ``cfg.seed``) on the same data, and
    the same batch order per seed, into ``OUT/<slug>/`` (one seed) or ``OUT/<slug>/seed<s>/``
    (several); writes ``compare.md``, ``compare.json`` and ``compare.png`` (``summarize``,
    ``summary_table``, ``plot_sweep``/``plot_losses``), the first spec being the baseline.
    Returns the runs' results, spec by spec, seed by seed.

    Every sub-run is checked before anything trains or is written: each passes the checks
    its own single run makes before its first step (``TrainConfig`` with its spec's
    run-level keys, then ``check_runs``), whatever the order of the specs. With ``resume``
    each sub-run resumes
    (one that never started starts afresh); with ``overwrite`` each is moved aside by
    ``train``. Otherwise a sub-run that holds a run is refused (``RunExists``), except when
    ``OUT`` holds an earlier sweep (``OUT/sweep.json``): then a repeated sweep continues:
    finished (and diverged) sub-runs are skipped, cut-off ones resumed from their checkpoint,
    ones killed before their first checkpoint moved aside and restarted, each said on stderr;
    a sub-run whose recorded config differs from the requested one is still refused.

    A sub-run that diverges is a result of the sweep, not its end: it is reported (``status:
    "diverged"`` in its ``result.json``, no mean in the summary) and the sweep goes on.
    With ``jobs > 1`` up to ``jobs`` specs train at once, each in its own process
    (``fp4jax.train._worker``, its output in ``OUT/workers/<slug>.log``; with more jobs than
    specs, a spec's seeds are split over workers, ``<slug>-seeds0.log``; stopping the sweep
    stops its workers), sharing the local
    devices: compiles run in parallel, which is what makes many-spec sweeps on one GPU
    fast; throughput (tokens/s) of concurrent runs is then not comparable across runs.

    Raises:
      ValueError: a bad spec, seeds or ``jobs``; a sub-run its own run would refuse
        (``check_runs``); ``RunExists`` (see above).
      SweepFailed: a worker process failed (after the summary of the other runs is written).
    """
    if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
        raise ValueError(f"jobs must be an integer >= 1, got {jobs!r}")
    if not recipes:
        raise ValueError("compare: no recipe names given")
    for r in recipes:  # validate every spec before training anything (cfg's: parsed already)
        parsed_spec(cfg, r)
    seeds = [cfg.seed] if seeds is None else parse_seeds(seeds)
    check_out(cfg.out)  # (cfg validated itself when it was built: TrainConfig)
    out = Path(cfg.out)
    slugs = spec_slugs(recipes)
    subs: dict[tuple[str, int], TrainConfig] = {}
    for r in recipes:
        for s in seeds:
            d = out / slugs[r] if len(seeds) == 1 else out / slugs[r] / f"seed{s}"
            subs[r, s] = cfg.replace(recipe=r, seed=s, out=str(d), compare=None)
    done: dict[tuple[str, int], dict] = {}
    # a sweep (or an orphaned worker of one) still writing here: refuse before touching it
    check_unlocked(out)
    for sub in subs.values():
        check_unlocked(sub.out)
    if cfg.resume:
        for k, sub in subs.items():
            if not run_contents(sub.out):
                _note(f"--resume: {sub.out} holds no run yet: {k[0]} (seed {k[1]}) starts afresh")
                subs[k] = sub.replace(resume=False, resume_override=None)
    elif not cfg.overwrite:
        taken = {k: found for k, sub in subs.items() if (found := run_contents(sub.out))}
        if taken and (out / SWEEP_FILE).is_file():
            for k in taken:
                action, subs[k], res = _plan(subs[k])
                if action == "skip":
                    done[k] = res
                    _note(f"sweep: {subs[k].out}: {res['status']}: skipped")
                elif action == "resume":
                    _note(f"sweep: {subs[k].out}: cut off: resuming from its checkpoint")
                else:
                    _note(f"sweep: {subs[k].out}: no checkpoint: moving it aside, restarting")
        elif taken:
            first = next(iter(taken))
            raise RunExists(refusal(subs[first].out, taken[first])
                            + (f" (also: {', '.join(subs[k].out for k in list(taken)[1:])})"
                               if len(taken) > 1 else ""))
    todo = [k for k in subs if k not in done]
    ds = None
    if todo:  # every run to train passes its own run's checks before the first one starts
        ds = load_dataset(cfg.data, cfg.seq_len, cfg.val_fraction, cfg.cache_dir,
                          cfg.tokenizer)
        check_runs([subs[k] for k in todo], ds)
    out.mkdir(parents=True, exist_ok=True)
    lock_out(out)  # one sweep at a time in OUT (released when compare returns)
    (out / SWEEP_FILE).write_text(json.dumps(
        {"specs": list(recipes), "seeds": seeds, "dirs": {r: slugs[r] for r in recipes},
         "config": {k: v for k, v in dataclasses.asdict(cfg).items()
                    if k not in ("recipe", "seed")}},
        indent=1))
    failed: list[str] = []
    if jobs > 1 and len(todo) > 1:  # (a bpe:N vocabulary: trained above, once, not per worker)
        before = {k: _stamp(Path(subs[k].out) / "result.json") for k in todo}
        failed = _train_parallel({k: subs[k] for k in todo}, slugs, out, jobs)
        for k in todo:
            done[k] = _result_of(subs[k], before=before[k] or ())
    elif todo:
        for k in todo:
            try:
                done[k] = train(subs[k], ds)
            except TrainingDiverged as e:
                _note(f"{subs[k].out}: training diverged ({e}); the sweep goes on")
                done[k] = _result_of(subs[k])
    results = [done[k] for k in subs]
    for k, r in zip(subs, results, strict=True):  # older result.json files lack these
        r.setdefault("spec", k[0])
        r.setdefault("seed", k[1])
        r["out"] = subs[k].out
    agg = summarize(results, baseline=recipes[0])
    table = summary_table(agg) + "\n\nPer run:\n\n" + comparison_table(results)
    (out / "compare.md").write_text(table + "\n")
    (out / "compare.json").write_text(json.dumps(agg, indent=1))
    if len(seeds) > 1:
        plot_path = plot_sweep(results, out / "compare.png", baseline=recipes[0])
    else:
        plot_path = plot_losses(results, out / "compare.png")
    print(table)
    print(f"wrote {out / 'compare.md'}, {out / 'compare.json'}"
          + (f", {plot_path}" if plot_path else ""))
    diverged = [r["out"] for r in results if r.get("status") == "diverged"]
    if diverged:
        _note(f"{len(diverged)} run(s) diverged: {', '.join(diverged)}")
    if failed:
        raise SweepFailed(f"{len(failed)} sweep worker(s) failed; see {', '.join(failed)}")
    return results


def check_runs(subs: Sequence[TrainConfig], dataset: Any) -> None:
    """Runs, for each sub-run of a sweep (one per spec: the seeds share them), the checks
    its own ``train`` runs before its first step, without compiling or writing anything:
    a checkpoint to resume from (``check_resumable``, each sub-run that resumes), the config
    (``TrainConfig``), the devices (``run_mesh``), the model and its precision
    (``build_models``), the token rows per device (``check_token_rows``) and, from the
    parameters' shapes (``jax.eval_shape``), the plans of ``--osci-reset``,
    ``--outcontrol`` and ``--fp4-param-gather``. A run with ``--bf16-layers auto`` chooses
    its layers by an FP4 warm-up run of its own: its model is checked when it starts.

    Raises:
      ValueError: the first sub-run that its own ``train`` would refuse, naming its spec.
    """
    import jax

    from fp4jax.train import parallel
    from fp4jax.train.config import explicit_bf16_layers, make_optimizer
    from fp4jax.train.plan import plan_run
    from fp4jax.train.steps import make_init_state

    for sub in subs:  # each seed's: its directory holds a checkpoint to resume from
        if sub.resume:
            check_resumable(sub.out)
    seen: set[str] = set()
    for sub in subs:
        if sub.recipe in seen:
            continue
        seen.add(sub.recipe)
        try:
            plan = plan_run(sub)  # sub validated itself (TrainConfig): its spec is parsed
            rsub, recipe = plan.run_config, plan.recipe
            if explicit_bf16_layers(rsub.bf16_layers) is None:  # auto: measured by the run
                continue
            mesh = run_mesh(sub, rsub)
            rm = build_models(sub, rsub, recipe, dataset)
            check_token_rows(sub, rm, mesh)
            if (rm.rcfg.osci_reset is None and rm.rcfg.outcontrol is None
                    and not sub.fp4_param_gather):
                continue
            init = make_init_state(rm.models[False], make_optimizer(sub), sub)
            state = jax.eval_shape(init, jax.random.key(sub.seed))
            if rm.rcfg.osci_reset is not None:
                osci_reset_plan(rm, state["params"])
            if rm.rcfg.outcontrol is not None:
                outcontrol_plan(sub, rm, mesh, state["params"])
            if sub.fp4_param_gather and mesh.shape["fsdp"] > 1:
                specs = parallel.state_specs(state, mesh)
                fp4_gather_plans(rm, state["params"], specs["params"], mesh)
        except ValueError as e:
            raise ValueError(f"the run of recipe spec {sub.recipe!r} would be refused, so "
                             f"the sweep did not start: {e}") from None


def _stamp(path: Path) -> tuple | None:
    """Identity of a file's current version (inode, mtime in ns, size), None if absent."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def _result_of(sub: TrainConfig, before: tuple | None = None) -> dict:
    """The ``result.json`` of a sub-run, or a stand-in with status ``"failed"`` when it has
    none, or only the one it had before the run (``before``, its ``_stamp``): a run that
    failed before writing its own never reports an older run's result."""
    path = Path(sub.out) / "result.json"
    try:
        if before is None or _stamp(path) != before:
            return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    return {"recipe": sub.recipe, "spec": sub.recipe, "seed": sub.seed, "status": "failed",
            "final_val_loss": None, "last_val_loss": None, "last_val_step": None,
            "final_train_loss": None, "tokens_per_s": None,
            "policy": "failed: no result (see the worker log)", "history": {}}


PARENT_ENV = "FP4JAX_SWEEP_PARENT"
"""Environment variable naming a sweep worker's parent pid (``_worker.watch_parent``)."""


def local_gpus() -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` entries, found without
    starting CUDA (which would claim memory on every GPU in the sweep's parent): the entries
    of ``CUDA_VISIBLE_DEVICES`` when set, else ``0 .. n-1`` for the ``/dev/nvidiaN`` device
    files; none under ``JAX_PLATFORMS=cpu``."""
    import os

    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return []
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip() and g.strip() != "-1"]
    try:
        n = sum(1 for f in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", f))
    except OSError:
        n = 0
    return [str(i) for i in range(n)]


def gpu_slots(jobs: int, devices_per_run: int, gpus: Sequence[str]) -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` values giving each of ``jobs`` workers GPUs of its own
    (``devices_per_run`` each, consecutive in ``gpus``), or None when they must share:
    a run that takes all devices (``devices_per_run`` 0), no GPUs, or more GPUs asked for
    than there are (``jobs x devices_per_run > len(gpus)``)."""
    if devices_per_run < 1 or not gpus or jobs * devices_per_run > len(gpus):
        return None
    return [",".join(gpus[i * devices_per_run:(i + 1) * devices_per_run])
            for i in range(jobs)]


def _train_parallel(subs: dict[tuple[str, int], TrainConfig], slugs: dict[str, str],
                    out: Path, jobs: int, gpus: Sequence[str] | None = None) -> list[str]:
    """Trains ``subs`` with up to ``jobs`` worker processes, one per spec (its seeds one after
    the other in it, sharing compiled steps), or, with more jobs than specs, a spec's seeds
    split over several workers. Returns the logs of the workers that failed.

    When every worker can have GPUs of its own (``gpu_slots``: the runs' ``devices`` x
    ``jobs`` <= the GPUs, ``gpus`` or ``local_gpus()``), each worker runs with its own
    ``CUDA_VISIBLE_DEVICES``; otherwise the workers share every device (and do not
    preallocate GPU memory)."""
    import os
    import signal
    import subprocess
    import threading
    import time

    import jax

    units: list[tuple[str, list[TrainConfig]]] = []  # (spec, its sub-runs in one worker)
    for (spec, _), sub in subs.items():
        if not units or units[-1][0] != spec:
            units.append((spec, []))
        units[-1][1].append(sub.replace(progress=False))
    # more workers than specs: split the seeds of the largest units over several workers
    # (each compiles for itself; worth it where the devices, not the compiles, are the limit)
    while len(units) < jobs and max(len(u[1]) for u in units) > 1:
        i = max(range(len(units)), key=lambda j: len(units[j][1]))
        spec, runs = units[i]
        units[i:i + 1] = [(spec, runs[:len(runs) // 2]), (spec, runs[len(runs) // 2:])]
    whole = {spec: sum(u[0] == spec for u in units) == 1 for spec, _ in units}
    per_run = max(sub.devices for sub in subs.values()) if subs else 0
    if any(sub.devices == 0 for sub in subs.values()):
        per_run = 0
    slots = gpu_slots(min(jobs, len(units)), per_run, local_gpus() if gpus is None else gpus)
    env = dict(os.environ)
    if slots is None:
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # processes share devices
    env[PARENT_ENV] = str(os.getpid())  # the workers end when this process does
    cache = jax.config.jax_compilation_cache_dir
    logs = out / "workers"  # beside the runs: a worker moving its run aside keeps its log
    logs.mkdir(parents=True, exist_ok=True)
    pending, running, failed = list(units), {}, []
    old_term = None
    if threading.current_thread() is threading.main_thread():
        def _stop(signum, frame):  # SIGTERM: stop the workers too (finally below)
            raise SystemExit(128 + signum)
        old_term = signal.signal(signal.SIGTERM, _stop)
    try:
        while pending or running:
            while pending and len(running) < jobs:
                spec, runs = pending.pop(0)
                tag = slugs[spec] + ("" if whole[spec] else
                                     "-seeds" + "-".join(str(c.seed) for c in runs))
                plan = logs / f"{tag}-plan.json"
                plan.write_text(json.dumps({"configs": [dataclasses.asdict(c) for c in runs],
                                            "compile_cache": cache}, indent=1))
                path = logs / f"{tag}.log"
                log = open(path, "a")  # appended: a repeated sweep keeps the old log
                wenv, slot = env, None
                if slots is not None:
                    slot = slots.pop(0)
                    wenv = {**env, "CUDA_VISIBLE_DEVICES": slot}
                _note(f"sweep: {spec}: {len(runs)} run(s) in a worker, log {path}"
                      + (f", GPU {slot}" if slot is not None else ""))
                proc = subprocess.Popen(
                    [sys.executable, "-m", "fp4jax.train._worker", str(plan)],
                    stdout=log, stderr=subprocess.STDOUT, env=wenv)
                running[path] = (proc, log, spec, slot)
            time.sleep(0.2)
            for path, (proc, log, spec, slot) in list(running.items()):
                if proc.poll() is not None:
                    log.close()
                    del running[path]
                    if slot is not None:
                        slots.append(slot)
                    if proc.returncode != 0:
                        failed.append(str(path))
                        _note(f"sweep: {spec}: worker exited {proc.returncode}; see {path}")
                    else:
                        _note(f"sweep: {spec}: worker done ({path.name})")
    finally:
        for proc, _, _, _ in running.values():  # interrupted: no orphans
            proc.terminate()
        for proc, log, _, _ in running.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    return failed


def _final(r: dict) -> float | None:
    v = r.get("final_val_loss")
    return None if v is None or not math.isfinite(v) else float(v)


def paired_difference(base: dict[int, float], other: dict[int, float]) -> dict:
    """Paired comparison of two recipes over the seeds both have (a seed fixes the
    initialization, the batch order and the stochastic-rounding draws, so runs of the same
    seed are paired): per shared seed ``d_i = other_i - base_i`` and ``r_i = d_i / base_i``.

    Returns ``{"seeds", "n", "mean", "se", "rel_mean", "rel_se"}``: the mean of ``d`` and
    its standard error ``std(d, ddof=1) / sqrt(n)``, the same for ``r``; ``se``/``rel_se``
    None for fewer than 2 shared seeds, everything but ``seeds``/``n`` None for none.
    Non-finite or missing values leave their seed out.
    """
    def ok(v: Any) -> bool:
        return v is not None and math.isfinite(v)

    seeds = sorted(s for s in base if s in other and ok(base[s]) and ok(other[s]))
    out: dict[str, Any] = {"seeds": seeds, "n": len(seeds), "mean": None, "se": None,
                           "rel_mean": None, "rel_se": None}
    if not seeds:
        return out
    b = np.array([base[s] for s in seeds], np.float64)
    d = np.array([other[s] for s in seeds], np.float64) - b
    r = d / b
    out["mean"], out["rel_mean"] = float(d.mean()), float(r.mean())
    if len(seeds) > 1:
        out["se"] = float(d.std(ddof=1) / math.sqrt(len(seeds)))
        out["rel_se"] = float(r.std(ddof=1) / math.sqrt(len(seeds)))
    return out


def summarize(results: Sequence[dict], baseline: str | None = None) -> dict:
    """``compare.json``: ``{"runs": [...], "summary": [...], "baseline": SPEC, "rule": ...}``.

    ``runs``: spec (``recipe``), seed, final validation loss, tokens/s, directory, status.
    ``summary`` per spec (first-seen order): its seeds, ``n`` (runs with a final validation
    loss), ``mean``, ``std`` (sample std, ddof=1; 0 for one run), ``min``, ``max``,
    ``gap_vs_baseline`` ((mean - base mean) / base mean) and ``gap_exceeds_spread``:
    |mean - base mean| > max(std, base std), None when either has fewer than two runs (no
    spread to compare with) or a mean is missing, and ``paired``: the paired difference to
    the baseline over the seeds both ran (:func:`paired_difference`: mean difference and
    relative difference with their standard errors). ``baseline`` defaults to the first
    spec.
    """
    runs = [{"recipe": r.get("spec") or r["recipe"], "seed": r.get("seed"),
             "final_val_loss": r.get("final_val_loss"), "tokens_per_s": r.get("tokens_per_s"),
             "out": r.get("out"), "status": r.get("status")} for r in results]
    specs = list(dict.fromkeys(x["recipe"] for x in runs))
    baseline = specs[0] if baseline is None else baseline
    summary = []
    for sp in specs:
        mine = [x for x in runs if x["recipe"] == sp]
        vals = [v for x in mine if (v := _final(x)) is not None]
        tps = [x["tokens_per_s"] for x in mine if x["tokens_per_s"]]
        summary.append({
            "recipe": sp, "seeds": [x["seed"] for x in mine], "n": len(vals),
            "mean": float(np.mean(vals)) if vals else None,
            "std": (float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0) if vals else None,
            "min": min(vals) if vals else None, "max": max(vals) if vals else None,
            "tokens_per_s": float(np.mean(tps)) if tps else None,
            "statuses": sorted({x["status"] for x in mine if x["status"]}),
        })
    base = next((x for x in summary if x["recipe"] == baseline), None)
    finals = {sp: {x["seed"]: _final(x) for x in runs if x["recipe"] == sp} for sp in specs}
    for x in summary:
        x["paired"] = paired_difference(finals.get(baseline, {}), finals[x["recipe"]])
        ok = base is not None and base["mean"] is not None and x["mean"] is not None
        x["gap_vs_baseline"] = (x["mean"] - base["mean"]) / base["mean"] if ok else None
        x["gap_exceeds_spread"] = (
            abs(x["mean"] - base["mean"]) > max(x["std"], base["std"])
            if ok and x["n"] > 1 and base["n"] > 1 else None)
    return {"runs": runs, "summary": summary, "baseline": baseline,
            "rule": "gap_exceeds_spread: |mean - baseline mean| > max(std, baseline std), "
                    "sample stds over seeds (ddof=1); null with fewer than 2 seeds. paired: "
                    "per shared seed d = loss - baseline loss; mean(d) ± std(d, ddof=1) / "
                    "sqrt(n) (the standard error), and the same for d / baseline loss; "
                    "se null with fewer than 2 shared seeds"}


def summary_table(agg: dict) -> str:
    """The markdown table of ``summarize``'s output, with its caption."""
    def f(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.4f}"

    lines = [f"Final validation loss over seeds (mean ± sample std); gap: relative gap of the "
             f"means to the baseline {agg['baseline']}; exceeds spread: |mean difference| > "
             "the larger of the two stds (n/a with fewer than 2 seeds); paired: the mean "
             "over the seeds both ran of (loss - baseline loss) ± its standard error "
             "(std/sqrt(n)), and the same relative to the baseline (n/a with fewer than 2 "
             "shared seeds).", "",
             "| recipe | seeds | val loss (mean ± std) | min – max | gap vs baseline | "
             "exceeds spread | paired diff ± SE | paired rel. ± SE | tokens/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for x in agg["summary"]:
        gap = "n/a" if x["gap_vs_baseline"] is None else f"{100 * x['gap_vs_baseline']:+.2f}%"
        ex = {None: "n/a", True: "yes", False: "no"}[x["gap_exceeds_spread"]]
        tps = "n/a" if not x["tokens_per_s"] else f"{x['tokens_per_s']:,.0f}"
        std = "n/a" if x["n"] < 2 or x["std"] is None else f"{x['std']:.4f}"
        mean = "n/a" if x["mean"] is None else f"{x['mean']:.4f} ± {std}"
        pd, pr = paired_cells(x.get("paired"))
        lines.append(f"| {x['recipe']} | {','.join(map(str, x['seeds']))} (n={x['n']}) | {mean} "
                     f"| {f(x['min'])} – {f(x['max'])} | {gap} | {ex} | {pd} | {pr} | {tps} |")
    return "\n".join(lines)


def paired_cells(p: dict | None) -> tuple[str, str]:
    """The two table cells of a :func:`paired_difference`: ``"+0.0123 ± 0.0015 (n=3)"`` and
    ``"+1.02% ± 0.12%"``; ``"n/a"`` with fewer than 2 shared seeds."""
    if not p or p.get("se") is None:
        return "n/a", "n/a"
    return (f"{p['mean']:+.4f} ± {p['se']:.4f} (n={p['n']})",
            f"{100 * p['rel_mean']:+.2f}% ± {100 * p['rel_se']:.2f}%")


def plot_sweep(results: Sequence[dict], path: Path, baseline: str | None = None) -> Path | None:
    """Mean training (EMA) and validation loss curves per spec over its seeds, with a
    min–max band, as a PNG (matplotlib optional)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'fp4jax[train]')",
              file=sys.stderr)
        return None
    results = [r for r in results if r.get("history", {}).get("step")]  # failed: no curves
    if not results:
        return None
    specs = list(dict.fromkeys(r.get("spec") or r["recipe"] for r in results))
    colors = recipe_colors(specs)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    lo = np.inf
    for sp in specs:
        mine = [r for r in results if (r.get("spec") or r["recipe"]) == sp]
        for ax, xs, ys in ((ax1, "step", "loss"), (ax2, "val_step", "val_loss")):
            n = min(len(r["history"][ys]) for r in mine)
            if not n:
                continue
            x = mine[0]["history"][xs][:n]
            y = np.array([_ema(r["history"][ys][:n]) if ys == "loss" else r["history"][ys][:n]
                          for r in mine])
            line, = ax.plot(x, y.mean(0), label=f"{sp} (n={len(mine)})",
                            marker="o" if ys == "val_loss" else None, ms=3,
                            color=colors[sp])
            ax.fill_between(x, y.min(0), y.max(0), color=line.get_color(), alpha=0.2)
            for r in mine:
                _mark_switch(r, (ax,), line.get_color())
            if ys == "val_loss":
                lo = min(lo, float(y.min()))
    ax1.set(xlabel="step", ylabel="train loss (EMA 0.9, nats/byte)",
            title="training loss: mean, min–max over seeds")
    ax2.set(xlabel="step", ylabel="val loss (nats/byte)",
            title="validation loss: mean, min–max over seeds")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        if math.isfinite(lo):
            ax.set_ylim(bottom=max(0.0, lo - 0.3), top=lo + 2.5)
    r0 = results[0]
    fig.suptitle(f"{r0['preset']} preset, {r0['params'] / 1e6:.2f}M params, "
                 f"{r0['devices']}x {r0['device_kind']}; baseline {baseline or specs[0]}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _mark_switch(r: dict, axes: Sequence[Any], color: Any) -> None:
    """A dotted vertical line at the step where run ``r`` switched precision
    (``result.json``'s ``switch_step``: a fixed ``--switch-at`` or the auto switch)."""
    step = r.get("switch_step")
    if step is not None:
        for ax in axes:
            ax.axvline(step, color=color, ls=":", lw=1.0)


def _ema(xs: Sequence[float]) -> np.ndarray:
    out, e = [], None
    for x in xs:
        e = x if e is None else 0.9 * e + 0.1 * x
        out.append(e)
    return np.array(out)


def comparison_table(results: Sequence[dict]) -> str:
    """A markdown table: final validation loss and its relative gap to the BF16 run, and the
    share of each run's linear-layer GEMM work kept in BF16 by its policy (at ``micro``, two
    blocks, the paper's last-15%-of-blocks rule keeps one of them: a "bf16 vs nvfp4"
    comparison there trains about half of the GEMM work in NVFP4, and the table says so).

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

    seeds = {r.get("seed") for r in results}
    base = {}
    for r in results:  # the BF16 run of the same seed (or of any seed, when none has one)
        if r["recipe"] == "bf16":
            base.setdefault(r.get("seed"), val(r))
            base.setdefault("any", val(r))
    lines = ["| recipe | final val loss | gap to bf16 | final train loss | tokens/s | policy | "
             "BF16 GEMM work |", "|---|---|---|---|---|---|---|"]
    for r in results:
        v, s, shown = val(r)
        b = base.get(r.get("seed"), base.get("any", (None, None, "")))
        gap = (f"{100 * (v - b[0]) / b[0]:+.2f}%"
               if b[0] and v is not None and s == b[1] else "n/a")
        label = r.get("spec") or r["recipe"]
        label += f" [seed {r.get('seed')}]" if len(seeds) > 1 else ""
        tps = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "n/a"
        frac = r.get("bf16_gemm_fraction")
        share = "n/a" if frac is None else f"{100 * frac:.0f}%"
        lines.append(f"| {label} | {shown} | {gap} | {fmt(r.get('final_train_loss'))} | {tps} "
                     f"| {r.get('policy', '')} | {share} |")
    return "\n".join(lines)


def recipe_colors(labels: Sequence[str]) -> dict[str, str]:
    """One matplotlib colour per recipe label (``C0``, ``C1``, ... in first-seen order), the
    same in every panel of a figure (a panel that skips a recipe keeps the others')."""
    return {lab: f"C{i % 10}" for i, lab in enumerate(dict.fromkeys(labels))}


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
    results = [r for r in results if r.get("history", {}).get("step")]  # failed: no curves
    if not results:
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

    colors = recipe_colors([r.get("spec") or r["recipe"] for r in results])
    for r in results:
        h = r["history"]
        label = r.get("spec") or r["recipe"]
        c = colors[label]  # one colour per recipe in every panel
        ax1.plot(h["step"], ema(h["loss"]), label=label, color=c)
        _mark_switch(r, (ax1, ax2), c)
        v = r.get("final_val_loss")
        v = r.get("last_val_loss") if v is None else v
        ax2.plot(h["val_step"], h["val_loss"], marker="o", ms=3, color=c,
                 label=f"{label} ({'n/a' if v is None else f'{v:.4f}'})")
        if ncols == 3 and r is not base and h["step"] == base["history"]["step"]:
            gap = 100 * (ema(h["loss"]) / ema(base["history"]["loss"]) - 1)
            axes[2].plot(h["step"], gap, label=label, color=c)
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
