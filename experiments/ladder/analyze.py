"""Rebuilds every table and plot of the scale ladder (issue 36) from the committed results.

    python experiments/ladder/analyze.py            # TABLES.md, plots, experiments/README.md
    python experiments/ladder/analyze.py --check    # CI: the committed tables are current

Reads every ``result.json`` under ``experiments/results/ladder/runs/``, loose (a fresh
run) or packed in ``runs/records.tar.xz`` (``experiments/pack_results.py --raw``), both
alike (``sweep/<size>/lr<lr>`` and ``ladder/<size>/<slug>/seed<s>``; the loss curves are in each
``result.json``'s ``history``; a superseded rung, ``spec.ARCHIVED``, under ``ladder/<its
key>/``, is tabled and plotted as a rung of its own) and writes
``experiments/results/ladder/TABLES.md`` (setup; the LR sweep; per size, every row's final
validation loss as mean ± sample std over seeds, its gap to BF16, the paired difference to
BF16 over the shared seeds ± its standard error, absolute and relative
(``fp4jax.train.comparison.paired_difference``), and tokens/s), the plots
``gap_vs_size.png`` (the paired relative gap of NVFP4 and MXFP4 to BF16 against
non-embedding parameters, ± SE bars and each seed's gap), ``curves_<size>.png`` (validation
loss per recipe, mean and min-max band) and ``gap_over_training.png`` (the paired relative
validation-loss gap at every evaluation), and the tables block of ``experiments/README.md``
between its ``ladder:begin``/``ladder:end`` markers. Rows with no finished run say
"pending". ``--check`` exits 1 when ``TABLES.md`` or the README block differ from what the
results give (the plots are not compared).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for p in (str(ROOT), str(HERE), str(HERE.parent)):
    if p not in sys.path:
        sys.path.insert(0, p)

import pack_results  # noqa: E402
import spec as S  # noqa: E402

from fp4jax.train.comparison import paired_cells, paired_difference, summarize  # noqa: E402

RESULTS = ROOT / "experiments" / "results" / "ladder"
README = ROOT / "experiments" / "README.md"
BEGIN, END = "<!-- ladder:begin (experiments/ladder/analyze.py) -->", "<!-- ladder:end -->"


def load(results: Path) -> dict[str, dict]:
    """``{name: result}`` of every finished or diverged run under ``results/runs``, its
    ``result.json`` loose or packed (``pack_results.find``: a loose file and the packed one
    of the same run are one, the loose one read)."""
    out = {}
    root = (results / "runs").resolve()
    for f in pack_results.find(root, "result.json") if root.is_dir() else []:
        try:
            r = json.loads(pack_results.read_text(f.parent, f.name))
        except ValueError:
            continue
        if r.get("status") in ("finished", "diverged"):
            out[f.parent.relative_to(root).as_posix()] = r
    return out


def _f(x: float | None, fmt: str = ".4f") -> str:
    return "n/a" if x is None or not math.isfinite(x) else format(x, fmt)


def rungs(res: dict[str, dict]) -> list[str]:
    """The sizes (``spec.SIZES``), then the superseded rungs (``spec.ARCHIVED``) that have
    runs: the keys tabled and plotted."""
    return [*S.SIZES, *(k for k in S.ARCHIVED if size_runs(res, k))]


def rung_size(key: str) -> str:
    """The size (``spec.SIZES`` key) whose rows and LR a rung has."""
    return S.ARCHIVED[key]["size"] if key in S.ARCHIVED else key


def size_runs(res: dict[str, dict], size: str) -> list[dict]:
    """The ladder runs of ``size``, each with ``spec`` and ``seed``."""
    out = []
    for name, r in res.items():
        parts = name.split("/")
        if parts[0] == "ladder" and len(parts) == 4 and parts[1] == size:
            out.append({**r, "spec": r.get("spec") or r["recipe"]})
    return out


def size_summary(res: dict[str, dict], size: str) -> dict | None:
    """``fp4jax.train.comparison.summarize`` of ``size``'s runs against BF16 (None: none)."""
    runs = size_runs(res, size)
    if not runs:
        return None
    order = {sp: i for i, (_, sp, _, _) in enumerate(S.ROWS)}
    runs.sort(key=lambda r: (order.get(r["spec"], 99), r["seed"]))
    return summarize(runs, baseline=S.BASELINE)


