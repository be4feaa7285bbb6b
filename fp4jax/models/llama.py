"""A Llama-style decoder-only transformer, written with plain Flax layers, and its precision
rules.

Architecture: token embedding (untied from the LM head), ``n_layers`` pre-norm blocks of
RMSNorm -> grouped-query attention with rotary position embeddings -> residual, RMSNorm -> FFN
-> residual, a final RMSNorm and the LM head. No biases. The FFN is squared-ReLU
(``down(relu(up(x))**2)``, as in the NVFP4 paper's 1.2B model), SwiGLU
(``down(silu(gate(x)) * up(x))``) or Smooth-SwiGLU (SwiGLU with per-channel scaling of the
down projection's input, ``smooth_swiglu_scale``; FP4-all-the-way's 7B model).

:class:`Llama` is a plain ``flax.linen`` model (``nn.Dense`` linear layers, no fp4jax
layer): it is quantized as any other model is, by precision rules
(``fp4jax.nn.quantize_model``). :func:`quantized_llama` does that for a
:class:`~fp4jax.nn.PrecisionPolicy` (the NVFP4 paper's section 4: only the block linear
layers ``q/k/v/o``, ``gate/up/down`` in FP4, except the policy's high-precision blocks and
layers; embeddings, norms, softmax, the attention score/value matmuls and the LM head in
high precision), or for rules of your own (:func:`llama_rules`: block-level paths
``block_{i}/{layer}`` that also reach the blocks of a scanned stack). Master weights are
float32; compute runs in ``config.dtype`` (bfloat16 by default; float32 is faster on
CPUs); norms and softmax are float32; the LM head runs in the compute dtype (BF16, as the
paper keeps it) and its logits are cast to float32 for the loss.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from fp4jax import sharding
from fp4jax.models.moe import AUX_COLLECTION, moe_ffn
from fp4jax.nn.model import quantize_model
from fp4jax.nn.policy import PrecisionPolicy
from fp4jax.nn.taps import DEFAULT_TAPS, tap_collections
from fp4jax.quantized_attention import attention as quantized_attention
from fp4jax.recipes import AttentionRecipe, get_attention
from fp4jax.rules import Rule, as_rules, match_rule

ATTENTION = ("auto", "xla", "cudnn")
"""``LlamaConfig.attention`` values (``causal_attention``'s implementations)."""

SCAN_REMAT = ("none", "dots", "full")
"""``LlamaConfig.scan_remat`` values: what a scanned block keeps for the backward pass."""

FFNS = ("relu2", "swiglu", "smooth_swiglu")
"""``LlamaConfig.ffn`` values."""


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Model hyper-parameters.

    Attributes:
      vocab_size: number of token ids (256 for bytes).
      d_model: residual width D.
      n_layers: number of blocks.
      n_heads: query heads H; head size is ``d_model // n_heads``.
      n_kv_heads: key/value heads (grouped-query attention; must divide ``n_heads``).
      d_ff: FFN hidden width.
      max_seq_len: longest sequence the RoPE tables are built for.
      ffn: ``"relu2"`` (squared ReLU), ``"swiglu"`` or ``"smooth_swiglu"`` (SwiGLU whose
        down projection quantizes a per-channel-scaled input: ``smooth_swiglu_scale``).
      rope_theta: RoPE base.
      norm_eps: RMSNorm epsilon.
      dtype: compute dtype name (``"bfloat16"`` or ``"float32"``).
      init_std: std of the normal init; output projections use ``init_std/sqrt(2*n_layers)``.
      attention: how the (unquantized) causal attention runs: ``"auto"`` (the default:
        ``"cudnn"`` where it runs, NVIDIA GPUs with shapes and dtypes cuDNN takes, else
        ``"xla"``; ``causal_attention``), ``"xla"`` (einsums with float32 scores and
        softmax) or ``"cudnn"`` (``jax.nn.dot_product_attention`` on cuDNN's fused flash
        attention, NVIDIA GPUs only: bf16 inputs, float32 softmax inside, no (B, H, T, T)
        tensor in memory; about 1.7x bf16's training speed at ``small`` on an H100).
      scan_layers: run each run of consecutive blocks (``Llama.runs``; under
        :func:`quantized_llama`, the maximal runs that share their recipes) as one
        ``flax.linen.scan`` (parameters stacked along a leading axis, in
        ``blocks_{first}_{last}``), so XLA compiles one block body per run instead of one
        per block. Same function, fewer compiles; parameter tree and random draws
        (init, stochastic rounding keys) differ from the unrolled model.
      scan_remat: with ``scan_layers``, what a scanned block saves for the backward pass:
        ``"dots"`` (the default: ``flax.linen.remat`` with
        ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``, i.e. the linear
        layers' outputs; the attention scores, softmax and elementwise work are recomputed
        in the backward pass), ``"full"`` (nothing: the whole block is recomputed) or
        ``"none"`` (everything JAX saves by default, stacked over the blocks: the scan's
        dynamic-update-slice copies of every residual). Same function and gradients
        (recomputation uses the same values and random keys); a speed and memory knob
        (``"dots"`` against ``"none"`` on an H100: docs/performance.md).
      n_experts: 0 (the default): a dense FFN; ``G > 0``: a mixture of ``G`` experts, each an
        FFN of ``ffn``'s kind (``"swiglu"`` or ``"relu2"``) and width ``d_ff``, at the dense
        FFN's paths (``block_{i}/gate``, ``up``, ``down``: weights ``(G, K, N)``, grouped
        GEMMs) plus the router ``block_{i}/router`` (``fp4jax.models.moe``).
      top_k: experts per token (with ``n_experts``).
      moe_aux_weight: the load-balancing loss's coefficient (Switch Transformer's
        ``alpha = 0.01``), sown by every router (``fp4jax.models.moe.aux_loss``).
    """

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 512
    max_seq_len: int = 1024
    ffn: str = "relu2"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dtype: str = "bfloat16"
    init_std: float = 0.02
    attention: str = "auto"
    scan_layers: bool = False
    scan_remat: str = "dots"
    n_experts: int = 0
    top_k: int = 2
    moe_aux_weight: float = 0.01

    def __post_init__(self) -> None:
        if self.n_experts:
            if not 1 <= self.top_k <= self.n_experts:
                raise ValueError(f"top_k={self.top_k} must be in 1..n_experts="
                                 f"{self.n_experts}")
            if self.ffn == "smooth_swiglu":
                raise ValueError("ffn='smooth_swiglu' has no mixture-of-experts form here: "
                                 "use ffn='swiglu' or 'relu2' with n_experts")
        if self.scan_remat not in SCAN_REMAT:
            raise ValueError(f"scan_remat must be one of {SCAN_REMAT}, got {self.scan_remat!r}")
        if self.ffn not in FFNS:
            raise ValueError(f"ffn must be one of {FFNS}, got {self.ffn!r}")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {self.attention!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} not divisible by n_kv_heads={self.n_kv_heads}"
            )
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("head size d_model // n_heads must be even for RoPE")
        jnp.dtype(self.dtype)  # raises on an unknown dtype name

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def linear_layers(self) -> tuple[str, ...]:
        """Names of the linear layers inside one block."""
        mlp = ("mlp.gate", "mlp.up", "mlp.down") if self.gated else ("mlp.up", "mlp.down")
        return ("attn.q", "attn.k", "attn.v", "attn.o", *mlp)

    @property
    def gated(self) -> bool:
        """Whether the FFN is a SwiGLU (plain or smooth): gate, up and down projections."""
        return self.ffn in ("swiglu", "smooth_swiglu")

    def replace(self, **changes: Any) -> LlamaConfig:
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Exact parameter count (embedding + blocks + final norm + LM head)."""
        d, hd = self.d_model, self.head_dim
        attn = d * d * 2 + 2 * d * self.n_kv_heads * hd
        mlp = (3 if self.gated else 2) * d * self.d_ff
        if self.n_experts:  # one FFN per expert and the router
            mlp = self.n_experts * mlp + d * self.n_experts
        return 2 * self.vocab_size * d + self.n_layers * (attn + mlp + 2 * d) + d


