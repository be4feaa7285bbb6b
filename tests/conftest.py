"""Test session set-up: 4 virtual CPU devices (for sharding tests), float32 defaults, XLA:CPU's
faster compiles."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=4"
# The suite's time is mostly XLA:CPU compiling tiny programs (a micro NVFP4 train step: 42 s
# at the default optimization level, 19 s without LLVM's optimizations). What changes: the
# order of float32 sums (at the default level XLA:CPU lets LLVM vectorize reductions, which
# reorders them), so a sum or mean may differ in its last bit; maxima, comparisons and the
# quantizers' element-wise arithmetic give the same bits (every bit-exact test passes at
# both levels). Tests of float32 sums allow their rounding. FP4JAX_TEST_XLA_OPT=1 runs the
# suite at XLA's default level.
if os.environ.get("FP4JAX_TEST_XLA_OPT", "0") != "1":
    for flag in ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"):
        if flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
            os.environ["XLA_FLAGS"] += " " + flag
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import gc  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

# Python's cyclic garbage collector, at its default thresholds, runs a full collection over
# the millions of objects JAX's tracing and caches keep alive every few hundred thousand
# allocations: 5.6% of the process time of three harness tests (3.1 of 55 s, 1,847
# collections). Objects alive after the imports are frozen (never traversed again) and the
# collections are rarer (1.4 s, 20 collections); cycles are still collected, so memory is
# not leaked.
gc.freeze()
gc.set_threshold(50_000, 50, 100)

# Tests compare float32 matmuls against NumPy: on GPUs the default precision is
# reduced (TF32-like), so ask for full float32 everywhere (no effect on CPU).
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session", autouse=True)
def _shared_compile_cache(tmp_path_factory):
    """One persistent XLA compilation cache for the session, shared by the xdist workers
    (the same jitted functions and eager ops recur across test files and workers): compiled
    executables are reused, numerics are unaffected. Fresh for every run (under pytest's
    temporary directory), so nothing carries over between runs."""
    try:
        from jax._src import compilation_cache as cc
    except ImportError:  # pragma: no cover
        yield
        return
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    old = {n: getattr(jax.config, n) for n in names}
    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "xla_cache_session"
    path.mkdir(exist_ok=True)
    jax.config.update(names[0], str(path))
    jax.config.update(names[1], float(os.environ.get("FP4JAX_TEST_CACHE_MIN_S", "0")))
    jax.config.update(names[2], 0)
    cc.reset_cache()
    # CLI tests pass ``--compile-cache auto``, which takes $JAX_COMPILATION_CACHE_DIR: their
    # runs and a parallel sweep's worker processes then share this cache with the rest of
    # the session (numerics unaffected), and nothing is written to ~/.cache/fp4jax/xla
    old_env = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(path)
    yield
    if old_env is None:
        os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    else:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = old_env
    for n, v in old.items():
        jax.config.update(n, v)
    cc.reset_cache()


@pytest.fixture
def keep_compile_cache():
    """``--compile-cache off`` (``fp4jax.train.cli.main``) turns JAX's process-wide persistent
    cache off: put the session's setting back after the test."""
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    old = {n: getattr(jax.config, n) for n in names}
    yield
    for n, v in old.items():
        jax.config.update(n, v)


@pytest.fixture(scope="module")
def mesh():
    """A 1-D ``("data",)`` mesh over the first 4 devices (the forced virtual CPU devices);
    skips when fewer are present. Shared by the data-parallel tests."""
    import numpy as np
    from jax.sharding import Mesh

    devs = jax.devices()
    if len(devs) < 4:
        pytest.skip(f"needs 4 devices, got {len(devs)}")
    return Mesh(np.array(devs[:4]), ("data",))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "heavy(seconds): a compile-heavy test, with its time on 2 CI cores; the "
        "suite starts these first, longest first; also slow")
    config.addinivalue_line(
        "markers", "slow: left out of the fast tier (pytest -m 'not slow', tests/README.md)")


# Test files whose every test is slow: each trains (the harness, its CLI, sweeps,
# notebooks) or compiles much (kernels in interpret mode, the experiments' scripts); the
# fast tier (``-m "not slow"``) leaves them to the full suite. Paths relative to tests/.
SLOW_FILES = frozenset({
    "docs/test_notebooks.py",
    "experiments",
    "kernels",
    "train/test_auto_precision.py",
    "train/test_cli_recipes.py",
    "train/test_multiprocess.py",
    "train/test_outcontrol.py",
    "train/test_param_gather.py",
    "train/test_safety.py",
    "train/test_stats.py",
    "train/test_sweep.py",
    "train/test_train.py",
})


