"""The dry run's per-op compute time model (accelfn/dryrun/timing.py): GEMMs held to published measurements and
to the quantization arithmetic of NVIDIA's guide, memory-bound ops to bytes over bandwidth, the eager launch
floor, fp8 at the fp8 peak, attention from its shapes; `OpTimer` over real autograd graphs on fake tensors, its
sums recomputed here from the shapes."""

from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from accelfn.dryrun.timing import OpTimer, TimingAssumptions, attention_time, matmul_time, op_cost
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
    # times the share of bf16's fraction the H100 SXM's fp8 GEMMs were measured to reach (timing.MAMF_FP8, 0.91)
    share = TimingAssumptions().gemm(H100, torch.float8_e4m3fn) / TimingAssumptions().gemm(H100)
    assert bf16 / fp8 == pytest.approx(1979.0 / 989.0 * share) and share == pytest.approx(0.91, abs=0.01)
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
    a = TimingAssumptions(launch_s=0.0, attention_backend="flash2")
    b, h, seq, dim = 2, 32, 8192, 128
    with FakeTensorMode():
        q, k, v = (torch.randn(b, h, seq, dim, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        with OpTimer(H100, a) as timer:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(torch.ones_like(out))
    matmul = 2 * b * h * seq * seq * dim
    # forward QK^T and PV; backward five with QK^T again; causal: half. FlashAttention-3's paper measured
    # FlashAttention-2 on an H100 SXM5 at 8k, head dim 128, with a causal mask: 333 TFLOP/s forward (370 without);
    # the backward assumed to slow as the forward does: 318 x 333 / 370
    forward, backward = 2 * matmul / 2, 5 * matmul / 2
    assert timer.times.seconds["attention"] == pytest.approx(
        forward / 333e12 + backward / (318e12 * 333 / 370)
    )


@pytest.mark.parametrize("backend", ["flash2", "cudnn"])
def test_fp32_attention_runs_3xtf32_at_a_third_of_the_tf32_peak_whatever_the_backend(backend) -> None:
    """fp32 SDPA runs torch's memory-efficient kernel (flash and cuDNN take 2-byte inputs only), whose sm80+
    matmuls are 3xTF32 (`OpMultiplyAddFastF32`): an H100's 494.7 TF32 TFLOP/s / 3, at FlashAttention-2's measured
    fraction (333 TFLOP/s of 989 forward, causal, 8k); an A100's 156 / 3."""
    a = TimingAssumptions(launch_s=0.0, attention_backend=backend)
    b, h, seq, dim = 1, 8, 8192, 128
    with FakeTensorMode():
        q, k, v = (torch.randn(b, h, seq, dim, dtype=torch.float32) for _ in range(3))
        with OpTimer(H100, a) as timer:
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    forward = 2 * (2 * b * h * seq * seq * dim) / 2
    assert timer.times.seconds["attention"] == pytest.approx(forward / (494.7e12 / 3 * 333 / 989))
    fa2 = TimingAssumptions(attention_backend="flash2")
    bf16 = attention_time(forward, H100, fa2, torch.bfloat16, seq=seq, causal=True)
    assert attention_time(forward, H100, a, torch.float32, seq=seq, causal=True) == pytest.approx(
        bf16 * 989 / (494.7 / 3)
    )
    a100 = attention_time(10**15, spec("a100-80gb"), a, torch.float32)
    assert a100 == pytest.approx(10**15 / (52e12 * 370 / 989))  # a long non-causal forward: 370 of 989


@pytest.mark.parametrize(
    "seq, causal, non_causal",
    [  # FlashAttention-3's paper, FlashAttention-2 forward on an H100 SXM5, head dim 128 (figure 5d / 5c)
        (512, 191, 309),
        (1024, 260, 350),
        (2048, 298, 362),
        (4096, 319, 368),
        (8192, 333, 370),
        (16384, 335, 370),
    ],
)
def test_a_causal_kernel_runs_at_flashattention_2s_measured_causal_speed(seq, causal, non_causal) -> None:
    a = TimingAssumptions(attention_backend="flash2")
    flops = 10**15
    assert flops / attention_time(flops, H100, a, seq=seq, causal=True) == pytest.approx(causal * 1e12)
    assert flops / attention_time(flops, H100, a, seq=seq) == pytest.approx(non_causal * 1e12)
    # no causal backward was published: assumed to slow by the forward's causal / non-causal ratio
    backward = {512: 214, 1024: 260, 2048: 291, 4096: 310, 8192: 318, 16384: 322}[seq]
    assert flops / attention_time(flops, H100, a, seq=seq, causal=True, backward=True) == pytest.approx(
        backward * causal / non_causal * 1e12
    )


def test_the_causal_speed_is_interpolated_in_log2_of_the_length_and_held_at_the_ends() -> None:
    a = TimingAssumptions(attention_backend="flash2")

    def tflops(seq: int) -> float:
        return 1e15 / attention_time(10**15, H100, a, seq=seq, causal=True) / 1e12

    # 3k keys: log2 between 2k (298) and 4k (319)
    w = math.log2(3072 / 2048)
    assert tflops(3072) == pytest.approx(298 * (1 - w) + 319 * w)
    assert tflops(128) == pytest.approx(191) and tflops(65536) == pytest.approx(335)


@pytest.mark.parametrize(
    "seq, causal, forward, backward",
    [  # FlashAttention-3's paper, cuDNN's bars (H100 SXM5, head dim 128): causal forward, non-causal forward and
        # backward
        (512, 315, 497, 305),
        (2048, 484, 617, 465),
        (8192, 529, 600, 518),
        (16384, 539, 595, 516),
    ],
)
def test_a_cudnn_kernel_runs_at_cudnns_measured_speed(seq, causal, forward, backward) -> None:
    a = TimingAssumptions(attention_backend="cudnn")
    flops = 10**15
    assert flops / attention_time(flops, H100, a, seq=seq, causal=True) == pytest.approx(causal * 1e12)
    assert flops / attention_time(flops, H100, a, seq=seq) == pytest.approx(forward * 1e12)
    assert flops / attention_time(flops, H100, a, seq=seq, backward=True) == pytest.approx(backward * 1e12)
    # the causal backward: assumed as FlashAttention-2's (no published figure)
    assert flops / attention_time(flops, H100, a, seq=seq, causal=True, backward=True) == pytest.approx(
        backward * causal / forward * 1e12
    )


@pytest.mark.parametrize(
    "version, backend",
    [
        ("2.4.1+cu124", "flash2"),  # cuDNN only with TORCH_CUDNN_SDPA_ENABLED=1
        ("2.5.0", "cudnn"),  # cuDNN first on H100 (the 2.5 release)
        ("2.5.1", "flash2"),  # pytorch#138522, cherry-picked: cuDNN opt-in
        ("2.6.0.dev20241223", "flash2"),  # torch 1963fc8, torchtitan's published runs
        ("2.6.0.dev20241010", "cudnn"),  # main before pytorch#138522
        ("2.8.0", "flash2"),
        ("2.9.0.dev20250801", "flash2"),  # main before pytorch#162073
        ("2.9.1+cu130", "cudnn"),  # pytorch#162073, "for 2.9", where built with cuDNN >= 9.9
        ("2.9.1+cu128", "flash2"),  # built against cuDNN 9.8.0 (pytorch#165801)
        ("2.10.0", "flash2"),  # cuDNN > 9.15.0 needed, not bundled
        ("2.11.0+cu130", "cudnn"),  # this project's H100 profile ran cuDNN's kernels
        ("2.13.0", "cudnn"),
    ],
)
def test_the_sdpa_backend_is_the_one_the_declared_torch_picks_on_an_h100(version, backend) -> None:
    assert TimingAssumptions(torch_version=version).backend(H100) == backend
    assert TimingAssumptions(torch_version=version).backend(spec("h100-96gb")) == backend
    # an A100 (sm80) runs FlashAttention-2 in every version
    assert TimingAssumptions(torch_version=version).backend(spec("a100-80gb")) == "flash2"


def test_the_backend_is_printed_and_an_override_wins_over_the_torch_version() -> None:
    flops = 10**15
    cudnn = TimingAssumptions(torch_version="2.11.0")
    fa2 = TimingAssumptions(torch_version="2.11.0", attention_backend="flash2")
    assert attention_time(flops, H100, fa2, seq=2048, causal=True) == pytest.approx(flops / 298e12)
    assert attention_time(flops, H100, cudnn, seq=2048, causal=True) == pytest.approx(flops / 484e12)
    assumes = OpTimer(H100, cudnn).times.assumes
    assert assumes["attention_backend"] == "cudnn" and assumes["torch_version"] == "2.11.0"
    assert OpTimer(H100, fa2).times.assumes["attention_backend"] == "flash2"
    # the installed torch's choice when nothing is declared
    assert TimingAssumptions().torch_version == torch.__version__


def test_the_cli_declares_the_jobs_torch_and_names_a_bad_one(tmp_path, capsys) -> None:
    import argparse

    from accelfn.cli.dry_run import _dry_run
    from accelfn.dryrun import Assumptions

    script = tmp_path / "train.py"
    script.write_text("")
    given = []

    def dry_run(*args, assumptions, **kwargs):  # records what the command hands af.dry_run
        given.append(assumptions)
        raise SystemExit(0)

    def args(version):
        return argparse.Namespace(
            rank="0", gpu="h100-96gb", moe_routing="uniform", host_memory_gib=2048.0, torch_version=version,
            script=str(script), script_args=[], nproc_per_node=8, nnodes=1, steps=1, step=None, mesh=None,
            no_search=True, device="cuda", json_path=None,
        )  # fmt: skip

    with pytest.raises(SystemExit):
        _dry_run(args("2.6.0.dev20241223"), dry_run, Assumptions)
    assert given[0].timing.torch_version == "2.6.0.dev20241223"
    assert given[0].timing.backend(spec("h100-96gb")) == "flash2"
    assert _dry_run(args("latest"), dry_run, Assumptions) == 2
    assert "--torch-version: torch_version 'latest' is not a torch version" in capsys.readouterr().err


def test_an_unknown_backend_or_torch_version_is_named() -> None:
    with pytest.raises(ValueError, match="attention_backend"):
        TimingAssumptions(attention_backend="flash3")
    with pytest.raises(ValueError, match="'nightly' is not a torch version"):
        TimingAssumptions(torch_version="nightly").backend(H100)


def test_eager_memory_bound_kernels_run_at_atens_measured_bandwidth_and_fused_ones_at_tritons() -> None:
    # Liger-Kernel's H100 data (benchmark/data/all_benchmark_data.csv): transformers' eager add + RMSNorm reaches
    # 84% of the bandwidth, hand-written Triton kernels 91-92%
    from accelfn.dryrun.step_time import predict_step
    from accelfn.dryrun.timing import OpCost

    nbytes = 10**9
    eager = predict_step([OpCost("memory", nbytes=nbytes)], H100).compute_s
    fused = predict_step([OpCost("memory", nbytes=nbytes)], H100, compiled="step").compute_s
    assert eager == pytest.approx(nbytes / (3350e9 * 0.84)) and fused == pytest.approx(
        nbytes / (3350e9 * 0.9)
    )
    flat = TimingAssumptions(eager_memory_efficiency=0.5)
    assert predict_step([OpCost("memory", nbytes=nbytes)], H100, timing=flat).compute_s == pytest.approx(
        nbytes / 1675e9
    )


class _RecordAttention(torch.utils._python_dispatch.TorchDispatchMode):
    """The attention kernels' `OpCost`s run inside it, in `costs`, as the dry run's tracker records them."""

    def __init__(self) -> None:
        super().__init__()
        self.costs: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        cost = op_cost(func, args, kwargs or {}, out)
        if cost is not None and cost.kind == "attention":
            self.costs.append(cost)
        return out


def _attention_costs(*args, **kwargs) -> list:
    """The `OpCost`s of an SDPA call's forward and backward kernels."""
    with _RecordAttention() as record:
        out = torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)
        out.sum().backward()
    return record.costs


def _qkv(seq: int = 16) -> list[torch.Tensor]:
    return [torch.randn(2, 4, seq, 8, requires_grad=True) for _ in range(3)]


def test_an_sdpa_call_with_is_causal_is_costed_causal_with_half_the_flops() -> None:
    causal, full = _attention_costs(*_qkv(), is_causal=True), _attention_costs(*_qkv())
    assert [c.causal for c in causal] == [True, True] and [c.causal for c in full] == [False, False]
    per_matmul = 2 * 2 * 4 * 16 * 16 * 8  # batch 2, 4 heads, 16 queries x 16 keys, head dim 8
    # the forward's two matmuls, the backward's five (q @ k^T again)
    assert [c.flops * 2 for c in causal] == [c.flops for c in full] == [2 * per_matmul, 5 * per_matmul]


def test_a_causal_call_with_fewer_queries_than_keys_computes_the_lower_right_part() -> None:
    # the GPU kernels align is_causal to the lower right (context parallel's chunks over the keys up to their end):
    # 8 queries, the last of 24 keys: query i sees 16 + i + 1 keys, 8 x 20 of the 8 x 24 scores
    q = torch.randn(2, 4, 8, 8, requires_grad=True)
    k, v = (torch.randn(2, 4, 24, 8, requires_grad=True) for _ in range(2))
    causal, full = _attention_costs(q, k, v, is_causal=True), _attention_costs(q, k, v)
    assert [c.causal for c in causal] == [True, True]
    assert [c.flops * 24 for c in causal] == [c.flops * 20 for c in full]


def test_an_explicit_causal_mask_is_read_as_causal_and_any_other_mask_is_not() -> None:
    tril = torch.ones(16, 16, dtype=torch.bool).tril()
    additive = torch.zeros(16, 16).masked_fill(~tril, torch.finfo(torch.float32).min)
    padding = tril[None, None].repeat(2, 1, 1, 1)
    padding[1, ..., 12:] = False  # the second sequence's last 4 keys are padding
    for mask, causal in [
        (tril, True),  # 2-D
        (tril[None, None].expand(2, 1, 16, 16), True),  # transformers' (B, 1, L, L)
        (additive[None, None], True),
        (torch.ones(16, 16, dtype=torch.bool), False),  # bidirectional
        (padding, False),
    ]:
        costs = _attention_costs(*_qkv(), attn_mask=mask)
        assert [c.causal for c in costs] == [causal, causal], mask.shape


def test_a_fake_square_mask_shared_by_the_heads_is_taken_as_causal() -> None:
    # the dry run's tensors have no values: transformers' causal mask on CPU is a (B, 1, L, L) mask (an assumption)
    with FakeTensorMode():
        mask = torch.ones(2, 1, 16, 16, dtype=torch.bool)
        costs = _attention_costs(*_qkv(), attn_mask=mask)
    assert [c.causal for c in costs] == [True, True]


def test_a_transformers_llama_reaches_the_attention_cost_as_causal() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (2, 16))
    for mask, causal in [(None, True), (torch.tensor([[1] * 16, [1] * 12 + [0] * 4]), False)]:
        with _RecordAttention() as record:
            model(input_ids=ids, attention_mask=mask).logits.sum().backward()
        assert [c.causal for c in record.costs] == [causal, causal], mask


