"""Pallas Mosaic GPU kernels for fp4jax on Hopper (sm_90), grouped by operation.

``dot_sm90`` and ``dot_sm100`` are ``fp4jax.dot``'s kernel backends (``fp4jax.backends.
Backend``), found by the core through the ``fp4jax.backends`` entry points
(``pyproject.toml``) the first time a call chooses its backends, never imported by the
core by name; ``dispatch`` holds the standalone kernel operations (packed quantize, W4A16,
W4A4) with their XLA fallback; ``support`` where the kernels run and what they implement;
``quantize/`` and ``gemm/`` hold the kernels, each tested against the core XLA function
that defines its meaning. Nothing here imports Pallas until a kernel is needed. See
``README.md`` beside this file for what each kernel covers and how fast it is.
"""
