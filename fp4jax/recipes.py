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

import ast
import dataclasses
import functools
import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from fp4jax.formats import FORMATS, MXFP4, MXFP8_E4M3_UP, NVFP4, BlockFormat, get_format
from fp4jax.hadamard import SIGN_POLICIES
from fp4jax.quantization import (
    BLOCK_SCALE_RULES,
    ROUNDINGS,
    check_block_scale_rule,
    check_ms_eden,
    check_row_scaled,
)

__all__ = [
    "QuantSpec",
    "GemmSpec",
    "Recipe",
    "nvfp4",
    "fp4_all_the_way",
    "mxfp4",
    "bf16",
    "nvfp4_fwd_only",
    "mxfp8",
    "mxfp8_fwd_nvfp4_bwd",
    "quartet2",
    "get",
    "names",
    "parse",
    "parse_run_spec",
    "RunSpec",
    "split_list",
    "split_spec",
    "spec",
    "HIGH_PRECISION",
    "AttentionRecipe",
    "attn_nvfp4",
    "attn_mxfp4",
    "attn_nvfp4_all",
    "attn_bf16",
    "attention_names",
    "get_attention",
    "recipe_quantizes",
]

_ROUNDINGS = ROUNDINGS


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How one GEMM operand is quantized (one of the six quantization points).

    Attributes:
      fmt: a ``BlockFormat`` (or its name); ``None`` keeps the operand in high precision.
      rounding: ``"nearest"`` (RNE), ``"stochastic"`` (unbiased SR) or ``"ms_eden"``
        (Quartet II's MS-EDEN, ``fp4jax.quantization.ms_eden``: NVFP4, 1D, the ``"max"`` rule;
        its GEMM must have an RHT of 16 or more, whose tile is the EDEN group and whose
        random signs make it unbiased).
      block_2d: 2D ``b x b`` tiles (weights; NVFP4 paper sec. 4.2) instead of 1D
        blocks along the contraction axis.
      block_scale_rule: how each block's scale is chosen: ``"max"`` (the block amax
        maps to the element maximum, 6 for E2M1; the default) or Transformer Engine's 4over6
        (``"4over6"``: per block the better of map-to-6 and map-to-4 by absolute error,
        tensor amax mapped to 256 * 6, TE's defaults; ``"4over6-mse"``, ``"4over6-448"``,
        ``"4over6-mse-448"``: its squared-error metric and its 448 bound;
        ``fp4jax.quantization.four_over_six``). 4over6 needs an NVFP4 format and
        round-to-nearest, and no RHT on its GEMM (TE refuses both combinations).
      row_scaled: one FP32 tensor scale per row of the operand (each vector along its
        contraction axis: per token for ``fprop.lhs``) instead of one per tensor:
        Transformer Engine's row-scaled NVFP4 (``NVFP4BlockScaling(row_scaled_activation=
        True)``, on the forward activation; ``fp4jax.quantization.global_encode_scale``). 1D
        blocks and a format with a tensor scale only; the GEMM applies the row scales to
        its output exactly (``fp4jax.dot``).
    """

    fmt: BlockFormat | None = NVFP4
    rounding: str = "nearest"
    block_2d: bool = False
    block_scale_rule: str = "max"
    row_scaled: bool = False

    def __post_init__(self):
        for flag in ("block_2d", "row_scaled"):
            v = getattr(self, flag)
            if not isinstance(v, (bool, np.bool_)):
                raise TypeError(f"QuantSpec.{flag} must be True or False, got {v!r}")
            object.__setattr__(self, flag, bool(v))
        if self.fmt is not None:
            object.__setattr__(self, "fmt", get_format(self.fmt))
        if self.rounding not in _ROUNDINGS:
            raise ValueError(
                f"QuantSpec.rounding must be one of {_ROUNDINGS}, got {self.rounding!r}"
            )
        check_block_scale_rule(self.block_scale_rule, self.fmt, self.rounding, "QuantSpec")
        check_row_scaled(self.row_scaled, self.fmt, block_2d=self.block_2d,
                         rounding=self.rounding, where="QuantSpec")
        if self.rounding == "ms_eden":
            check_ms_eden(self.fmt, block_2d=self.block_2d,
                          block_scale_rule=self.block_scale_rule, where="QuantSpec")

    @property
    def quantized(self) -> bool:
        return self.fmt is not None

    @property
    def stochastic(self) -> bool:
        """Per-element stochastic rounding (``rounding="stochastic"``)."""
        return self.quantized and self.rounding == "stochastic"

    @property
    def random(self) -> bool:
        """Whether quantizing draws random bits (SR, or MS-EDEN's scale rounding)."""
        return self.quantized and self.rounding != "nearest"

    def replace(self, **changes: Any) -> QuantSpec:
        return dataclasses.replace(self, **changes)


HIGH_PRECISION = QuantSpec(fmt=None)
"""An operand left unquantized (used in its input dtype)."""


def check_hadamard_signs(signs: tuple, size: int, where: str = "GemmSpec.hadamard_signs"
                         ) -> None:
    """ValueError naming ``where`` unless ``signs`` holds only the numbers +1 and -1 (not
    0/1 bits, not bools: the transform must stay orthogonal, else the weight gradient is
    silently wrong) and, when the GEMM has an RHT (``size > 0``), exactly ``size`` of them."""
    bad = [v for v in signs
           if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating))
           or v not in (1, -1)]
    if bad:
        raise ValueError(f"{where}: every entry must be +1 or -1 (a random sign vector such "
                         f"as Transformer Engine's), got {bad[0]!r} among {len(signs)} entries;"
                         " 0/1 bits must be mapped to -1/+1 (e.g. 2 * b - 1)")
    if size and len(signs) != size:
        raise ValueError(f"{where}: {len(signs)} signs for an RHT of size {size}: give "
                         f"exactly {size} (one per point of the transform)")


