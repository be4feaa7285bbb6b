"""Product taps (fp4jax.nn.taps): a linen DotGeneral runs its taps around the product, in
order, with the layer's own keys; a tap that observes changes no bit; a tap can replace the
product; a scanned Llama carries a tap's collections per block; bad taps are refused with
the argument named."""

import dataclasses
import functools
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, traverse_util

import fp4jax
from fp4jax.models.llama import get_preset, quantized_llama
from fp4jax.nn import linen as fnn
from fp4jax.nn import taps as T
from tests.checks import bits_equal

K, N = 64, 32
SEEN = "test_seen"


@dataclasses.dataclass(frozen=True)
class Seen:
    """Observes: sows the layer's lhs amax and whether its recipe quantizes."""

    collections: ClassVar[tuple[str, ...]] = (SEEN,)

    def __call__(self, call, scope, compute):
        y = compute()
        if not scope.is_initializing() and scope.is_mutable_collection(SEEN):
            scope.sow(SEEN, "amax", jnp.max(jnp.abs(call.lhs.astype(jnp.float32))))
            scope.sow(SEEN, "quantized", jnp.asarray(call.quantized))
        return y


@dataclasses.dataclass(frozen=True)
class Order:
    """Appends its tag to a host-side log before and after the rest of the chain."""

    tag: str
    collections: ClassVar[tuple[str, ...]] = ()

    def __call__(self, call, scope, compute):
        LOG.append(f"{self.tag}<")
        y = compute()
        LOG.append(f">{self.tag}")
        return y


@dataclasses.dataclass(frozen=True)
class Zero:
    """Replaces the product by zeros (the rest of the chain does not run)."""

    collections: ClassVar[tuple[str, ...]] = ()

    def __call__(self, call, scope, compute):
        LOG.append("zero")
        shape = jax.eval_shape(lambda: jax.lax.dot_general(
            call.lhs, call.rhs, call.dimension_numbers)).shape
        return jnp.zeros(shape, call.preferred_element_type or call.lhs.dtype)


LOG: list[str] = []


def _dense(taps=T.DEFAULT_TAPS):
    return nn.Dense(N, use_bias=False, dtype=jnp.bfloat16, dot_general_cls=functools.partial(
        fnn.DotGeneral, recipe="nvfp4", taps=taps))


def _x():
    return jnp.asarray(np.random.default_rng(0).standard_normal((2, 8, K)), jnp.bfloat16)


def test_observing_tap_sows_and_changes_no_bit():
    x, rngs = _x(), {"fp4": jax.random.key(1)}
    plain = _dense()
    params = plain.init(jax.random.key(0), x)
    y0 = plain.apply(params, x, rngs=rngs)
    tapped = _dense((*T.DEFAULT_TAPS, Seen()))
    y1, state = tapped.apply(params, x, rngs=rngs, mutable=[SEEN])
    bits_equal(y1, y0)
    (amax,) = state[SEEN]["DotGeneral_0"]["amax"]
    assert float(amax) == float(jnp.max(jnp.abs(x.astype(jnp.float32))))
    assert bool(state[SEEN]["DotGeneral_0"]["quantized"][0])
    bits_equal(tapped.apply(params, x, rngs=rngs), y0)  # collection not mutable: inert


def test_taps_run_outermost_first_and_can_replace_the_product():
    x, rngs = _x(), {"fp4": jax.random.key(1)}
    params = _dense().init(jax.random.key(0), x)
    LOG.clear()
    _dense((Order("a"), Order("b"))).apply(params, x, rngs=rngs)
    assert LOG == ["a<", "b<", ">b", ">a"]
    LOG.clear()
    y = _dense((Order("a"), Zero(), Order("c"))).apply(params, x, rngs=rngs)
    assert LOG == ["a<", "zero", ">a"]  # "c" and the dot never ran
    assert y.shape == (2, 8, N) and not np.any(np.asarray(y, np.float32))


