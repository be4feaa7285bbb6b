"""cProfile of lowering the `small` NVFP4 `--scan-layers` train step on the GPU (trace, lower,
compile seconds; the profile's top functions). Run from the repository root:
PYTHONPATH=$PWD python3 <this file>."""

import cProfile
import pstats
import sys
import time

sys.path.insert(0, "experiments")
import profile_step as ps  # noqa: E402

step, state, batch, key, mc = ps.build_step("small", "nvfp4", True, 64, 256)
t = time.time()
tr = step.trace(state, batch, key)
print("trace", time.time() - t, flush=True)
pr = cProfile.Profile()
pr.enable()
t = time.time()
low = tr.lower()
print("lower", time.time() - t, flush=True)
pr.disable()
t = time.time()
low.compile()
print("compile", time.time() - t, flush=True)
st = pstats.Stats(pr)
st.sort_stats("tottime").print_stats(25)
st.sort_stats("cumulative").print_stats(60)
