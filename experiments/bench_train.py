"""Training throughput and cold compile time of the harness's step, per recipe; the
training loop against a bare loop of the same step; fwd + bwd GEMM times per recipe.

For each preset (``--presets``, default ``small 100m``) and each configuration
(``--configs``, default ``bf16 bf16:scan nvfp4:scan nvfp4 mxfp4:scan mxfp4``; syntax
``SPEC[:scan][:fp4gather][:harness]``, ``SPEC`` a recipe spec as ``fp4jax-train --recipe``
takes it, run-level keys included, ``:scan`` for ``--scan-layers``, ``:fp4gather`` for
``--fp4-param-gather``, ``:harness`` below; ``bare`` is ``bf16`` by this minimal loop, named
so in the table) it builds the
step ``fp4jax-train`` compiles, as ``profile_step.build_step`` does (``TrainConfig``,
``run_recipe``, ``model_config``, ``Llama``, ``make_policy``, ``make_optimizer``,
``make_mesh(1)``, ``make_init_state``, ``make_train_step``; random int32 tokens ``(batch,
seq_len + 1)`` below 256), and measures:

* **cold compile**: the wall seconds of ``step.trace(state, batch, key)``, ``.lower()`` and
  ``.compile()`` on the harness's own jitted step (donated state, its out_shardings), which
  is what the first call of a training run pays before its first step: ``compile_s`` is the
  sum, ``trace_s``, ``lower_s`` (to StableHLO) and ``xla_compile_s`` its parts. Every
  configuration runs in a fresh process (this script re-invoked with ``--one``) with JAX's
  persistent compilation cache off (``JAX_ENABLE_COMPILATION_CACHE=false``, no
  ``JAX_COMPILATION_CACHE_DIR``, both also set by ``jax.config`` in the child) and
  ``CUDA_CACHE_DISABLE=1``, so nothing compiled earlier is reused. ``first_call_s`` is the
  first execution (kernels that compile at load time, e.g. Mosaic GPU's, land there).
* **step time**: the compiled step called with the state threaded through (it is donated),
  2 warm-up calls, then ``PIPELINE_WINDOWS`` windows of ``--iterations`` calls dispatched
  back to back with one wait at the end of each, as ``fp4jax-train``'s loop runs them (it
  reads a step's metrics while the next one runs): ``pipelined_step_s`` is the median over
  the windows of their mean step time and **``tokens_per_s`` = batch x seq_len /
  pipelined_step_s** (since 2026-11-25; before, it was the synchronous median below, which
  adds the host's dispatch time to every step: 3 ms of a 19-ms bf16 step and 6 ms of a
  29-ms NVFP4 step at ``small``). ``step_median_s`` (min, max) times ``--iterations``
  calls each from dispatch to ``jax.block_until_ready`` of the new state and metrics;
  ``tokens_per_s_synced`` = batch x seq_len / that median.

**The training loop** (``:harness``): the configuration run by ``fp4jax.train.train`` itself
for ``--harness-steps`` steps (default 200) on uniform random bytes, ``TrainConfig``'s
defaults otherwise (progress bar, validation every 20 steps, a record every 10, the final
checkpoint), in a fresh process with the cache off; ``tokens_per_s`` is the run's own
(``result.json``'s: the first two steps, evaluations and checkpoints left out),
``tokens_per_s_windows_median`` the median of its ``"train"`` records' windows (the first
left out), ``vs_bare_loop`` its tokens/s over the row of the same step without
``:harness`` (``bare`` for ``bf16:harness``): the harness's cost over a bare loop, measured
in one call on one GPU. No compile columns (the run compiles inside ``train``;
``train_wall_s`` includes it).

**The GEMM table** (``--gemm``, or ``--gemm-only`` without the configurations): in one more
fresh process, for 8192^3 and each preset's linear-layer shapes (M = batch x seq_len
tokens; q/k/v/o, gate/up, down; ``--gemm-shapes MxKxN ...`` instead), ``jax.value_and_grad``
with respect to both operands of ``sum(dot(x, w) * ct)`` (the forward GEMM and both backward
GEMMs, ``lab.dot_loss``) for bf16 ``jnp.dot`` and ``fp4jax.dot`` under each of
``--gemm-recipes`` (default ``bf16 nvfp4 mxfp4``), timed by ``lab.time_fn`` (CUPTI device
time of every kernel, median of ``--gemm-iterations`` after warm-up; synchronized wall
clock where CUPTI is missing, said in ``method``); each row has ``vs_jnp_dot`` and
``tflops`` (6 M K N over the median); the JSON's ``"gemm"``.

A configuration that does not finish within ``--timeout-s`` (default 240; the whole child
process: imports, init, compile, timing) gets a row with ``"status": "timeout"``, the seconds
waited and whatever the child had measured (its compile seconds if it got that far); a
child that fails gets ``"status": "error"`` and its error. Neither stops the script.

Per preset the parent adds ``vs_fastest_bf16`` (tokens/s over the fastest configuration
whose recipe quantizes nothing, the issue's "vs fastest bf16") and ``compile_vs_bf16``
(``compile_s`` over that of the first unquantized configuration without ``:scan``), prints
a markdown table per preset and writes ``bench_train.json`` to ``--out`` (default ``$OUT``,
else ``./bench_out``): ``lab.run_info`` (device, JAX version, commit, command; the device
fields come from the children, the parent never touches the accelerator) and the rows,
rewritten after every configuration, so a call cut off keeps what finished.

On the GPU machine, from the repository root (the defaults need several cold NVFP4 compiles:
give one preset per call, or ``--time-limit``, to stay within a 600 s device call):

    FP4JAX_COMMIT=<sha> PYTHONPATH=$PWD python3 experiments/bench_train.py \\
        [--presets small 100m] [--configs bf16 bf16:scan nvfp4:scan nvfp4 mxfp4:scan] \\
        [--batch-size 64 --seq-len 256 --iterations 20 --timeout-s 240 --time-limit S]

FSDP parameter gather in FP4 (issue 37 item 1): a configuration with ``:fp4gather``
(``--fp4-param-gather``) beside the same one without, on 2-4 devices with ``--fsdp`` equal
to them; each row records ``all_gather_bytes`` (what the compiled step's all-gathers
return, by dtype: float32 master weights, or uint8 codes and tile amaxes) and the
``:fp4gather`` row ``all_gather_bytes_vs_plain`` and ``tokens_per_s_vs_plain``; the table
has an all-gather MB column:

    FP4JAX_COMMIT=<sha> PYTHONPATH=$PWD python3 experiments/bench_train.py \\
        --presets small --configs nvfp4 nvfp4:fp4gather --devices 2 --fsdp 2 \\
        --batch-size 64 --seq-len 256

The training loop against a bare loop, the FP4 recipes and the GEMM table at ``small``, one
device call (4 cold processes and the GEMM process; not yet run: its time on an H100 is
estimated from issue 56's process walls, 32 s bf16 / 78 s NVFP4 / 46 s MXFP4 each, plus a
second compile in each ``:harness`` row), from the repository root:

    FP4JAX_COMMIT=<sha> PYTHONPATH=$PWD python3 experiments/bench_train.py \
        --presets small --configs bare bf16:harness nvfp4:harness mxfp4:harness \
        --gemm --time-limit 560 --timeout-s 200 --gemm-timeout-s 200

(``nvfp4`` and ``mxfp4`` without ``:harness`` add the minimal loop's FP4 rows, and so the
FP4 runs' harness cost, at one more cold compile each.)

On a CPU it runs as is, slowly (``--presets micro --batch-size 4 --seq-len 32``);
``--dry-run`` checks the presets and configurations and prints the child commands (and
with ``--gemm`` the GEMM table's problems) without running them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import lab  # before fp4jax: puts the repository root on sys.path

from fp4jax.models.llama import ATTENTION, SCAN_REMAT, LlamaConfig, resolve_attention
from fp4jax.train.cli import THREEFRY_LOWERINGS, set_threefry_lowering, threefry_lowering

JSON_NAME = "bench_train.json"
DEFAULT_PRESETS = ("small", "100m")
DEFAULT_CONFIGS = ("bf16", "bf16:scan", "nvfp4:scan", "nvfp4", "mxfp4:scan", "mxfp4")
TAG = "@@bench_train "  # prefix of the child's JSON lines on stdout
WARMUP = 2
PIPELINE_WINDOWS = 5  # pipelined windows of --iterations steps each (median taken)
# the child's last stage line -> what it was doing when it stopped
RUNNING = {"started": "building", "built": "compiling", "compiled": "running"}
# what the child's environment gets (and loses) so that its compile is cold
CHILD_ENV = {"JAX_ENABLE_COMPILATION_CACHE": "false", "CUDA_CACHE_DISABLE": "1"}
CHILD_ENV_DROP = ("JAX_COMPILATION_CACHE_DIR",)


# ---------------------------------------------------------------------------
# Configurations.
# ---------------------------------------------------------------------------


SUFFIXES = ("scan", "fp4gather", "harness")
"""A configuration's options after its spec: ``:scan`` (``--scan-layers``),
``:fp4gather`` (``--fp4-param-gather``: with ``--fsdp`` 2 or more, the weights of the 2D
NVFP4 layers gathered as packed FP4 codes; the row then records the all-gather bytes of
the compiled step beside those of the same configuration without it) and ``:harness``
(the whole training loop, ``fp4jax.train.train``, instead of the minimal loop:
``measure_harness``)."""

BARE = "bare"
"""The configuration ``bare`` (``bare[:scan]``): the ``bf16`` recipe's step timed by the
minimal loop, as every configuration without ``:harness`` is; named so that a call's table
shows the loop the ``:harness`` rows are compared with (``vs_bare_loop``)."""


def config_options(text: str) -> tuple[str, set[str]]:
    """``"SPEC[:scan][:fp4gather][:harness]"`` -> ``(SPEC, {options})``; ``bare`` ->
    ``("bf16", {"bare", ...})``.

    Raises:
      ValueError: an empty spec, an unknown or repeated suffix, ``bare:harness``, or a
        bad spec.
    """
    spec, *opts = text.strip().split(":")
    spec = spec.strip()
    if not spec:
        raise ValueError(f"{text!r}: empty recipe spec")
    bad = [o for o in opts if o.strip() not in SUFFIXES]
    if bad or len(set(opts)) != len(opts):
        raise ValueError(f"{text!r}: the suffixes are {', '.join(':' + x for x in SUFFIXES)} "
                         "(SPEC, SPEC:scan, SPEC:fp4gather, SPEC:harness, ...), each once")
    options = {o.strip() for o in opts}
    if spec == BARE:
        if "harness" in options:
            raise ValueError(f"{text!r}: 'bare' is the minimal loop; the harness's BF16 run "
                             "is bf16:harness")
        return "bf16", options | {BARE}
    quantized(spec)  # raises for a bad spec
    return spec, options


def harness(config: str) -> bool:
    """Whether the configuration runs the whole training loop (``:harness``)."""
    return "harness" in config_options(config)[1]


def split_config(text: str) -> tuple[str, bool]:
    """``"SPEC[:scan][:fp4gather]"`` -> ``(SPEC, scan_layers)`` (``config_options``); the
    spec is checked by ``fp4jax.train.config.run_recipe`` (run-level keys and recipe spec).

    Raises:
      ValueError: an empty spec, a suffix other than ``:scan``/``:fp4gather``, or a bad spec.
    """
    spec, opts = config_options(text)
    return spec, "scan" in opts


def fp4_gather(config: str) -> bool:
    """Whether the configuration gathers its weights in FP4 (``:fp4gather``)."""
    return "fp4gather" in config_options(config)[1]


def quantized(spec: str) -> bool:
    """Whether the recipe of ``spec`` quantizes any GEMM operand (``False``: a BF16 row).

    Raises:
      ValueError: a bad spec (``run_recipe``'s message).
    """
    from fp4jax.train.config import TrainConfig, run_recipe

    try:
        _, recipe = run_recipe(TrainConfig(recipe=spec))
    except (TypeError, ValueError) as e:
        raise ValueError(str(e)) from None
    return recipe.quantized


def _config_arg(text: str) -> str:
    try:
        split_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text.strip()


def _preset_arg(name: str) -> str:
    from fp4jax.models.llama import get_preset

    try:
        get_preset(name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} < 1")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return v


# ---------------------------------------------------------------------------
# The child: one configuration in a fresh process.
# ---------------------------------------------------------------------------


def _emit(rec: dict[str, Any]) -> None:
    print(TAG + json.dumps(rec, default=str), flush=True)


def scan_remat_in_effect(requested: str | None, scan: bool) -> str | None:
    """What a configuration's scanned blocks save (``--scan-remat``, else the model's
    default), None without ``:scan``."""
    return (requested or LlamaConfig.scan_remat) if scan else None


def measure_one(preset: str, config: str, batch_size: int, seq_len: int,
                iterations: int, devices: int = 1, attention: str = "auto",
                scan_remat: str | None = None, fsdp: int = 1) -> dict[str, Any]:
    """Builds, cold-compiles and times one configuration in this process; emits a tagged
    JSON line after each stage (the parent keeps the last one of a child it stops)."""
    for name, value in (("jax_enable_compilation_cache", False),
                        ("jax_compilation_cache_dir", None)):
        try:  # the environment (CHILD_ENV) already says so; this also covers a config file
            jax.config.update(name, value)
        except (AttributeError, KeyError, ValueError):  # an option a later JAX dropped
            pass
    from profile_step import build_step  # the harness's step, as profile_step builds it

    spec, scan = split_config(config)
    dev = jax.devices()[0]
    rec: dict[str, Any] = {
        "preset": preset, "config": config, "spec": spec, "scan_layers": scan,
        "quantized": quantized(spec), "batch_size": batch_size, "seq_len": seq_len,
        "tokens_per_step": batch_size * seq_len, "device": str(dev.device_kind),
        "platform": dev.platform, "device_count": jax.device_count(), "jax": jax.__version__,
        "devices": devices, "fsdp": fsdp, "attention": attention,
        "fp4_param_gather": fp4_gather(config),
        "attention_resolved": resolve_attention(attention),
        "scan_remat": scan_remat_in_effect(scan_remat, scan),
        "threefry_lowering": threefry_lowering(),
    }
    try:
        from jax._src import compilation_cache as cc

        rec["persistent_cache"] = bool(cc.is_persistent_cache_enabled())
    except (ImportError, AttributeError):
        rec["persistent_cache"] = None
    t = time.perf_counter()
    step, state, batch, key, mc = build_step(preset, spec, scan, batch_size, seq_len, devices,
                                             attention, scan_remat, fsdp, fp4_gather(config))
    jax.block_until_ready(state)
    rec["params"] = mc.num_params()
    rec["build_s"] = round(time.perf_counter() - t, 3)
    _emit(rec | {"stage": "built"})

    # the harness's own jitted step (donate_argnums=0, out_shardings): what train() compiles
    t0 = time.perf_counter()
    traced = step.trace(state, batch, key)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    rec.update(trace_s=round(t1 - t0, 3), lower_s=round(t2 - t1, 3),
               xla_compile_s=round(t3 - t2, 3), compile_s=round(t3 - t0, 3))
    try:
        hlo = compiled.as_text()
        rec["hlo_chars"] = len(hlo)
        rec["fusions"] = hlo.count(" fusion(")
        rec.update(all_gather_bytes(hlo))
    except Exception as e:  # noqa: BLE001 (informational only)
        rec["hlo_error"] = lab.error_text(e, 200)
    try:
        mem = compiled.memory_analysis()
        rec["temp_bytes"] = int(mem.temp_size_in_bytes)
    except Exception:  # noqa: BLE001 (not every backend reports it)
        pass
    _emit(rec | {"stage": "compiled"})

    def call(s):
        s, metrics = compiled(s, batch, key)
        return s, metrics

    t = time.perf_counter()
    state, metrics = call(state)
    jax.block_until_ready((state, metrics))
    rec["first_call_s"] = round(time.perf_counter() - t, 4)
    for _ in range(WARMUP - 1):
        state, metrics = call(state)
        jax.block_until_ready((state, metrics))
    times = []
    for _ in range(iterations):
        t = time.perf_counter()
        state, metrics = call(state)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t)
    windows = []
    for _ in range(PIPELINE_WINDOWS):
        t = time.perf_counter()
        for _ in range(iterations):
            state, metrics = call(state)
        jax.block_until_ready((state, metrics))
        windows.append((time.perf_counter() - t) / iterations)
    pipelined = statistics.median(windows)
    med = statistics.median(times)
    rec.update(step_median_s=med, step_min_s=min(times), step_max_s=max(times),
               iterations=iterations, warmup=WARMUP, pipelined_step_s=pipelined,
               pipelined_windows_s=windows, tokens_per_s=batch_size * seq_len / pipelined,
               tokens_per_s_synced=batch_size * seq_len / med,
               final_loss=float(metrics["loss"]), status="ok")
    _emit(rec | {"stage": "done"})
    return rec


def harness_dataset(batch_size: int, seq_len: int, steps: int, eval_batches: int,
                    seed: int = 0):
    """A byte dataset of uniform random bytes (the same token distribution as
    ``build_step``'s batch), large enough that ``steps`` batches do not wrap an epoch and
    ``eval_batches`` validation batches fit."""
    import numpy as np

    from fp4jax.train.data import ByteDataset

    rng = np.random.default_rng(seed)
    n_train = (steps + 1) * batch_size * seq_len + seq_len + 1
    n_val = max(eval_batches, 1) * batch_size * seq_len + seq_len + 1
    return ByteDataset(rng.integers(0, 256, n_train, dtype=np.uint8),
                       rng.integers(0, 256, n_val, dtype=np.uint8), seq_len)


def measure_harness(preset: str, config: str, batch_size: int, seq_len: int, steps: int,
                    devices: int = 1, attention: str = "auto", scan_remat: str | None = None,
                    fsdp: int = 1) -> dict[str, Any]:
    """Runs ``fp4jax.train.train`` as ``fp4jax-train`` would for this configuration (the
    config's defaults otherwise: the progress bar, validation every ``eval_every`` steps,
    a ``"train"`` record every ``log_every``, a checkpoint at the end) for ``steps`` steps
    on ``harness_dataset`` in a temporary ``--out``, and emits its row: ``tokens_per_s``
    is the run's own (``result.json``: steps after the first two, evaluations and
    checkpoints taken out), ``tokens_per_s_windows_median`` the median of its ``"train"``
    records' windows after the first (which holds the compilation), ``train_wall_s`` the
    run's wall seconds (compilation and first step included)."""
    import tempfile

    from fp4jax.train import TrainConfig, train

    for name, value in (("jax_enable_compilation_cache", False),
                        ("jax_compilation_cache_dir", None)):
        try:
            jax.config.update(name, value)
        except (AttributeError, KeyError, ValueError):
            pass
    spec, opts = config_options(config)
    scan = "scan" in opts
    dev = jax.devices()[0]
    rec: dict[str, Any] = {
        "preset": preset, "config": config, "spec": spec, "scan_layers": scan,
        "quantized": quantized(spec), "harness": True, "batch_size": batch_size,
        "seq_len": seq_len, "tokens_per_step": batch_size * seq_len,
        "device": str(dev.device_kind), "platform": dev.platform,
        "device_count": jax.device_count(), "jax": jax.__version__, "devices": devices,
        "fsdp": fsdp, "attention": attention, "fp4_param_gather": "fp4gather" in opts,
        "attention_resolved": resolve_attention(attention),
        "scan_remat": scan_remat_in_effect(scan_remat, scan),
        "threefry_lowering": threefry_lowering(), "harness_steps": steps,
    }
    _emit(rec | {"stage": "built"})
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(preset=preset, recipe=spec, scan_layers=scan, steps=steps,
                          batch_size=batch_size, seq_len=seq_len, devices=devices, fsdp=fsdp,
                          attention=attention, scan_remat=scan_remat if scan else None,
                          fp4_param_gather="fp4gather" in opts, out=out)
        rec.update(eval_every=cfg.eval_every, eval_batches=cfg.eval_batches,
                   log_every=cfg.log_every, progress=cfg.progress)
        ds = harness_dataset(batch_size, seq_len, steps, cfg.eval_batches)
        t = time.perf_counter()
        res = train(cfg, dataset=ds)
        rec["train_wall_s"] = round(time.perf_counter() - t, 3)
        windows = [json.loads(x) for x in Path(out, "metrics.jsonl").read_text().splitlines()]
        windows = [r["tokens_per_s"] for r in windows if r.get("type") == "train"][1:]
    rec.update(tokens_per_s=res["tokens_per_s"], params=res["params"],
               tokens_per_s_windows_median=(statistics.median(windows) if windows else None),
               final_loss=res["final_train_loss"], status="ok")
    _emit(rec | {"stage": "done"})
    return rec


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def all_gather_bytes(hlo: str) -> dict[str, Any]:
    """What the all-gathers of a compiled HLO module return (an all-gather's result: every
    device receives it, all but its own shard over the links): ``all_gather_bytes`` (sum
    over them; a loop body counted once: the harness's step has no loop around its
    parameter gathers unless ``:scan``, whose stacked kernels are gathered before the scan)
    and ``all_gather_bytes_by_dtype`` (``{"u8": ..., "f32": ...}``)."""
    by: dict[str, int] = {}
    for line in hlo.splitlines():
        # the substring test first: the regex backtracks over a long line's every "=" (a
        # Mosaic GPU kernel's serialized module is one line of its custom call), which took
        # ~3 minutes on the 85 MB HLO of the 100m NVFP4 step
        if "all-gather" not in line:
            continue
        m = re.search(r"=\s*(\(.*?\)|\S+)\s+all-gather(?:-start)?\(", line)
        if not m:
            continue
        for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1)):
            n = 1
            for d in dims.split(","):
                n *= int(d) if d else 1
            by[dt] = by.get(dt, 0) + n * _DTYPE_BYTES.get(dt, 0)
    return {"all_gather_bytes": sum(by.values()), "all_gather_bytes_by_dtype": by}


