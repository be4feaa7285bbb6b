"""fp4jax's test suite, by layer (``core``, ``recipes``, ``dot``, ``kernels``, ``nn``,
``train``, ``experiments``, ``docs``); the helpers the layers share live here, at the top:
``reference`` (the independent NumPy reference), ``kernel_inputs``, ``interpret``,
``harness_models``, ``textdata``."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
"""The repository's root folder."""
