"""MoE load balancing: the router z-loss, and aux-loss-free balancing by an expert bias (the biased top-k, its
counts under accumulation and full remat, the update), the capacity factor with token dropping, the step's MoE
metrics, in one process; over ep=2 on real processes vs one process on the global batch, and ep=2 composed with
compile, offload and fp8 (tests/workers/moe_balance_worker.py)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import accelfn as af
from accelfn.moe import (
    AllToAllDispatcher,
    add_aux_loss,
    add_expert_bias,
    biased_topk,
    local_experts,
    register_expert_bias,
    router_z_loss,
    set_capacity,
    step_metrics,
    update_expert_bias,
)
from tests._launch import expect_ok, run_workers

EXPERTS, TOPK = 4, 2


def qwen(hidden: int = 16, moe: int = 8) -> nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=32, hidden_size=hidden, intermediate_size=32, moe_intermediate_size=moe,
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


def test_capacity_keeps_the_first_rows_of_each_expert_and_combines_the_dropped_ones_as_zeros():
    d = AllToAllDispatcher(None, EXPERTS, 1, capacity_factor=0.5)  # ceil(0.5 * 8 / 4) = 1 row per expert
    x = torch.randn(8, 3, requires_grad=True)
    experts = torch.tensor([0, 1, 0, 0, 2, 0, 1, 3])
    rows, counts, handle = d.dispatch(x, experts)
    kept = torch.tensor([0, 1, 4, 7])  # the first row of each expert, by position
    assert counts.tolist() == [1, 1, 1, 1] and torch.equal(rows, x[kept])
    back = d.combine(rows * 2, handle)
    want = torch.zeros(8, 3)
    want[kept] = 2 * x[kept].detach()
    assert torch.equal(back, want)
    (grad,) = torch.autograd.grad(back.sum(), x)
    assert grad[kept].eq(2).all() and not grad[[2, 3, 5, 6]].any()  # a dropped row gets no gradient
    m = step_metrics([d])
    assert m["moe_tokens"].tolist() == [[4, 2, 1, 1]] and m["moe_dropped"].item() == 0.5
    assert m["moe_imbalance"].item() == 2.0
    assert not step_metrics([d])["moe_tokens"].any()  # taken: the next step counts from zero


def _hand_kept(idx: torch.Tensor, factor: float) -> torch.Tensor:
    """1 for each choice ([tokens, k]) an expert with capacity ceil(factor * rows / E) takes in token order."""
    cap, seen = math.ceil(factor * idx.numel() / EXPERTS), [0] * EXPERTS
    keep = []
    for e in idx.reshape(-1).tolist():
        seen[e] += 1
        keep.append(float(seen[e] <= cap))
    return torch.tensor(keep).view_as(idx)


def test_set_capacity_equals_transformers_experts_with_the_dropped_choices_weighted_zero():
    """One process: the loss and every gradient (experts, router, attention) equal the model whose experts run
    transformers' own forward with the routing weight of each choice over capacity set to zero by hand."""
    factor, ref, model = 0.75, qwen(), qwen()
    dropped = []
    for layer in ref.model.layers:
        experts = layer.mlp.experts

        def masked(h, idx, w, orig=experts.forward):
            keep = _hand_kept(idx, factor)
            dropped.append(int((keep == 0).sum()))
            return orig(h, idx, w * keep)

        experts.forward = masked
    dispatchers = set_capacity(model, factor)
    assert len(dispatchers) == 2
    losses, grads = [], []
    for m in (ref, model):
        loss = lm(m, batch())
        losses.append(loss.total / loss.count)
        grads.append(torch.autograd.grad(losses[-1], list(m.parameters())))
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    metrics = step_metrics(dispatchers)
    assert sum(dropped) > 0 and metrics["moe_dropped"].item() == sum(dropped) / (2 * 4 * 6 * TOPK)


def test_capacity_errors_name_the_culprit():
    with pytest.raises(ValueError, match="capacity_factor must be a number > 0"):
        AllToAllDispatcher(None, EXPERTS, 1, capacity_factor=0)
    with pytest.raises(ValueError, match="Linear has no expert-parallel plan"):
        set_capacity(nn.Linear(2, 2), 1.25)


@pytest.mark.slow
def test_moe_over_ep2_equals_one_process_and_composes():
    """ep=2 on 2 processes. balance: 3 steps, accumulate 2: biases equal on every rank and to one process on the
    global batch, the same global tokens per expert (the routers' and the step's `moe_tokens`) and loss (with the
    global router z-loss). capacity: a capacity factor of 1.0 drops what one process drops on the global batch
    (loss, params, `moe_tokens`, `moe_dropped` vs counts by hand). compile (per block and whole step), offload
    (master params and state on the host): equal to ep=2 without them. fp8 (torchao, emulated): dense layers in
    fp8, experts not (said in print(step)), equal to dp=2 with the same fp8 layers."""
    configs = ["balance", "capacity", "compile", "offload", "fp8"]
    expect_ok(run_workers("moe_balance_worker.py", 2, *configs, timeout=400), configs, 2)


