"""Shared helpers of the GPU lab scripts (``gpu_check.py``, ``bench_kernels.py``,
``profile_step.py``, ``bench_train.py``, ...): the run metadata every result JSON starts with
(device, JAX version, git commit, command line), a JSON writer that saves after every row (a
run stopped at its time limit keeps what it measured), device time by CUPTI (warm-up, then
the median), fresh inputs with the hard cases (NaN/Inf/-0, a 40-binade range, a tiny
tensor), bit comparisons in which NaN equals NaN, the XLA references of the kernels' outputs,
and ``fp4jax.dot`` under a chosen ``FP4JAX_KERNELS`` setting. The scripts import it as
``lab`` (a script's own folder is first on ``sys.path``); importing it puts the repository
root on ``sys.path``, so ``fp4jax`` and ``pallas_kernels`` import without installation.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

# ---------------------------------------------------------------------------
# Run metadata and result files.
# ---------------------------------------------------------------------------


def git_commit(explicit: str | None = None) -> str:
    """The commit the results belong to: ``explicit`` (a ``--commit`` flag), else the
    ``FP4JAX_COMMIT`` environment variable, else ``git rev-parse HEAD`` of this checkout
    (``+dirty`` when tracked files are modified), else ``"unknown"``. On the GPU machine
    pass the hash in (``FP4JAX_COMMIT=<sha>`` written into the device command): its copy of
    the working tree has a ``.git`` whose HEAD is not the commit being run (an older one
    was seen there, 2026-11-24)."""
    if explicit:
        return explicit
    if os.environ.get("FP4JAX_COMMIT"):
        return os.environ["FP4JAX_COMMIT"]
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], check=True,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain",
                                "--untracked-files=no"], check=True, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        if head:
            return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def run_info(script: str, argv: list[str], commit: str | None = None) -> dict:
    """What every result JSON starts with: the tool, the command line that reproduces it,
    device, JAX version, git commit, start time (UTC)."""
    dev = jax.devices()[0]
    return {
        "tool": Path(script).stem,
        "command": "PYTHONPATH=$PWD python3 experiments/" + Path(script).name
                   + "".join(" " + shlex.quote(a) for a in argv),
        "device": str(dev.device_kind),
        "platform": dev.platform,
        "device_count": jax.device_count(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "commit": git_commit(commit),
        "kernels_env": {k: os.environ[k] for k in ("FP4JAX_KERNELS", "FP4JAX_KERNEL_GEMM")
                        if k in os.environ},
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }


def arg_parser(doc: str, json_name: str, what: str, names_help: str
               ) -> argparse.ArgumentParser:
    """The lab tools' common command line: the names to run (``args.names``), ``--list``,
    ``--out`` (default ``$OUT/json_name``) and ``--commit``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", metavar=what.upper(), help=names_help)
    ap.add_argument("--list", action="store_true", help=f"list the {what}s and exit")
    ap.add_argument("--out", default=None, help=f"result JSON (default $OUT/{json_name})")
    ap.add_argument("--commit", default=None, help="git commit of the code (default: "
                    "$FP4JAX_COMMIT, else git rev-parse HEAD)")
    return ap


def default_out(name: str) -> str:
    """``$OUT/name`` (the device tool's output folder), else ``./name``."""
    return os.path.join(os.environ.get("OUT", "."), name)


class Results:
    """A result JSON (``meta`` plus lists of rows by section), rewritten after every row."""

    def __init__(self, path: str, meta: dict) -> None:
        self.path = path
        self.data = dict(meta)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.save()

    def add(self, section: str, row: dict, echo: bool = True) -> dict:
        self.data.setdefault(section, []).append(row)
        if echo:
            print(json.dumps(row, default=str), flush=True)
        self.save()
        return row

    def save(self) -> None:
        with open(self.path, "w") as f:
            json.dump(self.data, f, indent=1, default=str)

    def finish(self, **extra) -> None:
        self.data.update(extra, finished=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()))
        self.save()


def registry() -> tuple[dict, Callable]:
    """``(table, register)``: ``@register(name, doc)`` puts ``(fn, doc)`` in ``table[name]``
    (the checks of ``gpu_check.py``, the modes of ``bench_kernels.py``)."""
    table: dict = {}

    def register(name: str, doc: str):
        def add(fn):
            table[name] = (fn, doc)
            return fn
        return add

    return table, register


def error_text(e: BaseException, limit: int = 600) -> str:
    return f"{type(e).__name__}: {str(e)[:limit]}"


# ---------------------------------------------------------------------------
# Timing.
# ---------------------------------------------------------------------------


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


def lower_for_cuda(f, *args) -> int:
    """Lower ``jax.jit(f)(*args)`` for CUDA without running it (a CPU dry run of a GPU
    script); returns the number of ``mosaic_gpu`` mentions in the module."""
    lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    return lowered.as_text().count("mosaic_gpu")


# ---------------------------------------------------------------------------
# Inputs, comparisons, references.
# ---------------------------------------------------------------------------

INPUT_KINDS = {
    "normal": "standard normal",
    "wild": "normal times e^U(-8,8) per row, with -0, NaN, +Inf and -Inf planted",
    "wide40": "normal times 2^U(-20,20) per element (40 binades), with -0, NaN, +-Inf",
    "tiny": "normal times 1e-33 (decode scale outside the table reciprocal's exact range)",
    "blocks": "normal times 2^U(-14,8) per 1x16 block (every E4M3 scale code)",
    "tiles": "normal times 2^U(-14,8) per 16x16 tile (every E4M3 scale code)",
}


