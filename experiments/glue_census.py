"""Where an NVFP4 step's extra GPU kernels go, offline: the kernels of one ``profile_step.py
--hlo`` run grouped by what they do for the quantized GEMMs.

Reads ``profile_step_<spec>_kernels.json.gz`` (every kernel of one step, in order: name,
microseconds, category) and ``profile_step_<spec>_hlo.txt.gz`` (the step's optimized HLO,
which names each fusion's op) from ``--dir``, and prints one row per group: the GEMMs, the
Pallas operand kernels, the XLA kernels of the operand glue (``fp4_operands`` ops outside the
kernels: tensor-amax reductions, scalar vectors, key words), the XLA quantization of the
operands the kernels leave to XLA (``fp4_quantize``/``fp4_amax`` ops: the weights narrower
than the 2D kernel's 1024 columns), the Threefry key derivations, and the rest by
category; with ``--json`` also each kernel's group and op (the census without the HLO).

    python experiments/glue_census.py --dir RESULTS/prof --spec nvfp4 --baseline bf16
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re

GLUE = "operand glue (XLA)"
XLA_QUANT = "XLA quantization (operands off the kernels)"


def fusion_ops(hlo: str) -> dict[str, str]:
    """``{instruction name: op_name metadata}`` of every instruction of the HLO text."""
    ops = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%(\S+) = [^\n]*?op_name=\"([^\"]+)\"", hlo, re.M):
        ops[m.group(1)] = m.group(2)
    return ops


def op_of(kernel: str, ops: dict[str, str]) -> str:
    """The op name of a GPU kernel: XLA names a fusion's kernel as the fusion with its
    ``.N`` suffix written ``_N``."""
    for cand in (kernel, re.sub(r"_(\d+)$", r".\1", kernel)):
        if cand in ops:
            return ops[cand]
    return ""


def group_of(category: str, op: str) -> str:
    """The census group of one kernel (``category``: ``profile_step``'s)."""
    if category == "pallas":
        return "Pallas operand kernels"
    if "fp4_quantize" in op or "fp4_amax" in op:
        return XLA_QUANT
    if "fp4_operands" in op:
        return GLUE
    if category == "prng":
        return "Threefry key derivations"
    return category


def census(kernels: list, ops: dict[str, str]) -> tuple[dict[str, list], list[dict]]:
    """``({group: [kernels, microseconds]}, per-kernel rows)`` of one step's kernel list."""
    groups: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    rows = []
    for name, us, cat in kernels:
        op = op_of(name, ops)
        g = group_of(cat, op)
        groups[g][0] += 1
        groups[g][1] += us
        rows.append({"kernel": name, "us": us, "category": cat, "group": g, "op": op})
    return dict(groups), rows


def _load(d: str, spec: str) -> tuple[list, dict[str, str]]:
    with gzip.open(os.path.join(d, f"profile_step_{spec}_kernels.json.gz"), "rt") as f:
        kernels = json.load(f)
    path = os.path.join(d, f"profile_step_{spec}_hlo.txt.gz")
    ops = {}
    if os.path.exists(path):
        with gzip.open(path, "rt") as f:
            ops = fusion_ops(f.read())
    return kernels, ops


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True, help="a profile_step.py --hlo output folder")
    ap.add_argument("--spec", default="nvfp4", help="the profiled recipe spec's slug")
    ap.add_argument("--baseline", default="bf16", help="the baseline's slug (its kernel count)")
    ap.add_argument("--small-us", type=float, default=4.0,
                    help="kernels shorter than this count as tiny (default 4 µs)")
    ap.add_argument("--json", default=None, help="write the census here")
    args = ap.parse_args(argv)
    kernels, ops = _load(args.dir, args.spec)
    groups, rows = census(kernels, ops)
    base, _ = _load(args.dir, args.baseline)
    total, btotal = sum(k[1] for k in kernels), sum(k[1] for k in base)
    print(f"{args.spec}: {len(kernels)} kernels, {total:,.0f} µs; {args.baseline}: "
          f"{len(base)} kernels, {btotal:,.0f} µs")
    for k in (args.spec, args.baseline):
        ks = kernels if k == args.spec else base
        tiny = [x for x in ks if x[1] < args.small_us]
        print(f"  {k}: {len(tiny)} kernels under {args.small_us:g} µs, "
              f"{sum(x[1] for x in tiny):,.0f} µs")
    print(f"{'group':46s} {'kernels':>8s} {'µs':>9s} {'µs each':>8s}")
    for g, (n, us) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        print(f"{g:46s} {n:8d} {us:9.1f} {us / n:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"spec": args.spec, "baseline": args.baseline,
                       "kernels": len(kernels), "us": round(total, 1),
                       "baseline_kernels": len(base), "baseline_us": round(btotal, 1),
                       "groups": {g: {"kernels": n, "us": round(us, 1)}
                                  for g, (n, us) in groups.items()},
                       "rows": rows}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
