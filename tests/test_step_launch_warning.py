"""A training step without `af.shard` under `accelfn launch` on several processes trains one copy per process
that never syncs: rank 0 warns once, naming the fix. Checked over 2 real processes through the launcher, and
in one process with the launcher's environment (rank 1, one process, a dry run, a sharded step: no warning)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import accelfn as af
from tests._launch import output_of, run_workers

WARNING = (
    "accelfn started 2 processes (accelfn launch, notebook_launch), but this training step has no af.shard"
)


@pytest.mark.skipif(
    os.environ.get("ACCELFN_TEST_TORCHRUN") == "1", reason="torchrun sets no ACCELFN_LAUNCHED"
)
def test_two_launched_processes_without_shard_warn_once_and_with_shard_do_not() -> None:
    alone = run_workers("unsharded_worker.py", 2)
    assert alone.returncode == 0, output_of(alone)
    assert alone.stdout.count("trained") == 2
    assert (alone.stdout + alone.stderr).count(WARNING) == 1, output_of(alone)
    assert "af.shard(step, af.Mesh.from_env())" in alone.stderr
    sharded = run_workers("unsharded_worker.py", 2, "--shard")
    assert sharded.returncode == 0, output_of(sharded)
    assert "has no af.shard" not in sharded.stdout + sharded.stderr


@pytest.mark.parametrize(
    "env, warns",
    [
        ({"ACCELFN_LAUNCHED": "1", "WORLD_SIZE": "2", "RANK": "0"}, True),
        ({"ACCELFN_LAUNCHED": "1", "WORLD_SIZE": "2", "RANK": "1"}, False),  # rank 0 says it
        ({"ACCELFN_LAUNCHED": "1", "WORLD_SIZE": "1", "RANK": "0"}, False),  # one process
        ({"WORLD_SIZE": "2", "RANK": "0"}, False),  # not accelfn launch (torchrun: its own process group)
    ],
)
def test_the_warning_needs_accelfn_launch_several_processes_and_rank_0(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], warns: bool
) -> None:
    monkeypatch.delenv("ACCELFN_LAUNCHED", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    step = af.train_step(lambda m, b: af.losses.mse(m(b), b), af.optim.sgd(0.1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step.init(torch.nn.Linear(4, 4))
    assert any("has no af.shard" in str(w.message) for w in caught) == warns