@dataclasses.dataclass(frozen=True)
class GemmSpec:
    """The two operands of one GEMM and an optional random Hadamard transform.

    Attributes:
      lhs, rhs: ``QuantSpec`` of each operand (see the module docstring for which is which).
      hadamard: RHT tile size along the contraction axis (0 = off; 16 in NVFP4 Wgrad).
      hadamard_signs: ``None`` (Transformer Engine's fixed vector, one for every layer),
        an ``int`` seed, ``"layer"`` (one vector per layer, constant over training, drawn
        from the call's ``rht_key``: torchao's ``nvfp4_training`` policy), ``"random"``
        (fresh signs from the call's key, re-drawn every step and layer: Quartet II's),
        ``"ones"`` (no sign flips: the deterministic, unsigned Hadamard ``H / sqrt(n)`` of
        AMD's MXFP4 training, ``fp4jax.hadamard.unsigned_signs``) or a tuple of +-1 of
        length ``hadamard``.
    """

    lhs: QuantSpec = HIGH_PRECISION
    rhs: QuantSpec = HIGH_PRECISION
    hadamard: int = 0
    hadamard_signs: Any = None

    def __post_init__(self):
        h = self.hadamard
        if isinstance(h, bool) or not isinstance(h, (int, np.integer)):
            raise TypeError(f"GemmSpec.hadamard must be an int (0 = off, or a power of two "
                            f"in 2..256), got {h!r}")
        object.__setattr__(self, "hadamard", int(h))
        if not 0 <= self.hadamard <= 256:
            raise ValueError(f"GemmSpec.hadamard must be 0 (off) or a power of two in 2..256, "
                             f"got {_clip(str(self.hadamard), 40)}")
        if self.hadamard:
            from fp4jax.hadamard import check_size

            check_size(self.hadamard)
        s = self.hadamard_signs
        if isinstance(s, (list, np.ndarray)):
            s = tuple(np.asarray(s).tolist())
            object.__setattr__(self, "hadamard_signs", s)
        elif s is not None and not isinstance(s, (int, np.integer, str, tuple)) or isinstance(
                s, bool):
            raise TypeError("GemmSpec.hadamard_signs must be None, an int, 'layer', 'random', "
                            "'ones' or a tuple")
        if isinstance(s, str) and s not in ("random", "layer", *SIGN_POLICIES):
            raise ValueError(
                f"GemmSpec.hadamard_signs={s!r}: use None, an int, 'layer', 'random', 'ones' "
                "(no sign flips) or a tuple"
            )
        if isinstance(s, (int, np.integer)) and not 0 <= s < 2**32:
            raise ValueError(f"GemmSpec.hadamard_signs: an int seed must be in 0 .. 2**32 - 1 "
                             f"(a jax.random key's seed), got {s}")
        if isinstance(s, tuple):
            check_hadamard_signs(s, self.hadamard)
        for side in ("lhs", "rhs"):
            if getattr(self, side).rounding == "ms_eden" and self.hadamard < 16:
                raise ValueError(
                    f"GemmSpec: {side}.rounding='ms_eden' needs an RHT of 16 or more on its "
                    f"GEMM, got hadamard={self.hadamard}: MS-EDEN's correction is unbiased "
                    "only in expectation over a random rotation, and its group is the RHT "
                    "tile (Quartet II: hadamard=128, hadamard_signs='random'); set hadamard "
                    f"or {side}.rounding='stochastic'")
            rule = getattr(self, side).block_scale_rule
            if self.hadamard and rule != "max":
                raise ValueError(
                    f"GemmSpec: {side}.block_scale_rule={rule!r} with hadamard="
                    f"{self.hadamard}: Transformer Engine refuses 4over6 with the RHT ('NVFP4 "
                    "4over6 quantization does not support RHT'); set hadamard=0 for this "
                    f"GEMM (e.g. rht=0 for wgrad) or {side}.block_scale_rule='max'"
                )

    @property
    def quantized(self) -> bool:
        return self.lhs.quantized or self.rhs.quantized

    def replace(self, **changes: Any) -> GemmSpec:
        return dataclasses.replace(self, **changes)


def _map_quant(spec: GemmSpec, fn: Callable[[QuantSpec], QuantSpec]) -> GemmSpec:
    return spec.replace(lhs=fn(spec.lhs), rhs=fn(spec.rhs))


