"""af.data: batching, padding, epochs, resume, iterables, workers; sharding checked on 2 real processes."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _launch import output_of, run_workers

import accelfn as af
from accelfn.data.batching import batches_per_rank, global_batches, rank_slices

DL = af.data.DataLoader
BatchInfo = af.data.BatchInfo


@pytest.fixture(autouse=True)
def _not_launched(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert not dist.is_initialized()
    yield
    af.mesh.destroy_process_group()


def lists(loader: DL) -> list[list[int]]:
    return [b.tolist() for b in loader]


class Stream(torch.utils.data.IterableDataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n
        self.epochs: list[int] = []

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


class Recording(torch.utils.data.Dataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n
        self.read: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.read.append(i)
        return i


# ---- 2 real processes ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_ranks_get_exact_shards_padding_resume_and_gathered_metrics() -> None:
    proc = run_workers("data_worker.py", 2)
    out = output_of(proc)
    assert proc.returncode == 0, out
    for r in range(2):
        assert f"rank {r}/2: all data checks passed" in proc.stdout, out
        for total in (99, 82, 512):
            assert f"rank {r}: gather_for_metrics {total} -> {total}" in proc.stdout, out


@pytest.mark.slow
def test_a_short_last_batch_on_two_ranks_makes_the_updates_of_one_process() -> None:
    # af.shard(af.accumulate(step, 2, uneven=True)) over epochs whose last global batch is short (13 rows: 7 + 6;
    # and 1 row: 1 + 0, a rank with an empty batch), ddp and fsdp, against a plain one-process PyTorch loop
    proc = run_workers("last_batch_worker.py", 2, timeout=300)
    out = output_of(proc)
    assert proc.returncode == 0, out
    for r in range(2):
        for total in (45, 33):
            for strategy in ("ddp", "fsdp"):
                assert (
                    f"rank {r}: short {total} {strategy} equals one process over 6 updates" in proc.stdout
                ), out
            assert (
                f"rank {r}: short {total} batches, gather_for_metrics, iterable, dispatch" in proc.stdout
            ), out
        assert f"rank {r}/2: all last-batch checks passed" in proc.stdout, out


# ---- the batching arithmetic -----------------------------------------------------------------------------------
def test_global_batches_wrap_around_even_when_the_data_is_shorter_than_a_batch() -> None:
    assert list(global_batches(range(2), 5)) == [([0, 1, 0, 1, 0], 3)]
    assert list(global_batches(range(0), 5)) == []
    assert rank_slices([0, 1, 2], per_rank=2, ranks=3) == [[0, 1], [2], []]


def test_batches_per_rank_matches_the_batches_yielded() -> None:
    for n in (1, 5, 6, 7, 13):
        for kw in ({}, {"drop_last": True}, {"even_batches": False}):
            parts = [rank_slices(b, 2, 3) for b, _ in global_batches(range(n), 6, **kw)]
            for r in range(3):
                assert batches_per_rank(n, 2, 3, r, **kw) == sum(1 for p in parts if p[r]), (n, kw, r)
        short = [
            rank_slices(b, 2, 3, balanced=True) for b, _ in global_batches(range(n), 6, even_batches=False)
        ]
        for r in range(3):  # "short": every rank gets a batch of every global batch, an empty one included
            assert batches_per_rank(n, 2, 3, r, last_batch="short") == len(short), (n, r)


def test_balanced_slices_split_a_short_batch_as_evenly_as_possible() -> None:
    for ranks in (1, 2, 3, 4):
        for size in range(3 * ranks + 1):  # a global batch has at most per_rank * ranks samples
            parts = rank_slices(list(range(size)), 3, ranks, balanced=True)
            lengths = [len(p) for p in parts]
            # in order, each once
            assert [i for p in parts for i in p] == list(range(size)), (size, ranks, parts)
            if size < 3 * ranks:
                assert max(lengths) - min(lengths) <= 1 and lengths == sorted(lengths, reverse=True), parts
            else:
                assert lengths[:-1] == [3] * (ranks - 1), parts


# ---- one process ---------------------------------------------------------------------------------------------
def test_batches_in_order_with_the_last_one_wrapped_around() -> None:
    loader = DL(range(10), 4)
    assert lists(loader) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
    assert len(loader) == 3 and loader.padding == 2 and loader.batch_padding == 2


def test_each_last_batch_mode_on_the_issue_example() -> None:
    # 40 samples in batches of 32: pad repeats 24 samples in the last batch, short keeps 8, drop drops them
    want = {
        "pad": [list(range(32)), list(range(32, 40)) + list(range(24))],
        "short": [list(range(32)), list(range(32, 40))],
        "drop": [list(range(32))],
    }
    for mode, batches in want.items():
        loader = DL(range(40), 32, last_batch=mode)
        assert lists(loader) == batches and len(loader) == len(batches), mode
        assert loader.last_batch_mode == mode and loader.padding == (24 if mode == "pad" else 0)
        assert loader.last_batch == BatchInfo(
            len(batches) - 1, 24 if mode == "pad" else 0, (len(batches[-1]),)
        )
    assert DL(range(40), 32).last_batch_mode == "pad"  # the default
    # Accelerate's names are two of the modes
    assert DL(range(4), 2, drop_last=True).last_batch_mode == "drop"
    assert DL(range(4), 2, even_batches=True).last_batch_mode == "pad"
    assert DL(range(4), 2, even_batches=False).last_batch_mode == "uneven"


def test_contradicting_last_batch_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="last_batch='short ' is not one of 'pad', 'short', 'drop'"):
        DL(range(4), 2, last_batch="short ")
    with pytest.raises(ValueError, match="drop_last=True contradicts last_batch='short'"):
        DL(range(4), 2, last_batch="short", drop_last=True)
    with pytest.raises(ValueError, match="even_batches=False contradicts last_batch='short'"):
        DL(range(4), 2, last_batch="short", even_batches=False)
    with pytest.raises(ValueError, match="even_batches=True contradicts last_batch='drop'"):
        DL(range(4), 2, last_batch="drop", even_batches=True)
    assert DL(range(4), 2, last_batch="drop", drop_last=True).last_batch_mode == "drop"


def test_short_last_batch_resumes_and_is_refused_by_a_loader_of_another_mode() -> None:
    for mode in ("pad", "short", "drop"):
        full = lists(DL(range(23), 4, shuffle=True, seed=2, last_batch=mode))
        first = DL(range(23), 4, shuffle=True, seed=2, last_batch=mode)
        it = iter(first)
        seen = [next(it).tolist() for _ in range(5)]
        state = json.loads(json.dumps(first.state_dict()))
        assert state["last_batch"] == mode
        resumed = DL(range(23), 4, shuffle=True, seed=2, last_batch=mode)
        resumed.load_state_dict(state)
        assert seen + lists(resumed) == full, mode
    state = DL(range(23), 4, last_batch="short").state_dict()
    with pytest.raises(ValueError, match="last_batch='short' but this loader has last_batch='pad'"):
        DL(range(23), 4).load_state_dict(state)
    del state["last_batch"]  # a state saved before last_batch existed resumes into any mode
    DL(range(23), 4).load_state_dict(state)


def test_a_short_epoch_under_accumulate_makes_the_updates_of_a_plain_loop() -> None:
    # 45 samples, global batches of 16: updates on 16, 16 and 13 rows; accumulate(2, uneven=True) splits 13 as 7 + 6
    g = torch.Generator().manual_seed(0)
    data = {"x": torch.randn(45, 4, generator=g), "y": torch.randn(45, 2, generator=g)}

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))

    ref = model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for k in range(0, 45, 16):
        x, y = data["x"][k : k + 16], data["y"][k : k + 16]
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
    for loss_fn in (
        lambda m, b: af.losses.mse(m(b["x"]), b["y"]),  # Loss(total, count)
        lambda m, b: torch.nn.functional.mse_loss(m(b["x"]), b["y"]),  # a mean: weighted by its rows
    ):
        step = af.accumulate(af.train_step(loss_fn, af.optim.sgd(0.1)), 2, uneven=True)
        state = step.init(model())
        rows = []
        for batch in DL(data, 16, last_batch="short"):
            rows.append(len(batch["x"]))
            state, _ = step(state, batch)
        assert rows == [16, 16, 13]
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(state.params[k], v, rtol=1e-5, atol=1e-6)


def test_a_short_batch_not_divisible_by_the_micro_batches_names_uneven_and_last_batch() -> None:
    step = af.accumulate(af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.sgd(0.1)), 2)
    state = step.init(torch.nn.Linear(3, 1))
    with pytest.raises(ValueError, match=r"has 5 rows.*not divisible by 2.*uneven=True.*last_batch='short'"):
        for batch in DL(torch.randn(13, 3), 8, last_batch="short"):
            state, _ = step(state, batch)


def test_even_batches_false_leaves_the_last_batch_short_and_drop_last_drops_it() -> None:
    assert lists(DL(range(10), 4, even_batches=False)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    loader = DL(range(10), 4, drop_last=True)
    assert lists(loader) == [[0, 1, 2, 3], [4, 5, 6, 7]] and len(loader) == 2 and loader.padding == 0


def test_shuffle_is_reproducible_and_set_epoch_changes_the_order() -> None:
    a, b = DL(range(20), 5, shuffle=True, seed=1), DL(range(20), 5, shuffle=True, seed=1)
    epoch0 = lists(a)
    assert (
        epoch0 == lists(b)
        and sorted(sum(epoch0, [])) == list(range(20))
        and sum(epoch0, []) != list(range(20))
    )
    a.set_epoch(1)
    epoch1 = lists(a)
    assert epoch1 != epoch0
    assert sum(epoch1, []) == torch.randperm(20, generator=torch.Generator().manual_seed(1 + 1)).tolist()
    a.set_epoch(0)
    assert lists(a) == epoch0


def randperm(n: int, seed: int) -> list[int]:
    """The documented shuffle: `torch.randperm` drawn from `torch.Generator().manual_seed(seed + epoch)`."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def test_each_new_loop_advances_the_epoch() -> None:
    loader = DL(range(12), 4, shuffle=True, seed=0)
    epochs = []
    for _ in range(3):
        epochs.append(lists(loader))
    assert loader.epoch == 2
    assert len({json.dumps(e) for e in epochs}) == 3, f"every pair of epochs differs: {epochs}"
    for e, batches in enumerate(epochs):  # epoch e is the permutation seeded with seed + e, cut in order
        order = randperm(12, 0 + e)
        assert batches == [order[k : k + 4] for k in range(0, 12, 4)], (e, batches, order)
    reference = DL(range(12), 4, shuffle=True, seed=0)
    reference.set_epoch(2)
    assert lists(reference) == epochs[2]