# Tests elsewhere that compile for long (each over ~40 s at -n 0 on the shared 2-core
# machine, JAX 0.12, 2026-12-07): "file::test" relative to tests/, every parametrization.
SLOW_TESTS = frozenset({
    # end-to-end cases whose pieces stay fast (2026-12-07: the fast tier at 318 s on 2 cores)
    "dot/test_dot.py::test_dot_general_works_as_flax_dot_general",
    "recipes/test_quartet2.py::test_quartet2_dot_forward_backward",
    "dot/test_ragged.py::test_ragged_dot_is_per_expert_dot_bit_for_bit[nvfp4-layer-rht]",
    "core/test_four_over_six.py::test_reference_ftz_is_inert_on_normal_inputs",
    "dot/test_amax_scope.py::test_local_scope_is_each_shard_alone",
    "nn/test_outcontrol.py::test_llama_layers_carry_the_collections",
    "nn/test_outcontrol.py::test_scanned_blocks_take_each_blocks_own_split",
    "nn/test_model.py::test_scan_layers_is_the_same_function",
    "nn/test_rules.py::test_linen_bit_identical_to_hand_wired",
    "nn/test_rules.py::test_quantize_model_under_data_parallel_equals_one_device",
    "nn/test_rules.py::test_nnx_bit_identical_to_hand_wired",
    "nn/test_rules.py::test_weight_as_lhs_and_setup_style_modules",
    "nn/test_functional.py::test_loss_and_gradients_equal_the_hand_wired_model",
    "nn/test_functional.py::test_weight_on_the_left_takes_the_weight_role",
    "nn/test_moe.py::test_rules_put_linen_experts_on_ragged_dot",
    "nn/test_moe.py::test_moe_llama_trains_with_the_aux_loss",
    "nn/test_rules_operands.py::"
    "test_a_layer_whose_input_has_its_transposed_kernels_shape_is_quantized",
    # Out of the fast tier on 2026-12-07 (issue 57: the fast tier took 11.5-19 min on the
    # shared 2-core machine; test CPU seconds at -n 2 on JAX 0.10.2 in brackets). Runs of
    # the harness's CLI on foreign models, each training end to end (a fast test still runs
    # the harness's train and eval steps on a foreign model:
    # test_harness.py::test_train_step_and_eval_step_on_a_tiny_model):
    "train/test_harness.py::test_cli_trains_a_linen_model_with_rules_and_resumes_exactly",  # 28
    "train/test_harness.py::test_cli_trains_an_nnx_model_from_a_file",  # 18
    "train/test_harness.py::test_cli_compares_recipes_on_a_foreign_model",  # 30
    "train/test_harness.py::test_cli_grad_noise_and_auto_switch_on_a_foreign_model",  # 11
    "train/test_harness.py::test_cli_bf16_layers_auto_and_stats_on_a_linen_model",  # 34
    "train/test_harness.py::test_cli_stats_on_an_nnx_model",  # 19
    # other end-to-end training runs (the loop's checkpoints and resume stay in the fast
    # tier through test_harness.py::test_checkpoints_save_resume_round_trip)
    "train/test_pipelining.py::test_pipelined_run_records_what_the_synchronous_loop_records",  # 37
    "train/test_oscillation.py::test_harness_records_resets_and_resumes_exactly",  # 19
    "train/test_tokens.py::test_train_cli_on_tokenized_corpus_resumes_exactly",  # 10
    "train/test_harness_edges.py::test_resume_with_edited_model_code_is_refused",  # 8
    # the micro Llama's train step against its golden bits, 5 recipes (23; nvfp4 alone ~60 s
    # of wall on one worker)
    "nn/test_llama_rules.py::test_micro_train_step_bits_are_the_old_llamas",
    # the fused operand kernels in Mosaic GPU interpret mode (as tests/kernels, slow)
    "dot/test_sharding.py::test_kernels_quantize_a_row_shard_as_the_whole_tensor",  # 21
    # models compiled whole under a mesh or a scan (the sharded dot and the RHT keys per
    # layer stay in the fast tier at the GEMM and layer level: test_sharding.py,
    # test_rht_policy.py's others)
    "nn/test_attention.py::test_sharded_eval_equals_one_device",  # 14
    "recipes/test_rht_policy.py::test_scanned_llama_gives_each_layer_its_own_key",  # 8
    # one parametrization of a test whose others stay fast ("file::test[id]"): the kernels
    # in interpret mode (as tests/kernels), the second recipe or size of a GEMM-level check
    "core/test_te_codes.py::test_packed_kernels_give_the_core_codes[False]",  # 6
    "core/test_te_codes.py::test_packed_kernels_give_the_core_codes[True]",  # 5 (12-07)
    # the hybrid's jitted VJP against the recipe (issue 57, 12-07; 6 CPU s): its MXFP8
    # forward stays fast through [mxfp8], its NVFP4 backward through
    # dot/test_dot.py::test_backward_nvfp4_matches_manual_recipe, its structure through
    # test_formats.py's recipe tests, SR same-key bits under jit through test_jit_grad_vmap
    "core/test_formats.py::test_new_recipes_forward_and_backward[mxfp8_fwd_nvfp4_bwd]",
    "dot/test_amax_scope.py::test_amax_collectives[interpret]",  # 5
    "dot/test_dot.py::test_reference_gemms_are_dots_forward_and_vjp_bit_for_bit[quartet2]",  # 9
    "dot/test_ragged.py::test_ragged_dot_is_per_expert_dot_bit_for_bit[mxfp4]",  # 5
    "dot/test_sharding.py::test_sharded_dot_equals_one_device[fp4_all_the_way]",  # 4
    "recipes/test_rht_policy.py::test_layer_signs_are_the_fixed_vector_drawn_from_rht_key[128]",
    "dot/test_sharding.py::test_sharded_dot_equals_one_device[mxfp4]",  # 4
    "dot/test_ragged_edges.py::test_negative_traced_sizes_give_nan[fp4_all_the_way]",  # 3
    # the Pallas operand kernel in interpret mode against the XLA path (as tests/kernels)
    "dot/test_implementation.py::test_argument_overrides_the_environment",  # 10
    # the harness's NNX wrapper compiled whole, forward and gradient (NNX models under the
    # rules stay fast: nn/test_rules.py)
    "train/test_harness.py::test_nnx_model_as_a_pure_function",  # 16
})


