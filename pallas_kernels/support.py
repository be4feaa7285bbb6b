"""Where the kernels run and what they implement: the device checks, the kernels' coverage
by quantization spec (the one statement of it), and the small predicates every kernel
family shares."""

from __future__ import annotations

from typing import Any

import jax

from fp4jax.formats import NVFP4, get_format

__all__ = ["MOSAIC_API", "e2m1_reason", "interpret_params", "is_mx_fp4", "is_nvfp4",
           "is_threefry", "mosaic_api_reason", "on_sm90", "on_sm100", "spec_unsupported_reason"]


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


MOSAIC_API = ((0, 10), (0, 11))
"""The JAX releases (major, minor) on whose GPUs the Hopper kernels have been run and
checked (the Hopper provider declines on any other: the reference runs). JAX 0.12 changed
the Mosaic GPU API (``plgpu.load`` takes one indexed ref, ``plgpu.transpose_ref`` was
removed); the kernels make those calls through ``mosaic_compat``, and on JAX 0.12.1 they
pass their interpret-mode tests (bit for bit) and lower to Mosaic GPU for CUDA (the
kernel tests' ``lower_for_cuda`` cases, the benchmark's dry run), but their CUDA
compilation and run there are unverified: 0.12 joins this once checked on a GPU. The CPU
tests' interpret mode is not gated by this."""

_VERIFIED_ELSEWHERE = {(0, 12): "on JAX 0.12 the kernels pass their interpret-mode tests "
                                "and lower for CUDA, but their CUDA compile and run there "
                                "are unverified"}


def mosaic_api_reason() -> str | None:
    """None when the Hopper kernels have been run on a GPU with this JAX's Mosaic GPU API
    (``MOSAIC_API``), else why the provider declines it (the reference runs)."""
    try:
        version = tuple(int(p) for p in jax.__version__.split(".")[:2])
    except ValueError:
        return f"unrecognised JAX version {jax.__version__!r}"
    if version in MOSAIC_API:
        return None
    known = ", ".join(f"{a}.{b}" for a, b in MOSAIC_API)
    why = _VERIFIED_ELSEWHERE.get(version, "its Mosaic GPU API may have changed")
    return (f"the Hopper kernels are verified on GPUs with the Mosaic GPU API of JAX "
            f"{known}; this is JAX {jax.__version__} ({why}): the reference runs")


def is_nvfp4(fmt: Any) -> bool:
    """Whether ``fmt`` is NVFP4 itself: the only format of the quantize, operand and W4A16
    kernels besides the MX FP4 operands (any other element type, FP6/FP8 included, takes
    the XLA path)."""
    return fmt == NVFP4 or fmt == "nvfp4"


def e2m1_reason(fmt: Any) -> str | None:
    """None when ``fmt`` stores E2M1 elements, else why the Hopper kernels cannot take it:
    they quantize to and decode 4-bit E2M1 codes only (FP6/FP8 formats run on XLA)."""
    f = get_format(fmt)
    if (f.elem_exp_bits, f.elem_man_bits) != (2, 1):
        return (f"the kernels implement E2M1 (FP4) elements only, got format {f.name!r} with "
                f"E{f.elem_exp_bits}M{f.elem_man_bits} elements: it runs on the XLA path")
    return None


def is_mx_fp4(fmt: Any) -> bool:
    """Whether ``fmt`` (a ``BlockFormat``, its name or None) is an MX FP4 format of the
    operand kernels (``quantize/common_sm90.is_mx``: MXFP4, MXFP4_OCP)."""
    if fmt is None or is_nvfp4(fmt):
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
    only (``dispatch.quantize_unsupported_reason``)."""
    if fmt is not None and not is_nvfp4(fmt) and not is_mx_fp4(fmt):
        return e2m1_reason(fmt) or (f"the kernels implement NVFP4 and MXFP4 (blocks of 32, "
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


def interpret_params(mode: str) -> dict:
    """Kernel keyword arguments for ``mode``: Mosaic GPU's interpret mode for
    ``"interpret"`` (CPU tests, JAX >= 0.10), nothing otherwise."""
    if mode != "interpret":
        return {}
    from pallas_kernels.mosaic_compat import interpret_gpu_params

    return {"interpret": interpret_gpu_params()}


def is_threefry(key: Any) -> bool:
    """Whether ``key`` is a typed threefry key (the kernels compute Threefry-2x32 draws)."""
    return "threefry" in str(jax.random.key_impl(key)).lower()
