"""Where the compile time of FP4 GEMMs goes: XLA's HLO passes, timed per pass (issue 17).

Builds ``value_and_grad`` of a chain of ``--layers`` ``fp4jax.dot`` calls (tokens x K -> N
-> K ..., distinct bf16 weights, one SR key per layer) for each recipe spec, and compiles
it, one spec after the other in this process with JAX's caches cleared between them.
XLA's own scoped timers (``TF_CPP_VMODULE=gpu_compiler=1,hlo_pass_pipeline=1``, set here
before JAX starts) are captured from the process's stderr and summed per pass, so each
spec reports its compile seconds and the passes that took them (on the whole train step
the ``priority-fusion`` pass took 146 of 257 s: ``2026-11-25_compile_passes_h100``).

    PYTHONPATH=$PWD python3 experiments/compile_dot.py bf16 nvfp4 "nvfp4(sr=False)" \\
        --tokens 16384 --k 512 --n 2048 --layers 4 [--kernels off]

Writes ``$OUT/compile_dot.json`` (``lab.run_info`` first). On the CPU the pass timers are
those of XLA's CPU pipeline (a different fusion pass): use it to check the script.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0")
os.environ.setdefault("TF_CPP_VMODULE", "gpu_compiler=1,hlo_pass_pipeline=1,cpu_compiler=1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import lab  # noqa: E402  (puts the repository root on sys.path)

_PASS = re.compile(r"HLO pass: (\S+) time: .*?\((\d+) us\) \(cumul")
_MODULE = re.compile(r"Running HLO pass pipeline on module (\S+): ")
_TOTAL = re.compile(r"(RunHloPasses|RunBackend) for (\S+) time: .*?\((\d+) us\) \(cumul")


def chain_loss(recipe, layers: int):
    """``sum(h_L * ct)`` with ``h_{i+1} = fp4jax.dot(h_i, w_i)`` (float32 sum)."""
    import fp4jax

    def loss(x, ws, ct, key):
        h = x
        for i, w in enumerate(ws):
            h = fp4jax.dot(h, w, recipe=recipe, key=jax.random.fold_in(key, i))
        return (h.astype(jnp.float32) * ct.astype(jnp.float32)).sum()

    return loss


def parse_log(text: str, module: str = "jit_loss") -> dict:
    """Per-pass microseconds of ``module`` and its RunHloPasses / RunBackend totals."""
    passes: dict[str, int] = {}
    current, totals = None, {}
    for line in text.splitlines():
        m = _MODULE.search(line)
        if m:
            current = m.group(1)
            continue
        m = _PASS.search(line)
        if m and current == module:
            passes[m.group(1)] = passes.get(m.group(1), 0) + int(m.group(2))
            continue
        m = _TOTAL.search(line)
        if m and m.group(2) == module:
            totals[m.group(1)] = int(m.group(3)) / 1e6
    top = sorted(passes.items(), key=lambda kv: -kv[1])[:8]
    return {"passes_s": round(sum(passes.values()) / 1e6, 2), **{k: round(v, 2) for k, v in
            totals.items()}, "top_passes": [(k, round(v / 1e6, 2)) for k, v in top]}


def compile_one(spec: str, a) -> dict:
    """Lowers and compiles the chain for ``spec`` with fd 2 captured; returns timings."""

    import fp4jax
    from fp4jax import quantized_dot as fdot
    recipe = fp4jax.recipes.parse(spec)
    fdot._make_dot3.cache_clear()
    jax.clear_caches()
    x = jax.ShapeDtypeStruct((a.tokens, a.k), jnp.bfloat16)
    dims = [(a.k, a.n) if i % 2 == 0 else (a.n, a.k) for i in range(a.layers)]
    ws = [jax.ShapeDtypeStruct(d, jnp.bfloat16) for d in dims]
    ct = jax.ShapeDtypeStruct((a.tokens, dims[-1][1]), jnp.bfloat16)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    fn = jax.jit(jax.value_and_grad(chain_loss(recipe, a.layers), argnums=(0, 1)))
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as log:
        os.dup2(log.fileno(), 2)
        try:
            t0 = time.perf_counter()
            lowered = fn.lower(x, ws, ct, key)
            t1 = time.perf_counter()
            compiled = lowered.compile()
            t2 = time.perf_counter()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        text = log.read().decode(errors="replace")
    hlo = compiled.as_text()
    if a.dump:
        import gzip
        name = re.sub(r"[^A-Za-z0-9=,_-]+", "_", spec).strip("_")
        os.makedirs(a.dump, exist_ok=True)
        with gzip.open(os.path.join(a.dump, f"{name}_L{a.layers}.hlo.gz"), "wt") as f:
            f.write(hlo)
    return {"spec": spec, "lower_s": round(t1 - t0, 2), "compile_s": round(t2 - t1, 2),
            "fusions": hlo.count(" fusion("), "hlo_chars": len(hlo),
            "custom_calls": hlo.count("custom-call("), **parse_log(text)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = lab.arg_parser(__doc__, "compile_dot.json", "spec", "recipe specs to compile")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--k", type=int, default=512)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dump", default=None, help="write each optimized HLO here (gzip)")
    ap.add_argument("--kernels", default=None, help="FP4JAX_KERNELS for every spec")
    a = ap.parse_args(argv)
    if a.kernels is not None:
        os.environ["FP4JAX_KERNELS"] = a.kernels
    out = a.out or lab.default_out("compile_dot.json")
    res = lab.Results(out, {**lab.run_info(__file__, argv, a.commit), "tokens": a.tokens,
                            "k": a.k, "n": a.n, "layers": a.layers})
    for spec in a.names or ["bf16", "nvfp4"]:
        res.add("results", compile_one(spec, a))
    res.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