def test_a_flat_attention_efficiency_scales_every_attention_kernel_alike() -> None:
    a = TimingAssumptions(attention_efficiency=0.5, attention_backend="flash2")
    long_fwd = attention_time(10**15, H100, a)
    assert long_fwd == pytest.approx(10**15 / (989e12 * 0.5))
    short_bwd = attention_time(10**15, H100, a, backward=True, seq=2048)
    # FlashAttention-2: 370 TFLOP/s on a long forward, 291 on a 2k backward
    assert short_bwd == pytest.approx(long_fwd * 370 / 291)


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
    # each op one ATen kernel, at eager_memory_efficiency (Liger-Kernel's H100 data: 84%)
    assert c.times.seconds["memory"] == pytest.approx(10 * 2 * 4096 / (3350e9 * 0.84))
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


# ---- communication per collective (accelfn/dryrun/comm_time.py) ------------------------------------------------
def _nccl_ring(kind: str, nbytes: int, n: int, nodes: int, intra_gbs: float, inter_gbs: float) -> float:
    """NCCL's ring cost, written out from src/graph/tuning.cc (Simple protocol) and nccl-tests' bus bytes."""
    steps, inter = (2 * (n - 1), 2 * (nodes - 1)) if kind == "all_reduce" else (n - 1, nodes - 1)
    latency = 8.4 + (steps - inter) * 3.4 + inter * 14.0
    factor = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
    bw = (intra_gbs if nodes == 1 else inter_gbs) * 1e9 * 0.8
    return latency * 1e-6 + factor * nbytes / bw


