"""A transformers MoE model's own experts (no ep) in autocast's dtype: accelfn.moe.autocast_experts."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from accelfn.moe.autocast_experts import NAME, grouped_mm_in_autocast_dtype

transformers = pytest.importorskip("transformers")


def _model() -> torch.nn.Module:
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, head_dim=8,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(cfg)


class _GroupedDtypes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.dtypes: list[tuple[torch.dtype, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._grouped_mm.default:
            self.dtypes.append((args[0].dtype, args[1].dtype))
        return func(*args, **(kwargs or {}))


def _run(model: torch.nn.Module, ids: torch.Tensor, autocast: bool) -> tuple[torch.Tensor, dict, list]:
    seen = _GroupedDtypes()
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast), seen:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, seen.dtypes


def test_the_experts_grouped_gemms_run_in_autocasts_dtype_and_equal_the_eager_loop() -> None:
    # reference: transformers' eager experts (a loop of F.linear, which autocast runs in bf16) on the same
    # fp32 weights; transformers' own grouped_mm casts the rows up to fp32 instead
    ids = torch.randint(0, 64, (2, 12))
    ours, eager, plain = _model(), _model(), _model()
    grouped_mm_in_autocast_dtype(ours)
    eager.set_experts_implementation("eager")
    plain.set_experts_implementation("grouped_mm")
    assert ours.config._experts_implementation == NAME
    loss, grads, dtypes = _run(ours, ids, autocast=True)
    ref_loss, ref_grads, _ = _run(eager, ids, autocast=True)
    _, _, plain_dtypes = _run(plain, ids, autocast=True)
    assert dtypes and set(dtypes) == {(torch.bfloat16, torch.bfloat16)}, dtypes
    assert set(plain_dtypes) == {(torch.float32, torch.float32)}, plain_dtypes  # what the cast is for
    torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=2e-2)
    assert grads.keys() == ref_grads.keys()
    for name in grads:  # fp32 gradients reach the fp32 master weights through the cast
        assert grads[name].dtype == torch.float32, name
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=0.1, atol=2e-2, msg=name)
    expert_grads = [n for n in grads if "experts" in n]
    assert expert_grads and all(grads[n].abs().sum() > 0 for n in expert_grads)


def test_without_autocast_the_experts_are_transformers_grouped_mm_exactly() -> None:
    ids = torch.randint(0, 64, (2, 12))
    ours, plain = _model(), copy.deepcopy(_model())
    grouped_mm_in_autocast_dtype(ours)
    plain.set_experts_implementation("grouped_mm")
    loss, grads, _ = _run(ours, ids, autocast=False)
    ref_loss, ref_grads, _ = _run(plain, ids, autocast=False)
    assert torch.equal(loss, ref_loss)  # the same call on the same data
    assert all(torch.equal(grads[n], ref_grads[n]) for n in grads)


def test_a_model_without_experts_is_named() -> None:
    with pytest.raises(ValueError, match="Linear is not a transformers model with experts"):
        grouped_mm_in_autocast_dtype(torch.nn.Linear(2, 2))