def chosen_lrs(res: dict[str, dict]) -> dict[str, tuple[float, float] | None]:
    """Per size the sweep's (lr, final val loss) of the lowest loss, None while pending."""
    out = {}
    for size in S.SIZES:
        rows = [(res[r["name"]].get("final_val_loss"), r["lr"]) for r in S.runs("sweep", (size,))
                if r["name"] in res]
        done = len(rows) == len(S.SWEEP[size])
        rows = [(v, lr) for v, lr in rows if v is not None]
        out[size] = (min(rows)[1], min(rows)[0]) if done and rows else None
    return out


def tables(res: dict[str, dict]) -> tuple[str, str]:
    """(``TABLES.md``, the README block)."""
    lrs = chosen_lrs(res)
    n_runs = sum(1 for n in res if n.startswith("ladder/"))
    dev = sorted({r.get("device_kind", "?") for r in res.values()})
    head = [f"{n_runs} ladder runs and {len(res) - n_runs} LR-sweep runs"
            + (f" on {', '.join(dev)}" if dev else "")
            + "; final validation loss in nats per token (BPE 16384 on Python source code, "
              f"{S.VAL_TOKENS / 1e6:.2f}M held-out tokens of held-out files). Paired: per "
              "seed (same initialization, data order and SR draws) loss minus the BF16 loss "
              "of that seed, mean ± standard error (std(d, ddof=1)/sqrt(n)); unpaired: mean "
              "± sample std.", ""]
    setup = ["| size | preset | non-embedding params | embedding params | tokens | "
             "tokens / non-emb. param | steps | peak LR (BF16 sweep) |",
             "|---|---|---|---|---|---|---|---|"]
    for size in rungs(res):
        cfg = S.SIZES.get(size) or S.ARCHIVED[size]
        pc = S.param_counts(size)
        lr = lrs[rung_size(size)]
        setup.append(f"| {size} | `{cfg['preset']}` | {pc['non_embedding'] / 1e6:.2f}M | "
                     f"{pc['embedding'] / 1e6:.2f}M | {S.tokens(size) / 1e6:.1f}M | "
                     f"{S.tokens(size) / pc['non_embedding']:.1f} | {cfg['steps']} | "
                     + ("pending" if lr is None else f"{lr[0]:g}") + " |")
    sweep = ["| size | peak LR | steps | final val loss |", "|---|---|---|---|"]
    for r in S.runs("sweep"):
        x = res.get(r["name"])
        loss = "pending" if x is None else (
            _f(x.get("final_val_loss")) if x["status"] == "finished" else "diverged")
        steps = "" if x is None else str(x.get("steps", ""))
        sweep.append(f"| {r['size']} | {r['lr']:g} | {steps} | {loss} |")
    per_size = []
    short = []
    for size in rungs(res):
        agg = size_summary(res, size)
        rows_here = [(lab, sp, se) for lab, sp, se, wh in S.ROWS if rung_size(size) in wh]
        if size in S.ARCHIVED:  # only the rows it ran
            rows_here = [x for x in rows_here if any(r["spec"] == x[1]
                                                     for r in size_runs(res, size))]
        by = {x["recipe"]: x for x in agg["summary"]} if agg else {}
        pc = S.param_counts(size)
        name = S.ARCHIVED[size]["label"] if size in S.ARCHIVED else size
        title = (f"### {name} ({pc['non_embedding'] / 1e6:.1f}M non-embedding parameters, "
                 f"{S.tokens(size) / 1e6:.0f}M tokens)")
        t = [title, "", "| row | spec | seeds | final val loss (mean ± std) | gap vs BF16 "
             "(means) | paired diff vs BF16 ± SE | paired rel. ± SE | tokens/s |",
             "|---|---|---|---|---|---|---|---|"]
        for lab, sp, seeds in rows_here:
            x = by.get(sp)
            if x is None or not x["n"]:
                t.append(f"| {lab} | `{sp}` | 0 of {len(seeds)} | pending | | | | |")
                continue
            std = _f(x["std"]) if x["n"] > 1 else "n/a"
            gap = ("" if x["gap_vs_baseline"] is None or sp == S.BASELINE
                   else f"{100 * x['gap_vs_baseline']:+.2f}%")
            pd, pr = ("", "") if sp == S.BASELINE else paired_cells(x["paired"])
            tps = "n/a" if not x["tokens_per_s"] else f"{x['tokens_per_s']:,.0f}"
            t.append(f"| {lab} | `{sp}` | {x['n']} of {len(seeds)} | {_f(x['mean'])} ± {std} "
                     f"| {gap} | {pd} | {pr} | {tps} |")
        per_size += t + [""]
        short += t + [""]
    md = ["# Scale ladder: BF16 vs NVFP4 vs MXFP4 at three sizes (issue 36)", "",
          "Rebuilt by `python experiments/ladder/analyze.py` from `runs/`; setup and "
          "discussion in [experiments/README.md](../../README.md#scale-ladder-issue-36).", "",
          *head, "## Setup", "", *setup, "", "## BF16 learning-rate sweep (seed 0)", "",
          "The ladder trains each size at the LR of the lowest final loss.", "", *sweep, "",
          "## Final validation loss per size", "", *per_size]
    if any(f"ladder/{s}" in n for n in res for s in rungs(res)):
        md += ["![gap vs size](gap_vs_size.png)", "",
               "![gap over training](gap_over_training.png)", ""]
        md += [f"![{s}](curves_{s}.png)" for s in rungs(res)
               if any(n.startswith(f"ladder/{s}/") for n in res)] + [""]
    readme = [*head, *setup, "", *short]
    return "\n".join(md).rstrip() + "\n", "\n".join(readme).rstrip()


