"""Worker: an expert-parallel checkpoint saved at one layout loads at others, params and optimizer state exact.

    accelfn launch --nproc-per-node 4 --cpu tests/workers/ep_ckpt_worker.py <folder>

On 4 processes, one run in phases: train a tiny transformers Qwen3-MoE 2 AdamW steps at dp2 x ep2 (ddp, experts
`Shard(0)` over ep) and save; load that checkpoint at ep4 (one expert per rank) and at fsdp2 x ep2 (the experts
FSDP-sharded within their ep rank too), each into a fresh state of another seed. Checked: every param and every
optimizer-state tensor, gathered, equal to the saved ones (torch.equal: a reshard moves bytes, it computes
nothing); the experts really held as other pieces; one more step after the load equal on both layouts (fp32
round-off) to one more step of the saved layout. The same state written by `save_pretrained` (Hugging Face's
per-expert keys) read back by `load_pretrained` at each layout: exact, each rank reading only its experts.
Rank 0 writes the saved params and optimizer state whole (`<folder>-state.safetensors`) for the test's load in
one process without ep.
"""

import contextlib
import sys

import torch
import torch.distributed as dist

import accelfn as af
from accelfn.checkpoint._dist import region
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


@contextlib.contextmanager
def opened_keys():
    """The keys read through `safetensors.safe_open(...).get_slice` while the block runs (a list, filled live)."""
    import safetensors

    opened: list[str] = []
    real = safetensors.safe_open

    class Spy:
        def __init__(self, path, framework):
            self.f = real(path, framework=framework)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_slice(self, key):
            opened.append(key)
            return self.inner.get_slice(key)

    safetensors.safe_open = Spy
    try:
        yield opened
    finally:
        safetensors.safe_open = real


def check_pretrained(hf, step, saved, mesh):
    """The Hugging Face folder written at ep2 read into this layout: exact, each rank opening only the
    per-expert keys of the experts it holds."""
    like = step.init(make_model("qwen", None), seed=7).params
    with opened_keys() as opened:
        params = af.checkpoint.load_pretrained(hf, like=like)
    for k, v in params.items():
        assert torch.equal(full(v), saved[f"params/{k}"]), f"load_pretrained: {k} differs"
    mine = {int(k.split(".experts.")[1].split(".")[0]) for k in opened}
    pieces = [v for k, v in params.items() if k.endswith("experts.gate_up_proj")]
    lo, n = region(pieces[0])[0][0], pieces[0].to_local().shape[0]
    assert mine == set(range(lo, lo + n)), (mesh.rank, sorted(mine), lo, n)
    assert n < EXPERTS


def main():
    folder = sys.argv[1]
    data = batches()
    mesh, step = make_step("ep2")
    state = step.init(make_model("qwen", None), seed=3)
    for b in data:
        state, _ = step(state, b)
    af.checkpoint.save(folder, state)
    af.checkpoint.save_pretrained(folder + "-hf", state, model=step.model)
    saved = gathered(state)
    if mesh.is_main:  # the whole params, for the test to compare transformers' from_pretrained with
        from safetensors.torch import save_file

        save_file(
            {k[7:]: v for k, v in saved.items() if k.startswith("params/")}, folder + "-full.safetensors"
        )
        save_file(saved, folder + "-state.safetensors")  # params and AdamW state, for a load in one process
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
        check_pretrained(folder + "-hf", step, saved, mesh)  # last: a new init rebinds the FSDP params
        print(f"rank {mesh.rank}: OK {layout}", flush=True)
    dist.barrier()
    mesh.close()


if __name__ == "__main__":
    main()
