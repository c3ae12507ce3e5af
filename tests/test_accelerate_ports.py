"""Accelerate's by_feature scripts ported with docs/migration.md (examples/early_stopping.py, examples/local_sgd.py)
give Accelerate's numbers, run side by side in the same 2 processes; and `shard(strategy="local_sgd")`'s own
contract on one process."""

from __future__ import annotations

import copy
import runpy
import sys
from pathlib import Path

import pytest
import torch
from _launch import output_of, run_workers

import accelfn as af


@pytest.mark.slow
def test_early_stopping_accumulation_schedule_and_local_sgd_ports_equal_accelerate_on_two_processes() -> None:
    proc = run_workers("accelerate_ports_worker.py", 2, timeout=240)
    out = output_of(proc)
    assert proc.returncode == 0, out
    for r in range(2):
        assert f"rank {r}: early stopping at " in proc.stdout, out
        assert (
            f"rank {r}: gradient accumulation + linear schedule == accelerate (12 updates)" in proc.stdout
        ), out
        assert f"rank {r}: local SGD 11 updates == accelerate LocalSGD" in proc.stdout, out
        assert f"rank {r}: average over 4 buckets of 3 dtypes == the mean" in proc.stdout, out


def _loss(model, batch):
    return af.losses.mse(model(batch["x"]), batch["y"])


def _batches(k: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(8, 4, generator=g), "y": torch.randn(8, 1, generator=g)} for _ in range(k)]


def test_local_sgd_on_one_process_is_the_plain_step() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    plain = af.train_step(_loss, af.optim.adamw(1e-2))
    a = plain.init(copy.deepcopy(model), seed=0)
    with af.Mesh({"dp": -1}, device="cpu") as mesh:
        local = af.shard(plain, mesh, strategy="local_sgd", sync_every=2)
        b = local.init(copy.deepcopy(model), seed=0)
        for batch in _batches(5):
            a, ma = plain(a, batch)
            b, mb = local(b, batch)
            assert torch.equal(ma["loss"], mb["loss"]) and torch.equal(mb["rank_loss"], mb["loss"])
        b = af.average_params(b, mesh)
        assert "local SGD over 1 ranks" in str(local) and "every 2 updates" in str(local)
    for name in a.params:
        assert torch.equal(a.params[name], b.params[name]), name


def test_local_sgd_options_and_refusals_name_the_culprit() -> None:
    step = af.train_step(_loss, af.optim.sgd(0.1))
    with af.Mesh({"dp": -1}, device="cpu") as mesh:
        with pytest.raises(ValueError, match="sync_every applies to strategy='local_sgd' only, not 'ddp'"):
            af.shard(step, mesh, sync_every=4)
        with pytest.raises(ValueError, match="sync_every must be a number of updates >= 1, got 0"):
            af.shard(step, mesh, strategy="local_sgd", sync_every=0)
        with pytest.raises(ValueError, match="supports strategy 'ddp' \\(ZeRO-1\\) or 'fsdp'"):
            af.shard(step, mesh, strategy="local_sgd", backend="deepspeed")
        with pytest.raises(ValueError, match="sync_every must be a number of updates >= 1, got True"):
            af.shard(step, mesh, strategy="local_sgd", sync_every=True)
        for offload in (af.offload(step, params=True), af.offload(step, delayed_update_from=2)):
            local = af.shard(offload, mesh, strategy="local_sgd")
            with pytest.raises(af.CompositionError, match="local SGD averages the params on the device"):
                local.init(torch.nn.Linear(4, 1))
        fsdp = af.shard(step, mesh, strategy="fsdp")
        with pytest.raises(ValueError, match="sharded DTensors"):
            af.average_params(fsdp.init(torch.nn.Linear(4, 1)), mesh)
    from accelfn.transforms.shard import STRATEGIES

    assert "local_sgd" in STRATEGIES


def test_local_sgd_lowers_at_64_ranks_with_one_params_all_reduce_and_refuses_tp_and_pipelines() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1))  # 4,225 fp32 params

    def main(mesh_shape: dict[str, int], pipelined: bool = False) -> None:
        mesh = af.Mesh(mesh_shape)
        step = af.shard(af.train_step(_loss, af.optim.sgd(0.1)), mesh, strategy="local_sgd", sync_every=4)
        if pipelined:
            step = af.pipeline(step, mesh, microbatches=2)
        state = step.init(model)
        step(state, {"x": torch.zeros(8, 64), "y": torch.zeros(8, 1)})

    report = af.dry_run(lambda: main({"dp": 64}), nproc_per_node=8, nnodes=8, device="cpu", search=False)
    assert report.world_size == 64 and "local SGD over 64 ranks" in report.strategy
    # no gradient sync: the only collective of the step is the params' averaging (counted in every measured step)
    assert set(report.comm) == {"all_reduce"}, report.comm
    reduce = report.comm["all_reduce"]["dp"]
    assert reduce["count"] == 1 and reduce["bus_bytes"] == pytest.approx(2 * 63 / 64 * 4225 * 4, abs=1)
    assert any("local SGD" in note for note in report.notes)
    with pytest.raises(ValueError, match="local SGD averages whole replicas: tensor parallel"):
        af.dry_run(lambda: main({"dp": 32, "tp": 2}), nproc_per_node=8, nnodes=8, device="cpu", search=False)
    with pytest.raises(ValueError, match="not combined with af.pipeline"):
        af.dry_run(
            lambda: main({"pp": 2, "dp": 32}, True), nproc_per_node=8, nnodes=8, device="cpu", search=False
        )


@pytest.mark.parametrize(
    "script, check",
    [
        ("early_stopping.py", "every process stops at the same step"),
        ("local_sgd.py", "loss falls and the replicas end equal"),
    ],
)
def test_the_port_examples_pass_their_own_check_on_one_process(
    script: str, check: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", [script])
    runpy.run_path(str(Path(__file__).parents[1] / "examples" / script), run_name="__main__")
    assert f"CHECK {check}: OK" in capsys.readouterr().out
