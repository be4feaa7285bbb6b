"""One process of a parallel sweep (``compare(..., jobs=N)``): trains the sub-runs of one
recipe spec one after the other, sharing their compiled steps, and leaves each sub-run's
``result.json`` for the parent to read. Not a public entry point:
``python -m fp4jax.train._worker PLAN.json``, where the plan holds ``{"configs": [TrainConfig
fields, ...], "compile_cache": path or null}``. Exit status 0 when every sub-run finished or
diverged (a result of the sweep), 1 when one failed otherwise (the traceback is in the log).
"""

from __future__ import annotations

import json
import sys
import traceback


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m fp4jax.train._worker PLAN.json", file=sys.stderr)
        return 2
    plan = json.loads(open(argv[0]).read())
    from fp4jax.tokens import load_dataset
    from fp4jax.train.cli import enable_compile_cache
    from fp4jax.train.config import TrainConfig
    from fp4jax.train.loop import TrainingDiverged, train

    enable_compile_cache(plan.get("compile_cache") or "off")
    cfgs = [TrainConfig(**c) for c in plan["configs"]]
    ds = load_dataset(cfgs[0].data, cfgs[0].seq_len, cfgs[0].val_fraction,
                      cfgs[0].cache_dir, cfgs[0].tokenizer)
    status = 0
    for cfg in cfgs:
        try:
            r = train(cfg, ds)
            print(json.dumps({k: v for k, v in r.items() if k != "history"}), flush=True)
        except TrainingDiverged as e:
            print(f"fp4jax-train: {cfg.out}: training diverged: {e}", file=sys.stderr,
                  flush=True)
        except Exception:  # noqa: BLE001 - reported, the other sub-runs go on
            traceback.print_exc()
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
