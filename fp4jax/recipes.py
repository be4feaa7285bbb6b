"""Training recipes: which format, rounding, scaling and transform each GEMM operand gets.

A linear layer runs three GEMMs (NVFP4 paper sec. 4, FP4-all-the-way sec. 4):

* ``fprop``: ``y = x @ w``      (lhs = x, rhs = w; contraction over K)
* ``dgrad``: ``dx = dy @ w.T``  (lhs = dy, rhs = w; contraction over N)
* ``wgrad``: ``dw = x.T @ dy``  (lhs = x, rhs = dy; contraction over the tokens M)

Each of the six operands has a ``QuantSpec``; each GEMM may add a random
Hadamard transform along its contraction axis, applied to *both* operands so
the product is preserved. Named recipes compose these pieces, as
``optax.alias`` composes transforms.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from fp4jax.formats import MXFP4, NVFP4, BlockFormat, get_format

__all__ = [
    "QuantSpec",
    "GemmSpec",
    "Recipe",
    "nvfp4",
    "fp4_all_the_way",
    "mxfp4",
    "bf16",
    "nvfp4_fwd_only",
    "get",
    "names",
    "HIGH_PRECISION",
]

_ROUNDINGS = ("nearest", "stochastic")


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How one GEMM operand is quantized (one of the six quantization points).

    Attributes:
      fmt: a ``BlockFormat`` (or its name); ``None`` keeps the operand in high precision.
      rounding: ``"nearest"`` (RNE) or ``"stochastic"`` (unbiased SR).
      block_2d: 2D ``b x b`` tiles (weights; NVFP4 paper sec. 4.2) instead of 1D
        blocks along the contraction axis.
    """

    fmt: BlockFormat | None = NVFP4
    rounding: str = "nearest"
    block_2d: bool = False

    def __post_init__(self):
        if self.fmt is not None:
            object.__setattr__(self, "fmt", get_format(self.fmt))
        if self.rounding not in _ROUNDINGS:
            raise ValueError(
                f"QuantSpec.rounding must be one of {_ROUNDINGS}, got {self.rounding!r}"
            )

    @property
    def quantized(self) -> bool:
        return self.fmt is not None

    @property
    def stochastic(self) -> bool:
        return self.quantized and self.rounding == "stochastic"

    def replace(self, **changes: Any) -> QuantSpec:
        return dataclasses.replace(self, **changes)


HIGH_PRECISION = QuantSpec(fmt=None)
"""An operand left unquantized (used in its input dtype)."""


@dataclasses.dataclass(frozen=True)
class GemmSpec:
    """The two operands of one GEMM and an optional random Hadamard transform.

    Attributes:
      lhs, rhs: ``QuantSpec`` of each operand (see the module docstring for which is which).
      hadamard: RHT tile size along the contraction axis (0 = off; 16 in NVFP4 Wgrad).
      hadamard_signs: ``None`` (Transformer Engine's fixed vector), an ``int`` seed,
        ``"random"`` (fresh signs from the call's key) or a tuple of +-1 of length
        ``hadamard``.
    """

    lhs: QuantSpec = HIGH_PRECISION
    rhs: QuantSpec = HIGH_PRECISION
    hadamard: int = 0
    hadamard_signs: Any = None

    def __post_init__(self):
        if self.hadamard:
            from fp4jax.hadamard import _check_size

            _check_size(self.hadamard)
        s = self.hadamard_signs
        if isinstance(s, list):
            object.__setattr__(self, "hadamard_signs", tuple(s))
        elif s is not None and not isinstance(s, (int, str, tuple)):
            raise TypeError("GemmSpec.hadamard_signs must be None, an int, 'random' or a tuple")
        if isinstance(s, str) and s not in ("random", "te"):
            raise ValueError(
                f"GemmSpec.hadamard_signs={s!r}: use None, an int, 'random' or a tuple"
            )

    @property
    def quantized(self) -> bool:
        return self.lhs.quantized or self.rhs.quantized

    def replace(self, **changes: Any) -> GemmSpec:
        return dataclasses.replace(self, **changes)