AMAX_SCOPES = ("global", "local")
"""``Recipe.amax_scope`` values."""


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
      amax_scope: whose amax sets a data-parallel tensor's scale inside
        ``fp4jax.sharding.data_parallel`` (``AMAX_SCOPES``; no effect elsewhere):
        ``"global"`` (the default: the whole batch's, one ``pmax`` over the devices: the
        one-device bits) or ``"local"`` (each device quantizes its shard of x and dy with
        its shard's own tensor amax, Transformer Engine's data-parallel semantics: no
        collective, bits that depend on the device count).

    ``replace`` takes the dataclass fields and a few ablation knobs:
      * ``sr=False``: every stochastic operand becomes round-to-nearest.
      * ``rht=0`` (or a size): set the Wgrad Hadamard size (0 drops it).
      * ``block_2d=False``: every 2D-scaled operand becomes 1D.
      * ``fmt=BlockFormat``: the format of every quantized operand.
      * ``block_scale_rule="4over6"`` (or another 4over6 rule): on the quantized x and w
        operands (``fprop.lhs``, ``fprop.rhs``, ``dgrad.rhs``, ``wgrad.lhs``; never dy:
        Transformer Engine's ``nvfp4_4over6="all"`` scope); ``"max"``: on all six.
        The RHT and stochastic rounding must be off there first, e.g.
        ``nvfp4().replace(rht=0, block_scale_rule="4over6")``.
      * ``row_scaled=True``: per-row tensor scales on the forward activation
        (``fprop.lhs``; TE's ``row_scaled_activation``); ``False``: off on all six.
      * dotted paths, e.g. ``**{"dgrad.lhs.rounding": "nearest", "wgrad.hadamard": 0}``.

    Example:
      >>> r = fp4jax.recipes.nvfp4().replace(sr=False, name="nvfp4-no-sr")
    """

    name: str
    fprop: GemmSpec
    dgrad: GemmSpec
    wgrad: GemmSpec
    amax_scope: str = "global"

    def __post_init__(self):
        if self.amax_scope not in AMAX_SCOPES:
            raise ValueError(f"Recipe.amax_scope must be one of {AMAX_SCOPES}, got "
                             f"{self.amax_scope!r}")

    @property
    def gemms(self) -> dict[str, GemmSpec]:
        return {"fprop": self.fprop, "dgrad": self.dgrad, "wgrad": self.wgrad}

    @property
    def needs_key(self) -> bool:
        """True when some operand draws random bits (stochastic rounding, MS-EDEN) or RHT
        signs come from the key."""
        return any(
            g.lhs.random or g.rhs.random or (g.hadamard and g.hadamard_signs == "random")
            for g in self.gemms.values()
        )

    @property
    def needs_layer_key(self) -> bool:
        """True when some GEMM draws its RHT signs per layer (``hadamard_signs="layer"``):
        ``fp4jax.dot`` then needs ``rht_key``, a key constant over training, one per layer."""
        return any(g.hadamard and g.hadamard_signs == "layer" for g in self.gemms.values())

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
            if k in ("sr", "block_2d") and not isinstance(v, (bool, np.bool_)):
                raise TypeError(f"Recipe.replace: {k} must be True or False, got {v!r}")
            if k == "sr":
                if not v:
                    r = r._map(lambda q: q.replace(rounding="nearest"))
                else:
                    raise ValueError("replace(sr=True) is ambiguous; set rounding per operand")
            elif k == "rht":
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                    raise TypeError(f"Recipe.replace: rht must be an int (0 = off, or a power "
                                    f"of two in 2..256), got {v!r}")
                r = dataclasses.replace(r, wgrad=r.wgrad.replace(hadamard=int(v)))
            elif k == "block_2d":
                if v:
                    raise ValueError(
                        "replace(block_2d=True) is ambiguous; use 'fprop.rhs.block_2d'"
                    )
                r = r._map(lambda q: q.replace(block_2d=False))
            elif k == "fmt":
                r = r._map(functools.partial(_set_fmt, get_format(v)))
            elif k == "block_scale_rule":
                r = r._set_block_scale_rule(v)
            elif k == "row_scaled":
                r = r._set_row_scaled(v)
            elif "." in k:
                r = r._replace_path(k.split("."), v)
            else:
                raise ValueError(
                    f"Recipe.replace: unknown key {k!r}; use {sorted(fields)}, 'sr', 'rht', "
                    "'block_2d', 'fmt', 'block_scale_rule', 'row_scaled' or a dotted path "
                    "like 'dgrad.lhs.rounding'"
                )
        return r

    def _set_block_scale_rule(self, rule: str) -> Recipe:
        """``replace(block_scale_rule=rule)``: a 4over6 rule on the quantized x and w
        operands (TE's ``nvfp4_4over6="all"``: gradients keep ``"max"``), ``"max"`` on all
        six; a ValueError naming the operand when its GEMM has an RHT or it rounds
        stochastically (TE refuses both), or when ``rule`` is unknown."""
        if rule not in BLOCK_SCALE_RULES:
            raise ValueError(f"Recipe.replace: block_scale_rule must be one of "
                             f"{BLOCK_SCALE_RULES}, got {rule!r}")
        if rule == "max":
            return self._map(lambda q: q.replace(block_scale_rule="max") if q.quantized else q)
        gemms = {n: getattr(self, n) for n in ("fprop", "dgrad", "wgrad")}
        for gname, side in _X_AND_W:
            g = gemms[gname]
            q = getattr(g, side)
            if not q.quantized:
                continue
            path = f"{gname}.{side}"
            operand = _OPERAND_NAMES[gname][side == "rhs"]
            if g.hadamard:
                raise ValueError(
                    f"Recipe.replace(block_scale_rule={rule!r}) sets {path} ({operand}"
                    f"), whose GEMM has an RHT ({gname}.hadamard={g.hadamard}): Transformer "
                    "Engine refuses 4over6 with the RHT. Drop it first (e.g. "
                    f"'{self.name}(rht=0, block_scale_rule={rule})' or "
                    f"{gname}.hadamard=0), or set the rule per operand ('fprop.lhs."
                    "block_scale_rule', ...)")
            if q.stochastic:
                raise ValueError(
                    f"Recipe.replace(block_scale_rule={rule!r}) sets {path}, which rounds "
                    "stochastically: Transformer Engine refuses 4over6 with stochastic "
                    f"rounding. Set {path}.rounding=nearest first, or set the rule per "
                    "operand ('fprop.lhs.block_scale_rule', ...)")
            gemms[gname] = g.replace(**{side: q.replace(block_scale_rule=rule)})
        return dataclasses.replace(self, **gemms)

    def _set_row_scaled(self, on: bool) -> Recipe:
        """``replace(row_scaled=on)``: True sets it on the forward activation ``fprop.lhs``
        (TE's ``row_scaled_activation``: "forward activation quantizers emit row-scaled
        NVFP4 tensors"), False clears it on all six operands."""
        if not isinstance(on, bool):
            raise TypeError(f"Recipe.replace: row_scaled must be True or False, got {on!r}")
        if not on:
            return self._map(lambda q: q.replace(row_scaled=False) if q.row_scaled else q)
        try:
            return dataclasses.replace(
                self, fprop=self.fprop.replace(lhs=self.fprop.lhs.replace(row_scaled=True)))
        except ValueError as e:
            raise ValueError(f"Recipe.replace(row_scaled=True) sets fprop.lhs (x): {e}"
                             ) from None

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
        try:
            if len(path) == 2:
                g = g.replace(**{path[1]: value})
            else:
                if path[1] not in ("lhs", "rhs"):
                    raise ValueError(f"Recipe.replace: bad path {'.'.join(path)!r}")
                g = g.replace(**{path[1]: getattr(g, path[1]).replace(**{path[2]: value})})
        except ValueError as e:
            if str(e).startswith("Recipe.replace"):
                raise
            raise ValueError(f"{path[0]}: {e}") from None
        return dataclasses.replace(self, **{path[0]: g})

    def describe(self) -> str:
        """A multi-line table of the six quantization points."""

        def one(q: QuantSpec) -> str:
            if not q.quantized:
                return "high precision"
            dims = "2D" if q.block_2d else "1D"
            rule = "" if q.block_scale_rule == "max" else f" {q.block_scale_rule}"
            rows = " row-scaled" if q.row_scaled else ""
            return f"{q.fmt.name} {dims} {_ROUNDING_NAMES[q.rounding]}{rule}{rows}"

        lines = [f"recipe {self.name}"]
        for gname, g in self.gemms.items():
            rht = f", RHT{g.hadamard}" if g.hadamard else ""
            lines.append(f"  {gname}: lhs {one(g.lhs)}; rhs {one(g.rhs)}{rht}")
        return "\n".join(lines)

    def __str__(self) -> str:
        """One line: per GEMM, each operand's format, block shape, scale format and
        rounding, and the RHT, e.g. ``nvfp4: fprop x nvfp4 1x16 e4m3 RtN, w nvfp4 16x16
        e4m3 RtN | dgrad dy ... | wgrad RHT16 x ..., dy ...``."""
        parts = []
        for gname, g in self.gemms.items():
            a, b = _OPERAND_NAMES[gname]
            rht = f"RHT{g.hadamard} " if g.hadamard else ""
            if g.hadamard and g.hadamard_signs is not None:
                rht = f"RHT{g.hadamard}(signs={g.hadamard_signs!r}) "
            parts.append(f"{gname} {rht}{a} {_operand_str(g.lhs)}, {b} {_operand_str(g.rhs)}")
        return f"{self.name}: " + " | ".join(parts)


_OPERAND_NAMES = {"fprop": ("x", "w"), "dgrad": ("dy", "w"), "wgrad": ("x", "dy")}
# the x and w operands: the slots Transformer Engine's nvfp4_4over6="all" covers
_X_AND_W = (("fprop", "lhs"), ("fprop", "rhs"), ("dgrad", "rhs"), ("wgrad", "lhs"))


def _operand_str(q: QuantSpec) -> str:
    if not q.quantized:
        return "bf16"
    f = q.fmt
    shape = f"{f.block_size}x{f.block_size}" if q.block_2d else f"1x{f.block_size}"
    scale = f"e{f.scale_exp_bits}m{f.scale_man_bits}{'-ieee' if f.scale_ieee else ''}"
    rule = "" if q.block_scale_rule == "max" else f" {q.block_scale_rule}"
    rows = " row-scaled" if q.row_scaled else ""
    return f"{f.name} {shape} {scale} {_ROUNDING_NAMES[q.rounding]}{rule}{rows}"


_ROUNDING_NAMES = {"nearest": "RtN", "stochastic": "SR", "ms_eden": "MS-EDEN"}


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


def mxfp8() -> Recipe:
    """The MXFP8 baseline, as Transformer Engine's ``MXFP8BlockScaling`` recipe runs it by
    default (``fp8_format=Format.E4M3``: "MXFP8 uses the E4M3 FP8 format exclusively for
    both forward and backward passes"; TE commit 000b637e,
    ``transformer_engine/common/recipe/__init__.py``, and
    ``docs/features/low_precision_training/mxfp8/mxfp8.rst``).

    All six operands are MXFP8 E4M3 (``fp4jax.formats.MXFP8_E4M3_UP``: blocks of 32,
    UE8M0 scale rounded up, TE's ``float_to_e8m0(amax * (1/448))``), 1D blocks along each
    GEMM's contraction axis (TE: 1x32 blocks, the rowwise and columnwise copies each
    quantized from the high-precision tensor, no 2D scaling), round-to-nearest, no RHT.
    TE's ``Format.HYBRID`` option (E5M2 gradients) is
    ``parse("mxfp8(dgrad.lhs.fmt=mxfp8_e5m2_up, wgrad.rhs.fmt=mxfp8_e5m2_up)")``.
    """
    f = MXFP8_E4M3_UP
    return Recipe(
        name="mxfp8",
        fprop=GemmSpec(lhs=_rtn(f), rhs=_rtn(f)),
        dgrad=GemmSpec(lhs=_rtn(f), rhs=_rtn(f)),
        wgrad=GemmSpec(lhs=_rtn(f), rhs=_rtn(f)),
    )


def mxfp8_fwd_nvfp4_bwd() -> Recipe:
    """MXFP8 forward, NVFP4 backward: Transformer Engine's hybrid quantizer factory
    ``mxfp8_fwd_nvfp4_bwd_quantizer_factory`` (TE commit 0043a63c,
    ``transformer_engine/pytorch/custom_recipes/quantization_factory_zoo.py``): "fprop:
    weight.row(MXFP8) x input.row(MXFP8); dgrad: weight.col(NVFP4) x
    grad_output.row(NVFP4); wgrad: input.col(NVFP4) x grad_output.col(NVFP4)", the NVFP4
    side with NVFP4's role settings (2D weights; RHT and SR as the NVFP4 recipe).

    fprop: x and w MXFP8 E4M3 1x32 RtN (as ``mxfp8()``). dgrad and wgrad: ``nvfp4()``'s
    (dy 1x16 SR with w 16x16 RtN, quantized from the high-precision weight; wgrad RHT-16,
    x RtN, dy SR).
    """
    f = MXFP8_E4M3_UP
    return nvfp4().replace(name="mxfp8_fwd_nvfp4_bwd",
                           fprop=GemmSpec(lhs=_rtn(f), rhs=_rtn(f)))


def quartet2() -> Recipe:
    """Quartet II (Panferov et al., 2026, arXiv 2601.22813; IST-DASLab/Quartet-II commit
    8776a90b, ``src/models/quantization/schemes/quartet_2.py`` and
    ``kernels/python/quartet2/linear.py``): NVFP4 everywhere, 1x16 blocks along each GEMM's
    contraction axis.

    fprop: x and w round-to-nearest with 4over6 block scaling (their ``NVFP4QuantMode.
    FOUR_SIX`` kernel, ``round_four_six.cu``: squared error, tensor amax mapped to 256 x 6,
    so ``"4over6-mse"``, Transformer Engine's arithmetic of that rule). dgrad and wgrad: a
    128-point RHT along the contraction axis on both operands, signs re-drawn every step
    and layer (``hadamard_signs="random"``: their ``rerotate_hadamard`` per backward call),
    and MS-EDEN rounding of all four operands (``fp4jax.quantization.ms_eden``) in place of SR.

    Differences from their code: their backward re-quantizes the forward's dequantized x
    and w (``rht128_requant``), fp4jax quantizes dgrad's w and wgrad's x from the
    high-precision tensors (as every fp4jax recipe); their RHT multiplies ``H`` by the signs
    on the right, fp4jax's by ``diag(signs)`` on the left (both a random orthogonal
    rotation), and draws separate signs for dgrad and wgrad (theirs: one per step for
    both); MS-EDEN's own differences are in ``ms_eden``.
    """
    four6 = QuantSpec(NVFP4, "nearest", block_scale_rule="4over6-mse")
    eden = QuantSpec(NVFP4, "ms_eden")
    bwd = GemmSpec(lhs=eden, rhs=eden, hadamard=128, hadamard_signs="random")
    return Recipe(name="quartet2", fprop=GemmSpec(lhs=four6, rhs=four6), dgrad=bwd, wgrad=bwd)


_NAMED: dict[str, Callable[[], Recipe]] = {
    "nvfp4": nvfp4,
    "fp4_all_the_way": fp4_all_the_way,
    "mxfp4": mxfp4,
    "bf16": bf16,
    "nvfp4_fwd_only": nvfp4_fwd_only,
    "mxfp8": mxfp8,
    "mxfp8_fwd_nvfp4_bwd": mxfp8_fwd_nvfp4_bwd,
    "quartet2": quartet2,
}


def names() -> list[str]:
    """Names accepted by ``get``."""
    return sorted(_NAMED)


def get(name: str | Recipe) -> Recipe:
    """A named recipe, a recipe spec string (``"nvfp4(sr=False)"``: ``parse``) or the recipe
    itself; unknown names raise ValueError listing valid ones."""
    if isinstance(name, Recipe):
        return name
    if isinstance(name, str) and "(" in name:
        return parse(name)
    key = str(name).lower().replace("-", "_")
    if key not in _NAMED:
        raise ValueError(f"unknown recipe {name!r}; valid names: {names()}")
    return _NAMED[key]()


# ---------------------------------------------------------------------------
# Recipe spec strings: "nvfp4(sr=False, dgrad.lhs.rounding=nearest)".
# ---------------------------------------------------------------------------

_SPEC_KNOBS = ("sr", "rht", "block_2d", "fmt", "block_scale_rule", "row_scaled", "name",
               "amax_scope")
_GEMM_KEYS = ("hadamard", "hadamard_signs")
_QUANT_KEYS = ("fmt", "rounding", "block_2d", "block_scale_rule", "row_scaled")
_RULE_RE = re.compile(r"[A-Za-z0-9_-]+$")  # a bare block_scale_rule value: 4over6-mse
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*$")
# a spec: NAME, optionally followed by (key=value, ...) overrides
_SPEC_RE = re.compile(r"([^()\s]+)\s*(?:\((.*)\))?", flags=re.S)
_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def _valid_keys() -> list[str]:
    keys = list(_SPEC_KNOBS)
    for g in ("fprop", "dgrad", "wgrad"):
        keys += [f"{g}.{k}" for k in _GEMM_KEYS]
        keys += [f"{g}.{o}.{k}" for o in ("lhs", "rhs") for k in _QUANT_KEYS]
    return keys


def _split_top(text: str, spec: str) -> list[str]:
    """Split ``text`` at commas outside parentheses, brackets and quotes."""
    parts, depth, quote, cur, escaped = [], 0, None, [], False
    for ch in text:
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"recipe spec {spec!r}: unbalanced ')'")
        elif ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    if quote or depth:
        raise ValueError(f"recipe spec {spec!r}: unclosed quote or parenthesis")
    parts.append("".join(cur))
    return [p.strip() for p in parts]


def split_spec(spec: str) -> tuple[str, list[str]]:
    """The grammar of a recipe spec, ``NAME`` or ``NAME(item, item, ...)``: the name and the
    items (``key=value`` strings, split at commas outside parentheses, brackets and quotes;
    no items for a bare name). ``parse`` gives the items their meaning; callers that carry
    their own keys beside a recipe's (the harness's run-level keys) split them out here.

    Raises:
      ValueError: not of that form, or unbalanced parentheses or quotes.
    """
    text = spec.strip()
    m = _SPEC_RE.fullmatch(text)
    if not m:
        raise ValueError(f"recipe spec {spec!r}: use NAME or NAME(key=value, ...), e.g. "
                         "'nvfp4(sr=False, rht=0)'")
    if m[2] is None or not m[2].strip():
        return m[1], []
    return m[1], _split_top(m[2], spec)


def split_list(text: str) -> list[str]:
    """A comma-separated list of specs split at its top-level commas (outside parentheses,
    brackets and quotes), blanks dropped: ``"nvfp4,nvfp4(sr=False, rht=0),bf16"`` gives
    three specs.

    Raises:
      ValueError: unbalanced parentheses or quotes.
    """
    return [x for x in _split_top(text, text) if x]


def _block_format(node: ast.Call, spec: str) -> BlockFormat:
    """``BlockFormat(...)`` of a spec: the constructor's arguments as literals; ``scale="e4m3"``
    may stand for ``scale_exp_bits=4, scale_man_bits=3`` and ``elem="e4m3"`` for
    ``elem_exp_bits=4, elem_man_bits=3``; the name defaults to one made of the element
    format (when not E2M1), the scale format and block size (e.g. ``e4m3-b32``,
    ``e4m3_e8m0-b32``; ``-ieee`` for IEEE-convention scales)."""
    try:
        args = [ast.literal_eval(a) for a in node.args]
        kw = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    except (ValueError, TypeError, RecursionError, MemoryError, OverflowError) as e:
        raise ValueError(f"recipe spec {spec!r}: BlockFormat(...) takes literal arguments") from e
    for short, prefix in (("scale", "scale"), ("elem", "elem")):
        bits = kw.pop(short, None)
        if bits is None:
            continue
        m = re.fullmatch(r"[eE](\d)[mM](\d)", str(bits))
        if not m:
            raise ValueError(f"recipe spec {spec!r}: {short}={bits!r}: use 'eXmY', e.g. "
                             f"{'e4m3' if short == 'scale' else 'e2m1'!r}")
        kw[f"{prefix}_exp_bits"], kw[f"{prefix}_man_bits"] = int(m[1]), int(m[2])
    if not args and "name" not in kw:
        e, mb = kw.get("scale_exp_bits", 4), kw.get("scale_man_bits", 3)
        ee, em = kw.get("elem_exp_bits", 2), kw.get("elem_man_bits", 1)
        elem = "" if (ee, em) == (2, 1) else f"e{ee}m{em}_"
        ieee = "-ieee" if kw.get("scale_ieee") else ""
        kw["name"] = f"{elem}e{e}m{mb}-b{kw.get('block_size', 16)}{ieee}"
    fields = [f.name for f in dataclasses.fields(BlockFormat)]
    bad = [k for k in kw if k not in fields]
    if bad:
        raise ValueError(f"recipe spec {spec!r}: BlockFormat has no argument {bad[0]!r}; "
                         f"valid: {fields}, scale='eXmY' and elem='eXmY'")
    return BlockFormat(*args, **kw)


def _clip(text: str, n: int = 120) -> str:
    """``text`` shortened for an error message (a hostile spec may be huge)."""
    return text if len(text) <= n else f"{text[:n // 2]}...{text[-20:]}"


def _value(key: str, text: str, spec: str) -> Any:
    """A spec value: a Python literal, ``BlockFormat(...)``, or a bare word (a format name
    for ``fmt`` keys, else the word as a string: ``nearest``, ``stochastic``, ``random``)."""
    value = _value_any(key, text, spec)
    leaf = key.rsplit(".", 1)[-1]
    if leaf in _BOOL_KEYS and not isinstance(value, bool):
        raise ValueError(f"recipe spec {spec!r}: {key}={_clip(text)}: {leaf} takes True or "
                         "False")
    if leaf in _INT_KEYS and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"recipe spec {spec!r}: {key}={_clip(text)}: {leaf} takes an "
                         "integer (0 = no RHT, or a power of two in 2..256)")
    return value


_BOOL_KEYS = ("sr", "block_2d", "row_scaled")
_INT_KEYS = ("rht", "hadamard")
_MAX_VALUE_CHARS = 1000


def _value_any(key: str, text: str, spec: str) -> Any:
    """``_value`` before the type checks of boolean and integer keys."""
    if not text:
        raise ValueError(f"recipe spec {spec!r}: {key}= has no value")
    if len(text) > _MAX_VALUE_CHARS:
        raise ValueError(f"recipe spec: the value of {key} is {len(text)} characters long "
                         f"(at most {_MAX_VALUE_CHARS}): {_clip(text)!r}")
    if key.rsplit(".", 1)[-1] == "block_scale_rule" and _RULE_RE.match(text):
        return text  # a bare word that may start with a digit: 4over6
    try:
        node = ast.parse(text, mode="eval").body
    except (SyntaxError, RecursionError, MemoryError, ValueError):
        raise ValueError(f"recipe spec {spec!r}: cannot read the value of {key}: "
                         f"{_clip(text)!r}") from None
    leaf = key.rsplit(".", 1)[-1]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and (
            node.func.id == "BlockFormat"):
        return _block_format(node, spec)
    if isinstance(node, ast.Name):
        word = node.id
        if word in ("True", "False", "None"):
            return ast.literal_eval(word)
        if leaf == "fmt":
            try:
                return get_format(word)
            except ValueError as e:
                raise ValueError(f"recipe spec {spec!r}: {key}={word}: {e}") from None
        return word
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, RecursionError, MemoryError, OverflowError,
            SyntaxError):
        raise ValueError(f"recipe spec {spec!r}: {key}={_clip(text)!r} is not a literal, "
                         "a format name or BlockFormat(...)") from None


def parse(spec: str | Recipe) -> Recipe:
    """A recipe from a spec string: a recipe name, optionally followed by overrides.

    ``parse("nvfp4(sr=False, rht=0)") == nvfp4().replace(sr=False, rht=0)``. The keys are
    those of ``Recipe.replace``: ``sr``, ``rht``, ``block_2d``, ``fmt``,
    ``block_scale_rule``, ``name`` and dotted paths to one GEMM (``wgrad.hadamard``,
    ``wgrad.hadamard_signs``) or one quantization point (``dgrad.lhs.rounding``,
    ``fprop.rhs.block_2d``, ``wgrad.rhs.fmt``, ``fprop.lhs.block_scale_rule``).
    Values are Python literals (``False``, ``0``, ``'random'``),
    format names (``fmt=mxfp4``, ``fmt=mxfp8_e4m3``), ``BlockFormat(...)`` (its arguments,
    with ``scale='e4m3'`` and ``elem='e4m3'`` as shorthands for the scale and element
    bits, and ``scale_ieee=True`` for IEEE-convention scales) or bare words (``nearest``,
    ``stochastic``). Overrides apply left to right. A ``Recipe`` is returned unchanged.

    Examples:
      >>> parse("nvfp4")
      >>> parse("mxfp8(dgrad.lhs.fmt=mxfp8_e5m2_up, wgrad.rhs.fmt=mxfp8_e5m2_up)")
      >>> parse("nvfp4(fmt=BlockFormat(block_size=32, scale='e4m3'))")
      >>> parse("nvfp4(fmt=BlockFormat(scale='e5m2', scale_ieee=True))")  # max 57344
      >>> parse("nvfp4(dgrad.lhs.rounding=nearest, wgrad.lhs.rounding=stochastic)")
      >>> parse("nvfp4(rht=0, block_scale_rule=4over6)")       # TE's 4over6 on x and w
      >>> parse("nvfp4(fprop.lhs.block_scale_rule=4over6-mse)")
      >>> parse("nvfp4(row_scaled=True)")   # TE's row-scaled NVFP4 on the forward x
      >>> parse("quartet2(wgrad.hadamard=16)")

    Raises:
      ValueError naming the bad name, key or value and listing the valid ones.
    """
    if isinstance(spec, Recipe):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"recipe spec must be a string or a Recipe, got {type(spec).__name__}")
    text = spec.strip()
    m = _SPEC_RE.fullmatch(text)
    if not m:
        raise ValueError(f"recipe spec {spec!r}: use NAME or NAME(key=value, ...), e.g. "
                         "'nvfp4(sr=False, rht=0)'")
    name, body = m[1], m[2]
    recipe = _spec_recipe(name, spec)
    if body is None or not body.strip():
        return recipe
    return _apply_items(recipe, _split_top(body, spec), spec)


