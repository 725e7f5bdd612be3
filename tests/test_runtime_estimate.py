"""The cost model's estimates for Inductor's overlap scheduler (``runtime/estimate.py``).

Hand-made post-grad nodes (fake tensors, no device): a GEMM's estimate is ``costs.gemm_time``
of its shape on the machine, a collective's is ``costs.collective_time`` of its shard, in
milliseconds; anything else, a symbolic shape, or no machine gives None (Inductor's own).
Then one real ``torch.compile`` on two gloo ranks with the overlap scheduler on: it asks the
hook for the GEMMs and the all-gather, and the compiled function gives the eager values.
"""

import pickle
from pathlib import Path

import pytest
import torch
import torch._inductor.config as inductor_config
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ficco_select import costs
from ficco_select.hardware import HardwareError, load_hardware
from ficco_select.runtime import dispatch
from ficco_select.runtime.estimate import install_estimates, runtime_estimate
from helpers.ranks import spawn

aten, c10d = torch.ops.aten, torch.ops._c10d_functional
H100 = "h100-nvswitch"


@pytest.fixture(autouse=True)
def fresh_dispatch(monkeypatch):
    monkeypatch.delenv("FICCO_HARDWARE", raising=False)
    dispatch.reset()
    yield
    dispatch.reset()


def node(target, *args, out=None):
    """A call node of `target` in a graph of its own; tensor args become placeholders whose
    ``meta['val']`` is the tensor (as post-grad nodes carry their fake values)."""
    graph = torch.fx.Graph()
    fx_args = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            a_node = graph.placeholder(f"arg{i}")
            a_node.meta["val"] = a
            a = a_node
        fx_args.append(a)
    call = graph.call_function(target, tuple(fx_args))
    if out is not None:
        call.meta["val"] = out
    return call


def fake(*shape, dtype=torch.bfloat16, device="cpu"):
    with FakeTensorMode():
        return torch.empty(*shape, dtype=dtype, device=device)


def gemm_ms(hw_name, M, N, K, dtype="bfloat16", dtype_bytes=2):
    hw = load_hardware(hw_name)
    return float(costs.gemm_time(hw, M, N, K, dtype_bytes, hw.peak_of(dtype) * 1e12)) * 1e3


def collective_ms(hw_name, op, shard_bytes, P):
    return float(costs.collective_time(load_hardware(hw_name), costs.OP_CODES[op], shard_bytes, P)) * 1e3


# -- GEMMs ------------------------------------------------------------------------------------
def test_an_mm_is_the_cost_models_gemm_time_in_ms():
    # Few output tiles over a long contraction: N and K swapped gives another time.
    mm = node(aten.mm.default, fake(256, 16384), fake(16384, 256))
    got = runtime_estimate(mm, hardware=H100)
    assert got == pytest.approx(gemm_ms(H100, 256, 256, 16384), rel=1e-12)
    assert got != pytest.approx(gemm_ms(H100, 256, 16384, 256), rel=1e-3)
    assert 0.001 < got < 1  # milliseconds, not seconds or nanoseconds (2 GFLOP on an H100: ~25 us)


def test_addmm_reads_its_matrices_after_the_bias_and_float32_its_own_peak():
    addmm = node(aten.addmm.default, fake(1024, dtype=torch.float32), fake(512, 256, dtype=torch.float32),
                 fake(256, 1024, dtype=torch.float32))
    want = gemm_ms("mi300x-8", 512, 1024, 256, dtype="float32", dtype_bytes=4)
    assert runtime_estimate(addmm, hardware="mi300x-8") == pytest.approx(want, rel=1e-12)


def test_a_bmm_is_its_batch_of_gemms_with_one_launch():
    bmm = node(aten.bmm.default, fake(8, 128, 64), fake(8, 64, 256))
    one = gemm_ms(H100, 128, 256, 64)
    launch = load_hardware(H100).gemm_launch_us * 1e-3
    assert runtime_estimate(bmm, hardware=H100) == pytest.approx(8 * (one - launch) + launch, rel=1e-9)


def test_a_scaled_mm_runs_at_the_fp8_peak():
    a, b = fake(2048, 4096, dtype=torch.float8_e4m3fn), fake(4096, 2048, dtype=torch.float8_e4m3fn)
    scaled = node(aten._scaled_mm.default, a, b, fake(1, dtype=torch.float32), fake(1, dtype=torch.float32))
    want = gemm_ms(H100, 2048, 2048, 4096, dtype="float8_e4m3fn", dtype_bytes=1)
    assert runtime_estimate(scaled, hardware=H100) == pytest.approx(want, rel=1e-12)
    assert want < gemm_ms(H100, 2048, 2048, 4096)  # fp8's peak, not bfloat16's


def test_the_machine_is_the_one_dispatch_decides_with():
    mm = node(aten.mm.default, fake(1024, 1024), fake(1024, 4096))
    assert runtime_estimate(mm) == pytest.approx(gemm_ms("cpu", 1024, 4096, 1024), rel=1e-12)  # cpu tensors
    dispatch.configure(hardware="mi300x-8")
    assert runtime_estimate(mm) == pytest.approx(gemm_ms("mi300x-8", 1024, 4096, 1024), rel=1e-12)