def is_slow(relpath: str, marks: set[str], name: str = "", params: str = "") -> bool:
    """Whether the test ``name`` (without its parameters; ``params``: its ``[id]`` suffix,
    if any) of file ``relpath`` (relative to ``tests/``) is slow: marked ``slow`` or
    ``heavy(seconds)``, in one of ``SLOW_FILES`` (a file, or a folder) or one of
    ``SLOW_TESTS`` (every parametrization, or the one named with its ``[id]``)."""
    if marks & {"slow", "heavy"}:
        return True
    relpath = relpath.replace(os.sep, "/")
    parts = relpath.split("/")
    return (any("/".join(parts[:i]) in SLOW_FILES for i in range(1, len(parts) + 1))
            or f"{relpath}::{name}" in SLOW_TESTS
            or bool(params) and f"{relpath}::{name}{params}" in SLOW_TESTS)


def pytest_ignore_collect(collection_path, config):
    """Under exactly ``-m "not slow"`` (the fast tier) the files of ``SLOW_FILES`` are not
    imported at all: every test in them would be deselected, and importing them costs
    ~3 CPU seconds a worker (module-level arrays compiled eagerly, the kernels' Pallas
    imports). Any other ``-m`` (or none) collects them as usual."""
    if (config.getoption("markexpr", "") or "").strip() != "not slow":
        return None
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    rel = os.path.relpath(str(collection_path), tests_dir).replace(os.sep, "/")
    if rel.startswith(".."):
        return None
    parts = rel.split("/")
    if any("/".join(parts[:i]) in SLOW_FILES for i in range(1, len(parts) + 1)):
        return True
    return None


