"""af.dist: collectives checked on 2 and 3 real processes over gloo, and in a single un-launched process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from _launch import output_of, run_workers

import accelfn as af

LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "ACCELFN_DEBUG",
    "ACCELFN_DEVICE",
)


@pytest.fixture(autouse=True)
def _not_launched(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    assert not dist.is_initialized()
    yield
    af.mesh.destroy_process_group()


# ---- real processes ------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 3])
def test_collectives_give_exact_results_on_real_processes(nproc: int) -> None:
    proc = run_workers("dist_worker.py", nproc)
    out = output_of(proc)
    assert proc.returncode == 0, out
    for r in range(nproc):
        assert f"rank {r}/{nproc}: all dist checks passed" in proc.stdout, out
    expected = {
        2: ["0..8 (9 items)", "9..16 (8 items)"],
        3: ["0..5 (6 items)", "6..11 (6 items)", "12..16 (5 items)"],
    }
    for r, text in enumerate(expected[nproc]):
        assert f"rank {r}: split {text}" in proc.stdout, out
    assert proc.stdout.count("MAIN-ONLY PRINT") == 1 and "MAIN-ONLY PRINT from rank 0" in proc.stdout, out
    assert proc.stderr.count("work: 100%") == 1, out  # one progress bar, on the main process


@pytest.mark.slow
def test_debug_mode_turns_a_shape_mismatch_into_an_error_on_every_rank() -> None:
    proc = run_workers("debug_worker.py", 2, env={"ACCELFN_DEBUG": "1"})
    out = output_of(proc)
    assert proc.returncode == 0, out
    for r in range(2):
        assert (
            f"rank {r} caught shape mismatch: af.dist.gather on rank {r}: the ranks disagree" in proc.stdout
        ), out
        assert f"rank {r} caught call mismatch" in proc.stdout, out
        assert f"rank {r} caught step mismatch" in proc.stdout, out
        assert f"rank {r}: debug checks passed" in proc.stdout, out
    assert (
        "  rank 0: af.dist.gather(float32[3, 4])\n  rank 1: af.dist.gather(float32[2, 4])" in proc.stdout
    ), out
    assert (
        "rank 0: af.dist.all_reduce[sum](float32[2])\n  rank 1: af.dist.broadcast[src=0](float32[2])"
        in proc.stdout
    )
    assert (
        "rank 0: af.Step(training step, state.step=1)\n  rank 1: af.dist.all_reduce[sum](float32[])"
        in proc.stdout
    )


@pytest.mark.slow
def test_any_all_and_flattened_gather_object_match_accelerate_on_two_processes() -> None:
    # the worker runs Accelerate's set_trigger/check_trigger and accelerate.utils.gather_object beside ours
    proc = run_workers("trigger_worker.py", 2)
    out = output_of(proc)
    assert proc.returncode == 0, out
    for r in range(2):
        assert f"rank {r}: gather_object flatten == accelerate [0, 1]" in proc.stdout, out
        assert f"rank {r}: early stop at step 4 (accelerate: 4)" in proc.stdout, out
        assert f"rank {r}/2: all trigger checks passed" in proc.stdout, out


# ---- a single process, no process group ----------------------------------------------------------------------
def test_any_and_all_in_one_process_are_the_flag_itself() -> None:
    assert af.dist.any(True) is True and af.dist.any(0) is False and af.dist.all(1) is True
    assert af.dist.any(torch.tensor(True)) is True and af.dist.all(torch.tensor([0.0])) is False
    with pytest.raises(ValueError, match=r"af.dist.any: flag is a tensor of shape \(3,\); pass one value"):
        af.dist.any(torch.ones(3))
    with af.Mesh.from_env():  # a world of one mesh: no collective either
        assert af.dist.any(False) is False and af.dist.all(True) is True


def test_gather_object_flatten_concatenates_the_ranks_lists() -> None:
    assert af.dist.gather_object([0]) == [[0]]
    assert af.dist.gather_object([0], flatten=True) == [0]  # accelerate.utils.gather_object's shape
    assert af.dist.gather_object(("a", {"b": 1}), flatten=True) == ["a", {"b": 1}]
    assert af.dist.gather_object([], flatten=True) == []
    with pytest.raises(TypeError, match="flatten=True concatenates the ranks' lists, but rank 0 passed dict"):
        af.dist.gather_object({"n": 1}, flatten=True)


def test_unlaunched_process_is_a_world_of_one() -> None:
    assert (af.dist.rank(), af.dist.world_size(), af.dist.local_rank(), af.dist.is_main_process()) == (
        0,
        1,
        0,
        True,
    )
    x = {"a": torch.ones(2, 3), "s": torch.tensor(1.5)}
    g = af.dist.gather(x)
    assert torch.equal(g["a"], x["a"]) and torch.equal(g["s"], torch.tensor([1.5]))
    assert af.dist.gather_object("hi") == ["hi"]
    assert af.dist.broadcast_object(3) == 3
    r = af.dist.all_reduce(x, op="sum")
    assert torch.equal(r["a"], x["a"]) and r["a"] is not x["a"]
    assert torch.equal(af.dist.broadcast(torch.arange(3)), torch.arange(3))
    assert torch.equal(af.dist.pad_across_processes(torch.ones(2, 3), dim=1), torch.ones(2, 3))
    af.dist.barrier()
    with af.dist.main_process_first():
        pass


def test_collectives_work_on_a_world_of_one_mesh() -> None:
    with af.Mesh.from_env():
        assert torch.equal(af.dist.gather(torch.arange(3)), torch.arange(3))
        assert torch.equal(af.dist.all_reduce(torch.tensor([2.0]), op="max"), torch.tensor([2.0]))


def test_launched_without_a_process_group_says_to_make_the_mesh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert (af.dist.rank(), af.dist.world_size(), af.dist.is_main_process()) == (1, 2, False)
    with pytest.raises(
        RuntimeError, match="af.dist.gather: .*WORLD_SIZE=2 but no process group.*af.Mesh.from_env"
    ):
        af.dist.gather(torch.ones(1))


def test_unknown_reduce_op_lists_the_ops() -> None:
    with pytest.raises(ValueError, match="unknown op 'avg'; use one of 'sum', 'mean', 'max', 'min'"):
        af.dist.all_reduce(torch.ones(1), op="avg")


def test_non_tensor_leaf_is_named() -> None:
    with pytest.raises(TypeError, match="got str at 'b.0'.*gather_object"):
        af.dist.gather({"a": torch.ones(1), "b": ["x"]})


def test_pad_dim_out_of_range_is_an_error() -> None:
    with pytest.raises(ValueError, match="dim=2 is out of range for tensor of shape \\(3, 4\\)"):
        af.dist.pad_across_processes(torch.ones(3, 4), dim=2)


def test_broadcast_src_must_be_a_rank() -> None:
    with pytest.raises(ValueError, match="src=1 is not a rank of this world of 1 processes"):
        af.dist.broadcast(torch.ones(1), src=1)


@pytest.mark.parametrize(("rank", "expected"), [(0, list(range(0, 9))), (1, list(range(9, 17)))])
def test_split_17_items_between_2_ranks_gives_9_and_8(
    monkeypatch: pytest.MonkeyPatch, rank: int, expected: list[int]
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", str(rank))
    with af.dist.split_between_processes(list(range(17))) as mine:
        assert mine == expected
    with af.dist.split_between_processes(list(range(17)), apply_padding=True) as mine:
        assert mine == expected + [16] * (9 - len(expected))
    with af.dist.split_between_processes(
        {"t": torch.arange(17), "x": tuple(range(17))}, apply_padding=True
    ) as mine:
        assert mine["t"].tolist() == list(mine["x"]) == expected + [16] * (9 - len(expected))


def test_split_fewer_items_than_ranks_pads_with_the_last_item(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    parts, padded = [], []
    for r in range(4):
        monkeypatch.setenv("RANK", str(r))
        with af.dist.split_between_processes(["a", "b"]) as mine:
            parts.append(mine)
        with af.dist.split_between_processes(["a", "b"], apply_padding=True) as mine:
            padded.append(mine)
    assert parts == [["a"], ["b"], [], []] and padded == [["a"], ["b"], ["b"], ["b"]]


def test_split_rejects_uneven_dicts_and_unsized_inputs() -> None:
    with (
        pytest.raises(ValueError, match="same length, got \\{'a': 2, 'b': 3\\}"),
        af.dist.split_between_processes({"a": [1, 2], "b": [1, 2, 3]}),
    ):
        pass
    with (
        pytest.raises(TypeError, match="cannot split a generator"),
        af.dist.split_between_processes(i for i in range(3)),
    ):
        pass


def test_print_and_progress_only_on_the_main_process(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    af.dist.print("hello")
    assert not af.progress(range(2)).disable
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    af.dist.print("not me")
    bar = af.progress(range(3), desc="x")
    assert bar.disable and list(bar) == [0, 1, 2]
    assert capsys.readouterr().out == "hello\n"


def test_split_between_processes_refuses_padding_it_cannot_do_on_every_rank():
    # checked before splitting, so the error does not depend on the rank or on the length dividing evenly
    with pytest.raises(TypeError, match="apply_padding=True supports lists, tuples and tensors, not range"):
        af.dist.split_between_processes(range(4), apply_padding=True).__enter__()
    with pytest.raises(TypeError, match=r"cannot split a int \(dict key 'b'\)"):
        af.dist.split_between_processes({"a": [1, 2], "b": 3}).__enter__()
