"""`af.profile`: one Chrome trace per rank under RUN_DIR/profile, holding the step's ops."""

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


@pytest.mark.slow
def test_each_rank_writes_its_own_trace(tmp_path):
    proc = run_workers("profile_worker.py", 2, str(tmp_path))
    assert proc.returncode == 0, output_of(proc)
    traces = sorted((tmp_path / "profile").glob("*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in traces] == ["rank0", "rank1"], output_of(proc)
    for trace in traces:
        assert "ProfilerStep#1" in {e.get("name") for e in events(trace)}
