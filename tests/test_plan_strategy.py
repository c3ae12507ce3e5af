"""The planner knows the strategy a script fixes: read from what its probe lowered (`prune.lowered_strategy` of
the probe's report; the probe's ACCELFN_STRATEGY=ddp does not reach a script that fixes its own), it decides
the legality of the candidates (no af.offload with fsdp); their states bound stays the finest split's.

The planned script is tests/workers/plan_worker.py with 8 heads (tp=4 divides its 4 kv heads): its strategy
fixed by a flag, its mesh and offload (and accumulation) left to the plan, on 4 fake ranks.
"""

from __future__ import annotations

import pytest

import accelfn as af
from accelfn.planner import Space, enumerate_candidates
from accelfn.planner.prune import lowered_strategy
from tests._launch import WORKERS

SCRIPT = str(WORKERS / "plan_worker.py")


def _plans(
    args: list[str], axes: tuple[str, ...], memory_mib: float
) -> tuple[af.planner.Plan, af.planner.Plan]:
    """The pruned plan and the exhaustive one (`prune=False`) of plan_worker.py with `args`."""
    args = [*args, "--remat", "none", "--compile", "none", "--heads", "8"]
    kw = dict(nproc_per_node=4, global_batch_size=8, axes=axes, workers=1, memory_gib=memory_mib / 1024)
    return af.plan(SCRIPT, args, **kw), af.plan(SCRIPT, args, prune=False, **kw)  # type: ignore[arg-type]


def test_the_strategy_is_read_from_what_the_shard_lowered() -> None:
    step = af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1))
    try:
        mesh = af.Mesh({"dp": 1})
        for strategy in ("ddp", "fsdp", "zero1", "zero2", "zero3"):
            assert lowered_strategy(str(af.shard(step, mesh, strategy=strategy))) == strategy
        hsdp = af.shard(step, af.Mesh({"dp": 1, "fsdp": 1}), strategy="hsdp")
        assert lowered_strategy(str(hsdp)) == "hsdp"
        assert lowered_strategy(str(af.shard(step, mesh, strategy="local_sgd"))) is None  # not a knob's value
        assert lowered_strategy(str(step)) is None  # no shard
    finally:
        af.mesh.destroy_process_group()  # the planner's dry runs start their own


def test_a_script_fixing_fsdp_gets_no_offload_candidate_and_loses_no_mesh() -> None:
    """1.6 MiB usable: memory binds, so each mesh's most frugal candidate (offloaded) would run first; its
    lowering error ('offloading FSDP-sharded state is not supported') pruned the whole mesh, every mesh."""
    pruned, exhaustive = _plans(["--strategy", "fsdp", "--accumulate", "1"], ("dp", "tp"), 1.6)
    offloaded = [c for c in (f.candidate for f in pruned.fallen) if c.offload == "optimizer"]
    assert len(offloaded) == 3  # one a mesh
    for f in pruned.fallen:
        if f.candidate.offload == "optimizer":
            assert f.tier == "legality"
            assert "fsdp (the script fixes it) with af.offload: offloading FSDP-sharded state" in f.reason
        else:
            assert f.tier != "lowering", f.reason
    assert {r.candidate.mesh_spec for r in pruned.rows} == {"dp=4", "dp=2,tp=2", "dp=1,tp=4"}
    assert pruned.best is not None and exhaustive.best is not None
    assert pruned.best.candidate == exhaustive.best.candidate
    assert pruned.best.step_time_s == pytest.approx(exhaustive.best.step_time_s, rel=1e-9)


def test_a_script_fixing_ddp_is_bounded_as_fsdp_and_its_unfit_candidates_are_measured() -> None:
    """1.3 MiB usable, below the model's 1.63 MiB of params, grads and Adam state: ddp without offload cannot hold
    them. The states bound stays the finest split's (fsdp: a strategy read from a one-process probe may not be what
    the candidates lower, see the next test), so those candidates are dry-run and fall as not fitting, and the
    pruned plan chooses what the exhaustive one does."""
    pruned, exhaustive = _plans(["--strategy", "ddp"], ("dp",), 1.3)
    unfit = {"dp=4 acc=1 offload=none", "dp=4 acc=2 offload=none"}
    for p in (pruned, exhaustive):
        assert not [f for f in p.fallen if f.tier == "states bound"]
        assert unfit <= {f.candidate.label for f in p.fallen if f.tier == "does not fit"}
    assert pruned.best is not None and exhaustive.best is not None
    assert pruned.best.candidate == exhaustive.best.candidate == exhaustive.rows[0].candidate
    assert pruned.best.candidate.offload == "optimizer"