def _spec_recipe(name: str, spec: str) -> Recipe:
    """The named recipe ``name`` of the spec ``spec`` (``get``), or a ValueError naming the
    spec and listing the valid names."""
    key = name.lower().replace("-", "_")
    if key not in _NAMED:
        raise ValueError(f"recipe spec {spec!r}: unknown recipe {name!r}; valid names: {names()}")
    return _NAMED[key]()


def _apply_items(recipe: Recipe, items: list[str], spec: str, more: str = "") -> Recipe:
    """``recipe`` with the ``key=value`` items of ``spec`` applied left to right (``parse``);
    ``more`` is appended to the message of an unknown key (the caller's own keys)."""
    valid = _valid_keys()
    for item in items:
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or not _KEY_RE.match(key):
            raise ValueError(f"recipe spec {spec!r}: {item!r} is not key=value")
        if key not in valid:
            raise ValueError(f"recipe spec {spec!r}: unknown key {key!r}; valid keys: {valid}"
                             f"{more}")
        shown = _clip(spec)
        value = _value(key, text.strip(), shown)
        try:
            recipe = recipe.replace(**{key: value})
        except (TypeError, ValueError) as e:
            raise ValueError(f"recipe spec {shown!r}: {key}={_clip(text.strip())}: {e}"
                             ) from None
    return recipe


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """A spec parsed by ``parse_run_spec``: the recipe it names, with its recipe items
    applied, and the values of the caller's own keys.

    Attributes:
      text: the spec as given, stripped (``"nvfp4(sr=False, last_bf16=0)"``).
      base: the spec without the caller's keys (``"nvfp4(sr=False)"``), for messages and
        records; ``parse(base) == recipe``.
      recipe: the parsed recipe.
      extra: the caller's keys of the spec and their converted values (``{"last_bf16": 0}``),
        in the order given.
    """

    text: str
    base: str
    recipe: Recipe
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)

    @classmethod
    def plain(cls, text: str, recipe: Recipe) -> RunSpec:
        """The parse of ``text``, a spec with no caller's keys whose recipe is already known
        (``spec(recipe)``, or a ``RunSpec``'s ``base``): ``text == base``, no ``extra``."""
        return cls(text, text, recipe, {})


