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
    sys.path.insert(0, str(EXP))
    try:
        import bench_train

        yield bench_train
    finally:
        sys.path.remove(str(EXP))


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
