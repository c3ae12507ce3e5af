"""Trackers across a kill and a resume, and a failing tracker next to checkpoints (real processes)."""

import json

import pytest
import torch
from torch import nn

import accelfn as af
from tests._launch import output_of, run_workers


@pytest.mark.slow
def test_a_killed_and_resumed_run_logs_every_step_once(tmp_path):
    first = run_workers("resume_logging_worker.py", 2, str(tmp_path), "20", "--die-at", "13", timeout=120)
    assert first.returncode != 0, output_of(first)  # rank 0 was SIGKILLed after step 13 (checkpoint at 10)
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps[:10] == list(range(1, 11))  # what was flushed; steps after 10 may be lost or half-written
    second = run_workers("resume_logging_worker.py", 2, str(tmp_path), "20", timeout=120)
    assert second.returncode == 0, output_of(second)
    assert "rank 0: done at step 20 (started at 10)" in second.stdout, output_of(second)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 21))  # no duplicate, none missing


class Failing:
    name = "failing"

    def log(self, metrics, step):
        if step >= 7:
            raise OSError("disk full")

    def log_config(self, config):
        pass

    def close(self):
        pass


def test_a_tracker_that_fails_raises_one_clear_error_and_loses_no_checkpoint(tmp_path):
    step = af.train_step(lambda m, b: af.losses.mse(m(b), b), af.optim.sgd(0.1))
    state = step.init(nn.Linear(3, 3))
    weights = {}
    with (
        pytest.raises(af.trackers.TrackerError, match="failing.*disk full"),
        af.trackers.open(tmp_path, [Failing(), "jsonl"], log_every=1) as run,
    ):
        for _ in range(10):
            state, metrics = step(state, torch.randn(4, 3))
            weights[int(state.step)] = state.params["weight"].detach().clone()
            run.log({"loss": metrics["loss"]}, step=int(state.step))
            af.checkpoint.save(tmp_path / f"ckpt-{int(state.step)}", state)
    saved = af.checkpoint.load(
        af.checkpoint.latest(tmp_path), like=state
    )  # the last good checkpoint is whole
    assert int(saved.step) == 6
    assert torch.equal(saved.params["weight"], weights[6])
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 8))  # the other tracker kept logging


def test_a_new_run_in_the_same_folder_keeps_the_earlier_runs_metrics_and_starts_its_own(tmp_path):
    # run twice into one folder without resume_step: the second run's steps 1-3 start a new metrics.jsonl (they
    # followed the first run's step 3, and a plot drew back to step 1); the first run's lines are kept, not lost
    def run(steps):
        tracker = af.trackers.JSONLTracker(tmp_path)
        for step in steps:
            tracker.log({"loss": float(step)}, step=step, wall_time=0.0)
        tracker.close()

    def steps(name):
        return [json.loads(line)["step"] for line in (tmp_path / name).read_text().splitlines()]

    run([1, 2, 3])
    (tmp_path / "config.json").write_text('{"lr": 1}\n')  # the first run's (trackers.open's log_config)
    with pytest.warns(UserWarning, match=r"held an earlier run's metrics.jsonl: kept as metrics.1.jsonl"):
        run([1, 2, 3])
    assert (tmp_path / "config.1.json").read_text() == '{"lr": 1}\n' and not (
        tmp_path / "config.json"
    ).exists()
    with pytest.warns(UserWarning, match="kept as metrics.2.jsonl"):
        run([1, 2])
    assert steps("metrics.jsonl") == [1, 2]
    assert steps("metrics.1.jsonl") == steps("metrics.2.jsonl") == [1, 2, 3]
    tracker = af.trackers.JSONLTracker(tmp_path, resume_step=1)  # resuming continues the file, as before
    tracker.log({"loss": 2.0}, step=2, wall_time=0.0)
    tracker.close()
    assert steps("metrics.jsonl") == [1, 2] and not (tmp_path / "metrics.3.jsonl").exists()
