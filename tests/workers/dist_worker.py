"""Every af.dist collective on N CPU processes, checked against exact expected values on every rank."""

import os
import tempfile
import time

import torch

import accelfn as af

mesh = af.Mesh.from_env()
r, n = mesh.rank, mesh.world_size
assert (af.dist.rank(), af.dist.world_size(), af.dist.is_main_process()) == (r, n, r == 0)
assert af.dist.local_rank() == int(os.environ["LOCAL_RANK"]) == r

# ---- gather: tensors, 0-d, ints, bools, pytrees -------------------------------------------------------------
x = torch.full((2, 3), float(r))
assert torch.equal(af.dist.gather(x), torch.cat([torch.full((2, 3), float(i)) for i in range(n)]))
g = af.dist.gather({"a": torch.tensor(r), "b": [torch.arange(2) + 10 * r], "m": torch.tensor([r % 2 == 0])})
assert torch.equal(g["a"], torch.arange(n)), g
assert torch.equal(g["b"][0], torch.cat([torch.arange(2) + 10 * i for i in range(n)])), g
assert torch.equal(g["m"], torch.tensor([i % 2 == 0 for i in range(n)])), g
assert af.dist.gather_object({"rank": r, "s": "x" * r}) == [{"rank": i, "s": "x" * i} for i in range(n)]

# ---- all_reduce: every op, input untouched, ints, pytrees -------------------------------------------------
v = torch.tensor([r + 1.0, -float(r)])
ranks = range(n)
assert torch.equal(
    af.dist.all_reduce(v, op="sum"), torch.tensor([sum(i + 1.0 for i in ranks), -float(sum(ranks))])
)
assert torch.allclose(af.dist.all_reduce(v, op="mean"), torch.tensor([(n + 1) / 2, -(n - 1) / 2]))
assert torch.equal(af.dist.all_reduce(v, op="max"), torch.tensor([float(n), 0.0]))
assert torch.equal(af.dist.all_reduce(v, op="min"), torch.tensor([1.0, -(n - 1.0)]))
assert torch.equal(v, torch.tensor([r + 1.0, -float(r)])), "all_reduce must not modify its input"
mean_int = af.dist.all_reduce({"k": torch.tensor([r])}, op="mean")["k"]
assert mean_int.is_floating_point() and torch.allclose(mean_int, torch.tensor([(n - 1) / 2])), mean_int

# ---- broadcast ----------------------------------------------------------------------------------------------
b = af.dist.broadcast({"w": torch.full((3,), float(r)), "i": torch.tensor(r)}, src=n - 1)
assert torch.equal(b["w"], torch.full((3,), float(n - 1))) and int(b["i"]) == n - 1, b
assert af.dist.broadcast_object({"from": r}, src=1) == {"from": 1}

# ---- pad_across_processes: rank r has r + 1 items ---------------------------------------------------------
t = torch.arange(r + 1) + 1
padded = af.dist.pad_across_processes(t)
assert torch.equal(padded, torch.cat([t, torch.zeros(n - r - 1, dtype=t.dtype)])), padded
first = af.dist.pad_across_processes(t, pad_index=-1, pad_first=True)
assert torch.equal(first, torch.cat([torch.full((n - r - 1,), -1), t])), first
two_d = af.dist.pad_across_processes({"m": torch.ones(2, r + 1)}, dim=1)["m"]
assert two_d.shape == (2, n) and two_d[:, r + 1 :].eq(0).all() and two_d[:, : r + 1].eq(1).all(), two_d
gathered = af.dist.gather(padded)
assert torch.equal(gathered, torch.cat([torch.cat([torch.arange(i + 1) + 1, torch.zeros(n - i - 1, dtype=torch.int64)])
                                        for i in range(n)]))  # fmt: skip

# ---- split_between_processes: 17 items ------------------------------------------------------------------
shares = {2: [(0, 9), (9, 17)], 3: [(0, 6), (6, 12), (12, 17)]}[n]
lo, hi = shares[r]
items = list(range(17))
with af.dist.split_between_processes(items) as mine:
    assert mine == items[lo:hi], mine
with af.dist.split_between_processes(items, apply_padding=True) as mine:
    width = shares[0][1]
    assert mine == items[lo:hi] + [items[hi - 1]] * (width - (hi - lo)), mine
with af.dist.split_between_processes({"x": items, "t": torch.arange(17) * 10}, apply_padding=True) as mine:
    assert mine["x"] == items[lo:hi] + [hi - 1] * (width - (hi - lo)), mine
    assert mine["t"].tolist() == [10 * i for i in mine["x"]], mine
assert af.dist.gather_object(len(items[lo:hi])) == [b - a for a, b in shares]
print(f"rank {r}: split {items[lo:hi][0]}..{items[lo:hi][-1]} ({hi - lo} items)", flush=True)

# ---- main_process_first: the main process finishes its block before the others enter --------------------
path = af.dist.broadcast_object(tempfile.mkstemp(prefix="accelfn-mpf-")[1] if r == 0 else None)
with af.dist.main_process_first():
    with open(path, "a") as f:
        f.write(f"enter {r}\n")
    if r == 0:
        time.sleep(0.5)
    with open(path, "a") as f:
        f.write(f"leave {r}\n")
af.dist.barrier()
with open(path) as f:
    lines = f.read().split()
events = [" ".join(p) for p in zip(lines[::2], lines[1::2])]
assert events[:2] == ["enter 0", "leave 0"] and len(events) == 2 * n, events
af.dist.barrier()
if r == 0:
    os.remove(path)

# ---- print and progress on the main process only ---------------------------------------------------------
af.dist.print(f"MAIN-ONLY PRINT from rank {r}")
bar = af.progress(range(5), desc="work")
assert bar.disable == (r != 0)
bar.set_postfix(loss=1.0)  # a no-op off the main process, but it must not fail
assert sum(bar) == 10

print(f"rank {r}/{n}: all dist checks passed", flush=True)
mesh.close()
