"""NVFP4 quantize kernels for Hopper: ``operand_sm90`` (the bf16 ``data * scale`` GEMM
operands of ``fp4jax.dot``), ``packed_sm90`` (packed codes and scale bits) and their shared
numerics, ``common_sm90``. Reference: ``fp4jax.quantize``. Use them through
``pallas_kernels.dispatch``."""
