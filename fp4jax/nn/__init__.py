"""Flax integration of fp4jax: linen and NNX layers and layer precision policies.

* :mod:`fp4jax.nn.linen`: ``DotGeneral`` (for ``nn.Dense(dot_general_cls=...)``) and ``Dense``.
* :mod:`fp4jax.nn.nnx`: ``DotGeneral`` (for ``nnx.Linear(dot_general=...)``) and ``Linear``.
* :class:`PrecisionPolicy`: which linear layers of a model run in which recipe.
"""

from fp4jax.nn import linen, nnx
from fp4jax.nn.policy import PrecisionPolicy, recipe_quantizes

__all__ = ["PrecisionPolicy", "linen", "nnx", "recipe_quantizes"]