def _deepseek() -> nn.Module:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV3Config(vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                           num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2,
                           q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
                           n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2)  # fmt: skip
    model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():
        model.model.layers[1].mlp.gate.weight.normal_(0, 0.5)
    return model


def test_a_deepseek_v3_router_keeps_its_sigmoid_group_choice_and_its_own_bias_moves():
    """DeepSeek-V3's router (sigmoid scores, top-k within the best groups, its own `e_score_correction_bias` for the
    choice only) keeps its forward; add_expert_bias only counts its choices (equal to the experts its forward
    returns, recorded by a hook), and update_expert_bias moves its own bias by rate * sign(mean - count)."""
    model = _deepseek()
    gate = model.model.layers[1].mlp.gate
    chosen: list[torch.Tensor] = []
    gate.register_forward_hook(lambda m, args, out: chosen.append(out[-1].detach().reshape(-1)))
    assert add_expert_bias(model) == ["model.layers.1.mlp.gate"]
    step = af.train_step(lm, af.optim.sgd(0.1))
    state, _ = step(step.init(model, seed=0), batch())
    counts = torch.bincount(torch.cat(chosen), minlength=8)
    assert torch.equal(state.buffers["model.layers.1.mlp.gate.expert_tokens"], counts)
    new, metrics = update_expert_bias(state, rate=0.25)
    want = 0.25 * torch.sign(counts.double().mean() - counts.double()).float()
    assert torch.equal(new.buffers["model.layers.1.mlp.gate.e_score_correction_bias"], want)
    assert torch.equal(metrics["moe_tokens"][0], counts)
    with torch.no_grad():  # the moved bias steers the choice: a large one on expert 5 takes every row
        bias = gate.e_score_correction_bias
        bias.copy_(torch.zeros(8))
        bias[5] = 100.0
        _, _, idx = gate(torch.randn(10, 16))
    assert (idx == 5).any(-1).all()


def test_a_group_limited_router_without_its_own_bias_is_refused():
    model = _deepseek()
    gate = model.model.layers[1].mlp.gate
    del gate.e_score_correction_bias
    with pytest.raises(ValueError, match="is not a softmax top-k router"):
        add_expert_bias(model, routers=["model.layers.1.mlp.gate"])


def test_fp8_experts_forward_and_gradients_within_torchaos_bounds():
    """The experts' grouped GEMMs in emulated mxfp8 (as `af.autocast_fp8(emulate=True)` sets them) against the same
    experts in fp32 (the per-expert loop): 4 experts, uneven row groups (padded to 32-row blocks) and an idle one.
    Bounds from torchao's own test of one mxfp8 grouped GEMM (test/prototype/moe_training/test_mxfp8_grouped_mm.py,
    test_mxfp8_grouped_gemm_with_dq_fwd_bwd: SQNR >= 27 dB output, 25 dB input gradient, 24 dB weight gradient),
    less 10 log10(3) = 4.8 dB for the three quantized products in series here (gate, up, down): 22, 20, 19 dB; below
    40 dB (really quantized). The idle expert's gradients are zeros (not NaN from unset rows, transformers #48205)."""
    from torchao.quantization.utils import compute_error

    from accelfn.moe.experts import FP8_RECIPE

    experts = qwen(hidden=64, moe=64).model.layers[0].mlp.experts
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 64**-0.5)
        experts.down_proj.normal_(0, 64**-0.5)
    g = torch.Generator().manual_seed(3)
    counts = torch.tensor([37, 0, 50, 9])
    rows = torch.randn(int(counts.sum()), 64, generator=g, requires_grad=True)
    weigh = torch.randn(int(counts.sum()), 64, generator=g)
    outs = []
    for recipe in (None, "mxfp8_emulated"):
        if recipe is not None:
            setattr(experts, FP8_RECIPE, recipe)
        y = local_experts(experts, rows, counts)
        outs.append(
            (y, *torch.autograd.grad((y * weigh).sum(), [rows, experts.gate_up_proj, experts.down_proj]))
        )
    out, *grads = outs[1]
    assert out.dtype == torch.float32
    for what, a, b, least in zip(
        ("output", "rows", "gate_up_proj", "down_proj"), outs[0], outs[1], (22, 20, 19, 19)
    ):
        sqnr = compute_error(a, b).item()
        assert least <= sqnr < 40, (what, sqnr)
    assert not grads[1][1].any() and not grads[2][1].any()  # expert 1: no rows (NaN would count as nonzero)


