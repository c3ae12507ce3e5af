"""af.dist.any / af.dist.all and gather_object(flatten=True) on 2 CPU processes, checked against Accelerate's
`set_trigger()` / `check_trigger()` and `accelerate.utils.gather_object` run in the same processes."""

import torch
import torch.distributed as dist

import accelfn as af

mesh = af.Mesh({"dp": -1}, device="cpu")
r, n = mesh.rank, mesh.world_size
assert n == 2, n

from accelerate import Accelerator  # noqa: E402 - after the mesh: Accelerate reuses the running process group
from accelerate.utils import gather_object as accelerate_gather_object  # noqa: E402

accelerator = Accelerator(cpu=True)
assert accelerator.num_processes == 2 and accelerator.process_index == r

# ---- gather_object(flatten=True) is Accelerate's gather_object ------------------------------------------------
cases = [[r], [r, 10 * r], [{"rank": r}, (r, "x")], [] if r == 0 else ["only rank 1"], (r,), [[r], [r]]]
for obj in cases:
    ours, theirs = af.dist.gather_object(obj, flatten=True), accelerate_gather_object(obj)
    assert ours == theirs, (obj, ours, theirs)
assert af.dist.gather_object([r], flatten=True) == [0, 1]
assert af.dist.gather_object([r]) == [[0], [1]]  # without flatten: one entry per rank, as before
try:
    af.dist.gather_object(r if r == 1 else [r], flatten=True)  # rank 1 passes an int: both ranks raise
except TypeError as e:
    assert "but rank 1 passed int;" in str(e), e
else:
    raise AssertionError("flatten=True with a non-list must raise on every rank")
print(f"rank {r}: gather_object flatten == accelerate {af.dist.gather_object([r], flatten=True)}", flush=True)

# ---- af.dist.any: one all-reduce, the same bool on every rank --------------------------------------------------
calls: list[str] = []
real_all_reduce = dist.all_reduce


def counting(*args, **kwargs):
    calls.append("all_reduce")
    return real_all_reduce(*args, **kwargs)


dist.all_reduce = counting
for mine, want_any, want_all in [(r == 1, True, False), (False, False, False), (True, True, True)]:
    calls.clear()
    got_any = af.dist.any(mine)
    assert calls == ["all_reduce"], calls  # one collective
    got_all = af.dist.all(mine)
    assert (got_any, got_all) == (want_any, want_all), (r, mine, got_any, got_all)
    assert calls == ["all_reduce", "all_reduce"], calls
assert af.dist.any(torch.tensor(r == 0)) is True and af.dist.any(torch.tensor([r * 0.0])) is False
dist.all_reduce = real_all_reduce

# ---- early stopping: each rank watches its own loss; all ranks stop at the same step -------------------------
# rank 0's loss falls below 0.5 at step 7, rank 1's at step 4: with `any` both stop at step 4, with `all` at 7
my_losses = [1.0 - (0.1 if r == 0 else 0.15) * s for s in range(20)]


def stop_step(check):
    for s, loss in enumerate(my_losses):
        if check(loss < 0.45):
            return s
    return None


def accelerate_stop_step():
    for s, loss in enumerate(my_losses):
        if loss < 0.45:
            accelerator.set_trigger()
        if accelerator.check_trigger():
            return s
    return None


ours, theirs = stop_step(af.dist.any), accelerate_stop_step()
assert ours == theirs == 4, (ours, theirs)
assert af.dist.gather_object([stop_step(af.dist.all)], flatten=True) == [6, 6]
print(f"rank {r}: early stop at step {ours} (accelerate: {theirs})", flush=True)

print(f"rank {r}/{n}: all trigger checks passed", flush=True)
mesh.close()
