"""Device-event timing helpers shared by the kernel GPU scripts (warm-up + median)."""

from __future__ import annotations

import statistics
import time

import jax


def time_fn(f, *args, iterations: int = 20, warmup: int = 2) -> dict:
    """Median device time (µs) of ``f(*args)`` summed over all kernels it launches.

    Uses CUPTI through ``jax.experimental.mosaic.gpu.profiler.measure``; falls back to
    synchronized wall clock (which includes dispatch) if CUPTI is unavailable.
    """
    for _ in range(warmup):
        jax.block_until_ready(f(*args))
    try:
        from jax.experimental.mosaic.gpu import profiler

        _, times_ms = profiler.measure(f, iterations=iterations)(*args)
        if times_ms is None:
            raise RuntimeError("no kernels measured")
        if not isinstance(times_ms, list):
            times_ms = [times_ms]
        us = [t * 1e3 for t in times_ms]
        method = "cupti"
    except Exception as e:  # noqa: BLE001
        us = []
        for _ in range(iterations):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            us.append((time.perf_counter() - t0) * 1e6)
        method = f"wallclock ({type(e).__name__}: {str(e)[:80]})"
    return {
        "median_us": statistics.median(us),
        "min_us": min(us),
        "max_us": max(us),
        "n": len(us),
        "method": method,
    }