def pytest_itemcollected(item):
    """Marks the slow tests ``slow`` (``is_slow``), so ``-m "not slow"`` selects the fast
    tier."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    rel = os.path.relpath(str(item.path), tests_dir)
    name = getattr(item, "originalname", None) or item.name.split("[", 1)[0]
    params = item.name[len(name):] if item.name.startswith(name + "[") else ""
    if is_slow(rel, {m.name for m in item.iter_markers()}, name, params):
        item.add_marker(pytest.mark.slow)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist sends the worker's ids to the controller
def pytest_collection_finish(session):
    """Under ``--dist loadgroup`` every test marked ``xdist_group`` must carry its group in
    its node id (pytest-xdist's suffix ``@group``, which its scheduler groups by). pytest
    9.2 keeps a node's id in ``_id`` while pytest-xdist 3.8 still renames ``_nodeid``, so
    there the suffix is silently lost, every group is split over the workers and the suite
    compiles its shared steps on both (about 2x the CI time): add it here where it is
    missing (pyproject's dev extra also keeps pytest below 9.2)."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    for item in session.items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if not names or "@" in item.nodeid:
            continue
        new = f"{item.nodeid}@{'_'.join(names)}"
        if hasattr(item, "_id"):  # pytest >= 9.2
            from _pytest.nodeid import NodeId

            item._id = NodeId.parse(new)
        else:
            item._nodeid = new


def pytest_collection_modifyitems(config, items):
    """Longest first: the tests marked ``heavy(seconds)`` run before all others, in
    decreasing ``seconds`` (the rest keep their order). Under ``-n 2 --dist loadgroup`` the
    workers take them in this order, so the last tests to start are short ones and both
    workers finish at about the same time; the order is the same on every worker (xdist
    checks that)."""

    def seconds(item) -> float:
        mark = item.get_closest_marker("heavy")
        return float(mark.args[0]) if mark is not None and mark.args else 0.0

    items.sort(key=lambda item: -seconds(item))


# --- where the suite's time goes (opt-in): FP4JAX_TEST_COMPILE_LOG=FILE appends one JSON
# line per test phase with its wall seconds and the seconds this process spent tracing,
# lowering and compiling (XLA backend compile, persistent-cache reads included), and its
# persistent-cache hits and misses, and the CPU seconds of the process and of its waited-for
# child processes since the previous line (CLI tests' children: only their CPU is seen).
_COMPILE_LOG = os.environ.get("FP4JAX_TEST_COMPILE_LOG")
_COMPILE_ACC: dict[str, float] = {}
if _COMPILE_LOG:
    from jax import monitoring as _monitoring

    _EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
               "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
               "/jax/core/compile/backend_compile_duration": "compile_s"}

    def _on_duration(event: str, secs: float, **_: object) -> None:
        k = _EVENTS.get(event)
        if k:
            _COMPILE_ACC[k] = _COMPILE_ACC.get(k, 0.0) + secs
            if k == "compile_s":
                _COMPILE_ACC["compiles"] = _COMPILE_ACC.get("compiles", 0) + 1

    def _on_event(event: str, **_: object) -> None:
        k = {"/jax/compilation_cache/cache_hits": "cache_hits",
             "/jax/compilation_cache/cache_misses": "cache_misses"}.get(event)
        if k:
            _COMPILE_ACC[k] = _COMPILE_ACC.get(k, 0) + 1

    _monitoring.register_event_duration_secs_listener(_on_duration)
    _monitoring.register_event_listener(_on_event)

    import logging as _logging
    import re as _re

    _COMPILED: list = []  # (name, seconds, "hit" | "miss" | "") of each backend compile
    _PROGRAM_MIN_S = float(os.environ.get("FP4JAX_TEST_COMPILE_LOG_MIN_S", "0.2"))

    class _CompileNames(_logging.Handler):
        """Reads JAX's debug lines: the persistent cache's hit/miss for a module, then
        "Finished XLA compilation of NAME in S sec"."""

        _pending: dict = {}

        def emit(self, record: _logging.LogRecord) -> None:
            msg = record.getMessage()
            m = _re.match(r"(Persistent compilation cache hit|PERSISTENT COMPILATION CACHE "
                          r"MISS) for '([^']+)'", msg)
            if m:
                self._pending[m.group(2)] = "hit" if m.group(1).endswith("hit") else "miss"
                return
            m = _re.match(r"Finished XLA compilation of (.+) in ([0-9.e-]+) sec", msg)
            if m:
                name = m.group(1)
                key = _re.sub(r"^(\w+)\((.*)\)$", r"\1_\2", name)  # jit(f) -> jit_f
                _COMPILED.append((name, round(float(m.group(2)), 3),
                                  self._pending.pop(key, "")))

    for _name in ("jax._src.dispatch", "jax._src.compiler"):
        _lg = _logging.getLogger(_name)
        _lg.setLevel(_logging.DEBUG)
        _lg.addHandler(_CompileNames(level=_logging.DEBUG))

    import resource as _resource

    def _cpu_seconds() -> tuple[float, float]:
        """User + system CPU seconds of this process and of its waited-for children."""
        own = _resource.getrusage(_resource.RUSAGE_SELF)
        kids = _resource.getrusage(_resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime

    _CPU_LAST = [_cpu_seconds()]

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(item, call):
        yield
        import json

        now = _cpu_seconds()
        (own0, kids0), _CPU_LAST[0] = _CPU_LAST[0], now
        rec = {"test": item.nodeid, "phase": call.when,
               "wall_s": round(call.duration, 3),
               "cpu_s": round(now[0] - own0, 3), "child_cpu_s": round(now[1] - kids0, 3),
               "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
               **{k: round(v, 3) for k, v in _COMPILE_ACC.items()},
               "programs": [c for c in _COMPILED if c[1] >= _PROGRAM_MIN_S]}
        _COMPILE_ACC.clear()
        _COMPILED.clear()
        with open(_COMPILE_LOG, "a") as f:
            f.write(json.dumps(rec) + "\n")