def test_state_dict_round_trip_resumes_with_exactly_the_unseen_batches() -> None:
    reference = DL(range(30), 4, shuffle=True, seed=5)
    reference.set_epoch(1)
    expected = lists(reference)
    first = DL(range(30), 4, shuffle=True, seed=5)
    first.set_epoch(1)
    it = iter(first)
    seen = [next(it).tolist() for _ in range(3)]
    state = json.loads(json.dumps(first.state_dict()))
    assert state["epoch"] == 1 and state["batches_done"] == 3
    dataset = Recording(30)
    resumed = DL(dataset, 4, shuffle=True, seed=5)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)  # the usual `for epoch in ...: set_epoch(epoch)` keeps the resume position
    rest = lists(resumed)
    assert seen + rest == expected
    assert dataset.read == [i for b in rest for i in b], "only the unseen batches are read"


def test_state_after_a_finished_epoch_starts_the_next_one() -> None:
    loader = DL(range(8), 4, shuffle=True, seed=0)
    lists(loader)
    state = loader.state_dict()
    assert (state["epoch"], state["batches_done"]) == (1, 0)
    again = DL(range(8), 4, shuffle=True, seed=0)
    again.load_state_dict(state)
    loader_next = lists(loader)
    assert lists(again) == loader_next


def test_load_state_dict_refuses_a_different_seed() -> None:
    state = DL(range(8), 4, shuffle=True, seed=0).state_dict()
    with pytest.raises(ValueError, match=r"seed=0 but this loader has seed=1"):
        DL(range(8), 4, shuffle=True, seed=1).load_state_dict(state)


