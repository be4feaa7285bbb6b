"""One process of a parallel sweep (``compare(..., jobs=N)``): trains the sub-runs of one
recipe spec one after the other, sharing their compiled steps, and leaves each sub-run's
``result.json`` for the parent to read. Not a public entry point:
``python -m fp4jax.train._worker PLAN.json``, where the plan holds ``{"configs": [TrainConfig
fields, ...], "compile_cache": path or null}``. Exit status 0 when every sub-run finished or
diverged (a result of the sweep), 1 when one failed otherwise (the traceback is in the log).

A worker ends with its parent (``watch_parent``): killed alone (``kill -9``, an OOM killer),
the sweep's parent leaves no orphan training into its sub-runs. Each sub-run holds its
directory's lock while it trains (``fp4jax.train.rundir.lock_out``, in ``train``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback

PARENT_ENV = "FP4JAX_SWEEP_PARENT"  # fp4jax.train.comparison.PARENT_ENV
PR_SET_PDEATHSIG = 1


def _end(reason: str) -> None:
    print(f"fp4jax-train worker {os.getpid()}: {reason}: stopping", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
    os._exit(143)  # SIGTERM handled and ignored: end anyway


def watch_parent(parent: int, interval: float = 0.5) -> None:
    """Ends this process (SIGTERM) when ``parent`` is gone: on Linux the kernel's parent-death
    signal (``prctl(PR_SET_PDEATHSIG, SIGTERM)``), and everywhere a daemon thread that polls
    the parent pid every ``interval`` seconds (a reparented process sees another
    ``os.getppid()``)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):  # pragma: no cover - no prctl: the thread below
            pass
    if os.getppid() != parent:  # died before the signal was armed
        _end(f"parent {parent} is gone")

    def poll() -> None:
        while True:
            time.sleep(interval)
            if os.getppid() != parent:
                _end(f"parent {parent} is gone")
                return

    threading.Thread(target=poll, name="fp4jax-parent-watch", daemon=True).start()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m fp4jax.train._worker PLAN.json", file=sys.stderr)
        return 2
    if os.environ.get(PARENT_ENV, "").isdigit():
        watch_parent(int(os.environ[PARENT_ENV]))
    plan = json.loads(open(argv[0]).read())
    from fp4jax.train.cli import enable_compile_cache
    from fp4jax.train.config import TrainConfig
    from fp4jax.train.loop import TrainingDiverged, train
    from fp4jax.train.tokens import load_dataset

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
