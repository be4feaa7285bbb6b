"""Training throughput and cold compile time of the harness's step, per recipe (issue 17).

The table of issue 17 ("NVFP4 training at the speed of BF16") in one call. For each preset
(``--presets``, default ``small 100m``) and each configuration (``--configs``, default
``bf16 bf16:scan nvfp4:scan nvfp4 mxfp4:scan``; syntax ``SPEC[:scan][:fp4gather]``,
``SPEC`` a recipe spec as ``fp4jax-train --recipe`` takes it, run-level keys included,
``:scan`` for ``--scan-layers``, ``:fp4gather`` for ``--fp4-param-gather``) it builds the
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

On a CPU it runs as is, slowly (``--presets micro --batch-size 4 --seq-len 32``);
``--dry-run`` checks the presets and configurations and prints the child commands without
running them.
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
DEFAULT_CONFIGS = ("bf16", "bf16:scan", "nvfp4:scan", "nvfp4", "mxfp4:scan")
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


SUFFIXES = ("scan", "fp4gather")
"""A configuration's options after its spec: ``:scan`` (``--scan-layers``) and
``:fp4gather`` (``--fp4-param-gather``: with ``--fsdp`` 2 or more, the weights of the 2D
NVFP4 layers gathered as packed FP4 codes; the row then records the all-gather bytes of
the compiled step beside those of the same configuration without it)."""


def config_options(text: str) -> tuple[str, set[str]]:
    """``"SPEC[:scan][:fp4gather]"`` -> ``(SPEC, {options})``.

    Raises:
      ValueError: an empty spec, an unknown or repeated suffix, or a bad spec.
    """
    spec, *opts = text.strip().split(":")
    spec = spec.strip()
    if not spec:
        raise ValueError(f"{text!r}: empty recipe spec")
    bad = [o for o in opts if o.strip() not in SUFFIXES]
    if bad or len(set(opts)) != len(opts):
        raise ValueError(f"{text!r}: the suffixes are {', '.join(':' + x for x in SUFFIXES)} "
                         "(SPEC, SPEC:scan, SPEC:fp4gather, SPEC:scan:fp4gather), each once")
    quantized(spec)  # raises for a bad spec
    return spec, {o.strip() for o in opts}


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


def child_main(args: argparse.Namespace) -> int:
    preset, config = args.one
    set_threefry_lowering(args.threefry)  # as fp4jax-train --threefry does
    try:
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
            "fp4_param_gather": fp4_gather(config), "batch_size": batch_for(args, devices)}
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
    every row (None where a row or its reference has no measurement), and
    ``scaling_vs_1_device``: tokens/s over the same preset and configuration on one device
    (weak scaling with ``--batch-per-device``)."""
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
                "| tokens/s (synced) | compile s | compile vs bf16 | all-gather MB |",
                "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
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
            out.append(f"| `{r['config']}` | {tps} | {_fmt(ratio, '.2f')}"
                       f"{'x' if ratio is not None else ''} "
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
    args = ap.parse_args(argv)
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
    if "--one" in argv:  # the child: runs on the accelerator
        return child_main(parse_args(argv))
    # the parent stays off the accelerator (a GPU client would preallocate most of its
    # memory under the children), so it validates and records on the CPU backend
    jax.config.update("jax_platforms", "cpu")
    args = parse_args(argv)
    if args.dry_run:
        for preset in args.presets:
            for config in args.configs:
                for devices in args.devices:
                    print(shlex.join(child_command(args, preset, config, devices)))
        return 0
    out = args.out or os.environ.get("OUT") or "bench_out"
    meta = lab.run_info(__file__, argv, args.commit)
    meta.update(device=None, platform=None, device_count=None,  # filled from the children
                presets=args.presets, configs=args.configs, batch_size=args.batch_size,
                seq_len=args.seq_len, devices=args.devices, fsdp=args.fsdp,
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
    todo = [(p, c, d) for p in args.presets for d in args.devices for c in args.configs]
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
    text = table(rows)
    res.finish(table=text)
    print()
    print(text)
    print(f"wrote {res.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