@pytest.mark.parametrize(
    "kind, nbytes, n, nodes",
    [
        ("all_gather", 2**30, 8, 1),  # FSDP over a node: NVLink
        ("reduce_scatter", 2**31, 128, 16),  # FSDP over 16 nodes: each GPU's NIC
        ("all_reduce", 2**28, 8, 1),
        ("all_to_all", 2**20, 8, 1),
    ],
)
def test_a_collective_costs_ncclS_ring_latency_and_bus_bytes_over_its_link(kind, nbytes, n, nodes) -> None:
    from accelfn.dryrun.comm_time import CommAssumptions, collective_time

    got = collective_time(kind, nbytes, n, nodes, H100, CommAssumptions())
    assert got == pytest.approx(_nccl_ring(kind, nbytes, n, nodes, 450.0, 50.0), rel=1e-12)


def test_a_small_all_reduce_over_many_nodes_takes_the_tree_and_a_large_one_the_ring() -> None:
    from accelfn.dryrun.comm_time import CommAssumptions, collective_time

    a, n, nodes = CommAssumptions(protocols=False), 1024, 128  # the Simple protocol alone
    small = collective_time("all_reduce", 4096, n, nodes, H100, a)
    tree = (8.4 + 2 * (7 * 3.4 + math.log2(nodes) * 14.0)) * 1e-6 + 2 * 4096 / 40e9
    assert small == pytest.approx(tree) and small < _nccl_ring("all_reduce", 4096, n, nodes, 450, 50)
    large = collective_time("all_reduce", 2**32, 16, 2, H100, a)  # few hops: the ring's 2 (n - 1) / n wins
    assert large == pytest.approx(_nccl_ring("all_reduce", 2**32, 16, 2, 450, 50))
    assert collective_time("all_reduce", 2**32, 16, 2, H100, CommAssumptions()) == pytest.approx(large)
    no_tree = CommAssumptions(tree=False, protocols=False)
    assert collective_time("all_reduce", 4096, n, nodes, H100, no_tree) > small


