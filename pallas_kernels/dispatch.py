"""The one dispatcher between fp4jax and its Pallas Mosaic GPU kernels.

Every kernel-backed operation has one entry here, whose meaning is a core XLA function
(the reference it is tested against) and whose Hopper (sm_90) kernels live beside it,
grouped by operation: ``pallas_kernels/quantize/`` (``operand_sm90``: the bf16
``data * scale`` GEMM operands of ``fp4jax.dot``; ``packed_sm90``: packed codes and
scales; ``common_sm90``: their shared numerics) and ``pallas_kernels/gemm/``
(``alpha_sm90``: the GEMM with the tensor scales in its epilogue; ``w4a16_sm90``;
``w4a4_sm90``). This module is the only place that reads the environment variables
``FP4JAX_KERNELS`` and ``FP4JAX_KERNEL_GEMM`` and decides which backend runs.

Operations (reference in parentheses):

* ``fp4jax.dot``'s backend (``dot_backend``: its ``implementation=`` argument, None =
  automatic with fallback, an explicit one or a ValueError; ``spec_unsupported_reason``:
  the kernels' coverage by quantization spec, the one place it is stated);
* ``fp4jax.dot``'s operands and GEMMs (``fp4jax.dot``'s XLA path):
  ``kernel_mode`` (whether a ``dot`` call uses kernels), ``operand_kernel`` (which fused
  kernel makes one operand, or None), ``make_operands`` (run them), ``scaled_gemm``
  (the GEMM with ``alpha = dec_a * dec_b`` in its epilogue, or None for XLA's);
* ``quantize`` / ``quantize_packed`` (``fp4jax.quantize``): NVFP4, bfloat16 input; 1x16
  blocks along the last axis, round-to-nearest (element count / 16 a multiple of 256,
  last axis a multiple of 16) or stochastic (rows % 4 == 0, last axis % 1024 == 0, a
  threefry key), or 16x16 tiles over the last two axes (``block_2d=True``,
  round-to-nearest: rows a multiple of 16, last axis a multiple of 1024; leading axes
  are stacked matrices). Bit-identical to ``fp4jax.quantize`` (codes, E4M3 scale bits,
  tensor scale);
* ``w4a16_matmul`` (``x @ dequantize(W)``): W an NVFP4 ``QuantizedArray`` (K, N) scaled
  along K (1x16 along axis 0, or 16x16 tiles); M <= 256, K % 64 == 0, N % 64 == 0.
  Equal up to float32 accumulation order;
* ``w4a4_matmul`` (``dequantize(A) @ dequantize(B)``): NVFP4 or MXFP4 operands scaled
  along K; decode kernel + bf16 GEMM (M % 64, N % 64, K % 256 == 0). Equal up to float32
  accumulation order;
* Blackwell (sm_100+): ``native_mode`` / ``native_gemm`` (``fp4jax.dot``'s XLA path): the
  recipe's NVFP4 GEMMs on ``jax.nn.scaled_matmul`` (``gemm/blockscale_sm100``) or, only
  under ``FP4JAX_KERNELS=tcgen05``, the never-run Pallas kernel ``gemm/tcgen05_sm100``.
  Equal up to float32 accumulation order; not run on Blackwell hardware.

The packed-output functions take ``backend``: ``"auto"`` (kernels on an sm_90 GPU when
the shape, dtype and options are supported, else XLA), ``"pallas"`` (kernels or a
ValueError that says why not) or ``"xla"`` (always the reference). ``FP4JAX_KERNELS=off``
turns ``"auto"`` into ``"xla"`` (``=on`` into ``"pallas"``); it is read at call (trace)
time, nothing is cached. Kernel modules are imported on first use (they load Pallas).
This module imports core modules of ``fp4jax`` only, never the package root.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp

from fp4jax import quantization as qz
from fp4jax import sharding
from fp4jax.formats import NVFP4, get_format

BACKENDS = ("auto", "pallas", "xla")


def _compute_capability() -> tuple[int, int] | None:
    """(major, minor) of JAX's default device when it is an NVIDIA GPU, else None."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return None
    if dev.platform != "gpu":
        return None
    cc = str(getattr(dev, "compute_capability", ""))
    try:
        major, minor = (int(p) for p in cc.split(".")[:2])
    except ValueError:
        return None
    return major, minor


def on_sm90() -> bool:
    """True when JAX's default device is an NVIDIA GPU of compute capability 9.x."""
    cc = _compute_capability()
    return cc is not None and cc[0] == 9


def on_sm100() -> bool:
    """True when JAX's default device is an NVIDIA GPU of compute capability 10.0 or newer
    (Blackwell: B200/GB200 10.0, GB300 10.3, RTX Pro 12.0): block-scaled FP4 tensor cores."""
    cc = _compute_capability()
    return cc is not None and cc[0] >= 10


# ---------------------------------------------------------------------------
# The environment: FP4JAX_KERNELS and FP4JAX_KERNEL_GEMM (read here only).
# ---------------------------------------------------------------------------

_ENV_OFF = ("off", "0", "xla")  # FP4JAX_KERNELS spellings that force XLA
_ENV_ON = ("on", "1", "pallas")  # ... that force the kernels
_ENV_NATIVE = ("native", "tcgen05")  # ... that force the Blackwell GEMM backend


def _kernels_env() -> str:
    return os.environ.get("FP4JAX_KERNELS", "auto").lower()


def kernels_forced() -> bool:
    """Whether ``FP4JAX_KERNELS`` forces the kernels (``on``/``1``/``pallas``)."""
    return _kernels_env() in _ENV_ON


def gemm_backend() -> str:
    """``FP4JAX_KERNEL_GEMM``: the kernel path's GEMMs on the Pallas ``gemm_alpha``
    kernel (``pallas``, the default) or on XLA's ``dot_general`` followed by the alpha
    multiply (``xla``: bit-identical to the XLA path)."""
    env = os.environ.get("FP4JAX_KERNEL_GEMM", "pallas").lower()
    if env not in ("pallas", "xla"):
        raise ValueError(f"FP4JAX_KERNEL_GEMM={env!r}: use pallas or xla")
    return env