def test_iterable_dataset_is_batched_padded_and_told_the_epoch() -> None:
    stream = Stream(7)
    loader = DL(stream, 3)
    assert lists(loader) == [[0, 1, 2], [3, 4, 5], [6, 0, 1]] and loader.padding == 2
    assert lists(loader) and stream.epochs == [0, 1]
    assert lists(DL(Stream(7), 3, even_batches=False)) == [[0, 1, 2], [3, 4, 5], [6]]
    with pytest.raises(TypeError, match="has no len"):
        len(DL(Stream(7), 3))
    with pytest.raises(ValueError, match="shuffle=True needs a map-style dataset"):
        DL(Stream(7), 3, shuffle=True)


def test_iterable_dataset_resumes_mid_epoch() -> None:
    first = DL(Stream(11), 2)
    it = iter(first)
    seen = [next(it).tolist() for _ in range(2)]
    resumed = DL(Stream(11), 2)
    resumed.load_state_dict(first.state_dict())
    assert seen + lists(resumed) == lists(DL(Stream(11), 2))


def test_two_workers_give_the_same_batches_as_none() -> None:
    kw: dict[str, Any] = {"shuffle": True, "seed": 3}
    assert lists(DL(range(23), 4, num_workers=2, **kw)) == lists(DL(range(23), 4, **kw))
    assert lists(DL(Stream(9), 2, num_workers=2)) == lists(DL(Stream(9), 2))
    first = DL(range(23), 4, num_workers=2, **kw)
    it = iter(first)
    seen = [next(it).tolist() for _ in range(3)]
    resumed = DL(range(23), 4, num_workers=2, **kw)
    resumed.load_state_dict(first.state_dict())
    assert seen + lists(resumed) == lists(DL(range(23), 4, **kw))