# ---------------------------------------------------------------------------
# The GEMM table: fp4jax.dot's forward + backward per recipe against bf16 jnp.dot.
# ---------------------------------------------------------------------------

GEMM_RECIPES = ("bf16", "nvfp4", "mxfp4")
GEMM_CUBE = (8192, 8192, 8192)


def parse_shape(text: str) -> tuple[int, int, int]:
    """``"MxKxN"`` -> ``(M, K, N)``.

    Raises:
      ValueError: not three positive integers joined by ``x``."""
    parts = text.lower().split("x")
    try:
        dims = tuple(int(d) for d in parts)
    except ValueError:
        dims = ()
    if len(dims) != 3 or min(dims) < 1:
        raise ValueError(f"{text!r}: a GEMM shape is MxKxN, three positive integers")
    return dims  # type: ignore[return-value]


def preset_gemms(preset: str, tokens: int) -> list[tuple[str, tuple[int, int, int]]]:
    """The linear layers of a block of ``preset`` as ``(names, (M, K, N))`` (``M``: the
    tokens of a step, ``tokens``), one entry per distinct shape, names joined by ``/``
    (``"q/o"``): attention projections q, k, v, o; the FFN's up (and gate), down. The LM
    head and the embedding stay in BF16 in every recipe and are not listed."""
    from fp4jax.models.llama import get_preset

    c = get_preset(preset)
    d, kv = c.d_model, c.n_kv_heads * c.head_dim
    layers = [("q", (d, d)), ("k", (d, kv)), ("v", (d, kv)), ("o", (d, d))]
    if c.gated:
        layers.append(("gate", (d, c.d_ff)))
    layers += [("up", (d, c.d_ff)), ("down", (c.d_ff, d))]
    by: dict[tuple[int, int, int], list[str]] = {}
    for name, (k, n) in layers:
        by.setdefault((tokens, k, n), []).append(name)
    return [("/".join(names), shape) for shape, names in by.items()]


