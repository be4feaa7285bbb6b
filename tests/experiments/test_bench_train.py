"""``experiments/bench_train.py`` on a CPU: two configurations of the ``micro`` preset, each
in its own cold process, give a result JSON with run metadata, positive throughput, compile
seconds and the ratios to the BF16 rows, and a markdown table; a configuration past its
timeout becomes a ``timeout`` row; a bad ``--configs`` is a usage error naming the flag; the
ratios follow the issue's definitions (fastest BF16 configuration, BF16 without scan)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests import ROOT
from tests.experiments import experiments_on_path

EXP = ROOT / "experiments"
SMALL = ["--iterations", "2", "--batch-size", "4", "--seq-len", "32"]


def _run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(EXP)]),
               JAX_PLATFORMS="cpu")
    env.pop("OUT", None)
    return subprocess.run([sys.executable, "experiments/bench_train.py", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def bench_train():
    with experiments_on_path():
        import bench_train

        yield bench_train


def test_two_configs_on_cpu(tmp_path):
    r = _run("--presets", "micro", "--configs", "bf16", "nvfp4:scan", *SMALL,
             "--out", str(tmp_path), "--commit", "abc123")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "bench_train.json").read_text())
    for key in ("device", "platform", "jax", "commit", "command", "started", "finished",
                "table"):
        assert res.get(key), key
    assert res["commit"] == "abc123" and res["platform"] == "cpu"
    assert res["command"].startswith("PYTHONPATH=$PWD python3 experiments/bench_train.py")
    rows = {row["config"]: row for row in res["rows"]}
    assert list(rows) == ["bf16", "nvfp4:scan"]
    assert rows["nvfp4:scan"]["scan_layers"] and rows["nvfp4:scan"]["quantized"]
    assert not rows["bf16"]["scan_layers"] and not rows["bf16"]["quantized"]
    for row in rows.values():
        assert row["status"] == "ok", row
        assert row["persistent_cache"] is False
        assert row["tokens_per_s"] > 0 and row["compile_s"] > 0
        assert row["xla_compile_s"] > 0 and row["lower_s"] > 0
        assert row["step_min_s"] <= row["step_median_s"] <= row["step_max_s"]
        # the headline throughput is the pipelined one (as the training loop runs)
        assert len(row["pipelined_windows_s"]) == 5
        assert row["tokens_per_s"] == pytest.approx(
            row["tokens_per_step"] / row["pipelined_step_s"])
        assert row["tokens_per_s_synced"] == pytest.approx(
            row["tokens_per_step"] / row["step_median_s"])
        assert row["vs_fastest_bf16"] > 0 and row["compile_vs_bf16"] > 0
        assert row["fastest_bf16"] == "bf16" and row["compile_bf16"] == "bf16"
    assert rows["bf16"]["vs_fastest_bf16"] == 1.0 and rows["bf16"]["compile_vs_bf16"] == 1.0
    assert "| `nvfp4:scan` |" in r.stdout and "### micro" in r.stdout


def test_timeout_is_a_row(tmp_path):
    r = _run("--presets", "micro", "--configs", "nvfp4", *SMALL, "--timeout-s", "1.5",
             "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = json.loads((tmp_path / "bench_train.json").read_text())["rows"]
    assert row["status"] == "timeout" and row["waited_s"] >= 1.5
    assert row["vs_fastest_bf16"] is None and "timeout" in r.stdout


def test_bad_configs_is_a_usage_error(tmp_path):
    for bad in ("nvfp4:foo", "nosuchrecipe"):
        r = _run("--presets", "micro", "--configs", "bf16", bad, "--out", str(tmp_path))
        assert r.returncode == 2 and "--configs" in r.stderr, r.stderr
    assert not (tmp_path / "bench_train.json").exists()


def test_ratios(bench_train):
    rows = [
        {"preset": "p", "config": "bf16", "quantized": False, "scan_layers": False,
         "status": "ok", "tokens_per_s": 100.0, "compile_s": 10.0},
        {"preset": "p", "config": "bf16:scan", "quantized": False, "scan_layers": True,
         "status": "ok", "tokens_per_s": 200.0, "compile_s": 5.0},
        {"preset": "p", "config": "nvfp4", "quantized": True, "scan_layers": False,
         "status": "timeout", "waited_s": 240.0},
        {"preset": "p", "config": "nvfp4:scan", "quantized": True, "scan_layers": True,
         "status": "ok", "tokens_per_s": 150.0, "compile_s": 30.0},
        {"preset": "q", "config": "nvfp4", "quantized": True, "scan_layers": False,
         "status": "ok", "tokens_per_s": 1.0, "compile_s": 1.0},
    ]
    bench_train.add_ratios(rows)
    by = {(r["preset"], r["config"]): r for r in rows}
    assert by["p", "nvfp4:scan"]["vs_fastest_bf16"] == 0.75  # against bf16:scan, the fastest
    assert by["p", "nvfp4:scan"]["compile_vs_bf16"] == 3.0  # against bf16 without scan
    assert by["p", "bf16:scan"]["compile_vs_bf16"] == 0.5
    assert by["p", "nvfp4"]["vs_fastest_bf16"] is None
    assert by["q", "nvfp4"]["vs_fastest_bf16"] is None  # no BF16 row in that preset
    text = bench_train.table(rows)
    assert "### p" in text and "### q" in text and "| `nvfp4` | timeout (240 s" in text
    assert bench_train.split_config(" nvfp4(sr=False, last_bf16=0):scan ") == (
        "nvfp4(sr=False, last_bf16=0)", True)
    with pytest.raises(ValueError, match="scan"):
        bench_train.split_config("bf16:Scan")


def test_bare_harness_and_gemm_table_on_cpu(tmp_path):
    """``bare`` (bf16 by the minimal loop), ``bf16:harness`` (fp4jax.train.train itself)
    and the GEMM table, each in its own process: the harness row's ratio to the bare row,
    the GEMM rows' ratios to jnp.dot, both tables printed."""
    r = _run("--presets", "micro", "--configs", "bare", "bf16:harness", *SMALL,
             "--harness-steps", "6", "--gemm", "--gemm-shapes", "32x64x48",
             "--gemm-recipes", "bf16", "mxfp4", "--gemm-iterations", "2",
             "--out", str(tmp_path), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "bench_train.json").read_text())
    rows = {row["config"]: row for row in res["rows"]}
    assert list(rows) == ["bare", "bf16:harness"]
    bare, harness = rows["bare"], rows["bf16:harness"]
    assert bare["status"] == harness["status"] == "ok", (bare, harness)
    assert bare["spec"] == harness["spec"] == "bf16" and not bare["quantized"]
    assert not bare["harness"] and harness["harness"] and harness["harness_steps"] == 6
    assert bare["tokens_per_s"] > 0 and harness["tokens_per_s"] > 0
    assert harness["bare_loop"] == "bare"
    assert harness["vs_bare_loop"] == pytest.approx(harness["tokens_per_s"]
                                                    / bare["tokens_per_s"])
    assert harness.get("compile_s") is None and bare["compile_s"] > 0
    assert harness["params"] == bare["params"]
    g = res["gemm"]
    assert g["status"] == "ok", g
    assert [(x["recipe"], x["shape"]) for x in g["rows"]] == [
        (rc, [32, 64, 48]) for rc in ("jnp.dot", "bf16", "mxfp4")]
    for x in g["rows"]:
        assert x["status"] == "ok" and x["median_us"] > 0 and x["tflops"] > 0, x
    assert g["rows"][0]["vs_jnp_dot"] == 1.0
    assert "| `bf16:harness` |" in r.stdout and "| 32x64x48 | --gemm-shapes |" in r.stdout


