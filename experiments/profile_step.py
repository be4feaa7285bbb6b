"""Where one training step's time goes, by category (issue 17).

For each recipe spec (default ``bf16`` and ``nvfp4``) at a preset, builds the harness's own
train step (``fp4jax.train``'s model, policy, optimizer and ``--scan-layers`` choice, the
step function ``fp4jax-train`` compiles), then on a GPU:

* times the whole step (``lab.time_fn``: CUPTI device time, warm-up, median of N);
* lists the device time of every kernel of one step (``profiler.measure(aggregate=False)``)
  and sums them by category. A kernel's category comes from the optimized HLO: the XLA
  instruction the kernel is named after, its op kind and the JAX name stack in its
  ``op_name`` metadata (which fp4jax function it came from):

  ``gemm`` (dots and cuBLAS custom calls), ``pallas`` (the Pallas kernels), ``rht``,
  ``quantize`` (XLA-path quantization and decode), ``amax``, ``fp4_glue`` (the rest of
  ``fp4jax.dot``: transposes, pads, casts, scale products), ``prng`` (``jax.random``'s
  Threefry as CUDA kernels, ``--threefry kernel``), ``optimizer`` (optax),
  ``attention`` (softmax and score/value matmuls are ``gemm``), ``embedding``
  (gather/scatter), ``layout`` (transpose, copy, pad, slice), ``reduce`` (other reductions),
  ``elementwise`` (other fusions), ``collective`` (all-reduces and other collectives: NCCL
  kernels), ``other``; ``launch gaps`` = step time - kernel sum.

With ``--devices N`` (N > 1) the step is the data-parallel one (``shard_map`` over N local
GPUs, the batch split by rows, as ``fp4jax-train --devices N`` runs it). CUPTI then lists the
kernels of every device: the step time and the categories are summed over the N devices,
and ``per_device_us`` divides them by N (the devices run the same program on equal rows);
the per-call Pallas attribution is left out (the devices' kernels interleave).

Writes ``$OUT/profile_step.json`` (``lab.run_info`` first: device, JAX version, commit,
command). On a machine without CUPTI (CPU) it times wall clock and reports the HLO's
instructions per category instead of kernel times (to check the script).

    PYTHONPATH=$PWD python3 experiments/profile_step.py --preset small --scan-layers \\
        --specs bf16 nvfp4 [--batch-size 64 --seq-len 256] [--devices 2] [--hlo]

``census`` (offline, no device; was ``glue_census.py``): a ``--hlo`` folder's kernels grouped
by what they do for the quantized GEMMs (``CENSUS_DOC``):

    python experiments/profile_step.py census --dir RESULTS/prof --spec nvfp4 --baseline bf16
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import lab  # before fp4jax: puts the repository root on sys.path
from jax.sharding import NamedSharding

from fp4jax.models.llama import SCAN_REMAT, quantized_llama
from fp4jax.train.cli import THREEFRY_LOWERINGS, set_threefry_lowering, threefry_lowering
from fp4jax.train.comparison import slug
from fp4jax.train.config import TrainConfig, make_optimizer, make_policy, model_config, run_recipe
from fp4jax.train.loop import make_init_state, make_mesh, make_train_step

CENSUS_DOC = """Where an NVFP4 step's extra GPU kernels go, offline: the kernels of one
``profile_step.py --hlo`` run grouped by what they do for the quantized GEMMs (issue 35).

