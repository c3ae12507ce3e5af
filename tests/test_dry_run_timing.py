"""The dry run's per-op compute time model (accelfn/dryrun/timing.py): GEMMs held to published measurements and
to the quantization arithmetic of NVIDIA's guide, memory-bound ops to bytes over bandwidth, the eager launch
floor, fp8 at the fp8 peak, attention from its shapes; `OpTimer` over real autograd graphs on fake tensors, its
sums recomputed here from the shapes."""

from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from accelfn.dryrun.timing import OpTimer, TimingAssumptions, matmul_time
from accelfn.platforms.specs import spec

H100 = spec("h100-sxm")


@pytest.mark.parametrize(
    "key, tflops, shape",
    [  # ml-engineering's "Maximum Achievable Matmul FLOPS comparison table" (bf16; m x n x k)
        ("h100-sxm", 792.1, (6144, 17920, 2816)),
        ("a100-80gb", 267.9, (6912, 16384, 2048)),
        ("mi300x", 781.9, (4096, 10240, 4864)),
    ],
)
def test_a_large_gemm_runs_at_the_published_maximum_achievable_flops(key, tflops, shape) -> None:
    m, n, k = shape
    seconds = matmul_time(m, n, k, torch.bfloat16, spec(key), TimingAssumptions())
    assert 2 * m * n * k / seconds / 1e12 == pytest.approx(tflops, rel=1e-9)


def test_one_tile_more_than_the_sms_takes_a_second_wave() -> None:
    a = TimingAssumptions(tiles=((128, 128),), gemm_efficiency=0.25)  # math-bound at 128 FLOPs per byte
    k = 8192
    full = matmul_time(128 * 132, 128, k, torch.bfloat16, H100, a)  # 132 tiles: one wave
    over = matmul_time(128 * 133, 128, k, torch.bfloat16, H100, a)  # 133 tiles: two waves
    assert full == pytest.approx(2 * 128 * 132 * 128 * k / (989e12 * 0.25))
    assert over == pytest.approx(2 * full)


def test_a_ragged_output_pays_for_its_padded_tiles() -> None:
    a = TimingAssumptions(tiles=((128, 128),), gemm_efficiency=0.1, sm_count=2)  # the 2 tiles: one wave
    k = 8192
    ragged = matmul_time(129, 128, k, torch.bfloat16, H100, a)
    assert ragged == pytest.approx(2 * 256 * 128 * k / (989e12 * 0.1))  # two tiles' work for 129 rows


def test_a_matrix_vector_product_is_memory_bound() -> None:
    a = TimingAssumptions(memory_efficiency=0.9)
    seconds = matmul_time(1, 8192, 8192, torch.bfloat16, H100, a)
    moved = (8192 * 8192 + 8192) * 2 + 8192 * 2  # the weight, the vector, the output
    assert seconds == pytest.approx(moved / (3350e9 * 0.9))


def test_fp8_matmuls_run_at_the_fp8_peak_and_bf16_at_the_bf16_peak() -> None:
    a = TimingAssumptions(gemm_efficiency=0.8)
    bf16 = matmul_time(8448, 8192, 8192, torch.bfloat16, H100, a)
    fp8 = matmul_time(8448, 8192, 8192, torch.float8_e4m3fn, H100, a)
    assert bf16 / fp8 == pytest.approx(1979.0 / 989.0)
    assert 2 * 8448 * 8192 * 8192 / bf16 == pytest.approx(989e12 * 0.8)  # 8448 x 8192 fills whole waves


def _linear_times(rows: int, d_in: int, d_out: int, a: TimingAssumptions) -> float:
    """A bias-free Linear's three GEMMs: x @ W^T, then g @ W and g^T @ x."""
    dt = torch.bfloat16
    return (
        matmul_time(rows, d_out, d_in, dt, H100, a)
        + matmul_time(rows, d_in, d_out, dt, H100, a)
        + matmul_time(d_out, d_in, rows, dt, H100, a)
    )


def test_op_timer_times_a_models_forward_and_backward_gemms_from_their_shapes() -> None:
    a = TimingAssumptions()
    rows, d, hidden = 8192, 4096, 14336
    with FakeTensorMode():
        bf16 = torch.bfloat16
        model = torch.nn.Sequential(
            torch.nn.Linear(d, hidden, bias=False, dtype=bf16),
            torch.nn.SiLU(),
            torch.nn.Linear(hidden, d, bias=False, dtype=bf16),
        )
        x = torch.randn(rows, d, dtype=torch.bfloat16, requires_grad=True)
        with OpTimer(H100, a) as timer:
            model(x).sum().backward()
    expected = _linear_times(rows, d, hidden, a) + _linear_times(rows, hidden, d, a)
    assert timer.times.seconds["matmul"] == pytest.approx(expected, rel=1e-12)
    # the SiLU forward and backward move at least its input, output and gradients
    assert timer.times.seconds["memory"] >= 4 * rows * hidden * 2 / (3350e9 * 0.9)