# Presets: "micro" is for tests and smoke runs; "tiny" (~0.8M) trains on a laptop CPU in about
# a minute per hundred steps; "small" (~23M) and "100m" (~95M) are GPU models.
PRESETS: dict[str, LlamaConfig] = {
    "micro": LlamaConfig(d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=128),
    "tiny": LlamaConfig(d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=512),
    "mini": LlamaConfig(d_model=256, n_layers=6, n_heads=8, n_kv_heads=4, d_ff=1024),
    "small": LlamaConfig(d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, d_ff=2048),
    "100m": LlamaConfig(d_model=768, n_layers=12, n_heads=12, n_kv_heads=4, d_ff=4096),
    # the NVIDIA NVFP4 paper's 1.2B ablation model (20 blocks, d 2048, FFN 6144 squared
    # ReLU, 16 query and 8 KV heads, RoPE) with the byte vocabulary: 0.76B parameters (the
    # paper's 1.2B counts its 131k-token embedding and output layers)
    "1b": LlamaConfig(d_model=2048, n_layers=20, n_heads=16, n_kv_heads=8, d_ff=6144),
}


def get_preset(name: str) -> LlamaConfig:
    """Returns the preset config ``name``; raises ValueError listing the valid names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; valid presets: {sorted(PRESETS)}") from None


class RMSNorm(nn.Module):
    """RMSNorm over the last axis, computed in float32, returned in ``dtype``."""

    eps: float = 1e-5
    dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones_init(), (x.shape[-1],), jnp.float32)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * scale).astype(self.dtype)


CUDNN_ERRORS = (NotImplementedError, RuntimeError, ValueError, TypeError)
"""What ``jax.nn.dot_product_attention(implementation="cudnn")`` raises at trace time where
cuDNN cannot run a call (no cuDNN, an old version or GPU, a head size or dtype it does not
take): ``"auto"`` then falls back to the XLA attention."""


def on_nvidia_gpu() -> bool:
    """Whether JAX's default backend is an NVIDIA GPU (``"gpu"``/``"cuda"`` platform): where
    ``attention="auto"`` tries cuDNN."""
    try:
        return jax.default_backend() in ("gpu", "cuda")
    except RuntimeError:  # pragma: no cover (no backend at all)
        return False


def resolve_attention(impl: str) -> str:
    """The attention ``impl`` runs as, judged by the default backend only: ``"auto"`` is
    ``"cudnn"`` on an NVIDIA GPU and ``"xla"`` elsewhere (a call cuDNN then refuses still
    falls back to ``"xla"`` in ``causal_attention``); others as given. For records."""
    if impl not in ATTENTION:
        raise ValueError(f"attention must be one of {ATTENTION}, got {impl!r}")
    if impl == "auto":
        return "cudnn" if on_nvidia_gpu() else "xla"
    return impl


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, impl: str = "xla"
                     ) -> jax.Array:
    """Causal grouped-query attention. ``q (B, T, H, hd)``, ``k, v (B, T, KV, hd)`` in the
    compute dtype (query head ``h`` reads key/value head ``h // (H / KV)``) -> ``(B, T, H,
    hd)`` in that dtype; scale ``hd**-0.5``.

    ``impl="xla"``: scores and softmax in float32 (einsums accumulating in float32), the
    probabilities rounded to the compute dtype for the value product. ``"cudnn"``:
    ``jax.nn.dot_product_attention(..., is_causal=True, implementation="cudnn")`` (cuDNN's
    fused kernel on NVIDIA GPUs; raises elsewhere). ``"auto"``: ``"cudnn"`` on an NVIDIA
    GPU when cuDNN takes the call (``CUDNN_ERRORS`` at trace time: it does not), else
    ``"xla"``; the CPU always gets ``"xla"``'s bits.

    Under a plain ``jax.jit`` over several devices (the harness's evaluation step with
    ``--fsdp``) cuDNN's partitioner needs q, k and v sharded alike: call it inside
    ``jax.shard_map`` over the batch (as the harness's steps do), where each device attends
    over its own sequences."""
    B, T, H, hd = q.shape
    KV = k.shape[2]
    if impl == "auto":
        if on_nvidia_gpu():
            try:
                return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                    implementation="cudnn")
            except CUDNN_ERRORS:
                pass
        impl = "xla"
    if impl != "xla":
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
    q = q.reshape(B, T, KV, H // KV, hd)
    s = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    s = s * (hd**-0.5)
    mask = jnp.tril(jnp.ones((T, T), dtype=bool))
    s = jnp.where(mask, s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
    a = jnp.einsum("bkgts,bskd->btkgd", p, v, preferred_element_type=jnp.float32)
    return a.reshape(B, T, H, hd).astype(q.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding (rotate-half form). ``x (B, T, H, hd)``, ``positions (T,)`` int."""
    hd = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    ang = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # (T, hd/2)
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., : hd // 2], x32[..., hd // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def smooth_swiglu_scale(h: jax.Array, axis_name: Any = None) -> jax.Array:
    """Per-channel scale of Smooth-SwiGLU (Fishman et al., "Scaling FP8 training to
    trillion-token LLMs", ICLR 2025, arXiv 2409.12517, sec. 4.3: ``Smooth-SwiGLU(x) =
    s_i^-1 Q(s_i (w1_i^T Q(x)) Swish(w2_i^T Q(x)))`` per channel ``i`` of the SwiGLU
    product, the ``s_i^-1`` merged into the down projection's weight; FP4-all-the-way uses
    it in its 7B model).

    ``s_i = 2**-ceil(log2(amax_i))``, ``amax_i = max |h[..., i]|`` over every leading axis
    (the batch's tokens; and over the devices of ``axis_name``, the data-parallel mesh axes,
    so the scale, and the quantized bits, are those of one device), 1 where ``amax_i`` is 0
    or not finite; no gradient flows through it. The scaled product ``h * s`` has every
    channel's amax in (1/2, 1], so a block of 16 channels no longer takes its scale from
    one outlier channel. The down projection computes ``(h * s) @ (w / s[:, None])``:
    ``s`` is a power of two, so both products are exact and, unquantized, this is the plain
    SwiGLU bit for bit.

    Verified and not: the formula above and "per-channel max" come from the paper (its text
    as quoted by Graphcore Research's summary, graphcore-research.github.io
    ``2024-09-27-fp8_smooth_swiglu.md``); the paper's reference implementation is inside
    Intel Gaudi's closed ``intel_transformer_engine`` (``use_fp8_smooth_swiglu`` of the
    down projection's ``IntelTERowParallelLinearFP8SmoothSwiglu``, HabanaAI Megatron-LM
    ``megatron/core/extensions/intel_transformer_engine.py``), so its exact scale (the
    amax's reciprocal or a power of two, over which tokens, delayed or current) is not
    verified; rounding it to a power of two is fp4jax's choice (it keeps the identity exact).

    Args:
      h: the SwiGLU product ``silu(gate) * up``, ``(..., d_ff)``, any float dtype.
      axis_name: mesh axis name(s) to take the channel amax over as well (None: none).
    Returns:
      float32 ``(d_ff,)``, powers of two.
    """
    a = jnp.abs(h.astype(jnp.float32)).reshape(-1, h.shape[-1])
    amax = jnp.max(jnp.where(jnp.isfinite(a), a, 0.0), axis=0)
    if axis_name is not None:
        amax = jax.lax.pmax(amax, axis_name)
    ok = (amax > 0) & jnp.isfinite(amax)
    e = jnp.ceil(jnp.log2(jnp.where(ok, amax, 1.0)))
    s = jnp.where(ok, jnp.exp2(-jnp.clip(e, -126, 126)), 1.0)
    return jax.lax.stop_gradient(s.astype(jnp.float32))


def _dense(cfg: LlamaConfig, features: int, name: str, std: float) -> nn.Module:
    return nn.Dense(features, use_bias=False, dtype=cfg.dtype,
                    kernel_init=nn.initializers.normal(std), name=name)


class ChannelScaledDense(nn.Module):
    """``nn.Dense`` (no bias) whose product is ``(x * s) @ (kernel / s[:, None])`` for a
    per-input-channel scale ``s`` (float32 ``(K,)``): Smooth-SwiGLU's down projection
    (``smooth_swiglu_scale``; powers of two, so unquantized it is ``x @ kernel`` bit for
    bit, and a quantizing rule sees the scaled operands). Parameters as ``nn.Dense``'s
    (``{"kernel": (K, features)}``)."""

    features: int
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = nn.initializers.lecun_normal()

    @nn.compact
    def __call__(self, x: jax.Array, channel_scale: jax.Array) -> jax.Array:
        """``x (..., K)``, ``channel_scale (K,)`` -> ``(..., features)`` in the compute
        dtype."""
        k = jnp.shape(x)[-1]
        kernel = self.param("kernel", self.kernel_init, (k, self.features), self.param_dtype)
        s = jnp.asarray(channel_scale, jnp.float32)
        if s.shape != (k,):
            raise ValueError(f"ChannelScaledDense: channel_scale must have shape ({k},) (one "
                             f"per input channel), got {s.shape}")
        x = x * s.astype(x.dtype)
        kernel = kernel / s[:, None].astype(kernel.dtype)
        x, kernel = nn.dtypes.promote_dtype(x, kernel, dtype=self.dtype)
        return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))