def test_dict_samples_and_dict_of_tensor_columns_collate_to_dicts_of_batches() -> None:
    rows = [{"x": torch.full((2,), float(i)), "y": torch.tensor(i)} for i in range(5)]
    columns = {"x": torch.arange(10.0).reshape(5, 2), "y": torch.arange(5)}
    for data in (rows, columns):
        batches = list(DL(data, 2, even_batches=False))
        assert [b["y"].tolist() for b in batches] == [[0, 1], [2, 3], [4]]
        assert batches[0]["x"].shape == (2, 2)
    with pytest.raises(ValueError, match="columns of one length"):
        DL({"x": torch.ones(3), "y": torch.ones(4)}, 2)


def test_collate_fn_and_pin_memory_on_a_cpu_only_machine() -> None:
    loader = DL(range(6), 3, collate_fn=lambda items: [i * 10 for i in items], pin_memory=True)
    assert list(loader) == [[0, 10, 20], [30, 40, 50]]


def test_pin_memory_on_a_cpu_mesh_is_a_silent_no_op(recwarn: pytest.WarningsRecorder) -> None:
    made: list[torch.Tensor] = []

    def collate(items: list[int]) -> torch.Tensor:
        made.append(torch.tensor(items))
        return made[-1]

    loader = DL(range(6), 3, collate_fn=collate, pin_memory=True)
    assert loader.layout.device == torch.device("cpu")
    got = list(loader)
    # documented: pinning is skipped on CPU meshes: the collated tensors come out as they are (not copied,
    # not pinned), with no warning
    assert [b.tolist() for b in got] == [[0, 1, 2], [3, 4, 5]]
    assert all(b is m for b, m in zip(got, made, strict=True)) and not any(b.is_pinned() for b in got)
    assert not [w for w in recwarn if "pin" in str(w.message).lower()], [str(w.message) for w in recwarn]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback where pinned memory is impossible")