# -- collectives ------------------------------------------------------------------------------
def test_an_all_gather_is_the_collective_time_of_its_input_shard():
    shard = fake(512, 4096)
    ag = node(c10d.all_gather_into_tensor.default, shard, 8, "tp", out=fake(4096, 4096))
    want = collective_ms(H100, "ag_gemm", 512 * 4096 * 2, 8)
    assert runtime_estimate(ag, hardware=H100) == pytest.approx(want, rel=1e-12)
    assert runtime_estimate(ag, hardware=H100) != pytest.approx(collective_ms(H100, "ag_gemm", 512 * 4096 * 2, 4))


def test_a_reduce_scatter_sends_one_of_its_P_blocks_to_each_peer():
    rs = node(c10d.reduce_scatter_tensor.default, fake(4096, 1024), "sum", 4, "tp", out=fake(1024, 1024))
    want = collective_ms("mi300x-8", "gemm_rs", 4096 * 1024 * 2 / 4, 4)
    assert runtime_estimate(rs, hardware="mi300x-8") == pytest.approx(want, rel=1e-12)


def test_override_sizes_scale_the_shard_and_zero_asks_the_fixed_cost():
    from torch._inductor.comm_analysis import estimate_fx_collective_size

    ag = node(c10d.all_gather_into_tensor.default, fake(512, 4096), 8, "tp", out=fake(4096, 4096))
    whole = estimate_fx_collective_size(ag)
    shard = 512 * 4096 * 2
    assert runtime_estimate(ag, whole, hardware=H100) == pytest.approx(runtime_estimate(ag, hardware=H100))
    assert runtime_estimate(ag, whole // 2, hardware=H100) == pytest.approx(
        collective_ms(H100, "ag_gemm", shard / 2, 8), rel=1e-9)
    assert runtime_estimate(ag, 0, hardware=H100) == pytest.approx(collective_ms(H100, "ag_gemm", 1, 8), rel=1e-12)


