"""GPU check of issue 35's attention fix: cuDNN's fused attention under ``--fsdp``.

``--attention cudnn`` with ``--fsdp 2`` crashed in the evaluation step ("Query, key and
value should have same sharding", cuDNN's custom partitioner under a plain ``jit`` over
fsdp-sharded weights). The evaluation step now runs in ``shard_map`` like the train step
(``fp4jax.train.parallel.sharded_value``). This script builds the harness's train and eval
steps (``small`` preset, bf16: the attention is what is checked and bf16 compiles fast; random
tokens) on 4 devices as ``data 2 x fsdp 2`` (2 devices ``fsdp 2`` when only 2 are visible)
for each attention (``cudnn``, ``auto``, ``xla``), compiles and runs one train step and
one evaluation, and checks that the losses are finite and that cuDNN's evaluation loss is
XLA's within 1e-2 (relative; the two attentions round differently). Writes
``$OUT/gpu_attention_check.json``; exit status 1 when a check fails.

    PYTHONPATH=$PWD python3 experiments/gpu_attention_check.py
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import lab  # noqa: F401  (puts the repository root on sys.path)
from jax.sharding import NamedSharding

from fp4jax.models.llama import quantized_llama, resolve_attention
from fp4jax.train import parallel
from fp4jax.train.config import TrainConfig, make_optimizer, make_policy, model_config, run_recipe
from fp4jax.train.loop import make_eval_step, make_init_state, make_train_step


def one(devices: int, fsdp: int, attention: str, recipe: str = "bf16") -> dict:
    cfg = TrainConfig(preset="small", recipe=recipe, batch_size=16 * devices, seq_len=256,
                      devices=devices, fsdp=fsdp, attention=attention)
    rcfg, rec = run_recipe(cfg)
    mc = model_config(cfg)
    model = quantized_llama(mc, make_policy(rcfg, mc, rec))
    tx = make_optimizer(cfg)
    mesh = parallel.make_mesh(devices, fsdp)
    init = make_init_state(model, tx, cfg)
    specs = parallel.state_specs(jax.eval_shape(init, jax.random.key(0)), mesh)
    state = jax.jit(init, out_shardings=parallel.shardings(specs, mesh))(jax.random.key(0))
    batch = jax.random.randint(jax.random.key(1), (cfg.batch_size, 257), 0, 256, jnp.int32)
    batch = jax.device_put(batch, NamedSharding(mesh, parallel.BATCH))
    t = time.perf_counter()
    ev = make_eval_step(model, None, mesh)
    val = float(ev(state["params"], batch, jax.random.key(2)))
    train = make_train_step(model, tx, None, mesh, specs)
    state, metrics = train(state, batch, jax.random.key(2))
    loss = float(metrics["loss"])
    return {"devices": devices, "fsdp": fsdp, "attention": attention,
            "resolved": resolve_attention(attention), "eval_loss": val, "train_loss": loss,
            "wall_s": round(time.perf_counter() - t, 1)}


def main() -> int:
    n = jax.device_count()
    res = {"device": str(jax.devices()[0].device_kind), "device_count": n,
           "jax": jax.__version__, "rows": [], "failures": []}
    meshes = [(4, 2)] if n >= 4 else [(2, 2)]
    if n < 2:
        res["failures"].append(f"needs 2 GPUs, got {n}")
    for devices, fsdp in meshes if n >= 2 else []:
        rows = {}
        for att in ("cudnn", "auto", "xla"):
            try:
                r = one(devices, fsdp, att)
            except Exception as e:  # noqa: BLE001 (recorded: the check's point)
                r = {"devices": devices, "fsdp": fsdp, "attention": att,
                     "error": f"{type(e).__name__}: {str(e)[:500]}"}
                res["failures"].append(f"{devices}/{fsdp} {att}: {r['error'][:200]}")
            rows[att] = r
            res["rows"].append(r)
            print(json.dumps(r), flush=True)
        for att in ("cudnn", "auto"):
            a, x = rows[att], rows["xla"]
            if "eval_loss" in a and "eval_loss" in x:
                rel = abs(a["eval_loss"] - x["eval_loss"]) / abs(x["eval_loss"])
                a["eval_rel_vs_xla"] = rel
                if not (rel < 1e-2 and jnp.isfinite(a["train_loss"])):
                    res["failures"].append(f"{devices}/{fsdp} {att}: eval {a['eval_loss']} "
                                           f"vs xla {x['eval_loss']}")
        if rows["auto"].get("resolved") != "cudnn":
            res["failures"].append("auto did not resolve to cudnn on this GPU")
    out = os.environ.get("OUT") or "."
    with open(os.path.join(out, "gpu_attention_check.json"), "w") as f:
        json.dump(res, f, indent=1)
    print("FAILURES:" if res["failures"] else "all checks passed", *res["failures"], sep="\n")
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
