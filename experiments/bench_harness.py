"""``fp4jax-train``'s training loop against a bare jitted loop of the very same step, in one
process (issue 56 item 5: the harness within 3% of a bare loop).

For each configuration (``--configs``, default ``bf16 nvfp4``: recipe specs as
``fp4jax-train --recipe`` takes them) at ``--preset`` (default ``small``), ``--batch-size``
x ``--seq-len`` (default 64 x 256), on uniform random bytes, this process:

1. builds the run's jitted functions exactly as ``fp4jax.train.train`` does
   (``loop.run_mesh``, ``loop.build_models``, ``loop.compiled_steps``): the step function
   here *is* the harness's (the same jitted object, shared through the loop's step cache:
   ``train`` below finds it there and compiles nothing for its train step; ``retraced``
   in the JSON says whether the train step was traced again after the first bare run);
2. **bare**: the initial state ``fns["init"](root)``, the run's ``--steps`` batches built
   by the dataset and put on the device before timing, then the step called back to back
   with the state threaded through (donated), no logging, no metrics read; after
   ``--warmup`` steps (compilation, first-step costs), windows of ``--window`` steps (40)
   each ended by one wait for the last step's metrics: ``tokens_per_s`` is the median over
   the windows (``overall_tokens_per_s``: all of them together);
3. **harness**: ``fp4jax.train.train(cfg, dataset=...)`` in a temporary ``--out`` with
   ``TrainConfig``'s defaults (what ``fp4jax-train`` runs: the progress bar, validation
   every 20 steps on 4 batches, a ``"train"`` record every 10 steps, a checkpoint at the
   end) for the same ``--steps``: ``tokens_per_s`` is the median of the ``"train"``
   records' windows (the loop's own clock: wall time between the host reading the
   metrics of one record's step and the next, evaluations taken out), windows covering a
   step before ``--warmup`` left out; ``result_tokens_per_s`` is ``result.json``'s;
4. the same with other settings (``--variants``, default all): **lean** (validation only
   after the last step, no progress bar: the loop alone, without the pipeline drain an
   evaluation costs), **deep** (lean with ``loop.IN_FLIGHT`` and ``loop.PREFETCH`` 4
   instead of 2: whether more slack helps), **sync** (lean with both 0: each batch built
   when its step needs it and each step's metrics read right after its dispatch, about
   the loop before it was pipelined). Each harness run also reports ``host``, from the
   loop's reads of each step's metrics (``processes.host_value``, wrapped here): the
   waits there (a median well above zero: the host waited for the device, which then
   had the steps in flight queued), the wall time between reads (``tokens_per_s`` from
   it: a clock outside the loop's own, evaluations *not* taken out, so below the loop's
   for ``harness``; ``ratios_host_clock``) and the main thread's CPU milliseconds
   between reads (the host's own work per step; the bare loop's
   ``host_cpu_ms_per_step`` beside it).

Bare and harness runs alternate ``--repeats`` times (default 3); each row reports the
median of the repeats and ``ratios`` (each variant's tokens/s over the bare loop's;
``ratio`` the first variant's, ``harness`` by default: the issue's number). The bare
run's last loss is put beside each variant's record of the same step (``same_losses``:
the same step, data, initial state and keys give the same loss; on a GPU the reductions'
order may differ run to run, so it is informational).

Writes ``bench_harness.json`` to ``--out`` (default ``$OUT``, else ``./bench_out``) after
every configuration (``lab.run_info``: device, JAX version, commit from
``FP4JAX_COMMIT``, command) and prints one summary line per configuration and a last
``bench_harness:`` line. ``--time-limit S`` starts no repeat or configuration past S
seconds.

GPU (one H100; not yet run there: about 5 min estimated from issue 56's step times and
compile seconds, ~1.5 min BF16 and ~3.5 min NVFP4 with its cold compile, each 3 repeats of
a bare run and 4 harness runs of 300 steps; ``--time-limit`` starts no repeat past it):

    FP4JAX_COMMIT=<sha> PYTHONPATH=$PWD python3 experiments/bench_harness.py \\
        --out $OUT --time-limit 400

CPU (a check of the script; the numbers say little about a GPU):

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python3 experiments/bench_harness.py \\
        --preset micro --batch-size 4 --seq-len 32 --steps 20 --warmup 4 --window 4 \\
        --repeats 1 --configs bf16 --variants harness lean
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import lab  # before fp4jax: puts the repository root on sys.path
import numpy as np

TAG = "BENCH_HARNESS "


def dataset(batch_size: int, seq_len: int, steps: int, eval_batches: int, seed: int = 0):
    """Uniform random bytes, enough that ``steps`` batches do not wrap an epoch."""
    from fp4jax.train.data import ByteDataset

    rng = np.random.default_rng(seed)
    n_train = (steps + 1) * batch_size * seq_len + seq_len + 1
    n_val = max(eval_batches, 1) * batch_size * seq_len + seq_len + 1
    return ByteDataset(rng.integers(0, 256, n_train, dtype=np.uint8),
                       rng.integers(0, 256, n_val, dtype=np.uint8), seq_len)


def harness_functions(cfg, ds) -> tuple[dict, Any, Any]:
    """The jitted functions ``train(cfg, dataset=ds)`` runs, built as it builds them (shared
    with it through the loop's step cache). Returns ``(fns, mesh, root key)``."""
    from fp4jax.train import config, loop

    config.validate_config(cfg)
    rcfg, recipe = config.run_recipe(cfg)
    mesh = loop.run_mesh(cfg, rcfg)
    ds = loop.load_data(cfg, ds)
    rm = loop.build_models(cfg, rcfg, recipe, ds)
    root = jax.random.key(cfg.seed)
    fns, _ = loop.compiled_steps(cfg, rm, recipe, mesh, root)
    return fns, mesh, root


def bare(fns: dict, mesh, root, cfg, ds, steps: int, warmup: int, window: int) -> dict:
    """The harness's train step in a bare loop: data on the device beforehand, no logging."""
    from jax.sharding import NamedSharding

    from fp4jax.train import parallel

    sharding = NamedSharding(mesh, parallel.BATCH)
    batches = [jax.device_put(ds.train_batch(s, cfg.batch_size, cfg.seed), sharding)
               for s in range(steps)]
    jax.block_until_ready(batches)
    step = fns["train"][False]
    sr_key = jax.random.fold_in(root, 1)  # as train's
    state = fns["init"](root)
    tokens = cfg.batch_size * cfg.seq_len
    t = time.perf_counter()
    for s in range(warmup):
        state, m = step(state, batches[s], sr_key)
    jax.block_until_ready((state, m))
    warm_s = time.perf_counter() - t
    windows, s = [], warmup
    t_all, cpu = time.perf_counter(), time.thread_time()
    while s + window <= steps:
        t = time.perf_counter()
        for i in range(s, s + window):
            state, m = step(state, batches[i], sr_key)
        # the step's outputs are ready together: its metrics stand for the state (cheaper
        # to wait on than every leaf of the state)
        jax.block_until_ready(m)
        windows.append(window * tokens / (time.perf_counter() - t))
        s += window
    total_s = time.perf_counter() - t_all
    cpu = time.thread_time() - cpu
    last_loss = float(m["loss"])
    del state, batches
    return {"tokens_per_s": statistics.median(windows), "windows": windows,
            "overall_tokens_per_s": (s - warmup) * tokens / total_s, "warmup_s": warm_s,
            "host": {"host_cpu_ms_per_step": 1e3 * cpu / max(s - warmup, 1)},
            "steps": s, "last_step": s - 1, "last_loss": last_loss}


# Harness variants: (TrainConfig overrides, loop constants {IN_FLIGHT, PREFETCH} or None)
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, int] | None]] = {
    # what fp4jax-train runs: progress bar, validation every 20 steps, a record every 10
    "harness": ({}, None),
    # the loop alone: validation only after the last step, no progress bar
    "lean": ({"eval_every": 0, "progress": False}, None),
    # lean with a deeper pipeline: does more slack help?
    "deep": ({"eval_every": 0, "progress": False}, {"IN_FLIGHT": 4, "PREFETCH": 4}),
    # lean without pipelining (each batch built when its step needs it, each step's
    # metrics read right after its dispatch): about the loop before it was pipelined
    "sync": ({"eval_every": 0, "progress": False}, {"IN_FLIGHT": 0, "PREFETCH": 0}),
}


