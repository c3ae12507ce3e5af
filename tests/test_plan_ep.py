"""`accelfn plan`'s expert parallel beyond a `transformers` model inside a node: a script's own `ep_plan=` (a user's
MoE module, tests/workers/custom_moe_plan.py), and `ep` across whole nodes.

The enumeration is checked against a brute-force listing; the plans run a tiny MoE at 4-8 fake ranks (seconds).
"""

from __future__ import annotations

import itertools

import attrs
import pytest

import accelfn as af
from accelfn import launch_env
from accelfn.planner import Space, enumerate_candidates
from accelfn.planner.candidates import ep_sizes
from tests._launch import WORKERS

CUSTOM = str(WORKERS / "custom_moe_plan.py")  # 8 experts in a user's module, planned through its own ep_plan=


def _env(**knobs: object) -> tuple[tuple[str, str], ...]:
    return tuple((launch_env.KNOBS[k][0], str(v)) for k, v in knobs.items())


def _meshes(world: int, experts: int, axes: tuple[str, ...] = ("dp", "tp", "cp", "pp", "ep")) -> set[tuple]:
    space = Space(world=world, nproc_per_node=8, open=frozenset({"mesh"}), axes=axes, experts=experts)
    return {tuple(sorted(c.mesh.items())) for c in enumerate_candidates(space)}


