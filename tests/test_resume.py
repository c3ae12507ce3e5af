"""Exact resume: N steps straight == k steps, save, fresh processes, load, N-k steps (bitwise, fp32, CPU)."""

import json

import pytest

from tests._launch import output_of, run_workers


def _run(strategy, mode, ckpt, nproc=2):
    proc = run_workers("resume_worker.py", nproc, strategy, mode, str(ckpt), timeout=300)
    assert proc.returncode == 0, output_of(proc)
    line = [l for l in proc.stdout.splitlines() if l.startswith("{")]  # noqa: E741
    assert line, output_of(proc)
    return json.loads(line[-1])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_resume_on_two_ranks_with_shard_and_loader_is_bitwise_exact(strategy, tmp_path):
    full = _run(strategy, "full", tmp_path / "unused")
    first = _run(strategy, "first", tmp_path / "ckpt")
    rest = _run(strategy, "rest", tmp_path / "ckpt")
    assert first["losses"] + rest["losses"] == full["losses"]
    assert rest["params"] == full["params"] and rest["step"] == full["step"] == 6


@pytest.mark.slow
def test_resume_in_one_process_with_loader_is_bitwise_exact(tmp_path):
    full = _run("ddp", "full", tmp_path / "unused", nproc=1)
    first = _run("ddp", "first", tmp_path / "ckpt", nproc=1)
    rest = _run("ddp", "rest", tmp_path / "ckpt", nproc=1)
    assert first["losses"] + rest["losses"] == full["losses"]
    assert rest["params"] == full["params"]
