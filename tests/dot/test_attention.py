"""``fp4jax.attention`` (issue 37 item 3): FP4 ``q k^T`` and ``P v`` under an attention
recipe, softmax in float32.

* the forward bit for bit against an independent NumPy composition (``tests/reference.py``'s
  quantizer per operand along each product's contraction axis, one tensor scale per
  sequence, float64 products, float32 softmax): head size and key count are one block, so
  every float32 accumulation is exact and the bits do not depend on summation order;
* the gradients against the recipe's backward written out in NumPy (float64): the
  straight-through high-precision backward of ``attn_nvfp4`` and an all-NVFP4
  round-to-nearest backward (``dv`` bit for bit);
* ``attn_bf16`` is the Llama's XLA attention bit for bit; causal and explicit masks
  (masked positions enter no scale); bad input errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import recipes
from fp4jax.models.llama import causal_attention
from tests import reference as ref
from tests.checks import bits_equal

F32 = np.float32
NV = dict()  # ref_quantize's defaults are NVFP4's
MX = dict(exp_bits=8, man_bits=0, block=32, tensor_scale=False, rule="up")


def _qkv(B, T, H, KV, hd, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, H, hd)) * 1.5
    k = rng.standard_normal((B, T, KV, hd))
    v = rng.standard_normal((B, T, KV, hd)) * 0.7
    return tuple(jnp.asarray(a, dtype) for a in (q, k, v))


def _scaled(x, fmt, axis):
    """NumPy quantization of ``x`` (float32, the whole array one tensor) along ``axis``:
    (data * block scale as float64, the float32 decode scale)."""
    data, s, dec = ref.ref_quantize(np.asarray(x, F32), axis=axis, **fmt)
    ax = axis % data.ndim
    block = fmt.get("block", 16)
    full = np.moveaxis(np.repeat(np.moveaxis(s, ax, -1), block, -1)[..., :data.shape[ax]],
                       -1, ax)
    return data * full, F32(dec)


def _softmax_f32(s, m):
    s = np.where(m, s, np.finfo(F32).min).astype(F32)
    e = np.exp((s - s.max(-1, keepdims=True)).astype(F32)).astype(F32)
    p = (e / e.sum(-1, keepdims=True, dtype=F32)).astype(F32)
    return np.where(m, p, F32(0))


def _ref_probs(qb, kb, fmt, causal=True):
    """One sequence's float32 probabilities (KV, G, T, S) from quantized q and k."""
    T, H, hd = qb.shape
    S, KV = kb.shape[0], kb.shape[1]
    m = np.tril(np.ones((T, S), bool)) if causal else np.ones((T, S), bool)
    qg = np.asarray(qb, F32).reshape(T, KV, H // KV, hd).transpose(1, 2, 0, 3)
    qs, dq_ = _scaled(qg, fmt, -1)
    ks, dk_ = _scaled(np.asarray(kb, F32).transpose(1, 0, 2), fmt, -1)
    s = np.einsum("kgtd,ksd->kgts", qs, ks)  # exact: one block per dot
    s = (s.astype(F32) * F32(dq_ * dk_)).astype(F32) * F32(hd ** -0.5)
    return _softmax_f32(s, m)


def _ref_forward(q, k, v, fmt, causal=True):
    """The quantized forward of one batch, sequence by sequence, in NumPy."""
    q, k, v = (np.asarray(a, F32) for a in (q, k, v))
    B, T, H, hd = q.shape
    out = np.zeros((B, T, H, hd), F32)
    for b in range(B):
        vb = v[b].transpose(1, 0, 2)  # (KV, S, hd)
        p = _ref_probs(q[b], k[b], fmt, causal)
        ps, dp_ = _scaled(p, fmt, -1)
        vs, dv_ = _scaled(vb, fmt, 1)  # along the keys
        o = np.einsum("kgts,ksd->kgtd", ps, vs)
        o = o.astype(F32) * F32(dp_ * dv_)
        out[b] = o.transpose(2, 0, 1, 3).reshape(T, H, hd)
    return out


@pytest.mark.parametrize("name,fmt,shape", [
    ("attn_nvfp4", NV, (2, 16, 4, 2, 16)),
    ("attn_mxfp4", MX, (2, 32, 2, 1, 32)),
])
def test_forward_is_the_numpy_composition_bit_for_bit(name, fmt, shape):
    q, k, v = _qkv(*shape)
    got = fp4jax.attention(q, k, v, name, causal=True)
    assert got.shape == q.shape and got.dtype == q.dtype
    bits_equal(got, _ref_forward(q, k, v, fmt))
    # and not the unquantized attention
    plain = np.asarray(fp4jax.attention(q, k, v, "attn_bf16"))
    assert np.abs(np.asarray(got) - plain).max() > 1e-3


def test_bf16_recipe_is_the_plain_attention():
    q, k, v = _qkv(2, 16, 4, 2, 16, jnp.bfloat16)
    want = causal_attention(q, k, v, "xla")
    for r in ("attn_bf16", None, recipes.bf16()):
        got = fp4jax.attention(q, k, v, r)
        assert got.dtype == jnp.bfloat16
        bits_equal(got, want)


def _ref_backward(q, k, v, do, fq, fb, causal=True):
    """The recipe's gradients in float64 (one sequence at a time): forward operands
    quantized per ``fq`` (None: not), backward operands per ``fb`` (None: high
    precision, the tensors themselves), each along its GEMM's contraction axis."""
    q, k, v, do = (np.asarray(a, F32) for a in (q, k, v, do))
    B, T, H, hd = q.shape
    KV = k.shape[2]
    G = H // KV
    sc = hd ** -0.5
    m = np.tril(np.ones((T, T), bool)) if causal else np.ones((T, T), bool)

    def Q(x, f, axis):
        if f is None:
            return np.asarray(x, np.float64)
        xs, dec = _scaled(np.asarray(x, F32), f, axis)
        return xs * np.float64(dec)

    grads = [np.zeros(a.shape) for a in (q, k, v)]
    for b in range(B):
        qg = q[b].reshape(T, KV, G, hd).transpose(1, 2, 0, 3)
        kb, vb = k[b].transpose(1, 0, 2), v[b].transpose(1, 0, 2)
        dob = do[b].reshape(T, KV, G, hd).transpose(1, 2, 0, 3)
        s = np.einsum("kgtd,ksd->kgts", Q(qg, fq, -1), Q(kb, fq, -1)) * sc
        s = np.where(m, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p = np.where(m, p / p.sum(-1, keepdims=True), 0.0)
        # pv: dgrad dP = dO v^T (contract hd), wgrad dv = P^T dO (contract the queries)
        dp = np.einsum("kgtd,ksd->kgts", Q(dob, fb, -1), Q(vb, fb, -1))
        pw = Q(p.reshape(KV, G * T, T), fb, 1)
        dow = Q(dob.reshape(KV, G * T, hd), fb, 1)
        dv = np.einsum("kms,kmd->ksd", pw, dow)
        ds = np.where(m, p * (dp - (p * dp).sum(-1, keepdims=True)), 0.0) * sc
        # qk: dgrad dq = dS k (contract the keys), wgrad dk = dS^T q (contract the queries)
        dq = np.einsum("kgts,ksd->kgtd", Q(ds, fb, -1), Q(kb, fb, 1))
        dsw = Q(ds.reshape(KV, G * T, T), fb, 1)
        qw = Q(qg.reshape(KV, G * T, hd), fb, 1)
        dk = np.einsum("kms,kmd->ksd", dsw, qw)
        grads[0][b] = dq.transpose(2, 0, 1, 3).reshape(T, H, hd)
        grads[1][b] = dk.transpose(1, 0, 2)
        grads[2][b] = dv.transpose(1, 0, 2)
    return grads


def _grads(q, k, v, do, r):
    _, vjp = jax.vjp(lambda q, k, v: fp4jax.attention(q, k, v, r), q, k, v)
    return [np.asarray(g, np.float64) for g in vjp(do)]


def test_high_precision_backward_is_the_straight_through_gradient():
    """attn_nvfp4: dq, dk, dv, dP from the unquantized tensors (and the forward's
    quantized scores' softmax), float32 against float64."""
    q, k, v = _qkv(2, 16, 4, 2, 16)
    do = _qkv(2, 16, 4, 2, 16, seed=1)[0]
    got = _grads(q, k, v, do, "attn_nvfp4")
    want = _ref_backward(q, k, v, do, NV, None)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5 * np.abs(w).max())


def test_quantized_backward_follows_the_recipe():
    """An all-NVFP4 round-to-nearest recipe (1D blocks, no RHT): the four backward products
    on operands quantized along their contraction axes. ``dv = Q(P)^T Q(dO)`` (the queries
    one block) is exact: bit for bit; dq and dk go through the float32 softmax gradient
    (``dS``), whose last-bit differences from float64 can move a rounding: to 1%."""
    r = recipes.nvfp4().replace(sr=False, rht=0, block_2d=False, name="rtn")
    q, k, v = _qkv(1, 16, 2, 2, 16)
    do = _qkv(1, 16, 2, 2, 16, seed=1)[0]
    got = _grads(q, k, v, do, r)
    want = _ref_backward(q, k, v, do, NV, NV)
    p = _ref_probs(q[0], k[0], NV).reshape(2, 16, 16)  # (KV, G * T, S), G = 1
    pw, dp_ = _scaled(p, NV, 1)
    dow, do_ = _scaled(np.asarray(do[0], F32).transpose(1, 0, 2), NV, 1)
    dv = np.einsum("kms,kmd->ksd", pw, dow).astype(F32) * F32(dp_ * do_)
    bits_equal(got[2].astype(F32)[0], dv.transpose(1, 0, 2))
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5, atol=1e-6)
    for g, w in zip(got[:2], want[:2], strict=True):
        assert np.linalg.norm(g - w) <= 1e-2 * np.linalg.norm(w)
    hp = _ref_backward(q, k, v, do, NV, None)  # and the recipe's backward quantizes
    assert not np.allclose(hp[2], got[2], rtol=1e-3)


