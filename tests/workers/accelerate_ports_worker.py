"""Accelerate's by_feature scripts and their accelfn ports (examples/early_stopping.py, gradient accumulation under a
prepared linear schedule as in nlp_example / gradient_accumulation, examples/local_sgd.py) run side by side in the same 2 CPU processes, on the same batches, from the same initial model: the ports must give
Accelerate's numbers (losses and params to fp32 round-off, the same stop step)."""

import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import accelfn as af

ROOT = Path(__file__).resolve().parents[2]


def example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


mesh = af.Mesh({"dp": -1}, device="cpu")
r, n = mesh.rank, mesh.world_size
assert n == 2, n

from accelerate import Accelerator  # noqa: E402 - after the mesh: Accelerate reuses the running process group
from accelerate.local_sgd import LocalSGD  # noqa: E402

accelerator = Accelerator(cpu=True)
assert accelerator.num_processes == 2 and accelerator.process_index == r
SEED, LR = 0, 3e-2


def close(ours: list[float], theirs: list[float], what: str) -> None:
    assert len(ours) == len(theirs), (what, len(ours), len(theirs))
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours, theirs, strict=True))
    assert worst < 1e-5, (what, worst, ours, theirs)


# ---- early stopping: each process's own loss, one trigger ----------------------------------------------------
es = example("early_stopping")
step, state, loader = es.build(mesh, lr=LR, batch_size=16, seed=SEED)
batches = list(loader)  # this process's batches, fed to both sides
state, ours, our_stop = es.train(step, state, batches, es.EarlyStoppingCallback(0.0, 3))

model = es.make_model(SEED)
opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
model, opt = accelerator.prepare(model, opt)
callback, theirs, their_stop = es.EarlyStoppingCallback(0.0, 3), [], None
for i, batch in enumerate(batches):
    loss = F.mse_loss(model(batch["x"]), batch["y"])
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
    theirs.append(loss.item())
    if callback.check_early_stopping(loss.item()):
        accelerator.set_trigger()
    if accelerator.check_trigger():
        their_stop = i
        break
assert our_stop == their_stop and our_stop is not None, (our_stop, their_stop)
close(ours, theirs, "early stopping losses")
# the trigger matters: alone, each process would stop at another step (the first one to decide stops both)
alone = es.EarlyStoppingCallback(0.0, 3)
own = next((i for i, x in enumerate(ours) if alone.check_early_stopping(x)), None)
owns = af.dist.gather_object([own], flatten=True)
assert our_stop == min(x for x in owns if x is not None) and len(set(owns)) > 1, (our_stop, owns)
print(
    f"rank {r}: early stopping at {our_stop} == accelerate {their_stop}; alone the ranks stop at {owns}",
    flush=True,
)

# ---- nlp_example / gradient_accumulation: a prepared linear schedule under accumulate -------------------------
# Accelerate steps a prepared scheduler num_processes times per update: the port divides its counts by n
from transformers import get_linear_schedule_with_warmup  # noqa: E402

ls = example("local_sgd")  # its model and data
GA, W, T = 2, 8, 40  # Accelerate's num_warmup_steps / num_training_steps, as a script passes them
loader = af.data.DataLoader(ls.make_data(512, SEED), batch_size=16, mesh=mesh, shuffle=True, seed=SEED)
batches = list(loader)[:12]
schedule = af.optim.warmup_linear(1e-2, warmup=W / n, total=T / n)
# AdamW's update does not change with the gradients' scale (m / sqrt(v)): the gradient norm of each update, with a
# clipping threshold never reached, is compared too (a gradient summed over the processes instead of averaged,
# or over the micro-batches, fails there)
NO_CLIP = 1e6
step = af.shard(
    af.accumulate(
        af.train_step(ls.loss_fn, af.optim.adamw(schedule, weight_decay=0.0), clip_grad_norm=NO_CLIP), GA
    ),
    mesh,
)
state = step.init(ls.make_model(SEED), seed=SEED)
ours, our_lrs, our_norms = [], [], []
for batch in batches:
    state, metrics = step(state, batch)
    ours.append(metrics["loss"].item())
    our_lrs.append(metrics["lr"].item())
    our_norms.append(metrics["grad_norm"].item())