def test_a_small_collective_takes_nccl_s_low_latency_protocol_and_a_large_one_simple() -> None:
    """NCCL 2.27.3's tuning table (src/graph/tuning.cc), written out: LL's ring is 6.6 us + 0.6 us a hop on NVLink
    (2.7 over the network) at half Simple's bandwidth, LL128's 14.0 + 1.9 (4.0) at 0.92 of it, the tree's LL
    6.8 + 0.6 / 5.0 at 1 / 3.8; NCCL runs the fastest (`ncclTopoGetAlgoTime`)."""
    from accelfn.dryrun.comm_time import CommAssumptions, collective_time

    a = CommAssumptions()
    # a tensorwise fp8 scale's amax, all-reduced over tp = 8 in a node: 2 (n - 1) = 14 hops
    amax = collective_time("all_reduce", 4, 8, 1, H100, a)
    assert amax == pytest.approx((6.6 + 14 * 0.6) * 1e-6 + 2 * 7 / 8 * 4 / (360e9 * 0.5), rel=1e-12)
    assert collective_time("all_reduce", 4, 8, 1, H100, CommAssumptions(protocols=False)) == pytest.approx(
        _nccl_ring("all_reduce", 4, 8, 1, 450, 50), rel=1e-12
    )  # 56 us
    # a medium message: LL128 (its bandwidth 0.92 of Simple's, its hops 1.9 us)
    mid = 2**24
    ll128 = (14.0 + 7 * 1.9) * 1e-6 + 7 / 8 * mid / (360e9 * 0.92)
    assert collective_time("all_gather", mid, 8, 1, H100, a) == pytest.approx(ll128, rel=1e-12)
    # a large one: Simple, as before
    assert collective_time("all_gather", 2**30, 8, 1, H100, a) == pytest.approx(
        _nccl_ring("all_gather", 2**30, 8, 1, 450, 50), rel=1e-12
    )
    # a tiny all-reduce over 128 nodes: the tree's LL, 2 (7 NVLink + log2(128) network hops)
    tiny = collective_time("all_reduce", 4096, 1024, 128, H100, a)
    assert tiny == pytest.approx((6.8 + 2 * (7 * 0.6 + 7 * 5.0)) * 1e-6 + 2 * 4096 / (40e9 / 3.8), rel=1e-12)


def test_an_all_to_all_over_nodes_sends_only_the_other_nodes_parts_over_the_network() -> None:
    """ep=64 on 8 nodes of 8 (DeepSeek-V3's EP64): 56 of each rank's 64 parts cross the network, 7 stay on NVLink,
    both at once; an ep group strided over 8 nodes sends every other part across."""
    from accelfn.dryrun.comm_time import CommAssumptions, collective_time, ranks_in_node

    a, size = CommAssumptions(), 2**28
    inside = ranks_in_node(("ep",), {"fsdp": 16, "ep": 64}, 8)
    strided = ranks_in_node(("ep",), {"ep": 8, "fsdp": 8}, 8)
    assert (inside, strided) == (8, 1)
    latency = (8.4 + (63 - 7) * 3.4 + 7 * 14.0) * 1e-6
    got = collective_time("all_to_all", size, 64, 8, H100, a, inside)
    assert got == pytest.approx(latency + size * 56 / 64 / 40e9, rel=1e-12)
    assert got < collective_time("all_to_all", size, 64, 8, H100, a, 1)  # strided: 63 parts over the NIC
    latency8 = (8.4 + 6 * 3.4 + 1 * 14.0) * 1e-6
    assert collective_time("all_to_all", size, 8, 2, H100, a, 1) == pytest.approx(
        latency8 + size * 7 / 8 / 40e9
    )


# ---- the step's time: overlap as each strategy has it (accelfn/dryrun/step_time.py) -----------------------------
def _step(timeline, axes, **kw):
    from accelfn.dryrun.step_time import predict_step

    return predict_step(timeline, H100, groups={"g": axes}, shape={axes[0]: 8}, nproc_per_node=8, **kw)


def _coll(kind: str, nbytes: int, phase: str = "forward_backward"):
    from accelfn.dryrun.tracker import Collective

    return Collective(kind, "g", 8, nbytes, phase=phase)


def test_fsdp_all_gathers_prefetch_one_ahead_and_tensor_parallel_ones_block() -> None:
    from accelfn.dryrun.comm_time import CommAssumptions, collective_time
    from accelfn.dryrun.timing import OpCost, cost_time

    a = TimingAssumptions(launch_s=0.0)
    block = OpCost("matmul", 8192, 8192, 8192)
    c = cost_time(block, H100, a)
    small, large = _coll("all_gather", 2**28), _coll("all_gather", 2**33)  # shorter / longer than a block
    ts, tl = (collective_time("all_gather", x.nbytes, 8, 1, H100, CommAssumptions()) for x in (small, large))
    assert ts < c < tl
    fsdp = _step([small, block, small, block, small, block], ("fsdp",), timing=a)
    # the first all-gather is exposed; each later one is issued when the one before it was needed, and hides
    # behind the block before it
    assert fsdp.step_s == pytest.approx(ts + 3 * c) and fsdp.exposed_comm_s == pytest.approx(ts)
    slow = _step([large, block, large, block], ("fsdp",), timing=a)
    # prefetch is bounded by the block's compute: the second waits for what the first block did not hide
    assert slow.step_s == pytest.approx(tl + max(c, tl) + c)
    tp = _step([small, block, small, block, small, block], ("tp",), timing=a)  # on the critical path
    assert tp.step_s == pytest.approx(3 * ts + 3 * c) and tp.comm_s == pytest.approx(3 * ts)


