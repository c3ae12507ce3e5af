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


# ---- one process ---------------------------------------------------------------------------------------------
def test_batches_in_order_with_the_last_one_wrapped_around() -> None:
    loader = DL(range(10), 4)
    assert lists(loader) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
    assert len(loader) == 3 and loader.padding == 2 and loader.batch_padding == 2


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


def test_gather_for_metrics_drops_padding_in_one_process() -> None:
    loader = DL(torch.arange(10), 4)
    outs = [af.data.gather_for_metrics({"p": b.float(), "i": b}, loader) for b in loader]
    assert torch.cat([o["i"] for o in outs]).tolist() == list(range(10))


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
