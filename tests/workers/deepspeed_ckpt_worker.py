"""Worker: af.checkpoint of DeepSpeed steps (run by test_deepspeed.py). Args: a shared folder, then configs
like `zero2:adamw`, `zero1:adamw:schedule`, `zero2:sgd`, `zero2:adamw:bf16`."""

import os
import sys

import torch
from torch import nn

import accelfn as af

STEPS, SPLIT = 5, 3


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 5))


def batches():
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 5, (8,), generator=g)
        y[:3] = -100  # uneven valid labels across the two ranks
        out.append({"x": x, "y": y})
    return out


def loss_fn(m, b):
    return af.losses.cross_entropy(m(b["x"]), b["y"])


def make(extra, mesh=None, **shard_kw):
    if "offload" in extra and shard_kw.get("backend") == "deepspeed":
        shard_kw["offload_optimizer"] = True
    if "sgd" in extra:
        tx = af.optim.sgd(0.1, momentum=0.9)
    else:
        lr = af.optim.warmup_cosine(3e-2, warmup=2, total=STEPS) if "schedule" in extra else 1e-2
        tx = af.optim.adamw(lr, weight_decay=0.01)
    step = af.train_step(loss_fn, tx, clip_grad_norm=1.0)
    if "bf16" in extra:
        step = af.autocast(step, torch.bfloat16)
    return step if mesh is None else af.shard(step, mesh, inputs="global", **shard_kw)


def run(step, state, data):
    for b in data:
        state, _ = step(state, b)
    return state


def full_params(step, state):
    # the exported state's params: the fp32 master values (what af.checkpoint writes)
    from accelfn.checkpoint import adapters

    adapter = adapters.adapter_for(state)
    return (adapter.export(state) if adapter else state).params


def max_diff(a, b):
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def update_error(a, ref):
    """|a's update - ref's update| / |ref's update| from the initial params (bf16: DeepSpeed trains bf16
    weights, the ddp step fp32 ones under autocast; a run that did not train gives 1.0)."""
    init = dict(model().named_parameters())
    delta = torch.cat([(a[k].float() - ref[k].float()).flatten() for k in ref])
    moved = torch.cat([(ref[k].float() - init[k]).flatten() for k in ref])
    return (delta.norm() / moved.norm()).item()


def check(name):
    stage, *extra = name.split(":")
    ds = lambda: make(extra, mesh, backend="deepspeed", zero_stage=int(stage.removeprefix("zero")))  # noqa: E731
    ddp = lambda: make(extra, mesh, strategy="ddp")  # noqa: E731
    data = batches()
    folder = os.path.join(ROOT, name.replace(":", "-"))

    whole_step = ds()
    whole = full_params(whole_step, run(whole_step, whole_step.init(model()), data))
    ddp_whole_step = ddp()
    ddp_whole = run(ddp_whole_step, ddp_whole_step.init(model()), data).params

    first = ds()
    state = run(first, first.init(model()), data[:SPLIT])
    af.checkpoint.save(folder, state)
    # a fresh DeepSpeed step resumes from the files and ends where the uninterrupted run ended
    second = ds()
    resumed = af.checkpoint.load(folder, like=second.init(model()))
    assert int(resumed.step) == SPLIT and int(resumed.opt_state.count) == SPLIT, (
        resumed.step,
        resumed.opt_state,
    )
    resumed = run(second, resumed, data[SPLIT:])
    diff = max_diff(full_params(second, resumed), whole)
    assert diff <= 1e-6, (
        f"rank {mesh.rank}: resumed DeepSpeed run differs from the uninterrupted one by {diff}"
    )

    # the same files resume a backend="torch" ddp step (fp32 masters, moments, count, schedule)
    compare, tol = (update_error, 0.1) if "bf16" in extra else (max_diff, 1e-4)
    torch_step = ddp()
    from_ds = run(torch_step, af.checkpoint.load(folder, like=torch_step.init(model())), data[SPLIT:])
    diff_ddp = compare(from_ds.params, ddp_whole)
    assert diff_ddp <= tol, f"rank {mesh.rank}: ddp resumed from a DeepSpeed checkpoint differs by {diff_ddp}"

    # and a ddp checkpoint resumes a DeepSpeed step
    torch_first = ddp()
    af.checkpoint.save(folder + "-ddp", run(torch_first, torch_first.init(model()), data[:SPLIT]))
    third = ds()
    from_ddp = run(third, af.checkpoint.load(folder + "-ddp", like=third.init(model())), data[SPLIT:])
    diff_back = compare(full_params(third, from_ddp), whole)
    assert diff_back <= tol, (
        f"rank {mesh.rank}: DeepSpeed resumed from a ddp checkpoint differs by {diff_back}"
    )
    print(f"rank {mesh.rank}: OK {name} (resume {diff:.1e}, into ddp {diff_ddp:.1e}, from ddp {diff_back:.1e})",
          flush=True)  # fmt: skip


if __name__ == "__main__":
    ROOT, CONFIGS = sys.argv[1], sys.argv[2:]
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    mesh = af.Mesh({"dp": -1}, device="cpu")
    for config in CONFIGS:
        check(config)
    mesh.close()