def gemm_shapes(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The GEMM table's problems: ``--gemm-shapes`` if given, else 8192^3 and each preset's
    linear-layer shapes at ``--batch-size`` x ``--seq-len`` tokens (``preset_gemms``)."""
    if args.gemm_shapes:
        return [{"source": "--gemm-shapes", "layers": None, "shape": list(parse_shape(s))}
                for s in args.gemm_shapes]
    probs = [{"source": "cube", "layers": None, "shape": list(GEMM_CUBE)}]
    for preset in args.presets:
        for names, shape in preset_gemms(preset, args.batch_size * args.seq_len):
            probs.append({"source": preset, "layers": names, "shape": list(shape)})
    return probs


def gemm_child(args: argparse.Namespace) -> int:
    """Times each problem of ``gemm_shapes``: ``jax.value_and_grad`` with respect to both
    operands of ``sum(dot(x, w) * ct)`` (``lab.dot_problem``'s operands; fwd + the two
    backward GEMMs), for bf16 ``jnp.dot`` and for ``fp4jax.dot`` under each of
    ``--gemm-recipes`` (``lab.dot_loss``), each with ``lab.time_fn`` (CUPTI device time of
    every kernel, median after warm-up; synchronized wall clock where CUPTI is missing,
    as ``method`` says); one tagged line per measurement."""
    import fp4jax

    for name, value in (("jax_enable_compilation_cache", False),
                        ("jax_compilation_cache_dir", None)):
        try:
            jax.config.update(name, value)
        except (AttributeError, KeyError, ValueError):
            pass
    import jax.numpy as jnp

    def jnp_loss(x, w, ct):
        return (jnp.dot(x, w).astype(jnp.float32) * ct.astype(jnp.float32)).sum()

    dev = jax.devices()[0]
    for prob in gemm_shapes(args):
        m, k, n = prob["shape"]
        x, w, ct = lab.dot_problem(m, k, n)
        base = {**prob, "device": str(dev.device_kind), "platform": dev.platform,
                "flops": 6 * m * k * n}
        for recipe in ("jnp.dot", *args.gemm_recipes):
            row = {**base, "recipe": recipe}
            try:
                loss = (jnp_loss if recipe == "jnp.dot"
                        else lab.dot_loss(fp4jax.recipes.get(recipe)))
                f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
                row.update(lab.time_fn(f, x, w, ct, iterations=args.gemm_iterations))
                row["status"] = "ok"
            except Exception as e:  # noqa: BLE001 (a row, not the end of the table)
                row.update(status="error", error=lab.error_text(e))
            _emit({"gemm_row": row})
        del x, w, ct
    return 0


def _gemm_rows(stdout: str | bytes | None) -> list[dict[str, Any]]:
    if isinstance(stdout, bytes):
        stdout = stdout.decode(errors="replace")
    rows = []
    for line in (stdout or "").splitlines():
        if line.startswith(TAG):
            try:
                rec = json.loads(line[len(TAG):])
            except json.JSONDecodeError:
                continue
            if "gemm_row" in rec:
                rows.append(rec["gemm_row"])
    return rows


def gemm_command(args: argparse.Namespace) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--gemm-one",
            "--presets", *args.presets, "--batch-size", str(args.batch_size),
            "--seq-len", str(args.seq_len), "--gemm-recipes", *args.gemm_recipes,
            "--gemm-iterations", str(args.gemm_iterations),
            *(["--gemm-shapes", *args.gemm_shapes] if args.gemm_shapes else []),
            "--threefry", args.threefry]


def run_gemm(args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    """The GEMM table in a fresh process: ``{"status", "rows", ...}`` (a child stopped at
    ``timeout`` or failing keeps the rows it finished)."""
    t = time.perf_counter()
    try:
        r = subprocess.run(gemm_command(args), env=child_env(), capture_output=True,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return {"status": "timeout", "waited_s": round(time.perf_counter() - t, 1),
                "rows": gemm_ratios(_gemm_rows(e.stdout))}
    out = {"status": "ok" if r.returncode == 0 else "error",
           "wall_s": round(time.perf_counter() - t, 1),
           "rows": gemm_ratios(_gemm_rows(r.stdout))}
    if r.returncode != 0:
        out["stderr_tail"] = (r.stderr or "")[-2000:]
    return out


def gemm_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row gets ``vs_jnp_dot`` (its median time over bf16 ``jnp.dot``'s of the same
    shape: below 1 is faster) and ``tflops`` (6 M K N over its median time)."""
    for r in rows:
        ref = next((o for o in rows if o["shape"] == r["shape"] and o["recipe"] == "jnp.dot"
                    and o.get("status") == "ok"), None)
        ok = r.get("status") == "ok"
        r["vs_jnp_dot"] = r["median_us"] / ref["median_us"] if ok and ref else None
        r["tflops"] = r["flops"] / (r["median_us"] * 1e-6) / 1e12 if ok else None
    return rows


def gemm_table(rows: list[dict[str, Any]]) -> str:
    """The GEMM table in markdown: a line per shape, per recipe its median µs and its ratio
    to bf16 ``jnp.dot``."""
    recipes = list(dict.fromkeys(r["recipe"] for r in rows))
    out = ["### fwd + bwd GEMMs (value_and_grad of sum(dot(x, w) * ct)), median µs "
           "(ratio to bf16 jnp.dot)", "",
           "| shape M x K x N | layers | " + " | ".join(recipes) + " |",
           "| --- | --- |" + " ---: |" * len(recipes)]
    for shape in dict.fromkeys(tuple(r["shape"]) for r in rows):
        mine = {r["recipe"]: r for r in rows if tuple(r["shape"]) == shape}
        first = next(iter(mine.values()))
        where = (first["layers"] and f"{first['source']}: {first['layers']}") or first["source"]
        cells = []
        for rc in recipes:
            r = mine.get(rc)
            if r is None:
                cells.append("")
            elif r.get("status") != "ok":
                cells.append(f"error ({r.get('error', '')[:40]})")
            else:
                cells.append(f"{r['median_us']:,.0f} ({r['vs_jnp_dot']:.2f}x)")
        out.append(f"| {'x'.join(map(str, shape))} | {where} | " + " | ".join(cells) + " |")
    method = {r.get("method", "")[:9] for r in rows if r.get("status") == "ok"}
    out += ["", f"timing: {', '.join(sorted(method)) or 'n/a'}", ""]
    return "\n".join(out)


def child_main(args: argparse.Namespace) -> int:
    set_threefry_lowering(args.threefry)  # as fp4jax-train --threefry does
    if args.gemm_one:
        return gemm_child(args)
    preset, config = args.one
    try:
        if harness(config):
            measure_harness(preset, config, args.batch_size, args.seq_len, args.harness_steps,
                            args.devices[0], args.attention, args.scan_remat, args.fsdp)
        else:
            measure_one(preset, config, args.batch_size, args.seq_len, args.iterations,
                        args.devices[0], args.attention, args.scan_remat, args.fsdp)
    except Exception as e:  # noqa: BLE001 (reported to the parent as the row's error)
        _emit({"error": lab.error_text(e)})  # the last stage line says where
        raise
    return 0


# ---------------------------------------------------------------------------
# The parent: one child per configuration, ratios, table, JSON.
# ---------------------------------------------------------------------------


def _last_record(stdout: str | bytes | None) -> dict[str, Any]:
    """The child's last tagged JSON line, merged over the earlier ones ({} if none)."""
    if isinstance(stdout, bytes):
        stdout = stdout.decode(errors="replace")
    rec: dict[str, Any] = {}
    for line in (stdout or "").splitlines():
        if line.startswith(TAG):
            try:
                rec.update(json.loads(line[len(TAG):]))
            except json.JSONDecodeError:
                pass
    return rec


def child_env() -> dict[str, str]:
    env = dict(os.environ, **CHILD_ENV)
    for k in CHILD_ENV_DROP:
        env.pop(k, None)
    return env


def batch_for(args: argparse.Namespace, devices: int) -> int:
    """The global batch of a run on ``devices`` devices: ``--batch-per-device`` times the
    devices (weak scaling), else ``--batch-size``."""
    return args.batch_per_device * devices if args.batch_per_device else args.batch_size


def child_command(args: argparse.Namespace, preset: str, config: str, devices: int = 0
                  ) -> list[str]:
    devices = devices or args.devices[0]
    return [sys.executable, str(Path(__file__).resolve()), "--one", preset, config,
            "--batch-size", str(batch_for(args, devices)), "--seq-len", str(args.seq_len),
            "--iterations", str(args.iterations), "--devices", str(devices),
            *(["--harness-steps", str(args.harness_steps)] if harness(config) else []),
            "--fsdp", str(args.fsdp),
            "--attention", args.attention,
            *(["--scan-remat", args.scan_remat] if args.scan_remat else []),
            "--threefry", args.threefry]


def run_child(args: argparse.Namespace, preset: str, config: str, timeout: float,
              devices: int = 0) -> dict[str, Any]:
    """One configuration in a fresh process: its row (status ok, timeout or error)."""
    spec, scan = split_config(config)
    devices = devices or args.devices[0]
    base = {"preset": preset, "config": config, "spec": spec, "scan_layers": scan,
            "quantized": quantized(spec), "devices": devices, "fsdp": args.fsdp,
            "fp4_param_gather": fp4_gather(config), "harness": harness(config),
            "batch_size": batch_for(args, devices)}
    t = time.perf_counter()
    try:
        r = subprocess.run(child_command(args, preset, config, devices), env=child_env(),
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        rec = base | _last_record(e.stdout)
        rec.update(status="timeout", waited_s=round(time.perf_counter() - t, 1),
                   stopped_in=RUNNING.get(rec.pop("stage", "started"), "?"))
        return rec
    rec = base | _last_record(r.stdout)
    rec["wall_s"] = round(time.perf_counter() - t, 1)
    stage = rec.pop("stage", None)
    if r.returncode != 0 or stage != "done":
        rec["status"] = "error"
        rec["stopped_in"] = RUNNING.get(stage or "started", "?")
        rec["returncode"] = r.returncode
        rec.setdefault("error", "no result")
        rec["stderr_tail"] = (r.stderr or "")[-2000:]
    return rec


def group_key(r: dict[str, Any]) -> tuple:
    """The rows compared with each other: one preset on one mesh (devices, fsdp)."""
    return r["preset"], r.get("devices", 1), r.get("fsdp", 1)


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Per preset and mesh (``group_key``): ``vs_fastest_bf16`` and ``compile_vs_bf16`` on
    every row (None where a row or its reference has no measurement),
    ``scaling_vs_1_device``: tokens/s over the same preset and configuration on one device
    (weak scaling with ``--batch-per-device``), and on ``:harness`` rows ``vs_bare_loop``:
    tokens/s over the minimal loop's row of the same step (the same spec and options
    without ``:harness``; ``bare`` for ``bf16:harness``), None without one."""
    for key in dict.fromkeys(group_key(r) for r in rows):
        mine = [r for r in rows if group_key(r) == key]
        bf16 = [r for r in mine if not r.get("quantized") and r.get("status") == "ok"]
        fastest = max(bf16, key=lambda r: r["tokens_per_s"], default=None)
        base = next((r for r in mine if not r.get("quantized") and not r.get("scan_layers")
                     and r.get("compile_s")), None)
        for r in mine:
            r["fastest_bf16"] = fastest["config"] if fastest else None
            r["vs_fastest_bf16"] = (r["tokens_per_s"] / fastest["tokens_per_s"]
                                    if fastest and r.get("status") == "ok" else None)
            r["compile_bf16"] = base["config"] if base else None
            r["compile_vs_bf16"] = (r["compile_s"] / base["compile_s"]
                                    if base and r.get("compile_s") else None)
    for r in rows:  # :fp4gather against the same configuration gathering as stored
        if not r.get("fp4_param_gather"):
            continue
        plain = next((o for o in rows if group_key(o) == group_key(r)
                      and not o.get("fp4_param_gather") and o.get("status") == "ok"
                      and o.get("spec") == r.get("spec")
                      and o.get("scan_layers") == r.get("scan_layers")), None)
        ok = plain is not None and r.get("status") == "ok"
        r["plain_gather"] = plain["config"] if plain else None
        r["all_gather_bytes_vs_plain"] = (r["all_gather_bytes"] / plain["all_gather_bytes"]
                                          if ok and plain.get("all_gather_bytes") else None)
        r["tokens_per_s_vs_plain"] = (r["tokens_per_s"] / plain["tokens_per_s"]
                                      if ok else None)
    for r in rows:
        one = next((o for o in rows if o["preset"] == r["preset"] and o["config"] == r["config"]
                    and o.get("devices", 1) == 1 and o.get("status") == "ok"), None)
        r["scaling_vs_1_device"] = (r["tokens_per_s"] / one["tokens_per_s"]
                                    if one and r.get("status") == "ok" else None)
    for r in rows:  # the training loop against the minimal loop of the same step
        if not r.get("harness"):
            continue
        loop = next((o for o in rows if group_key(o) == group_key(r) and not o.get("harness")
                     and o.get("status") == "ok" and o.get("spec") == r.get("spec")
                     and o.get("scan_layers") == r.get("scan_layers")
                     and o.get("fp4_param_gather") == r.get("fp4_param_gather")), None)
        r["bare_loop"] = loop["config"] if loop else None
        r["vs_bare_loop"] = (r["tokens_per_s"] / loop["tokens_per_s"]
                             if loop and r.get("status") == "ok" else None)


def _mb(n: int | None) -> float | None:
    return None if n is None else n / 1e6


def _fmt(v: float | None, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def table(rows: list[dict[str, Any]]) -> str:
    """A markdown table per preset and mesh, then issue 35's summary (``summary``)."""
    out = []
    for key in dict.fromkeys(group_key(r) for r in rows):
        preset, devices, fsdp = key
        mine = [r for r in rows if group_key(r) == key]
        info = next((r for r in mine if "params" in r), {})
        head = f"### {preset}" + (f", {devices} devices" if devices > 1 else "") + (
            f", fsdp {fsdp}" if fsdp > 1 else "")
        if info:
            head += (f" ({info['params'] / 1e6:.1f}M parameters, batch {info['batch_size']}"
                     f" x seq {info['seq_len']}, {info.get('device', '?')})")
        out += [head, "", "| configuration | tokens/s (pipelined) | vs fastest bf16 "
                "| vs bare loop | tokens/s (synced) | compile s | compile vs bf16 "
                "| all-gather MB |",
                "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in mine:
            st = r.get("status")
            if st == "ok":
                tps = f"{r['tokens_per_s']:,.0f}"
            elif st == "timeout":
                tps = f"timeout ({r['waited_s']:.0f} s, {r.get('stopped_in')})"
            else:
                tps = f"{st} ({r.get('error', '')[:60]})"
            ratio = r.get("vs_fastest_bf16")
            comp = r.get("compile_vs_bf16")
            bare = r.get("vs_bare_loop")
            out.append(f"| `{r['config']}` | {tps} | {_fmt(ratio, '.2f')}"
                       f"{'x' if ratio is not None else ''} "
                       f"| {_fmt(bare, '.3f')}{'x' if bare is not None else ''} "
                       f"| {_fmt(r.get('tokens_per_s_synced'), ',.0f')} "
                       f"| {_fmt(r.get('compile_s'), '.1f')}"
                       f" | {_fmt(comp, '.2f')}{'x' if comp is not None else ''} "
                       f"| {_fmt(_mb(r.get('all_gather_bytes')), '.2f')} |")
        out.append("")
    out += summary(rows)
    return "\n".join(out)


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """Issue 35's table: per preset and mesh, the fastest bf16 configuration against each
    quantized one (tokens/s, ratio, scaling over one device, compile + first call)."""
    out = ["### NVFP4 against the fastest bf16 (issue 35)", "",
           "| preset | devices (fsdp) | attention | bf16 (fastest) tokens/s | configuration "
           "| tokens/s | vs bf16 | scaling vs 1 device (bf16 / it) "
           "| compile + first step s (bf16 / it) |",
           "| --- | --- | --- | ---: | --- | ---: | ---: | --- | --- |"]
    for key in dict.fromkeys(group_key(r) for r in rows):
        mine = [r for r in rows if group_key(r) == key]
        bf = next((r for r in mine if r.get("config") == r.get("fastest_bf16")), None)
        if bf is None:
            continue
        for r in mine:
            if not r.get("quantized"):
                continue

            def cf(x):
                c = (x.get("compile_s") or 0) + (x.get("first_call_s") or 0)
                return f"{c:.1f}" if x.get("compile_s") else "n/a"

            def sc(x):
                return _fmt(x.get("scaling_vs_1_device"), ".2f")

            ratio = r.get("vs_fastest_bf16")
            out.append(
                f"| {key[0]} | {key[1]} ({key[2]}) | {bf.get('attention_resolved', '?')} "
                f"| {bf['tokens_per_s']:,.0f} ({bf['config']}) | `{r['config']}` "
                f"| {_fmt(r.get('tokens_per_s'), ',.0f')} "
                f"| {_fmt(ratio, '.3f')}{'x' if ratio is not None else ''} "
                f"| {sc(bf)} / {sc(r)} | {cf(bf)} / {cf(r)} |")
    out.append("")
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", type=_preset_arg, default=list(DEFAULT_PRESETS),
                    metavar="PRESET", help="model presets (default: %(default)s)")
    ap.add_argument("--configs", nargs="+", type=_config_arg, default=list(DEFAULT_CONFIGS),
                    metavar="SPEC[:scan]", help="recipe specs, ':scan' for --scan-layers "
                    "(default: %(default)s)")
    ap.add_argument("--batch-size", type=_positive, default=64)
    ap.add_argument("--seq-len", type=_positive, default=256)
    ap.add_argument("--iterations", type=_positive, default=20,
                    help=f"timed steps after {WARMUP} warm-up steps")
    ap.add_argument("--harness-steps", type=_positive, default=200,
                    help="steps of each ':harness' configuration's training run "
                         "(default %(default)s)")
    ap.add_argument("--gemm", action="store_true",
                    help="also the GEMM table (fwd + bwd of fp4jax.dot per --gemm-recipes "
                         "against bf16 jnp.dot; 8192^3 and the presets' linear layers) in "
                         "its own process after the configurations")
    ap.add_argument("--gemm-only", action="store_true",
                    help="the GEMM table only (no configuration runs)")
    ap.add_argument("--gemm-recipes", nargs="+", default=list(GEMM_RECIPES),
                    metavar="RECIPE", help="recipes of the GEMM table (default %(default)s)")
    ap.add_argument("--gemm-shapes", nargs="+", default=None, metavar="MxKxN",
                    help="the GEMM table's shapes instead of 8192^3 and the presets'")
    ap.add_argument("--gemm-iterations", type=_positive, default=20,
                    help="timed calls per GEMM measurement (default %(default)s)")
    ap.add_argument("--gemm-timeout-s", type=_positive_float, default=240.0,
                    help="limit of the GEMM table's process (default %(default)s)")
    ap.add_argument("--devices", type=_positive, nargs="+", default=[1],
                    help="local devices of the data-parallel step (the batch split over "
                         "them; default 1); several values: every configuration on each")
    ap.add_argument("--batch-per-device", type=_positive, default=None,
                    help="weak scaling: the global batch is this times the devices "
                         "(overrides --batch-size)")
    ap.add_argument("--fsdp", type=_positive, default=1,
                    help="the state split over this many devices, as fp4jax-train --fsdp")
    ap.add_argument("--attention", default="auto", choices=ATTENTION,
                    help="the model's attention, as fp4jax-train --attention (default auto: "
                         "cuDNN's on an NVIDIA GPU, else XLA's; each row records what ran as "
                         "attention_resolved)")
    ap.add_argument("--scan-remat", default=None, choices=SCAN_REMAT,
                    help="what the ':scan' configurations' blocks save, as fp4jax-train "
                         "--scan-remat (default: fp4jax-train's, dots)")
    ap.add_argument("--threefry", choices=THREEFRY_LOWERINGS, default="kernel",
                    help="GPU lowering of jax.random's Threefry, as fp4jax-train --threefry "
                         "(default %(default)s, fp4jax-train's)")
    ap.add_argument("--timeout-s", type=_positive_float, default=240.0,
                    help="limit of one configuration's process (default %(default)s)")
    ap.add_argument("--time-limit", type=_positive_float, default=None,
                    help="limit of the whole run: each configuration's timeout is cut to what "
                         "is left, and those that cannot start are recorded as 'skipped'")
    ap.add_argument("--out", default=None, help="output folder (default $OUT, else ./bench_out)")
    ap.add_argument("--commit", default=None, help="git commit of the code (default: "
                    "$FP4JAX_COMMIT, else git rev-parse HEAD)")
    ap.add_argument("--dry-run", action="store_true",
                    help="check the presets and configurations, print the child commands, exit")
    ap.add_argument("--one", nargs=2, metavar=("PRESET", "CONFIG"), help=argparse.SUPPRESS)
    ap.add_argument("--gemm-one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    import fp4jax

    for r in args.gemm_recipes:
        try:
            fp4jax.recipes.get(r)
        except (KeyError, ValueError) as e:
            ap.error(f"--gemm-recipes {r}: {e}")
    for s in args.gemm_shapes or ():
        try:
            parse_shape(s)
        except ValueError as e:
            ap.error(f"--gemm-shapes: {e}")
    if args.gemm_one:
        return args
    from fp4jax.train.config import TrainConfig, run_recipe, validate_config

    configs = [args.one[1]] if args.one else args.configs
    if args.scan_remat is not None and not any(split_config(c)[1] for c in configs):
        ap.error("--scan-remat applies to the ':scan' configurations: there is none")

    if args.one and len(args.devices) != 1:
        ap.error("--one runs on one --devices value")
    for preset in [args.one[0]] if args.one else args.presets:
        for config in configs:
            spec, scan = split_config(config)
            for devices in args.devices:
                try:  # the whole run's config, as build_step makes it (flags in the message)
                    cfg = TrainConfig(preset=preset, recipe=spec, scan_layers=scan,
                                      batch_size=batch_for(args, devices),
                                      seq_len=args.seq_len, devices=devices, fsdp=args.fsdp,
                                      attention=args.attention,
                                      scan_remat=args.scan_remat if scan else None,
                                      fp4_param_gather=fp4_gather(config))
                    run_recipe(cfg)
                    validate_config(cfg)
                except (TypeError, ValueError) as e:
                    ap.error(f"{preset} {config} on {devices} devices: {e}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--one" in argv or "--gemm-one" in argv:  # a child: runs on the accelerator
        return child_main(parse_args(argv))
    # the parent stays off the accelerator (a GPU client would preallocate most of its
    # memory under the children), so it validates and records on the CPU backend
    jax.config.update("jax_platforms", "cpu")
    args = parse_args(argv)
    gemm = args.gemm or args.gemm_only
    if args.dry_run:
        for preset in args.presets if not args.gemm_only else ():
            for config in args.configs:
                for devices in args.devices:
                    print(shlex.join(child_command(args, preset, config, devices)))
        if gemm:
            print(shlex.join(gemm_command(args)))
            for prob in gemm_shapes(args):
                print("gemm", "x".join(map(str, prob["shape"])), prob["source"],
                      prob["layers"] or "", "x", " ".join(["jnp.dot", *args.gemm_recipes]))
        return 0
    out = args.out or os.environ.get("OUT") or "bench_out"
    meta = lab.run_info(__file__, argv, args.commit)
    meta.update(device=None, platform=None, device_count=None,  # filled from the children
                presets=args.presets, configs=args.configs, batch_size=args.batch_size,
                seq_len=args.seq_len, devices=args.devices, fsdp=args.fsdp,
                harness_steps=args.harness_steps, gemm=gemm,
                gemm_recipes=args.gemm_recipes if gemm else None,
                batch_per_device=args.batch_per_device, attention=args.attention,
                scan_remat=scan_remat_in_effect(
                    args.scan_remat, any(split_config(c)[1] for c in args.configs)),
                iterations=args.iterations,
                warmup=WARMUP,
                timeout_s=args.timeout_s, time_limit=args.time_limit,
                child_env=CHILD_ENV | {k: None for k in CHILD_ENV_DROP},
                xla_flags=os.environ.get("XLA_FLAGS", ""))
    res = lab.Results(os.path.join(out, JSON_NAME), meta)
    rows: list[dict[str, Any]] = res.data.setdefault("rows", [])
    start = time.monotonic()
    todo = ([] if args.gemm_only else
            [(p, c, d) for p in args.presets for d in args.devices for c in args.configs])
    for preset, config, devices in todo:
        left = (None if args.time_limit is None
                else args.time_limit - (time.monotonic() - start))
        if left is not None and left < 5:
            spec, scan = split_config(config)
            row = {"preset": preset, "config": config, "spec": spec, "scan_layers": scan,
                   "quantized": quantized(spec), "devices": devices, "fsdp": args.fsdp,
                   "status": "skipped", "error": "--time-limit reached"}
        else:
            print(f"[bench_train] {preset} {config} on {devices} devices ...", flush=True)
            row = run_child(args, preset, config,
                            args.timeout_s if left is None else min(args.timeout_s, left),
                            devices)
        if res.data.get("device") is None and row.get("device"):
            res.data.update({k: row[k] for k in ("device", "platform", "device_count")})
        rows.append(row)
        add_ratios(rows)
        res.save()
        print(json.dumps({k: row.get(k) for k in (
            "preset", "config", "status", "tokens_per_s", "step_median_s", "compile_s",
            "lower_s", "xla_compile_s", "first_call_s", "waited_s", "error")
            if row.get(k) is not None}), flush=True)
    text = table(rows) if rows else ""
    if gemm:
        left = (None if args.time_limit is None
                else args.time_limit - (time.monotonic() - start))
        if left is not None and left < 5:
            res.data["gemm"] = {"status": "skipped", "rows": []}
        else:
            print("[bench_train] GEMM table ...", flush=True)
            res.data["gemm"] = run_gemm(args, args.gemm_timeout_s if left is None
                                        else min(args.gemm_timeout_s, left))
        g = res.data["gemm"]
        if res.data.get("device") is None and g["rows"]:
            res.data.update(device=g["rows"][0]["device"], platform=g["rows"][0]["platform"])
        text += "\n" + (gemm_table(g["rows"]) if g["rows"] else "") + (
            f"GEMM table: {g['status']}\n" if g["status"] != "ok" else "")
        res.save()
    res.finish(table=text)
    print()
    print(text)
    print(f"wrote {res.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