def test_quantize_model_passes_taps_to_every_quantized_layer():
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(K, name="down")(nn.relu(nn.Dense(2 * K, name="up")(x)))

    x, rngs = _x().astype(jnp.float32), {"fp4": jax.random.key(1)}
    rules = [("up", "nvfp4"), (".*", None)]
    base = fp4jax.nn.quantize_model(MLP(), rules)
    params = base.init(jax.random.key(0), x)
    q = fp4jax.nn.quantize_model(MLP(), rules, taps=(*T.DEFAULT_TAPS, Seen()))
    y, state = q.apply(params, x, rngs=rngs, mutable=[SEEN])
    bits_equal(y, base.apply(params, x, rngs=rngs))
    flat = traverse_util.flatten_dict(state[SEEN], sep="/")
    assert sorted(flat) == ["up/DotGeneral_0/amax", "up/DotGeneral_0/quantized"]


@pytest.mark.slow
def test_scanned_llama_carries_a_taps_collection_per_block():
    cfg = get_preset("micro").replace(scan_layers=True)
    rules = [(r"block_[0-9]+/.*", "nvfp4"), (".*", None)]
    model = quantized_llama(cfg, rules, taps=(*T.DEFAULT_TAPS, Seen()))
    tokens = jnp.arange(2 * 16, dtype=jnp.int32).reshape(2, 16) % 256
    params = model.init(jax.random.key(0), tokens)
    rngs = {"fp4": jax.random.key(1), "fp4_layer": jax.random.key(2)}
    y, state = model.apply(params, tokens, rngs=rngs, mutable=[SEEN])
    flat = traverse_util.flatten_dict(state[SEEN], sep="/")
    amaxes = {k: v for k, v in flat.items() if k.endswith("amax")}
    assert amaxes and all(v[0].shape == (cfg.n_layers,) for v in amaxes.values())
    bits_equal(y, quantized_llama(cfg, rules).apply(params, tokens, rngs=rngs))


def test_tap_collections_in_order_each_once():
    assert T.tap_collections((Seen(), T.StatsTap(), Seen())) == (
        SEEN, fnn.PERTURB_COLLECTION, fnn.COTANGENT_COLLECTION, fnn.STATS_COLLECTION)
    assert set(T.tap_collections(T.DEFAULT_TAPS)) >= {fnn.CHANNEL_NORM_COLLECTION,
                                                      fnn.OUTCONTROL_COLLECTION}


@pytest.mark.parametrize("taps, needle", [
    ([Seen()], None),                          # a list is taken
    (Seen(), "must be a tuple"),
    ((lambda call, scope, compute: compute(),), "taps[0]"),  # no collections
    ((Seen(), "x"), "taps[1]"),
])
def test_bad_taps_refused_naming_the_argument(taps, needle):
    class One(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(N, name="d")(x)

    if needle is None:
        fp4jax.nn.quantize_model(One(), [(".*", "nvfp4")], taps=taps)
        return
    with pytest.raises(ValueError, match="quantize_model") as e:
        fp4jax.nn.quantize_model(One(), [(".*", "nvfp4")], taps=taps)
    assert needle in str(e.value)


def test_nnx_refuses_taps():
    layer = nnx.Linear(K, N, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="taps are for linen"):
        fp4jax.nn.quantize_model(layer, [(".*", "nvfp4")], rngs=nnx.Rngs(fp4=1),
                                 taps=(*T.DEFAULT_TAPS, Seen()))


def test_setup_style_layer_refuses_other_taps():
    class Inner(nn.Module):  # setup-style: its product runs outside a compact method
        def setup(self):
            self.w = self.param("w", nn.initializers.lecun_normal(), (K, N))

        def __call__(self, x):
            return jnp.einsum("btk,kn->btn", x, self.w)

    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Inner(name="inner")(x)

    x, rngs = _x().astype(jnp.float32), {"fp4": jax.random.key(1)}
    ok = fp4jax.nn.quantize_model(Outer(), [(".*", "nvfp4")])
    params = ok.init(jax.random.key(0), x)
    y = ok.apply(params, x, rngs=rngs)
    rep = fp4jax.nn.report(ok, x)  # the default taps: the product is quantized
    assert [v["recipe"] for v in rep.layers.values()] == ["nvfp4"], rep.layers
    q = fp4jax.nn.quantize_model(Outer(), [(".*", "nvfp4")], taps=(*T.DEFAULT_TAPS, Seen()))
    with pytest.raises(ValueError, match="setup-style"):
        q.apply(params, x, rngs=rngs)
    assert y.shape == (2, 8, N)
