"""Flax integration of fp4jax: linen and NNX layers, precision rules by module path.

* :func:`quantize_model`: precision rules (:class:`Rule`: module-path regex -> recipe)
  applied to any unedited linen or NNX model; :func:`report` lists what they did;
  :func:`load_rules` reads rules from JSON or TOML.
* :func:`quantize_function`: the same rules on plain JAX functions (Equinox, pure
  functions) by ``jax.named_scope`` path; :func:`function_report`.
* :mod:`fp4jax.nn.linen`: ``DotGeneral`` (for ``nn.Dense(dot_general_cls=...)``) and ``Dense``.
* :mod:`fp4jax.nn.nnx`: ``DotGeneral`` (for ``nnx.Linear(dot_general=...)``) and ``Linear``.
* :class:`PrecisionPolicy`: which linear layers of a model run in which recipe.
* :mod:`fp4jax.nn.taps`: product taps, what a linen layer runs around each quantized
  product (the statistics, OutControl, or your own: ``quantize_model(..., taps=...)``).
"""

from fp4jax.nn import linen, nnx, taps
from fp4jax.nn.functional import FunctionReport, function_report, quantize_function
from fp4jax.nn.model import Report, quantize_model, report
from fp4jax.nn.policy import PrecisionPolicy
from fp4jax.recipes import recipe_quantizes
from fp4jax.rules import Rule, einsum_dimension_numbers, layer_key, load_rules, match_rule

__all__ = ["FunctionReport", "PrecisionPolicy", "Report", "Rule", "einsum_dimension_numbers",
           "function_report", "layer_key", "linen", "load_rules", "match_rule", "nnx",
           "quantize_function", "quantize_model", "recipe_quantizes", "report", "taps"]