def test_pin_memory_that_fails_is_skipped_and_the_batch_still_reaches_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(RuntimeError):  # the premise: this torch cannot pin host memory
        torch.ones(1).pin_memory()
    meta = af.data.DataLayout(1, 0, torch.device("meta"), (0,))  # a non-CPU device, so pinning is tried
    monkeypatch.setattr(af.data.DataLayout, "resolve", staticmethod(lambda mesh: meta))
    loader = DL({"x": torch.arange(8.0).reshape(4, 2)}, 2, pin_memory=True)
    batches = list(loader)
    assert len(batches) == 2 and all(b["x"].is_meta and b["x"].shape == (2, 2) for b in batches)


def test_last_batch_is_the_batch_info_of_the_batch_just_yielded() -> None:
    loader = DL(range(10), 4)
    assert loader.last_batch is None  # nothing yielded yet
    infos = []
    for _ in loader:
        infos.append(loader.last_batch)
    # 10 samples in global batches of 4: steps 0, 1, 2; the last one has 2 real samples + 2 wrapped around
    assert infos == [BatchInfo(0, 0, (4,)), BatchInfo(1, 0, (4,)), BatchInfo(2, 2, (4,))], infos
    assert all(type(i) is BatchInfo for i in infos)
    assert (infos[2].step, infos[2].padding, infos[2].sizes) == (2, 2, (4,))
    it = iter(loader)  # a new epoch forgets the previous one's batch
    assert loader.last_batch is None
    next(it)
    assert loader.last_batch == BatchInfo(0, 0, (4,))

    short = DL(range(10), 4, even_batches=False)
    assert [tuple(short.last_batch) for _ in short] == [(0, 0, (4,)), (1, 0, (4,)), (2, 0, (2,))]
    workers = DL(range(10), 4, num_workers=2)  # the info comes back from the worker processes too
    assert [workers.last_batch for _ in workers] == infos


def test_last_batch_after_a_resume_counts_steps_from_the_start_of_the_epoch() -> None:
    first = DL(range(10), 4)
    next(iter(first))
    resumed = DL(range(10), 4)
    resumed.load_state_dict(first.state_dict())
    assert resumed.last_batch is None
    assert [resumed.last_batch for _ in resumed] == [BatchInfo(1, 0, (4,)), BatchInfo(2, 2, (4,))]


@contextlib.contextmanager
def pretend_rank(rank: int, world: int, shape: dict[str, int]) -> Iterator[af.Mesh]:
    """An `af.Mesh` as global rank `rank` of `world` sees it, in this one process (torch's fake process group:
    no peers, so only what needs no collective is checked)."""
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=world)
    try:
        yield af.Mesh(shape, device="cpu")
    finally:
        af.mesh.destroy_process_group()


def shard_of(shape: dict[str, int], g: int) -> int:
    """Independent reference: global rank `g`'s coordinates in a row-major mesh (outermost axis first), and
    the shard they make from the data axes only (in mesh order)."""
    coords, rest = {}, g
    for name in reversed(list(shape)):
        coords[name], rest = rest % shape[name], rest // shape[name]
    shard = 0
    for name in shape:
        if name in ("dp", "fsdp", "dp_replicate", "dp_shard"):
            shard = shard * shape[name] + coords[name]
    return shard


@pytest.mark.parametrize(
    "shape",
    [{"dp": 2, "tp": 2, "fsdp": 2}, {"tp": 2, "dp": 4}, {"dp": 4, "tp": 2}, {"pp": 2, "tp": 2}],
    ids=["dp-tp-fsdp", "tp-dp", "dp-tp", "no-data-axis"],
)
def test_data_layout_maps_every_global_rank_to_its_shard(shape: dict[str, int]) -> None:
    world = math.prod(shape.values())
    expected = tuple(shard_of(shape, g) for g in range(world))
    size = max(expected) + 1
    for g in range(world):
        with pretend_rank(g, world, shape) as mesh:
            lay = af.data.DataLayout.resolve(mesh)
            assert lay.data_rank_of == expected, (shape, g, lay)
            assert (lay.data_size, lay.data_rank, lay.world_size) == (size, expected[g], world)
            assert lay.first_rank_of_each_shard() == [expected.index(d) for d in range(size)]
            assert DL(range(4), 1, mesh=mesh).layout == lay