class HostClock:
    """Times the loop's reads of a step's metrics (``processes.host_value`` of a dict with
    ``"loss"``; evaluation's reads are not counted) while active: how long the host waited
    for the device there, the wall time between reads (a clock outside the loop's own:
    one read a step) and the main thread's CPU time between them (the host's own work per
    step)."""

    def __enter__(self) -> HostClock:
        from fp4jax.train import processes

        self.calls: list[tuple[float, float, float]] = []  # (wall, cpu, waited) at return
        self.orig = processes.host_value

        def timed(x: Any) -> Any:
            t = time.perf_counter()
            v = self.orig(x)
            if isinstance(x, dict) and "loss" in x:
                now = time.perf_counter()
                self.calls.append((now, time.thread_time(), now - t))
            return v

        processes.host_value = timed
        return self

    def __exit__(self, *exc: Any) -> None:
        from fp4jax.train import processes

        processes.host_value = self.orig

    def summary(self, skip: int, tokens_per_step: int) -> dict[str, Any]:
        """Over the reads after the first ``skip`` (the last two, read back to back at the
        end, left out)."""
        c = self.calls[skip:-2]
        if len(c) < 2:
            return {"reads": len(self.calls)}
        waits = sorted(x[2] for x in c)
        n = len(c) - 1
        wall = (c[-1][0] - c[0][0]) / n
        return {"reads": len(self.calls),
                "wait_median_ms": 1e3 * statistics.median(waits),
                "wait_p10_ms": 1e3 * waits[len(waits) // 10],
                "wall_ms_per_read": 1e3 * wall,
                "tokens_per_s": tokens_per_step / wall,
                "host_cpu_ms_per_read": 1e3 * (c[-1][1] - c[0][1]) / n}


def harness(cfg, ds, warmup: int, variant: str = "harness") -> dict:
    """``fp4jax.train.train`` on ``ds`` with ``cfg`` (and ``VARIANTS[variant]``) in a
    temporary ``--out``: the median tokens/s of its ``"train"`` records' windows past
    ``warmup``, and ``HostClock``'s summary."""
    from fp4jax.train import loop, train

    overrides, consts = VARIANTS[variant]
    saved = {k: getattr(loop, k) for k in consts or {}}
    try:
        for k, v in (consts or {}).items():
            setattr(loop, k, v)
        with tempfile.TemporaryDirectory() as out, HostClock() as clock:
            c = cfg.replace(out=out, **overrides)
            t = time.perf_counter()
            res = train(c, dataset=ds)
            wall = time.perf_counter() - t
            recs = [json.loads(x)
                    for x in Path(out, "metrics.jsonl").read_text().splitlines()]
    finally:
        for k, v in saved.items():
            setattr(loop, k, v)
    train_recs = [r for r in recs if r.get("type") == "train"]
    # a record's window covers the steps after the record before it
    steady = [r["tokens_per_s"] for prev, r in zip(train_recs[:-1], train_recs[1:],
                                                    strict=True)
              if prev["step"] + 1 >= warmup]
    return {"tokens_per_s": statistics.median(steady) if steady else None,
            "windows": steady, "result_tokens_per_s": res["tokens_per_s"], "wall_s": wall,
            "losses": {r["step"]: r["loss"] for r in train_recs},
            "host": clock.summary(warmup, c.batch_size * c.seq_len),
            "config": {k: getattr(c, k) for k in ("eval_every", "eval_batches", "log_every",
                                                   "progress", "checkpoint_every")},
            **({"loop": consts} if consts else {})}


def _median(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def measure(args: argparse.Namespace, spec: str, deadline: float) -> dict:
    from fp4jax.train import TrainConfig
    from fp4jax.train.steps import TRACE_COUNTS

    cfg = TrainConfig(preset=args.preset, recipe=spec, steps=args.steps,
                      batch_size=args.batch_size, seq_len=args.seq_len,
                      attention=args.attention, scan_layers=args.scan_layers)
    ds = dataset(args.batch_size, args.seq_len, args.steps, cfg.eval_batches)
    row: dict[str, Any] = {"preset": args.preset, "config": spec,
                           "batch_size": args.batch_size, "seq_len": args.seq_len,
                           "tokens_per_step": args.batch_size * args.seq_len,
                           "steps": args.steps, "warmup": args.warmup,
                           "window": args.window, "attention": args.attention,
                           "scan_layers": args.scan_layers, "variants": args.variants}
    t = time.perf_counter()
    fns, mesh, root = harness_functions(cfg, ds)
    row["build_s"] = time.perf_counter() - t
    runs: dict[str, list[dict]] = {"bare": [], **{v: [] for v in args.variants}}
    traces = None
    for rep in range(args.repeats):
        if rep and time.perf_counter() > deadline:
            row["repeats_cut"] = f"stopped after {rep} repeats (--time-limit)"
            break
        runs["bare"].append(bare(fns, mesh, root, cfg, ds, args.steps, args.warmup,
                                 args.window))
        if traces is None:
            traces = TRACE_COUNTS["train"]  # after the first bare run's compilation
        for v in args.variants:
            runs[v].append(harness(cfg, ds, args.warmup, v))
        print(f"  {spec} repeat {rep}: " + ", ".join(
            f"{k} {rs[-1]['tokens_per_s'] or 0:,.0f}" for k, rs in runs.items())
            + " tokens/s", flush=True)
    row["retraced"] = TRACE_COUNTS["train"] != traces
    for k, rs in runs.items():
        row[k] = {"tokens_per_s": _median([r["tokens_per_s"] for r in rs]),
                  "runs": [{kk: v for kk, v in r.items() if kk != "losses"} for r in rs]}
    bt = row["bare"]["tokens_per_s"]
    row["ratios"] = {v: row[v]["tokens_per_s"] / bt for v in args.variants
                     if row[v]["tokens_per_s"] and bt}
    row["ratio"] = row["ratios"].get(args.variants[0])
    row["ratios_host_clock"] = {
        v: _median([r["host"].get("tokens_per_s") for r in runs[v]]) / bt
        for v in args.variants if bt and _median([r["host"].get("tokens_per_s")
                                                  for r in runs[v]])}
    b0 = runs["bare"][0]
    row["same_losses"] = {"step": b0["last_step"], "bare": b0["last_loss"],
                          **{v: runs[v][0]["losses"].get(b0["last_step"])
                             for v in args.variants if runs[v]}}
    return row


def summary(row: dict) -> str:
    return (f"{row['preset']} {row['config']}: bare {row['bare']['tokens_per_s']:,.0f} "
            "tokens/s; " + ", ".join(
                f"{v} {row[v]['tokens_per_s']:,.0f} ({row['ratios'][v]:.3f}x)"
                for v in row["variants"] if v in row["ratios"]))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--configs", nargs="+", default=["bf16", "nvfp4"],
                    help="recipe specs (default: bf16 nvfp4)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=300, help="steps of each run")
    ap.add_argument("--warmup", type=int, default=20,
                    help="first steps of each run left out of tokens/s")
    ap.add_argument("--window", type=int, default=40,
                    help="the bare loop's window, steps (each ends in one wait: the next "
                    "starts from an empty queue, a dispatch's time against the bare loop)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                    help="harness runs beside the bare loop; the first gives 'ratio' "
                    f"(default: {' '.join(VARIANTS)})")
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--scan-layers", action="store_true")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="start no repeat or configuration after this many seconds")
    ap.add_argument("--out", default=None, help="folder of bench_harness.json (default "
                    "$OUT, else ./bench_out)")
    args = ap.parse_args(argv)
    if args.steps < args.warmup + args.window:
        ap.error(f"--steps {args.steps} must be at least --warmup + --window "
                 f"({args.warmup + args.window})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    deadline = t0 + (args.time_limit if args.time_limit else float("inf"))
    out = Path(args.out or os.environ.get("OUT") or "bench_out")
    out.mkdir(parents=True, exist_ok=True)
    data = {"run": lab.run_info(__file__, sys.argv[1:] if argv is None else argv),
            "rows": []}
    path = out / "bench_harness.json"
    for spec in args.configs:
        if data["rows"] and time.perf_counter() > deadline:
            data["rows"].append({"config": spec, "status": "skipped (--time-limit)"})
            continue
        try:
            row = measure(args, spec, deadline)
            row["status"] = "ok"
            print(TAG + summary(row), flush=True)
        except Exception as e:  # noqa: BLE001 (one failed configuration stops no other)
            row = {"config": spec, "status": "error", "error": lab.error_text(e, 2000)}
            print(f"{TAG}{spec}: error {row['error']}", flush=True)
        data["rows"].append(row)
        data["elapsed_s"] = time.perf_counter() - t0
        path.write_text(json.dumps(data, indent=1, default=str))
    ok = [r for r in data["rows"] if r.get("status") == "ok"]
    print("bench_harness: " + "; ".join(
        f"{r['config']} " + " ".join(f"{v}/bare {x:.3f}" for v, x in r["ratios"].items())
        for r in ok) + f" [{data['run']['device']}, "
        f"{time.perf_counter() - t0:.0f} s] -> {path}", flush=True)
    return 0 if len(ok) == len(data["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