def make_input(shape: tuple[int, int], kind: str, seed: int, dtype=jnp.bfloat16) -> jax.Array:
    """A fresh (R, C) input of one of ``INPUT_KINDS``, made on the default device, bf16 (or
    ``dtype``: float32 keeps the full float32 mantissas of the random values)."""
    r, c = shape
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(k1, shape, jnp.float32)
    if kind == "wild":
        x = x * jnp.exp(jax.random.uniform(k2, (r, 1), minval=-8.0, maxval=8.0))
    elif kind == "wide40":
        x = x * jnp.exp2(jax.random.uniform(k2, shape, minval=-20.0, maxval=20.0))
    elif kind == "tiny":
        x = x * 1e-33
    elif kind in ("blocks", "tiles"):
        tr = 16 if kind == "tiles" else 1
        mag = jnp.exp2(jax.random.uniform(k2, (r // tr, 1, c // 16, 1), minval=-14.0,
                                          maxval=8.0))
        x = x * jnp.broadcast_to(mag, (r // tr, tr, c // 16, 16)).reshape(shape)
    elif kind != "normal":
        raise ValueError(f"input kind {kind!r}: use one of {sorted(INPUT_KINDS)}")
    if kind in ("wild", "wide40"):
        x = (x.at[0, :32].set(-0.0).at[3 % r, 7 % c].set(jnp.nan)
             .at[9 % r, 100 % c].set(jnp.inf).at[17 % r, 5 % c].set(-jnp.inf))
    return x.astype(dtype)


@jax.jit
def _differ(a, b):
    ut = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[a.dtype.itemsize]
    diff = jax.lax.bitcast_convert_type(a, ut) != jax.lax.bitcast_convert_type(b, ut)
    if jnp.issubdtype(a.dtype, jnp.floating):
        diff &= ~(jnp.isnan(a.astype(jnp.float32)) & jnp.isnan(b.astype(jnp.float32)))
    return jnp.sum(diff)


def mismatches(got, want) -> int:
    """How many elements of two same-dtype arrays differ in their bits; NaN equals any NaN
    (the XLA path's NaN payloads are not one bit pattern on the GPU)."""
    got, want = jnp.asarray(got), jnp.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        raise ValueError(f"{got.dtype}{got.shape} vs {want.dtype}{want.shape}")
    return int(_differ(got, want))


def same_bits(a, b) -> bool:
    """Every leaf of ``a`` equals the matching leaf of ``b`` bit for bit (NaN = NaN)."""
    a, b = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(a) == len(b) and all(
        u.shape == v.shape and mismatches(u, v) == 0 for u, v in zip(a, b, strict=True))


def xla_operand(x, *, axis: int = -1, block_2d: bool = False, key=None, signs=None):
    """The XLA path's NVFP4 GEMM operand, what every ``operand_sm90`` kernel must equal:
    ``(scaled_data(quantize(RHT(x) if signs is not None else x), bf16), dec)`` with 1x16
    blocks along ``axis`` (16x16 with ``block_2d``), stochastic rounding with ``key``."""
    import fp4jax
    from fp4jax import quantization as qz
    from fp4jax.hadamard import random_hadamard_transform
    xin = x if signs is None else random_hadamard_transform(x, axis=0, size=16, signs=signs)
    q = fp4jax.quantize(xin, fp4jax.NVFP4, axis=axis, block_2d=block_2d, key=key,
                        rounding="nearest" if key is None else "stochastic")
    return qz.scaled_data(q, jnp.bfloat16), q.global_scale


# ---------------------------------------------------------------------------
# fp4jax.dot with a chosen kernel setting.
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def kernel_env(kernels: str, gemm: str = "pallas"):
    """``FP4JAX_KERNELS=kernels`` and ``FP4JAX_KERNEL_GEMM=gemm`` inside the block (restored
    after). ``fp4jax.dot`` caches its custom_vjp per recipe (``_make_dot3``), so that cache
    and JAX's trace caches are cleared on entry: each setting traces anew."""
    env = {"FP4JAX_KERNELS": kernels, "FP4JAX_KERNEL_GEMM": gemm}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        from fp4jax import quantized_dot
        quantized_dot._make_dot3.cache_clear()
        jax.clear_caches()
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def dot_problem(m: int, k: int, n: int, seed: int = 0):
    """bf16 ``x`` (M, K) ~ N(0, 1), ``w`` (K, N) ~ 0.02 N(0, 1) and a random cotangent ``ct``
    (M, N): passed as an argument, so XLA cannot constant-fold the backward's quantization
    (a closed-over or all-ones cotangent lets it, KERNELS.md run 3)."""
    kx, kw, kc = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = (0.02 * jax.random.normal(kw, (k, n), jnp.float32)).astype(jnp.bfloat16)
    ct = jax.random.normal(kc, (m, n), jnp.float32).astype(jnp.bfloat16)
    return x, w, ct


def dot_loss(recipe=None, key=None, with_y: bool = False, out_dtype=None):
    """``loss(x, w, ct) = sum(fp4jax.dot(x, w) * ct)`` (float32), and ``y`` as an auxiliary
    output with ``with_y``. Its ``value_and_grad`` is the recipe's forward + backward:
    nothing is dropped (``grad`` alone lets XLA drop the forward GEMM). ``out_dtype``:
    ``fp4jax.dot``'s ``preferred_element_type`` (default ``result_type(x, w)``)."""
    import fp4jax

    recipe = fp4jax.recipes.nvfp4() if recipe is None else recipe
    key = jax.random.key(7) if key is None else key

    def loss(x, w, ct):
        y = fp4jax.dot(x, w, recipe=recipe, key=key, preferred_element_type=out_dtype)
        v = (y.astype(jnp.float32) * ct.astype(jnp.float32)).sum()
        return (v, y) if with_y else v

    return loss