# ------------------------------------------------------------------------------ plots


def _val_curve(r: dict) -> tuple[list[int], list[float]]:
    h = r.get("history", {})
    return list(h.get("val_step", [])), list(h.get("val_loss", []))


def plots(res: dict[str, dict], where: Path) -> list[Path]:
    """The three kinds of plots (module docstring); matplotlib is optional."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError:
        print("matplotlib is not installed: no plots", file=sys.stderr)
        return []
    made = []
    colors = {sp: f"C{i}" for i, (_, sp, _, _) in enumerate(S.ROWS)}
    labels = {sp: lab for lab, sp, _, _ in S.ROWS}
    # 1. the paired relative gap vs size
    fig, ax = plt.subplots(figsize=(6, 4))
    drew = False
    for sp in ("nvfp4", "mxfp4"):
        for key in [k for k in rungs(res) if k in S.ARCHIVED]:  # hollow, beside the ladder
            runs = size_runs(res, key)
            base = {r["seed"]: r.get("final_val_loss") for r in runs if r["spec"] == S.BASELINE}
            mine = {r["seed"]: r.get("final_val_loss") for r in runs if r["spec"] == sp}
            p = paired_difference(base, mine)
            if p["rel_mean"] is None:
                continue
            n = S.param_counts(key)["non_embedding"] * 1.04  # nudged right, to be seen
            ax.errorbar([n], [100 * p["rel_mean"]], yerr=[100 * (p["rel_se"] or 0.0)],
                        marker="o", mfc="none", ls="none", capsize=3, color=colors[sp],
                        label=f"{labels[sp]}, {key} (superseded)")
        xs, ys, es = [], [], []
        for size in S.SIZES:
            runs = size_runs(res, size)
            base = {r["seed"]: r.get("final_val_loss") for r in runs if r["spec"] == S.BASELINE}
            mine = {r["seed"]: r.get("final_val_loss") for r in runs if r["spec"] == sp}
            p = paired_difference(base, mine)
            if p["rel_mean"] is None:
                continue
            n = S.param_counts(size)["non_embedding"]
            xs.append(n)
            ys.append(100 * p["rel_mean"])
            es.append(100 * (p["rel_se"] or 0.0))
            for s in p["seeds"]:
                ax.plot(n, 100 * (mine[s] - base[s]) / base[s], ".", color=colors[sp], alpha=0.4)
        if xs:
            drew = True
            ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, color=colors[sp],
                        label=f"{labels[sp]} (mean ± SE; dots: seeds)")
            ax.fill_between(xs, np.array(ys) - es, np.array(ys) + es, color=colors[sp],
                            alpha=0.15)
    if drew:
        ax.axhline(0, color="k", lw=0.8)
        ax.set(xscale="log", xlabel="non-embedding parameters",
               ylabel="final val loss vs BF16 (%, paired by seed)",
               title="FP4 loss gap vs model size")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(where / "gap_vs_size.png", dpi=110)
        made.append(where / "gap_vs_size.png")
    plt.close(fig)
    # 2. validation curves per size, 3. the paired gap over training
    sizes = [s for s in rungs(res) if size_runs(res, s)]
    if sizes:
        fig2, axes2 = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4), squeeze=False)
        for ax, size in zip(axes2[0], sizes, strict=True):
            runs = size_runs(res, size)
            base = {r["seed"]: _val_curve(r) for r in runs if r["spec"] == S.BASELINE}
            for sp in dict.fromkeys(r["spec"] for r in runs):
                if sp == S.BASELINE:
                    continue
                mine = {r["seed"]: _val_curve(r) for r in runs if r["spec"] == sp}
                gaps = []
                for s, (st, vl) in mine.items():
                    if s in base and base[s][0] == st and st:
                        gaps.append((st, 100 * (np.array(vl) / np.array(base[s][1]) - 1)))
                if gaps:
                    st = gaps[0][0]
                    g = np.array([x for _, x in gaps if len(x) == len(st)])
                    ax.plot(st, g.mean(0), marker="o", ms=3, color=colors.get(sp),
                            label=f"{labels.get(sp, sp)} (n={len(g)})")
                    if len(g) > 1:
                        se = g.std(0, ddof=1) / np.sqrt(len(g))
                        ax.fill_between(st, g.mean(0) - se, g.mean(0) + se,
                                        color=colors.get(sp), alpha=0.2)
            ax.axhline(0, color="k", lw=0.8)
            ax.set(xlabel="step", ylabel="val loss vs BF16 (%, paired)", title=size)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig2.suptitle("paired val-loss gap over training (mean ± SE)")
        fig2.tight_layout()
        fig2.savefig(where / "gap_over_training.png", dpi=110)
        plt.close(fig2)
        made.append(where / "gap_over_training.png")
    for size in sizes:
        runs = size_runs(res, size)
        fig3, ax = plt.subplots(figsize=(6.5, 4.5))
        lo = math.inf
        for sp in dict.fromkeys(r["spec"] for r in runs):
            curves = [_val_curve(r) for r in runs if r["spec"] == sp]
            st = curves[0][0]
            ys = np.array([vl for s2, vl in curves if s2 == st])
            if not len(st) or not len(ys):
                continue
            ax.plot(st, ys.mean(0), marker="o", ms=3, color=colors.get(sp),
                    label=f"{labels.get(sp, sp)} (n={len(ys)})")
            ax.fill_between(st, ys.min(0), ys.max(0), color=colors.get(sp), alpha=0.2)
            lo = min(lo, float(ys.min()))
        if math.isfinite(lo):
            ax.set_ylim(lo - 0.05, lo + 1.5)
        ax.set(xlabel="step", ylabel="val loss (nats/token)",
               title=f"{size}: validation loss, mean and min-max over seeds")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig3.tight_layout()
        fig3.savefig(where / f"curves_{size}.png", dpi=110)
        plt.close(fig3)
        made.append(where / f"curves_{size}.png")
    return made


def splice(readme: str, block: str) -> str:
    """``readme`` with the text between ``BEGIN`` and ``END`` replaced by ``block``."""
    a, b = readme.index(BEGIN), readme.index(END)
    return readme[:a + len(BEGIN)] + "\n" + block + "\n" + readme[b:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", default=str(RESULTS))
    p.add_argument("--readme", default=str(README))
    p.add_argument("--check", action="store_true",
                   help="exit 1 when TABLES.md or the README block are not current")
    p.add_argument("--no-plots", action="store_true")
    a = p.parse_args(argv)
    results, readme = Path(a.results), Path(a.readme)
    res = load(results)
    md, block = tables(res)
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        print(f"{readme}: no {BEGIN} ... {END} markers", file=sys.stderr)
        return 1
    new_readme = splice(text, block)
    if a.check:
        stale = []
        if not (results / "TABLES.md").is_file() or (results / "TABLES.md").read_text() != md:
            stale.append(str(results / "TABLES.md"))
        if new_readme != text:
            stale.append(f"{readme} (ladder block)")
        if stale:
            print("not current: " + ", ".join(stale)
                  + "; run python experiments/ladder/analyze.py", file=sys.stderr)
            return 1
        print(f"ladder tables current ({len(res)} runs)")
        return 0
    results.mkdir(parents=True, exist_ok=True)
    (results / "TABLES.md").write_text(md)
    readme.write_text(new_readme)
    made = [] if a.no_plots else plots(res, results)
    print(f"wrote {results / 'TABLES.md'}, the {readme.name} block"
          + (f", {', '.join(x.name for x in made)}" if made else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