def test_causal_mask_future_keys_change_nothing_before_them():
    """Query t sees keys <= t only: changing keys and values after t leaves rows <= t bit
    for bit, and the masked probabilities are exact zeros that enter no scale of P. (k's
    and v's own scales do span the sequence: v's blocks run along the keys, the product's
    contraction axis; here position 0 holds every amax, so they stay put.)"""
    q, k, v = _qkv(1, 16, 2, 1, 16)
    k = k.at[0, 0, 0, 0].set(8.0)
    v = v.at[0, 0, 0, :].set(8.0)
    t = 7
    rng = np.random.default_rng(3)
    k2 = k.at[:, t + 1:].set(jnp.asarray(rng.uniform(-1, 1, (1, 8, 1, 16)), jnp.float32))
    v2 = v.at[:, t + 1:].set(jnp.asarray(rng.uniform(-1, 1, (1, 8, 1, 16)), jnp.float32))
    a = np.asarray(fp4jax.attention(q, k, v, "attn_nvfp4"))
    b = np.asarray(fp4jax.attention(q, k2, v2, "attn_nvfp4"))
    bits_equal(a[:, :t + 1], b[:, :t + 1])
    assert not np.array_equal(a[:, t + 1:], b[:, t + 1:])
    bits_equal(a, _ref_forward(q, k, v, NV))
    bits_equal(a[0, 0], np.full((2, 16), 8.0))  # query 0 sees key 0 only: P = 1, v[0] = 8


