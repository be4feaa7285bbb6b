"""FSDP parameter all-gather in FP4 on the GPUs (issue 37 item 1): the same bits, fewer
bytes, and the step time.

In one process, on ``--devices`` devices with the state split over ``--fsdp`` of them, the
harness's train step (``profile_step.build_step``: the step ``fp4jax-train`` compiles) is
built twice from the same initial state and batch: gathering the parameters as stored
(float32), and with ``--fp4-param-gather`` (the 2D NVFP4 weights as packed FP4 codes and
tile amaxes, ``fp4jax.sharding.fp4_all_gather``). Each is compiled (seconds recorded), its
all-gathers read from the compiled HLO (``bench_train.all_gather_bytes``: bytes by dtype),
run ``--steps`` steps (loss and gradient norm of each), then timed (``--iterations`` steps
in ``bench_train.PIPELINE_WINDOWS`` pipelined windows, the median window's mean step time).

Verdict: ``identical`` when every step's loss and gradient norm and every parameter after
the steps have the same bits in both runs. XLA's deterministic GPU ops are on
(``fp4jax.train.cli.set_deterministic``, as ``fp4jax-train --deterministic``): without them
two runs of one program may differ in float32 sums (atomics), and the check would not
say anything about the gather. ``--no-deterministic`` leaves them off (the first GPU try
aborted inside XLA with them on) and records the largest parameter difference instead.

    FP4JAX_COMMIT=<sha> PYTHONPATH=$PWD python3 experiments/param_gather_check.py \\
        --preset small --devices 2 --fsdp 2 [--scan-layers] [--recipe nvfp4] \\
        [--batch-size 64 --seq-len 256 --steps 5 --iterations 20] [--out DIR]

Writes ``param_gather_check.json`` to ``--out`` (default ``$OUT``, else
``./param_gather_out``). On a CPU: ``XLA_FLAGS=--xla_force_host_platform_device_count=4``
and ``--preset micro --batch-size 8 --seq-len 32`` (slow: two cold compiles).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import jax
import lab  # before fp4jax: puts the repository root on sys.path
import numpy as np
from bench_train import PIPELINE_WINDOWS, all_gather_bytes
from profile_step import build_step

from fp4jax.train.cli import set_deterministic

JSON_NAME = "param_gather_check.json"


def run_one(args: argparse.Namespace, fp4: bool, plan_out: dict | None = None
            ) -> tuple[dict[str, Any], list[list[np.ndarray]]]:
    """One configuration: its row and its parameters (host arrays) after each of
    ``--steps`` steps."""
    step, state, batch, key, mc = build_step(args.preset, args.recipe, args.scan_layers,
                                             args.batch_size, args.seq_len, args.devices,
                                             args.attention, None, args.fsdp, fp4, plan_out)
    rec: dict[str, Any] = {"fp4_param_gather": fp4, "params": mc.num_params()}
    t = time.perf_counter()
    compiled = step.lower(state, batch, key).compile()
    rec["compile_s"] = round(time.perf_counter() - t, 2)
    rec.update(all_gather_bytes(compiled.as_text()))
    losses, norms, params = [], [], []
    for _ in range(args.steps):
        state, m = compiled(state, batch, key)
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
        params.append([np.asarray(x) for x in jax.tree.leaves(jax.device_get(state["params"]))])
    rec["losses"], rec["grad_norms"] = losses, norms
    windows = []
    for _ in range(PIPELINE_WINDOWS):
        t = time.perf_counter()
        for _ in range(args.iterations):
            state, m = compiled(state, batch, key)
        jax.block_until_ready((state, m))
        windows.append((time.perf_counter() - t) / args.iterations)
    rec["step_s"] = statistics.median(windows)
    rec["windows_s"] = windows
    rec["tokens_per_s"] = args.batch_size * args.seq_len / rec["step_s"]
    del compiled, state
    return rec, params


def weight_bits(params: list[np.ndarray], plan_out: dict) -> list[dict[str, Any]]:
    """For every weight the FP4 gather carries, on these parameters (host arrays, the
    state's leaf order): the weight ``fp4_all_gather`` rebuilds from its shards against the
    plain weight, each cast to its compute dtype and 2D-quantized by ``fp4jax.quantize``
    with its format (jitted, on the devices): how many codes, block scales and tensor
    scales differ. Rows only for weights with a mismatch, plus a count of those checked."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import fp4jax

    mesh = plan_out["mesh"]
    plan = jax.tree.leaves(plan_out["plan"], is_leaf=lambda x: x is None)
    specs = jax.tree_util.tree_flatten_with_path(plan_out["specs"]["params"],
                                                 is_leaf=lambda x: isinstance(x, P))[0]
    rows, checked = [], 0
    for w, (path, spec), fp4 in zip(params, specs, plan, strict=True):
        if fp4 is None:
            continue
        checked += 1
        axis = tuple(spec).index("fsdp")
        dtype = jnp.dtype(fp4.dtype)
        gather = jax.jit(jax.shard_map(
            lambda x, axis=axis, fmt=fp4.fmt, dtype=dtype: fp4jax.sharding.fp4_all_gather(
                x, "fsdp", axis, fmt, dtype),
            mesh=mesh, in_specs=spec, out_specs=P(), check_vma=False))
        got = gather(jax.device_put(jnp.asarray(w), NamedSharding(mesh, spec)))

        @jax.jit
        def q(v, fmt=fp4.fmt, dtype=dtype):
            r = fp4jax.quantize(v.astype(dtype), fmt, block_2d=True)
            return r.data.astype(jnp.float32), r.scale.astype(jnp.float32), r.global_scale

        bad = {k: int(np.count_nonzero(np.asarray(u).view(np.uint32)
                                       != np.asarray(v).view(np.uint32)))
               for k, u, v in zip(("codes", "scales", "tensor_scale"), q(got),
                                  q(jnp.asarray(w)), strict=True)}
        if any(bad.values()):
            rows.append({"param": jax.tree_util.keystr(path), "shape": list(w.shape), **bad})
    return [{"weights_checked": checked}] + rows


def same_bits(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and x.dtype == y.dtype and x.tobytes() == y.tobytes()
        for x, y in zip(a, b, strict=True))


def differing(a: list[np.ndarray], b: list[np.ndarray]) -> int:
    """How many parameter elements differ in their bits (all of them where shapes do)."""
    def bits(x: np.ndarray) -> np.ndarray:
        return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])

    return sum(int(np.count_nonzero(bits(x) != bits(y)))
               if x.shape == y.shape and x.dtype == y.dtype else x.size
               for x, y in zip(a, b, strict=True))


