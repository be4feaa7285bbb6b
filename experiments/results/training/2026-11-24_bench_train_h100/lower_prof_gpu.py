import os, sys, time, cProfile, pstats
sys.path.insert(0, "experiments")
import jax
import profile_step as ps
step, state, batch, key, mc = ps.build_step("small", "nvfp4", True, 64, 256)
t = time.time(); tr = step.trace(state, batch, key); print("trace", time.time() - t, flush=True)
pr = cProfile.Profile(); pr.enable()
t = time.time(); low = tr.lower(); print("lower", time.time() - t, flush=True)
pr.disable()
t = time.time(); c = low.compile(); print("compile", time.time() - t, flush=True)
st = pstats.Stats(pr); st.sort_stats("tottime").print_stats(25)
st.sort_stats("cumulative").print_stats(60)
