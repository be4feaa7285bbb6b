"""Heat map (layer x step) of one per-layer quantization statistic of a training run.

Reads the ``"stats"`` records that ``fp4jax-train --stats-every N`` writes to
``RUN_DIR/metrics.jsonl`` (``fp4jax.diagnostics.read_stats``; a committed run's, packed in
its campaign's ``records.tar.xz``, through ``pack_results.py``) and draws one statistic for
every measured layer (rows, in the records' order: by block, then q, k, v, o, up, down)
and stats step (columns)::

    python experiments/stats_heatmap.py runs/nvfp4                      # wgrad.rel_error
    python experiments/stats_heatmap.py runs/nvfp4 --stat fprop.lhs.underflow --log
    python experiments/stats_heatmap.py runs/nvfp4 --stat dgrad.rel_error --out dgrad.png

``--stat`` is ``GEMM.NAME``: the GEMM (``fprop``, ``dgrad``, ``wgrad``) and a statistic of
``fp4jax.diagnostics.gemm_stats``: ``rel_error`` (``rel_err`` also works) or an operand's
``lhs.``/``rhs.`` ``underflow``, ``saturation``, ``scale_min``, ``scale_max``, ``amax``.
Cells of a layer absent at a step (e.g. after a precision switch) are blank. Writes
``RUN_DIR/stats_<stat>.png`` unless ``--out`` says otherwise. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # also when loaded by path (tests)
    sys.path.insert(1, str(Path(__file__).resolve().parent))
import pack_results  # noqa: E402  (experiments/pack_results.py)

from fp4jax.diagnostics import read_stats  # noqa: E402

GEMMS = ("fprop", "dgrad", "wgrad")


def parse_stat(stat: str) -> tuple[str, str]:
    """``"wgrad.rel_err"`` -> ``("wgrad", "rel_error")``; ``"fprop.lhs.amax"`` ->
    ``("fprop", "lhs.amax")``.

    Raises:
      ValueError: not ``GEMM.NAME`` with a known GEMM.
    """
    gemm, _, name = stat.partition(".")
    if gemm not in GEMMS or not name:
        raise ValueError(f"--stat {stat!r}: give GEMM.NAME with GEMM one of {list(GEMMS)}, "
                         "e.g. wgrad.rel_error or fprop.lhs.underflow")
    return gemm, "rel_error" if name == "rel_err" else name


def _stats_records(run: str | Path) -> list[dict]:
    """``fp4jax.diagnostics.read_stats`` of the run, or, for a committed run whose
    ``metrics.jsonl`` is packed in its campaign's ``records.tar.xz``, the same records read
    from the archive."""
    p = Path(run)
    if not (p / "metrics.jsonl").is_file() and pack_results.has_records(p):
        return [r for r in pack_results.read_records(p)
                if r.get("type") == "stats" and "layers" in r]
    return read_stats(run)


def stat_matrix(run: str | Path, stat: str
                ) -> tuple[list[str], list[int], list[list[float]]]:
    """``(layers, steps, values)`` of ``stat`` in the run's stats records: ``values[i][j]``
    is layer ``layers[i]`` at step ``steps[j]`` (NaN where the layer was not measured).

    Raises:
      ValueError: no stats records, or no layer has ``stat`` (the message lists those that
        exist).
    """
    gemm, name = parse_stat(stat)
    recs = _stats_records(run)
    if not recs:
        raise ValueError(f"{run}: no 'stats' records in metrics.jsonl (train with "
                         "fp4jax-train --stats-every N)")
    layers = list(dict.fromkeys(n for r in recs for n in r["layers"]))  # as recorded
    steps = [r["step"] for r in recs]
    values = [[float(r["layers"].get(n, {}).get(gemm, {}).get(name, math.nan)) for r in recs]
              for n in layers]
    if all(math.isnan(v) for row in values for v in row):
        have = sorted({f"{g}.{k}" for r in recs for s in r["layers"].values()
                       for g, d in s.items() for k in d})
        raise ValueError(f"--stat {stat!r}: no layer has it; recorded: {', '.join(have)}")
    return layers, steps, values


def plot(run: str | Path, stat: str = "wgrad.rel_error", out: str | Path | None = None,
         log: bool = False) -> Path:
    """Draws the heat map of ``stat`` for the run in ``run`` and saves it; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LogNorm

    layers, steps, values = stat_matrix(run, stat)
    gemm, name = parse_stat(stat)
    base = Path(run) if Path(run).is_dir() else Path(run).parent
    v = np.asarray(values, dtype=np.float64)
    v[~np.isfinite(v)] = np.nan
    norm = None
    if log:
        pos = v[v > 0]
        norm = LogNorm(pos.min(), pos.max()) if pos.size else None
        v = np.where(v > 0, v, np.nan)
    fig, ax = plt.subplots(figsize=(max(5.0, 0.35 * len(steps) + 3),
                                    max(3.0, 0.22 * len(layers) + 1.5)))
    im = ax.imshow(v, aspect="auto", interpolation="nearest", cmap="viridis", norm=norm)
    ax.set_yticks(range(len(layers)), layers, fontsize=7)
    every = max(1, len(steps) // 20)
    ax.set_xticks(range(0, len(steps), every), [str(s) for s in steps[::every]], fontsize=7)
    ax.set_xlabel("step")
    ax.set_ylabel("layer")
    ax.set_title(f"{base.name}: {stat}", fontsize=9)
    fig.colorbar(im, ax=ax, label=stat)
    fig.tight_layout()
    path = Path(out) if out else base / f"stats_{gemm}.{name}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dir", help="run directory (holds metrics.jsonl) or the file itself")
    p.add_argument("--stat", default="wgrad.rel_error",
                   help="GEMM.NAME, e.g. wgrad.rel_error, dgrad.lhs.underflow, fprop.rhs.amax")
    p.add_argument("--out", default=None, help="PNG path (default RUN_DIR/stats_<stat>.png)")
    p.add_argument("--log", action="store_true", help="logarithmic colour scale")
    args = p.parse_args(argv)
    try:
        path = plot(args.run_dir, args.stat, args.out, args.log)
    except (ValueError, OSError) as e:
        print(f"stats_heatmap: error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
