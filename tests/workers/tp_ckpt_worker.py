"""Worker (4 processes): a state saved on dp2 x tp2 (FSDP over TP: `_StridedShard` placements) loads into
dp2 x tp2 with ddp, into fsdp over 4 ranks, and back, with identical values (the test loads it on one process).

    accelfn launch --nproc-per-node 4 --cpu tests/workers/tp_ckpt_worker.py FOLDER
"""

import sys
from pathlib import Path

import torch

import accelfn as af

sys.path.insert(0, str(Path(__file__).parent))
from tp_worker import batches, full, loss_for, make_model  # noqa: E402

ROOT = Path(sys.argv[1])
loss_fn = loss_for("llama")


def build(mesh, strategy):
    return af.shard(af.train_step(loss_fn, af.optim.adamw(1e-3), clip_grad_norm=0.5), mesh, strategy=strategy,
                    inputs="global")  # fmt: skip


def values(state):
    out = {f"params.{k}": full(v) for k, v in state.params.items()}
    out.update({f"mu.{k}": full(v) for k, v in state.opt_state.mu.items()})
    out["step"] = full(state.step)
    return out


def same(a, b, what):
    assert a.keys() == b.keys(), what
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"{what}: {bad[:3]} differ"


with af.Mesh({"dp": 2, "tp": 2}, device="cpu") as mesh:
    step = build(mesh, "fsdp")
    state = step.init(make_model("llama"), seed=3)
    for b in batches("llama", n=2):
        state, _ = step(state, b)
    strided = [
        k for k, v in state.params.items() if any(type(p).__name__ == "_StridedShard" for p in v.placements)
    ]
    assert strided, [v.placements for v in state.params.values()][:3]  # FSDP over TP: what was refused before
    af.checkpoint.save(ROOT / "fsdp-tp", state)
    af.checkpoint.save_pretrained(
        ROOT / "fsdp-tp-hf", state, config=step.model.config
    )  # for the test's check
    saved = values(state)
    ddp_tp = build(mesh, "ddp")
    loaded = af.checkpoint.load(ROOT / "fsdp-tp", like=ddp_tp.init(make_model("llama"), seed=3))
    same(values(loaded), saved, "fsdp x tp -> ddp x tp")
    loaded, _ = ddp_tp(loaded, batches("llama", n=3)[2])  # and it trains on from there
    af.checkpoint.save(ROOT / "ddp-tp", loaded)
    after_ddp = values(loaded)

with af.Mesh({"dp": 4}, device="cpu") as mesh:
    fsdp4 = build(mesh, "fsdp")
    loaded = af.checkpoint.load(ROOT / "fsdp-tp", like=fsdp4.init(make_model("llama"), seed=3))
    same(values(loaded), saved, "fsdp x tp -> fsdp over 4")
    af.checkpoint.save(ROOT / "fsdp4", loaded)

with af.Mesh({"dp": 2, "tp": 2}, device="cpu") as mesh:  # and back
    step = build(mesh, "fsdp")
    back = af.checkpoint.load(ROOT / "fsdp4", like=step.init(make_model("llama"), seed=3))
    same(values(back), saved, "fsdp over 4 -> fsdp x tp")
    back = af.checkpoint.load(ROOT / "ddp-tp", like=back)
    same(values(back), after_ddp, "ddp x tp -> fsdp x tp")
    print(f"rank {mesh.rank}: TP CKPT OK ({len(strided)} params with _StridedShard)", flush=True)