def parse_run_spec(spec: str, keys: Mapping[str, Callable[[str], Any]] | None = None, *,
                   label: str = "run-level keys") -> RunSpec:
    """Parses a spec that may carry, beside the recipe's items (``parse``), keys of its
    caller: the training harness's run-level keys (``nvfp4(sr=False, last_bf16=0)``). The
    spec is split once (``split_spec``) and each item read once: an item whose key is in
    ``keys`` is converted by ``keys[key](value_text)``, every other item is the recipe's.

    Args:
      spec: ``NAME`` or ``NAME(key=value, ...)``.
      keys: the caller's keys and their converters; a converter takes the value's text and
        returns the value or raises ``ValueError`` saying what the key takes (``"last_bf16
        is an int >= -1"``).
      label: what the caller's keys are called in the message of an unknown key.

    Returns:
      The ``RunSpec``: the recipe, the spec without the caller's keys and their values.

    Raises:
      TypeError: ``spec`` is not a string.
      ValueError: a malformed spec, an unknown recipe or key (listing the valid ones, the
        caller's under ``label``), a bad value, or a caller's key given twice; the message
        names the spec.
    """
    if not isinstance(spec, str):
        raise TypeError(f"recipe spec must be a string, got {type(spec).__name__}")
    keys = keys or {}
    text = spec.strip()
    name, items = split_spec(text)
    keep: list[str] = []
    extra: dict[str, Any] = {}
    for item in items:
        key, eq, val = item.partition("=")
        key = key.strip()
        if eq and key in keys:
            if key in extra:
                raise ValueError(f"recipe spec {spec!r}: {key} given twice")
            try:
                extra[key] = keys[key](val.strip())
            except ValueError as e:
                raise ValueError(f"recipe spec {spec!r}: {key}={val.strip()}: {e}") from None
        else:
            keep.append(item)
    base = name + (f"({', '.join(keep)})" if keep else "")
    shown = spec if items else text
    recipe = _spec_recipe(name, shown)
    more = f"; {label}: {list(keys)}" if keys else ""
    return RunSpec(text=text, base=base, recipe=_apply_items(recipe, keep, shown, more),
                   extra=extra)