def test_gradient_reductions_overlap_the_backward_until_the_update_needs_them() -> None:
    from accelfn.dryrun.comm_time import CommAssumptions, collective_time
    from accelfn.dryrun.timing import OpCost, cost_time

    a = TimingAssumptions(launch_s=0.0)
    block = OpCost("matmul", 8192, 8192, 8192, backward=True)
    c = cost_time(block, H100, a)
    rs = _coll("reduce_scatter", 2**28)
    t = collective_time("reduce_scatter", rs.nbytes, 8, 1, H100, CommAssumptions())
    update = OpCost("memory", nbytes=10**9)
    u = cost_time(update, H100, a)
    loss_sum = _coll("all_reduce", 8, phase="reduce")
    ar = collective_time("all_reduce", 8, 8, 1, H100, CommAssumptions())
    assert t < c
    got = _step([block, rs, block, rs, loss_sum, update], ("dp",), timing=a)
    # the first reduce-scatter hides behind the second block, the last is exposed before the update
    assert got.step_s == pytest.approx(2 * c + t + ar + u)
    assert got.exposed_comm_s == pytest.approx(t + ar)


def test_compiled_steps_fuse_each_run_of_memory_bound_ops_and_have_no_launch_floor() -> None:
    from accelfn.dryrun.timing import OpCost

    mm = OpCost("matmul", 4096, 4096, 4096)
    run = [OpCost("memory", nbytes=n) for n in (10**6, 5 * 10**6, 2 * 10**6)]
    timeline = [mm, *run, mm, *run]
    eager, compiled = _step(timeline, ("dp",)), _step(timeline, ("dp",), compiled=True)
    assert eager.kernels == 8 and compiled.kernels == 4
    assert compiled.by_kind["memory"] == pytest.approx(2 * 5 * 10**6 / (3350e9 * 0.9))
    assert eager.by_kind["memory"] == pytest.approx(
        2 * sum(max(5e-6, op.nbytes / (3350e9 * 0.9)) for op in run)
    )


def test_a_compiled_steps_update_stays_eager_one_kernel_per_op_at_the_launch_floor() -> None:
    from accelfn.dryrun.timing import OpCost

    mm = OpCost("matmul", 4096, 4096, 4096)
    update = [OpCost("memory", nbytes=n, graph=False) for n in (10**3, 4 * 10**8, 10**3)]
    graph = [OpCost("memory", nbytes=n) for n in (10**6, 5 * 10**6)]
    compiled = _step([mm, *graph, *update], ("dp",), compiled=True)
    assert compiled.kernels == 1 + 1 + 3 and compiled.launch_bound == 2
    fused, eager = 3350e9 * 0.9, 3350e9 * 0.84  # a Triton kernel's bandwidth, an ATen kernel's
    assert compiled.by_kind["memory"] == pytest.approx(5 * 10**6 / fused + 2 * 5e-6 + 4 * 10**8 / eager)


def test_a_compiled_blocks_forward_and_backward_are_marked_compiled_and_the_update_is_not() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    from accelfn.dryrun.compiled import partition_block
    from accelfn.dryrun.timing import op_cost

    class Costs(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.costs: list[object] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            self.costs.append(op_cost(func, args, kwargs or {}, out))
            return out

    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    assert partition_block(block)
    x = torch.randn(4, 8, requires_grad=True)
    block(x)  # traced once, outside the mode
    with Costs() as fwd_bwd:
        block(x).sum().backward()  # the partitioned forward runs in an autograd.Function: grad disabled there
    with Costs() as update, torch.no_grad():
        torch._foreach_add_(list(block.parameters()), [p.grad for p in block.parameters()])
    ran = [c for c in fwd_bwd.costs if c is not None]
    assert ran and all(c.graph for c in ran)  # type: ignore[attr-defined]
    assert update.costs and not any(c.graph for c in update.costs if c is not None)  # type: ignore[attr-defined]


class _Costs:
    """Records `op_cost` of every op run inside it (None for views, wrappers and collectives)."""

    def __enter__(self):  # type: ignore[no-untyped-def]
        from torch.utils._python_dispatch import TorchDispatchMode

        from accelfn.dryrun.timing import op_cost

        costs: list[tuple[str, object]] = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                out = func(*args, **(kwargs or {}))
                costs.append((func.__name__.split(".")[0], op_cost(func, args, kwargs or {}, out)))
                return out

        self.costs, self._mode = costs, Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):  # type: ignore[no-untyped-def]
        self._mode.__exit__(*exc)


def test_fsdp2s_copy_in_wrapper_moves_nothing_and_its_copies_never_fuse() -> None:
    import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401  (defines torch.ops.fsdp)

    from accelfn.dryrun.timing import op_cost

    shards = [torch.randn(6), torch.randn(2)]
    buffer = torch.empty(32)  # 4 ranks x 8 elements
    out = torch.ops.fsdp.all_gather_copy_in(shards, buffer, [6, 2], 8, 1)
    # the wrapper: its whole output buffer is not moved; the `_foreach_copy_` it runs is (recorded on its own)
    assert op_cost(torch.ops.fsdp.all_gather_copy_in.default, (shards, buffer, [6, 2], 8, 1), {}, out) is None
    grads, flat = [torch.randn(4, 2), torch.randn(8)], torch.empty(16)
    with torch.enable_grad():  # as in the backward, where a compiled region's ops fuse
        cat = op_cost(torch.ops.fsdp.chunk_cat.default, (grads, 0, 4), {"out": flat}, None)
        copy = op_cost(torch.ops.aten._foreach_copy_.default, ([flat[:8]], [grads[1]]), {}, None)
        parts = [torch.empty(24), torch.empty(8)]  # the unsharded parameters
        split = op_cost(torch.ops.fsdp.split_with_sizes_copy.default, (buffer, [24, 8]), {"out": parts}, None)
        mul = op_cost(torch.ops.aten.mul.Tensor, (flat, flat), {}, flat * flat)
    assert cat is not None and copy is not None and split is not None and mul is not None
    assert cat.nbytes == 2 * 16 * 4 and split.nbytes == 2 * 32 * 4  # what they read and write
    assert not (cat.graph or copy.graph or split.graph) and mul.graph