def test_dry_run_lists_children_and_gemm_problems():
    r = _run("--presets", "small", "--configs", "bare", "bf16:harness", "mxfp4:harness",
             "--gemm", "--dry-run")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    children = [x for x in lines if "--one" in x]
    assert [x.split("--one ")[1].split(" --")[0] for x in children] == [
        "small bare", "small bf16:harness", "small mxfp4:harness"]
    assert "--harness-steps 200" in children[1] and "--harness-steps" not in children[0]
    assert sum("--gemm-one" in x for x in lines) == 1
    gemms = [x.split()[1:4] for x in lines if x.startswith("gemm ")]
    # 8192^3, then small's q/o, k/v, up, down at 64 x 256 tokens
    assert gemms == [["8192x8192x8192", "cube", "x"],
                     ["16384x512x512", "small", "q/o"], ["16384x512x256", "small", "k/v"],
                     ["16384x512x2048", "small", "up"], ["16384x2048x512", "small", "down"]]
    for bad in (["--configs", "bare:harness"], ["--gemm-shapes", "8x8"],
                ["--gemm-recipes", "nosuch"]):
        r = _run("--presets", "micro", *bad, "--gemm", "--dry-run")
        assert r.returncode == 2, (bad, r.stderr)


def test_harness_and_gemm_ratios(bench_train):
    assert bench_train.config_options("bare") == ("bf16", {"bare"})
    assert bench_train.config_options("bare:scan") == ("bf16", {"bare", "scan"})
    assert bench_train.harness("nvfp4:scan:harness") and not bench_train.harness("bare")
    with pytest.raises(ValueError, match="bf16:harness"):
        bench_train.config_options("bare:harness")
    rows = [
        {"preset": "p", "config": "bare", "spec": "bf16", "quantized": False,
         "scan_layers": False, "status": "ok", "tokens_per_s": 200.0, "compile_s": 1.0},
        {"preset": "p", "config": "bf16:harness", "spec": "bf16", "quantized": False,
         "scan_layers": False, "harness": True, "status": "ok", "tokens_per_s": 150.0},
        {"preset": "p", "config": "nvfp4:harness", "spec": "nvfp4", "quantized": True,
         "scan_layers": False, "harness": True, "status": "ok", "tokens_per_s": 100.0},
    ]
    bench_train.add_ratios(rows)
    by = {r["config"]: r for r in rows}
    assert by["bf16:harness"]["vs_bare_loop"] == 0.75 and by["bf16:harness"]["bare_loop"] == "bare"
    assert by["nvfp4:harness"]["vs_bare_loop"] is None  # no minimal-loop nvfp4 row
    assert by["nvfp4:harness"]["vs_fastest_bf16"] == 0.5  # against bare, the fastest
    assert "| `bf16:harness` | 150 | 0.75x | 0.750x |" in bench_train.table(rows)
    g = bench_train.gemm_ratios([
        {"shape": [2, 3, 4], "source": "cube", "layers": None, "recipe": "jnp.dot",
         "status": "ok", "median_us": 10.0, "flops": 144, "method": "cupti"},
        {"shape": [2, 3, 4], "source": "cube", "layers": None, "recipe": "mxfp4",
         "status": "ok", "median_us": 8.0, "flops": 144, "method": "cupti"},
        {"shape": [2, 3, 4], "source": "cube", "layers": None, "recipe": "nvfp4",
         "status": "error", "error": "boom", "flops": 144}])
    assert [x["vs_jnp_dot"] for x in g] == [1.0, 0.8, None]
    assert g[1]["tflops"] == pytest.approx(144 / 8e-6 / 1e12)
    assert "| 2x3x4 | cube | 10 (1.00x) | 8 (0.80x) | error (boom) |" in (
        bench_train.gemm_table(g))
    assert bench_train.preset_gemms("micro", 8) == [
        ("q/o", (8, 64, 64)), ("k/v", (8, 64, 32)), ("up", (8, 64, 128)),
        ("down", (8, 128, 64))]
