"""Worker: an expert-parallel checkpoint saved at one layout loads at others, params and optimizer state exact.

    accelfn launch --nproc-per-node 4 --cpu tests/workers/ep_ckpt_worker.py <folder>

On 4 processes, one run in phases: train a tiny transformers Qwen3-MoE 2 AdamW steps at dp2 x ep2 (ddp, experts
`Shard(0)` over ep) and save; load that checkpoint at ep4 (one expert per rank) and at fsdp2 x ep2 (the experts
FSDP-sharded within their ep rank too), each into a fresh state of another seed. Checked: every param and every
optimizer-state tensor, gathered, equal to the saved ones (torch.equal: a reshard moves bytes, it computes
nothing); the experts really held as other pieces; one more step after the load equal on both layouts (fp32
round-off) to one more step of the saved layout.
"""

import sys

import torch
import torch.distributed as dist

import accelfn as af
from accelfn.tree import flatten_with_path
from tests.workers.ep_worker import EXPERTS, batches, full, lm_loss, make_model

LAYOUTS = {
    "ep2": ({"dp": 2, "ep": 2}, "ddp"),
    "ep4": ({"ep": 4}, "ddp"),
    "fsdp2xep2": ({"fsdp": 2, "ep": 2}, "fsdp"),
}


def make_step(layout):
    shape, strategy = LAYOUTS[layout]
    mesh = af.Mesh(shape, device="cpu")
    step = af.shard(af.train_step(lm_loss, af.optim.adamw(1e-2)), mesh, strategy=strategy, inputs="global")
    return mesh, step


def gathered(state):
    """Every param and optimizer-state tensor of `state`, whole and copied (a step donates its state; a
    collective: every rank)."""
    out = {f"params/{k}": full(v).clone() for k, v in state.params.items()}
    for path, v in flatten_with_path(state.opt_state):
        if isinstance(v, torch.Tensor):
            out[f"opt/{path}"] = full(v).clone()
    return out


def experts_per_rank(state):
    return {tuple(v.to_local().shape) for k, v in state.params.items() if "experts" in k}


def main():
    folder = sys.argv[1]
    data = batches()
    mesh, step = make_step("ep2")
    state = step.init(make_model("qwen", None), seed=3)
    for b in data:
        state, _ = step(state, b)
    af.checkpoint.save(folder, state)
    saved = gathered(state)
    assert any(k.startswith("opt/") and "experts" in k for k in saved), sorted(saved)
    after, m_ref = step(state, data[0])
    want_next = gathered(after)
    for layout, local_experts in (("ep4", 1), ("fsdp2xep2", 1)):
        mesh, step = make_step(layout)
        fresh = step.init(make_model("qwen", None), seed=5)
        loaded = af.checkpoint.load(folder, like=fresh)
        got = gathered(loaded)
        assert sorted(got) == sorted(saved), (layout, sorted(set(got) ^ set(saved)))
        for k, v in saved.items():
            assert torch.equal(got[k], v), f"{layout}: {k} differs from the ep2 checkpoint"
        assert {s[0] for s in experts_per_rank(loaded)} == {local_experts}, (layout, experts_per_rank(loaded))
        assert EXPERTS // mesh.axis_size("ep") // (2 if layout.startswith("fsdp") else 1) == local_experts
        nxt, m = step(loaded, data[0])
        assert abs(m["loss"].item() - m_ref["loss"].item()) < 2e-5, (layout, m["loss"], m_ref["loss"])
        for k, v in gathered(nxt).items():
            diff = (v - want_next[k]).abs().max().item()
            assert diff < 2e-5, f"{layout}: {k} after a step differs from the ep2 run by {diff}"
        print(f"rank {mesh.rank}: OK {layout}", flush=True)
    dist.barrier()
    mesh.close()


if __name__ == "__main__":
    main()
