"""Test session set-up: 4 virtual CPU devices (for sharding tests), float32 defaults."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

# Tests compare float32 matmuls against NumPy: on GPUs the default precision is
# reduced (TF32-like), so ask for full float32 everywhere (no effect on CPU).
jax.config.update("jax_default_matmul_precision", "highest")