def test_mask_argument_and_fully_masked_rows():
    q, k, v = _qkv(1, 16, 2, 1, 16)
    mask = np.ones((1, 1, 16, 16), bool)
    mask[..., 10:] = False  # padding keys
    mask[..., 3, :] = False  # a query that sees nothing
    got = np.asarray(fp4jax.attention(q, k, v, "attn_bf16", causal=False, mask=mask))
    qn, kn, vn = (np.asarray(a, np.float64)[0] for a in (q, k, v))
    s = np.einsum("thd,shd->hts", qn, np.repeat(kn, 2, 1)) / 4.0
    e = np.where(mask[0], np.exp(s - s.max(-1, keepdims=True)), 0.0)
    p = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)
    want = np.einsum("hts,shd->thd", p, np.repeat(vn, 2, 1))
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-6)
    assert (got[0, 3] == 0).all()
    # FP4 under the padding mask: the padded keys change nothing (amaxes at position 0)
    k = k.at[0, 0, 0, 0].set(8.0)
    v = v.at[0, 0, 0, :].set(8.0)
    a = fp4jax.attention(q, k, v, "attn_nvfp4", causal=False, mask=mask)
    b = fp4jax.attention(q, k.at[:, 10:].set(0.5), v.at[:, 10:].set(-0.25), "attn_nvfp4",
                         causal=False, mask=mask)
    bits_equal(a, b)
    assert (np.asarray(a)[0, 3] == 0).all()


def test_stochastic_recipe_needs_a_key_and_is_deterministic_in_it():
    q, k, v = _qkv(1, 16, 2, 1, 16)
    with pytest.raises(ValueError, match="attn_nvfp4_all.*key=jax.random.key"):
        fp4jax.attention(q, k, v, "attn_nvfp4_all")
    f = jax.jit(jax.grad(lambda q, key: fp4jax.attention(q, k, v, "attn_nvfp4_all",
                                                         key=key).sum()))
    a, b, c = (np.asarray(f(q, jax.random.key(s))) for s in (1, 1, 2))
    bits_equal(a, b)
    assert not np.array_equal(a, c)


