"""`af.profile`: one Chrome trace per rank under RUN_DIR/profile, holding the step's ops; the whole block by
default and torch.profiler's options, as Accelerate's `ProfileKwargs` + `accelerator.profile()`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _launch import output_of, run_workers

import accelfn as af
from accelfn.profile import profile


def events(trace: Path) -> list[dict]:
    data = json.loads(trace.read_text())
    assert isinstance(data["traceEvents"], list)
    return data["traceEvents"]


def test_a_profiled_run_writes_a_chrome_trace_of_the_steps_ops(tmp_path):
    step = af.train_step(lambda m, b: af.losses.mse(m(b["x"]), b["y"]), af.optim.adamw(1e-3))
    state = step.init(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
    batch = {"x": torch.randn(4, 8), "y": torch.randn(4, 1)}
    with profile(tmp_path, wait=1, warmup=1, active=2, record_shapes=True) as prof:
        for _ in range(5):
            state, _ = step(state, batch)
            prof.step()
    traces = list((tmp_path / "profile").glob("*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in traces] == ["rank0"]
    names = {e.get("name") for e in events(traces[0])}
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= names  # the two active steps, not the waiting ones
    assert "ProfilerStep#0" not in names
    assert {"aten::addmm", "aten::relu"} <= names  # the forward of the step
    assert any(n and "_fused_adamw" in n for n in names)  # and its optimizer update
    assert not list((tmp_path / "profile").glob("*.pickle"))  # no memory snapshot off CUDA


def test_memory_snapshot_off_cuda_is_a_clear_error(tmp_path):
    if af.platforms.detect().kind == "cuda":
        pytest.skip("CUDA records memory snapshots")
    with (
        pytest.raises(ValueError, match="records no allocation history"),
        profile(tmp_path, memory_snapshot=True),
    ):
        pass


def test_bad_schedule_is_refused(tmp_path):
    with pytest.raises(ValueError, match="active must be >= 1"), profile(tmp_path, active=0):
        pass
    with (
        pytest.raises(ValueError, match="wait must be >= 0"),
        profile(tmp_path, schedule={"wait": -1, "warmup": 0, "active": 1}),
    ):
        pass
    with (
        pytest.raises(ValueError, match="unknown schedule key"),
        profile(tmp_path, schedule={"wait": 0, "warmup": 0, "active": 1, "waits": 2}),
    ):
        pass
    with (
        pytest.raises(ValueError, match="either schedule= or the keywords active"),
        profile(tmp_path, schedule={"wait": 0, "warmup": 0, "active": 1}, active=2),
    ):
        pass


def _matmuls(prof, n: int) -> None:
    for _ in range(n):
        torch.ones(64, 32) @ torch.ones(32, 16)
        prof.step()


def _recorded_steps(trace: Path) -> list[str]:
    return sorted(e["name"] for e in events(trace) if str(e.get("name")).startswith("ProfilerStep#"))


def test_by_default_every_step_of_the_block_is_recorded_into_one_trace_written_at_the_end(tmp_path):
    # as accelerator.profile() with ProfileKwargs(): no schedule, the whole block (af.profile used to record 3)
    with profile(tmp_path) as prof:
        for _ in range(6):
            torch.ones(8, 8) @ torch.ones(8, 8)
            prof.step()
        assert not prof.traces and not list((tmp_path / "profile").iterdir())  # written when the block ends
    assert prof.traces == list((tmp_path / "profile").glob("rank0.*.pt.trace.json")) and len(prof.traces) == 1
    recorded = _recorded_steps(prof.traces[0])
    assert {f"ProfilerStep#{i}" for i in range(6)} <= set(recorded), recorded  # every step: none skipped
    assert sum(e.get("name") == "aten::mm" for e in events(prof.traces[0])) == 6
    assert (
        prof.key_averages() is not None and prof.dir == tmp_path / "profile"
    )  # torch's methods, as Accelerate


def test_a_block_without_step_calls_is_profiled_whole(tmp_path):
    with profile(tmp_path) as prof:  # Accelerate users wrap `train()` and never call step()
        for _ in range(3):
            torch.ones(8, 8) @ torch.ones(8, 8)
    assert sum(e.get("name") == "aten::mm" for e in events(prof.traces[0])) == 3


def test_with_flops_counts_a_matmul_as_torch_does(tmp_path):
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        torch.ones(64, 32) @ torch.ones(32, 16)
    assert counter.get_total_flops() == 2 * 64 * 32 * 16
    with profile(tmp_path, with_flops=True) as prof:
        _matmuls(prof, 3)
    flops = {e.key: e.flops for e in prof.key_averages()}
    assert flops["aten::mm"] == 3 * counter.get_total_flops()
    with profile(tmp_path) as prof:  # off by default, as ProfileKwargs
        _matmuls(prof, 1)
    assert {e.key: e.flops for e in prof.key_averages()}["aten::mm"] == 0


def test_the_same_options_give_accelerates_profile(tmp_path):
    from accelerate import Accelerator
    from accelerate.utils import ProfileKwargs

    accelerator = Accelerator(cpu=True)
    theirs_dir = tmp_path / "accelerate"
    handler = ProfileKwargs(with_flops=True, record_shapes=True, output_trace_dir=str(theirs_dir))
    with accelerator.profile(handler) as theirs:
        _matmuls(theirs, 4)
    with profile(tmp_path / "accelfn", with_flops=True, record_shapes=True, activities=["cpu"]) as ours:
        _matmuls(ours, 4)

    def table(prof) -> dict[str, tuple[int, int]]:
        return {e.key: (e.count, e.flops) for e in prof.key_averages() if e.key.startswith("aten::")}

    assert table(ours) == table(theirs) and table(ours)["aten::mm"] == (4, 4 * 2 * 64 * 32 * 16)
    theirs_mm = sum(e.get("name") == "aten::mm" for e in events(theirs_dir / "profile_0.json"))
    assert sum(e.get("name") == "aten::mm" for e in events(ours.traces[0])) == theirs_mm == 4


def test_torch_profiler_options_reach_torch(tmp_path):
    options = dict(
        record_shapes=True, profile_memory=True, with_stack=True, with_flops=True, with_modules=True
    )
    with profile(tmp_path, **options) as prof:
        _matmuls(prof, 1)
    assert {k: getattr(prof.profiler, k) for k in options} == options
    mm = [e for e in events(prof.traces[0]) if e.get("name") == "aten::mm"]
    assert mm[0]["args"]["Input Dims"] == [[64, 32], [32, 16]]  # record_shapes


@pytest.mark.parametrize(
    ("kind", "schedule", "keywords", "recorded"),
    [
        # Accelerate's schedule_option dict: torch.profiler.schedule's defaults, repeat=0 cycles until the end
        ("dict", {"wait": 1, "warmup": 1, "active": 1}, {}, [["ProfilerStep#2"], ["ProfilerStep#5"]]),
        ("torch", torch.profiler.schedule(wait=0, warmup=1, active=2, repeat=1), {}, [["ProfilerStep#1", "ProfilerStep#2"]]),
        # the keywords: those left out keep af.profile's former defaults (wait 1, warmup 1, active 3, repeat 1)
        ("keywords", None, {"active": 2}, [["ProfilerStep#2", "ProfilerStep#3"]]),
        ("skip_first", None, {"skip_first": 2, "wait": 0, "active": 1}, [["ProfilerStep#3"]]),
    ],
)  # fmt: skip
def test_a_schedule_records_only_its_windows_one_trace_each(tmp_path, kind, schedule, keywords, recorded):
    with profile(tmp_path, schedule=schedule, **keywords) as prof:
        _matmuls(prof, 7)
    assert [_recorded_steps(t) for t in sorted(prof.traces)] == recorded
    assert sorted(prof.traces) == sorted((tmp_path / "profile").glob("rank0.*.pt.trace.json"))


def test_without_a_run_dir_nothing_is_written_and_on_trace_ready_sees_the_profiler(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    seen = []
    with profile(on_trace_ready=lambda p: seen.append(p)) as prof:
        _matmuls(prof, 2)
    assert seen == [prof.profiler] and prof.dir is None and prof.traces == []
    assert not list(tmp_path.iterdir())
    assert {e.key: e.count for e in prof.key_averages()}["aten::mm"] == 2
    with pytest.raises(ValueError, match="give a run_dir"), profile(memory_snapshot=True):
        pass
    order = []
    with profile(
        tmp_path, on_trace_ready=lambda p: order.append(list((tmp_path / "profile").iterdir()))
    ) as prof:
        _matmuls(prof, 1)
    assert order == [prof.traces]  # called after this rank's trace is written


def test_activities_by_name_as_accelerate_spells_them(tmp_path):
    with profile(tmp_path, activities=["cpu"]) as prof:
        _matmuls(prof, 1)
    assert prof.traces
    with pytest.raises(ValueError, match="unknown activity 'gpu'"), profile(tmp_path, activities=["gpu"]):
        pass
    if torch.profiler.ProfilerActivity.CUDA not in torch.profiler.supported_activities():
        with (
            pytest.raises(ValueError, match="cannot trace 'cuda' here"),
            profile(tmp_path, activities=["cuda"]),
        ):
            pass


@pytest.mark.slow
def test_each_rank_writes_its_own_trace(tmp_path):
    proc = run_workers("profile_worker.py", 2, str(tmp_path))
    assert proc.returncode == 0, output_of(proc)
    traces = sorted((tmp_path / "profile").glob("*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in traces] == ["rank0", "rank1"], output_of(proc)
    for trace in traces:
        assert "ProfilerStep#1" in {e.get("name") for e in events(trace)}
