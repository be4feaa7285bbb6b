"""Deprecated alias for one release: ``fp4jax.ragged_dot`` and its helpers moved to
``fp4jax.quantized_ragged_dot`` (named after what it holds, beside ``quantized_dot`` and
``quantized_attention``; every public name is re-exported here)."""

import warnings

from fp4jax.quantized_ragged_dot import *  # noqa: F403
from fp4jax.quantized_ragged_dot import __all__  # noqa: F401

warnings.warn("fp4jax.grouped_dot moved to fp4jax.quantized_ragged_dot; the alias "
              "fp4jax.grouped_dot goes in the next release", DeprecationWarning, stacklevel=2)
