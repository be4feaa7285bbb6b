"""``experiments/bench_harness.py`` on a CPU at ``micro`` size: in one process, the bare
loop runs the harness's own jitted step (not traced again by the harness runs) and gives
the harness's losses bit for bit; the JSON has the run metadata, positive tokens/s for the
bare loop and each variant, and their ratios; the loop constants a variant sets are put
back."""

from __future__ import annotations

import json

import pytest

from tests.experiments import experiments_on_path

pytestmark = pytest.mark.usefixtures("keep_compile_cache")


@pytest.fixture(scope="module")
def bench_harness():
    with experiments_on_path():
        import bench_harness

        yield bench_harness


def test_micro_bare_and_harness_in_one_process(bench_harness, tmp_path, capsys):
    from fp4jax.train import loop, processes

    before = (loop.IN_FLIGHT, loop.PREFETCH, processes.host_value)
    rc = bench_harness.main(["--preset", "micro", "--configs", "bf16", "--batch-size", "4",
                             "--seq-len", "32", "--steps", "12", "--warmup", "2",
                             "--window", "5", "--repeats", "1", "--variants", "lean",
                             "sync", "--out", str(tmp_path)])
    assert rc == 0
    assert (loop.IN_FLIGHT, loop.PREFETCH, processes.host_value) == before
    data = json.loads((tmp_path / "bench_harness.json").read_text())
    assert data["run"]["platform"] == "cpu" and data["run"]["jax"]
    (row,) = data["rows"]
    assert row["status"] == "ok" and row["retraced"] is False
    assert row["bare"]["tokens_per_s"] > 0
    assert len(row["bare"]["runs"][0]["windows"]) == 2  # (12 - 2) // 5
    for v in ("lean", "sync"):
        assert row[v]["tokens_per_s"] > 0
        assert row["ratios"][v] == row[v]["tokens_per_s"] / row["bare"]["tokens_per_s"]
        assert row[v]["runs"][0]["host"]["reads"] == 12  # one read of each step's metrics
    assert row["ratio"] == row["ratios"]["lean"]
    # the same step, data, initial state and keys: the same last loss, bit for bit (CPU)
    same = row["same_losses"]
    assert same["step"] == 11 and same["bare"] == same["lean"] == same["sync"]
    out = capsys.readouterr().out
    assert "BENCH_HARNESS micro bf16: bare" in out and "bench_harness: bf16 lean/bare" in out


def test_steps_must_cover_warmup_and_a_window(bench_harness):
    with pytest.raises(SystemExit):
        bench_harness.parse_args(["--steps", "10", "--warmup", "8", "--window", "5"])