def _format_spec(fmt: BlockFormat | None) -> str:
    """A format in a spec: its name when it is a named format, else ``BlockFormat(...)``
    with its name and every field that differs from the default."""
    if fmt is None:
        return "None"
    if fmt.name in FORMATS and FORMATS[fmt.name] == fmt:
        return fmt.name
    args = ", ".join(f"{f.name}={getattr(fmt, f.name)!r}" for f in dataclasses.fields(fmt)
                     if f.name == "name" or getattr(fmt, f.name) != f.default)
    return f"BlockFormat({args})"


def _value_spec(key: str, value: Any) -> str:
    if key.endswith("fmt"):
        return _format_spec(value)
    if key.endswith("block_scale_rule") and isinstance(value, str) and _RULE_RE.match(value):
        return value
    if isinstance(value, str) and _NAME_RE.match(value) and value not in (
            "True", "False", "None"):
        return value
    return repr(value)


def spec(recipe: Recipe | str) -> str:
    """The spec string of a recipe, the inverse of ``parse``: its base name (its own name
    when that is a named recipe, else ``bf16``) and the dotted overrides where it differs,
    so ``parse(spec(r)) == r`` for every recipe. ``spec(nvfp4().replace(sr=False))`` is
    ``"nvfp4(dgrad.lhs.rounding=nearest, wgrad.rhs.rounding=nearest)"``."""
    r = parse(recipe)
    base_name = r.name if r.name in _NAMED else "bf16"
    base = get(base_name)
    items = []
    # one format for every quantized operand, where the base quantizes the same ones: fmt=
    quant = [q for g in r.gemms.values() for q in (g.lhs, g.rhs) if q.quantized]
    fmts = {q.fmt for q in quant}
    same_set = [q.quantized for g in r.gemms.values() for q in (g.lhs, g.rhs)] == [
        q.quantized for g in base.gemms.values() for q in (g.lhs, g.rhs)]
    if len(fmts) == 1 and same_set and quant:
        fmt = fmts.pop()
        if any(q.fmt != fmt for g in base.gemms.values() for q in (g.lhs, g.rhs)
               if q.quantized):
            base = base.replace(fmt=fmt)
            items.append(f"fmt={_format_spec(fmt)}")
    if r.name != base.name:
        items.append(f"name={r.name!r}")
    if r.amax_scope != base.amax_scope:
        items.append(f"amax_scope={r.amax_scope}")
    for gname in ("fprop", "dgrad", "wgrad"):
        g, bg = getattr(r, gname), getattr(base, gname)
        for k in _GEMM_KEYS:
            if getattr(g, k) != getattr(bg, k):
                items.append(f"{gname}.{k}={_value_spec(k, getattr(g, k))}")
        for o in ("lhs", "rhs"):
            q, bq = getattr(g, o), getattr(bg, o)
            for k in _QUANT_KEYS:
                if getattr(q, k) != getattr(bq, k):
                    items.append(f"{gname}.{o}.{k}={_value_spec(k, getattr(q, k))}")
    return base_name + (f"({', '.join(items)})" if items else "")