def test_a_step_compiled_per_block_fuses_only_the_blocks_ops_and_keeps_the_loss_eager() -> None:
    from accelfn.dryrun.compiled import partition_block
    from accelfn.dryrun.step_time import compile_regions

    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    assert partition_block(block)
    x = torch.randn(4, 8, requires_grad=True)
    block(x)  # traced once, outside the recording (the same graph as the test above: cached)
    with _Costs() as rec:
        torch.nn.functional.log_softmax(block(x).float() * 2.0, -1).sum().backward()
    costs = [(name, c) for name, c in rec.costs if c is not None]
    in_block = {name for name, c in costs if c.region}  # type: ignore[attr-defined]
    outside = {name for name, c in costs if not c.region}  # type: ignore[attr-defined]
    assert {"gelu", "gelu_backward", "addmm", "mm"} <= in_block  # the block's forward and its backward graph
    assert {"_log_softmax", "_log_softmax_backward_data", "mul"} <= outside  # the loss: outside, both ways
    assert all(c.graph for _, c in costs)  # type: ignore[attr-defined]

    timeline = [c for _, c in costs]
    whole, blocks = _step(timeline, ("dp",), compiled="step"), _step(timeline, ("dp",), compiled="blocks")
    eager_loss = sum(1 for c in timeline if c.kind == "memory" and not c.region)  # type: ignore[attr-defined]
    assert blocks.kernels > whole.kernels and blocks.launch_bound >= eager_loss > 0
    assert blocks.by_kind["memory"] > whole.by_kind["memory"]
    assert blocks.assumes["compiled"] == "blocks" and whole.assumes["compiled"] == "step"
    assert (
        compile_regions("train_step(f) -> autocast(bfloat16) -> shard(fsdp, dp=8) -> compile()") == "blocks"
    )
    assert compile_regions("train_step(f) -> shard(ddp, dp=1) -> compile(regions='blocks')") == "blocks"
    assert compile_regions("train_step(f) -> shard(ddp, dp=1) -> compile()") == "step"


def test_the_pipeline_bubble_comes_from_the_schedules_order_and_shrinks_with_interleaving() -> None:
    from accelfn.dryrun.step_time import Pipeline, makespan, pipeline_of
    from accelfn.dryrun.timing import OpCost

    fwd, bwd = OpCost("matmul", 4096, 4096, 4096), OpCost("matmul", 4096, 4096, 4096, backward=True)
    busy = [fwd, bwd, bwd] * 32  # backward twice the forward
    one = _step(busy, ("pp",), pipeline=Pipeline(8, 32, 1, "1f1b"))
    two = _step(busy, ("pp",), pipeline=Pipeline(8, 32, 2, "interleaved_1f1b"))
    # equal stages: the simulated order's idle time is Narayanan et al.'s (p - 1) / (m v) of the busy time
    assert one.bubble_s == pytest.approx(one.compute_s * 7 / 32) and two.bubble_s == pytest.approx(
        one.bubble_s / 2
    )
    # a hand-over between stages lengthens the fill and drain
    assert makespan(4, 8, 1, 1.0, 2.0, p2p=0.5) > makespan(4, 8, 1, 1.0, 2.0) == 8 * 3.0 + 3 * 3.0
    got = pipeline_of("pipeline(interleaved_1f1b, pp=8, stages [0, 8] of 16, 32 micro-batches) over x")
    assert got == Pipeline(8, 32, 2, "interleaved_1f1b")
    assert pipeline_of("shard(fsdp, dp=8)") is None


def test_the_tracker_records_each_kernel_and_collective_in_order_with_its_phase_and_direction() -> None:
    from accelfn.dryrun.timing import OpCost, cost_time
    from accelfn.dryrun.tracker import StepTracker

    a = TimingAssumptions()
    rows, d, hidden = 4096, 1024, 4096
    with FakeTensorMode():
        bf16 = torch.bfloat16
        model = torch.nn.Sequential(
            torch.nn.Linear(d, hidden, bias=False, dtype=bf16),
            torch.nn.Linear(hidden, d, bias=False, dtype=bf16),
        )
        x = torch.randn(rows, d, dtype=bf16, requires_grad=True)
        with StepTracker() as t:
            t.phase = "forward_backward"
            model(x).sum().backward()
    mms = [e for e in t.timeline if isinstance(e, OpCost) and e.kind == "matmul"]
    assert [e.backward for e in mms] == [False, False, True, True, True, True]
    got = sum(cost_time(e, H100, a) for e in mms)
    assert got == pytest.approx(
        _linear_times(rows, d, hidden, a) + _linear_times(rows, hidden, d, a), rel=1e-12
    )


def test_a_backward_prefetch_goes_on_the_link_before_the_reductions_issued_after_it() -> None:
    """FSDP's backward: all-gather, block, reduce-scatter per layer, all on one link. Each all-gather is issued
    when the one before it was needed (before that block's reduce-scatter), so with a block longer than an
    all-gather and a reduce-scatter together only the first all-gather and the last reduce-scatter show."""
    from accelfn.dryrun.comm_time import CommAssumptions, collective_time
    from accelfn.dryrun.timing import OpCost, cost_time

    a = TimingAssumptions(launch_s=0.0)
    block = OpCost("matmul", 8192, 8192, 8192, backward=True)
    ag, rs = _coll("all_gather", 2**27), _coll("reduce_scatter", 2**28)
    c = cost_time(block, H100, a)
    tg, tr = (collective_time(x.kind, x.nbytes, 8, 1, H100, CommAssumptions()) for x in (ag, rs))
    assert tg + tr < c
    got = _step([ag, block, rs] * 3, ("fsdp",), timing=a)
    assert got.step_s == pytest.approx(tg + 3 * c + tr) and got.exposed_comm_s == pytest.approx(tg + tr)


def _mlp_main() -> None:
    import accelfn as af

    mesh = af.Mesh({"dp": -1})
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)])
    step = af.shard(
        af.autocast(af.train_step(lambda m, b: af.losses.mse(m(b), b), af.optim.adamw(1e-3)), torch.bfloat16),
        mesh,
        strategy="fsdp",
    )
    state = step.init(model)
    for _ in range(2):
        state, _ = step(state, torch.randn(4096, 2048))


