"""Worker: MoE balancing, capacity and composition over ep=2 (2 processes) == a reference, SGD, fp32.

    accelfn launch --nproc-per-node 2 --cpu tests/workers/moe_balance_worker.py balance capacity compile offload fp8

balance: a tiny Qwen3-MoE with aux-loss-free balancing (`add_expert_bias`) trained 3 steps under `af.accumulate(2)`
with `update_expert_bias` after each, the loss plus the router z-loss of the global batch; the reference: one
process, no accumulation, the whole batch. Checked after each step: the expert biases equal on every rank and to
the reference's, the global tokens per expert equal (the routers' own counts, and the step's `moe_tokens`), the
loss equal; the z-loss shares add up to one process's value.
capacity: `set_capacity(model, 1.0)` on ep=2 vs one process with the same capacity on the global batch: loss,
params, `moe_tokens` and `moe_dropped` vs counts made by hand from the reference's routing.
compile / offload / fp8: ep=2 under `af.compile` (per block and whole step, aot_eager), `af.offload(params=True)`
(AdamW) vs the same ep=2 step without it; under `af.autocast_fp8` (torchao, emulated: the dense Linear layers in
fp8, the experts not: their dims take no mxfp8 32-blocks) vs dp=2 with the same fp8 layers and no ep (their fp8 scales are per rank alike).
"""

import math
import sys

import torch
import torch.distributed as dist

import accelfn as af
from accelfn.moe import add_aux_loss, add_expert_bias, router_z_loss, set_capacity, update_expert_bias

VOCAB, EXPERTS, TOPK, RATE, STEPS = 64, 4, 2, 0.05, 3


def make_model(bias=True):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         num_experts=EXPERTS, num_experts_per_tok=TOPK, max_position_embeddings=32,
                         tie_word_embeddings=False)  # fmt: skip
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # transformers zero-initialises the router: a skewed one, for the bias to correct
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
            layer.mlp.gate.weight[0] += 0.5
    if bias:
        add_expert_bias(model)
    return model


def batches():
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (8, 12), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def loss_fn(group):
    def fn(model, b):
        out = model(input_ids=b["input_ids"], output_router_logits=True)
        ce = af.losses.cross_entropy(out.logits[:, :-1], b["labels"][:, 1:])
        return add_aux_loss(ce, router_z_loss(out.router_logits, group=group), 0.01, group)

    return fn


def biases(state):
    return torch.stack([v for k, v in sorted(state.buffers.items()) if k.endswith("expert_bias")])


