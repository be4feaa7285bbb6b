"""Tests of the lab scripts in ``experiments/`` (never imported by the library)."""

import contextlib
import sys
from collections.abc import Iterator

from tests import ROOT

EXPERIMENTS = ROOT / "experiments"


@contextlib.contextmanager
def experiments_on_path() -> Iterator[None]:
    """``experiments/`` on ``sys.path`` while the block runs (its scripts import each other
    as top-level modules: ``lab``, ``bench_train``), taken off after."""
    sys.path.insert(0, str(EXPERIMENTS))
    try:
        yield
    finally:
        sys.path.remove(str(EXPERIMENTS))
