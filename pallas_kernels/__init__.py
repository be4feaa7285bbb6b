"""Pallas Mosaic GPU kernels for fp4jax on Hopper (sm_90), grouped by operation.

``pallas_kernels.dispatch`` is the entry point and the only module that chooses a backend
(it reads ``FP4JAX_KERNELS`` and ``FP4JAX_KERNEL_GEMM``); ``quantize/`` and ``gemm/`` hold
the kernels, each tested against the core XLA function that defines its meaning. Nothing
here is imported by ``import fp4jax`` until a kernel is needed. See ``README.md`` beside
this file for what each kernel covers and how fast it is.
"""