class Block(nn.Module):
    """One pre-norm transformer block (plain Flax layers ``q, k, v, o, gate, up, down``).

    ``attn_recipe``: None (the default) runs ``causal_attention(..., cfg.attention)``; an
    ``fp4jax.recipes.AttentionRecipe`` runs ``fp4jax.attention`` under it instead (FP4
    ``q k^T`` and ``P v``, XLA: cuDNN's fused attention takes no FP4 operands), drawing its
    stochastic-rounding key from the ``"fp4"`` stream when the recipe needs one."""

    cfg: LlamaConfig
    attn_recipe: AttentionRecipe | None = None

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """``x (B, T, D)`` in the compute dtype -> same shape and dtype."""
        cfg = self.cfg
        B, T, _ = x.shape
        hd, H, KV = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        std, out_std = cfg.init_std, cfg.init_std / (2 * cfg.n_layers) ** 0.5

        h = RMSNorm(cfg.norm_eps, cfg.dtype, name="attn_norm")(x)
        q = _dense(cfg, H * hd, "q", std)(h).reshape(B, T, H, hd)
        k = _dense(cfg, KV * hd, "k", std)(h).reshape(B, T, KV, hd)
        v = _dense(cfg, KV * hd, "v", std)(h).reshape(B, T, KV, hd)
        q, k = rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta)
        if self.attn_recipe is None:
            # Grouped-query attention in high precision (causal_attention).
            a = causal_attention(q, k, v, cfg.attention)
        else:  # FP4 attention, opted into per block (Llama.attn_recipes)
            key = self.make_rng("fp4") if self.attn_recipe.needs_key else None
            a = quantized_attention(q, k, v, self.attn_recipe, causal=True, key=key)
        a = a.reshape(B, T, H * hd)
        x = x + _dense(cfg, cfg.d_model, "o", out_std)(a)

        h = RMSNorm(cfg.norm_eps, cfg.dtype, name="mlp_norm")(x)
        if cfg.n_experts:  # mixture of experts (fp4jax.models.moe): router, gate, up, down
            return x + moe_ffn(h, n_experts=cfg.n_experts, top_k=cfg.top_k, d_ff=cfg.d_ff,
                               gated=cfg.gated, dtype=cfg.dtype, init_std=std,
                               out_std=out_std, aux_weight=cfg.moe_aux_weight)
        up = _dense(cfg, cfg.d_ff, "up", std)(h)
        if cfg.gated:
            gate = _dense(cfg, cfg.d_ff, "gate", std)(h)
            f = nn.silu(gate) * up
        else:
            f = jnp.square(nn.relu(up))
        if cfg.ffn == "smooth_swiglu":
            # per-channel scale in, its inverse in the weight
            down = ChannelScaledDense(cfg.d_model, dtype=cfg.dtype,
                                      kernel_init=nn.initializers.normal(out_std), name="down")
            return x + down(f, channel_scale=smooth_swiglu_scale(f, sharding.data_axis()))
        return x + _dense(cfg, cfg.d_model, "down", out_std)(f)