Reads ``profile_step_<spec>_kernels.json.gz`` (every kernel of one step, in order: name,
microseconds, category) and ``profile_step_<spec>_hlo.txt.gz`` (the step's optimized HLO,
which names each fusion's op) from ``--dir``, and prints one row per group: the GEMMs, the
Pallas operand kernels, the XLA kernels of the operand glue (``fp4_operands`` ops outside the
kernels: tensor-amax reductions, scalar vectors, key words), the XLA quantization of the
operands the kernels leave to XLA (``fp4_quantize``/``fp4_amax`` ops: the weights narrower
than the 2D kernel's 1024 columns), the Threefry key derivations, and the rest by
category; with ``--json`` also each kernel's group and op (the census without the HLO).

    python experiments/profile_step.py census --dir RESULTS/prof --spec nvfp4 --baseline bf16
"""

CATEGORIES = ("gemm", "pallas", "rht", "quantize", "amax", "fp4_glue", "prng", "optimizer",
              "attention", "embedding", "layout", "reduce", "elementwise", "collective",
              "other")
_COLLECTIVES = ("all-reduce", "all-reduce-start", "all-reduce-done", "all-gather",
                "all-gather-start", "all-gather-done", "reduce-scatter", "collective-permute",
                "collective-permute-start", "collective-permute-done", "all-to-all")

# name-stack patterns, checked in order (the first that matches wins)
_STACK_RULES = (  # fp4jax's named scopes (fp4jax/quantized_dot.py, fp4jax/quantization.py) first
    ("amax", re.compile(r"fp4_amax")),
    ("rht", re.compile(r"fp4_rht|_rht_jit")),
    ("quantize", re.compile(r"fp4_quantize|fp4_decode|fp4_operands")),
    ("fp4_glue", re.compile(r"jit\(dot3\)")),
    ("optimizer", re.compile(r"optax|adam|scale_by|apply_updates|clip")),
    ("attention", re.compile(r"softmax|attention|attn")),
)
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*[^=]*?\b([a-z][\w\-]*)\(")
_OPNAME = re.compile(r'op_name="([^"]*)"')
_INDEX_COMMENT = re.compile(r"/\*index=\d+\*/")
_TARGET = re.compile(r'custom_call_target="([^"]*)"')


def norm(name: str) -> str:
    """Kernel and instruction names compared without the ``.``/``_``/``-`` differences."""
    return re.sub(r"[.\-]", "_", name)


def hlo_instructions(hlo: str) -> dict[str, tuple[str, str, str]]:
    """``{normalized instruction name: (opcode, custom-call target, op_name)}`` of the entry
    and fused computations of an optimized HLO module's text."""
    out = {}
    for line in hlo.splitlines():
        # tuple shapes of 6+ elements carry /*index=5*/ comments, whose '=' would end the
        # instruction's name match early (e.g. the combined gradient all-reduce)
        m = _INSTR.match(_INDEX_COMMENT.sub("", line))
        if not m:
            continue
        op = _OPNAME.search(line)
        tgt = _TARGET.search(line)
        out[norm(m.group(1))] = (m.group(2), tgt.group(1) if tgt else "",
                                 op.group(1) if op else "")
    return out


def categorize(opcode: str, target: str, op_name: str, fused_text: str = "") -> str:
    """The category of one instruction (see the module docstring)."""
    t = target.lower()
    if opcode in _COLLECTIVES:
        return "collective"
    if opcode == "custom-call" and ("mosaic" in t or "pallas" in t or "triton" in t):
        return "pallas"
    if opcode in ("dot", "convolution") or "gemm" in t or "cublas" in t or "matmul" in t:
        return "gemm"
    if opcode == "fusion" and re.search(r"\bdot\(|custom_call_target=\"__cublas", fused_text):
        return "gemm"
    stack = op_name.lower()
    for cat, pat in _STACK_RULES:
        if pat.search(stack):
            return cat
    if opcode in ("gather", "scatter") or re.search(r"\b(gather|scatter)\(", fused_text):
        return "embedding"
    if opcode in ("transpose", "copy", "pad", "slice", "dynamic-slice", "concatenate",
                  "dynamic-update-slice", "bitcast", "reshape"):
        return "layout"
    if opcode in ("reduce", "reduce-window") or re.search(r"\breduce\(", fused_text):
        return "reduce"
    if opcode == "fusion":
        return "elementwise"
    return "other"


def fused_bodies(hlo: str) -> dict[str, str]:
    """``{normalized fusion instruction name: text of the computation it calls}``."""
    comps, cur, buf = {}, None, []
    for line in hlo.splitlines():
        m = re.match(r"^\s*%?([\w.\-]+)\s.*\{\s*$", line)
        if m and not line.startswith(" "):
            cur, buf = m.group(1), []
            continue
        if cur is not None:
            if line.strip() == "}":
                comps[cur] = "\n".join(buf)
                cur = None
            else:
                buf.append(line)
    out = {}
    for line in hlo.splitlines():
        m = _INSTR.match(line)
        c = re.search(r"calls=%?([\w.\-]+)", line)
        if m and c and c.group(1) in comps:
            out[norm(m.group(1))] = comps[c.group(1)]
    return out


def kernel_category(kernel: str, instrs: dict, bodies: dict) -> str:
    """The category of a CUPTI kernel name: the HLO instruction it is named after, else by
    the name itself (cuBLAS/cuDNN kernels, Pallas kernels named after their function)."""
    k = norm(kernel.split("(")[0].strip())
    if k in instrs:
        opcode, target, op_name = instrs[k]
        return categorize(opcode, target, op_name, bodies.get(k, ""))
    low = kernel.lower()
    if "nccl" in low:  # NCCL's collective kernels (data-parallel steps)
        return "collective"
    if re.search(r"prng|threefry", low):  # jax.random's Threefry as a CUDA kernel
        return "prng"
    if re.search(r"gemm|nvjet|xmma|cutlass|cublas|wgmma", low):
        return "gemm"
    if re.search(r"reduce|reduction", low):
        return "reduce"
    if re.search(r"transpose|copy|memcpy|memset", low):
        return "layout"
    if "fusion" in low:
        return "elementwise"
    return "pallas"  # Mosaic GPU kernels carry their Python function's name


_MOSAIC = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S+)\s+custom-call\(.*'
                     r'custom_call_target="mosaic_gpu[^"]*"')


def _fold_layers(op_name: str) -> str:
    """``op_name`` with layer numbers folded (``block_3`` -> ``block_N``)."""
    return re.sub(r"block_\d+", "block_N", op_name)


def strip_mosaic_modules(hlo: str) -> str:
    """``hlo`` with each Mosaic GPU custom call's serialized module (its backend config's
    ``module`` string, most of a kernel step's HLO text) replaced by its length."""
    return re.sub(r'((?:\bmodule|\\?"module\\?")\s*[=:]\s*)"((?:[^"\\]|\\.)*)"',
                  lambda m: f'{m.group(1)}"<{len(m.group(2))} chars>"', hlo)


def mosaic_calls(hlo: str) -> list[tuple[str, str]]:
    """``(operation, output shape)`` of every Mosaic GPU custom call of the optimized
    module's entry computation, in schedule order (the printed order of a scheduled module):
    the operation is the ``op_name`` with layer numbers folded (``block_3`` -> ``block_N``)
    and the outer ``jit(step)/`` and trailing ``/body/...`` dropped, e.g.
    ``transpose(jvp(Llama))/block_N/down/DotGeneral_0/jit(dot3)/fp4_operands/jit(fq_rows_scaled)``."""
    entry = hlo[hlo.find("\nENTRY "):] if "\nENTRY " in hlo else hlo
    out = []
    for line in entry.splitlines():
        m = _MOSAIC.match(line)
        if not m:
            continue
        op = _OPNAME.search(line)
        name = _fold_layers(op.group(1) if op else m.group(1))
        name = re.sub(r"^jit\(step\)/", "", re.sub(r"/body(/.*)?$", "", name))
        out.append((name, m.group(2)))
    return out


def attribute_pallas(per: list, calls: list[tuple[str, str]], instrs: dict,
                     bodies: dict) -> dict:
    """The Pallas kernels of one profiled step matched to ``calls`` (``mosaic_calls``) by
    order: CUPTI lists kernels in execution order and each Mosaic GPU custom call launches
    one kernel, so the i-th Pallas kernel is the i-th call when the counts agree (else
    ``{"error": ...}``). Returns ``{"rows": [{op, shape, calls, us, us_per_call}], ...}``
    sorted by time."""
    seq = [ms * 1e3 for name, ms in per if kernel_category(name, instrs, bodies) == "pallas"]
    if len(seq) != len(calls):
        return {"error": f"{len(seq)} Pallas kernels ran, {len(calls)} Mosaic GPU calls in "
                         f"the entry computation: not matched"}
    agg = collections.OrderedDict()
    for (op, shape), us in zip(calls, seq, strict=True):
        c, s = agg.get((op, shape), (0, 0.0))
        agg[(op, shape)] = (c + 1, s + us)
    rows = [{"op": op, "shape": shape, "calls": c, "us": round(s, 1),
             "us_per_call": round(s / c, 1)} for (op, shape), (c, s) in agg.items()]
    return {"rows": sorted(rows, key=lambda r: -r["us"])}


def _op_of(kernel: str, instrs: dict) -> str:
    """The ``op_name`` of the HLO instruction a kernel is named after (layer numbers
    folded, the last 140 characters), or "" for library kernels (cuBLAS, Pallas)."""
    got = instrs.get(norm(kernel.split("(")[0].strip()))
    return _fold_layers(got[2])[-140:] if got else ""


def build_step(preset: str, spec: str, scan_layers: bool, batch_size: int, seq_len: int,
               devices: int = 1, attention: str = "xla", scan_remat: str | None = None,
               fsdp: int = 1, fp4_param_gather: bool = False, plan_out: dict | None = None):
    """The harness's train step for one spec, its initial state and one batch (on
    ``devices`` local devices: the data-parallel step, the batch split over them; ``fsdp``:
    the state split over that many of them, as ``--fsdp``; ``attention`` as
    ``--attention``; ``fp4_param_gather`` as ``--fp4-param-gather``: the weights planned
    by ``parallel.fp4_gather_plan`` gathered in FP4; ``plan_out``, a dict, receives the
    plan, the state's ``PartitionSpec``s and the mesh)."""
    from fp4jax.models.llama import llama_rules, policy_rules
    from fp4jax.train import parallel
    from fp4jax.train.models import llama_weight_layers

    cfg = TrainConfig(preset=preset, recipe=spec, scan_layers=scan_layers,
                      batch_size=batch_size, seq_len=seq_len, devices=devices, fsdp=fsdp,
                      attention=attention, scan_remat=scan_remat if scan_layers else None,
                      fp4_param_gather=fp4_param_gather)
    rcfg, recipe = run_recipe(cfg)
    mc = model_config(cfg)
    policy = make_policy(rcfg, mc, recipe)
    model = quantized_llama(mc, policy)
    tx = make_optimizer(cfg)
    mesh = make_mesh(devices, fsdp)
    init = make_init_state(model, tx, cfg)
    shapes = jax.eval_shape(init, jax.random.key(0))
    specs = parallel.state_specs(shapes, mesh)
    state = jax.jit(init, out_shardings=parallel.shardings(specs, mesh))(jax.random.key(0))
    plan = None
    if fp4_param_gather:
        layers = llama_weight_layers(mc, model, llama_rules(mc, policy_rules(mc, policy)),
                                     seq_len)
        plan, notes = parallel.fp4_gather_plan(shapes["params"], specs["params"], mesh,
                                               layers, mc.dtype)
        print(parallel.describe_plan(notes), file=sys.stderr, flush=True)
    if plan_out is not None:
        plan_out.update(plan=plan, specs=specs, mesh=mesh)
    step = make_train_step(model, tx, None, mesh, specs, plan)
    batch = jax.random.randint(jax.random.key(1), (batch_size, seq_len + 1), 0, 256, jnp.int32)
    batch = jax.device_put(batch, NamedSharding(mesh, parallel.BATCH))
    return step, state, batch, jax.random.key(2), mc


def profile_spec(args, spec: str) -> dict:
    step, state, batch, key, mc = build_step(args.preset, spec, args.scan_layers,
                                             args.batch_size, args.seq_len,
                                             devices=args.devices, attention=args.attention,
                                             scan_remat=args.scan_remat)
    # The harness's step donates the state, and CUPTI's measure calls the function several
    # times on the same arguments: profile the same step function compiled without donation
    # (measure takes the compiled object as it is; wrapping it in another jit fails).
    once = jax.jit(step.__wrapped__).lower(state, batch, key).compile()
    hlo = once.as_text()
    instrs, bodies = hlo_instructions(hlo), fused_bodies(hlo)

    rec = {"spec": spec, "params": mc.num_params(), "devices": args.devices,
           "scan_remat": mc.scan_remat if args.scan_layers else None,
           "tokens_per_step": args.batch_size * args.seq_len}
    rec["step"] = lab.time_fn(once, state, batch, key, iterations=args.iterations)
    try:
        from jax.experimental.mosaic.gpu import profiler

        _, per = profiler.measure(once, aggregate=False)(state, batch, key)
        by_cat = collections.Counter()
        by_kernel = collections.OrderedDict()
        for name, ms in per:
            cat = kernel_category(name, instrs, bodies)
            by_cat[cat] += ms * 1e3
            c, s, _ = by_kernel.get(name, (0, 0.0, cat))
            by_kernel[name] = (c + 1, s + ms * 1e3, cat)
        total = sum(by_cat.values())
        rec["kernels_total_us"] = round(total, 1)
        rec["categories_us"] = {c: round(by_cat.get(c, 0.0), 1) for c in CATEGORIES}
        rec["launch_gaps_us"] = round(rec["step"]["median_us"] - total, 1)
        if args.devices > 1:
            rec["per_device_us"] = {"step": round(rec["step"]["median_us"] / args.devices, 1)} | {
                c: round(us / args.devices, 1) for c, us in rec["categories_us"].items()}
        rec["pallas_kernels"] = (attribute_pallas(per, mosaic_calls(hlo), instrs, bodies)
                                 if args.devices == 1 else
                                 {"error": "not attributed with several devices (CUPTI "
                                           "interleaves their kernels): see top_kernels"})
        if args.hlo:  # the kernel sequence itself, to re-attribute offline
            with gzip.open(os.path.join(args.out, f"profile_step_{slug(spec)}_kernels.json.gz"),
                           "wt") as f:
                json.dump([[n, round(ms * 1e3, 2), kernel_category(n, instrs, bodies)]
                           for n, ms in per], f)
        rec["top_kernels"] = [{"kernel": n[:100], "category": cat, "calls": c, "us": round(s, 1),
                               "op": _op_of(n, instrs)}
                              for n, (c, s, cat) in sorted(by_kernel.items(),
                                                           key=lambda kv: -kv[1][1])[:60]]
    except Exception as e:  # noqa: BLE001 (no CUPTI: CPU, or a profiler API change)
        rec["breakdown_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        counts = collections.Counter(categorize(o, t, n, bodies.get(k, ""))
                                     for k, (o, t, n) in instrs.items())
        rec["hlo_instructions_per_category"] = {c: counts.get(c, 0) for c in CATEGORIES}
    if args.hlo:  # without the Mosaic GPU modules' bytes (most of the text; kept: their hash)
        path = os.path.join(args.out, f"profile_step_{slug(spec)}_hlo.txt.gz")
        with gzip.open(path, "wt") as f:
            f.write(strip_mosaic_modules(hlo))
    return rec


# --- census (offline; was experiments/glue_census.py, issue 35) ---

GLUE = "operand glue (XLA)"
XLA_QUANT = "XLA quantization (operands off the kernels)"


def census_fusion_ops(hlo: str) -> dict[str, str]:
    """``{instruction name: op_name metadata}`` of every instruction of the HLO text."""
    ops = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%(\S+) = [^\n]*?op_name=\"([^\"]+)\"", hlo, re.M):
        ops[m.group(1)] = m.group(2)
    return ops


