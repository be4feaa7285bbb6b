"""Product taps: what runs around each quantized dense product of a linen layer.

A linen ``fp4jax.nn.linen.DotGeneral`` (the module every ``quantize_model``'d linen layer
and fp4jax's Llama run their products through) computes its product as a chain of taps
around ``fp4jax.dot_general``: each tap gets the call (:class:`ProductCall`: operands,
recipe, the keys the layer drew), the layer's linen scope and a ``compute`` that runs the
rest of the chain, and returns the product. The taps compose outermost first::

    taps[0](call, scope, lambda: taps[1](call, scope, ... lambda: dot_general(call)))

A tap may replace the product (``compute`` not called), read or write linen variables in
the layer's scope (``sow``, ``perturb``, ``get_variable``) and transform the result. The
features that wrap a product live beside their own code, not in the Flax layer:

* :class:`StatsTap` (``fp4jax.diagnostics.layer_stats``, ``fp4jax-train --stats-every``):
  the perturbation that yields ``dy`` and the ``gemm_stats`` of the layer's operands;
* ``fp4jax.outcontrol.ChannelNormTap`` and ``ChannelSplitTap`` (TetraJet-v2's OutControl:
  the per-channel statistic, the channel split).

``DEFAULT_TAPS`` holds the three; each is inert unless its variable collections are passed
to ``apply`` (in or mutable), so a plain ``apply`` computes ``fp4jax.dot_general`` alone.
A tap's ``collections`` are the linen variable collections it uses: a model that runs
layers under ``nn.scan`` must list them in ``variable_axes`` (``tap_collections``) for the
tap to work per scanned layer (fp4jax's Llama does).

The keys are drawn by the layer before the chain runs, in the same order whatever the taps,
so the taps never change which stochastic-rounding draws a product gets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol

import jax
import jax.numpy as jnp

from fp4jax.diagnostics import (
    COTANGENT_COLLECTION,
    PERTURB_COLLECTION,
    STATS_COLLECTION,
    gemm_stats,
    note_unmeasured,
    probing,
)
from fp4jax.outcontrol import ChannelNormTap, ChannelSplitTap
from fp4jax.recipes import Recipe

__all__ = ["DEFAULT_TAPS", "ProductCall", "ProductTap", "StatsTap", "TapScope",
           "check_taps", "run_taps", "tap_collections"]


@dataclasses.dataclass(frozen=True)
class ProductCall:
    """One product ``jax.lax.dot_general(lhs, rhs, dimension_numbers)`` of a layer, as its
    ``DotGeneral`` runs it.

    Attributes:
      path: the layer's module path (``DotGeneral``'s own name left out), e.g.
        ``("block_0", "q")``.
      lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding: the
        ``dot_general`` call's arguments.
      recipe: the layer's resolved recipe.
      key, rht_key: the stochastic-rounding and per-layer RHT keys the layer drew (``None``
        where the recipe needs none).
      dense: whether the product is ``x (..., K) @ w (K, N)``
        (``fp4jax.diagnostics.is_dense_product``), the only products the statistics and
        OutControl act on.
      quantized: whether the recipe quantizes some operand (``recipes.recipe_quantizes``).
    """

    path: tuple[str, ...]
    lhs: jax.Array
    rhs: jax.Array
    dimension_numbers: Any
    precision: Any
    preferred_element_type: Any
    out_sharding: Any
    recipe: Recipe
    key: jax.Array | None
    rht_key: jax.Array | None
    dense: bool
    quantized: bool

    @property
    def name(self) -> str:
        """The layer's path as ``a/b/c``."""
        return "/".join(self.path)


class TapScope(Protocol):
    """What a tap may use of the layer's linen scope (a bound ``DotGeneral``)."""

    def has_variable(self, col: str, name: str) -> bool: ...
    def get_variable(self, col: str, name: str) -> Any: ...
    def is_mutable_collection(self, col: str) -> bool: ...
    def is_initializing(self) -> bool: ...
    def sow(self, col: str, name: str, value: Any) -> bool: ...
    def perturb(self, name: str, value: Any, collection: str = ...) -> Any: ...


class ProductTap(Protocol):
    """A middleware around one product (see the module docstring). Taps are module fields
    of a linen ``DotGeneral``, so they must be hashable (frozen dataclasses are)."""

    collections: tuple[str, ...]

    def __call__(self, call: ProductCall, scope: TapScope,
                 compute: Callable[[], jax.Array]) -> jax.Array: ...


def run_taps(taps: Sequence[ProductTap], call: ProductCall, scope: TapScope,
             default: Callable[[ProductCall], jax.Array]) -> jax.Array:
    """``taps[0](call, scope, lambda: taps[1](..., lambda: default(call)))``: the chain,
    outermost first (no taps: ``default(call)``)."""
    def at(i: int) -> jax.Array:
        if i == len(taps):
            return default(call)
        return taps[i](call, scope, lambda: at(i + 1))
    return at(0)