def test_each_rank_reads_the_global_rows_of_its_shard_and_last_batch_says_how_many_are_real() -> None:
    shape, world, n, per_rank = {"dp": 2, "tp": 2, "fsdp": 2}, 8, 37, 2  # 4 shards, global batch of 8
    padded = list(range(n)) + list(range(-n % 8))  # the last global batch wraps around to the start
    for g in range(world):
        d = shard_of(shape, g)
        with pretend_rank(g, world, shape) as mesh:
            loader = DL(range(n), per_rank, mesh=mesh)
            got = lists(loader)
            assert got == [padded[k + 2 * d : k + 2 * d + 2] for k in range(0, len(padded), 8)], (g, d, got)
            assert loader.last_batch == BatchInfo(4, 3, (2, 2, 2, 2)), loader.last_batch
            real = n - 4 * 8  # 5 real samples in the last global batch: shards 0, 1 get 2, shard 2 gets 1
            assert sum(i >= 32 for i in got[-1]) == min(max(real - 2 * d, 0), 2) == [2, 2, 1, 0][d]

            short = DL(range(n), per_rank, mesh=mesh, even_batches=False)
            got = lists(short)
            assert got[:4] == [list(range(k + 2 * d, k + 2 * d + 2)) for k in range(0, 32, 8)], (g, got)
            if d == 3:  # no share of the 5-sample last batch: 4 batches, the last info is batch 3's
                assert len(got) == 4 and short.last_batch == BatchInfo(3, 0, (2, 2, 2, 2))
            else:
                assert got[4] == list(range(32 + 2 * d, min(34 + 2 * d, n)))
                assert short.last_batch == BatchInfo(4, 0, (2, 2, 1, 0)), short.last_batch


def test_short_last_batch_is_split_evenly_over_the_shards_and_a_rank_without_rows_gets_an_empty_batch() -> (
    None
):
    shape, world, per_rank = {"dp": 2, "tp": 2, "fsdp": 2}, 8, 2  # 4 shards, global batch of 8
    for n, sizes in ((37, (2, 1, 1, 1)), (34, (1, 1, 0, 0))):
        columns = {"x": torch.arange(n * 3.0).reshape(n, 3), "id": torch.arange(n)}
        starts = [sum(sizes[:d]) for d in range(4)]
        for g in range(world):
            d = shard_of(shape, g)
            with pretend_rank(g, world, shape) as mesh:
                loader = DL(columns, per_rank, mesh=mesh, last_batch="short")
                got = list(loader)
                assert len(got) == len(loader) == 5 and loader.padding == 0
                assert [b["id"].tolist() for b in got[:4]] == [
                    list(range(k + 2 * d, k + 2 * d + 2)) for k in range(0, 32, 8)
                ]
                last = got[-1]
                assert last["id"].tolist() == list(range(32 + starts[d], 32 + starts[d] + sizes[d])), (
                    n,
                    g,
                    last,
                )
                assert last["x"].shape == (sizes[d], 3) and last["x"].dtype == torch.float32
                assert loader.last_batch == BatchInfo(4, 0, sizes), loader.last_batch


def test_an_empty_batch_keeps_the_structure_of_the_collated_batch() -> None:
    from accelfn.data.batches import no_rows

    collated = {
        "ids": torch.ones(1, 4, dtype=torch.long),
        "text": ["a"],
        "pair": (torch.zeros(1), torch.ones(1, 2)),
    }
    empty = no_rows(collated)
    assert empty["ids"].shape == (0, 4) and empty["ids"].dtype == torch.long and empty["text"] == []
    assert isinstance(empty["pair"], tuple) and [t.shape for t in empty["pair"]] == [(0,), (0, 2)]


def test_split_batches_in_one_process_keeps_the_whole_batch() -> None:
    loader = DL(range(6), 3, split_batches=True)
    assert loader.batch_size == 3 and lists(loader) == [[0, 1, 2], [3, 4, 5]]


