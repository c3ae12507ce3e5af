"""Worker: MoE load balancing over ep=2 (2 processes) == one process on the global batch, SGD, fp32.

    accelfn launch --nproc-per-node 2 --cpu tests/workers/moe_balance_worker.py

A tiny Qwen3-MoE with aux-loss-free balancing (`add_expert_bias`) trained 3 steps under `af.accumulate(2)` with
`update_expert_bias` after each, the loss plus the router z-loss of the global batch; the reference: one process,
no accumulation, the whole batch. Checked after each step: the expert biases equal on every rank and to the
reference's, the global tokens per expert equal, the loss equal; the z-loss shares add up to one process's value.
"""

import torch
import torch.distributed as dist

import accelfn as af
from accelfn.moe import add_aux_loss, add_expert_bias, router_z_loss, update_expert_bias

VOCAB, EXPERTS, TOPK, RATE, STEPS = 64, 4, 2, 0.05, 3


def make_model():
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


def main():
    mesh = af.Mesh({"ep": 2}, device="cpu")
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
    print(f"rank {mesh.rank}: OK balance []", flush=True)
    dist.barrier()
    mesh.close()


if __name__ == "__main__":
    main()