def test_bad_inputs_raise_clear_errors():
    q, k, v = _qkv(1, 16, 4, 2, 16)
    with pytest.raises(ValueError, match="4-D"):
        fp4jax.attention(q[0], k, v)
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        fp4jax.attention(q, k, v[:, :8])
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        fp4jax.attention(q[:, :, :3], k, v)
    with pytest.raises(ValueError, match="batch and head_dim"):
        fp4jax.attention(q[..., :8], k, v)
    with pytest.raises(TypeError, match="share a dtype"):
        fp4jax.attention(q.astype(jnp.bfloat16), k, v)
    with pytest.raises(TypeError, match="q"):
        fp4jax.attention(q.astype(jnp.int32), k, v)
    with pytest.raises(TypeError, match="mask must be boolean"):
        fp4jax.attention(q, k, v, mask=jnp.ones((16, 16)))
    with pytest.raises(ValueError, match="mask shape"):
        fp4jax.attention(q, k, v, mask=jnp.ones((3, 16, 16), bool))
    with pytest.raises(TypeError, match="causal must be True or False"):
        fp4jax.attention(q, k, v, causal=1)
    with pytest.raises(ValueError, match="unknown attention recipe 'attn_fp3'"):
        fp4jax.attention(q, k, v, "attn_fp3")
    with pytest.raises(TypeError, match="attention recipe must be"):
        fp4jax.attention(q, k, v, 4)
    with pytest.raises(ValueError, match="hadamard_signs='layer'"):
        recipes.AttentionRecipe("x", qk=recipes.nvfp4().replace(
            **{"wgrad.hadamard_signs": "layer"}), pv=recipes.bf16())
    with pytest.raises(TypeError, match="AttentionRecipe.pv"):
        recipes.AttentionRecipe("x", qk=recipes.bf16(), pv=3)


def test_recipes_describe_their_operands():
    r = recipes.get_attention("attn_nvfp4")
    assert r == recipes.attn_nvfp4() and not r.needs_key and r.quantized
    assert r.qk.fprop.lhs.fmt == fp4jax.NVFP4 and not r.qk.fprop.rhs.block_2d
    assert not r.qk.dgrad.quantized and not r.pv.wgrad.quantized
    assert recipes.attn_nvfp4_all().needs_key and not recipes.attn_bf16().quantized
    assert recipes.get_attention("nvfp4").qk == recipes.nvfp4()
    assert "pv (O = P v)" in r.describe()
    assert recipes.attention_names() == ["attn_bf16", "attn_mxfp4", "attn_nvfp4",
                                         "attn_nvfp4_all"]


def test_data_parallel_sequences_get_one_devices_bits():
    """Inside ``fp4jax.sharding.data_parallel`` under ``jax.shard_map`` (4 devices, a 2 x 2
    mesh, the batch split data-major as the harness splits it), each device's sequences
    get the one-device forward bits, and the stochastic backward the same random bits
    (keys folded with each sequence's index in the whole batch: a wrong index moves FP4
    roundings, ~10% of the gradient); the gradient's float32 sums of unquantized products
    (the softmax gradient, dS's row sums) may round differently in the per-device program:
    to 1e-6."""
    from jax.sharding import PartitionSpec as P

    from fp4jax.train import parallel

    mesh = parallel.make_mesh(4, fsdp=2)
    q, k, v = _qkv(4, 16, 2, 1, 16)
    nv, sr = fp4jax.QuantSpec(fp4jax.NVFP4), fp4jax.QuantSpec(fp4jax.NVFP4, "stochastic")
    pv = fp4jax.Recipe("sr_dP", fprop=fp4jax.GemmSpec(nv, nv), dgrad=fp4jax.GemmSpec(sr),
                       wgrad=fp4jax.GemmSpec())
    r = recipes.AttentionRecipe("sr_dP", qk=recipes.attn_nvfp4().qk, pv=pv)

    def out_grad(q, k, v, key):
        f = lambda q: fp4jax.attention(q, k, v, r, key=key)  # noqa: E731
        o, vjp = jax.vjp(f, q)
        return o, vjp(o)[0]

    def local(q, k, v, key):
        with fp4jax.sharding.data_parallel(parallel.AXES):
            return out_grad(q, k, v, key)

    sm = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(parallel.BATCH,) * 3 + (P(),),
                               out_specs=(parallel.BATCH,) * 2, check_vma=False))
    key = jax.random.key(7)
    o, g = sm(q, k, v, key)
    o1, g1 = jax.jit(out_grad)(q, k, v, key)
    bits_equal(o, o1)
    g, g1 = np.asarray(g), np.asarray(g1)
    np.testing.assert_allclose(g, g1, rtol=0, atol=1e-6 * np.abs(g1).max())
    _, g2 = jax.jit(out_grad)(q, k, v, jax.random.key(8))  # other keys: other roundings
    assert np.abs(np.asarray(g2) - g1).max() > 1e-3 * np.abs(g1).max()
