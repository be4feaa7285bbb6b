"""Deprecated alias for one release: the byte-level corpora moved to ``fp4jax.train.data``
(the training harness, their one user; every public name is re-exported here)."""

import warnings

from fp4jax.train.data import *  # noqa: F403
from fp4jax.train.data import __all__  # noqa: F401

warnings.warn("fp4jax.data moved to fp4jax.train.data; the alias fp4jax.data goes in the next "
              "release", DeprecationWarning, stacklevel=2)