def test_the_dry_run_prints_every_assumption_and_takes_overrides() -> None:
    import attrs

    import accelfn as af
    from accelfn.dryrun.comm_time import CommAssumptions

    base = af.dry_run(_mlp_main, nproc_per_node=8, nnodes=2, gpu="h100", search=False)
    assumes = base.to_dict()["predicted"]["assumes"]
    for field in [*attrs.fields_dict(TimingAssumptions), *attrs.fields_dict(CommAssumptions)]:
        assert field in assumes, field
    assert "attention at 37%" in str(base) and "links 80% of 450 / 80% of 50 GB/s" in str(base)
    no_latency = CommAssumptions(ring_base_us=0.0, tree_base_us=0.0, nvlink_hop_us=0.0, net_hop_us=0.0)
    fast = af.dry_run(
        _mlp_main,
        nproc_per_node=8,
        nnodes=2,
        gpu="h100",
        search=False,
        assumptions=af.dryrun.Assumptions(comm=no_latency),
    )
    slow_net = af.dryrun.Assumptions(comm=attrs.evolve(no_latency, inter_efficiency=0.1))
    slow = af.dry_run(_mlp_main, nproc_per_node=8, nnodes=2, gpu="h100", search=False, assumptions=slow_net)
    assert "80% of 450 / 10% of 50 GB/s" in str(slow)
    # fsdp over 2 nodes: every collective runs on the network, 8x slower, and more of it shows
    assert slow.predicted.comm_s == pytest.approx(fast.predicted.comm_s * 8, rel=1e-9)
    assert slow.predicted.exposed_comm_s > fast.predicted.exposed_comm_s
    assert slow.predicted.compute_s == pytest.approx(base.predicted.compute_s)
    assert base.predicted.comm_s > fast.predicted.comm_s  # NCCL's latencies


def test_a_grouped_gemm_is_one_kernel_timed_per_group_and_counts_the_loops_flops() -> None:
    """The experts' `torch._grouped_mm` (forward, input and weight gradients): one kernel each, timed as a batched
    GEMM of the groups' mean shape, and the same FLOPs as the per-expert loop of `mm`s torch's counter counts."""
    from accelfn.dryrun.tracker import StepTracker

    a = TimingAssumptions()
    experts, per, d, f = 8, 2048, 4096, 3072
    flops = {}
    for grouped in (True, False):
        with FakeTensorMode():
            bf16 = torch.bfloat16
            w = torch.randn(experts, f, d, dtype=bf16, requires_grad=True)
            x = torch.randn(experts * per, d, dtype=bf16, requires_grad=True)
            grad = torch.randn(experts * per, f, dtype=bf16)
            offs = torch.arange(1, experts + 1, dtype=torch.int32) * per
            with StepTracker() as t, OpTimer(H100, a) as timer:
                if grouped:
                    y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
                else:
                    y = torch.cat([p @ w[e].T for e, p in enumerate(x.split(per))])
                y.backward(grad)
        flops[grouped] = t.flops
        if grouped:
            assert timer.times.kernels == 3  # forward, input gradient, weight gradient (no copies)
            expected = 3 * matmul_time(per, f, d, torch.bfloat16, H100, a, batch=experts)
            assert timer.times.seconds["matmul"] == pytest.approx(expected, rel=0.05)
    assert flops[True] == flops[False] == 3 * 2 * experts * per * d * f


def test_a_dry_run_of_a_gpu_job_lowers_the_experts_as_that_gpu_would() -> None:
    """Grouped GEMMs in bf16 where the modelled device runs them (sm90 and newer), the loop on an A100."""
    from accelfn.dryrun.timing import grouped_mm_dtypes

    assert grouped_mm_dtypes(spec("h100-sxm")) == (torch.bfloat16,)
    assert grouped_mm_dtypes(spec("b200")) == (torch.bfloat16,)
    assert grouped_mm_dtypes(spec("a100-80gb")) == ()
    assert grouped_mm_dtypes(spec("cpu")) == ()