def max_abs_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """The largest |a - b| over the parameters (float64; inf where shapes differ)."""
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b, strict=True)):
        return float("inf")
    return max((float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))
                for x, y in zip(a, b, strict=True) if x.size), default=0.0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--recipe", default="nvfp4")
    ap.add_argument("--scan-layers", action="store_true")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--fsdp", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--no-deterministic", action="store_true",
                    help="leave XLA's deterministic GPU ops off (the first GPU try aborted "
                         "inside XLA with them on): the verdict may then show float32 sums "
                         "of atomics differing; the largest parameter difference is recorded")
    ap.add_argument("--weight-bits", action="store_true",
                    help="also quantize every FP4-gathered weight, rebuilt from its shards "
                         "and plain, on the plain run's parameters after each step, and "
                         "count the codes and scales that differ")
    args = ap.parse_args(argv)
    if not args.no_deterministic:
        set_deterministic()  # before JAX touches a backend
    out = args.out or os.environ.get("OUT") or "param_gather_out"
    meta = lab.run_info(__file__, argv, args.commit)
    meta.update(vars(args), xla_flags=os.environ.get("XLA_FLAGS", ""))
    res = lab.Results(os.path.join(out, JSON_NAME), meta)
    print("param_gather_check: the float32 gather (compile, steps, timing)", flush=True)
    plain, p0 = run_one(args, False)
    res.add("rows", plain)
    print(f"param_gather_check: {plain['tokens_per_s']:,.0f} tokens/s; the FP4 gather",
          flush=True)
    plan_out: dict = {}
    fp4, p1 = run_one(args, True, plan_out)
    res.add("rows", fp4)
    identical = (plain["losses"] == fp4["losses"] and plain["grad_norms"] == fp4["grad_norms"]
                 and same_bits(p0[-1], p1[-1]))
    # where the runs part: the parameters after each step (the update of step i)
    by_step = [{"after_step": i, "differing_elements": differing(a, b),
                "max_abs_diff": max_abs_diff(a, b)}
               for i, (a, b) in enumerate(zip(p0, p1, strict=True))]
    summary = {
        "identical": identical,
        "all_gather_bytes": [plain["all_gather_bytes"], fp4["all_gather_bytes"]],
        "all_gather_bytes_ratio": plain["all_gather_bytes"] / max(fp4["all_gather_bytes"], 1),
        "tokens_per_s": [plain["tokens_per_s"], fp4["tokens_per_s"]],
        "speed_ratio": fp4["tokens_per_s"] / plain["tokens_per_s"],
        "compile_s": [plain["compile_s"], fp4["compile_s"]],
        "max_abs_param_diff": max_abs_diff(p0[-1], p1[-1]),
        "params_by_step": by_step,
    }
    if args.weight_bits:
        # the rebuilt weights on the parameters the plain run reached after each step
        summary["weight_bits_by_step"] = [weight_bits(p, plan_out) for p in p0]
        for i, r in enumerate(summary["weight_bits_by_step"]):
            print(f"param_gather_check: weights after step {i}: {r}", flush=True)
    for r in by_step:
        print(f"param_gather_check: after step {r['after_step']}: "
              f"{r['differing_elements']:,} parameter elements differ, max |diff| "
              f"{r['max_abs_diff']:.3g}", flush=True)
    res.finish(summary=summary)
    print(f"param_gather_check: identical={identical}; all-gather bytes "
          f"{plain['all_gather_bytes']:,} -> {fp4['all_gather_bytes']:,} "
          f"({summary['all_gather_bytes_ratio']:.2f}x fewer); tokens/s "
          f"{plain['tokens_per_s']:,.0f} -> {fp4['tokens_per_s']:,.0f} "
          f"({summary['speed_ratio']:.3f}x); compile {plain['compile_s']} -> "
          f"{fp4['compile_s']} s; wrote {res.path}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
