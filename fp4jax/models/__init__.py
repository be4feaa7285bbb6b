"""Reference models for fp4jax experiments."""

from fp4jax.models.llama import PRESETS, Llama, LlamaConfig, get_preset, quantized_llama

__all__ = ["PRESETS", "Llama", "LlamaConfig", "get_preset", "quantized_llama"]