# ---- the optimizer's fused kernels (accelfn/optim/_kernels.py) ---------------------------------------------------
@pytest.mark.parametrize(
    "make, per_param",
    [  # bytes each fp32 parameter moves: AdamW reads p, g, m, v and writes p, m, v; SGD+momentum p, g, b / p, b
        (lambda: __import__("accelfn").optim.adamw(1e-3, weight_decay=0.1), 28),
        (lambda: __import__("accelfn").optim.adam(1e-3), 28),
        (lambda: __import__("accelfn").optim.sgd(1e-3, momentum=0.9), 20),
        (lambda: __import__("accelfn").optim.sgd(1e-3), 12),
    ],
)
def test_a_dry_runs_fused_update_is_one_memory_bound_kernel_per_tensor_group_and_allocates_nothing(
    make, per_param
) -> None:
    from accelfn import dry_mode
    from accelfn.dryrun.step_time import predict_step
    from accelfn.dryrun.timing import OpCost
    from accelfn.dryrun.tracker import StepTracker
    from accelfn.optim.base import apply_gradients

    tx = make()
    fake = FakeTensorMode()
    with fake:  # two tensor groups: fp32 and bf16 (each one launch of torch's multi-tensor kernel)
        params = {
            "w": torch.zeros(8192, 8192),
            "b": torch.zeros(8192),
            "h": torch.zeros(4096, 4096, dtype=torch.bfloat16),
        }
        grads = {k: torch.zeros_like(v) for k, v in params.items()}
        state = tx.init(params)
        with dry_mode.watching(dry_mode.Watcher()) as watcher, StepTracker(fake_mode=fake) as t:
            t.phase = "update"
            before = t.peak_bytes
            with torch.no_grad():
                apply_gradients(tx, grads, state, params)
    fp32, bf16 = 8192 * 8192 + 8192, 4096 * 4096
    kernels = [e for e in t.timeline if isinstance(e, OpCost) and e.nbytes >= 10**6]
    assert [e.nbytes for e in kernels] == [per_param * fp32, per_param // 2 * bf16]
    assert not any(e.graph for e in kernels)  # the update: eager, outside any compiled region
    assert t.peak_bytes - before <= 64  # in place, as the real kernel: only the step count's and lr's scalars
    assert any("fused optimizer kernel" in n for n in watcher.notes)
    got = predict_step(kernels, H100)
    assert got.step_s == pytest.approx(per_param * (fp32 + bf16 / 2) / (3350e9 * 0.84), rel=1e-12)


def _adamw_main() -> None:
    import accelfn as af

    model = torch.nn.Linear(4096, 4096, bias=False)
    step = af.train_step(lambda m, b: af.losses.mse(m(b), b), af.optim.adamw(1e-3))
    state = step.init(model)
    for _ in range(2):
        state, _ = step(state, torch.randn(8, 4096))


def test_a_dry_runs_predicted_step_holds_the_fused_adamw_update_of_every_parameter() -> None:
    import accelfn as af

    report = af.dry_run(_adamw_main, nproc_per_node=1, gpu="h100", search=False)
    bw = 3350e9 * 0.9
    update = 28 * 4096 * 4096 / bw  # fp32 p, g, m, v read, p, m, v written: 0.16 ms
    weight = (
        4 * 4096 * 4096 / bw
    )  # the forward's and the backward's two matmuls move it (or its gradient) once
    assert report.predicted is not None and any("fused optimizer kernel adamw" in n for n in report.notes)
    assert report.predicted.compute_s > update + 3 * weight  # without the update: 0.19 ms against 0.16 + 0.07


@pytest.mark.parametrize("backend", ["flash2", "cudnn"])
def test_a_step_compiled_as_one_graph_runs_transformers_causal_mask_as_a_full_attention(backend) -> None:
    from accelfn.dryrun.step_time import predict_step
    from accelfn.dryrun.timing import OpCost

    ta = TimingAssumptions(attention_backend=backend)
    flops = 10**12  # the computed half's

    def costs(causal: bool, mask: bool, scale: int = 1) -> list[OpCost]:
        return [
            OpCost("attention", flops=scale * flops, seq=2048, causal=causal, mask=mask, backward_kernel=b)
            for b in (False, True)
        ]

    def seconds(ops: list[OpCost], compiled: str | None) -> float:
        return predict_step(ops, H100, timing=ta, compiled=compiled).compute_s

    masked = costs(causal=True, mask=True)
    full = seconds(costs(causal=False, mask=False, scale=2), "step")  # every block computed, none skipped
    causal = seconds(costs(causal=True, mask=False), "step")  # is_causal: the masked half skipped
    assert full > 1.5 * causal
    assert seconds(masked, "step") == pytest.approx(full)  # the mask traced with the model
    assert seconds(masked, "blocks") == pytest.approx(causal)  # the mask made outside the blocks, skipped
    assert seconds(masked, None) == pytest.approx(causal)  # eager: transformers passes is_causal
    assert seconds(costs(causal=True, mask=False), "step") == pytest.approx(causal)  # torchtitan's is_causal


@pytest.mark.parametrize("n, gbs", [(1024, 1950), (2048, 2180), (4096, 2300), (16384, 1810)])
def test_a_compiled_reduction_runs_at_torch_compiles_measured_bandwidth(n, gbs) -> None:
    # Dao-AILab/quack's figure: torch.compile's RMSNorm (bf16) on an H100 80GB HBM3, GB/s by the rows' length
    from accelfn.dryrun.step_time import predict_step
    from accelfn.dryrun.timing import OpCost

    nbytes = 10**9
    norm = OpCost("memory", nbytes=nbytes, reduce=n)
    pointwise = OpCost("memory", nbytes=nbytes)
    assert predict_step([norm], H100, compiled="step").compute_s == pytest.approx(nbytes / (gbs * 1e9))
    assert predict_step([pointwise], H100, compiled="step").compute_s == pytest.approx(
        nbytes / (3350e9 * 0.9)
    )
    # eager: ATen's kernel, at eager_memory_efficiency like any other
    assert predict_step([norm], H100).compute_s == pytest.approx(nbytes / (3350e9 * 0.84))
    # a flat figure overrides the measured one
    flat = TimingAssumptions(reduction_efficiency=0.5)
    assert predict_step([norm], H100, compiled="step", timing=flat).compute_s == pytest.approx(
        nbytes / 1675e9
    )


def test_a_fused_run_takes_its_slowest_reduction_and_short_reductions_run_as_pointwise() -> None:
    from accelfn.dryrun.step_time import predict_step
    from accelfn.dryrun.timing import OpCost

    nbytes = 10**9
    run = [OpCost("memory", nbytes=nbytes, reduce=4096), OpCost("memory", nbytes=1, reduce=256)]
    # log2-interpolated: 256 keys' 1,275 GB/s is the run's slowest
    assert predict_step(run, H100, compiled="step").compute_s == pytest.approx(nbytes / 1275e9)
    short = [OpCost("memory", nbytes=nbytes, reduce=2)]  # summing pairs: inductor makes it pointwise
    assert predict_step(short, H100, compiled="step").compute_s == pytest.approx(nbytes / (3350e9 * 0.9))
    w = math.log2(3000 / 2048)
    mid = [OpCost("memory", nbytes=nbytes, reduce=3000)]
    assert predict_step(mid, H100, compiled="step").compute_s == pytest.approx(
        nbytes / ((2180 * (1 - w) + 2300 * w) * 1e9)
    )


def test_reductions_are_recorded_with_the_length_of_the_rows_they_reduce() -> None:
    x = torch.randn(4, 8, 2048)
    cases = [
        (torch.ops.aten.mean.dim, (x, [-1], True), 2048),  # transformers' RMSNorm
        (torch.ops.aten.sum.dim_IntList, (x, [0, 1]), 32),  # a weight gradient's sum over the tokens
        (torch.ops.aten._log_softmax.default, (x, -1, False), 2048),
        (torch.ops.aten._log_softmax_backward_data.default, (x, x, -1, torch.float32), 2048),
        (torch.ops.aten.mul.Tensor, (x, x), 0),
    ]
    for func, args, reduce in cases:
        out = func(*args)
        assert op_cost(func, args, {}, out).reduce == reduce, func