class _ScanBlock(nn.Module):
    """``Block`` as a ``flax.linen.scan`` body: ``(x, positions) -> (x, None)``."""

    cfg: LlamaConfig
    attn_recipe: AttentionRecipe | None = None

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, None]:
        return Block(self.cfg, self.attn_recipe, name="block")(x, positions), None


def layer_name(path: tuple[str, ...], index: tuple[int, ...] = ()) -> str:
    """The name of a linear layer of :class:`Llama` for per-layer statistics
    (``fp4jax.diagnostics.layer_stats``'s ``name_fn``): its parameter path joined by ``/``
    (``"block_3/q"``, ``"block_0/down"``), with the layers of a scanned run of blocks
    (``blocks_{first}_{last}/block/q`` at scan index ``i``) named as in the unrolled model
    (``block_{first + i}/q``), so scanned and unrolled runs name their layers alike."""
    m = re.fullmatch(r"blocks_(\d+)_(\d+)", path[0]) if path else None
    if m and len(index) == 1 and path[1:2] == ("block",):
        return "/".join((f"block_{int(m[1]) + index[0]}", *path[2:]))
    return "/".join(path) + "".join(f"[{i}]" for i in index)


_BLOCK_LAYERS = ("q", "k", "v", "o", "gate", "up", "down")  # module names, in call order


