"""af.data on N=2 CPU processes: exact per-rank batches, padding, shuffling, resume, dispatch, gather_for_metrics."""

import warnings

import torch

import accelfn as af

mesh = af.Mesh.from_env()
r, n = mesh.rank, mesh.world_size
assert n == 2, n
DL = af.data.DataLoader


def lists(loader):
    return [b.tolist() for b in loader]


def documented_order(n, seed, epoch):
    """docs/data.md: the permutation is drawn from `torch.Generator().manual_seed(seed + epoch)`."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


# ---- batch-level sharding: 24 items, 3 per rank --------------------------------------------------------------
expected = {
    0: [[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 20]],
    1: [[3, 4, 5], [9, 10, 11], [15, 16, 17], [21, 22, 23]],
}
loader = DL(range(24), 3)
assert lists(loader) == expected[r] and len(loader) == 4 and loader.padding == 0, lists(loader)
assert loader.global_batch_size == 6 and loader.layout.data_rank == r

# ---- 21 items: the last global batch wraps around to the start -----------------------------------------------
wrapped = {
    0: [[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 20]],
    1: [[3, 4, 5], [9, 10, 11], [15, 16, 17], [0, 1, 2]],
}
loader = DL(range(21), 3)
got, raw, pads = [], [], []
for b in loader:
    got.append(b.tolist())
    raw += af.dist.gather(b).tolist()
    pads.append(loader.batch_padding)
assert got == wrapped[r] and len(loader) == 4, got
assert sorted(set(raw)) == list(range(21)) and len(raw) == 24, raw
assert pads == [0, 0, 0, 3] and loader.padding == 3, pads
evaluated = torch.cat([af.data.gather_for_metrics(b, loader) for b in loader])
assert evaluated.tolist() == list(range(21)), evaluated
# Python objects (generated text), one per sample: every sample once, in order, the padding dropped
texts = [t for b in loader for t in af.data.gather_for_metrics([f"s{i}" for i in b.tolist()], loader)]
assert texts == [f"s{i}" for i in range(21)], texts

# ---- even_batches=False: uneven counts; drop_last: equal full batches ----------------------------------------
with warnings.catch_warnings(record=True) as caught:  # 4 batches on rank 0, 3 on rank 1: said on data rank 0
    warnings.simplefilter("always")
    loader = DL(range(21), 3, even_batches=False)
said = [str(w.message) for w in caught if "even_batches=False" in str(w.message)]
assert len(said) == (1 if r == 0 else 0), said  # the job's rank 0 only
assert r or "(4, but 3 on data rank 1)" in said[0] and "waits forever" in said[0], said
assert lists(loader) == {0: wrapped[0], 1: wrapped[1][:3]}[r] and len(loader) == {0: 4, 1: 3}[r]
with warnings.catch_warnings():
    warnings.simplefilter("error")  # as many batches on each rank (the last one shorter): nothing to say
    loader = DL(range(22), 4, even_batches=False)  # last global batch has 6: rank 0 gets 4, rank 1 gets 2
shapes = [len(b) for b in loader]
assert shapes == {0: [4, 4, 4], 1: [4, 4, 2]}[r], shapes
evaluated = torch.cat([af.data.gather_for_metrics(b * 10, loader) for b in loader])
assert evaluated.tolist() == [10 * i for i in range(22)], evaluated
texts = [t for b in loader for t in af.data.gather_for_metrics([str(i) for i in b.tolist()], loader)]
assert texts == [str(i) for i in range(22)], texts  # uneven batches (4 and 2)
loader = DL(range(8), 2)
batch = next(iter(loader))
try:  # generated ids padded to each rank's own longest: refused on both ranks by name, not inside gloo
    af.data.gather_for_metrics({"ids": torch.zeros(2, 6 + r, dtype=torch.long)}, loader)
    raise AssertionError("tensors of other shapes beyond dim 0 were gathered")
except ValueError as e:
    assert "passed different x beyond dim 0" in str(e) and "(n, 6) int64" in str(e), e
    assert "(n, 7) int64" in str(e) and "pad_across_processes(x, dim=1)" in str(e), e
try:  # one rank's own mistake (a dim 0 that is not its batch): an error on both ranks, not a hang of the other
    af.data.gather_for_metrics(torch.zeros(2 + r, 3), loader)
    raise AssertionError("a wrong dim 0 on rank 1 was gathered")
except ValueError as e:
    assert "rank 1: gather_for_metrics: x has shape (3, 3), but dim 0 must be the 2 samples" in str(e), e
try:  # objects on one rank, tensors on the other
    af.data.gather_for_metrics(["a", "b"] if r else torch.zeros(2), loader)
    raise AssertionError("objects and tensors were gathered together")
except ValueError as e:
    assert "rank 1: a list of Python objects" in str(e), e
padded = af.dist.pad_across_processes(torch.full((2, 6 + r), r), dim=1)
assert af.data.gather_for_metrics(padded, loader).shape == (4, 7)
assert lists(DL(range(21), 3, drop_last=True)) == wrapped[r][:3]

# ---- shuffle: the same on both ranks and in both runs; disjoint shards that cover everything -----------------
runs = [lists(DL(range(24), 3, shuffle=True, seed=7)) for _ in range(2)]
assert runs[0] == runs[1], runs
both = af.dist.gather_object(runs[0])
mine, theirs = [i for b in both[0] for i in b], [i for b in both[1] for i in b]
assert not set(mine) & set(theirs) and sorted(mine + theirs) == list(range(24)), both
order = documented_order(24, seed=7, epoch=0)
assert [i for k in range(4) for rank in range(2) for i in both[rank][k]] == order, (both, order)
assert order != list(range(24))

# every epoch (each new loop): global batch k of the documented permutation, rank r its r-th slice of 3; with
# 21 samples the last global batch is the permutation's last 3 samples + its first 3 (wrap-around padding)
for n_samples in (24, 21):
    loader = DL(range(n_samples), 3, shuffle=True, seed=7)
    pad = -n_samples % 6  # 21 samples: the last global batch's 3 padded samples are rank 1's whole last batch
    orders = []
    for epoch in range(3):
        got = lists(loader)
        assert loader.epoch == epoch and loader.padding == pad, (loader.epoch, epoch, loader.padding)
        order = documented_order(n_samples, seed=7, epoch=epoch)
        padded = order + order[:pad]
        want = [padded[k + 3 * r : k + 3 * r + 3] for k in range(0, len(padded), 6)]
        assert got == want, (epoch, got, order)
        both = af.dist.gather_object(got)
        real = [[i for b in both[0] for i in b], [i for b in both[1][: len(both[1]) - pad // 3] for i in b]]
        assert not set(real[0]) & set(real[1]) and sorted(real[0] + real[1]) == list(range(n_samples)), both
        orders.append(order)
    assert orders[0] != orders[1] and orders[1] != orders[2] and orders[0] != orders[2], orders

# ---- mid-epoch state_dict -> a new loader yields exactly the unseen batches ---------------------------------
full = DL(range(50), 4, shuffle=True, seed=3)
full.set_epoch(2)
reference = lists(full)
first = DL(range(50), 4, shuffle=True, seed=3)
first.set_epoch(2)
it = iter(first)
seen = [next(it).tolist() for _ in range(3)]
state = first.state_dict()
assert state["epoch"] == 2 and state["batches_done"] == 3 and state["data_size"] == 2, state
assert af.dist.gather_object(state) == [state, state], "the state must be the same on every rank"
resumed = DL(range(50), 4, shuffle=True, seed=3)
resumed.load_state_dict(state)
rest = lists(resumed)
assert seen + rest == reference and len(rest) == len(reference) - 3, (seen, rest, reference)

# ---- split_batches: the batch size is global -----------------------------------------------------------------
assert lists(DL(range(24), 6, split_batches=True)) == expected[r]
try:
    DL(range(24), 5, split_batches=True)
except ValueError as e:
    assert "batch_size=5" in str(e) and "2 data-parallel ranks" in str(e), e
else:
    raise AssertionError("split_batches with 5 over 2 ranks must raise")

# ---- gather_for_metrics: every sample once, in order -----------------------------------------------------------
for total in (99, 82, 512):
    data = {"x": torch.arange(total, dtype=torch.float32), "id": torch.arange(total)}
    loader = DL(data, 8)
    outs = [af.data.gather_for_metrics({"pred": b["x"] * 2, "id": b["id"]}, loader) for b in loader]
    ids, preds = torch.cat([o["id"] for o in outs]), torch.cat([o["pred"] for o in outs])
    assert ids.tolist() == list(range(total)) and torch.equal(preds, torch.arange(total) * 2.0), (total, ids)
    print(f"rank {r}: gather_for_metrics {total} -> {len(ids)}", flush=True)

# ---- iterable datasets: each rank keeps its slices; dispatch: rank 0 reads and sends -------------------------
assert lists(DL(Stream(21), 3)) == wrapped[r]
assert lists(DL(Stream(21), 3, dispatch=True)) == wrapped[r]
assert lists(DL(range(21), 3, dispatch=True, even_batches=False)) == {0: wrapped[0], 1: wrapped[1][:3]}[r]
loader = DL(Stream(21), 3, dispatch=True)
assert torch.cat([af.data.gather_for_metrics(b, loader) for b in loader]).tolist() == list(range(21))

# ---- worker processes give the same batches -------------------------------------------------------------------
assert lists(DL(range(21), 3, num_workers=2, shuffle=True, seed=1)) == lists(
    DL(range(21), 3, shuffle=True, seed=1)
)

# ---- a mesh with a tp axis: both ranks share one data shard ----------------------------------------------------
tp_mesh = af.Mesh({"dp": 1, "tp": 2}, device="cpu")
loader = DL(range(5), 2, mesh=tp_mesh)
assert loader.layout.data_size == 1 and lists(loader) == [[0, 1], [2, 3], [4, 0]]
assert torch.cat([af.data.gather_for_metrics(b, loader) for b in loader]).tolist() == list(range(5))
assert [t for b in loader for t in af.data.gather_for_metrics([-i for i in b.tolist()], loader)] == [
    0, -1, -2, -3, -4
]  # fmt: skip

print(f"rank {r}/{n}: all data checks passed", flush=True)
mesh.close()
