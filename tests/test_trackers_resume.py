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