accelerator.gradient_accumulation_steps = GA
model = ls.make_model(SEED)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
scheduler = get_linear_schedule_with_warmup(opt, num_warmup_steps=W, num_training_steps=T)
model, opt, scheduler = accelerator.prepare(model, opt, scheduler)
theirs, their_lrs, their_norms = [], [], []
for batch in batches:
    micro_losses = []
    for half in range(GA):
        rows = slice(half * 8, (half + 1) * 8)
        with accelerator.accumulate(model):
            loss = F.mse_loss(model(batch["x"][rows]), batch["y"][rows])
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                their_lrs.append(opt.param_groups[0]["lr"])  # the lr this update uses
                their_norms.append(accelerator.clip_grad_norm_(model.parameters(), NO_CLIP).item())
            opt.step()
            scheduler.step()
            opt.zero_grad()
        micro_losses.append(loss.detach())
    theirs.append(accelerator.reduce(torch.stack(micro_losses).mean(), "mean").item())  # the global loss
close(our_lrs, their_lrs, "learning rates")
close(our_norms, their_norms, "gradient norms under accumulation")
close(ours, theirs, "losses under a prepared schedule and accumulation")
print(f"rank {r}: gradient accumulation + linear schedule == accelerate ({len(ours)} updates)", flush=True)

# ---- local SGD with gradient accumulation --------------------------------------------------------------------
GA, K = 2, 8  # Accelerate's local_sgd_steps counts micro-batches: sync_every = K // GA updates
step, state, loader = ls.build(mesh, lr=1e-2, accumulation=GA, local_sgd_steps=K, batch_size=16, seed=SEED)
batches = list(loader)[:11]  # 22 micro-batches: the last averaging is the exit's
state, ours = ls.train(step, state, batches)
state = af.average_params(state, mesh)

model = ls.make_model(SEED)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
model, opt = accelerator.prepare(model, opt)
theirs = []
with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=K, enabled=True) as local_sgd:
    for batch in batches:
        micro_losses = []
        for half in range(GA):
            rows = slice(half * 8, (half + 1) * 8)
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(batch["x"][rows]), batch["y"][rows])
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()
                local_sgd.step()
            micro_losses.append(loss.item())
        theirs.append(sum(micro_losses) / GA)
close(ours, theirs, "local SGD losses (each process's own)")
reference = dict(accelerator.unwrap_model(model).named_parameters())
for name, p in state.params.items():
    torch.testing.assert_close(p, reference[name].detach(), rtol=1e-5, atol=1e-6, msg=name)
# between averagings the replicas differ (no gradient sync): the losses of the two processes are not the same
their_losses = af.dist.gather_object([ours], flatten=True)
assert their_losses[0] != their_losses[1]
print(
    f"rank {r}: local SGD {len(ours)} updates == accelerate LocalSGD (losses and averaged params)", flush=True
)
# ---- the averaging itself: several buckets, several dtypes (fp32, bf16, fp16), integers left alone -------------
from accelfn.transforms.shard.local_sgd import average  # noqa: E402

group = mesh.grad_group()
base = {  # rank r holds base x (r + 1): the mean over 2 ranks is base x 1.5, exact in every dtype here
    "a": (300, torch.float32), "b": (300, torch.float32), "c": (300, torch.float32),  # 1200 bytes each
    "d": (500, torch.bfloat16), "e": (500, torch.bfloat16), "f": (100, torch.float16),
}  # fmt: skip
held = {k: (torch.arange(n) % 16).to(dtype) * (r + 1) for k, (n, dtype) in base.items()}
held["steps"] = torch.arange(10) * (r + 1)  # not floating point: not averaged
before = group._get_sequence_number_for_group()  # gloo's own count of the collectives it ran
average(held.values(), group, bucket_mb=2000 / 2**20)  # buckets: (a, b), (c), (d, e), (f)
assert group._get_sequence_number_for_group() - before == 4
for k, (n, dtype) in base.items():
    want = (torch.arange(n) % 16).to(dtype) * 1.5
    assert held[k].dtype == dtype and torch.equal(held[k], want), k
assert torch.equal(held["steps"], torch.arange(10) * (r + 1))
print(f"rank {r}: average over 4 buckets of 3 dtypes == the mean", flush=True)
mesh.close()