@pytest.fixture
def world_of_4():
    """A fake process group of 4 ranks in this process (collectives that name only their group)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


def test_an_all_reduce_takes_its_group_size_from_the_group(world_of_4):
    ar = node(c10d.all_reduce.default, fake(2048, 1024), "sum", world_of_4, out=fake(2048, 1024))
    want = collective_ms(H100, "gemm_ar", 2048 * 1024 * 2 / 4, 4)
    assert runtime_estimate(ar, hardware=H100) == pytest.approx(want, rel=1e-12)


def test_an_uneven_all_to_all_is_bounded_by_its_largest_piece(world_of_4):
    tokens = fake(100, 512)
    a2a = node(c10d.all_to_all_single.default, tokens, [10, 20, 30, 40], [40, 30, 20, 10], world_of_4,
               out=fake(100, 512))
    want = collective_ms(H100, "a2a_gemm", 40 * 512 * 2, 4)
    assert runtime_estimate(a2a, hardware=H100) == pytest.approx(want, rel=1e-12)


# -- None: Inductor's own estimate --------------------------------------------------------------
def test_other_ops_and_non_calls_are_left_to_inductor():
    relu = node(aten.relu.default, fake(64, 64), out=fake(64, 64))
    assert runtime_estimate(relu, hardware=H100) is None
    placeholder = next(iter(relu.graph.nodes))
    assert runtime_estimate(placeholder, hardware=H100) is None
    wait = node(c10d.wait_tensor.default, fake(64, 64), out=fake(64, 64))
    assert runtime_estimate(wait, hardware=H100) is None


def test_no_known_machine_is_left_to_inductor(monkeypatch):
    mm = node(aten.mm.default, fake(1024, 1024, device="cuda"), fake(1024, 1024, device="cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")  # no preset
    assert runtime_estimate(mm) is None
    assert runtime_estimate(mm, hardware="no-such-machine") is None
    dispatch.configure(hardware="no-such-machine")
    assert runtime_estimate(mm) is None
    dispatch.configure(hardware=H100)  # configured: known, whatever the GPU's name
    assert runtime_estimate(mm) == pytest.approx(gemm_ms(H100, 1024, 1024, 1024), rel=1e-12)


def test_symbolic_shapes_and_unreadable_nodes_are_left_to_inductor():
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        m = mode.shape_env.create_unbacked_symint()
        tokens = torch.empty(m, 1024, dtype=torch.bfloat16)
    assert runtime_estimate(node(aten.mm.default, tokens, fake(1024, 256)), hardware=H100) is None
    no_vals = torch.fx.Graph()
    a, b = no_vals.placeholder("a"), no_vals.placeholder("b")
    assert runtime_estimate(no_vals.call_function(aten.mm.default, (a, b)), hardware=H100) is None
    broken = node(c10d.all_gather_into_tensor.default, fake(8, 8), "not a size", "tp")
    assert runtime_estimate(broken, hardware=H100) is None  # never raises into Inductor


# -- installing -------------------------------------------------------------------------------
def test_install_sets_the_scheduler_and_restores_it():
    options = inductor_config.aten_distributed_optimizations
    before = (options.custom_runtime_estimation, options.enable_overlap_scheduling, options.compute_estimator)
    with install_estimates(hardware=H100) as estimates:
        assert options.custom_runtime_estimation is estimates
        assert options.enable_overlap_scheduling is True
        assert options.compute_estimator == "analytical"
        mm = node(aten.mm.default, fake(256, 512), fake(512, 128))
        assert estimates(mm, None) == pytest.approx(gemm_ms(H100, 256, 128, 512), rel=1e-12)
        assert [(e.kind, e.shape, e.hardware) for e in estimates.made] == [("gemm", (1, 256, 128, 512), H100)]
    assert (options.custom_runtime_estimation, options.enable_overlap_scheduling,
            options.compute_estimator) == before


def test_an_estimator_installed_before_answers_what_the_cost_model_leaves():
    options = inductor_config.aten_distributed_optimizations
    relu = node(aten.relu.default, fake(64, 64), out=fake(64, 64))
    mm = node(aten.mm.default, fake(256, 512), fake(512, 128))
    earlier = lambda n, size: 42.0  # noqa: E731
    with install_estimates(hardware=H100, enable_overlap_scheduling=False, compute_estimator=None):
        inner = options.custom_runtime_estimation
        options.custom_runtime_estimation = earlier  # a user's own estimator, then ours over it
        with install_estimates(hardware=H100) as estimates:
            assert estimates(relu, None) == 42.0
            assert estimates(mm, None) == pytest.approx(gemm_ms(H100, 256, 128, 512), rel=1e-12)
        assert options.custom_runtime_estimation is earlier
        options.custom_runtime_estimation = inner


def test_bad_settings_fail_at_install_naming_the_fix():
    with pytest.raises(HardwareError, match="presets"):
        install_estimates(hardware="no-such-machine")
    with pytest.raises(ValueError, match="compute_estimator"):
        install_estimates(compute_estimator="roofline")
    assert inductor_config.aten_distributed_optimizations.custom_runtime_estimation is None


def test_the_cache_key_holds_the_machine_not_the_record():
    # Inductor pickles its config into its FX graph cache key.
    with install_estimates(hardware=H100) as estimates:
        key = pickle.dumps(estimates)
        estimates(node(aten.mm.default, fake(256, 512), fake(512, 128)), None)
        assert pickle.dumps(estimates) == key
    assert pickle.loads(key).hardware == H100


# -- a real compile on gloo ranks -------------------------------------------------------------
def check_compiled_with_estimates(rank: int, P: int, tmp: Path) -> None:
    import torch.distributed._functional_collectives as funcol
    import torch.utils._runtime_estimation as roofline

    # Inductor's roofline (computed for every compute node before the hook's answer replaces
    # it) asks triton for the GPU's bandwidth and peak; this CPU-only build has no triton.
    roofline.get_gpu_dram_gbps = lambda: 100.0
    roofline.get_device_tflops = lambda dtype: 1.0
    group = dist.group.WORLD.group_name

    # Matmuls and a collective only: Inductor calls them as extern kernels, so nothing waits
    # for a C++ compiler (the caches are off, for the scheduler to ask the hook).
    def column_parallel(x_shard, w, bias, a, b):
        x = funcol.all_gather_tensor(x_shard, 0, group)  # (P * 8, 16)
        independent = a @ b  # can hide the all-gather
        return torch.addmm(bias, x, w), independent

    gen = torch.Generator().manual_seed(3 + rank)
    args = (torch.randn(8, 16, generator=gen), torch.randn(16, 24, generator=gen), torch.randn(24, generator=gen),
            torch.randn(32, 48, generator=gen), torch.randn(48, 40, generator=gen))
    torch._dynamo.reset()
    with inductor_config.patch(force_disable_caches=True), install_estimates() as estimates:
        got = torch.compile(column_parallel, fullgraph=True)(*args)
    torch.testing.assert_close(got, column_parallel(*args), rtol=1e-5, atol=1e-5)
    made = {(e.kind, e.shape): e.ms for e in estimates.made}
    assert all(e.hardware == "cpu" for e in estimates.made)  # the machine helpers.ranks configures
    assert made[("gemm", (1, 32, 40, 48))] == pytest.approx(gemm_ms("cpu", 32, 40, 48, "float32", 4), rel=1e-12)
    assert made[("gemm", (1, P * 8, 24, 16))] == pytest.approx(gemm_ms("cpu", P * 8, 24, 16, "float32", 4),
                                                               rel=1e-12)
    assert made[("collective", (8 * 16 * 4, P))] == pytest.approx(collective_ms("cpu", "ag_gemm", 8 * 16 * 4, P),
                                                                  rel=1e-12)
    assert {e.op for e in estimates.made} >= {"aten.mm.default", "aten.addmm.default",
                                              "_c10d_functional.all_gather_into_tensor.default"}


@pytest.mark.gloo
def test_a_compiled_all_gather_and_matmuls_ask_the_cost_model(tmp_path):
    spawn(check_compiled_with_estimates, 2, tmp_path)