def _map_quant(spec: GemmSpec, fn: Callable[[QuantSpec], QuantSpec]) -> GemmSpec:
    return spec.replace(lhs=fn(spec.lhs), rhs=fn(spec.rhs))


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Per-GEMM quantization of a linear layer (frozen, hashable, a static jit argument).

    Attributes:
      name: display name.
      fprop: ``GemmSpec(lhs=x, rhs=w)``.
      dgrad: ``GemmSpec(lhs=dy, rhs=w)``. When ``dgrad.rhs == fprop.rhs`` and it is
        2D-scaled, the weight quantized for fprop is reused (one quantized W
        serves both passes: the chain rule holds, NVFP4 paper sec. 4.2).
      wgrad: ``GemmSpec(lhs=x, rhs=dy)``; its RHT runs along the token axis.

    ``replace`` takes the dataclass fields and a few ablation knobs:
      * ``sr=False``: every stochastic operand becomes round-to-nearest.
      * ``rht=0`` (or a size): set the Wgrad Hadamard size (0 drops it).
      * ``block_2d=False``: every 2D-scaled operand becomes 1D.
      * ``fmt=BlockFormat``: the format of every quantized operand.
      * dotted paths, e.g. ``**{"dgrad.lhs.rounding": "nearest", "wgrad.hadamard": 0}``.

    Example:
      >>> r = fp4jax.recipes.nvfp4().replace(sr=False, name="nvfp4-no-sr")
    """

    name: str
    fprop: GemmSpec
    dgrad: GemmSpec
    wgrad: GemmSpec

    @property
    def gemms(self) -> dict[str, GemmSpec]:
        return {"fprop": self.fprop, "dgrad": self.dgrad, "wgrad": self.wgrad}

    @property
    def needs_key(self) -> bool:
        """True when some operand uses stochastic rounding or RHT signs come from the key."""
        return any(
            g.lhs.stochastic or g.rhs.stochastic or (g.hadamard and g.hadamard_signs == "random")
            for g in self.gemms.values()
        )

    @property
    def quantized(self) -> bool:
        return any(g.quantized for g in self.gemms.values())

    def replace(self, **changes: Any) -> Recipe:
        r = self
        fields = {f.name for f in dataclasses.fields(Recipe)}
        plain = {k: v for k, v in changes.items() if k in fields}
        if plain:
            r = dataclasses.replace(r, **plain)
        for k, v in changes.items():
            if k in fields:
                continue
            if k == "sr":
                if not v:
                    r = r._map(lambda q: q.replace(rounding="nearest"))
                else:
                    raise ValueError("replace(sr=True) is ambiguous; set rounding per operand")
            elif k == "rht":
                r = dataclasses.replace(r, wgrad=r.wgrad.replace(hadamard=int(v)))
            elif k == "block_2d":
                if v:
                    raise ValueError(
                        "replace(block_2d=True) is ambiguous; use 'fprop.rhs.block_2d'"
                    )
                r = r._map(lambda q: q.replace(block_2d=False))
            elif k == "fmt":
                r = r._map(functools.partial(_set_fmt, get_format(v)))
            elif "." in k:
                r = r._replace_path(k.split("."), v)
            else:
                raise ValueError(
                    f"Recipe.replace: unknown key {k!r}; use {sorted(fields)}, 'sr', 'rht', "
                    "'block_2d', 'fmt' or a dotted path like 'dgrad.lhs.rounding'"
                )
        return r

    def _map(self, fn: Callable[[QuantSpec], QuantSpec]) -> Recipe:
        return dataclasses.replace(
            self,
            fprop=_map_quant(self.fprop, fn),
            dgrad=_map_quant(self.dgrad, fn),
            wgrad=_map_quant(self.wgrad, fn),
        )

    def _replace_path(self, path: list[str], value: Any) -> Recipe:
        if path[0] not in ("fprop", "dgrad", "wgrad") or len(path) not in (2, 3):
            raise ValueError(f"Recipe.replace: bad path {'.'.join(path)!r}")
        g = getattr(self, path[0])
        if len(path) == 2:
            g = g.replace(**{path[1]: value})
        else:
            if path[1] not in ("lhs", "rhs"):
                raise ValueError(f"Recipe.replace: bad path {'.'.join(path)!r}")
            g = g.replace(**{path[1]: getattr(g, path[1]).replace(**{path[2]: value})})
        return dataclasses.replace(self, **{path[0]: g})

    def describe(self) -> str:
        """A multi-line table of the six quantization points."""

        def one(q: QuantSpec) -> str:
            if not q.quantized:
                return "high precision"
            dims = "2D" if q.block_2d else "1D"
            rnd = "SR" if q.rounding == "stochastic" else "RtN"
            return f"{q.fmt.name} {dims} {rnd}"

        lines = [f"recipe {self.name}"]
        for gname, g in self.gemms.items():
            rht = f", RHT{g.hadamard}" if g.hadamard else ""
            lines.append(f"  {gname}: lhs {one(g.lhs)}; rhs {one(g.rhs)}{rht}")
        return "\n".join(lines)


def _set_fmt(fmt: BlockFormat, q: QuantSpec) -> QuantSpec:
    return q.replace(fmt=fmt) if q.quantized else q


def _rtn(fmt: BlockFormat, block_2d: bool = False) -> QuantSpec:
    return QuantSpec(fmt, "nearest", block_2d)


def _sr(fmt: BlockFormat) -> QuantSpec:
    return QuantSpec(fmt, "stochastic", False)


def _paper_recipe(name: str, fmt: BlockFormat, rht: int) -> Recipe:
    w = _rtn(fmt, block_2d=True)
    return Recipe(
        name=name,
        fprop=GemmSpec(lhs=_rtn(fmt), rhs=w),
        dgrad=GemmSpec(lhs=_sr(fmt), rhs=w),
        wgrad=GemmSpec(lhs=_rtn(fmt), rhs=_sr(fmt), hadamard=rht),
    )


def nvfp4() -> Recipe:
    """The NVFP4 pretraining recipe (NVIDIA 2025, sec. 4).

    fprop: x 1x16 RtN, w 16x16 RtN. dgrad: dy 1x16 SR, the same quantized w.
    wgrad: 16x16 random Hadamard transform along the tokens on x and dy, x RtN,
    dy SR. Format NVFP4 (E2M1, E4M3 block scale, FP32 tensor scale).
    """
    return _paper_recipe("nvfp4", NVFP4, 16)


def mxfp4() -> Recipe:
    """The NVFP4 paper's MXFP4 comparison: the same recipe with MXFP4 (blocks of 32,
    UE8M0 scales rounded up), 32x32 weight tiles and a size-32 RHT on wgrad."""
    return _paper_recipe("mxfp4", MXFP4, 32)


def fp4_all_the_way() -> Recipe:
    """FP4 All the Way (Chmiel et al., 2025) fully quantized training.

    NVFP4 format with 1D blocks of 16 everywhere, no RHT; stochastic rounding on
    dy in dgrad and wgrad and on x in wgrad, round-to-nearest elsewhere (their
    SR-placement study, sec. 4).
    """
    f = NVFP4
    return Recipe(
        name="fp4_all_the_way",
        fprop=GemmSpec(lhs=_rtn(f), rhs=_rtn(f)),
        dgrad=GemmSpec(lhs=_sr(f), rhs=_rtn(f)),
        wgrad=GemmSpec(lhs=_sr(f), rhs=_sr(f)),
    )


def bf16() -> Recipe:
    """No quantization: every GEMM runs on the operands as given (the BF16 baseline)."""
    hp = GemmSpec()
    return Recipe(name="bf16", fprop=hp, dgrad=hp, wgrad=hp)


def nvfp4_fwd_only() -> Recipe:
    """FP4 forward, high-precision backward: the quantization-aware fine-tuning phase
    (FP4-all-the-way sec. 5 QAF; NVFP4 paper Appendix D precision switching)."""
    return nvfp4().replace(name="nvfp4_fwd_only", dgrad=GemmSpec(), wgrad=GemmSpec())


_NAMED: dict[str, Callable[[], Recipe]] = {
    "nvfp4": nvfp4,
    "fp4_all_the_way": fp4_all_the_way,
    "mxfp4": mxfp4,
    "bf16": bf16,
    "nvfp4_fwd_only": nvfp4_fwd_only,
}


def names() -> list[str]:
    """Names accepted by ``get``."""
    return sorted(_NAMED)


def get(name: str | Recipe) -> Recipe:
    """A named recipe (or the recipe itself); unknown names raise ValueError listing valid ones."""
    if isinstance(name, Recipe):
        return name
    key = str(name).lower().replace("-", "_")
    if key not in _NAMED:
        raise ValueError(f"unknown recipe {name!r}; valid names: {names()}")
    return _NAMED[key]()
