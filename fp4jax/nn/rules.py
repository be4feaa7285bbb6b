"""Deprecated alias for one release: precision rules moved to ``fp4jax.rules`` (the core's
one currency for layer precision; ``fp4jax.nn.Rule`` and the other names of
``fp4jax.nn`` are unchanged)."""

from fp4jax.rules import *  # noqa: F403
from fp4jax.rules import __all__  # noqa: F401
