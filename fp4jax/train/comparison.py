"""Comparing recipes: ``compare`` trains each recipe on the same data and seed and writes
``compare.md``, ``compare.json`` and ``compare.png``; ``comparison_table`` (the markdown table
of final losses and gaps to BF16) and ``plot_losses`` (the loss curves; matplotlib is optional
and imported on first use) also work on results loaded from ``result.json`` files.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

import fp4jax.recipes
from fp4jax.data import ByteDataset
from fp4jax.train.config import TrainConfig, validate_config
from fp4jax.train.loop import train
from fp4jax.train.rundir import RunExists, check_out, refusal, run_contents


def compare(cfg: TrainConfig, recipes: Sequence[str]) -> list[dict]:
    """Trains each recipe on the same data and seed into ``OUT/<recipe>/``; writes the plot
    and the table (``compare.*``, regenerated from the runs' results).

    Every sub-run is checked before anything trains: without ``resume`` one that holds a run
    is refused (``RunExists``) unless ``overwrite`` (then each is moved aside by ``train``);
    with ``resume`` each sub-run resumes, and one that never started starts afresh.
    """
    if not recipes:
        raise ValueError("compare: no recipe names given")
    for r in recipes:  # validate every name before training anything
        fp4jax.recipes.get(r)
    validate_config(cfg)
    check_out(cfg.out)
    out = Path(cfg.out)
    subs = {r: cfg.replace(recipe=r, out=str(out / r), compare=None) for r in recipes}
    if cfg.resume:
        for r, sub in subs.items():
            if not run_contents(sub.out):
                print(f"fp4jax-train: --resume: {sub.out} holds no run yet: {r} starts afresh",
                      file=sys.stderr, flush=True)
                subs[r] = sub.replace(resume=False, resume_override=None)
    elif not cfg.overwrite:
        taken = {r: run_contents(sub.out) for r, sub in subs.items()}
        taken = {r: found for r, found in taken.items() if found}
        if taken:
            first = next(iter(taken))
            raise RunExists(refusal(subs[first].out, taken[first])
                            + (f" (also: {', '.join(subs[r].out for r in list(taken)[1:])})"
                               if len(taken) > 1 else ""))
    ds = ByteDataset.load(cfg.data, cfg.seq_len, cfg.val_fraction, cfg.cache_dir)
    results = []
    for r in recipes:
        results.append(train(subs[r], ds))
    table = comparison_table(results)
    (out / "compare.md").write_text(table + "\n")
    (out / "compare.json").write_text(json.dumps(
        [{k: v for k, v in r.items() if k != "history"} for r in results], indent=1))
    plot_path = plot_losses(results, out / "compare.png")
    print(table)
    print(f"wrote {out / 'compare.md'}" + (f", {plot_path}" if plot_path else ""))
    return results


def comparison_table(results: Sequence[dict]) -> str:
    """A markdown table: final validation loss and its relative gap to the BF16 run.

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

    base = next((val(r) for r in results if r["recipe"] == "bf16"), (None, None, ""))
    lines = ["| recipe | final val loss | gap to bf16 | final train loss | tokens/s | policy |",
             "|---|---|---|---|---|---|"]
    for r in results:
        v, s, shown = val(r)
        gap = (f"{100 * (v - base[0]) / base[0]:+.2f}%"
               if base[0] and v is not None and s == base[1] else "n/a")
        tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "n/a"
        lines.append(f"| {r['recipe']} | {shown} | {gap} | {fmt(r['final_train_loss'])} | {tps} "
                     f"| {r['policy']} |")
    return "\n".join(lines)


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

    for r in results:
        h = r["history"]
        ax1.plot(h["step"], ema(h["loss"]), label=r["recipe"])
        v = r.get("final_val_loss")
        v = r.get("last_val_loss") if v is None else v
        ax2.plot(h["val_step"], h["val_loss"], marker="o", ms=3,
                 label=f"{r['recipe']} ({'n/a' if v is None else f'{v:.4f}'})")
        if ncols == 3 and r is not base and h["step"] == base["history"]["step"]:
            gap = 100 * (ema(h["loss"]) / ema(base["history"]["loss"]) - 1)
            axes[2].plot(h["step"], gap, label=r["recipe"])
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
