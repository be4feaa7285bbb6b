"""fp4jax: 4-bit floating point (NVFP4, MXFP4) training numerics for JAX.

Public API (see ``README.md``):
  formats   ``NVFP4``, ``MXFP4``, ``MXFP4_OCP``, ``MXFP8_E4M3``, ``MXFP8_E5M2``,
            ``MXFP6_E2M3``, ``MXFP6_E3M2`` (OCP MX; ``formats.FORMATS`` adds their
            rounded-up-scale ``_up`` variants), ``BlockFormat``
  tensors   ``quantize``, ``dequantize``, ``QuantizedArray``, ``pack_e2m1``, ``unpack_e2m1``
  GEMMs     ``dot``, ``dot_general`` (custom_vjp, FP4 forward and backward),
            ``ragged_dot`` (grouped / mixture-of-experts GEMMs, one ``dot`` per expert)
  attention ``attention`` (opt-in FP4 attention: q k^T and P v under an
            ``recipes.AttentionRecipe``, softmax in float32)
  recipes   ``recipes.nvfp4()``, ``.fp4_all_the_way()``, ``.mxfp4()``, ``.bf16()``,
            ``.nvfp4_fwd_only()``, ``.mxfp8()``, ``.mxfp8_fwd_nvfp4_bwd()``; ``Recipe``,
            ``GemmSpec``, ``QuantSpec``
  RHT       ``random_hadamard_transform``
  channels  ``outcontrol`` (TetraJet-v2's OutControl: outlier input channels in MXFP8,
            ``outcontrol.split_dot``)
  Flax      ``fp4jax.nn`` (linen/NNX layers, ``PrecisionPolicy``), ``fp4jax.models`` (Llama):
            imported on first use, so the core does not load Flax.
  Training  ``fp4jax.train`` (the ``fp4jax-train`` harness: ``TrainConfig``, ``train``,
            ``compare``; its corpora and tokenizers ``fp4jax.train.data`` and
            ``fp4jax.train.tokens``), also imported on first use. (``fp4jax.data`` and
            ``fp4jax.tokens`` are deprecated aliases of those two for one release.)
"""

import importlib

from fp4jax import numerics, outcontrol, recipes
from fp4jax.formats import (
    MXFP4,
    MXFP4_OCP,
    MXFP6_E2M3,
    MXFP6_E3M2,
    MXFP8_E4M3,
    MXFP8_E5M2,
    NVFP4,
    BlockFormat,
    get_format,
)
from fp4jax.hadamard import TE_SIGN_VECTOR, random_hadamard_transform
from fp4jax.quantization import (
    QuantizedArray,
    dequantize,
    pack_e2m1,
    quantize,
    unpack_e2m1,
)
from fp4jax.quantized_attention import attention
from fp4jax.quantized_dot import dot, dot_general
from fp4jax.quantized_ragged_dot import ragged_dot
from fp4jax.recipes import GemmSpec, QuantSpec, Recipe

__version__ = "0.1.0"

# "data": the deprecated alias of fp4jax.train.data, for one release
_LAZY_SUBMODULES = ("nn", "models", "data", "train")


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"fp4jax.{name}")
    raise AttributeError(f"module 'fp4jax' has no attribute {name!r}")

__all__ = [
    "BlockFormat",
    "GemmSpec",
    "MXFP4",
    "MXFP4_OCP",
    "MXFP6_E2M3",
    "MXFP6_E3M2",
    "MXFP8_E4M3",
    "MXFP8_E5M2",
    "NVFP4",
    "QuantSpec",
    "QuantizedArray",
    "Recipe",
    "TE_SIGN_VECTOR",
    "attention",
    "dequantize",
    "dot",
    "dot_general",
    "get_format",
    "models",
    "nn",
    "numerics",
    "outcontrol",
    "pack_e2m1",
    "quantize",
    "ragged_dot",
    "random_hadamard_transform",
    "recipes",
    "train",
    "unpack_e2m1",
]
