"""Modules that moved to the rooms of their users (issue 55, item 5) still answer at their old
names for one release: every public name of the new module is the same object under the old
one, and importing the old one raises a ``DeprecationWarning`` naming the new place."""

import importlib
import warnings

import pytest

MOVED = [("fp4jax.data", "fp4jax.train.data"),
         ("fp4jax.tokens", "fp4jax.train.tokens"),
         ("fp4jax.grouped_dot", "fp4jax.quantized_ragged_dot")]


@pytest.mark.parametrize(("old", "new"), MOVED)
def test_deprecated_alias_reexports_every_public_name(old, new):
    target = importlib.import_module(new)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        alias = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        alias = importlib.reload(alias)
    assert sorted(alias.__all__) == sorted(target.__all__)
    for name in target.__all__:
        assert getattr(alias, name) is getattr(target, name), name


def test_nn_model_keeps_its_public_names():
    from fp4jax.nn import hooks, layer_report, model, nnx_rewrite

    assert model.report is layer_report.report and model.Report is layer_report.Report
    assert sorted(model.__all__) == ["Report", "quantize_model", "report"]
    assert hooks.quantize_linen and nnx_rewrite.quantize_nnx  # the seams model.py calls


def test_the_package_answers_for_ragged_dot_and_the_lazy_data_alias():
    import fp4jax
    from fp4jax.quantized_ragged_dot import ragged_dot

    assert fp4jax.ragged_dot is ragged_dot  # the function, not a module of that name
    assert "data" not in fp4jax.__all__
