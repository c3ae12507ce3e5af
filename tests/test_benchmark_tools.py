"""The search logic of the benchmark scripts (their figures come from GPU runs; see docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("limit", [8, 9, 37, 100, 511, 600])
def test_remat_batch_finds_the_largest_batch_that_fits(monkeypatch, limit):
    rb = _load("remat_batch")
    tried = []

    def fake_trial(policy, batch, args):
        tried.append(batch)
        if batch > limit:
            return {"policy": policy, "batch": batch, "fits": False, "oom": True}
        return {"policy": policy, "batch": batch, "fits": True, "tokens_s": 1.0, "peak_gib": 1.0, "seq": 8}

    monkeypatch.setattr(rb, "run_trial", fake_trial)
    args = argparse.Namespace(start=8, max_batch=512, granularity=4)
    best = rb.largest("full", args, [])
    # within the granularity below the limit, or the cap
    assert best["batch"] <= limit and (limit - best["batch"] < 4 or best["batch"] == 512), (best, tried)
    assert best["capped"] == (limit >= 512)
    assert len(tried) <= 16, tried


def test_remat_batch_stops_on_a_failure_that_is_not_out_of_memory(monkeypatch):
    rb = _load("remat_batch")
    monkeypatch.setattr(rb, "run_trial", lambda p, b, a: {"policy": p, "batch": b, "fits": False, "oom": False,
                                                          "error": "ImportError: no transformers"})  # fmt: skip
    with pytest.raises(RuntimeError, match="failed otherwise than out of memory: ImportError"):
        rb.largest("none", argparse.Namespace(start=8, max_batch=64, granularity=4), [])


def test_remat_batch_reports_none_when_the_first_batch_does_not_fit(monkeypatch):
    rb = _load("remat_batch")
    monkeypatch.setattr(
        rb, "run_trial", lambda p, b, a: {"policy": p, "batch": b, "fits": False, "oom": True}
    )
    assert rb.largest("none", argparse.Namespace(start=8, max_batch=64, granularity=4), []) is None


def test_moe_benchmark_meshes_name_their_axes_and_strategy():
    """benchmarks/moe.py's `--meshes`: an axis takes every rank, axes must multiply to the job's size, fsdp where
    the mesh has an fsdp axis (the experts' efsdp), else ddp."""
    moe = _load("moe")
    assert moe._axes("ep", 4) == {"ep": 4}
    assert moe._axes("fsdp=2,ep=2", 4) == {"fsdp": 2, "ep": 2}
    assert [moe._strategy(moe._axes(m, 4)) for m in ("ep", "fsdp", "dp=2,ep=2", "fsdp=2,ep=2")] == [
        "ddp", "fsdp", "ddp", "fsdp"]  # fmt: skip
    with pytest.raises(SystemExit, match="dp=2,ep=4 has 8 ranks, the job 4"):
        moe._axes("dp=2,ep=4", 4)