# ---------------------------------------------------------------------------
# Attention recipes: the two batched products of an attention layer.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AttentionRecipe:
    """How the two products of an attention layer are quantized (``fp4jax.attention``):
    one ``Recipe`` per product, its operands in the roles a linear layer's have
    (``x``: the left operand, ``w``: the right one, ``dy``: the product's output gradient).

    * ``qk``: ``S = q @ k.T`` (x = q, w = k; fprop contracts the head dim ``hd``; dgrad
      ``dq = dS @ k`` contracts the keys; wgrad ``dk = dS.T @ q`` contracts the queries).
    * ``pv``: ``O = P @ v`` with ``P = softmax(S)`` (x = P, w = v; fprop contracts the keys;
      dgrad ``dP = dO @ v.T`` contracts ``hd``; wgrad ``dv = P.T @ dO`` the queries).

    Each operand's format, block scaling (1D blocks along that GEMM's contraction axis, or
    2D tiles), rounding and RHT are the ``QuantSpec``/``GemmSpec`` data of its recipe, as in
    ``fp4jax.dot``; ``P``, in [0, 1], is quantized with its own tensor and block scales.

    Attributes:
      name: display name (``attn_...``; the names ``get_attention`` knows).
      qk, pv: the products' recipes (``Recipe`` or a recipe name/spec).
    """

    name: str
    qk: Recipe
    pv: Recipe

    def __post_init__(self) -> None:
        for f in ("qk", "pv"):
            v = getattr(self, f)
            if isinstance(v, str):
                object.__setattr__(self, f, get(v))
            elif not isinstance(v, Recipe):
                raise TypeError(f"AttentionRecipe.{f} must be a fp4jax.Recipe or a recipe "
                                f"name, got {type(v).__name__} {v!r}")
            if getattr(self, f).needs_layer_key:
                raise ValueError(f"AttentionRecipe.{f} ({getattr(self, f).name!r}) draws its "
                                 "RHT signs per layer (hadamard_signs='layer'): attention "
                                 "has no per-layer key; use None, an int seed, 'random' or "
                                 "'ones'")

    @property
    def needs_key(self) -> bool:
        """Whether either product draws random bits (stochastic rounding, random RHT)."""
        return self.qk.needs_key or self.pv.needs_key

    @property
    def quantized(self) -> bool:
        """Whether any operand of either product is quantized."""
        return self.qk.quantized or self.pv.quantized

    def replace(self, **changes: Any) -> AttentionRecipe:
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """A multi-line table: each product's six quantization points."""
        return "\n".join([f"attention recipe {self.name}",
                          "  qk (S = q k^T): x = q, w = k, dy = dS",
                          *("  " + line for line in self.qk.describe().splitlines()[1:]),
                          "  pv (O = P v): x = P, w = v, dy = dO",
                          *("  " + line for line in self.pv.describe().splitlines()[1:])])