def layer_order(name: str) -> tuple[int, int, str]:
    """Sort key of ``layer_name`` names: by block, then in the block's call order (``q, k,
    v, o, gate, up, down``); other names last, alphabetically."""
    m = re.fullmatch(r"block_(\d+)/(\w+)", name)
    if m and m[2] in _BLOCK_LAYERS:
        return int(m[1]), _BLOCK_LAYERS.index(m[2]), ""
    return 2**31, 0, name


def block_layer_names(cfg: LlamaConfig) -> list[str]:
    """Every linear layer of the blocks of a model of ``cfg``, named as ``layer_name``
    names them (``"block_0/q"``, ..., ``"block_{n-1}/down"``), in ``layer_order``."""
    mods = [n.split(".")[1] for n in cfg.linear_layers]
    return sorted((f"block_{b}/{m}" for b in range(cfg.n_layers) for m in mods),
                  key=layer_order)


def policy_layer_name(name: str, cfg: LlamaConfig) -> str:
    """The ``PrecisionPolicy.high_precision_layers`` pattern of the layer ``layer_name``
    calls ``name``: ``"block_3/q"`` -> ``"block_3/attn.q"``, ``"block_0/down"`` ->
    ``"block_0/mlp.down"``.

    Raises:
      ValueError: ``name`` is not a linear layer of a block of ``cfg`` (listing the form).
    """
    m = re.fullmatch(r"block_(\d+)/(\w+)", name)
    full = {n.split(".")[1]: n for n in cfg.linear_layers}
    if not m or int(m[1]) >= cfg.n_layers or m[2] not in full:
        raise ValueError(
            f"{name!r} is not a linear layer of this model's blocks: give block_I/NAME with I "
            f"in 0..{cfg.n_layers - 1} and NAME one of {list(full)} (e.g. block_0/q)")
    return f"block_{int(m[1])}/{full[m[2]]}"


