"""`accelfn plan` on a mixture of experts as its full-scale runs search it (benchmarks/plan.py's MoE rows): offload
left open beside fsdp and hsdp, which `af.offload` refuses.

A tiny Qwen3-MoE (examples/train_moe.py) at 8 fake ranks, a few dry runs (seconds).
"""

from __future__ import annotations

import math
from pathlib import Path

import accelfn as af
from accelfn import launch_env
from accelfn.planner.candidates import Candidate
from accelfn.planner.prune import illegal

MOE = str(Path(__file__).parent.parent / "examples" / "train_moe.py")
# offload left open (the full-scale rows leave it so); 300 KiB usable: memory binds, each group's most frugal
# candidate (offload=optimizer) runs first
ARGS = ["--steps", "2", "--experts", "4", "--remat", "none", "--accumulate", "1"]
MEMORY_GIB = 300 / 2**20


def _env(**knobs: object) -> tuple[tuple[str, str], ...]:
    return tuple((launch_env.KNOBS[k][0], str(v)) for k, v in knobs.items())


def test_fsdp_and_hsdp_with_offload_fall_at_legality_as_the_lowering_refuses_them() -> None:
    from accelfn.planner.search import Job, run_job

    for strategy in ("fsdp", "hsdp"):
        why = illegal(Candidate({"dp": 8}, strategy, offload="optimizer"))
        assert why == f"{strategy} with af.offload: offloading FSDP-sharded state is not supported yet"
    assert illegal(Candidate({"dp": 8}, "ddp", offload="optimizer")) is None
    assert illegal(Candidate({"dp": 8}, "fsdp", offload="none")) is None
    job = Job(
        MOE,
        tuple(ARGS),
        2,
        1,
        mesh="dp=2",
        env=_env(strategy="fsdp", offload="optimizer", global_batch_size=4),
    )
    result = run_job(job)
    assert result.get("lowering") and "offloading FSDP-sharded state is not supported" in result["error"]


def test_fsdp_with_ep_cp_and_tp_falls_at_legality_as_the_lowering_refuses_it() -> None:
    """Experts split over ep x cp x tp are a 3-D DTensor, which FSDP2 does not shard: the lowering names the
    axes (it was torch's NotImplementedError from inside fully_shard, and the planner spent one dry run per such
    mesh on it, 15 of DeepSeek-V3's 43 on 256 ranks, and pruned the mesh's ddp candidates with it); ddp lowers."""
    from accelfn.planner.search import Job, run_job

    mesh = {"dp": 2, "ep": 2, "cp": 2, "tp": 2}
    for strategy in ("fsdp", "hsdp"):
        why = illegal(Candidate(mesh, strategy))
        assert why == f"{strategy} with ep, cp and tp: FSDP2 shards experts split over at most 2 of them", why
    assert illegal(Candidate(mesh, "ddp")) is None
    assert illegal(Candidate({"dp": 4, "ep": 2, "tp": 2}, "fsdp")) is None
    args = ("--steps", "1", "--experts", "16", "--seq", "64", "--remat", "none", "--accumulate", "1")
    fsdp = run_job(
        Job(MOE, args, 8, 2, mesh="dp=2,ep=2,cp=2,tp=2", env=_env(strategy="fsdp", global_batch_size=4))
    )
    assert fsdp.get("lowering"), fsdp
    assert "is split over ep=2 x cp=2 x tp=2" in fsdp["error"] and "FSDP2 shards parameters" in fsdp["error"]
    ddp = run_job(
        Job(MOE, args, 8, 2, mesh="dp=2,ep=2,cp=2,tp=2", env=_env(strategy="ddp", global_batch_size=4))
    )
    assert "error" not in ddp, ddp


def test_an_hsdp_mesh_is_measured_without_offload_where_offload_is_open() -> None:
    """Each hsdp mesh's most frugal candidate is its offload=optimizer one; run first, its lowering error was
    taken as the mesh's and the mesh's candidates without offload fell unrun ('as an earlier candidate of its
    mesh'): no hsdp row at all. Now it falls at legality and every hsdp mesh is dry-run without offload."""
    kw = dict(nproc_per_node=8, global_batch_size=16, axes=("dp", "ep"), memory_gib=MEMORY_GIB, workers=1)
    p = af.plan(MOE, ARGS, strategies=("hsdp",), **kw)  # type: ignore[arg-type]
    assert "offload" in p.open_knobs
    meshes = {c.candidate.mesh_spec for c in p.fallen} | {r.candidate.mesh_spec for r in p.rows + p.unfit}
    assert meshes == {"dp=4,fsdp=2", "dp=2,fsdp=4", "dp=2,fsdp=2,ep=2"}
    measured = {r.candidate.mesh_spec for r in p.rows + p.unfit}
    assert measured == meshes, [f.reason for f in p.fallen]
    unrun = [
        f for f in p.fallen if f.tier != "does not fit"
    ]  # (the measured ones that do not fit are in both)
    assert unrun and all(f.tier == "legality" and f.candidate.offload == "optimizer" for f in unrun), unrun


DEEPSEEK = str(Path(__file__).parent / "workers" / "tiny_deepseek_moe.py")
DEEPSEEK_ARGS = ("--model", "deepseek-v3", "--layers", "10", "--steps", "2")  # 3 dense layers, then 7 MoE


def test_a_model_whose_first_blocks_are_dense_is_cut_after_them_and_extrapolates_with_ep() -> None:
    """DeepSeek-V3's first 3 layers are dense: cut to its first 2 and 3 blocks it had no experts, so every ep
    mesh fell at lowering ('ep_plan entry ... matches no parameter') and the line ran through dense blocks.
    The cut keeps the 3 dense blocks and 2 and 3 MoE ones; extrapolated to the 10 blocks, the full dry run's
    states exactly, its peak to 0.5%, its step time to 1%."""
    import attrs

    from accelfn.planner.extrapolate import extrapolate
    from accelfn.planner.search import Job, run_job

    env = _env(strategy="ddp", accumulate=1, global_batch_size=16, remat="none", offload="none")
    job = Job(DEEPSEEK, DEEPSEEK_ARGS, 8, 1, mesh="dp=4,ep=2", env=env, gpu="h100-sxm")
    cut = run_job(attrs.evolve(job, blocks=(2, 3)))
    assert "reports" in cut, cut.get("error")
    (two,), (three,) = cut["reports"][2], cut["reports"][3]
    assert (two["at"], three["at"], two["full"]) == (5, 6, 10)
    full = run_job(job)
    assert full["experts"] == 4 and cut["blocks"] == full["blocks"] == 10
    ex, ref = extrapolate(two, three, 5, 6, 10), full["report"]
    for k in ("params", "grads", "optimizer"):
        assert ex["per_rank"][k] == ref["per_rank"][k], k
    assert math.isclose(ex["per_rank"]["peak"], ref["per_rank"]["peak"], rel_tol=5e-3)
    for k in ("step_time_s", "compute_s", "tokens_per_s"):
        assert math.isclose(ex["predicted"][k], ref["predicted"][k], rel_tol=1e-2), k