def test_autocast_fp8_puts_the_experts_in_fp8_or_refuses_naming_the_opt_out():
    """One process. emulate=True: both experts modules' grouped GEMMs in emulated mxfp8 (print(step) says so), and a
    step's expert update is the fp32 experts' one (`fp8_experts=False`, the same fp8 Linear layers) within the weight
    gradient's bound above, but not equal. Without emulation on a CPU (no fp8 grouped GEMM): a RuntimeError naming
    the experts, the kernels torchao has and the opt-out. `fp8_experts=False` keeps them in their dtype, said in
    print(step); experts whose dims take no 32-blocks are kept, said with the dims."""
    from torchao.quantization.utils import compute_error

    from accelfn.moe.experts import FP8_RECIPE

    def fp8(**kw):  # noqa: ANN003, ANN202
        return af.autocast_fp8(af.train_step(lm, af.optim.sgd(1.0)), backend="torchao", **kw)

    updates, texts = [], []
    for fp8_experts in (True, False):
        step = fp8(emulate=True, fp8_experts=fp8_experts)
        state = step.init(qwen(hidden=32, moe=32))
        before = state.params["model.layers.1.mlp.experts.down_proj"].clone()
        state, _ = step(state, batch())
        updates.append(before - state.params["model.layers.1.mlp.experts.down_proj"])  # lr 1: the gradient
        texts.append(repr(step))
        fp8_set = [getattr(m, FP8_RECIPE, None) for m in step.model.modules() if hasattr(m, "gate_up_proj")]
        assert fp8_set == (["mxfp8_emulated"] * 2 if fp8_experts else [None, None]), fp8_set
    assert "2 experts module(s) with grouped GEMMs in mxfp8_emulated (torchao)" in texts[0], texts[0]
    assert "fp8_experts=False" in texts[1] and "stay in float32 (fp8_experts=False)" in texts[1], texts[1]
    assert 19 <= compute_error(updates[1], updates[0]).item() < 40
    with pytest.raises(RuntimeError, match=r"experts \(model.layers.0.mlp.experts and 1 more\) .* no fp8 kernel on cpu "
                       r"\(torchao's moe_training runs fp8 rowwise on CUDA sm90 .* Pass fp8_experts=False"):  # fmt: skip
        fp8().init(qwen(hidden=32, moe=32))
    step = fp8(emulate=True)
    step.init(qwen())
    text = repr(step)
    assert "2 experts module(s) kept in float32 (dims (16, 16, 8) not multiples of 32" in text, text


_FP8_MOE_SCRIPT = """
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
import accelfn as af

with af.Mesh.from_env(device="cpu") as mesh:
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    step = af.train_step(lambda m, b: m(input_ids=b).logits.float().mean(), af.optim.sgd(0.1))
    step = af.autocast_fp8(af.autocast(step, "bf16"), backend="torchao", module_filter=lambda m, n: False)
    step = af.shard(step, mesh)
    state = step.init(Qwen3MoeForCausalLM(cfg))
    state, m = step(state, torch.randint(0, 64, (2, 64)))
"""


def test_dry_run_of_an_h100_counts_the_fp8_experts_grouped_gemms_as_fp8(tmp_path):
    """`accelfn dry-run --gpu h100` of ep=2 with the experts in fp8 (no Linear layer: module_filter): torchao's
    kernels do not run on fake tensors, so the experts' GEMMs are modelled as `torch._scaled_grouped_mm` on fp8
    operands (said in print(step)); the fp8 FLOPs are exactly those of the experts' two GEMMs, forward, input and
    weight gradient (3 x 2 x rows x (64 x 128 + 64 x 64)), on rows padded to 16 per expert."""
    script = tmp_path / "fp8_moe.py"
    script.write_text(_FP8_MOE_SCRIPT)
    report = af.dry_run(script, nproc_per_node=2, device="cuda", gpu="h100", mesh="ep=2", search=False)
    assert not report.errors, report.errors
    assert (
        "experts module(s) with grouped GEMMs in fp8 (modelled: torchao's kernels do not run on fake tensors)"
        in (report.strategy)
    ), report.strategy
    (obj,) = report.step_objects
    per_row = (
        3 * 2 * (64 * 128 + 64 * 64)
    )  # fwd + 2 bwd GEMMs, gate_up [128, 64] and down [64, 64], 2 FLOPs a MAC
    fp8 = obj["fp8_flops_per_step"]
    assert fp8 > 0 and fp8 % (per_row * 16) == 0 and fp8 // per_row >= 2 * 64 * 2, (fp8, fp8 / per_row)