def tap_collections(taps: Sequence[ProductTap]) -> tuple[str, ...]:
    """The linen variable collections ``taps`` use, each once, in order (for ``nn.scan``'s
    ``variable_axes``)."""
    out: list[str] = []
    for t in taps:
        out.extend(c for c in t.collections if c not in out)
    return tuple(out)


def check_taps(taps: Any, where: str) -> tuple[ProductTap, ...]:
    """``taps`` as a tuple of taps, or a ValueError naming ``where``: each must be callable,
    hashable and say its ``collections`` (a tuple of strings)."""
    if not isinstance(taps, (tuple, list)):
        raise ValueError(f"{where}: taps must be a tuple of product taps (fp4jax.nn.taps), "
                         f"got {type(taps).__name__}")
    for i, t in enumerate(taps):
        cols = getattr(t, "collections", None)
        ok_cols = isinstance(cols, tuple) and all(isinstance(c, str) for c in cols)
        try:
            hash(t)
            hashable = True
        except TypeError:
            hashable = False
        if not callable(t) or not ok_cols or not hashable:
            raise ValueError(
                f"{where}: taps[{i}] ({type(t).__name__}) is not a product tap: it must be "
                "callable as tap(call, scope, compute), hashable (e.g. a frozen dataclass) "
                "and have collections, a tuple of the linen collections it uses")
    return tuple(taps)


@dataclasses.dataclass(frozen=True)
class StatsTap:
    """Per-layer quantization statistics (``fp4jax.diagnostics.layer_stats``; the
    collections are documented in ``fp4jax.nn.linen``): on a dense product, when
    ``PERTURB_COLLECTION`` is passed in or mutable, adds the zero variable ``y`` to the
    output (its gradient is ``dy``); given ``dy`` in ``COTANGENT_COLLECTION`` and
    ``STATS_COLLECTION`` mutable, sows ``gemm_stats`` of the layer's own operands with its
    keys. In ``layer_stats``' shapes pass it reports a product it cannot measure
    (``note_unmeasured``). Inert in ``init`` and in a plain ``apply``."""

    collections: ClassVar[tuple[str, ...]] = (PERTURB_COLLECTION, COTANGENT_COLLECTION,
                                              STATS_COLLECTION)

    def __call__(self, call: ProductCall, scope: TapScope,
                 compute: Callable[[], jax.Array]) -> jax.Array:
        y = compute()
        if scope.is_initializing():
            return y
        if probing() == "shapes":  # layer_stats: say which products it cannot measure
            self._note_unmeasured(call, scope)
        if not call.dense:
            return y
        if (scope.has_variable(PERTURB_COLLECTION, "y")
                or scope.is_mutable_collection(PERTURB_COLLECTION)):
            y = scope.perturb("y", y, collection=PERTURB_COLLECTION)
        if (scope.has_variable(COTANGENT_COLLECTION, "y")
                and scope.is_mutable_collection(STATS_COLLECTION)):
            dy = scope.get_variable(COTANGENT_COLLECTION, "y")
            scope.sow(STATS_COLLECTION, "stats", gemm_stats(
                call.lhs, call.rhs, dy, recipe=call.recipe, key=call.key,
                rht_key=call.rht_key))
        return y

    @staticmethod
    def _note_unmeasured(call: ProductCall, scope: TapScope) -> None:
        """Tells ``layer_stats`` that this product cannot be measured, if so: not ``x (...,
        K) @ w (K, N)``, or inside a linen transform whose ``variable_axes`` do not carry
        the statistics collections."""
        if not call.dense:
            note_unmeasured(call.name, f"not an x (..., K) @ w (K, N) product "
                            f"({tuple(jnp.shape(call.lhs))} x {tuple(jnp.shape(call.rhs))}, "
                            f"dimension numbers {call.dimension_numbers})")
        elif not scope.is_mutable_collection(PERTURB_COLLECTION):
            note_unmeasured(call.name, "inside a linen transform (nn.scan, nn.vmap) whose "
                            f"variable_axes do not carry the collections {PERTURB_COLLECTION!r}"
                            f", {COTANGENT_COLLECTION!r} and {STATS_COLLECTION!r}: list them "
                            "with axis 0 to measure each scanned layer")


DEFAULT_TAPS: tuple[ProductTap, ...] = (StatsTap(), ChannelNormTap(), ChannelSplitTap())
"""The taps every linen ``DotGeneral`` runs unless given others: the statistics outermost,
then OutControl's channel statistic, then its channel split around the product."""