class Llama(nn.Module):
    """The decoder, plain Flax layers. ``__call__(tokens (B, T) int32) -> logits (B, T,
    vocab) float32``.

    Attributes:
      cfg: :class:`LlamaConfig`.
      runs: with ``cfg.scan_layers``, the lengths of the runs of consecutive blocks that
        run as one ``flax.linen.scan`` each (summing to ``cfg.n_layers``): a run of one
        block is ``block_{i}``, a longer run ``blocks_{first}_{last}`` with the block's
        parameters stacked along a leading axis (under ``blocks_{first}_{last}/block``).
        None: one run of every block. Ignored without ``scan_layers`` (every block
        ``block_{i}``). :func:`quantized_llama` sets them to the runs of blocks that share
        their recipes (``scan_runs``), so a scanned stack never mixes precisions.
      attn_recipes: None (the default: every block's attention in high precision,
        ``causal_attention``), or one ``fp4jax.recipes.AttentionRecipe`` (or its name) or
        None per block: FP4 attention in those blocks (``Block.attn_recipe``). The blocks of
        a scanned run must agree. :func:`quantized_llama` sets it from attention rules on
        ``block_{i}/attn`` (``attention_recipes``).
      scan_collections: the linen variable collections a scanned run carries per block
        (axis 0) besides ``params`` and the MoE auxiliary loss: those of the product taps
        its layers run (``fp4jax.nn.taps.tap_collections``). None: the default taps'
        (the statistics and OutControl collections; absent in training, they change
        nothing there).

    The model has no quantization of its own: put it under precision rules with
    :func:`quantized_llama` (a ``PrecisionPolicy`` or rules by block-level path) or
    ``fp4jax.nn.quantize_model``. Stochastic rounding then draws keys from the RNG stream
    ``"fp4"``: ``model.apply(variables, tokens, rngs={"fp4": jax.random.fold_in(key,
    step)})``.
    """

    cfg: LlamaConfig
    runs: tuple[int, ...] | None = None
    attn_recipes: tuple[AttentionRecipe | None, ...] | None = None
    scan_collections: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.attn_recipes is not None:
            a = self.attn_recipes
            if not isinstance(a, (tuple, list)) or len(a) != self.cfg.n_layers:
                raise ValueError(f"Llama: attn_recipes must be None or one attention recipe "
                                 f"(or None) per block ({self.cfg.n_layers}), got {a!r}")
            object.__setattr__(self, "attn_recipes", tuple(
                None if r is None else get_attention(r) for r in a))
        if self.runs is not None and not (
                isinstance(self.runs, tuple)
                and all(isinstance(r, int) and not isinstance(r, bool) for r in self.runs)):
            hint = (" (Llama is plain Flax now: quantize it with "
                    "fp4jax.models.quantized_llama(cfg, policy))"
                    if isinstance(self.runs, PrecisionPolicy) else "")
            raise TypeError(f"Llama: runs must be None or a tuple of block counts, got "
                            f"{type(self.runs).__name__} {self.runs!r}{hint}")
        super().__post_init__()

    def block_runs(self) -> list[tuple[int, int]]:
        """The ``[first, last]`` blocks of each run (``runs``; every block alone without
        ``cfg.scan_layers``).

        Raises:
          ValueError: ``runs`` that are not positive integers summing to ``n_layers``.
        """
        n = self.cfg.n_layers
        if not self.cfg.scan_layers:
            return [(i, i) for i in range(n)]
        runs = (n,) if self.runs is None else tuple(self.runs)
        if (any(isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in runs)
                or sum(runs) != n):
            raise ValueError(f"Llama: runs must be positive block counts summing to n_layers="
                             f"{n}, got {self.runs!r}")
        out, i = [], 0
        for r in runs:
            out.append((i, i + r - 1))
            i += r
        return out

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.cfg
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be (batch, seq) integers, got shape {tokens.shape}")
        T = tokens.shape[1]
        if T > cfg.max_seq_len:
            raise ValueError(f"sequence length {T} > max_seq_len {cfg.max_seq_len}")
        init = nn.initializers.normal(cfg.init_std)
        x = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=init, name="embed")(tokens)
        x = x.astype(cfg.dtype)
        positions = jnp.arange(T)
        attn = self.attn_recipes or (None,) * cfg.n_layers
        for i, last in self.block_runs():
            if any(attn[b] != attn[i] for b in range(i, last + 1)):
                raise ValueError(
                    f"Llama: the scanned blocks {i}..{last} get different attention recipes "
                    f"{[getattr(r, 'name', None) for r in attn[i:last + 1]]}: one scanned "
                    "body runs one; pass runs=scan_runs(cfg, rules) or turn scan_layers off")
            if last > i:
                # the product taps' collections (fp4jax.nn.taps) get a leading block
                # axis too; absent in training, they change nothing there
                taps_cols = (tap_collections(DEFAULT_TAPS) if self.scan_collections is None
                             else self.scan_collections)
                body = _ScanBlock
                if cfg.scan_remat != "none":
                    body = nn.remat(body, prevent_cse=False, policy={
                        "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                        "full": jax.checkpoint_policies.nothing_saveable}[cfg.scan_remat])
                scanned = nn.scan(body, variable_axes={
                                      "params": 0, **dict.fromkeys(taps_cols, 0),
                                      AUX_COLLECTION: 0},
                                  split_rngs={"params": True, "fp4": True, "fp4_layer": True},
                                  in_axes=nn.broadcast, length=last - i + 1)
                x, _ = scanned(cfg, attn[i], name=f"blocks_{i}_{last}")(x, positions)
            else:
                x = Block(cfg, attn[i], name=f"block_{i}")(x, positions)
        x = RMSNorm(cfg.norm_eps, cfg.dtype, name="final_norm")(x)
        logits = nn.Dense(
            cfg.vocab_size, use_bias=False, dtype=cfg.dtype, kernel_init=init, name="lm_head"
        )(x)
        return logits.astype(jnp.float32)


# ---------------------------------------------------------------------------
# precision rules of the Llama
# ---------------------------------------------------------------------------

HIGH_PRECISION_RULE = Rule(r"embed|lm_head", None)
"""The embeddings and the LM head stay in high precision (NVFP4 paper, section 4): the first
rule of ``policy_rules``."""


ROUTER_RULE = Rule(r"(.*/)?router", None)
"""A mixture-of-experts model's routers stay in high precision (``fp4jax.models.moe``): the
second rule of ``policy_rules`` when ``n_experts``."""


def layer_paths(cfg: LlamaConfig) -> dict[str, str]:
    """``{policy layer name: module path inside a block}`` of ``cfg``'s linear layers:
    ``{"attn.q": "q", ..., "mlp.down": "down"}`` (``PrecisionPolicy.rules``'s ``layers``)."""
    return {n: n.split(".")[1] for n in cfg.linear_layers}


def policy_rules(cfg: LlamaConfig, policy: PrecisionPolicy) -> tuple[Rule, ...]:
    """``policy`` as precision rules of a :class:`Llama` of ``cfg``, by block-level path
    (``block_{i}/{layer}``): ``HIGH_PRECISION_RULE`` (embeddings, LM head), then
    ``policy.rules(cfg.n_layers, "block_{i}", layer_paths(cfg))``. Every block layer gets
    ``policy.recipe_for(i, n_layers, name)``."""
    hp = [HIGH_PRECISION_RULE, ROUTER_RULE] if cfg.n_experts else [HIGH_PRECISION_RULE]
    return (*hp, *policy.rules(cfg.n_layers, "block_{i}", layer_paths(cfg)))


def block_recipes(cfg: LlamaConfig, rules: Any) -> list[tuple[Any, ...]]:
    """Per block, the recipes (``Recipe`` or None) that ``rules`` give its linear layers at
    ``block_{i}/{layer}``, in ``cfg.linear_layers`` order (first match; None unmatched)."""
    rules = as_rules(rules)
    out = []
    for i in range(cfg.n_layers):
        row = []
        for name in layer_paths(cfg).values():
            j = match_rule(rules, f"block_{i}/{name}")
            row.append(None if j is None else rules[j].recipe)
        out.append(tuple(row))
    return out


ATTENTION_SITE = "attn"
"""The block-level path of a block's attention, ``block_{i}/attn``: attention rules
(``fp4jax.nn.Rule`` with an ``AttentionRecipe``) matching it turn FP4 attention on there."""


def attention_recipes(cfg: LlamaConfig, rules: Any) -> tuple[AttentionRecipe | None, ...]:
    """Per block, the attention recipe the attention rules of ``rules`` give its attention
    at ``block_{i}/attn`` (first matching attention rule; None: high precision). Linear
    rules never match there (``fp4jax.nn.match_rule``), so ``Rule(".*", "nvfp4")`` leaves
    the attention as it is; ``Rule(r"block_[1-2]/attn", "attn_nvfp4")`` turns it on in
    blocks 1 and 2."""
    rules = as_rules(rules)
    out = []
    for i in range(cfg.n_layers):
        j = match_rule(rules, f"block_{i}/{ATTENTION_SITE}", attention=True)
        out.append(None if j is None else rules[j].recipe)
    return tuple(out)


def scan_runs(cfg: LlamaConfig, rules: Any) -> tuple[int, ...]:
    """The lengths of the maximal runs of consecutive blocks to which ``rules`` give the
    same recipes (``block_recipes``, and ``attention_recipes``): :class:`Llama`'s ``runs``,
    so that a scanned stack (one traced body) holds blocks of one precision."""
    recipes = list(zip(block_recipes(cfg, rules), attention_recipes(cfg, rules),
                       strict=True))
    runs: list[int] = []
    for i in range(cfg.n_layers):
        if i and recipes[i] == recipes[i - 1]:
            runs[-1] += 1
        else:
            runs.append(1)
    return tuple(runs)


def llama_rules(cfg: LlamaConfig, rules: Any, runs: tuple[int, ...] | None = None
                ) -> list[Rule]:
    """``rules`` (by block-level path ``block_{i}/{layer}``) for a :class:`Llama` of ``cfg``
    with ``runs``: with ``cfg.scan_layers``, each scanned stack ``blocks_{i}_{j}/block/``
    gets one exact rule per linear layer, placed first, with the recipe ``rules`` give
    ``block_{i}/{layer}`` (a scanned body is traced once: its blocks share a recipe); then
    ``rules`` themselves.

    Raises:
      ValueError: the blocks of a scanned run get different recipes from ``rules`` (naming
        the run, the layer and the fix: ``runs=scan_runs(cfg, rules)`` or no
        ``scan_layers``).
    """
    rules = list(as_rules(rules))
    model = Llama(cfg, runs)
    recipes = block_recipes(cfg, rules)
    names = list(layer_paths(cfg).values())
    out = []
    for i, last in model.block_runs():
        if last == i:
            continue
        for b in range(i + 1, last + 1):
            if recipes[b] != recipes[i]:
                k = next(n for n, x, y in zip(names, recipes[b], recipes[i], strict=True)
                         if x != y)
                raise ValueError(
                    f"llama_rules: the scanned blocks {i}..{last} (blocks_{i}_{last}) get "
                    f"different recipes for {k!r} from the rules (block_{b}/{k} vs "
                    f"block_{i}/{k}): one scanned body runs one recipe; pass "
                    "runs=scan_runs(cfg, rules) (scanned runs of equal recipes) or turn "
                    "scan_layers off")
        out += [Rule(re.escape(f"blocks_{i}_{last}/block/{n}"), r)
                for n, r in zip(names, recipes[i], strict=True)]
    return out + rules


def every_block_attention(recipe: Any) -> list[Rule]:
    """Attention rules for ``recipe`` (an ``AttentionRecipe``, its name or a linear recipe
    for both products) in every block: ``[Rule(r"block_[0-9]+/attn", recipe)]``; None: no
    rule (``[]``)."""
    if recipe is None:
        return []
    return [Rule(r"block_[0-9]+/" + ATTENTION_SITE, get_attention(recipe))]


def quantized_llama(cfg: LlamaConfig, precision: PrecisionPolicy | Any,
                    runs: tuple[int, ...] | None = None, attention: Any = None, *,
                    taps: tuple[Any, ...] | None = None) -> nn.Module:
    """A :class:`Llama` of ``cfg`` under precision rules: ``fp4jax.nn.quantize_model(
    Llama(cfg, runs), llama_rules(cfg, rules, runs))``.

    Args:
      cfg: the model's config.
      precision: a :class:`~fp4jax.nn.PrecisionPolicy` (its rules: ``policy_rules``, the
        embeddings and LM head high precision), or precision rules (``fp4jax.nn.Rule`` or
        ``(pattern, recipe)`` pairs) matched against block-level paths ``block_{i}/q``,
        ..., ``block_{i}/down`` and ``lm_head``, which reach a scanned stack's blocks too.
        Attention rules (an ``AttentionRecipe`` or its name, e.g. ``Rule(r"block_[0-9]+/attn",
        "attn_nvfp4")``) match ``block_{i}/attn`` and turn FP4 attention on there
        (``attention_recipes``; ``Llama.attn_recipes``); without one every block's
        attention is the unquantized ``causal_attention``, bit for bit.
      runs: the scanned runs (``Llama.runs``); None: ``scan_runs(cfg, rules)``, the runs
        of blocks with equal recipes. Models that share parameters (a run before and
        after its precision switch) must share ``runs``.
      attention: FP4 attention added to ``precision`` (with a policy too): None (none
        added), an attention recipe (or its name, or a linear recipe) for every block
        (``every_block_attention``), or attention rules (placed after ``precision``'s).
      taps: the product taps of every quantized layer (``fp4jax.nn.taps``; None: the
        default, ``DEFAULT_TAPS``); a scanned run carries their collections.

    Returns:
      the quantized linen model (``init``/``apply`` as the Llama's; parameter tree the
      Llama's).
    """
    rules = (policy_rules(cfg, precision) if isinstance(precision, PrecisionPolicy)
             else list(as_rules(precision, "quantized_llama: precision")))
    if attention is not None:
        extra = (list(as_rules(attention, "quantized_llama: attention"))
                 if isinstance(attention, (list, tuple, Rule))
                 else every_block_attention(attention))
        if not all(r.attention for r in extra):
            raise ValueError("quantized_llama: attention takes attention rules (their recipe "
                             "an AttentionRecipe or its name, e.g. 'attn_nvfp4') or one "
                             "attention recipe; linear rules go in precision")
        rules = [*rules, *extra]
    if runs is None:
        runs = scan_runs(cfg, rules)
    attn = attention_recipes(cfg, rules)
    model = Llama(cfg, runs, attn if any(a is not None for a in attn) else None,
                  scan_collections=None if taps is None else tap_collections(taps))
    return quantize_model(model, llama_rules(cfg, rules, runs),
                          taps=DEFAULT_TAPS if taps is None else taps)
