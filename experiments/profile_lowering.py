"""cProfile of lowering one harness train step: trace, lower and compile seconds, and the
profile's top functions of ``.lower()`` (where a cold compile's Python time goes: Mosaic GPU
kernel lowering, layout inference). Defaults: the ``small`` NVFP4 ``--scan-layers`` step of
64 x 256 tokens, as run on the H100 at commit c283eb8
(``results/training/2026-11-24_bench_train_h100/lower_profile_small_nvfp4_scan_c283eb8.log``)::

    PYTHONPATH=$PWD python3 experiments/profile_lowering.py
    PYTHONPATH=$PWD python3 experiments/profile_lowering.py --preset micro --seq-len 64 \\
        --batch-size 8 --top 10                                   # a quick CPU run

Prints the seconds of each phase, then the profile sorted by own time (``--top``) and by
cumulative time (``2 * --top``).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import profile_step as ps  # experiments/profile_step.py (imports lab: the root on sys.path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--spec", default="nvfp4", help="recipe spec")
    p.add_argument("--no-scan", action="store_true", help="without --scan-layers")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--top", type=int, default=30, help="functions listed by own time")
    a = p.parse_args(argv)
    step, state, batch, key, _ = ps.build_step(a.preset, a.spec, not a.no_scan, a.batch_size,
                                               a.seq_len)
    t = time.time()
    traced = step.trace(state, batch, key)
    print("trace", time.time() - t, flush=True)
    prof = cProfile.Profile()
    prof.enable()
    t = time.time()
    lowered = traced.lower()
    print("lower", time.time() - t, flush=True)
    prof.disable()
    t = time.time()
    lowered.compile()
    print("compile", time.time() - t, flush=True)
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(a.top)
    st.sort_stats("cumulative").print_stats(2 * a.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
