"""The backend interface of ``fp4jax.dot``: one operand type, the backends that make
operands and run GEMMs, the XLA reference backend, and the registry plug-ins join.

A call of ``fp4jax.dot`` runs three GEMMs (fprop, dgrad, wgrad), each on two operands made
from ``x``, ``w`` or the cotangent ``dy`` (``fp4jax.quantized_dot``). Who makes an operand
and who runs a GEMM is a *backend*; a call runs on an ordered tuple of backends ending with
the reference (``select``), tokamax style: each operand and each GEMM goes to the first
backend that takes it (``operand_reason`` / ``gemm_reason`` None), so a kernel backend
covers what its kernels implement and the reference the rest. Every backend computes the
reference's bits (GEMMs up to float32 accumulation order off XLA's einsum).

* ``Operand``: what every backend returns and every GEMM takes: the values ``data * scale``
  (no tensor scale), either materialized in the GEMM's dtype (``values``, what fused
  kernels write) or as the FP4 codes they decode from (``codes``, a ``QuantizedArray``),
  and the tensor decode scale (a float32 scalar, per-row decode scales for a row-scaled
  operand, None when unquantized). Transformer Engine's ``ScaledTensor``
  (``transformer_engine/jax/quantize/tensor.py``) and qwix's ``QArray`` are the models.
* ``OperandRequest``: one operand to make (its GEMM, side, spec, blocked axis, RHT size and
  signs, stochastic-rounding key, GEMM dtype); ``RowShard``: where a tensor's rows sit in a
  data-parallel tensor: the core's cross-device amax reduction and draw offset, which a
  backend calls and never computes itself.
* ``Backend``: ``operand_reason``/``make_operands`` and ``gemm_reason``/``gemm``;
  ``XLA`` is the reference backend, defined here.
* ``Provider``: a family of backends chosen by ``fp4jax.dot(implementation=...)``.
  Plug-ins (``pallas_kernels``) are found through the ``fp4jax.backends`` entry-point group
  (``pyproject.toml``; read from the checkout's ``pyproject.toml`` when fp4jax runs
  uninstalled), as JAX finds its PJRT plugins, or joined with ``register_provider``.
  ``FP4JAX_KERNELS`` sets only the default choice (``kernels_setting``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
import pathlib
import tomllib
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import jax
import jax.numpy as jnp

from fp4jax import numerics
from fp4jax import quantization as qz
from fp4jax.hadamard import random_hadamard_transform

__all__ = ["GROUP", "SUBSCRIPTS", "WHOLE", "XLA", "Backend", "DotCall", "NotSupported",
           "Operand", "OperandRequest", "Provider", "RowShard", "XlaBackend",
           "einsum_scaled", "gemm_dtype", "kernels_setting", "providers", "reference_quantize",
           "register_provider", "rotate", "run_gemm", "run_operands", "select"]

GROUP = "fp4jax.backends"
"""The entry-point group of backend providers (``pyproject.toml``'s
``[project.entry-points."fp4jax.backends"]``; each value a ``Provider`` object)."""


class NotSupported(Exception):  # noqa: N818 (tokamax's name for it)
    """A backend or provider does not take this call, operand or GEMM; the message says
    why. The next backend in the order takes it (the reference takes everything)."""


def _scoped(name: str):
    """Runs the function under ``jax.named_scope(name)``: HLO metadata only (the op names
    a profile attributes kernel time by), the same program."""
    def deco(f):
        @functools.wraps(f)
        def wrapped(*args, **kwargs):
            with jax.named_scope(name):
                return f(*args, **kwargs)
        return wrapped
    return deco


# ---------------------------------------------------------------------------
# The operand type.
# ---------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Operand:
    """One GEMM operand, whichever backend made it (a pytree).

    Attributes:
      values: the operand's values ``data * scale`` without the tensor scale, materialized
        (fused kernels write them in their GEMM's dtype), or the tensor itself when the
        operand is unquantized; None when held as ``codes``.
      codes: the ``QuantizedArray`` the values decode from (``scaled_data``), or None.
      decode_scale: the float32 tensor decode scale (``global_scale``; 1.0 for formats
        without one): a scalar, or one per row for a row-scaled operand (its shape with the
        contracted axis of length 1); None when unquantized.

    Exactly one of ``values`` and ``codes`` is set. The represented product operand is
    ``scaled(float32) * decode_scale``.
    """

    values: jax.Array | None = None
    codes: qz.QuantizedArray | None = None
    decode_scale: jax.Array | None = None

    @classmethod
    def from_tensor(cls, x: jax.Array) -> Operand:
        """An unquantized operand: the tensor itself (a high-precision GEMM)."""
        return cls(values=x)

    @classmethod
    def from_codes(cls, q: qz.QuantizedArray) -> Operand:
        """A quantized operand held as its codes and block scales."""
        return cls(codes=q, decode_scale=q.global_scale)

    @classmethod
    def from_scaled(cls, values: jax.Array, decode_scale: jax.Array) -> Operand:
        """A quantized operand as materialized values ``data * scale`` and its decode
        scale."""
        return cls(values=values, decode_scale=decode_scale)

    @property
    def quantized(self) -> bool:
        return self.decode_scale is not None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape if self.values is None else self.values.shape)

    def exact_in_bf16(self) -> bool:
        """Whether the values are exact in bfloat16: at most 8 significant bits
        (``BlockFormat.scaled_bits`` of the codes; a materialized array when it is
        bfloat16)."""
        if self.codes is not None:
            return self.codes.fmt.scaled_bits <= 8
        return self.values.dtype == jnp.bfloat16

    def scaled(self, dtype: Any) -> jax.Array:
        """The values in ``dtype`` (decoded from the codes by ``scaled_data``, or the
        materialized array cast: exact where ``exact_in_bf16`` or ``dtype`` is float32)."""
        if self.codes is not None:
            with jax.named_scope("fp4_decode"):
                return qz.scaled_data(self.codes, dtype)
        return self.values.astype(dtype)


def gemm_dtype(a: Operand, b: Operand) -> Any:
    """The dtype a GEMM of ``a`` and ``b`` computes in: bfloat16 when both are exact in it
    (``Operand.exact_in_bf16``), else float32; accumulation is float32 either way, so the
    products of two operands (at most ``2 * 12 = 24`` bits) are exact and only the float32
    accumulation rounds (NVFP4 paper, Eq. 5)."""
    return jnp.bfloat16 if a.exact_in_bf16() and b.exact_in_bf16() else jnp.float32


# ---------------------------------------------------------------------------
# What a backend is asked to make.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class OperandRequest:
    """One GEMM operand to make from a canonical tensor ``t`` (x ``(B, M, K)``, w
    ``(B, K, N)`` or dy ``(B, M, N)``).

    Attributes:
      gemm: ``"fprop"``, ``"dgrad"`` or ``"wgrad"``; which: ``"lhs"`` or ``"rhs"``.
      spec: the operand's ``fp4jax.recipes.QuantSpec``.
      axis: the blocked axis of ``t`` (1 or 2; the RHT runs along it too).
      hadamard: the GEMM's RHT size (0: none).
      signs: the RHT's float32 +-1 sign vector (length ``hadamard``), None without RHT.
      key: the operand's key for stochastic rounding and MS-EDEN (``fp4jax.quantized_dot.
        operand_key``); drawn from only when ``spec.random``.
      dtype: the dtype the operand's GEMM computes in (``gemm_dtype`` of the two
        operands, known from the recipe before any is made): a backend that materializes
        values writes them in it.
    """

    gemm: str
    which: str
    spec: Any
    axis: int
    hadamard: int
    signs: jax.Array | None
    key: jax.Array
    dtype: Any


@dataclasses.dataclass(frozen=True)
class RowShard:
    """Where a tensor's rows sit: the whole tensor (``axes`` None) or one device's block of
    token rows inside ``jax.shard_map`` over the mesh axes ``axes``
    (``fp4jax.sharding.data_parallel``). The core owns both data-parallel rules; a backend
    calls them on what it computed.

    ``local_amax`` (``Recipe.amax_scope="local"``): each device keeps its rows' own tensor
    amaxes."""

    axes: Any = None
    local_amax: bool = False

    def reduce_amax(self, amaxes: jax.Array) -> jax.Array:
        """The tensor amaxes from this block's (any shape, float32): the ``pmax`` over
        ``axes`` (one all-reduce for all of them), or as they are for a whole tensor or a
        local amax scope."""
        if self.axes is None or self.local_amax:
            return amaxes
        return jax.lax.pmax(amaxes, self.axes)

    def draw_offset(self, shape: tuple[int, ...]) -> jax.Array | None:
        """The first stochastic-rounding draw of this block's rows in the whole tensor
        (``numerics.row_shard_draw_offset`` of its local ``shape``, laid out as
        ``uniform_from_key`` draws it); None for a whole tensor."""
        if self.axes is None:
            return None
        return numerics.row_shard_draw_offset(shape, jax.lax.axis_index(self.axes),
                                              jax.lax.axis_size(self.axes))


WHOLE = RowShard()


@dataclasses.dataclass(frozen=True)
class DotCall:
    """What a provider sees of one ``fp4jax.dot`` call when it chooses a backend.

    Attributes:
      recipe: the ``fp4jax.recipes.Recipe``.
      batch, m, k, n: the canonical ``(B, M, K) @ (B, K, N)`` sizes.
      partitioned: the call is traced for several devices that XLA partitions itself (a
        multi-device ``jit``, not ``jax.shard_map``/``fp4jax.sharding.one_device``): a
        Pallas call there is not partitioned.
    """

    recipe: Any
    batch: int
    m: int
    k: int
    n: int
    partitioned: bool = False


# ---------------------------------------------------------------------------
# Backends.
# ---------------------------------------------------------------------------


class Backend:
    """How operands are made and GEMMs run (a frozen dataclass in every implementation:
    hashable, part of ``fp4jax.dot``'s trace cache key).

    ``operand_reason(t, request)`` / ``gemm_reason(subscripts, a, b, out_dtype)``: None
    when the backend takes that operand / GEMM, else why not. ``make_operands(t, requests,
    rows)`` makes operands it takes from one tensor (together: a backend may share reads
    between them); ``gemm(subscripts, a, b, out_dtype=, precision=)`` runs one of
    ``SUBSCRIPTS``' GEMMs: ``(sum (a_values * b_values) * (dec_a * dec_b)).astype(out_dtype)``
    up to float32 accumulation order. A backend that makes no operands (or runs no GEMMs)
    keeps the defaults."""

    name: ClassVar[str] = "?"

    def operand_reason(self, t: jax.Array, request: OperandRequest) -> str | None:
        return f"the {self.name} backend makes no operands"

    def make_operands(self, t: jax.Array, requests: Sequence[OperandRequest],
                      rows: RowShard = WHOLE) -> list[Operand]:
        raise NotSupported(f"the {self.name} backend makes no operands")

    def gemm_reason(self, subscripts: str, a: Operand, b: Operand, out_dtype: Any
                    ) -> str | None:
        return f"the {self.name} backend runs no GEMMs"

    def gemm(self, subscripts: str, a: Operand, b: Operand, *, out_dtype: Any,
             precision: Any = None) -> jax.Array:
        raise NotSupported(f"the {self.name} backend runs no GEMMs")


SUBSCRIPTS = {"fprop": "bmk,bkn->bmn",  # x @ w
              "dgrad": "bmn,bkn->bmk",  # dy @ w^T (w stored (K, N))
              "wgrad": "bmk,bmn->bkn"}  # x^T @ dy (x stored (M, K))
"""Each GEMM of one ``fp4jax.dot`` call on the canonical tensors x (B, M, K), w (B, K, N)
and dy (B, M, N)."""


@_scoped("fp4_rht")
def rotate(t: jax.Array, hadamard: int, axis: int, signs: jax.Array | None) -> jax.Array:
    """``t`` zero-padded along ``axis`` to a multiple of ``hadamard`` and rotated by the
    RHT with ``signs`` (``fp4jax.random_hadamard_transform``; float32); ``t`` itself when
    ``hadamard`` is 0. Zero padding does not change a product."""
    if not hadamard:
        return t
    pad = (-t.shape[axis]) % hadamard
    if pad:
        widths = [(0, 0)] * t.ndim
        widths[axis] = (0, pad)
        t = jnp.pad(t, widths)
    return random_hadamard_transform(t, axis=axis, size=hadamard, signs=signs)


@_scoped("fp4_quantize")
def reference_quantize(r: jax.Array, request: OperandRequest, rows: RowShard = WHOLE
                       ) -> Operand:
    """The reference operand of ``request`` from ``r``, the rotated tensor (``rotate``):
    ``fp4jax.quantize``'s rules (``quantization.quantize_unchecked``) with the spec's
    format, blocks, rounding, block scale rule and row scaling, MS-EDEN grouped by the
    GEMM's RHT size; ``rows``' amax scope and draw offset. Unquantized: ``r`` itself."""
    spec = request.spec
    if not spec.quantized:
        return Operand.from_tensor(r)
    q = qz.quantize_unchecked(r, request.key if spec.random else None, spec.fmt,
                              request.axis % r.ndim, spec.block_2d, spec.rounding,
                              spec.block_scale_rule, rows.axes, row_scaled=spec.row_scaled,
                              eden_group=request.hadamard if spec.rounding == "ms_eden" else 0,
                              local_amax=rows.local_amax)
    return Operand.from_codes(q)


def einsum_scaled(subscripts: str, av: jax.Array, bv: jax.Array, sa: Any, sb: Any,
                  precision: Any) -> jax.Array:
    """``einsum(av, bv)`` accumulated in float32, times the tensor decode scales present.

    A row-scaled operand's decode scales (one per row: its shape with the contracted axis
    of length 1, ``fp4jax.quantization.global_encode_scale``) are indexed by its free and
    batch axes only, so they factor out of the sum over the contracted axis exactly: they
    are laid out along the output's axes (``_scale_to_output``) and multiplied in with the
    other operand's scale as one factor per output element, ``y * (dec_a[m] * dec_b[n])``,
    as a scalar pair is: cuBLAS-style ``alpha = dec_a * dec_b`` (NVFP4 paper Eq. 5;
    Transformer Engine's row-scaled GEMM, ``pytorch/cpp_extensions/gemm.py`` l. 341-353,
    folds the two into one factor likewise when one side is a scalar)."""
    y = jnp.einsum(subscripts, av, bv, preferred_element_type=jnp.float32, precision=precision)
    # Applying the two scales one at a time would avoid the underflow of alpha for two tiny
    # tensors (amax_a * amax_b < ~1e-31), but XLA may re-associate it differently per call
    # site, which breaks bit-reproducibility between equivalent programs.
    ins, out = subscripts.split("->")
    scales = [_scale_to_output(s, sub, out) for s, sub in zip((sa, sb), ins.split(","),
                                                              strict=True) if s is not None]
    if scales:
        y = y * functools.reduce(jnp.multiply, scales)
    return y


def _scale_to_output(s: jax.Array, sub: str, out: str) -> jax.Array:
    """An operand's decode scale(s) broadcastable against the einsum output ``out``: a
    scalar as is; per-row scales (the operand's shape, ``sub``, with its contracted axes of
    length 1) with those axes dropped and the rest moved to their output positions."""
    if jnp.ndim(s) == 0:
        return s
    letters = [c for c in sub if c in out]
    s = s.reshape([d for d, c in zip(s.shape, sub, strict=True) if c in out])
    order = [c for c in out if c in letters]
    s = jnp.transpose(s, [letters.index(c) for c in order])
    return s.reshape([s.shape[order.index(c)] if c in order else 1 for c in out])


@dataclasses.dataclass(frozen=True)
class XlaBackend(Backend):
    """The reference: every operand from ``reference_quantize`` (codes), every GEMM an
    einsum of the decoded values in ``gemm_dtype`` with float32 accumulation
    (``Precision.HIGHEST`` when an operand is quantized, else the call's ``precision``),
    then the decode scales (``einsum_scaled``). It takes everything, on every device."""

    name: ClassVar[str] = "xla"

    def operand_reason(self, t, request):
        return None

    def make_operands(self, t, requests, rows=WHOLE):
        return [reference_quantize(rotate(t, r.hadamard, r.axis, r.signs), r, rows)
                for r in requests]

    def gemm_reason(self, subscripts, a, b, out_dtype):
        return None

    def gemm(self, subscripts, a, b, *, out_dtype, precision=None):
        compute = gemm_dtype(a, b)
        if a.quantized or b.quantized:
            precision = jax.lax.Precision.HIGHEST
        return einsum_scaled(subscripts, a.scaled(compute), b.scaled(compute),
                             a.decode_scale, b.decode_scale, precision).astype(out_dtype)


XLA = XlaBackend()
"""The reference backend."""


# ---------------------------------------------------------------------------
# Providers and the choice of backends.
# ---------------------------------------------------------------------------


class Provider(Protocol):
    """A family of backends, chosen by ``fp4jax.dot(implementation=name)``.

    ``name``: the ``implementation=`` value; ``priority``: the order of the automatic
    choice (lower first); ``env_modes``: the ``FP4JAX_KERNELS`` spellings it gives a
    meaning to besides the common ones (``kernels_setting``). ``backend(call, mode,
    explicit)`` returns the backend for ``call`` under the setting ``mode`` or raises
    ``NotSupported`` saying why not; ``explicit``: asked by name (then the automatic
    size and device-count bounds do not apply)."""

    name: str
    priority: int
    env_modes: tuple[str, ...]

    def backend(self, call: DotCall, mode: str, explicit: bool) -> Backend: ...


_PROVIDERS: dict[str, Provider] = {}
_DISCOVERED = False


def register_provider(provider: Provider) -> Provider:
    """Adds ``provider`` to the backends ``fp4jax.dot`` can choose (by its ``name``;
    registering a name again replaces it). Returns it."""
    if provider.name == "xla":
        raise ValueError("provider name 'xla' is the reference backend's: choose another")
    _PROVIDERS[provider.name] = provider
    return provider


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    """The ``GROUP`` entry points of the installed distribution, or, when fp4jax runs from
    a checkout that is not installed with them (``PYTHONPATH``), those its
    ``pyproject.toml`` declares."""
    found = list(importlib.metadata.entry_points(group=GROUP))
    if found:
        return found
    project = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"
    if not project.is_file():
        return []
    meta = tomllib.loads(project.read_text()).get("project", {})
    if meta.get("name") != "fp4jax":
        return []
    table = meta.get("entry-points", {}).get(GROUP, {})
    return [importlib.metadata.EntryPoint(name, value, GROUP) for name, value in table.items()]


def providers() -> list[Provider]:
    """The registered providers in the automatic choice's order (``priority``), the entry
    points of ``GROUP`` loaded on first use."""
    global _DISCOVERED
    if not _DISCOVERED:
        _DISCOVERED = True
        for ep in _entry_points():
            register_provider(ep.load())
    return sorted(_PROVIDERS.values(), key=lambda p: (p.priority, p.name))


_ENV_OFF = ("off", "0", "xla")
_ENV_ON = ("on", "1", "pallas")


def kernels_setting() -> str:
    """``FP4JAX_KERNELS``, the default of ``implementation=None``: ``"auto"`` (unset or
    ``auto``: each provider takes the calls it is best at on this device), ``"on"``
    (``on``/``1``/``pallas``: the kernels at every size they take), ``"off"``
    (``off``/``0``/``xla``: always the reference), or a spelling a provider defines
    (``env_modes``, e.g. ``interpret``, ``native``). Read at trace time; part of
    ``fp4jax.dot``'s trace cache key."""
    env = os.environ.get("FP4JAX_KERNELS", "auto").lower() or "auto"
    if env in _ENV_OFF:
        return "off"
    if env in _ENV_ON:
        return "on"
    known = {m for p in providers() for m in p.env_modes}
    if env != "auto" and env not in known:
        raise ValueError(f"FP4JAX_KERNELS={env!r}: use auto, on or off"
                         + (f" (or {', '.join(sorted(known))})" if known else ""))
    return env


def select(implementation: str | None, call: DotCall) -> tuple[Backend, ...]:
    """The backends of one call, in order, the reference last.

    ``implementation``: None (automatic: under ``kernels_setting()``, the first provider
    that takes the call, else the reference alone), ``"xla"`` (the reference alone), or a
    provider's name: its backend, or a ValueError saying why it cannot run the call."""
    if implementation == "xla":
        return (XLA,)
    mode = kernels_setting()
    if implementation is None:
        if mode == "off":
            return (XLA,)
        for p in providers():
            try:
                return (p.backend(call, mode, False), XLA)
            except NotSupported:
                continue
        return (XLA,)
    known = {p.name: p for p in providers()}
    if implementation not in known:
        raise ValueError(f"implementation must be None, 'xla' or one of {sorted(known)}, "
                         f"got {implementation!r}")
    try:
        return (known[implementation].backend(call, mode, True), XLA)
    except NotSupported as e:
        raise ValueError(f"fp4jax.dot(implementation={implementation!r}): {e}; use "
                         "implementation=None (automatic, with fallback) or 'xla'") from e


def run_operands(backends: Sequence[Backend], t: jax.Array,
                 requests: Sequence[OperandRequest], rows: RowShard = WHOLE
                 ) -> list[Operand]:
    """The operands ``requests`` of one tensor ``t``, each made by the first of
    ``backends`` that takes it (one ``make_operands`` call per backend, with all it
    takes)."""
    out: list[Operand | None] = [None] * len(requests)
    for backend in backends:
        todo = [i for i, r in enumerate(requests)
                if out[i] is None and backend.operand_reason(t, r) is None]
        if todo:
            made = backend.make_operands(t, [requests[i] for i in todo], rows)
            for i, op in zip(todo, made, strict=True):
                out[i] = op
    missing = [f"{r.gemm}.{r.which}" for r, op in zip(requests, out, strict=True) if op is None]
    if missing:
        raise NotSupported(f"no backend of {[b.name for b in backends]} makes {missing}")
    return out


def run_gemm(backends: Sequence[Backend], subscripts: str, a: Operand, b: Operand,
             out_dtype: Any, precision: Any = None) -> jax.Array:
    """One GEMM on the first of ``backends`` that takes it."""
    for backend in backends:
        if backend.gemm_reason(subscripts, a, b, out_dtype) is None:
            return backend.gemm(subscripts, a, b, out_dtype=out_dtype, precision=precision)
    raise NotSupported(f"no backend of {[b.name for b in backends]} runs {subscripts}")

