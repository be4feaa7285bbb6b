"""Recipe spec strings (``fp4jax.recipes.parse`` / ``spec``) and the one-line ``str()``:
the grammar against the Python expressions it abbreviates, round trips, every key, every
error."""

from __future__ import annotations

import pytest

import fp4jax
from fp4jax import recipes as R


@pytest.mark.parametrize("text,expr", [
    ("nvfp4", lambda: R.nvfp4()),
    (" nvfp4 ( ) ", lambda: R.nvfp4()),
    ("nvfp4(sr=False)", lambda: R.nvfp4().replace(sr=False)),
    ("nvfp4(rht=0, block_2d=False)", lambda: R.nvfp4().replace(rht=0, block_2d=False)),
    ("nvfp4(fmt=mxfp4)", lambda: R.nvfp4().replace(fmt=fp4jax.MXFP4)),
    ("nvfp4(fmt=BlockFormat(block_size=32, scale='e4m3'))",
     lambda: R.nvfp4().replace(fmt=fp4jax.BlockFormat("e4m3-b32", block_size=32))),
    ("nvfp4(fmt=BlockFormat('b8', 8, scale_exp_bits=8, scale_man_bits=0))",
     lambda: R.nvfp4().replace(fmt=fp4jax.BlockFormat("b8", 8, 8, 0))),
    ("nvfp4(dgrad.lhs.rounding=nearest, wgrad.lhs.rounding=stochastic)",
     lambda: R.nvfp4().replace(**{"dgrad.lhs.rounding": "nearest",
                                  "wgrad.lhs.rounding": "stochastic"})),
    ("nvfp4(wgrad.hadamard=128, wgrad.hadamard_signs=random)",
     lambda: R.nvfp4().replace(**{"wgrad.hadamard": 128, "wgrad.hadamard_signs": "random"})),
    ("nvfp4(wgrad.hadamard_signs=7, fprop.rhs.block_2d=False, dgrad.rhs.fmt=None)",
     lambda: R.nvfp4().replace(**{"wgrad.hadamard_signs": 7, "fprop.rhs.block_2d": False,
                                  "dgrad.rhs.fmt": None})),
    ("fp4_all_the_way(name='fp4-rtn', sr=False)",
     lambda: R.fp4_all_the_way().replace(name="fp4-rtn", sr=False)),
    ("bf16(fprop.lhs.fmt=nvfp4)", lambda: R.bf16().replace(**{"fprop.lhs.fmt": "nvfp4"})),
    ("MXFP4", lambda: R.mxfp4()),
    ("mxfp8", lambda: R.mxfp8()),
    ("mxfp8_fwd_nvfp4_bwd", lambda: R.mxfp8_fwd_nvfp4_bwd()),
    ("nvfp4(fmt=mxfp6_e2m3)", lambda: R.nvfp4().replace(fmt=fp4jax.MXFP6_E2M3)),
    ("mxfp8(dgrad.lhs.fmt=mxfp8_e5m2_up, wgrad.rhs.fmt=mxfp8_e5m2_up)",
     lambda: R.mxfp8().replace(**{"dgrad.lhs.fmt": fp4jax.formats.MXFP8_E5M2_UP,
                                  "wgrad.rhs.fmt": fp4jax.formats.MXFP8_E5M2_UP})),
    ("nvfp4(fmt=BlockFormat(elem='e4m3', scale='e8m0', block_size=32, tensor_scale=False, "
     "scale_rule='ocp'))",
     lambda: R.nvfp4().replace(fmt=fp4jax.BlockFormat(
         "e4m3_e8m0-b32", 32, 8, 0, False, "ocp", elem_exp_bits=4, elem_man_bits=3))),
    ("fp4_all_the_way(fmt=BlockFormat(scale='e5m2', scale_ieee=True))",
     lambda: R.fp4_all_the_way().replace(fmt=fp4jax.BlockFormat(
         "e5m2-b16-ieee", 16, 5, 2, scale_ieee=True))),
])
def test_parse_equals_the_expression(text, expr):
    assert R.parse(text) == expr()


def _variants():
    out = [R.get(n) for n in R.names()]
    n = R.nvfp4()
    out += [n.replace(sr=False), n.replace(rht=0), n.replace(block_2d=False),
            n.replace(fmt=fp4jax.MXFP4), n.replace(fmt=fp4jax.BlockFormat("e8m0-b16", 16, 8, 0)),
            n.replace(name="custom", **{"wgrad.hadamard_signs": "random"}),
            n.replace(**{"fprop.lhs.fmt": fp4jax.MXFP4_OCP, "wgrad.hadamard_signs": (1.0,) * 16}),
            R.bf16().replace(name="my recipe", **{"fprop.lhs.fmt": "nvfp4"}),
            n.replace(fmt=fp4jax.BlockFormat("e3m4-ieee", 16, 3, 4, scale_ieee=True)),
            R.mxfp8().replace(fmt=fp4jax.MXFP8_E4M3),
            n.replace(**{"fprop.lhs.fmt": fp4jax.BlockFormat("e2m3-b16", 16, elem_exp_bits=2,
                                                             elem_man_bits=3)})]
    return out


@pytest.mark.parametrize("recipe", _variants(), ids=lambda r: r.name)
def test_spec_round_trip(recipe):
    text = R.spec(recipe)
    assert R.parse(text) == recipe, text
    assert R.spec(R.parse(text)) == text