def _attn_fwd_only(name: str, fmt: BlockFormat) -> AttentionRecipe:
    fwd = GemmSpec(lhs=_rtn(fmt), rhs=_rtn(fmt))
    r = Recipe(name=name, fprop=fwd, dgrad=GemmSpec(), wgrad=GemmSpec())
    return AttentionRecipe(name, qk=r, pv=r)


def attn_nvfp4() -> AttentionRecipe:
    """FP4 attention forward, high-precision backward: the Attn-QAT setting (Zhang et al.,
    2026, "Attn-QAT: 4-Bit Attention With Quantization-Aware Training", arXiv 2603.00040;
    reference code hao-ai-lab/FastVideo ``fastvideo-kernel/python/fastvideo_kernel/
    triton_kernels/attn_qat_train.py`` and ``tests/qat_forward_reference.py``).

    Forward: q, k, P and v in NVFP4 (E2M1, E4M3 scales of 1x16 blocks along each product's
    contraction axis: ``hd`` for q and k, the keys for P and v; FP32 tensor scale),
    round to nearest. Backward: the four products ``dq, dk, dv, dP`` in high precision
    (their operands unquantized: a straight-through estimator), softmax and its gradient in
    float32.

    What Attn-QAT does and fp4jax does not (fp4jax composes two ``fp4jax.dot_general``
    calls, XLA only): their fused kernel quantizes v along ``hd`` (the Triton emulation's
    layout; a native FP4 ``P @ v`` needs blocks along the keys, fp4jax's choice), quantizes
    the unnormalized probabilities ``exp(s - m)`` per key tile with E4M3 block scales only
    (fp4jax: the normalized ``P`` with a tensor scale), and runs the backward's GEMMs on
    the forward's fake-quantized q, k, v (and the re-quantized P for ``dv``), where fp4jax's
    high-precision backward uses the unquantized tensors. Their second principle (the
    softmax gradient's row sum from the high-precision output ``P v``, not the quantized
    one) is what autodiff of fp4jax's composition computes:
    ``dS = P * (dP - rowsum(P * dP))``.
    """
    return _attn_fwd_only("attn_nvfp4", NVFP4)


def attn_mxfp4() -> AttentionRecipe:
    """``attn_nvfp4`` with MXFP4 (E2M1, E8M0 scales of 1x32 blocks, no tensor scale):
    forward q, k, P, v round to nearest, high-precision backward."""
    return _attn_fwd_only("attn_mxfp4", MXFP4)


def attn_nvfp4_all() -> AttentionRecipe:
    """The NVFP4 training recipe (``nvfp4()``: NVIDIA, arXiv 2509.25149, sec. 4) on both
    attention products, forward and backward, with 1D blocks on every operand (k and v are
    activations, not weights: no 16x16 tiles): forward q, k, P, v round to nearest; dgrad
    dS/dO with stochastic rounding, k/v round to nearest; wgrad a 16-point RHT along the
    queries, q/P round to nearest, dS/dO stochastic. fp4jax's own composition (no paper
    quantizes attention's backward this way); needs a key."""
    r = nvfp4().replace(block_2d=False, name="attn_nvfp4_all")
    return AttentionRecipe("attn_nvfp4_all", qk=r, pv=r)


def attn_bf16() -> AttentionRecipe:
    """No quantization (``bf16()`` on both products): the attention's plain bits."""
    return AttentionRecipe("attn_bf16", qk=bf16(), pv=bf16())


_ATTENTION: dict[str, Callable[[], AttentionRecipe]] = {
    "attn_nvfp4": attn_nvfp4,
    "attn_mxfp4": attn_mxfp4,
    "attn_nvfp4_all": attn_nvfp4_all,
    "attn_bf16": attn_bf16,
}


def attention_names() -> list[str]:
    """Names accepted by ``get_attention``."""
    return sorted(_ATTENTION)


def get_attention(name: str | AttentionRecipe | Recipe) -> AttentionRecipe:
    """An attention recipe: itself, a named one (``attention_names()``), or a linear
    recipe (a ``Recipe``, name or spec: ``get``) applied to both products alike.

    Raises:
      ValueError: an unknown name (listing the attention names and ``names()``).
    """
    if isinstance(name, AttentionRecipe):
        return name
    if isinstance(name, Recipe):
        return AttentionRecipe(name.name, qk=name, pv=name)
    if isinstance(name, str):
        key = name.strip().lower().replace("-", "_")
        if key in _ATTENTION:
            return _ATTENTION[key]()
        try:
            r = get(name)
        except ValueError:
            raise ValueError(f"unknown attention recipe {name!r}; valid names: "
                             f"{attention_names()}, or a linear recipe for both products "
                             f"({names()} or a spec)") from None
        return AttentionRecipe(r.name, qk=r, pv=r)
    raise TypeError(f"attention recipe must be a fp4jax.recipes.AttentionRecipe, a Recipe or "
                    f"a name, got {type(name).__name__} {name!r}")


def recipe_quantizes(recipe: Recipe | AttentionRecipe | None) -> bool:
    """Whether ``recipe`` quantizes anything: the one predicate of fp4jax for "does this
    layer's recipe quantize?" (precision rules, policies, the training harness's counts).

    ``None`` (a high-precision layer: its own ``dot_general``, untouched) and a recipe
    whose every GEMM operand is unquantized (``bf16()``, a ``switched`` ``"both"``) do not;
    a ``Recipe`` or ``AttentionRecipe`` quantizing any operand does (their ``quantized``).
    An object without ``quantized`` quantizes unless it is named ``"bf16"``.
    """
    if recipe is None:
        return False
    quantized = getattr(recipe, "quantized", None)
    return bool(quantized) if quantized is not None else getattr(recipe, "name", "") != "bf16"