def _resolve(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    env = os.environ.get("FP4JAX_KERNELS", "").lower()
    if backend == "auto" and env in _ENV_OFF:
        return "xla"
    if backend == "auto" and env in _ENV_ON:
        return "pallas"
    return backend


def _nvfp4(fmt) -> bool:
    """Whether ``fmt`` is NVFP4 itself: the only format of the quantize, operand and W4A16
    kernels (any other element type, FP6/FP8 included, takes the XLA path)."""
    return fmt == NVFP4 or fmt == "nvfp4"


def _e2m1_reason(fmt) -> str | None:
    """None when ``fmt`` stores E2M1 elements, else why the Hopper kernels cannot take it:
    they quantize to and decode 4-bit E2M1 codes only (FP6/FP8 formats run on XLA)."""
    f = get_format(fmt)
    if (f.elem_exp_bits, f.elem_man_bits) != (2, 1):
        return (f"the kernels implement E2M1 (FP4) elements only, got format {f.name!r} with "
                f"E{f.elem_exp_bits}M{f.elem_man_bits} elements: it runs on the XLA path")
    return None


def _mx_fp4(fmt) -> bool:
    """Whether ``fmt`` (a ``BlockFormat``, its name or None) is an MX FP4 format of the
    operand kernels (``quantize/common_sm90.is_mx``: MXFP4, MXFP4_OCP)."""
    if fmt is None or _nvfp4(fmt):
        return False
    from pallas_kernels.quantize.common_sm90 import is_mx

    return is_mx(get_format(fmt))


def spec_unsupported_reason(fmt: Any, *, block_scale_rule: str = "max",
                            row_scaled: bool = False, rounding: str = "nearest") -> str | None:
    """None when the Hopper operand kernels implement this quantization spec, else why
    not: the one statement of their coverage by spec (shapes are checked apart, per kernel).
    They quantize NVFP4 itself (E2M1 elements, E4M3 block scales of 16, one float32
    tensor scale) and the MX FP4 formats (``fp4jax.MXFP4``, ``MXFP4_OCP``: E2M1, E8M0
    scales of 32 by the format's rule, no tensor scale; not FP6/FP8 or other block
    formats), with the ``"max"`` block scale rule (not 4over6), rounding to nearest or
    stochastically (not MS-EDEN), one tensor scale per tensor (not row-scaled). ``fmt``:
    a ``BlockFormat`` or its name (None: NVFP4). The packed quantize kernels take NVFP4
    only (``quantize_unsupported_reason``)."""
    if fmt is not None and not _nvfp4(fmt) and not _mx_fp4(fmt):
        return _e2m1_reason(fmt) or (f"the kernels implement NVFP4 and MXFP4 (blocks of 32, "
                                     f"E8M0 scales, no tensor scale) only, got format "
                                     f"{get_format(fmt).name!r}")
    if block_scale_rule != "max":
        return (f"the kernels implement the 'max' block scale rule only, got "
                f"block_scale_rule={block_scale_rule!r}")
    if row_scaled:
        return "the kernels compute one tensor scale per tensor, got row_scaled=True"
    if rounding not in ("nearest", "stochastic"):
        return f"the kernels round to nearest or stochastically, got rounding={rounding!r}"
    return None


def _interpret_kw(mode: str) -> dict:
    """Kernel keyword arguments for ``mode``: Mosaic GPU's interpret mode for
    ``"interpret"`` (CPU tests, JAX >= 0.10), nothing otherwise."""
    if mode != "interpret":
        return {}
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return {"interpret": InterpretGPUParams()}


def _is_threefry(key) -> bool:
    return "threefry" in str(jax.random.key_impl(key)).lower()


# ---------------------------------------------------------------------------
# fp4jax.dot: the GEMM operands (bf16 data * scale) and the scaled GEMM.
# Reference: fp4jax.dot's XLA path (fp4jax.quantize + scaled_data, einsum * alpha).
# Kernels: quantize/operand_sm90.py, gemm/alpha_sm90.py.
# ---------------------------------------------------------------------------

KERNEL_AUTO_MIN_MKN = 2**30
"""``FP4JAX_KERNELS=auto`` uses the kernels only for GEMMs with ``M*K*N`` at least this
(8192 x 512 x 256). Measured on an H200 (``experiments/results/kernels/KERNELS.md``,
runs 17-22): the kernel path's forward + backward was faster than the XLA path at every
size measured alone, 2048^3 (218 vs 349 us), 16384x512x2048 (603 vs 1,222 us),
16384x2048x512, 8192x2048x2048 and 8192^3 (5,135 vs 7,634 us); and training the
``small`` preset with every GEMM on the kernels (``FP4JAX_KERNELS=on``; its smallest GEMMs
are 16384 x 512 x 256) ran at 477k tokens/s vs 383k on the XLA path (run 22). At 8192 x
512 x 256 (the ``small`` preset's k and v projections with 8,192 tokens a device, data
parallel on two H100s) the XLA path cost 1.8 ms a device a step against 0.54 ms for the
kernels at twice the tokens on one GPU
(``experiments/results/training/2026-11-26_data_parallel_profile_h100x2/``), so the bound
was halved from 2**31. Smaller GEMMs are not measured and stay on XLA."""


def kernel_mode(mkn: int | None = None) -> str:
    """How ``fp4jax.dot`` runs NVFP4 quantization: ``"on"`` (the Pallas kernels),
    ``"off"`` (XLA) or ``"interpret"`` (the kernels in Mosaic GPU interpret mode: for CPU
    tests only).

    ``FP4JAX_KERNELS`` decides: ``off``/``0``/``xla`` force XLA; ``on``/``1``/``pallas``
    use the kernels whenever the default device is an sm_90 (Hopper) GPU; unset or
    ``auto`` (the default) use them on an sm_90 GPU when this JAX sees a single device
    (``jax.device_count() == 1``: a Pallas call inside a multi-device, sharded ``jit`` is
    not partitioned by XLA, so data-parallel runs keep the XLA path unless forced) and
    the GEMM is large: ``mkn`` (``M*K*N`` of an unbatched call; ``dot_general`` passes 0
    for batched ones, which the kernels do not cover) at least ``KERNEL_AUTO_MIN_MKN``.
    Inside ``fp4jax.sharding.data_parallel`` (``jax.shard_map``: each device runs its own
    program on its rows) and inside ``fp4jax.sharding.one_device`` (a program on one
    device of a multi-device host) the device count does not matter.
    Under ``jax.vmap`` the operands take the XLA path. Either way the results are the
    same bits (the kernels are tested against the XLA path). The setting is part of
    ``dot``'s trace cache key: a change takes effect on the next call of ``dot``.
    """
    env = _kernels_env()
    if env in _ENV_OFF or env in _ENV_NATIVE:
        return "off"
    if env == "interpret":
        return "interpret"
    if env in _ENV_ON:
        return "on" if on_sm90() else "off"
    if env not in ("", "auto"):
        raise ValueError(f"FP4JAX_KERNELS={env!r}: use auto, on or off (or native / "
                         "tcgen05: the Blackwell GEMM backend)")
    big = mkn is None or mkn >= KERNEL_AUTO_MIN_MKN
    single = (jax.device_count() == 1 or sharding.data_axis() is not None
              or sharding.on_one_device())
    return "on" if big and on_sm90() and single else "off"


IMPLEMENTATIONS = ("xla", "pallas", "native")
"""The values of ``fp4jax.dot``'s ``implementation=`` besides None (automatic)."""


@dataclasses.dataclass(frozen=True)
class DotBackend:
    """How one ``fp4jax.dot`` call runs (hashable: part of its trace cache key).

    ``name``: ``"xla"`` (the reference: every operand a ``QuantizedArray``, einsum GEMMs),
    ``"pallas"`` (the Hopper kernel path: every quantized operand its ``data * scale`` from
    the fused operand kernels where they cover it, else from the reference; every
    unquantized operand the tensor itself, as the reference feeds it; GEMMs of two
    quantized operands on ``gemm/alpha_sm90`` where it tiles them, else XLA's, as on the
    reference) or ``"native"`` (the reference's
    operands, its NVFP4 GEMMs on Blackwell's block-scaled tensor cores). ``kmode``: the
    kernels' mode (``"on"``, ``"interpret"``: CPU tests; ``"off"`` unless ``"pallas"``);
    ``gemm``: ``FP4JAX_KERNEL_GEMM``; ``native``: ``native_mode``'s value;
    ``packed_quantize``: the reference path with its NVFP4 round-to-nearest operands from
    the packed quantize kernels (only under ``FP4JAX_KERNELS=on`` for recipes the kernel
    path does not take, as before). Every backend gives the reference's bits (GEMMs up to
    float32 accumulation order where they do not run XLA's einsum)."""

    name: str = "xla"
    kmode: str = "off"
    gemm: str = "pallas"
    native: str = "off"
    packed_quantize: bool = False


def dot_backend(implementation: str | None, *, mkn: int, kernel_recipe: bool
                ) -> DotBackend:
    """The backend of one ``fp4jax.dot`` call (tokamax style: one API, backends tried in
    order, the XLA reference last).

    ``implementation``: None (automatic: ``FP4JAX_KERNELS`` sets the choice, see
    ``kernel_mode`` and ``native_mode``; a backend that does not take the call falls back
    to the next, ending with ``"xla"``), or ``"xla"``, ``"pallas"``, ``"native"``: that
    backend or a ValueError saying why it cannot run the call. ``mkn``: ``M*K*N`` of an
    unbatched call, 0 for a batched one (the kernels take unbatched calls only);
    ``kernel_recipe``: some operand of the recipe is quantized with a spec the kernels
    implement (``spec_unsupported_reason``: NVFP4 with one tensor scale or MX FP4, the
    ``"max"`` block scale rule, round-to-nearest or stochastic rounding); the recipe's other
    operands, quantized or not, run inside the kernel path as on the reference.

    ``"pallas"`` needs an sm_90 GPU (or ``FP4JAX_KERNELS=interpret``: Mosaic GPU's
    interpret mode, for CPU tests), an unbatched call and a kernel recipe; it then runs
    at every size and device count (no ``KERNEL_AUTO_MIN_MKN`` bound). Inside such a call
    an operand or GEMM whose shape the kernels do not tile runs on the reference (same
    bits). ``"native"`` runs ``jax.nn.scaled_matmul`` on any device that lowers it
    (``gemm/blockscale_sm100.jax_lowers_on``: CUDA, and the CPU from JAX 0.11); GEMMs whose
    operands are not NVFP4 blocked along the contracted axis run on the reference."""
    if implementation is None:
        kmode = kernel_mode(mkn)
        if kmode != "off" and kernel_recipe:
            return DotBackend("pallas", kmode, gemm_backend())
        native = native_mode()
        if native != "off":
            return DotBackend("native", native=native)
        return DotBackend(packed_quantize=kmode == "on" and kernels_forced())
    if implementation == "xla":
        return DotBackend()
    if implementation == "pallas":
        interpret = _kernels_env() == "interpret"
        reason = None
        if not kernel_recipe:
            reason = ("the recipe has no operand the kernels implement (they quantize "
                      "NVFP4 with one tensor scale and MXFP4, with the 'max' block scale "
                      "rule, rounding to nearest or stochastically; this recipe's operands "
                      "are all FP6/FP8, 4over6, row-scaled, MS-EDEN or unquantized)")
        elif mkn == 0:
            reason = "the call is batched (dot_general batch dimensions): kernels take B == 1"
        elif not interpret and not on_sm90():
            reason = ("no sm_90 (Hopper) GPU is the default device (set "
                      "FP4JAX_KERNELS=interpret to run the kernels in interpret mode on CPU)")
        if reason is not None:
            raise ValueError(f"fp4jax.dot(implementation='pallas'): {reason}; use "
                             "implementation=None (automatic, with fallback) or 'xla'")
        return DotBackend("pallas", "interpret" if interpret else "on", gemm_backend())
    if implementation == "native":
        from pallas_kernels.gemm import blockscale_sm100 as bs

        platform = jax.devices()[0].platform
        if not bs.jax_lowers_on(platform):
            raise ValueError(
                f"fp4jax.dot(implementation='native'): this JAX ({jax.__version__}) does not "
                f"lower jax.nn.scaled_matmul on {platform!r} (CUDA, or the CPU from JAX "
                "0.11); use implementation=None or 'xla'")
        native = "tcgen05" if _kernels_env() == "tcgen05" else "scaled_matmul"
        return DotBackend("native", native=native)
    raise ValueError(f"implementation must be None or one of {IMPLEMENTATIONS}, got "
                     f"{implementation!r}")


def operand_kernel(x: jax.Array, *, block_2d: bool, axis: int, stochastic: bool,
                   rht: int, key: jax.Array, block_scale_rule: str = "max",
                   fmt: Any = None, row_scaled: bool = False,
                   rounding: str | None = None) -> str | None:
    """Which fused kernel of ``quantize/operand_sm90`` makes the GEMM operand
    ``scaled_data(quantize(RHT(x)), bfloat16)``: ``"rows"`` (1x16 along the last axis),
    ``"cols"`` (16x1 along the token axis, with the 16-point RHT if ``rht``), ``"2d"``
    (16x16 tiles), or None (the XLA path). MX FP4 operands (``fmt`` MXFP4/MXFP4_OCP): 1x32
    ``"rows"`` and 32x1 ``"cols"`` (RHT of size 32, or none), bfloat16 only; their 32x32
    weight tiles take the XLA path (a strip of 64 such tiles, the least the kernel's
    register layout takes, outgrows shared memory).

    ``x`` is ``fp4jax.dot``'s canonical (B, R, C) operand; ``axis`` (1 or 2) its blocked
    axis; ``rht`` the RHT size (0: none) along ``axis``; ``key`` the call's key (SR
    kernels compute Threefry draws, so other key implementations take the XLA path);
    ``block_scale_rule`` the operand's ``QuantSpec.block_scale_rule`` (the kernels
    implement ``"max"`` only: 4over6 operands take the XLA path); ``fmt`` the operand's
    format (None: NVFP4; any other format, e.g. MXFP8, takes the XLA path);
    ``row_scaled`` (per-row tensor scales) and ``rounding="ms_eden"`` (Quartet II's MS-EDEN)
    take the XLA path too: the kernels compute one tensor scale and RNE/SR elements."""
    if spec_unsupported_reason(fmt, block_scale_rule=block_scale_rule,
                               row_scaled=row_scaled,
                               rounding=rounding or ("stochastic" if stochastic else "nearest")
                               ) is not None:
        return None
    from pallas_kernels.quantize import operand_sm90 as fq

    mx = _mx_fp4(fmt)
    b = 32 if mx else 16
    if x.shape[0] != 1 or x.dtype not in (jnp.bfloat16, jnp.float32):
        return None
    if x.dtype == jnp.float32 and (mx or not block_2d):
        return None  # float32 input: the NVFP4 16x16 kernel only (a float32 master weight)
    if stochastic and not _is_threefry(key):
        return None  # the kernels compute threefry draws (numerics.draws_from_key)
    mat = x.shape[1:]
    if block_2d:
        ok = not mx and not rht and not stochastic and fq.supported_2d(mat, x.dtype)
        return "2d" if ok else None
    if axis == 2:
        ok = not rht and fq.supported_rows(mat, x.dtype, stochastic, padded=True, block=b)
        return "rows" if ok else None
    return "cols" if rht in (0, b) and fq.supported_cols(mat, x.dtype, b) else None


def make_operands(x: jax.Array, kinds: list[str], sr_keys: list[Any], signs: list[Any],
                  mode: str, shard: Any = None, local_amax: bool = False,
                  fmts: list[Any] | None = None) -> list[tuple[jax.Array, jax.Array]]:
    """Run the fused operand kernels on one tensor ``x`` (1, R, C) bfloat16 (or float32 when
    every operand is ``"2d"``).

    ``kinds[i]`` is ``operand_kernel``'s answer for operand ``i``, ``sr_keys[i]`` its
    stochastic-rounding key (None: round to nearest), ``signs[i]`` its RHT sign vector
    (``"cols"`` only; None: no RHT). Returns ``(scaled_data in bf16 (1, R, C), tensor
    decode scale)`` per operand. A rows operand and one RHT'd cols operand of the same
    tensor take both tensor amaxes from one read (``cols_amaxes``).

    ``shard``: ``x`` is one device's token rows of a data-parallel tensor
    (``fp4jax.sharding``): the tensor amaxes are the ``pmax`` over the mesh axes ``shard``
    (all of this tensor's operands in one all-reduce of a vector: the same bits as one per
    operand) and the stochastic-rounding draws start at the rows' place in the whole tensor
    (``numerics.row_shard_draw_offset``), so the operands are the whole tensor's rows.
    ``local_amax`` (``Recipe.amax_scope="local"``): each device keeps its rows' own amaxes
    (no all-reduce; the draws still at the rows' place).

    ``fmts[i]``: operand ``i``'s format (None or NVFP4; or MXFP4/MXFP4_OCP, whose kernels
    take no tensor amax: their decode scale is 1, ``global_encode_scale``'s for formats
    without a tensor scale). Default: all NVFP4."""
    from fp4jax.numerics import row_shard_draw_offset
    from pallas_kernels.quantize import operand_sm90 as fq
    from pallas_kernels.quantize.common_sm90 import finite_amax, global_scales, key_words, scalars

    kw = _interpret_kw(mode)
    m = x[0]
    fmts = [get_format(f) if _mx_fp4(f) else None
            for f in (fmts if fmts is not None else [None] * len(kinds))]
    nv = [i for i, f in enumerate(fmts) if f is None]  # NVFP4: a tensor amax each
    amax = rht_amax = None
    rot = [i for i in nv if signs[i] is not None]
    if [kinds[i] for i in nv].count("rows") == 1 and len(rot) == 1:  # x or dy of nvfp4
        amax, rht_amax = fq.cols_amaxes(m, signs[rot[0]], **kw)
    amaxes = [rht_amax if sg is not None else amax for sg in signs]
    for i, sg in enumerate(signs):  # every amax explicit (as fq_rows/fq_cols/fq_2d get them)
        if fmts[i] is not None:  # MX: amax 0 gives enc = dec = 1 (no tensor scale)
            amaxes[i] = jnp.float32(0.0)
        elif amaxes[i] is None:
            if sg is None:
                amax = finite_amax(m) if amax is None else amax
                amaxes[i] = amax
            else:
                amaxes[i] = fq.rht_cols_amax(m, sg, **kw)
    offset = None
    if shard is not None:
        if not local_amax:  # the whole tensor's amaxes: one all-reduce for all of them
            amaxes = list(jax.lax.pmax(jnp.stack([jnp.asarray(a, jnp.float32)
                                                  for a in amaxes]), shard))
        offset = row_shard_draw_offset(m.shape, jax.lax.axis_index(shard),
                                       jax.lax.axis_size(shard))
    # The tensor scales and the kernels' scalar vectors of all operands at once (elementwise
    # over a vector: the same bits as one operand at a time, in one XLA fusion instead of a
    # chain of tiny ones per operand)
    enc, dec = global_scales(None, jnp.stack([jnp.asarray(a, jnp.float32) for a in amaxes]))
    def sign_row(sg):  # 16 (NVFP4) or 32 (MX) signs, padded to 32 with ones
        sg = jnp.ones((32,), jnp.float32) if sg is None else jnp.asarray(sg, jnp.float32)
        return jnp.pad(sg.reshape(-1), (0, 32 - sg.size), constant_values=1.0)

    sc = scalars(enc, dec, jnp.stack([sign_row(sg) for sg in signs]))
    sc = sc.reshape(-1)  # every kernel takes the whole batch and reads its own row
    res = []
    for i, (kind, sr_key, sg) in enumerate(zip(kinds, sr_keys, signs, strict=True)):
        if kind == "2d":
            o = fq.fq_2d_scaled(m, sc, sc_row=i, **kw)
        elif kind == "rows":
            o = fq.fq_rows_scaled(m, sc, key_words(sr_key, offset), sr=sr_key is not None,
                                  sc_row=i, fmt=fmts[i], **kw)
        else:
            o = fq.fq_cols_scaled(m, sc, key_words(sr_key, offset), sr=sr_key is not None,
                                  rht=sg is not None, sc_row=i, fmt=fmts[i], **kw)
        res.append((o[None], dec[i]))
    return res


def scaled_gemm(a: jax.Array, b: jax.Array, alpha: jax.Array, *, trans_a: bool,
                trans_b: bool, out_dtype: Any, mode: str, gemm: str | None = None
                ) -> jax.Array | None:
    """``(alpha * op(a) @ op(b)).astype(out_dtype)`` on the Pallas ``gemm_alpha`` kernel
    (``gemm/alpha_sm90``: alpha in the epilogue, one rounding), or None where XLA's GEMM
    runs instead: unless ``gemm`` (default: ``gemm_backend()``, i.e.
    ``FP4JAX_KERNEL_GEMM``) is ``pallas`` (the default), ``mode`` is
    ``"on"`` (an sm_90 GPU), the output bf16 and the sizes tile-aligned and at least
    ``alpha_sm90.MIN_MKN`` (below it XLA's GEMM was as fast or faster, and faster in
    training). ``a``, ``b``: 2D bf16, ``op`` the transpose where asked."""
    from pallas_kernels.gemm import alpha_sm90 as ga

    m, k = a.shape[::-1] if trans_a else a.shape
    n = b.shape[0] if trans_b else b.shape[1]
    gemm = gemm_backend() if gemm is None else gemm
    if (gemm == "pallas" and mode == "on"
            and jnp.dtype(out_dtype) == jnp.bfloat16 and ga.preferred(m, k, n)):
        return ga.gemm_alpha(a, b, alpha, trans_a=trans_a, trans_b=trans_b)
    return None


# ---------------------------------------------------------------------------
# Blackwell (sm_100+): fp4jax.dot's GEMMs on block-scaled FP4 tensor cores.
# Reference: fp4jax.dot's XLA path (einsum of scaled_data, times alpha).
# Backends: gemm/blockscale_sm100.py (jax.nn.scaled_matmul), gemm/tcgen05_sm100.py.
# ---------------------------------------------------------------------------

NATIVE_MODES = ("off", "scaled_matmul", "tcgen05")


def native_mode() -> str:
    """Which backend runs ``fp4jax.dot``'s NVFP4 GEMMs natively: ``"off"`` (the XLA
    emulation, or the Hopper kernels of ``kernel_mode``), ``"scaled_matmul"``
    (``gemm/blockscale_sm100``: ``jax.nn.scaled_matmul`` on the library's quantized
    operands) or ``"tcgen05"`` (the Pallas kernel ``gemm/tcgen05_sm100`` where it applies,
    else ``"scaled_matmul"``).

    ``FP4JAX_KERNELS`` decides: unset/``auto`` and ``on`` give ``"scaled_matmul"`` on an
    sm_100+ (Blackwell) GPU and ``"off"`` anywhere else (Hopper and the CPU keep their
    paths); ``off``/``interpret`` give ``"off"``; ``native`` forces ``"scaled_matmul"`` on
    any device, the CPU included (JAX's CPU lowering of ``scaled_matmul`` from 0.11, the
    documented definition computed by ``blockscale_sm100.emulate`` before: for tests);
    ``tcgen05`` asks for the Pallas kernel, which is never chosen otherwise: it has not run
    on Blackwell hardware (see ``gemm/tcgen05_sm100``). Read at trace time; part of
    ``fp4jax.dot``'s trace cache key."""
    env = _kernels_env()
    if env == "native":
        return "scaled_matmul"
    if env == "tcgen05":
        return "tcgen05"
    if env in _ENV_OFF or env == "interpret":
        return "off"
    if env in _ENV_ON or env in ("", "auto"):
        return "scaled_matmul" if on_sm100() else "off"
    raise ValueError(f"FP4JAX_KERNELS={env!r}: use auto, on, off, native or tcgen05")


def native_gemm(subscripts: str, a: Any, b: Any, *, out_dtype: Any,
                mode: str) -> jax.Array | None:
    """One of ``fp4jax.dot``'s GEMMs on the Blackwell backend ``mode`` (``native_mode``),
    or None where it does not apply (``mode == "off"``, or an operand that is not NVFP4
    blocked along the contracted axis: high-precision, MXFP4, FP6/FP8; the caller then runs
    its XLA GEMM).

    ``a``, ``b``: ``fp4jax.dot``'s canonical quantized operands for ``subscripts``
    (``"bmk,bkn->bmn"``, ``"bmn,bkn->bmk"``, ``"bmk,bmn->bkn"``). Returns
    ``(sum_k (q_a s_a)(q_b s_b) * (dec_a * dec_b)).astype(out_dtype)``: the XLA path's
    value up to float32 accumulation order (``gemm/blockscale_sm100``)."""
    if mode not in NATIVE_MODES:
        raise ValueError(f"mode must be one of {NATIVE_MODES}, got {mode!r}")
    if mode == "off":
        return None
    from pallas_kernels.gemm import blockscale_sm100 as bs

    axes = bs.SUBSCRIPTS.get(subscripts)
    if axes is None:
        raise ValueError(f"native_gemm: unknown GEMM layout {subscripts!r}: use one of "
                         f"{sorted(bs.SUBSCRIPTS)}")
    if any(bs.operand_reason(q, ax) is not None for q, ax in zip((a, b), axes, strict=True)):
        return None
    if mode == "tcgen05" and on_sm100() and jnp.dtype(out_dtype) == jnp.bfloat16:
        from pallas_kernels.gemm import tcgen05_sm100 as tc

        if tc.available():
            y = tc.gemm(subscripts, a, b)  # None for shapes the kernel does not tile
            if y is not None:
                return y
    return bs.gemm(subscripts, a, b, out_dtype)


# ---------------------------------------------------------------------------
# Quantize to packed NVFP4. Reference: fp4jax.quantize. Kernels: quantize/packed_sm90.py.
# ---------------------------------------------------------------------------


def _rows(shape) -> int:
    r = 1
    for d in shape[:-1]:
        r *= d
    return r


def _key_reason(key) -> str | None:
    """None for a threefry key (typed or raw uint32) or no key, else why the kernels
    cannot draw its bits (they compute Threefry-2x32 in registers)."""
    if key is None:
        return None
    if hasattr(key, "dtype") and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        impl = str(jax.random.key_impl(key)).lower()
        if "threefry" not in impl:
            return f"kernels draw Threefry bits: key must be a threefry key, got {impl}"
    return None


def quantize_unsupported_reason(shape, dtype, *, fmt=None, axis=-1, block_2d=False,
                                rounding="nearest", key=None,
                                block_scale_rule="max", row_scaled=False) -> str | None:
    """None when a quantize kernel handles these arguments, else the reason.

    Kernels: 1x16 blocks along the last axis, round-to-nearest (``quantize_nvfp4_1x16``)
    or stochastic (``quantize_nvfp4_1x16_sr``); 16x16 tiles, round-to-nearest; all with
    the ``"max"`` block scale rule and one tensor scale (4over6, row-scaled tensors and
    MS-EDEN take the XLA path).
    Stochastic rounding needs a threefry ``key`` (checked when given). Blocks along
    another axis (e.g. 16x1 along the token axis) take the XLA path."""
    reason = spec_unsupported_reason(fmt, block_scale_rule=block_scale_rule,
                                     row_scaled=row_scaled, rounding=rounding)
    if reason is not None:
        return reason
    if _mx_fp4(fmt):
        return ("the packed quantize kernels implement NVFP4 only (MXFP4 is quantized by "
                "fp4jax.dot's operand kernels; packed MXFP4 takes the XLA path)")
    from pallas_kernels.quantize import packed_sm90 as qk

    sr = rounding == "stochastic"
    if sr and (reason := _key_reason(key)) is not None:
        return reason
    name = jnp.dtype(dtype).name
    if block_2d:
        if sr:
            return "16x16 kernel implements round-to-nearest only (no stochastic rounding)"
        if len(shape) < 2:
            return "16x16 tiles need >= 2 dims"
        if shape[-2] % 16 or not qk.supported_2d((_rows(shape), shape[-1]), dtype):
            return (f"16x16 kernel needs bfloat16, rows % 16 == 0 and last axis %"
                    f" {16 * qk.G2D[-1]} == 0; got {name} {tuple(shape)}")
        return None if on_sm90() else "no sm_90 GPU"
    if len(shape) < 1 or not -len(shape) <= axis < len(shape):
        return f"axis={axis} out of range for shape {tuple(shape)}"
    if axis % len(shape) != len(shape) - 1:
        return ("the packed kernels block along the last axis (or 16x16 tiles); other "
                "axes take the XLA path")
    c, r = shape[-1], _rows(shape)
    if sr:
        if not qk.supported_sr((r, c), dtype):
            return (f"stochastic-rounding kernel needs bfloat16, rows % 4 == 0, last axis "
                    f"% 1024 == 0 and size < 2^31; got {name} {tuple(shape)}")
    elif not qk.supported((r, c), dtype):
        return (f"kernel needs bfloat16, last axis % 16 == 0 and size/16 % {qk.SUB} == 0;"
                f" got {name} {tuple(shape)}")
    if not on_sm90():
        return "no sm_90 GPU"
    return None


def is_supported(op: str, *args, **kwargs) -> bool:
    """``is_supported("quantize", shape, dtype, fmt=, axis=, block_2d=, rounding=)``,
    ``is_supported("w4a16_matmul", m, k, n, q=None)`` or ``is_supported("w4a4_matmul",
    m, k, n, qa=None, qb=None)``: True only on an sm_90 GPU."""
    if op == "quantize":
        return quantize_unsupported_reason(*args, **kwargs) is None
    if op == "w4a16_matmul":
        return w4a16_unsupported_reason(*args, **kwargs) is None
    if op == "w4a4_matmul":
        return w4a4_unsupported_reason(*args, **kwargs) is None
    raise ValueError(f"unknown op {op!r}: use quantize, w4a16_matmul or w4a4_matmul")


def _check_sr_key(rounding: str, key) -> None:
    if rounding not in ("nearest", "stochastic", "ms_eden"):
        raise ValueError(f"rounding must be 'nearest', 'stochastic' or 'ms_eden', got "
                         f"{rounding!r}")
    if rounding != "nearest" and key is None:
        raise ValueError(f"key: {rounding!r} rounding needs a PRNG key, pass "
                         "key=jax.random.key(seed) (a new key per call)")


def quantize_packed(x: jax.Array, *, block_2d: bool = False, rounding: str = "nearest",
                    key=None, backend: str = "auto"):
    """NVFP4 quantization, 1x16 blocks along the last axis (round-to-nearest or, with
    ``rounding="stochastic"`` and ``key``, stochastic) or (``block_2d``) 16x16 tiles over
    the last two axes (round-to-nearest), packed.

    Returns ``(packed uint8 (..., C/2), scale_bits, dec float32)``: ``packed`` is
    ``fp4jax.pack_e2m1(q.data)``, ``scale_bits`` the bits of ``q.scale`` (uint8
    (..., C/16), or (..., R/16, C/16) for 16x16) and ``dec`` is ``q.global_scale`` of
    ``q = fp4jax.quantize(x, fp4jax.NVFP4, block_2d=block_2d, rounding=rounding,
    key=key)``.
    """
    from pallas_kernels.quantize import packed_sm90 as qk

    _check_sr_key(rounding, key)
    backend = _resolve(backend)
    reason = quantize_unsupported_reason(x.shape, x.dtype, block_2d=block_2d,
                                         rounding=rounding, key=key)
    if backend == "pallas" and reason is not None:
        raise ValueError(f"pallas quantize kernel unavailable: {reason}")
    if backend == "xla" or reason is not None:
        q = qz.quantize(x, NVFP4, block_2d=block_2d, rounding=rounding, key=key)
        return (qz.pack_e2m1(q.data), jax.lax.bitcast_convert_type(q.scale, jnp.uint8),
                q.global_scale)
    c = x.shape[-1]
    if block_2d:
        # stacked matrices are stacked rows: 16-row tiles never straddle two matrices
        r = x.shape[-2]
        packed, sbits, dec = qk.quantize_nvfp4_2d(x.reshape(-1, c))
        return (packed.reshape(*x.shape[:-1], c // 2),
                sbits.reshape(*x.shape[:-2], r // 16, c // 16), dec)
    if rounding == "stochastic":
        # uniform_from_key views x as (prod(leading), C): the same as the 2D reshape
        packed, sbits, dec = qk.quantize_nvfp4_1x16_sr(x.reshape(-1, c), key)
    else:
        packed, sbits, dec = qk.quantize_nvfp4_1x16(x.reshape(-1, c))
    return (packed.reshape(*x.shape[:-1], c // 2), sbits.reshape(*x.shape[:-1], c // 16), dec)


def quantize(x: jax.Array, fmt=None, *, axis: int = -1, block_2d: bool = False,
             rounding: str = "nearest", key=None, backend: str = "auto",
             block_scale_rule: str = "max", row_scaled: bool = False,
             eden_group: int = 128):
    """Drop-in for ``fp4jax.quantize`` that uses a kernel when one applies (1x16 along the
    last axis with either rounding, 16x16 round-to-nearest; the ``"max"`` block scale
    rule, one tensor scale: 4over6, ``row_scaled`` and MS-EDEN run ``fp4jax.quantize``).

    The kernel result is unpacked into a ``QuantizedArray`` (one extra XLA pass over the
    packed bytes); callers that can consume packed data should use ``quantize_packed``.
    """
    fmt = NVFP4 if fmt is None else fmt
    _check_sr_key(rounding, key)
    backend = _resolve(backend)
    reason = quantize_unsupported_reason(x.shape, x.dtype, fmt=fmt, axis=axis,
                                         block_2d=block_2d, rounding=rounding, key=key,
                                         block_scale_rule=block_scale_rule,
                                         row_scaled=row_scaled)
    if backend == "pallas" and reason is not None:
        raise ValueError(f"pallas quantize kernel unavailable: {reason}")
    if backend == "xla" or reason is not None:
        return qz.quantize(x, fmt, axis=axis, block_2d=block_2d, rounding=rounding, key=key,
                           block_scale_rule=block_scale_rule, row_scaled=row_scaled,
                           eden_group=eden_group)
    fmt = get_format(fmt)
    packed, sbits, dec = quantize_packed(x, block_2d=block_2d, rounding=rounding, key=key,
                                         backend="pallas")
    data = qz.unpack_e2m1(packed, x.shape[-1], axis=-1)
    scale = jax.lax.bitcast_convert_type(sbits, jnp.float8_e4m3fn)
    if block_2d:
        return qz.QuantizedArray(data, scale, dec, fmt, None, True)
    return qz.QuantizedArray(data, scale, dec, fmt, -1, False)


# ---------------------------------------------------------------------------
# W4A16 GEMM.
# ---------------------------------------------------------------------------


def w4a16_unsupported_reason(m: int, k: int, n: int, q=None) -> str | None:
    """None when ``w4a16_matmul`` runs the kernel for x (m, k) @ W (k, n), else why not."""
    if q is not None:
        if not _nvfp4(q.fmt):
            return "kernel implements NVFP4 weights only"
        if not q.block_2d and q.axis % q.ndim != 0:
            return "W must be scaled along K (axis=0 or 16x16 tiles)"
    if m > 256:
        return f"M <= 256 only (decode / small batches), got {m}"
    if k % 64 or n % 64:
        return f"K % 64 == 0 and N % 64 == 0 needed, got K={k}, N={n}"
    if not on_sm90():
        return "no sm_90 GPU"
    return None


def prepare_weight(q):
    """Kernel layout of an NVFP4 weight ``QuantizedArray`` (K, N): ``(wp, ws, dec)``.

    Do this once per weight (an XLA relayout of the codes and scales; see
    ``pallas_kernels/gemm/w4a16_sm90.py``)."""
    from pallas_kernels.gemm import w4a16_sm90 as wk

    return wk.prepare_weight(q)


def w4a16_matmul(x: jax.Array, q, *, prepared=None, out_dtype=None, backend: str = "auto"):
    """``x (..., K) @ dequantize(q)`` for an NVFP4 weight ``q`` (K, N).

    ``prepared``: the ``(wp, ws, dec)`` of ``prepare_weight(q)`` if already made.
    ``out_dtype`` defaults to ``x.dtype``. The XLA path computes
    ``dot(x, dequantize(q, float32))`` in float32.
    """
    from pallas_kernels.gemm import w4a16_sm90 as wk

    backend = _resolve(backend)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    k, n = q.data.shape
    lead = x.shape[:-1]
    m = 1
    for d in lead:
        m *= d
    reason = w4a16_unsupported_reason(m, k, n, q)
    if reason is None and x.dtype != jnp.bfloat16:
        reason = f"x must be bfloat16, got {x.dtype}"
    if backend == "pallas" and reason is not None:
        raise ValueError(f"pallas W4A16 kernel unavailable: {reason}")
    if backend == "xla" or reason is not None:
        w = qz.dequantize(q, jnp.float32)
        y = jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
        return y.astype(out_dtype)
    wp, ws, dec = prepared if prepared is not None else wk.prepare_weight(q)
    y = wk.w4a16_matmul(x.reshape(m, k), wp, ws, dec, out_dtype=out_dtype)
    return y.reshape(*lead, n)


# ---------------------------------------------------------------------------
# W4A4 GEMM (packed NVFP4 / MXFP4 x packed NVFP4 / MXFP4).
# ---------------------------------------------------------------------------

def w4a4_unsupported_reason(m: int, k: int, n: int, qa=None, qb=None) -> str | None:
    """None when ``w4a4_matmul`` runs the kernel for A (m, k) @ B (k, n), else why not
    (the decode kernel + bf16 GEMM needs M % 64, N % 64 and K % 256 == 0)."""
    from pallas_kernels.gemm.w4a4_sm90 import operand_unsupported_reason

    for name, q, ax in (("A", qa, 1), ("B", qb, 0)):
        if q is None:
            continue
        reason = _e2m1_reason(q.fmt) or operand_unsupported_reason(q, ax)
        if reason is not None:
            return f"{reason} ({name})"
    if m % 64 or n % 64 or k % 256:
        return f"M % 64 == 0, N % 64 == 0 and K % 256 == 0 needed, got M={m}, K={k}, N={n}"
    if not on_sm90():
        return "no sm_90 GPU"
    return None


def prepare_w4a4(qa, qb):
    """Kernel layouts of NVFP4 or MXFP4 A (M, K) and B (K, N): ``((aq, as, dec_a), (bq, bs,
    dec_b))`` (see ``gemm/w4a4_sm90``). Do this once per weight."""
    from pallas_kernels.gemm import w4a4_sm90 as w4

    return w4.prepare_a(qa), w4.prepare_b(qb)


def w4a4_matmul(qa, qb, *, prepared_a=None, prepared_b=None, out_dtype=jnp.bfloat16,
                backend: str = "auto"):
    """``dequantize(qa) @ dequantize(qb)`` for NVFP4 or MXFP4 (mixed allowed) ``qa`` (M, K)
    and ``qb`` (K, N), both scaled along K. Returns (M, N) ``out_dtype`` (bfloat16 or
    float32).

    ``prepared_a`` / ``prepared_b``: the kernel layouts (``prepare_w4a4``) if already
    made. The kernel decodes each operand to exact bf16 ``q * s`` and runs a bf16 GEMM
    with the tensor scales in its epilogue. The XLA path computes
    ``dot(dequantize(qa), dequantize(qb))`` in float32 (HIGHEST). Kernel results equal it
    up to float32 accumulation order.
    """
    from pallas_kernels.gemm import w4a4_sm90 as w4

    backend = _resolve(backend)
    if qa.ndim != 2 or qb.ndim != 2 or qa.shape[1] != qb.shape[0]:
        raise ValueError(f"need A (M, K) and B (K, N), got {qa.shape} and {qb.shape}")
    (m, k), n = qa.shape, qb.shape[1]
    reason = w4a4_unsupported_reason(m, k, n, qa, qb)
    if backend == "pallas" and reason is not None:
        raise ValueError(f"pallas W4A4 kernel unavailable: {reason}")
    if backend == "xla" or reason is not None:
        y = jnp.dot(qz.dequantize(qa, jnp.float32), qz.dequantize(qb, jnp.float32),
                    precision=jax.lax.Precision.HIGHEST)
        return y.astype(out_dtype)
    pa = prepared_a if prepared_a is not None else w4.prepare_a(qa)
    pb = prepared_b if prepared_b is not None else w4.prepare_b(qb)
    return w4.w4a4_matmul_two_pass(*pa, *pb, out_dtype=out_dtype,
                                   scale_a=w4.scale_format(qa.fmt),
                                   scale_b=w4.scale_format(qb.fmt))
