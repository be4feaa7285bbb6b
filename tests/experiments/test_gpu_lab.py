"""The GPU lab tools run on a CPU: the checker (``experiments/gpu_check.py``) lists its checks,
refuses to run without an sm_90 GPU unless asked for its interpret-mode dry run, passes two
checks in that dry run with a complete result JSON, and reports a wrong kernel as a failure;
the benchmark (``experiments/bench_kernels.py``) answers ``--help`` and ``--list`` and lowers
a mode for CUDA in its dry run; ``experiments/gpu_lab.sh`` refuses unknown tools before it
runs anything; the comparison helpers count NaN as equal to NaN."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests import ROOT
from tests.experiments import experiments_on_path
from tests.interpret import needs_interpret

jax = pytest.importorskip("jax")
jnp = jax.numpy

EXP = ROOT / "experiments"


def _run(*args, timeout=120):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(EXP)]),
               JAX_PLATFORMS="cpu")
    env.pop("OUT", None)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def lab_modules():
    with experiments_on_path():
        import gpu_check
        import lab

        yield lab, gpu_check


def test_checker_lists_its_checks_and_needs_a_gpu_or_interpret(lab_modules, capsys,
                                                             monkeypatch):
    r = _run("experiments/gpu_check.py", "--list")  # the script as a command, once
    assert r.returncode == 0, r.stderr
    names = [line.split()[0] for line in r.stdout.splitlines() if line.strip()]
    for name in ("recip", "rows", "cols", "2d", "amax", "packed", "packed_sr", "packed_2d",
                 "gemm_alpha", "w4a16", "w4a4", "dot", "dot_recipes"):
        assert name in names
    _, gc = lab_modules  # the rest in this process: its main() is the command's
    monkeypatch.setattr(gc.dispatch, "on_sm90", lambda: False)  # as on a CPU, on any host
    capsys.readouterr()
    assert gc.main(["rows"]) == 2 and "--interpret" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        gc.main(["--interpret", "nosuchcheck"])
    assert e.value.code == 2 and "unknown check" in capsys.readouterr().err


@needs_interpret
def test_checker_interpret_dry_run(tmp_path, lab_modules):
    if jax.default_backend() != "cpu":
        pytest.skip("the interpret dry run is the CPU's (a GPU runs the real checks)")
    _, gc = lab_modules
    out = tmp_path / "gpu_check.json"
    assert gc.main(["--interpret", "2d", "amax", "w4a16", "--seed", "3", "--out", str(out),
                    "--commit", "abc123"]) == 0
    res = json.loads(out.read_text())
    for key in ("device", "jax", "commit", "command", "seed", "started", "finished"):
        assert key in res
    assert res["commit"] == "abc123" and res["ok"] is True
    assert res["command"].startswith("PYTHONPATH=$PWD python3 experiments/gpu_check.py")
    rows = res["checks"]
    assert {r["check"] for r in rows} == {"2d", "amax", "w4a16"}
    assert all(r["status"] == "pass" for r in rows if r["check"] != "w4a16")
    assert [r["status"] for r in rows if r["check"] == "w4a16"] == ["skip"]  # no interpret mode
    assert {r["input"] for r in rows if r["check"] == "2d"} >= {"wild", "wide40", "tiny"}
    assert all(r["mismatch"] == 0 for r in rows if r["check"] == "2d")


def test_checker_reports_a_wrong_kernel(tmp_path, monkeypatch, lab_modules):
    lab, gc = lab_modules

    def off_by_one_ulp(x, **kw):  # the XLA path's operand with its last bit flipped
        y, dec = lab.xla_operand(x, block_2d=True)
        bits = jax.lax.bitcast_convert_type(y, jnp.uint16) ^ jnp.uint16(1)
        return jax.lax.bitcast_convert_type(bits, jnp.bfloat16), dec

    monkeypatch.setattr(gc.fq, "fq_2d", off_by_one_ulp)
    monkeypatch.setitem(gc.OPERAND_INPUTS, "interpret", [((32, 1024), "wild")])
    out = tmp_path / "gpu_check.json"
    assert gc.main(["--interpret", "2d", "--out", str(out), "--seed", "5"]) == 1
    res = json.loads(out.read_text())
    rows = res["checks"]  # the input as bf16, and as float32 (a master weight)
    assert [r["input"] for r in rows] == ["wild", "wild/f32"]
    assert all(r["status"] == "fail" and r["mismatch"] > 0 for r in rows)
    assert res["ok"] is False


def test_comparisons_count_nan_as_equal(lab_modules):
    lab, gc = lab_modules
    a = jnp.asarray([1.0, np.nan, -0.0, 2.0], jnp.bfloat16)
    b = jnp.asarray([1.0, -np.nan, 0.0, 2.0], jnp.bfloat16)
    assert lab.mismatches(a, b) == 1  # -0 vs +0 differ, NaN payloads do not
    assert lab.mismatches(jnp.uint8(3), jnp.uint8(3)) == 0
    want = jnp.asarray([1.0, 100.0, np.nan], jnp.float32)
    st = gc._gemm_case(jnp.asarray([1.0, 100.0 * (1 + 2e-7), np.nan], jnp.float32), want)
    assert st["ok"] and not st["bitwise_equal"] and st["max_rel_err"] < 1e-6
    st = gc._gemm_case(jnp.asarray([1.0, 101.0, np.nan], jnp.bfloat16), want)
    assert not st["ok"] and st["bad"] == 1


def test_benchmark_help_list_and_dry_run(tmp_path):
    r = _run("experiments/bench_kernels.py", "--help")
    assert r.returncode == 0 and "dotkern1" in r.stdout
    r = _run("experiments/bench_kernels.py", "--list")
    assert r.returncode == 0 and "fakequant1" in r.stdout
    out = tmp_path / "bench.json"
    r = _run("experiments/bench_kernels.py", "--dry-run", "fakequant1", "--out", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["dry_run"] and res["errors"] == 0 and "commit" in res and "device" in res
    kernel_rows = [r for r in res["results"] if r["name"].startswith("kernel+amax")]
    assert len(kernel_rows) == 6
    assert all(r["cuda_lowering_mosaic_gpu_mentions"] > 0 for r in kernel_rows)


def test_gpu_lab_refuses_unknown_tools_before_running(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "lab"))
    r = subprocess.run(["bash", str(EXP / "gpu_lab.sh"), "check", "--list", "+", "bnch"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown tool 'bnch'" in r.stderr
    assert not (tmp_path / "lab").exists()


def test_profile_step_categories_on_cpu(tmp_path):
    """The step profiler builds the harness's train step and attributes the HLO by category
    (on CPU: instruction counts; kernel times need CUPTI): fp4jax's named scopes reach the
    op-name metadata, so an NVFP4 step has quantize, amax and RHT instructions and a bf16
    step none."""
    r = _run("experiments/profile_step.py", "--preset", "micro", "--seq-len", "16",
             "--batch-size", "4", "--iterations", "1", "--specs", "bf16", "nvfp4(sr=False)",
             "--out", str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "profile_step.json").read_text())
    bf16, fp4 = (x["hlo_instructions_per_category"] for x in res["runs"])
    assert res["jax"] and res["commit"] and bf16["gemm"] > 0
    assert bf16["quantize"] == bf16["amax"] == bf16["rht"] == 0
    assert fp4["quantize"] > 0 and fp4["amax"] > 0 and fp4["rht"] > 0


def test_profile_step_kernel_names(lab_modules):
    import profile_step as ps

    hlo = ("%fused_computation.3 (p: f32[4]) -> f32[] {\n  %r = f32[] reduce(f32[4] %p)\n}\n"
           "ENTRY %main {\n"
           '  %input_reduce_fusion.3 = f32[] fusion(f32[4] %a), kind=kInput, '
           'calls=%fused_computation.3, metadata={op_name="jit(step)/jit(dot3)/fp4_amax/abs"}\n'
           '  %loop_fusion = f32[4] fusion(f32[4] %a), kind=kLoop, calls=%fc2, '
           'metadata={op_name="jit(step)/jvp(Llama)/mul"}\n'
           '  %custom-call.1 = f32[4,4] custom-call(f32[4,4] %a), '
           'custom_call_target="__cublas$gemm"\n}\n')
    instrs, bodies = ps.hlo_instructions(hlo), ps.fused_bodies(hlo)
    cat = lambda k: ps.kernel_category(k, instrs, bodies)  # noqa: E731
    assert cat("input_reduce_fusion_3") == "amax"
    assert cat("loop_fusion") == "elementwise"
    assert cat("custom-call.1") == "gemm"
    assert cat("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert cat("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NTN") == "gemm"
    assert cat("_quantize_rows_kernel") == "pallas"


def test_profile_step_collectives(lab_modules):
    """Data-parallel steps: the combined gradient all-reduce (a tuple of 6+ shapes, whose
    ``/*index=5*/`` comments hold an '=') and NCCL's kernels are ``collective``."""
    import profile_step as ps

    shapes = ", ".join(["f32[4]{0}"] * 5) + ", /*index=5*/f32[4]{0}"
    hlo = ("ENTRY %main {\n"
           f"  %all-reduce.1 = ({shapes}) all-reduce(f32[4]{{0}} %a), channel_id=1, "
           'metadata={op_name="jit(step)/shard_map/psum"}\n}\n')
    instrs, bodies = ps.hlo_instructions(hlo), ps.fused_bodies(hlo)
    assert instrs["all_reduce_1"][0] == "all-reduce"
    assert ps.kernel_category("all-reduce.1", instrs, bodies) == "collective"
    assert ps.kernel_category("ncclDevKernel_AllReduce_Sum_f32_RING_LL", instrs,
                              bodies) == "collective"


def test_profile_step_hlo_drops_mosaic_modules(lab_modules):
    """profile_step --hlo's saved HLO drops the Mosaic GPU modules' bytes (their hash
    kept)."""
    import profile_step as ps

    hlo = ('%c = f32[4] custom-call(%a), custom_call_target="mosaic_gpu_v2", '
           'backend_config={kernel_hash = "h\\"1", module = "ML\\\\EF\\"R\\\\x00", '
           'use_custom_barrier = false}')
    out = ps.strip_mosaic_modules(hlo)
    assert 'module = "<' in out and "ML" not in out and 'kernel_hash = "h\\"1"' in out
