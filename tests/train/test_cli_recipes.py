"""The newer recipes through the training CLI on the ``micro`` preset: two steps each, finite
losses, the recipe recorded (issue 20). Both are compile-heavy: marked ``heavy``, they start
early on the test workers instead of ending the suite."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.mark.heavy(40)
def test_train_cli_runs_the_hybrid_recipe(tmp_path):
    """``fp4jax-train --recipe mxfp8_fwd_nvfp4_bwd --preset micro``: two steps, finite losses,
    the recipe recorded."""
    import json

    from fp4jax import train as T
    from tests.textdata import write_text

    corpus = write_text(tmp_path / "c.txt", 20_000)
    out = tmp_path / "run"
    assert T.main(["--preset", "micro", "--recipe", "mxfp8_fwd_nvfp4_bwd", "--steps", "2",
                   "--lr", "0.01", "--batch-size", "4", "--seq-len", "32", "--eval-every", "0",
                   "--log-every", "1", "--warmup-steps", "1", "--no-progress",
                   "--compile-cache", "auto", "--devices", "1", "--data", str(corpus),
                   "--out", str(out)]) == 0
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in recs if r["type"] == "train"]
    assert len(losses) == 2 and np.isfinite(losses).all(), recs
    assert {r["recipe"] for r in recs if r["type"] == "train"} == {"mxfp8_fwd_nvfp4_bwd"}


@pytest.mark.heavy(66)
def test_train_cli_runs_quartet2_with_smooth_swiglu(tmp_path):
    """``fp4jax-train --recipe quartet2 --ffn smooth_swiglu --preset micro``: two steps
    (4over6 forward, RHT-128 re-drawn and MS-EDEN backward, the Smooth-SwiGLU down
    projection), finite losses, the recipe and the FFN recorded."""
    import json

    from fp4jax import train as T
    from tests.textdata import write_text

    corpus = write_text(tmp_path / "c.txt", 20_000)
    out = tmp_path / "run"
    assert T.main(["--preset", "micro", "--recipe", "quartet2", "--ffn", "smooth_swiglu",
                   "--steps", "2", "--lr", "0.01", "--batch-size", "4", "--seq-len", "32",
                   "--eval-every", "0", "--log-every", "1", "--warmup-steps", "1",
                   "--no-progress", "--compile-cache", "auto", "--devices", "1",
                   "--data", str(corpus), "--out", str(out)]) == 0
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in recs if r["type"] == "train"]
    assert len(losses) == 2 and np.isfinite(losses).all(), recs
    assert {r["recipe"] for r in recs if r["type"] == "train"} == {"quartet2"}
    result = json.loads((out / "result.json").read_text())
    assert result["config"]["ffn"] == "smooth_swiglu", result.get("config")