def _brute(world: int, experts: int) -> set[tuple]:
    """Every (pp, dp, ep, cp, tp) of `world` ranks, 8 a node, tp x cp inside a node; ep inside it, or its expert group
    (ep x tp x cp) over whole nodes dividing the experts where tp x cp fill the node or the experts outnumber it."""
    out = set()
    sizes = [d for d in range(1, world + 1) if world % d == 0]
    for pp, ep, cp, tp in itertools.product(sizes, repeat=4):
        group = ep * cp * tp
        if world % (pp * group) or 8 % (cp * tp):
            continue
        across = group % 8 == 0 and experts % group == 0 and (cp * tp == 8 or experts > 8)
        if 8 % group and not across:
            continue
        mesh = {"pp": pp, "dp": world // (pp * group), "ep": ep, "cp": cp, "tp": tp}
        out.add(tuple(sorted((k, v) for k, v in mesh.items() if v > 1 or k == "dp")))
    return out


def test_ep_spans_whole_nodes_where_tp_cp_fill_a_node_or_the_experts_outnumber_it() -> None:
    assert _meshes(32, 64) == _brute(32, 64)  # 64 experts: ep=8 (with tp=2: 16 ranks), 16 and 32 span nodes
    assert {"ep": 32, "dp": 1} in [
        dict(m) for m in _meshes(32, 64)
    ]  # DeepSeek-V3's EP64 in small: ep over 4 nodes
    assert _meshes(32, 16) == _brute(32, 16)  # tp=8 fills a node: ep=2 spans 2 (16 experts over 16 ranks)
    assert {"dp": 2, "ep": 2, "tp": 8} in [dict(m) for m in _meshes(32, 16)]
    # 4 experts, fewer than a node: ep stays inside it, as before
    assert _meshes(32, 4) == _brute(32, 4) == {m for m in _brute(32, 4) if 8 % dict(m).get("ep", 1) == 0}
    assert ep_sizes(data=4, inner=8, node=8, experts=24) == [1]  # no expert group of whole nodes divides 24
    # hsdp's fsdp axis stays inside a node beside ep: none beside an ep over nodes
    space = Space(
        world=32, nproc_per_node=8, open=frozenset({"mesh", "strategy"}), experts=64, axes=("dp", "ep")
    )
    hsdp = [c.mesh for c in enumerate_candidates(space) if c.strategy == "hsdp"]
    assert hsdp and all(8 % (m["fsdp"] * m.get("ep", 1)) == 0 for m in hsdp)


@pytest.fixture(scope="module")
def custom_plan() -> af.planner.Plan:
    """At 8 fake ranks, 100 KiB usable: only meshes with ep fit (dp=8: 290-410 KiB)."""
    kw = dict(nproc_per_node=8, global_batch_size=16, axes=("dp", "ep"), memory_gib=100 / 2**20, workers=1)
    return af.plan(CUSTOM, [], strategies=("ddp", "fsdp"), **kw)  # type: ignore[arg-type]


def test_a_scripts_own_ep_plan_gives_ep_candidates_and_the_chosen_one_dry_runs(custom_plan) -> None:
    """A user's MoE module (no transformers config) whose script passes af.shard(..., ep_plan=): the probe counts its
    experts from that plan (8, and their bytes), the plan searches ep and chooses it, and its config dry-runs to
    the row's peak."""
    from accelfn.planner.search import Job, run_job

    probe = run_job(Job(CUSTOM, (), 1, 1, env=_env(strategy="ddp", global_batch_size=16)))
    assert probe["experts"] == 8 and probe["expert_bytes"] == 2 * 8 * 16 * 64 * 4  # w_in, w_out: fp32
    plan = custom_plan
    assert plan.best is not None and plan.best.candidate.mesh.get("ep", 1) > 1
    every = [r.candidate for r in plan.rows + plan.unfit] + [f.candidate for f in plan.fallen]
    assert {c.mesh.get("ep", 1) for c in every} == {
        1,
        2,
        4,
        8,
    }  # ep=2 falls at the states bound or does not fit
    assert all(r.candidate.mesh.get("ep", 1) > 1 for r in plan.rows if r.fits)
    c = plan.best.candidate
    job = Job(CUSTOM, (), 8, 1, mesh=c.mesh_spec, env=_env(**c.knobs()))
    result = run_job(job)
    assert "error" not in result, result.get("error")
    assert result["report"]["per_rank"]["peak"] == plan.best.peak


def test_a_scripts_ep_plan_that_does_not_fit_its_model_is_named_by_the_probe() -> None:
    with pytest.raises(
        RuntimeError, match="ep_plan entry 'moe.experts.w_up' .grouped_gemm. matches no parameter"
    ):
        af.plan(CUSTOM, ["--bad-plan"], nproc_per_node=8, global_batch_size=16, axes=("dp", "ep"), workers=1)


def test_a_cross_node_ep_is_planned_and_its_all_to_all_priced_inter_node() -> None:
    """2 nodes of 2 ranks, 8 experts (more than a node): ep=4 spans both nodes and is the plan's choice; the dry run
    prices its all-to-all over the network (the same mesh on one node of 4 is faster)."""
    from accelfn.planner.search import Job, run_job

    kw = dict(nproc_per_node=2, nnodes=2, global_batch_size=16, axes=("dp", "ep"), workers=1, gpu="h100-sxm")
    plan = af.plan(CUSTOM, [], strategies=("ddp", "fsdp"), **kw)  # type: ignore[arg-type]
    assert "dp=1,ep=4 ddp" in [r.candidate.label for r in plan.rows]
    assert plan.best is not None and plan.best.candidate.mesh == {"dp": 1, "ep": 4}
    job = Job(
        CUSTOM, (), 2, 2, mesh="dp=1,ep=4", env=_env(strategy="ddp", global_batch_size=16), gpu="h100-sxm"
    )
    across, inside = run_job(job)["report"], run_job(attrs.evolve(job, nproc_per_node=4, nnodes=1))["report"]
    assert [r["intra_node"] for r in across["comm"]["all_to_all"].values()] == [False]
    assert [r["intra_node"] for r in inside["comm"]["all_to_all"].values()] == [True]
    assert across["predicted"]["comm_s"] > 1.3 * inside["predicted"]["comm_s"]


def test_a_plan_given_to_af_shard_before_the_probe_is_not_read_by_it() -> None:
    """`expert_parallel.GIVEN` is process-wide: an ep plan an earlier script (or test) gave `af.shard` must not
    count the experts of the model a later probe sees (the full suite's random order hit it in a doctest)."""
    from torch import nn

    from accelfn.planner.experts import recording_shapes
    from accelfn.transforms.shard.expert_parallel import GIVEN

    GIVEN[:] = [{"model.layers.*.mlp.experts": "ep_dispatch_experts"}]  # left by an earlier af.shard
    seen: dict = {}
    recording_shapes(None, seen)(nn.Linear(2, 2))
    zero3 = {"persistent": 1.0, "reused": 0.0}  # (its 6 elements under ZeRO-3's persistence threshold)
    assert seen == {"experts": 0, "expert_bytes": 0, "moe": {}, "decoder": {}, "zero3": zero3}
