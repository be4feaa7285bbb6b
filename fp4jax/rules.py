"""Precision rules by module path: which linear layers of a model run in which recipe.

A :class:`Rule` pairs a regular expression with a recipe::

    rules = [fp4jax.nn.Rule(r".*(embed|logits|lm_head).*", None),   # None: high precision
             fp4jax.nn.Rule(r"decoder/block_(0|11)/.*", None),
             fp4jax.nn.Rule(r".*", "nvfp4")]                          # a Recipe or a spec

The pattern is matched with ``re.fullmatch`` against the layer's module path joined by ``/``
(linen: ``Module.path``, e.g. ``"decoder/block_0/attn/query"``; NNX: the attribute path from
the root, list indices included, e.g. ``"blocks/3/mlp/up"``); the first rule that matches
decides; a layer no rule matches runs unchanged. ``recipe`` is a ``fp4jax.Recipe``, a spec
string (``fp4jax.recipes.parse``: ``"nvfp4"``, ``"nvfp4(sr=False)"``), or ``None`` (or the
string ``"none"``): the layer's own ``dot_general`` runs untouched, bit for bit the
unquantized model. ``fp4jax.nn.quantize_model`` applies rules to a model,
:func:`load_rules` reads them from a JSON or TOML file (``fp4jax-train --rules FILE``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax.recipes import (
    AttentionRecipe,
    Recipe,
    attention_names,
    get_attention,
    parse,
    recipe_quantizes,
)

__all__ = ["Rule", "as_rules", "block_paths", "block_rule", "einsum_dimension_numbers",
           "high_precision_rules", "layer_key", "sub_jaxprs", "load_rules", "match_rule",
           "match_rule_in_stack", "replace_quantizing", "rule_recipe", "rules_quantize"]

_NONE_SPECS = ("none", "high", "high_precision")


def _recipe_of(recipe: Any, what: str) -> Recipe | AttentionRecipe | None:
    """``recipe`` as a ``Recipe`` (a spec string parsed), an ``AttentionRecipe`` (one, or
    the name of one: ``fp4jax.recipes.attention_names()``) or ``None``; ValueError naming
    ``what`` otherwise."""
    if recipe is None or isinstance(recipe, (Recipe, AttentionRecipe)):
        return recipe
    if isinstance(recipe, str):
        if recipe.strip().lower() in _NONE_SPECS:
            return None
        if recipe.strip().lower().replace("-", "_") in attention_names():
            return get_attention(recipe)
        try:
            return parse(recipe)
        except ValueError as e:
            raise ValueError(f"{what}: bad recipe spec {recipe!r}: {e}") from None
    raise ValueError(f"{what}: recipe must be a fp4jax.Recipe, a spec string such as "
                     f"'nvfp4', an attention recipe (fp4jax.recipes.AttentionRecipe or one "
                     f"of {attention_names()}) or None (high precision), got "
                     f"{type(recipe).__name__} {recipe!r}")


@dataclasses.dataclass(frozen=True)
class Rule:
    """One precision rule: layers whose module path ``re.fullmatch``-es ``pattern`` run in
    ``recipe``.

    Attributes:
      pattern: a Python regular expression, matched in full against the layer's module
        path joined by ``/`` (``"decoder/block_0/attn/query"``).
      recipe: a ``fp4jax.Recipe``; a spec string (``fp4jax.recipes.parse``, e.g.
        ``"nvfp4(sr=False)"``) is parsed on construction; ``None`` (or ``"none"``) keeps
        the layer's own, unquantized ``dot_general``. Or an attention recipe
        (``fp4jax.recipes.AttentionRecipe``, or its name such as ``"attn_nvfp4"``): an
        *attention rule*, which applies to attention sites only (``fp4jax.attention`` in a
        model that has them: the built-in Llama's ``block_{i}/attn``), never to a linear
        layer; linear rules never apply to attention sites, so attention stays in high
        precision unless an attention rule matches it (``match_rule``'s ``attention``).

    Raises:
      ValueError: a pattern that is not a string or not a valid regular expression, or a
        recipe that is not a Recipe, a valid spec or None.
    """

    pattern: str
    recipe: Recipe | AttentionRecipe | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str):
            raise ValueError(f"Rule: pattern must be a regular expression string, got "
                             f"{type(self.pattern).__name__} {self.pattern!r}")
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ValueError(f"Rule: pattern {self.pattern!r} is not a valid regular "
                             f"expression: {e}") from None
        object.__setattr__(self, "recipe",
                           _recipe_of(self.recipe, f"Rule({self.pattern!r}, ...)"))

    def __repr__(self) -> str:
        return f"Rule({self.pattern!r}, {self.spec!r})"

    def matches(self, path: str) -> bool:
        """Whether ``re.fullmatch(self.pattern, path)``."""
        return re.fullmatch(self.pattern, path) is not None

    @property
    def attention(self) -> bool:
        """Whether this is an attention rule (its recipe an ``AttentionRecipe``)."""
        return isinstance(self.recipe, AttentionRecipe)

    @property
    def spec(self) -> str:
        """The recipe's name (``"none"`` for high precision), for tables and logs."""
        return "none" if self.recipe is None else self.recipe.name


def as_rules(rules: Any, what: str = "rules") -> tuple[Rule, ...]:
    """``rules`` as a tuple of :class:`Rule`: a sequence whose entries are ``Rule``,
    ``(pattern, recipe)`` pairs or ``{"pattern": ..., "recipe": ...}`` mappings (a single
    ``Rule`` is accepted too).

    Raises:
      ValueError: naming ``what`` and the bad entry's index.
    """
    if isinstance(rules, Rule):
        return (rules,)
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Iterable):
        raise ValueError(f"{what} must be a list of fp4jax.nn.Rule (or (pattern, recipe) "
                         f"pairs), got {type(rules).__name__} {rules!r}")
    out = []
    for i, r in enumerate(rules):
        out.append(_one_rule(r, f"{what}[{i}]"))
    return tuple(out)


def _one_rule(r: Any, what: str) -> Rule:
    if isinstance(r, Rule):
        return r
    if isinstance(r, dict):
        if set(r) != {"pattern", "recipe"}:  # a missing recipe is not high precision
            raise ValueError(f"{what}: a rule mapping needs the keys 'pattern' and 'recipe' "
                             f"(recipe may be null/'none'), got keys {sorted(r)}")
        pattern, recipe = r["pattern"], r["recipe"]
    elif isinstance(r, (list, tuple)) and len(r) == 2:
        pattern, recipe = r
    else:
        raise ValueError(f"{what}: expected a Rule, a [pattern, recipe] pair or a "
                         f"{{pattern, recipe}} mapping, got {r!r}")
    try:
        return Rule(pattern, recipe)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


def match_rule(rules: Sequence[Rule], path: str, attention: bool = False) -> int | None:
    """The index of the first rule of ``rules`` whose pattern ``re.fullmatch``-es
    ``path``, or None. Linear layers (``attention=False``) see only the linear rules,
    attention sites (``attention=True``) only the attention rules (``Rule.attention``)."""
    for i, r in enumerate(rules):
        if r.attention == attention and r.matches(path):
            return i
    return None


def rule_recipe(rules: Sequence[Rule], path: str) -> Recipe | None:
    """The recipe that ``rules`` give the linear layer at ``path``: the first linear rule
    matching it (``match_rule``); None (high precision, the layer unchanged) when none
    does or that rule's recipe is None."""
    i = match_rule(rules, path)
    return None if i is None else rules[i].recipe


def rules_quantize(rules: Sequence[Rule]) -> bool:
    """Whether a rule of ``rules`` has a recipe that quantizes (``recipe_quantizes``):
    else a model under ``rules`` runs bit for bit as the unquantized one."""
    return any(recipe_quantizes(r.recipe) for r in rules)


def high_precision_rules(paths: Iterable[str]) -> tuple[Rule, ...]:
    """One high-precision rule per module path of ``paths``, matching that path exactly
    (``Rule(re.escape(path), None)``): layers named one by one (``--bf16-layers``)."""
    return tuple(Rule(re.escape(p), None) for p in paths)


def block_rule(prefix: str, blocks: Iterable[int], recipe: Any = None) -> Rule | None:
    """The rule giving ``recipe`` (default None: high precision) to every layer of the
    blocks ``blocks`` of a stack whose block ``i`` sits at the module path ``prefix + str(i)``
    (``"layers_"``, ``"layers/"``): ``Rule(re.escape(prefix) + "(0|1|11)/.*", recipe)``, the
    indices in the order given. None when ``blocks`` is empty."""
    idx = list(blocks)
    if not idx:
        return None
    return Rule(re.escape(prefix) + "(" + "|".join(map(str, idx)) + ")/.*", recipe)


def replace_quantizing(rules: Sequence[Rule], fn: Callable[[Recipe], Recipe | None]
                       ) -> tuple[Rule, ...]:
    """``rules`` with the recipe ``r`` of each linear rule that quantizes
    (``recipe_quantizes``) replaced by ``fn(r)`` (a precision switch, e.g.
    ``fp4jax.train.config.switched_recipe``); the other rules (high precision, attention
    rules) unchanged, the same ``Rule`` objects."""
    return tuple(Rule(r.pattern, fn(r.recipe))
                 if not r.attention and recipe_quantizes(r.recipe) else r for r in rules)


def block_paths(path: str, stack: str, index: int) -> str:
    """The path of the layer at module path ``path`` in block ``index`` of the stack at
    ``stack`` (a prefix of ``path``: a scanned module's path): the index inserted as a
    path component after ``stack``, as NNX names list items (``block_paths(
    "decoder/blocks/attn/query", "decoder/blocks", 3) == "decoder/blocks/3/attn/query"``).
    """
    return f"{stack}/{index}{path[len(stack):]}"


def match_rule_in_stack(rules: Sequence[Rule], path: str, stacks: Sequence[tuple[str, int]]
                        ) -> int | None:
    """The rule of the layer at ``path`` that runs once per block of stacked (scanned)
    blocks: ``stacks`` lists ``(stack path, number of blocks)`` for each stack around it
    (``path`` starts with each stack path; none: ``match_rule``).

    A rule applies to block ``i`` of a stack when its pattern matches the stack's own path
    ``path`` (one rule for every block, as an unstacked layer) or the block's path
    ``block_paths(path, stack, i)`` (``"decoder/blocks/3/attn/query"``); each block takes
    the first rule that applies. One traced body runs every block of a stack, so the
    blocks must agree on the recipe: the first block's rule is returned.

    Raises:
      ValueError: the blocks of a stack get different recipes (naming the layer, the rules
        and their blocks, and the fix: unroll those blocks, or one recipe per stack).
    """
    first = match_rule(rules, path)
    for stack, n in stacks:
        per_block = []
        for i in range(n):
            bp = block_paths(path, stack, i)
            per_block.append(next((j for j, r in enumerate(rules) if not r.attention
                                   and (r.matches(path) or r.matches(bp))), None))
        recipes = {None if j is None else rules[j].recipe for j in per_block}
        if len(recipes) > 1:
            groups: dict[int | None, list[int]] = {}
            for i, j in enumerate(per_block):
                groups.setdefault(j, []).append(i)
            every = re.escape(stack) + r"/\d+" + re.escape(path[len(stack):])
            said = "; ".join(
                (f"blocks {_span(b)} no rule (unchanged)" if j is None else
                 f"blocks {_span(b)} rule [{j}] {rules[j].pattern!r} -> {rules[j].spec}")
                for j, b in groups.items())
            raise ValueError(
                f"fp4jax.nn.quantize_model: the layer {path!r} runs in a scanned stack of {n} "
                f"blocks at {stack!r} (one traced body, one recipe), but the rules give its "
                f"blocks different recipes: {said}. Unroll the blocks that differ around a "
                f"scan of the others (e.g. the first and last blocks as their own modules, as "
                f"fp4jax's Llama scans runs of blocks with equal recipes), or give every block "
                f"of the stack the same recipe (a rule on {path!r} or {every!r})")
        first = per_block[0] if per_block else first
    return first


def _span(blocks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out, start = [], None
    for k, b in enumerate(blocks):
        if start is None:
            start = b
        if k + 1 == len(blocks) or blocks[k + 1] != b + 1:
            out.append(str(start) if start == b else f"{start}-{b}")
            start = None
    return ",".join(out)


def load_rules(path: str | os.PathLike) -> list[Rule]:
    """Reads precision rules from a JSON or TOML file (by its suffix; ``.toml`` is TOML,
    anything else JSON).

    JSON: a list of ``{"pattern": ..., "recipe": ...}`` objects or ``[pattern, recipe]``
    pairs, or an object ``{"rules": [...]}``; ``"recipe": null`` is high precision. TOML:
    ``rules = [[pattern, recipe], ...]`` or ``[[rules]]`` tables with ``pattern`` and
    ``recipe`` keys (TOML has no null: write ``"none"``)::

        [[rules]]
        pattern = ".*(embed|lm_head).*"
        recipe = "none"
        [[rules]]
        pattern = ".*"
        recipe = "nvfp4(sr=False)"

    Raises:
      ValueError: the file does not parse, or an entry is not a valid rule (naming the file
        and the entry's index).
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ValueError(f"load_rules: cannot read {path!r}: {e}") from None
    try:
        if path.lower().endswith(".toml"):
            import tomllib

            data: Any = tomllib.loads(raw.decode("utf-8"))
        else:
            data = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        kind = "TOML" if path.lower().endswith(".toml") else "JSON"
        raise ValueError(f"load_rules: {path}: not valid {kind}: {e}") from None
    if isinstance(data, dict):
        if "rules" not in data:
            raise ValueError(f"load_rules: {path}: expected a list of rules or a 'rules' key, "
                             f"got keys {sorted(data)}")
        data = data["rules"]
    if not isinstance(data, list):
        raise ValueError(f"load_rules: {path}: the rules must be a list, got "
                         f"{type(data).__name__}")
    return list(as_rules(data, f"{path}: rules"))


def layer_key(key: jax.Array, path: str) -> jax.Array:
    """``jax.random.fold_in(key, crc32(path))``: the key of the layer at module path
    ``path`` derived from a model-wide ``key`` (what ``quantize_model`` gives each NNX layer
    for its stochastic-rounding stream and its per-layer RHT signs)."""
    return jax.random.fold_in(key, zlib.crc32(path.encode("utf-8")) & 0x7FFFFFFF)


def einsum_dimension_numbers(subscripts: str, lhs_ndim: int, rhs_ndim: int
                             ) -> tuple[Any, tuple[int, ...]] | None:
    """The ``lax.dot_general`` form of a two-operand einsum: ``(dimension_numbers, perm)``
    with ``jnp.einsum(subscripts, a, b) == jnp.transpose(lax.dot_general(a, b,
    dimension_numbers), perm)``, or None where it has none (an index repeated within one
    operand, an index summed that appears in one operand only, not two operands).

    Letters in both operands and the output are batch dimensions, in both operands only
    contracted, in one operand and the output free; ``...`` is expanded from the ranks.
    """
    s = subscripts.replace(" ", "")
    if "->" not in s:  # implicit output: letters seen once, sorted (numpy's rule)
        ins = s
        letters = [c for c in s if c.isalpha()]
        out = ("..." if "..." in s else "") + "".join(
            sorted(c for c in set(letters) if letters.count(c) == 1))
    else:
        ins, out = s.split("->")
    parts = ins.split(",")
    if len(parts) != 2:
        return None
    terms = []
    for p, nd in zip(parts, (lhs_ndim, rhs_ndim), strict=True):
        t = _expand(p, nd)
        if t is None:
            return None
        terms.append(t)
    a, b = terms
    n_ell = max(sum(c.isdigit() for c in t) for t in terms)
    o = _expand(out, n_ell + len(out.replace("...", "")) if "..." in out else len(out))
    if o is None or len(set(a)) != len(a) or len(set(b)) != len(b) or len(set(o)) != len(o):
        return None
    if any(c not in a and c not in b for c in o):
        return None
    batch = [c for c in a if c in b and c in o]
    contract = [c for c in a if c in b and c not in o]
    if any((c in a) != (c in b) and c not in o for c in a + b):
        return None  # summed over one operand only
    lfree = [c for c in a if c not in b]
    rfree = [c for c in b if c not in a]
    dims = ((tuple(a.index(c) for c in contract), tuple(b.index(c) for c in contract)),
            (tuple(a.index(c) for c in batch), tuple(b.index(c) for c in batch)))
    got = batch + lfree + rfree
    if sorted(got) != sorted(o):
        return None
    return dims, tuple(got.index(c) for c in o)


def _expand(term: str, ndim: int) -> list[str] | None:
    """The letters of one einsum term, ``...`` expanded to ``ndim`` (placeholder letters
    ``0``, ``1``, ... for the broadcast dims, aligned from the right as numpy does)."""
    if "..." not in term:
        return list(term) if len(term) == ndim and all(c.isalpha() for c in term) else None
    head, _, tail = term.partition("...")
    if "..." in tail or not all(c.isalpha() for c in head + tail):
        return None
    n = ndim - len(head) - len(tail)
    if n < 0:
        return None
    return [*head, *(str(9 - (n - 1 - i)) for i in range(n)), *tail]


def weight_dot_general(dot: Any, lhs: Any, rhs: Any, dimension_numbers: Any,
                       weight_is_lhs: bool, precision: Any = None,
                       preferred_element_type: Any = None) -> jax.Array:
    """``lax.dot_general(lhs, rhs, dimension_numbers)`` computed by ``dot`` (a
    ``fp4jax.dot_general``-like callable ``dot(x, w, dn, precision, preferred_element_type,
    out_sharding)``) with the weight as the RHS, the recipe's weight role: the operands are
    transposed and reshaped to ``x (B.., ..., K) @ w (B.., K, N)`` (every contracted axis
    flattened into K, every free weight axis into N, batch axes leading) and the output put
    back in ``lax.dot_general``'s order (batch, lhs free, rhs free).

    Args:
      dot: the quantized product of the reshaped operands.
      lhs, rhs: ``lax.dot_general``'s operands; the weight is ``lhs`` if ``weight_is_lhs``.
      dimension_numbers: ``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))``.
    Returns:
      the product, shaped as ``lax.dot_general(lhs, rhs, dimension_numbers)``.
    """
    (lc, rc), (lb, rb) = dimension_numbers
    nl, nr = jnp.ndim(lhs), jnp.ndim(rhs)
    lc, rc = tuple(d % nl for d in lc), tuple(d % nr for d in rc)
    lb, rb = tuple(d % nl for d in lb), tuple(d % nr for d in rb)
    if weight_is_lhs:  # the activation becomes the LHS
        lhs, rhs, lc, rc, lb, rb, nl, nr = rhs, lhs, rc, lc, rb, lb, nr, nl
    x, w = jnp.asarray(lhs), jnp.asarray(rhs)
    xfree = [d for d in range(nl) if d not in lc + lb]
    wfree = [d for d in range(nr) if d not in rc + rb]
    bshape = [x.shape[d] for d in lb]
    xfs, wfs = [x.shape[d] for d in xfree], [w.shape[d] for d in wfree]
    K = int(np.prod([x.shape[d] for d in lc]))
    N = int(np.prod(wfs))
    nb = len(lb)
    x2 = jnp.transpose(x, [*lb, *xfree, *lc]).reshape(*bshape, *xfs, K)
    w2 = jnp.transpose(w, [*rb, *rc, *wfree]).reshape(*bshape, K, N)
    dn = (((x2.ndim - 1,), (nb,)), (tuple(range(nb)), tuple(range(nb))))
    y = dot(x2, w2, dn, precision, preferred_element_type, None)
    y = y.reshape(*bshape, *xfs, *wfs)
    if weight_is_lhs:  # lax order: batch, weight free, activation free
        nx = len(xfs)
        y = jnp.transpose(y, [*range(nb), *range(nb + nx, nb + nx + len(wfs)),
                              *range(nb, nb + nx)])
    return y


def sub_jaxprs(eqn: Any) -> list[Any]:
    """The open jaxprs a traced equation holds (``pjit``, ``scan``, ``cond``'s branches,
    ``remat``, custom derivatives): for the walks of ``report`` and ``function_report``."""
    out = []
    for v in eqn.params.values():
        for sub in (v if isinstance(v, (list, tuple)) else [v]):
            inner = getattr(sub, "jaxpr", None)
            if inner is not None and hasattr(inner, "eqns"):
                out.append(inner)
            elif hasattr(sub, "eqns"):
                out.append(sub)
    return out
