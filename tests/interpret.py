"""Mosaic GPU interpret mode for the kernel tests (JAX >= 0.10 ships it; skip otherwise)."""

import pytest

try:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
except ImportError:  # pragma: no cover
    InterpretGPUParams = None

needs_interpret = pytest.mark.skipif(InterpretGPUParams is None,
                                     reason="no Mosaic GPU interpret mode")
