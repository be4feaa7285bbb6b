"""Times tracing, lowering and XLA compilation of one training step (no training).

Used to find why the data-parallel NVFP4 step compiled so slowly on 2 GPUs (issue 3):

    PYTHONPATH=$PWD python3 experiments/compile_probe.py --recipe nvfp4 --preset small \
        --seq-len 256 --batch-size 64 --devices 2 --json /tmp/probe.jsonl

Prints and (with ``--json``) writes: lower/compile seconds, the number of each collective
in the optimized HLO, the HLO size, and the XLA_FLAGS in effect. Run variants (XLA flags,
devices) as separate processes.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import lab
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fp4jax import train as T
from fp4jax.models import quantized_llama
from fp4jax.train.cli import THREEFRY_LOWERINGS, set_threefry_lowering, threefry_lowering

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
               "collective-permute")


def probe(cfg: T.TrainConfig) -> dict:
    """Lowers and compiles ``fp4jax.train``'s step for ``cfg``, built as ``train(cfg)``
    builds it (the spec's run-level keys applied, the stochastic-rounding key an argument);
    whether a persistent compilation cache filled here serves the training run has not been
    checked."""
    seq_len, batch_size = cfg.seq_len, cfg.batch_size
    mc = T.model_config(cfg)
    rcfg, recipe = T.run_recipe(cfg)  # a spec with run-level keys, as train() reads it
    model = quantized_llama(mc, T.make_policy(rcfg, mc, recipe))
    mesh = T.make_mesh(cfg.devices)
    tx = T.make_optimizer(cfg)
    root = jax.random.key(cfg.seed)

    repl = NamedSharding(mesh, P())
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=repl),
                         jax.eval_shape(T.make_init_state(model, tx, cfg)))
    batch = jax.ShapeDtypeStruct((batch_size, seq_len + 1), jnp.int32,
                                 sharding=NamedSharding(mesh, P("data")))
    # as train(): the stochastic-rounding key is an argument (one compile for every seed)
    step = T.make_train_step(model, tx, None, mesh)
    t0 = time.perf_counter()
    lowered = step.lower(state, batch, jax.random.fold_in(root, 1))
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    hlo = compiled.as_text()
    counts = {c: len(re.findall(rf"\b{c}(?:-start)?\(", hlo)) for c in COLLECTIVES}
    return {"recipe": cfg.recipe, "preset": cfg.preset, "devices": cfg.devices, "seq_len": seq_len,
            "batch_size": batch_size, "lower_s": round(t1 - t0, 2),
            "compile_s": round(t2 - t1, 2), "hlo_chars": len(hlo),
            "fusions": hlo.count(" fusion("), "collectives": counts,
            "platform": jax.devices()[0].platform, "device_kind": jax.devices()[0].device_kind,
            "jax": jax.__version__, "commit": lab.git_commit(),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "threefry_lowering": threefry_lowering()}


def main(argv=None) -> int:
    """Takes ``fp4jax-train``'s flags (those that shape the step) plus ``--json PATH``."""
    ap = T.build_parser()
    ap.add_argument("--json", default=None, help="append the result as one JSON line here")
    ap.add_argument("--threefry", choices=THREEFRY_LOWERINGS, default="kernel",
                    help="GPU lowering of jax.random's Threefry, as fp4jax-train --threefry")
    a = vars(ap.parse_args(argv))
    out = a.pop("json")
    set_threefry_lowering(a.pop("threefry"))
    for sweep_only in ("seeds", "jobs"):  # sweep flags: they do not shape the step
        a.pop(sweep_only, None)
    res = probe(T.TrainConfig(**a))
    print(json.dumps(res), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