def census_op_of(kernel: str, ops: dict[str, str]) -> str:
    """The op name of a GPU kernel: XLA names a fusion's kernel as the fusion with its
    ``.N`` suffix written ``_N``."""
    for cand in (kernel, re.sub(r"_(\d+)$", r".\1", kernel)):
        if cand in ops:
            return ops[cand]
    return ""


def census_group(category: str, op: str) -> str:
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
        op = census_op_of(name, ops)
        g = census_group(cat, op)
        groups[g][0] += 1
        groups[g][1] += us
        rows.append({"kernel": name, "us": us, "category": cat, "group": g, "op": op})
    return dict(groups), rows


def _census_load(d: str, spec: str) -> tuple[list, dict[str, str]]:
    with gzip.open(os.path.join(d, f"profile_step_{spec}_kernels.json.gz"), "rt") as f:
        kernels = json.load(f)
    path = os.path.join(d, f"profile_step_{spec}_hlo.txt.gz")
    ops = {}
    if os.path.exists(path):
        with gzip.open(path, "rt") as f:
            ops = census_fusion_ops(f.read())
    return kernels, ops


def census_main(argv: list[str]) -> int:
    """``profile_step.py census``: the census of a ``--hlo`` folder (was ``glue_census.py``)."""
    ap = argparse.ArgumentParser(prog="profile_step.py census", description=CENSUS_DOC)
    ap.add_argument("--dir", required=True, help="a profile_step.py --hlo output folder")
    ap.add_argument("--spec", default="nvfp4", help="the profiled recipe spec's slug")
    ap.add_argument("--baseline", default="bf16", help="the baseline's slug (its kernel count)")
    ap.add_argument("--small-us", type=float, default=4.0,
                    help="kernels shorter than this count as tiny (default 4 µs)")
    ap.add_argument("--json", default=None, help="write the census here")
    args = ap.parse_args(argv)
    kernels, ops = _census_load(args.dir, args.spec)
    groups, rows = census(kernels, ops)
    base, _ = _census_load(args.dir, args.baseline)
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["census"]:
        return census_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--specs", nargs="+", default=["bf16", "nvfp4"])
    ap.add_argument("--scan-layers", action="store_true")
    ap.add_argument("--attention", default="xla", choices=("xla", "cudnn"))
    ap.add_argument("--scan-remat", default=None, choices=SCAN_REMAT,
                    help="with --scan-layers: fp4jax-train --scan-remat (default: dots)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--devices", type=int, default=1,
                    help="local devices of the data-parallel step (the batch split over them)")
    ap.add_argument("--hlo", action="store_true", help="save each step's optimized HLO")
    ap.add_argument("--threefry", choices=THREEFRY_LOWERINGS, default="kernel",
                    help="GPU lowering of jax.random's Threefry, as fp4jax-train --threefry")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    if args.scan_remat is not None and not args.scan_layers:
        ap.error("--scan-remat applies to scanned blocks: pass --scan-layers too")
    if args.devices < 1 or args.batch_size % args.devices:
        ap.error(f"--devices {args.devices}: needs a positive count that divides "
                 f"--batch-size {args.batch_size}")
    set_threefry_lowering(args.threefry)
    res = lab.run_info(__file__, argv) | {
        "threefry_lowering": threefry_lowering(), "runs": []}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "profile_step.json")
    for spec in args.specs:
        rec = profile_spec(args, spec)
        res["runs"].append(rec)
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        med = rec["step"]["median_us"]
        print(f"{spec}: step {med:.0f} us ({rec['step']['method']}), "
              f"{rec['tokens_per_step'] / med * 1e6:,.0f} tokens/s")
        for cat, us in rec.get("categories_us", {}).items():
            if us:
                print(f"  {cat:12s} {us:10.1f} us  {100 * us / med:5.1f}%")
        if "launch_gaps_us" in rec:
            print(f"  {'launch gaps':12s} {rec['launch_gaps_us']:10.1f} us")
        pk = rec.get("pallas_kernels", {})
        if pk.get("error"):
            print(f"  pallas attribution: {pk['error']}")
        for r in pk.get("rows", [])[:25]:
            print(f"    {r['us']:9.1f} us  {r['calls']:3d} x {r['us_per_call']:7.1f}  "
                  f"{r['shape']:22s} {r['op'][-90:]}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