def test_a_fixed_hsdp_is_enumerated_over_every_split_of_its_data_ranks() -> None:
    space = Space(
        world=16, nproc_per_node=8, open=frozenset({"mesh"}), axes=("dp", "tp"), fixed_strategy="hsdp"
    )
    meshes = [c.mesh_spec for c in enumerate_candidates(space)]
    # fsdp inside a node (8 / tp), every split of dp (1 and dp too: hsdp as ddp and as fsdp)
    assert meshes[:5] == ["dp=16,fsdp=1", "dp=8,fsdp=2", "dp=4,fsdp=4", "dp=2,fsdp=8"] + ["dp=8,fsdp=1,tp=2"]
    assert "dp=2,fsdp=1,tp=8" in meshes  # tp fills the node: fsdp 1 only
    assert "dp=1,fsdp=16" not in meshes and "dp=1,fsdp=2,tp=8" not in meshes  # fsdp across nodes
    assert all(c.strategy is None for c in enumerate_candidates(space))  # the script's own, not the plan's


def test_a_script_fixing_hsdp_is_probed_on_two_data_axes_and_planned_over_their_splits() -> None:
    """hsdp refuses a mesh of dp alone, the probe's: the probe runs it again on dp=1,fsdp=1. Each split of the
    4 ranks is a mesh; offload falls at legality, hsdp over fsdp=1 (unsplit, 1.63 MiB) does not fit."""
    pruned, exhaustive = _plans(["--strategy", "hsdp", "--accumulate", "1"], ("dp",), 1.6)
    splits = {"dp=4,fsdp=1", "dp=2,fsdp=2", "dp=1,fsdp=4"}
    legality = [f for f in pruned.fallen if f.tier == "legality"]
    assert {f.candidate.mesh_spec for f in legality} == splits
    assert all("hsdp (the script fixes it) with af.offload" in f.reason for f in legality)
    # bounded as the finest split (the probe's strategy may not be the candidates'), measured not to fit
    assert "dp=4,fsdp=1 offload=none" in {
        f.candidate.label for f in pruned.fallen if f.tier == "does not fit"
    }
    assert {
        *(r.candidate.mesh_spec for r in exhaustive.rows),
        *(r.candidate.mesh_spec for r in exhaustive.unfit),
    } == splits
    assert pruned.best is not None and exhaustive.best is not None
    assert pruned.best.candidate == exhaustive.best.candidate


def _mesh_dependent_script(tmp_path, width: int):
    """A script whose strategy changes with the mesh: fsdp on many ranks, ddp as one process (the probe)."""
    script = tmp_path / "train.py"
    script.write_text(
        "import torch, accelfn as af\n"
        "mesh = af.Mesh.from_env()\n"
        "step = af.train_step(lambda m, b: af.losses.mse(m(b), b), af.optim.adamw(1e-3))\n"
        "step = af.shard(step, mesh, strategy='fsdp' if mesh.world_size > 1 else 'ddp')\n"
        f"state = step.init(torch.nn.Linear({width}, {width}))\n"
        f"state, _ = step(state, torch.randn(4, {width}))\n"
    )
    return script


def test_a_strategy_that_changes_with_the_mesh_is_noted(tmp_path) -> None:
    """The probe (one process) lowers ddp, the candidates fsdp: the plan says its legality was ddp's."""
    script = _mesh_dependent_script(tmp_path, 64)
    p = af.plan(script, nproc_per_node=2, axes=("dp",), workers=1)
    assert [r.candidate.mesh_spec for r in p.rows] == ["dp=2"]
    assert "the script lowered fsdp on dp=2, ddp as one process: its legality assumed ddp" in p.notes


def test_a_strategy_that_changes_with_the_mesh_loses_no_fitting_candidate_to_the_bound(tmp_path) -> None:
    """ddp as one process, fsdp on 4 ranks, with memory for a quarter of the states: bounded as the probe's ddp,
    dp=4 fell at the states bound and the plan found nothing; the exhaustive plan runs it and it fits."""
    script = _mesh_dependent_script(tmp_path, 256)
    kw = dict(nproc_per_node=4, axes=("dp",), workers=1, memory_gib=0.0009)
    pruned, exhaustive = af.plan(script, **kw), af.plan(script, prune=False, **kw)  # type: ignore[arg-type]
    assert exhaustive.best is not None and exhaustive.best.candidate.mesh_spec == "dp=4"
    assert pruned.best is not None and pruned.best.candidate == exhaustive.best.candidate
