"""MoE load balancing: the router z-loss, and aux-loss-free balancing by an expert bias (the biased top-k, its
counts under accumulation and full remat, the update) in one process; over ep=2 on real processes vs one
process on the global batch (tests/workers/moe_balance_worker.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import accelfn as af
from accelfn.moe import (
    add_aux_loss,
    add_expert_bias,
    biased_topk,
    register_expert_bias,
    router_z_loss,
    update_expert_bias,
)
from tests._launch import expect_ok, run_workers

EXPERTS, TOPK = 4, 2


def qwen() -> nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         num_experts=EXPERTS, num_experts_per_tok=TOPK)  # fmt: skip
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    return model


def batch(rows: int = 4) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 32, (rows, 6), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def lm(model: nn.Module, b: dict[str, torch.Tensor]) -> af.Loss:
    return af.losses.cross_entropy(model(input_ids=b["input_ids"]).logits[:, :-1], b["labels"][:, 1:])


def test_router_z_loss_is_the_mean_squared_logsumexp_summed_over_layers_with_padding_left_out():
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(6, EXPERTS, generator=g), torch.randn(6, EXPERTS, generator=g)]
    mask = torch.tensor([1, 1, 0, 1, 0, 1])
    want = sum((torch.logsumexp(x[mask.bool()], -1) ** 2).mean() for x in logits)
    assert torch.allclose(router_z_loss(logits, mask), want)
    loss = add_aux_loss(af.Loss(torch.tensor(3.0), torch.tensor(2.0)), router_z_loss(logits, mask), 0.5)
    assert torch.allclose(loss.total / loss.count, 1.5 + 0.5 * want)  # coef x z-loss on the mean loss


def test_biased_topk_chooses_on_score_plus_bias_and_weights_with_the_unbiased_score():
    router = nn.Linear(8, EXPERTS)
    register_expert_bias(router, EXPERTS)
    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 5.0]))
    scores = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]], requires_grad=True)
    values, idx = biased_topk(router, scores, 2)
    assert idx.tolist() == [[3, 0], [3, 2]]
    assert torch.equal(values, torch.tensor([[0.1, 0.4], [0.4, 0.3]]))
    assert router.expert_tokens.tolist() == [1, 0, 1, 2]
    values.sum().backward()  # the gradient reaches the scores the rows were weighted with
    assert scores.grad.tolist() == [[1, 0, 0, 1], [0, 0, 1, 1]]
    with torch.no_grad():  # an eval forward does not count
        biased_topk(router, scores, 2)
    assert router.expert_tokens.tolist() == [1, 0, 1, 2]


def test_zero_bias_routes_as_transformers_and_a_bias_changes_the_choice():
    model, patched = qwen(), qwen()
    assert add_expert_bias(patched) == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    ids = batch()["input_ids"]
    with torch.no_grad():
        assert torch.allclose(patched(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-6)
        gate = patched.model.layers[0].mlp.gate
        gate.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 1.0]))  # expert 3 in every row's top 2
        logits, weights, idx = gate(torch.randn(5, 16))
    assert (idx == 3).any(-1).all()
    chosen = logits.softmax(-1).gather(-1, idx)  # the unbiased probabilities (Qwen3-MoE: not renormalised)
    assert not gate.norm_topk_prob and torch.allclose(weights, chosen)


def _tokens(step: af.Step) -> torch.Tensor:
    state = step.init(_biased(), seed=0)
    state, _ = step(state, batch())
    return torch.stack([v for k, v in sorted(state.buffers.items()) if k.endswith("expert_tokens")])


def _biased() -> nn.Module:
    model = qwen()
    add_expert_bias(model)
    return model


def test_counts_once_per_row_under_accumulate_and_full_remat():
    """The step's counts: every row of the batch once per layer, the same with 2 micro-batches and under full
    remat (whose backward recomputes the forward: not counted again)."""
    plain = _tokens(af.train_step(lm, af.optim.sgd(0.1)))
    assert (plain.sum(-1) == 4 * 6 * TOPK).all(), plain
    assert torch.equal(_tokens(af.accumulate(af.train_step(lm, af.optim.sgd(0.1)), 2)), plain)
    assert torch.equal(_tokens(af.remat(af.train_step(lm, af.optim.sgd(0.1)), "full")), plain)


def test_update_moves_the_bias_towards_the_underloaded_experts_and_zeroes_the_counts():
    step = af.train_step(lm, af.optim.sgd(0.1))
    state, _ = step(step.init(_biased(), seed=0), batch())
    counts = torch.stack([state.buffers[f"model.layers.{i}.mlp.gate.expert_tokens"] for i in (0, 1)])
    new, metrics = update_expert_bias(state, rate=0.25)
    assert torch.equal(metrics["moe_tokens"], counts)
    mean = counts.double().mean(-1, keepdim=True)
    for i in (0, 1):
        want = 0.25 * torch.sign(mean[i] - counts[i]).float()
        assert torch.equal(new.buffers[f"model.layers.{i}.mlp.gate.expert_bias"], want)
        assert not new.buffers[f"model.layers.{i}.mlp.gate.expert_tokens"].any()
    new, _ = step(new, batch())  # the next step counts from zero with the new bias
    assert (new.buffers["model.layers.0.mlp.gate.expert_tokens"].sum() == 4 * 6 * TOPK).item()


def test_update_without_bias_buffers_and_a_model_without_routers_are_named_errors():
    state = af.train_step(lm, af.optim.sgd(0.1)).init(qwen())
    with pytest.raises(ValueError, match="no '\\*.expert_tokens' buffer; call af.moe.add_expert_bias"):
        update_expert_bias(state)
    with pytest.raises(ValueError, match="Linear has no module whose class ends in 'TopKRouter'"):
        add_expert_bias(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="the router 'model.embed_tokens' .* is not a softmax top-k router"):
        add_expert_bias(qwen(), routers=["model.embed_tokens"])


@pytest.mark.slow
def test_expert_bias_and_z_loss_over_ep2_with_accumulate_equal_one_process():
    """3 steps, accumulate 2, ep=2 on 2 processes: biases equal on every rank and to one process on the global
    batch, the same global tokens per expert and loss (with the global router z-loss)."""
    expect_ok(run_workers("moe_balance_worker.py", 2, timeout=300), ["balance"], 2)
