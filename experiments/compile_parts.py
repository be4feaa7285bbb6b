"""Where one training step's cold compile goes: tracing, lowering, XLA's HLO passes, XLA's
backend and the Mosaic GPU kernels it compiles (issue 17, item 3).

    PYTHONPATH=$PWD python3 experiments/compile_parts.py --preset small --specs bf16 nvfp4 \
        --out $OUT/compile_parts

For each spec, in a fresh child process (so every compile is cold: no persistent cache, no
in-process kernel cache; ``bench_train.child_env()``), it builds the harness's step as
``bench_train.py`` does and times:

* ``trace_s``, ``lower_s`` (StableHLO, which includes the Pallas -> Mosaic GPU lowering of
  every distinct kernel), ``xla_compile_s`` (``lowered.compile()``);
* XLA's pass pipelines inside that compile, from its own log (``TF_CPP_VMODULE`` makes XLA
  print a time-stamped line as each pipeline starts; a pipeline's seconds run to the next
  line, the last one's to the end of the compile, which is the backend: LLVM, ptxas, thunk
  emission, and the Mosaic GPU kernels' compilation, which XLA runs when it instantiates each
  custom call);
* each distinct Mosaic GPU module of the step compiled alone afterwards through the CUDA
  plugin's exported ``MosaicGpuCompile`` (MLIR passes, LLVM, ptxas and module load: what
  XLA's instantiate step runs once per distinct kernel), its serialized size and its
  call count in the StableHLO.

Writes ``compile_parts_<preset>.json`` (one record per spec) and prints a table. On a
machine without a CUDA GPU the Mosaic modules can still be counted (``--cuda-on-cpu`` lowers
for CUDA with the kernel path forced) but nothing is compiled.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import subprocess
import sys
import time
from typing import Any

import lab  # noqa: F401  (puts the repository root on sys.path)

TAG = "COMPILE_PARTS "
_PIPE = re.compile(r"^I(\d{4}) (\d\d):(\d\d):(\d\d\.\d+)\s+(\d+)\s+hlo_pass_pipeline\.cc:\d+\] "
                   r"Running HLO pass pipeline on module (\S+): (.+?)\s*$")
_PASS = re.compile(r"HLO pass: (\S+) time: ([\d.]+) (\w+)")
_UNIT = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9, "min": 60.0}


def pipeline_seconds(log_lines: list[str], module: str, end_wall: float,
                     start_wall: float) -> dict[str, Any]:
    """Seconds per HLO pass pipeline of ``module`` from XLA's time-stamped log lines, and
    per HLO pass (XLA's own ``HLO pass: NAME time: T`` lines, summed over every module the
    compile ran, the autotuner's included).

    XLA runs ``module``'s pipelines on one thread while other threads compile other modules
    (the GEMM autotuner's candidates); a pipeline's time runs from its line to the next
    pipeline line of ``module`` on the same thread (so ``config-assigner``, the autotuner,
    holds the time its candidates' compiles took), the last one's to ``end_wall`` (the
    compile's end, ``time.time()``), so it also holds the backend. Returns
    ``{"pipelines": {name: s}, "passes": {name: s} (the 25 largest), "first_s": seconds from
    the compile's start to the module's first line, "last": name}``."""
    marks = []
    passes: dict[str, float] = {}
    for line in log_lines:
        m = _PIPE.match(line)
        if m:
            _, hh, mm, ss, tid, mod, name = m.groups()
            if mod == module:
                marks.append((int(hh) * 3600 + int(mm) * 60 + float(ss), tid, name))
        p = _PASS.search(line)
        if p:
            passes[p.group(1)] = passes.get(p.group(1), 0.0) + float(p.group(2)) * _UNIT.get(
                p.group(3), float("nan"))
    top = dict(sorted(passes.items(), key=lambda kv: -kv[1])[:25])
    top = {k: round(v, 3) for k, v in top.items()}
    if not marks:
        return {"pipelines": {}, "passes": top, "first_s": None, "last": None}
    lt = time.localtime(end_wall)
    day0 = end_wall - (lt.tm_hour * 3600 + lt.tm_min * 60 + lt.tm_sec + end_wall % 1)
    out: dict[str, float] = {}
    for i, (t, tid, name) in enumerate(marks):
        nxt = next((t2 for t2, tid2, _ in marks[i + 1:] if tid2 == tid), end_wall - day0)
        out[name] = out.get(name, 0.0) + (nxt - t)
    return {"pipelines": {k: round(v, 3) for k, v in out.items()}, "passes": top,
            "first_s": round(marks[0][0] - (start_wall - day0), 3), "last": marks[-1][2]}


def _mosaic_compiler():
    """The CUDA plugin's ``MosaicGpuCompile`` / ``MosaicGpuUnload`` (what XLA's
    instantiate step of a Mosaic GPU custom call runs), or None where there is none."""
    try:
        try:
            import jax_plugins.xla_cuda13 as plugin  # type: ignore[import-not-found]
        except ImportError:
            import jax_plugins.xla_cuda12 as plugin  # type: ignore[import-not-found]
        dll = ctypes.CDLL(plugin._get_library_path())
        comp, unload = dll.MosaicGpuCompile, dll.MosaicGpuUnload
    except (ImportError, OSError, AttributeError):
        return None
    comp.argtypes = [ctypes.c_char_p, ctypes.c_int]
    comp.restype = ctypes.POINTER(ctypes.c_void_p)
    unload.argtypes = [comp.restype]
    unload.restype = None
    return comp, unload


def measure(preset: str, spec: str, batch_size: int, seq_len: int, log_path: str,
            cuda_on_cpu: bool) -> dict[str, Any]:
    """One spec in this process: trace, lower, compile (stderr to ``log_path``), then each
    distinct Mosaic GPU module compiled alone."""
    import jax
    from profile_step import build_step

    if cuda_on_cpu:
        import pallas_kernels.dot_sm90 as dot_sm90

        os.environ["FP4JAX_KERNELS"] = "on"
        dot_sm90.on_sm90 = lambda: True  # lower the kernel path for CUDA without a GPU
        dot_sm90.mosaic_api_reason = lambda: None
    from jax.experimental.mosaic.gpu import core as mgpu_core

    mgpu_core.KNOWN_KERNELS.clear()
    step, state, batch, key, mc = build_step(preset, spec, False, batch_size, seq_len)
    jax.block_until_ready(state)
    rec: dict[str, Any] = {"preset": preset, "spec": spec, "params": mc.num_params(),
                           "jax": jax.__version__, "device": jax.devices()[0].device_kind,
                           "commit": lab.git_commit()}
    t0 = time.perf_counter()
    traced = step.trace(state, batch, key)
    t1 = time.perf_counter()
    lowered = (traced.lower(lowering_platforms=("cuda",)) if cuda_on_cpu
               else traced.lower())
    t2 = time.perf_counter()
    text = lowered.as_text()
    rec.update(trace_s=round(t1 - t0, 3), lower_s=round(t2 - t1, 3),
               stablehlo_chars=len(text), mosaic_call_sites=text.count("mosaic_gpu_v2"))
    modules = dict(mgpu_core.KNOWN_KERNELS)
    rec["mosaic_modules"] = len(modules)
    rec["mosaic_module_bytes"] = sum(len(m) for m in modules.values())
    if cuda_on_cpu:
        return rec
    # XLA's log to a file for the compile (fd 2 is where its C++ logging goes)
    sys.stderr.flush()
    saved = os.dup(2)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    w0, t3 = time.time(), time.perf_counter()
    try:
        compiled = lowered.compile()
    finally:
        t4, w1 = time.perf_counter(), time.time()
        os.dup2(saved, 2)
        os.close(fd)
        os.close(saved)
    rec["xla_compile_s"] = round(t4 - t3, 3)
    hlo = compiled.as_text()
    rec.update(hlo_chars=len(hlo), fusions=hlo.count(" fusion("))
    with open(log_path, errors="replace") as f:
        lines = f.readlines()
    mods = re.findall(r"module (jit_\S+?):", "".join(lines[:200]))
    module = mods[0] if mods else "jit_step"
    rec["xla_log_module"] = module
    rec.update(pipeline_seconds(lines, module, w1, w0))
    # each distinct Mosaic GPU module, compiled alone (cold: a fresh process, no caches)
    comp = _mosaic_compiler()
    if comp is None:
        rec["mosaic_compile"] = "no CUDA plugin with MosaicGpuCompile"
        return rec
    per = []
    for mod in modules.values():
        c0 = time.perf_counter()
        res = comp[0](mod, len(mod))
        c1 = time.perf_counter()
        per.append({"bytes": len(mod), "compile_s": round(c1 - c0, 3), "ok": bool(res)})
        if res:
            comp[1](res)
    rec["mosaic_compile"] = sorted(per, key=lambda r: -r["compile_s"])
    rec["mosaic_compile_sum_s"] = round(sum(p["compile_s"] for p in per), 3)
    return rec


def from_log(path: str, compile_s: float, module: str = "jit_step") -> dict[str, Any]:
    """``pipeline_seconds`` of a saved log (``xla_<preset>_<spec>.log[.gz]``): the compile's
    start is taken as the module's first pipeline line and its end ``compile_s`` later."""
    import gzip

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", errors="replace") as f:
        lines = f.readlines()
    first = next((m for m in map(_PIPE.match, lines) if m and m.group(6) == module), None)
    if first is None:
        return {"error": f"no pipeline line of {module} in {path}"}
    hh, mm, ss = (int(first.group(2)), int(first.group(3)), float(first.group(4)))
    start = time.mktime(time.localtime(0)[:3] + (hh, mm, 0, 0, 1, -1)) + ss
    return pipeline_seconds(lines, module, start + compile_s, start)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--specs", nargs="+", default=["bf16", "nvfp4"])
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--out", default=os.environ.get("OUT", "compile_parts_out"))
    ap.add_argument("--cuda-on-cpu", action="store_true",
                    help="no GPU: lower for CUDA with the kernel path forced and count the "
                         "Mosaic GPU modules (compiles nothing)")
    ap.add_argument("--from-log", nargs=2, metavar=("LOG", "COMPILE_S"), default=None,
                    help="no compile: the pipeline and pass seconds of a saved XLA log "
                         "(.log or .log.gz) of a compile that took COMPILE_S seconds (its last "
                         "pipeline runs to the log's last line plus what is left of COMPILE_S "
                         "after the module's first line: approximate)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.from_log:
        print(json.dumps(from_log(a.from_log[0], float(a.from_log[1])), indent=1))
        return 0
    os.makedirs(a.out, exist_ok=True)
    if a.child:
        log = os.path.join(a.out, f"xla_{a.preset}_{a.child}.log")
        rec = measure(a.preset, a.child, a.batch_size, a.seq_len, log, a.cuda_on_cpu)
        print(TAG + json.dumps(rec), flush=True)
        return 0
    from bench_train import child_env  # a cold compile's environment, as bench_train's

    env = dict(child_env(), TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="hlo_pass_pipeline=1")
    # the repository root after the caller's PYTHONPATH (which may put another copy first)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (env.get("PYTHONPATH", ""),
                    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) if p)
    recs = []
    for spec in a.specs:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", spec, "--preset",
               a.preset, "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len),
               "--out", a.out] + (["--cuda-on-cpu"] if a.cuda_on_cpu else [])
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        got = [ln[len(TAG):] for ln in p.stdout.splitlines() if ln.startswith(TAG)]
        rec = (json.loads(got[-1]) if got else
               {"spec": spec, "error": (p.stderr or p.stdout)[-2000:], "rc": p.returncode})
        recs.append(rec)
        pipes = rec.get("pipelines") or {}
        top = sorted(pipes.items(), key=lambda kv: -kv[1])[:4]
        print(f"{spec}: trace {rec.get('trace_s')} s, lower {rec.get('lower_s')} s, "
              f"xla {rec.get('xla_compile_s')} s, mosaic modules {rec.get('mosaic_modules')}, "
              f"mosaic alone "
              f"{rec.get('mosaic_compile_sum_s')} s; pipelines {top}", flush=True)
    path = os.path.join(a.out, f"compile_parts_{a.preset}.json")
    with open(path, "w") as f:
        json.dump(recs, f, indent=1)
    print("wrote", path)
    return 0 if all("error" not in r for r in recs) else 1


if __name__ == "__main__":
    sys.exit(main())