def check_balance(mesh):
    data = batches()
    # the z-loss shares of the ranks' rows add up to one process's z-loss of all rows
    logits = [torch.randn(10, EXPERTS, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    mine = [x[mesh.rank * 5 : (mesh.rank + 1) * 5] for x in logits]
    share = router_z_loss(mine, group=mesh.data_group())
    dist.all_reduce(share)
    assert abs(share.item() - router_z_loss(logits).item()) < 1e-5, (share, router_z_loss(logits))

    ref_step = af.train_step(loss_fn(None), af.optim.sgd(0.5))
    ref = ref_step.init(make_model(), seed=3)
    step = af.shard(af.accumulate(af.train_step(loss_fn(mesh.data_group()), af.optim.sgd(0.5)), 2), mesh,
                    inputs="global")  # fmt: skip
    state = step.init(make_model(), seed=3)
    for i, b in enumerate(data):
        ref, ref_m = ref_step(ref, b)
        ref, ref_tokens = update_expert_bias(ref, RATE)
        state, m = step(state, b)
        state, tokens = update_expert_bias(state, RATE, mesh.data_group())
        assert torch.equal(tokens["moe_tokens"], ref_tokens["moe_tokens"]), (i, tokens, ref_tokens)
        assert torch.equal(m["moe_tokens"], ref_tokens["moe_tokens"]), (i, m["moe_tokens"], ref_tokens)
        assert abs(m["loss"].item() - ref_m["loss"].item()) < 2e-5, (i, m["loss"], ref_m["loss"])
        mine, want = biases(state), biases(ref)
        assert torch.allclose(mine, want, atol=1e-7), (i, mine, want)
        every = [torch.empty_like(mine) for _ in range(mesh.world_size)]
        dist.all_gather(every, mine)
        assert all(torch.equal(every[0], x) for x in every), (i, every)
    assert biases(state).abs().sum() > 0, biases(state)  # the biases moved
    assert (tokens["moe_tokens"].sum(-1) == 8 * 12 * TOPK).all(), (
        tokens
    )  # every row of the global batch counted


def lm_loss(model, b):
    return af.losses.cross_entropy(model(input_ids=b["input_ids"]).logits[:, :-1], b["labels"][:, 1:])


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def assert_close(state, ref, tol=2e-5, what=""):
    assert sorted(state.params) == sorted(ref.params)
    for k, v in state.params.items():
        diff = (full(v) - full(ref.params[k])).abs().max().item()
        assert diff < tol, f"{what}{k} differs from the reference by {diff}"


def hand_counts(chosen, factor):
    """From the routers' choices ([tokens, k] per layer, in the global batch's order): the rows per expert, and
    the rows dropped when each expert takes the first ceil(factor * rows / E) in token order."""
    tokens, dropped, rows = [], 0, 0
    for idx in chosen:
        flat = idx.reshape(-1).tolist()
        cap = math.ceil(factor * len(flat) / EXPERTS)
        seen = [0] * EXPERTS
        for e in flat:
            seen[e] += 1
            dropped += seen[e] > cap
        tokens.append(seen)
        rows += len(flat)
    return torch.tensor(tokens), dropped / rows


def check_capacity(mesh, factor=1.0):
    data = batches()
    ref_model = make_model(bias=False)
    set_capacity(ref_model, factor)
    chosen = {}
    for i, layer in enumerate(ref_model.model.layers):
        layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: chosen.__setitem__(i, out[2]))
    ref_step = af.train_step(lm_loss, af.optim.sgd(0.5))
    ref = ref_step.init(ref_model, seed=3)
    model = make_model(bias=False)
    set_capacity(model, factor)
    step = af.shard(af.train_step(lm_loss, af.optim.sgd(0.5)), mesh, inputs="global")
    state = step.init(model, seed=3)
    assert f"capacity factor {factor}" in repr(step), repr(step)
    meter = af.Meter(step)  # shows the imbalance and the dropped fraction of the steps after its first
    dropped_any, seen = 0.0, []
    for i, b in enumerate(data):
        ref, ref_m = ref_step(ref, b)
        tokens, dropped = hand_counts([chosen[j] for j in sorted(chosen)], factor)
        state, m = meter(state, b)
        seen += [(m["moe_imbalance"].item(), dropped)] if i else []
        assert torch.equal(m["moe_tokens"], tokens), (i, m["moe_tokens"], tokens)
        assert abs(m["moe_dropped"].item() - dropped) < 1e-6, (i, m["moe_dropped"], dropped)
        assert abs(m["loss"].item() - ref_m["loss"].item()) < 2e-5, (i, m["loss"], ref_m["loss"])
        assert_close(state, ref, what=f"step {i + 1}: ")
        dropped_any += dropped
    assert dropped_any > 0.05, dropped_any  # the skewed router overfills expert 0: rows were dropped
    figures = meter.figures()
    assert abs(figures["moe_imbalance"] - max(x for x, _ in seen)) < 1e-6, (figures, seen)
    assert abs(figures["moe_dropped"] - sum(d for _, d in seen) / len(seen)) < 1e-6, (figures, seen)


def run_ep(mesh, wrap, opt=None, steps=2, model=None):
    step = af.train_step(lm_loss, opt or af.optim.sgd(0.5))
    step = af.shard(wrap(step), mesh, inputs="global")
    state = step.init(model or make_model(bias=False), seed=3)
    metrics = []
    for b in batches()[:steps]:
        state, m = step(state, b)
        metrics.append(m)
    return step, state, metrics


def check_compile(mesh):
    from torch._dynamo.utils import counters

    _, eager, eager_m = run_ep(mesh, lambda s: s)
    for regions in ("blocks", None):
        counters.clear()
        step, state, m = run_ep(mesh, lambda s, r=regions: af.compile(s, regions=r, backend="aot_eager"))
        assert regions is None or "compiled 2/2 blocks" in repr(step), repr(step)
        assert counters["stats"]["unique_graphs"] > 0, dict(counters["stats"])  # graphs were compiled
        for a, b in zip(m, eager_m):
            assert abs(a["loss"].item() - b["loss"].item()) < 2e-5, (regions, a["loss"], b["loss"])
            assert torch.equal(a["moe_tokens"], b["moe_tokens"]), (regions, a, b)
        assert_close(state, eager, what=f"compile(regions={regions}): ")


def check_offload(mesh):
    opt = af.optim.adamw(1e-2)
    _, plain, plain_m = run_ep(mesh, lambda s: s, opt)
    for params in (True, False):  # fp32 master params on the host (the copying path), or the state only
        step, state, m = run_ep(mesh, lambda s, p=params: af.offload(s, params=p), opt)
        for a, b in zip(m, plain_m):
            assert abs(a["loss"].item() - b["loss"].item()) < 2e-5, (a["loss"], b["loss"])
        assert_close(state, plain, what=f"offload(params={params}): ")
        if params:
            master = state.extra["offload_master"]["model.layers.0.mlp.experts.gate_up_proj"]
            assert torch.equal(full(master), full(state.params["model.layers.0.mlp.experts.gate_up_proj"]))


def check_fp8(mesh):
    def fp8(s):
        return af.autocast_fp8(s, backend="torchao", emulate=True)

    step, state, m = run_ep(mesh, fp8)
    text = repr(step)
    assert "2 experts module(s) kept in float32 (dims (16, 16, 8) not multiples of 32" in text, text
    n = sum(type(x).__name__ == "Float8Linear" for x in step.model.modules())
    assert n >= 2, text
    dp = af.Mesh({"dp": 2}, device="cpu")
    ref_step = af.shard(fp8(af.train_step(lm_loss, af.optim.sgd(0.5))), dp, inputs="global")
    ref = ref_step.init(make_model(bias=False), seed=3)
    for i, b in enumerate(batches()[:2]):
        ref, ref_m = ref_step(ref, b)
        assert abs(m[i]["loss"].item() - ref_m["loss"].item()) < 2e-5, (i, m[i]["loss"], ref_m["loss"])
    assert_close(state, ref, what="fp8: ")


def main():
    mesh = af.Mesh({"ep": 2}, device="cpu")
    checks = {"balance": check_balance, "capacity": check_capacity, "compile": check_compile,
              "offload": check_offload, "fp8": check_fp8}  # fmt: skip
    for name in sys.argv[1:] or ["balance"]:
        checks[name](mesh)
        print(f"rank {mesh.rank}: OK {name} []", flush=True)
    dist.barrier()
    mesh.close()


if __name__ == "__main__":
    main()
