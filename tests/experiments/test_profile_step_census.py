"""``experiments/profile_step.py census`` (was ``glue_census.py``) groups a profiled step's
kernels by the op XLA's HLO names for them (a fusion ``%x.12``'s kernel is ``x_12``): Pallas
kernels, operand glue, XLA quantization, Threefry keys, the rest by category; its totals are
the input's."""

from __future__ import annotations

import gzip
import json

import pytest

from tests.experiments import experiments_on_path

pytest.importorskip("jax")
with experiments_on_path():
    import profile_step as ps

HLO = "\n".join([
    "HloModule jit_step",
    '  %input_concatenate_fusion.207 = f32[2,64]{1,0} fusion(%a), kind=kInput, '
    'metadata={op_name="jit(step)/q/jit(dot3)/fp4_operands/concatenate"}',
    '  %loop_select_fusion.3 = f32[] fusion(%b), kind=kLoop, '
    'metadata={op_name="jit(step)/o/jit(dot3)/fp4_operands/fp4_quantize/select_n"}',
    '  ROOT %loop_add_fusion = f32[8]{0} fusion(%c), kind=kLoop, '
    'metadata={op_name="jit(step)/add"}', ""])
KERNELS = [["input_concatenate_fusion_207", 3.0, "quantize"],
           ["input_concatenate_fusion_207", 3.5, "quantize"],
           ["loop_select_fusion_3", 1.5, "quantize"],
           ["loop_add_fusion", 4.0, "elementwise"],
           ["fq_rows_scaled_kernel", 20.0, "pallas"],
           ["threefry2x32_kernel", 1.25, "prng"]]


def test_census_groups_kernels_by_their_ops(tmp_path, capsys):
    for spec, ks in (("nvfp4", KERNELS), ("bf16", KERNELS[3:4])):
        with gzip.open(tmp_path / f"profile_step_{spec}_kernels.json.gz", "wt") as f:
            json.dump(ks, f)
    with gzip.open(tmp_path / "profile_step_nvfp4_hlo.txt.gz", "wt") as f:
        f.write(HLO)
    out = tmp_path / "census.json"
    assert ps.main(["census", "--dir", str(tmp_path), "--json", str(out)]) == 0
    c = json.loads(out.read_text())
    assert c["groups"] == {
        ps.GLUE: {"kernels": 2, "us": 6.5},
        ps.XLA_QUANT: {"kernels": 1, "us": 1.5},
        "elementwise": {"kernels": 1, "us": 4.0},
        "Pallas operand kernels": {"kernels": 1, "us": 20.0},
        "Threefry key derivations": {"kernels": 1, "us": 1.2}}
    assert c["kernels"] == 6 and c["us"] == 33.2 and c["baseline_kernels"] == 1
    assert [r["op"] for r in c["rows"]][2:4] == [
        "jit(step)/o/jit(dot3)/fp4_operands/fp4_quantize/select_n", "jit(step)/add"]
    text = capsys.readouterr().out
    assert "nvfp4: 6 kernels, 33 µs; bf16: 1 kernels, 4 µs" in text
    assert "nvfp4: 4 kernels under 4 µs, 9 µs" in text