def test_spec_is_short_for_common_ablations():
    assert R.spec(R.nvfp4()) == "nvfp4"
    assert R.spec(R.nvfp4().replace(rht=0)) == "nvfp4(wgrad.hadamard=0)"
    assert R.spec(R.nvfp4().replace(fmt=fp4jax.MXFP4)) == "nvfp4(fmt=mxfp4)"


def test_str_is_one_readable_line():
    s = str(R.nvfp4())
    assert "\n" not in s and s.startswith("nvfp4: ")
    assert "fprop x nvfp4 1x16 e4m3 RtN, w nvfp4 16x16 e4m3 RtN" in s
    assert "dgrad dy nvfp4 1x16 e4m3 SR" in s and "wgrad RHT16" in s
    assert "mxfp4 1x32 e8m0" in str(R.mxfp4()) and "bf16, w bf16" in str(R.bf16())


@pytest.mark.parametrize("bad,match", [
    ("nvfp5", r"unknown recipe 'nvfp5'; valid names: \['bf16'"),
    ("nvfp4(sr=False", "NAME or NAME"),
    ("nvfp4(fmt=BlockFormat(block_size=32)", "unclosed"),
    ("nvfp4(foo=1)", r"unknown key 'foo'; valid keys: \['sr', 'rht'"),
    ("nvfp4(dgrad.lhs.round=nearest)", "unknown key 'dgrad.lhs.round'"),
    ("nvfp4(fmt=nvfp9)", "unknown format 'nvfp9'; valid names"),
    ("nvfp4(rht=17)", "rht=17: Hadamard size"),
    ("nvfp4(dgrad.lhs.rounding=up)", "dgrad.lhs.rounding=up: .*'nearest', 'stochastic'"),
    ("nvfp4(sr=True)", "sr=True"),
    ("nvfp4(x)", "'x' is not key=value"),
    ("nvfp4(rht=)", "rht= has no value"),
    ("nvfp4(rht=1+)", "cannot read the value of rht"),
    ("nvfp4(fmt=BlockFormat(block_size=32, scale='e9'))", "scale='e9'"),
    ("nvfp4(fmt=BlockFormat(blocksize=32))", "no argument 'blocksize'"),
    ("nvfp4(fmt=BlockFormat(block_size=4))", "block_size must be an int in 8..128"),
    ("nvfp4(rht=len('abc'))", "not a literal"),
    ("nvfp4(fmt=BlockFormat(elem='e3m3'))", r"elem_exp_bits=3, elem_man_bits=3\) is not an "
                                            "OCP MX element format"),
    ("nvfp4(fmt=BlockFormat(elem='fp8'))", "elem='fp8': use 'eXmY'"),
    ("mxfp8(block_scale_rule=4over6)", "NVFP4 only"),
])
def test_bad_specs_name_the_problem(bad, match):
    with pytest.raises(ValueError, match=match):
        R.parse(bad)


def test_parse_passes_recipes_through_and_rejects_other_types():
    r = R.nvfp4()
    assert R.parse(r) is r
    with pytest.raises(TypeError, match="string or a Recipe"):
        R.parse(3)


def test_parse_run_spec_splits_the_callers_keys_once():
    """``parse_run_spec``: the caller's keys converted, the recipe's items applied, the base
    spec without the caller's keys; ``parse(base)`` is the same recipe."""

    def run_int(text):
        if not text.isdigit():
            raise ValueError("last_bf16 is an int >= 0")
        return int(text)

    keys = {"last_bf16": run_int}
    rs = R.parse_run_spec(" nvfp4(sr=False, last_bf16=0, rht=0) ", keys)
    assert rs.text == "nvfp4(sr=False, last_bf16=0, rht=0)"
    assert rs.base == "nvfp4(sr=False, rht=0)"
    assert dict(rs.extra) == {"last_bf16": 0}
    assert rs.recipe == R.parse("nvfp4(sr=False, rht=0)") == R.parse(rs.base)
    bare = R.parse_run_spec("nvfp4")
    assert (bare.base, dict(bare.extra), bare.recipe) == ("nvfp4", {}, R.nvfp4())
    assert R.parse_run_spec("nvfp4(last_bf16=0)", keys).base == "nvfp4"
    with pytest.raises(ValueError, match=r"recipe spec 'nvfp4\(last_bf16=x\)': last_bf16=x: "
                                         r"last_bf16 is an int >= 0"):
        R.parse_run_spec("nvfp4(last_bf16=x)", keys)
    with pytest.raises(ValueError, match="last_bf16 given twice"):
        R.parse_run_spec("nvfp4(last_bf16=0, last_bf16=1)", keys)
    with pytest.raises(ValueError, match=r"unknown key 'foo'; valid keys: .*; run-level keys: "
                                         r"\['last_bf16'\]"):
        R.parse_run_spec("nvfp4(foo=1, last_bf16=0)", keys)
    with pytest.raises(ValueError, match=r"recipe spec 'nvfp5\(last_bf16=0\)': unknown recipe"):
        R.parse_run_spec("nvfp5(last_bf16=0)", keys)
    with pytest.raises(TypeError, match="must be a string"):
        R.parse_run_spec(R.nvfp4())
