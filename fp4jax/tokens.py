"""Deprecated alias for one release: tokenizers and tokenized corpora moved to
``fp4jax.train.tokens`` (the training harness, their one user; every public name is
re-exported here, and ``python -m fp4jax.tokens`` still runs ``fp4jax-tokenize``)."""

import warnings

from fp4jax.train.tokens import *  # noqa: F403
from fp4jax.train.tokens import __all__, main  # noqa: F401

warnings.warn("fp4jax.tokens moved to fp4jax.train.tokens; the alias fp4jax.tokens goes in the "
              "next release", DeprecationWarning, stacklevel=2)

if __name__ == "__main__":
    main()
