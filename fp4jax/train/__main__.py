"""``python -m fp4jax.train``: the ``fp4jax-train`` command (``fp4jax.train.cli.main``)."""

import os
import sys

from fp4jax.train.cli import main

if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
