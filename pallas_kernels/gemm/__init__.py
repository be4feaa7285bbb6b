"""GEMM kernels for Hopper: ``alpha_sm90`` (bf16 GEMM with the NVFP4 tensor scales in the
epilogue, the three GEMMs of ``fp4jax.dot``), ``w4a16_sm90`` (packed NVFP4 weight x bf16
activations, decode-size batches) and ``w4a4_sm90`` (packed NVFP4/MXFP4 x packed
NVFP4/MXFP4). For Blackwell (sm_100+, not run on one): ``blockscale_sm100``
(``jax.nn.scaled_matmul`` on NVFP4 operands) and ``tcgen05_sm100`` (Pallas block-scaled
``tcgen05_mma``, opt-in). References: XLA ``dot_general`` on ``fp4jax.dequantize``d operands.
Use them through ``pallas_kernels.dispatch``."""
