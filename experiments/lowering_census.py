"""Where the StableHLO of a quantized step comes from, and what it costs to trace, lower and
compile (issues 35 and 38: NVFP4's compile time).

    PYTHONPATH=$PWD python3 experiments/lowering_census.py --targets dot step \\
        --specs bf16 nvfp4 quartet2 --repeats 3 --out /tmp/census.json

For each (target, spec), in ``--repeats`` fresh child processes (every compile cold: no
persistent cache), it times ``trace``, ``lower`` and XLA's ``compile`` (medians are
reported, with every sample; ``*_cpu_s``: the process's CPU seconds, steadier than wall
seconds on a shared machine), counts the StableHLO text lines and ops of the lowered module
and the optimized HLO's lines and fusions, and attributes every op to the quantizer rule it
comes from. Targets:

* ``dot``: ``jax.value_and_grad`` of one ``fp4jax.dot`` (``--tokens`` x ``--k`` @ ``--k`` x
  ``--n``, bf16) under the recipe: its three GEMMs and six quantized operands;
* ``step``: the training harness's train step (``experiments/profile_step.build_step``) at
  ``--preset`` (``micro`` by default) with ``--batch-size`` x ``--seq-len`` tokens.

Attribution: the module is lowered with debug locations; each op's location holds the
Python stack that emitted it; walking that stack from the innermost frame outward, the first
function named in ``CATEGORIES`` names the op's category (``random bits``: Threefry and the
uniforms; ``rht``; ``e2m1 rtn``/``e2m1 sr``: the element rounding; ``e4m3 scale``: the block
decode scale; ``encode scale``: the element encode scale's reciprocal; ``tensor scale``;
``amax``; ``decode``: ``data * scale`` for the GEMM; ``ms_eden``; ``4over6``). Ops inside a
private function (a nested ``jax.jit``: ``jnp.where``, ``dot3``, ...) take their own stack when
it names a category, else their call site's. ``ops`` counts each op once per text line;
``inlined_ops`` counts each op once per call path (what XLA sees after inlining).
Tracing time by category: ``cProfile``'s cumulative time of the category functions during
``trace`` (a separate, profiled trace: overhead included, proportions only; nested calls of
one category inside another count in both).

Writes JSON (``lab.run_info`` first, then one record per (target, spec)) and prints a table.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pstats
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lab  # noqa: F401  (puts the repository root on sys.path)

ROOT = Path(__file__).resolve().parent.parent
TAG = "LOWERING_CENSUS "

# innermost match wins: (module file stem, function) -> category
CATEGORIES: dict[tuple[str, str], str] = {
    ("numerics", "threefry2x32"): "random bits",
    ("numerics", "threefry2x32_primitive"): "random bits",
    ("numerics", "draws_from_key"): "random bits",
    ("numerics", "uniform_from_key"): "random bits",
    ("hadamard", "random_hadamard_transform"): "rht",
    ("hadamard", "resolve_signs"): "rht",
    ("quantized_dot", "_rht_signs"): "rht",
    ("quantized_dot", "_rht"): "rht",
    ("numerics", "stochastic_round_to_grid"): "sr (any grid)",
    ("quantization", "ms_eden"): "ms_eden",
    ("quantization", "_quantize_ms_eden"): "ms_eden",
    ("quantization", "four_over_six"): "4over6",
    ("quantization", "_round_elements"): "e2m1 rtn",  # "e2m1 sr" when SR is in the stack
    ("quantization", "block_decode_scale"): "e4m3 scale",
    ("quantization", "element_encode_scale"): "encode scale",
    ("quantization", "global_encode_scale"): "tensor scale",
    ("numerics", "reciprocal_rn"): "tensor scale",
    ("quantization", "finite_amax"): "amax",
    ("quantization", "block_amax"): "amax",
    ("quantization", "row_amax"): "amax",
    ("quantization", "scaled_data"): "decode",
    ("quantization", "dequantize"): "decode",
    ("quantized_dot", "_einsum_scaled"): "gemm",
    ("quantization", "quantize_unchecked"): "quantize (other)",
    ("quantized_dot", "_make_dot3"): "dot (other)",
}
PROFILE_FUNCS = sorted({f for _, f in CATEGORIES} | {"round_to_grid", "div_rn",
                                                     "recip_scaled_rn", "_quant"})


# ---------------------------------------------------------------------------
# StableHLO with debug locations -> ops per category
# ---------------------------------------------------------------------------

SCOPE = "census."
_LOCDEF = re.compile(r"^#(loc\d*) = loc\((.*)\)\s*$")
_OPLINE = re.compile(r"^\s*(?:%[^=]+=\s*)?\"?([a-z_]+(?:\.[a-z_0-9.]+)?)\"?[ (]")
_FUNC = re.compile(r"^\s*func\.func (?:public |private )?@([\w.$-]+)\(")
_CALL = re.compile(r"(?:func\.)?call @([\w.$-]+)\(")
_LOCREF = re.compile(r"loc\((#loc\d*)\)\s*$")


def instrument() -> None:
    """Wraps every function of ``CATEGORIES`` (and ``round_to_grid``) in a
    ``jax.named_scope("census.<module>.<function>")`` by replacing the module attribute, so
    that each op's name stack records the rule that emitted it (the traceback of ops traced
    inside a ``custom_vjp`` names only JAX's frames, so the Python stack cannot be used).
    Calls inside a module look their callee up in the module's globals at call time, so they
    see the wrapper too; names imported by value elsewhere (``from fp4jax.hadamard import
    random_hadamard_transform`` in ``quantized_dot``) are patched there as well. Metadata
    only: the program is the same."""
    import functools
    import importlib

    import jax

    targets = set(CATEGORIES) | {("numerics", "round_to_grid")}
    mods = {stem: importlib.import_module(f"fp4jax.{stem}")
            for stem in {m for m, _ in targets} | {"quantized_dot"}}
    for stem, name in targets:
        f = getattr(mods[stem], name, None)
        if f is None:  # a checkout without this function (--trees with an older one)
            continue

        def wrap(f, tag):
            @functools.wraps(f)
            def wrapped(*args, **kwargs):
                with jax.named_scope(tag):
                    return f(*args, **kwargs)
            return wrapped

        w = wrap(f, f"{SCOPE}{stem}.{name}")
        for m in mods.values():  # the defining module and any that imported it by value
            if getattr(m, name, None) is f:
                setattr(m, name, w)


class LocResolver:
    """The name stack (scopes outermost first) of a location alias of the module text."""

    def __init__(self, text: str):
        self.defs = {}
        for line in text.splitlines():
            m = _LOCDEF.match(line)
            if m:
                self.defs["#" + m.group(1)] = m.group(2)
        self.cache: dict[str, tuple] = {}

    def scopes(self, ref: str) -> tuple[tuple[str, str], ...]:
        """``((module, function), ...)`` of the census scopes, innermost first."""
        if ref not in self.cache:
            self.cache[ref] = ()
            names = re.findall(r'"([^"]*)"', self._expand(self.defs.get(ref, ""), 0))
            out: tuple = ()
            for name in names:  # the first name holding census scopes is the op's stack
                found = [c[len(SCOPE):] for c in name.split("/") if c.startswith(SCOPE)]
                if found:
                    out = tuple(tuple(f.split(".", 1)) for f in reversed(found))
                    break
            self.cache[ref] = out
        return self.cache[ref]

    def _expand(self, body: str, depth: int) -> str:
        if depth > 50:
            return body
        return re.sub(r"#loc\d*", lambda m: self._expand(self.defs.get(m.group(0), ""),
                                                          depth + 1), body)


def categorize(scopes: tuple) -> str | None:
    """The category of an op from its census scopes (innermost first)."""
    for fr in scopes:
        cat = CATEGORIES.get(fr)
        if cat is None:
            continue
        if cat == "e2m1 rtn" and ("numerics", "stochastic_round_to_grid") in scopes:
            return "e2m1 sr"
        if cat == "sr (any grid)" and ("quantization", "_round_elements") in scopes:
            return "e2m1 sr"
        if cat == "sr (any grid)" and ("quantization", "ms_eden") in scopes:
            return "ms_eden"
        return cat
    return None


def census(text: str) -> dict[str, Any]:
    """Ops per category of a module printed with ``as_text(debug_info=True)`` after
    ``instrument()``."""
    res = LocResolver(text)
    funcs: dict[str, list[tuple[str, str | None, str | None]]] = {}
    cur = None
    for line in text.splitlines():
        m = _FUNC.match(line)
        if m:
            cur = m.group(1)
            funcs[cur] = []
            continue
        if cur is None or line.startswith("#loc"):
            continue
        m = _OPLINE.match(line)
        if not m or m.group(1) in ("func.return", "stablehlo.return", "return"):
            continue
        ref = _LOCREF.search(line)
        cat = categorize(res.scopes(ref.group(1))) if ref else None
        call = _CALL.search(line)
        funcs[cur].append((m.group(1), cat, call.group(1) if call else None))
    by_cat_lines: collections.Counter = collections.Counter()
    by_op: collections.Counter = collections.Counter()
    for ops in funcs.values():
        for op, cat, _ in ops:
            by_cat_lines[cat or "other"] += 1
            by_op[op] += 1

    memo: dict[tuple[str, str], collections.Counter] = {}

    def inlined(fn: str, inherited: str) -> collections.Counter:
        """``{(category, op): count}`` of ``fn`` with its calls inlined."""
        k = (fn, inherited)
        if k in memo:
            return memo[k]
        c: collections.Counter = collections.Counter()
        for op, cat, callee in funcs.get(fn, []):
            here = cat or inherited
            if callee is not None and callee in funcs:
                c.update(inlined(callee, here))
            else:
                c[(here, op)] += 1
        memo[k] = c
        return c

    main = "main" if "main" in funcs else next(iter(funcs))
    inl_ops = inlined(main, "other")
    inl: collections.Counter = collections.Counter()
    per_cat: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for (cat, op), n in inl_ops.items():
        inl[cat] += n
        per_cat[cat][op.removeprefix("stablehlo.")] += n
    return {"ops": sum(by_cat_lines.values()), "ops_by_category": dict(by_cat_lines.most_common()),
            "inlined_ops": sum(inl.values()), "inlined_by_category": dict(inl.most_common()),
            "inlined_top_ops_by_category": {c: dict(per_cat[c].most_common(8)) for c, _ in
                                            inl.most_common()},
            "functions": len(funcs), "top_ops": dict(by_op.most_common(15))}


# ---------------------------------------------------------------------------
# targets
# ---------------------------------------------------------------------------


def build(target: str, spec: str, a) -> tuple[Any, tuple]:
    """The jitted function and its arguments (abstract where possible)."""
    import jax
    import jax.numpy as jnp

    if target == "dot":
        import fp4jax

        recipe = fp4jax.recipes.parse(spec)

        def loss(x, w, key):
            y = fp4jax.dot(x, w, recipe=recipe, key=key)
            return (y.astype(jnp.float32) ** 2).sum()

        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        args = (jax.ShapeDtypeStruct((a.tokens, a.k), jnp.bfloat16),
                jax.ShapeDtypeStruct((a.k, a.n), jnp.bfloat16),
                jax.random.key(0))
        return fn, args
    if target == "step":
        from profile_step import build_step

        step, state, batch, key, _ = build_step(a.preset, spec, False, a.batch_size, a.seq_len)
        return step, (state, batch, key)
    raise ValueError(f"unknown target {target!r}: use dot or step")


def measure(target: str, spec: str, a, profile: bool) -> dict[str, Any]:
    """One (target, spec) in this (fresh) process: timed (``profile`` False), or
    instrumented, profiled and counted (``profile`` True: its times are not reported)."""
    if profile:
        instrument()
    fn, args = build(target, spec, a)
    rec: dict[str, Any] = {"target": target, "spec": spec}
    prof = cProfile.Profile() if profile else None
    c0, t0 = time.process_time(), time.perf_counter()
    if prof:
        prof.enable()
    traced = fn.trace(*args)
    if prof:
        prof.disable()
    c1, t1 = time.process_time(), time.perf_counter()
    lowered = traced.lower()
    c2, t2 = time.process_time(), time.perf_counter()
    text = lowered.as_text()
    rec.update(trace_s=round(t1 - t0, 3), lower_s=round(t2 - t1, 3),
               trace_cpu_s=round(c1 - c0, 3), lower_cpu_s=round(c2 - c1, 3),
               stablehlo_lines=text.count("\n"), stablehlo_chars=len(text))
    if prof:
        cum: dict[str, float] = {}
        for (path, _, name), (_, _, _, ct, _) in pstats.Stats(prof).stats.items():
            p = Path(path)
            if p.parent.name == "fp4jax" and name in PROFILE_FUNCS:
                cum[f"{p.stem}.{name}"] = cum.get(f"{p.stem}.{name}", 0.0) + ct
        rec["trace_profile_cum_s"] = {k: round(v, 3) for k, v in
                                      sorted(cum.items(), key=lambda kv: -kv[1])}
        rec.update(census(lowered.as_text(debug_info=True)))
    elif not a.no_compile:
        c3, t3 = time.process_time(), time.perf_counter()
        compiled = lowered.compile()
        rec["compile_s"] = round(time.perf_counter() - t3, 3)
        rec["compile_cpu_s"] = round(time.process_time() - c3, 3)
        hlo = compiled.as_text()
        rec.update(hlo_lines=hlo.count("\n"), fusions=hlo.count(" fusion("))
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", nargs="+", default=["dot", "step"])
    ap.add_argument("--specs", nargs="+", default=["bf16", "nvfp4", "quartet2"])
    ap.add_argument("--repeats", type=int, default=3, help="timed fresh processes each")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=128)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--preset", default="micro")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--no-compile", action="store_true", help="trace and lower only")
    ap.add_argument("--out", default=None, help="write the JSON here")
    ap.add_argument("--label", default=None, help="a name for this run in the JSON")
    ap.add_argument("--trees", nargs="+", default=None, metavar="NAME=PATH",
                    help="checkouts to compare (each needs this script in its experiments/): "
                         "their runs alternate, so machine load hits them alike")
    ap.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        target, spec, profile = a.child
        rec = measure(target, spec, a, profile == "1")
        print(TAG + json.dumps(rec), flush=True)
        return 0
    trees = dict(t.split("=", 1) for t in a.trees) if a.trees else {"this": str(ROOT)}
    passthrough = ["--tokens", str(a.tokens), "--k", str(a.k), "--n", str(a.n), "--preset",
                   a.preset, "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len)]
    if a.no_compile:
        passthrough.append("--no-compile")
    out: dict[str, Any] = {**lab.run_info(__file__, sys.argv[1:] if argv is None else argv),
                           "label": a.label, "trees": trees, "results": []}

    def child(tree: str, target: str, spec: str, profile: bool) -> dict[str, Any]:
        root = Path(trees[tree])
        env = dict(os.environ)
        env["PYTHONPATH"] = str(root)  # that tree's fp4jax, first
        env.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")
        cmd = [sys.executable, str(root / "experiments" / Path(__file__).name), "--child",
               target, spec, "1" if profile else "0", *passthrough]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        got = [ln[len(TAG):] for ln in p.stdout.splitlines() if ln.startswith(TAG)]
        if not got:
            print(p.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"{tree} {target} {spec}: child failed (rc {p.returncode})")
        return json.loads(got[-1])

    for target in a.targets:
        for spec in a.specs:
            # one instrumented run per tree (counts; not timed), then `repeats` rounds of
            # timed runs, the trees alternating within each round (same machine load)
            recs = {t: child(t, target, spec, True) for t in trees}
            samples: dict[str, list] = {t: [] for t in trees}
            for _ in range(a.repeats):
                for t in trees:
                    samples[t].append(child(t, target, spec, False))
            for t in trees:
                rec = {"tree": t, **recs[t]}
                for k in ("trace_s", "lower_s", "compile_s", "trace_cpu_s", "lower_cpu_s",
                          "compile_cpu_s", "hlo_lines", "fusions"):
                    rec.pop(k, None)
                    vals = [s[k] for s in samples[t] if k in s]
                    if vals:
                        rec[k] = round(statistics.median(vals), 3)
                        rec[k + "_samples"] = vals
                out["results"].append(rec)
                print(f"{t:6s} {target:5s} {spec:12s} lines {rec['stablehlo_lines']:6d} ops "
                      f"{rec['ops']:6d} inlined {rec['inlined_ops']:6d} trace "
                      f"{rec.get('trace_s', float('nan')):6.2f} lower "
                      f"{rec.get('lower_s', float('nan')):5.2f} compile "
                      f"{rec.get('compile_s', float('nan')):6.2f} (cpu: trace "
                      f"{rec.get('trace_cpu_s', float('nan')):6.2f} compile "
                      f"{rec.get('compile_cpu_s', float('nan')):6.2f}) optimized HLO "
                      f"{rec.get('hlo_lines', 0)} lines", flush=True)
                cats = rec["inlined_by_category"]
                print("      " + ", ".join(f"{k} {v}" for k, v in cats.items()), flush=True)
            if a.out:
                Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
