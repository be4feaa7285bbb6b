"""Layer precision policies: which linear layers of a model run in which recipe.

The NVIDIA NVFP4 paper (section 4) keeps embeddings, the LM head, norms, non-linearities and
attention (softmax, QK^T and score-V matmuls) in high precision and quantizes only the linear
layers of the transformer blocks, except a few blocks at both ends (the 12B model kept the first
2 and last 8 of 62 blocks in BF16, about 16% of the linear layers; the paper notes that ~15%,
mostly at the end, is enough). A :class:`PrecisionPolicy` states that choice as data.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from fp4jax.recipes import recipe_quantizes
from fp4jax.rules import Rule

__all__ = ["PrecisionPolicy", "recipe_quantizes"]  # recipe_quantizes: fp4jax.recipes'

if TYPE_CHECKING:  # pragma: no cover
    from fp4jax import Recipe


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    """Assigns a recipe to each linear layer of a stack of ``n_blocks`` transformer blocks.

    Attributes:
      recipe: the recipe of the quantized linear layers (e.g. ``fp4jax.recipes.nvfp4()``).
      first_high_precision: number of leading blocks whose linear layers stay high precision.
      last_high_precision: number of trailing blocks whose linear layers stay high precision.
      high_precision_layers: ``fnmatch`` patterns of layer names that stay high precision:
        a name inside a block (``"attn.o"``, ``"mlp.*"``) matches in every block; a pattern
        with a ``/`` is matched against the block-qualified name ``"block_{i}/{layer}"``
        (``"block_3/attn.q"``, ``"block_*/mlp.down"``), so one layer of one block can be
        named (what ``fp4jax-train --bf16-layers`` uses).
      high_precision: the recipe of high-precision linear layers; ``None`` means a plain
        ``jax.lax.dot_general`` in the layer's compute dtype (no fp4jax involvement).

    Layers outside the blocks (embeddings, LM head, norms, attention score/value matmuls) are
    always high precision; the LM head is counted as one high-precision linear layer.
    """

    recipe: Recipe | None
    first_high_precision: int = 0
    last_high_precision: int = 0
    high_precision_layers: tuple[str, ...] = ()
    high_precision: Recipe | None = None

    def __post_init__(self) -> None:
        if self.first_high_precision < 0 or self.last_high_precision < 0:
            raise ValueError(
                "first_high_precision and last_high_precision must be >= 0, got "
                f"{self.first_high_precision} and {self.last_high_precision}"
            )

    def replace(self, **changes) -> PrecisionPolicy:
        """Returns a copy with ``changes`` applied (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    def block_is_high_precision(self, block: int, n_blocks: int) -> bool:
        """Whether block ``block`` (0-based) of ``n_blocks`` is kept entirely high precision."""
        if not 0 <= block < n_blocks:
            raise ValueError(f"block index {block} out of range for {n_blocks} blocks")
        return block < self.first_high_precision or block >= n_blocks - self.last_high_precision

    def recipe_for(self, block: int, n_blocks: int, layer: str) -> Recipe | None:
        """The recipe of linear layer ``layer`` (e.g. ``"attn.q"``) in block ``block``."""
        if self.block_is_high_precision(block, n_blocks):
            return self.high_precision
        qualified = f"block_{block}/{layer}"
        if any(fnmatch.fnmatchcase(qualified if "/" in p else layer, p)
               for p in self.high_precision_layers):
            return self.high_precision
        if not recipe_quantizes(self.recipe):
            return self.recipe if self.recipe is not None else self.high_precision
        return self.recipe

    def rules(self, n_blocks: int, block: str = "block_{i}",
              layers: Mapping[str, str] | None = None) -> tuple[Rule, ...]:
        """The policy as precision rules (``fp4jax.rules.Rule``, the currency of
        ``fp4jax.nn.quantize_model`` and the training harness) for a model whose
        ``n_blocks`` transformer blocks sit at the module paths ``block.format(i=i)``.

        In order (the first match wins): the high-precision blocks (``block_0/.*``, ...)
        -> ``high_precision``; each ``high_precision_layers`` pattern -> ``high_precision``;
        every other layer inside a block -> ``recipe`` (``high_precision`` when ``recipe``
        is None). Layers outside the blocks match no rule and run unchanged (embeddings,
        LM head). For a block of ``n_blocks`` and a layer ``name``, the rules give
        ``recipe_for(i, n_blocks, name)``.

        Args:
          n_blocks: number of blocks.
          block: the blocks' module path with ``{i}`` for the index (``"block_{i}"``,
            ``"decoder/layers_{i}"``).
          layers: the policy's layer names (what ``high_precision_layers`` patterns
            match, e.g. ``"attn.q"``) -> module path inside a block (``"q"``,
            ``"attn/query"``). None: the patterns match the module paths inside a block
            themselves (``"attn/*"``). A block-qualified pattern ``"block_3/attn.q"``
            (``fnmatch`` on the index: ``"block_*/mlp.down"``) names the blocks by index.

        Raises:
          ValueError: ``block`` without ``{i}``, or ``n_blocks`` < 1.
        """
        if "{i}" not in block:
            raise ValueError(f"PrecisionPolicy.rules: block must contain '{{i}}' (the block "
                             f"index), got {block!r}")
        if not isinstance(n_blocks, int) or n_blocks < 1:
            raise ValueError(f"PrecisionPolicy.rules: n_blocks must be an int >= 1, got "
                             f"{n_blocks!r}")
        parts = [re.escape(p) for p in block.split("{i}")]

        def blocks(idx: Sequence[int]) -> str:
            return "(" + "|".join(str(i).join(parts) for i in idx) + ")"

        any_block = r"\d+".join(parts)
        out = []
        hp = [i for i in range(n_blocks) if self.block_is_high_precision(i, n_blocks)]
        if hp:
            out.append(Rule(blocks(hp) + "/.*", self.high_precision))
        for pat in self.high_precision_layers:
            m = re.fullmatch(r"block_([^/]*)/(.+)", pat)
            where = any_block
            if m:
                idx = [i for i in range(n_blocks) if fnmatch.fnmatchcase(str(i), m[1])]
                if not idx:
                    continue
                where, pat = blocks(idx), m[2]
            if layers is None:
                inner = fnmatch.translate(pat)
            else:
                names = [layers[n] for n in layers if fnmatch.fnmatchcase(n, pat)]
                if not names:
                    continue
                inner = "(" + "|".join(re.escape(n) for n in names) + ")"
            out.append(Rule(f"{where}/{inner}", self.high_precision))
        main = self.recipe if self.recipe is not None else self.high_precision
        out.append(Rule(any_block + "/.*", main))
        return tuple(out)

    def count(
        self, n_blocks: int, layers: Sequence[str], n_extra_high_precision: int = 1
    ) -> tuple[int, int]:
        """Counts ``(quantized, total)`` linear layers.

        Args:
          n_blocks: number of transformer blocks.
          layers: names of the linear layers inside one block.
          n_extra_high_precision: high-precision linear layers outside the blocks (1: LM head).
        """
        quantized = sum(
            recipe_quantizes(self.recipe_for(b, n_blocks, name))
            for b in range(n_blocks)
            for name in layers
        )
        return quantized, n_blocks * len(layers) + n_extra_high_precision

    def summary(
        self, n_blocks: int, layers: Sequence[str], n_extra_high_precision: int = 1
    ) -> str:
        """One line such as ``"112 of 132 linear layers in NVFP4 (85%); ..."``."""
        q, total = self.count(n_blocks, layers, n_extra_high_precision)
        name = (getattr(self.recipe, "name", None) or "high precision").upper()
        hp_blocks = [b for b in range(n_blocks) if self.block_is_high_precision(b, n_blocks)]
        parts = []
        if hp_blocks:
            parts.append(f"blocks {_ranges(hp_blocks)}")
        if self.high_precision_layers:
            parts.append("layers " + ",".join(self.high_precision_layers))
        if n_extra_high_precision:
            parts.append("lm_head")
        hp_name = getattr(self.high_precision, "name", "bf16").upper()
        if not recipe_quantizes(self.recipe):
            return f"0 of {total} linear layers quantized (recipe {name}: all high precision)"
        line = f"{q} of {total} linear layers in {name} ({100.0 * q / total:.0f}%)"
        if q < total:
            line += f"; {hp_name}: " + ", ".join(parts)
        return line


def _ranges(xs: Sequence[int]) -> str:
    out, start, prev = [], xs[0], xs[0]
    for x in list(xs[1:]) + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ",".join(out)
