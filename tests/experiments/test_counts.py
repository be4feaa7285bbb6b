"""``experiments/counts.py`` (issue 56 item 3): both subcommands run (``nvfp4``,
``mxfp4-fp8``) and the NVFP4 counts equal hand arithmetic, so the tables in
docs/performance.md cannot drift silently."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests import ROOT


@pytest.fixture(scope="module")
def C():
    spec = importlib.util.spec_from_file_location("counts", ROOT / "experiments/counts.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["counts"] = mod
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop("counts", None)


def test_main_prints_and_predicts(C, capsys):
    out = C.main(["nvfp4"])
    text = capsys.readouterr().out
    assert "| `small` | floor, glue folded |" in text
    assert set(out) == {"small", "100m"}
    assert out["small"]["blocks"] == 6 and out["100m"]["blocks"] == 10
    # the designs in the order of their bytes: each no slower than the one before
    r = out["small"]
    assert (r["floor, glue kept"] < r["floor, glue folded"]
            < r["floor_producer, glue folded"]
            < r["fp8_producer, glue folded, GEMM at cuBLAS speed"])
    # FP8 storage pays over the producer-amax floor only with a GEMM near cuBLAS's speed
    assert 0.8 < r["break-even GEMM speed fp8_producer"] < 0.9


def test_counts_equal_hand_arithmetic(C):
    s = 8192 * 8192 * 2  # one bf16 8192^2 tensor read once
    assert C.bf16_bytes((8192, 8192)) == s
    lin = [("w", 8192, 8192, 8192, "x")]
    # BF16's three GEMMs: six operand reads and three outputs
    assert C.count(lin, "bf16")[2] == 9 * s
    # today: x and dy 5.5 S each (amax pass 1.25 S, its partials read 0.25 S, rows 2 S,
    # cols 2 S), w 3 S (amax read, 2D read + write)
    assert C.count(lin, "today")[1] == 14 * s
    assert len(C.count(lin, "today")[0]) == 10
    # floor: x and dy 4 S (amax read, one read writing two copies); producer amax: 3 S, w 2 S
    assert C.count(lin, "floor")[1] == 11 * s
    assert C.count(lin, "floor_producer")[1] == 8 * s
    # FP8 codes: a copy is S/2 codes + S/32 scales (S/512 for 16x16 tiles)
    assert C.count(lin, "fp8_producer")[1] == 2 * (s + 2 * (s / 2 + s / 32)) + (
        s + s / 2 + s / 512)
    # the GEMMs' flops and their time at 800 TFLOP/s
    assert C.count(lin, "bf16")[3] == 3 * 2 * 8192**3
    # one small block: q, k and v share their input, so 4 x tensors and 6 dy tensors
    passes = C.count(C.block_linears(512, 256, 2048), "today")[0]
    assert len({t for t, *_ in passes if t.startswith("x ")}) == 4
    assert len({t for t, *_ in passes if t.startswith("dy ")}) == 6


def test_fp8_wgmma_is_no_faster_than_bf16(C, capsys):
    assert C.fp8_wgmma_cycles() == pytest.approx((128 + 256) * 64 * 1.5 / 128 / 1024)
    assert "3.50x / 2.00x / 1.00x" in capsys.readouterr().out


def test_mxfp4_fp8_rows(C, capsys):
    """``mxfp4-fp8`` prints one markdown row per GEMM set: two 8192^3 rows and two a preset;
    one 8192^3 GEMM is 1,099.5 GFLOP."""
    C.main(["mxfp4-fp8"])
    rows = capsys.readouterr().out.splitlines()
    assert len(rows) == 8 and all(r.startswith("| ") for r in rows)
    assert rows[0].startswith("| 8192^3 GEMM | 1,099.5 |")