def test_wrong_arguments_name_the_parameter() -> None:
    with pytest.raises(TypeError, match="'batch_size'"):
        DL(range(4), "2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_size=0"):
        DL(range(4), 0)
    with pytest.raises(TypeError, match="map-style"):
        DL(object(), 2)


def test_gather_for_metrics_takes_objects_one_per_sample_and_a_list_of_tensors_as_tensors() -> None:
    loader = DL(torch.arange(5), 4)  # the last batch padded: [4, 0, 1, 2]
    texts = [
        t for b in loader for t in af.data.gather_for_metrics(tuple(f"s{i}" for i in b.tolist()), loader)
    ]
    assert texts == ["s0", "s1", "s2", "s3", "s4"]
    pieces = [
        af.data.gather_for_metrics([b, b * 2], loader) for b in loader
    ]  # a pytree of tensors, as before
    assert torch.cat([a for a, _ in pieces]).tolist() == list(range(5))
    assert all(torch.equal(c, 2 * a) for a, c in pieces)
    nested = [af.data.gather_for_metrics([{"p": b}], loader)[0]["p"] for b in loader]
    assert torch.cat(nested).tolist() == list(range(5))
    for _ in loader:
        with pytest.raises(ValueError, match=r"ranks \[0\] passed \[1\] for batches of \[4\]"):
            af.data.gather_for_metrics(["only one"], loader)
        break


def test_a_torch_dataloader_is_refused_with_how_to_pass_its_dataset() -> None:
    # Accelerate's `prepare(loader)` habit: its items are batches, which would gain a second batch dimension
    # (and wrap around to fill the last batch) instead of being batched once
    torch_loader = torch.utils.data.DataLoader(torch.arange(8.0).reshape(8, 1), batch_size=4)
    with pytest.raises(TypeError, match=r"got a torch.utils.data.DataLoader.*loader.dataset, batch_size="):
        DL(torch_loader, 4)
    assert [b.shape for b in DL(torch_loader.dataset, 4)] == [(4, 1), (4, 1)]  # what the error says to pass


def test_gather_for_metrics_drops_padding_in_one_process() -> None:
    loader = DL(torch.arange(10), 4)
    outs = [af.data.gather_for_metrics({"p": b.float(), "i": b}, loader) for b in loader]
    assert torch.cat([o["i"] for o in outs]).tolist() == list(range(10))


def test_gather_for_metrics_with_each_last_batch_mode_gives_each_sample_once() -> None:
    for mode, want in (("pad", 10), ("short", 10), ("drop", 8)):
        loader = DL(torch.arange(10), 4, last_batch=mode)
        assert torch.cat([af.data.gather_for_metrics(b, loader) for b in loader]).tolist() == list(
            range(want)
        )


def test_gather_for_metrics_errors_name_the_problem() -> None:
    loader = DL(torch.arange(10), 4)
    with pytest.raises(RuntimeError, match="has not yielded a batch yet"):
        af.data.gather_for_metrics(torch.zeros(4), loader)
    next(iter(loader))
    with pytest.raises(ValueError, match=r"x\['loss'\] has shape \(\)"):
        af.data.gather_for_metrics({"loss": torch.tensor(1.0)}, loader)


def test_a_world_of_one_mesh_is_one_shard_on_its_device() -> None:
    with af.Mesh.from_env(device="cpu") as mesh:
        loader = DL(range(4), 2)
        assert loader.layout.data_size == 1 and loader.layout.device == mesh.device
        assert lists(loader) == [[0, 1], [2, 3]]


def test_a_loader_made_before_the_mesh_of_a_launched_job_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # In a launched job the mesh (or a process group) tells the loader its shard; built before it, the loader
    # used to read the whole dataset on every rank (2 ranks: each sample twice, metrics counted twice).
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(
        RuntimeError, match="rank 1 of a launched job of 2 processes, but no af.Mesh exists yet"
    ):
        DL(torch.arange(16), batch_size=4)