def test_attention_is_timed_from_its_shapes_with_the_backward_recomputation_and_the_causal_half() -> None:
    a = TimingAssumptions(launch_s=0.0)
    b, h, seq, dim = 2, 32, 8192, 128
    with FakeTensorMode():
        q, k, v = (torch.randn(b, h, seq, dim, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        with OpTimer(H100, a) as timer:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(torch.ones_like(out))
    matmul = 2 * b * h * seq * seq * dim
    flops = (2 + 5) * matmul / 2  # forward QK^T and PV; backward five with QK^T again; causal: half
    assert timer.times.seconds["attention"] == pytest.approx(flops / (989e12 * 0.35))


def test_eager_kernels_take_at_least_the_launch_floor_and_compiled_ones_do_not() -> None:
    x = torch.ones(1024)
    eager, compiled = TimingAssumptions(launch_s=5e-6), TimingAssumptions(launch_s=5e-6, eager=False)
    with OpTimer(H100, eager) as e:
        for _ in range(10):
            x = x * 2
    with OpTimer(H100, compiled) as c:
        for _ in range(10):
            x = x * 2
    assert e.times.kernels == c.times.kernels == 10 and e.times.launch_bound == 10
    assert e.times.seconds["memory"] == pytest.approx(10 * 5e-6)
    assert c.times.seconds["memory"] == pytest.approx(10 * 2 * 4096 / (3350e9 * 0.9))
    assert c.times.launch_bound == 0


def test_views_and_metadata_launch_nothing() -> None:
    x = torch.ones(64, 64)
    with OpTimer(H100) as t:
        x.view(-1).view(64, 64)[:, :8].unsqueeze(0).transpose(1, 2).expand(3, 8, 64)
        x.t().reshape(-1)  # not contiguous: reshape copies (one kernel)
    assert t.times.kernels == 1
    with OpTimer(H100) as t:
        x.view(-1).view(64, 64)[:, :8].unsqueeze(0).transpose(1, 2).expand(3, 8, 64)
    assert t.times.kernels == 0 and t.times.total_s == 0


def test_every_assumption_is_printed_and_overridable() -> None:
    a = TimingAssumptions(gemm_efficiency=0.7, attention_efficiency=0.6, memory_efficiency=0.5, launch_s=1e-6)
    assumes = OpTimer(H100, a).times.assumes
    assert assumes["gemm_efficiency"] == 0.7 and assumes["attention_efficiency"] == 0.6
    assert assumes["memory_efficiency"] == 0.5 and assumes["launch_s"] == 1e-6 and assumes["sm_count"] == 132
    # a device without a measurement uses the default; one without an SM count has no wave quantization
    l4 = spec("l4")
    assert OpTimer(l4).times.assumes["gemm_efficiency"] == TimingAssumptions().default_gemm_efficiency
    assert OpTimer(l4).times.assumes["sm_count"] is None


def test_a_dtype_without_a_peak_is_named() -> None:
    with pytest.raises(ValueError, match=r"'a100-80gb' has no peak for torch.float8_e4m3fn"):
        matmul_time(1024, 1024, 1024, torch.float8_e4m3fn, spec("a100-80gb"), TimingAssumptions())


def test_wave_count_matches_the_guide_arithmetic() -> None:
    # NVIDIA's guide: tiles = ceil(m / tm) * ceil(n / tn), waves = ceil(tiles / SMs)
    a = TimingAssumptions(tiles=((256, 128),), gemm_efficiency=1.0)
    m, n, k = 4096, 5120, 8192
    tiles = math.ceil(m / 256) * math.ceil(n / 128)
    waves = math.ceil(tiles / 132)
    expected = waves * 132 * 256 * 128 * 2 * k / 989e12
    assert matmul_time(m, n, k, torch.bfloat16, H100, a) == pytest.approx(expected)


def test_collectives_are_left_to_the_communication_model() -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from accelfn import mesh as _mesh

    _mesh.destroy_process_group()  # another test's
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        x = torch.ones(1024)
        with OpTimer(H100) as t:
            dist.all_reduce(x)
            y = torch.ops._c10d_functional.all_gather_into_tensor(x, 8, dist.group.WORLD.group_name)
            torch.ops._c10d_functional.wait_tensor(y)
    finally:
        dist.destroy_process_group()
    assert t.times.kernels == 0
