"""Tensor parallel under fp8 in the dry run: torchao's float8 styles (`Float8ColwiseParallel`,
`Float8RowwiseParallel`, torchtitan's tensorwise TP since 2024) all-gather activations and gradients as float8
tensors, 1 byte an element, whose dtype reads as the bf16 they stand for: the tracker counts the bytes sent."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

pytest.importorskip("torchao.float8")

TOKENS, DIM, HIDDEN, TP = 64, 64, 128, 8


def _mlp_collectives(fp8: bool) -> list[tuple[str, bool, int]]:
    """(kind, backward, bytes) of the collectives of a sequence-parallel MLP's forward and backward over tp=8."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    from accelfn import mesh as _mesh
    from accelfn.dryrun.tracker import Collective, StepTracker

    _mesh.destroy_process_group()  # another test's
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=TP)
    try:
        mesh = init_device_mesh("cpu", (TP,))
        with FakeTensorMode(allow_non_fake_inputs=True):
            bf16 = torch.bfloat16
            mlp = torch.nn.Sequential(
                torch.nn.Linear(DIM, HIDDEN, bias=False, dtype=bf16),
                torch.nn.Linear(HIDDEN, DIM, bias=False, dtype=bf16),
            )
            col, row = ColwiseParallel, RowwiseParallel
            if fp8:
                convert_to_float8_training(mlp, config=Float8LinearConfig(emulate=True))
                col, row = Float8ColwiseParallel, Float8RowwiseParallel
            # the sequence split between the layers' regions: gathered in, scattered out (torchtitan's plan)
            plan = {"0": col(input_layouts=Shard(0)), "1": row(output_layouts=Shard(0))}
            parallelize_module(mlp, mesh, plan)
            x = torch.randn(TOKENS // TP, DIM, dtype=bf16, requires_grad=True)
            with StepTracker() as t:
                t.phase = "forward_backward"
                mlp(x).float().sum().backward()
    finally:
        dist.destroy_process_group()
    return [
        (c.kind, c.backward, c.nbytes)
        for c in t.timeline
        if isinstance(c, Collective) and c.kind in ("all_gather", "reduce_scatter")
    ]


def test_a_float8_all_gather_under_tensor_parallel_counts_one_byte_an_element() -> None:
    """The activation's all-gather (forward) and the output gradient's (backward) carry float8 data plus its fp32
    scale; the reduce-scatters of the partial sums stay bf16. Against plain ColwiseParallel / RowwiseParallel, whose
    all-gathers carry bf16."""
    gathered = TOKENS * DIM  # the whole sequence's elements, in each all-gather and reduce-scatter
    bf16 = _mlp_collectives(fp8=False)
    fp8 = _mlp_collectives(fp8=True)
    scale = 4  # each float8 tensor's fp32 tensorwise scale travels with it
    assert sorted(bf16) == sorted(
        [
            ("all_gather", False, 2 * gathered),
            ("reduce_scatter", False, 2 * gathered),
            ("all_gather", True, 2 * gathered),
            ("reduce_scatter", True, 2 * gathered),
        ]
    )
    assert sorted(fp8) == sorted(
        [
            ("all_gather", False, gathered + scale),  # e4m3 input
            ("reduce_scatter", False, 2 * gathered),
            ("all_gather", True, gathered + scale),  # e5m2 output gradient
            ("reduce_scatter", True, 2 * gathered),
        ]
    )


def test_fsdps_float8_weight_with_a_precomputed_scale_is_read_without_its_value() -> None:
    """torchao's `WeightWithDynamicFloat8CastTensor.__tensor_flatten__` asks `if self._precomputed_scale:`, which a
    fake scale cannot answer: after FSDP's float8 scales were precomputed (a dry run's micro-batch search, its
    second step) the default `accelfn dry-run ... --fp8` under fsdp failed there. Its tensors are read from the
    instance instead, and the dry run's byte counts see both."""
    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from accelfn.dryrun.timing import op_cost
    from accelfn.dryrun.tracker import _nbytes
    from accelfn.dryrun.wrapped import inner_tensors

    config = Float8Linear.from_float(
        torch.nn.Linear(4, 4), config=Float8LinearConfig(emulate=True)
    ).linear_mm_config
    with FakeTensorMode():
        data, scale = torch.zeros(64, 32), torch.ones(())
        weight = WeightWithDynamicFloat8CastTensor(data, config, torch.float32, scale)
        with pytest.raises(RuntimeError):  # what the dry run met: the scale's truth value
            weight.__tensor_flatten__()
        assert [t.shape for t in inner_tensors(weight)] == [data.shape, scale.shape]
        assert _nbytes(weight) == 64 * 32 * 4 + 4
        cost = op_cost(torch.ops.aten.abs.default, (weight,), {}, torch.zeros(64, 32))
        assert cost is not None and cost.nbytes == 2 * 64 * 32 * 4 + 4
    # before the first precompute the scale is None and flatten names the data alone, as before
    assert len(inner_tensors(WeightWithDynamicFloat8CastTensor(torch.zeros(2), config, torch.float32))) == 1
