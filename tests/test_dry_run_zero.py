"""DeepSpeed ZeRO in the dry run (`accelfn/transforms/shard/deepspeed/dry/` models the engine, which does
not run on fake tensors): checked against the real engine on 2 CPU processes over gloo
(`tests/workers/zero_bytes_worker.py`: the per-rank bytes read from the engine, every collective of 3 steps
seen by the dry run's tracker on the real tensors) and against Rajbhandari et al. 2020 (ZeRO) at 64 ranks."""

from __future__ import annotations

import json
import re
import sys
import time
from typing import Any

import pytest
import torch

import accelfn as af
from accelfn import mesh as _mesh
from accelfn.dryrun.tracker import StepTracker, bus_bytes
from tests._launch import ROOT, output_of, run_workers

sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "tests" / "workers"))
from zero_model import batch_shape, zero_step  # noqa: E402  (the worker's step)


@pytest.fixture(autouse=True)
def _no_process_group() -> None:
    _mesh.destroy_process_group()  # a dry run starts its own (fake) one


def _numels() -> list[int]:
    """The tiny Llama's params' sizes, in DeepSpeed's flat order (the module's)."""
    from train_llama import build

    return [p.numel() for p in build("tiny", 128).parameters()]


def _zero_script(stage: int, options: dict[str, Any], optimizer: Any = None) -> Any:
    """The worker's step (zero_model.py) in a loop."""

    def main() -> None:
        mesh = af.Mesh({"dp": -1})
        step, state = zero_step(mesh, stage, options, optimizer)
        for _ in range(4):
            state, _ = step(state, torch.zeros(*batch_shape(options), dtype=torch.long))

    return main


def _dry(
    stage: int,
    options: dict[str, Any] | None = None,
    *,
    steps: int = 1,
    rank: int = 0,
    nproc: int = 2,
    nnodes: int = 1,
    optimizer: Any = None,
) -> Any:
    """The dry run of the worker's step: its report (communication: the `steps`-th call's)."""
    return af.dry_run(
        _zero_script(stage, options or {}, optimizer),
        nproc_per_node=nproc,
        nnodes=nnodes,
        device="cpu",
        search=False,
        steps=steps,
        rank=rank,
    )


def _comm(report: Any) -> dict[str, tuple[int, int, int]]:
    """{kind: (count, bytes, bus bytes)} of a report, summed over the mesh axes."""
    return {
        kind: tuple(sum(row[key] for row in by_axis.values()) for key in ("count", "bytes", "bus_bytes"))  # type: ignore[misc]
        for kind, by_axis in report.comm.items()
    }


def _dry_calls(
    monkeypatch: pytest.MonkeyPatch, *args: Any, **kwargs: Any
) -> tuple[Any, list[tuple[str, int]]]:
    """`_dry(*args, **kwargs)`'s report and its reported call's collectives in order, `(kind, bytes)` each."""
    calls: list[list[tuple[str, int]]] = []
    by_group = StepTracker.collectives_by_group

    def recording(self: StepTracker) -> Any:  # once per measured call, at its end
        calls.append([(c.kind, c.nbytes) for c in self.collectives])
        return by_group(self)

    monkeypatch.setattr(StepTracker, "collectives_by_group", recording)
    return _dry(*args, **kwargs), calls[-1]


def _real_comm(calls: list[list[Any]]) -> dict[str, tuple[int, int, int]]:
    """The same of the worker's collectives, `[kind, group size, bytes]` each."""
    out: dict[str, tuple[int, int, int]] = {}
    for kind, size, nbytes in calls:
        count, total, bus = out.get(kind, (0, 0, 0))
        out[kind] = (count + 1, total + nbytes, bus + bus_bytes(kind, nbytes, size))
    return out


# ---- against the real engine, on 2 processes -------------------------------------------------------------------
OPTIONS: dict[str, dict[str, Any]] = {
    # the tiny Llama's blocks compiled (af.compile(regions="blocks"): ZeRO-3's hooks break each block's graph at
    # every module), small buckets reduced to each owner: ZeRO-2's buckets follow the order in which the compiled
    # backward's gradients come ready (7 reduces a step run eagerly, 9 compiled). aot_eager: the AOTAutograd
    # function Inductor's is, whose inputs set that order, without Inductor's codegen (27 s of the suite)
    "llama, compiled blocks, small buckets": {
        "compile": "blocks",
        "compile_backend": "aot_eager",
        "ds_config": {
            "zero_optimization": {"reduce_bucket_size": 100_000, "use_multi_rank_bucket_allreduce": False}
        },
    },
    # several buckets, params larger than one, reduce to each owner; ZeRO-3's prefetch, reuse distance and
    # persistence cut short; two micro-batches of an af.Loss (the update divides by the count: no count forwards)
    "llama, small buckets, 2 micro-batches": {
        "accumulate": 2,
        "ds_config": {
            "zero_optimization": {
                "reduce_bucket_size": 100_000,
                "use_multi_rank_bucket_allreduce": False,
                "stage3_prefetch_bucket_size": 60_000,
                "stage3_max_reuse_distance": 50_000,
                "stage3_param_persistence_threshold": 10_000,
            }
        },
    },
    # tied, frozen and external params, modules with several params, two param groups (zero_model.ZeroNet)
    "net": {"model": "net"},
}


@pytest.fixture(scope="module", params=list(OPTIONS))
def real_engine(request: pytest.FixtureRequest) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The worker's records (ZeRO-1, 2 and 3, both ranks) under one of OPTIONS."""
    options = OPTIONS[request.param]
    proc = run_workers("zero_bytes_worker.py", 2, "1,2,3", "3", json.dumps(options), timeout=400)
    assert proc.returncode == 0, output_of(proc)
    decoder = json.JSONDecoder()  # the ranks' lines may interleave
    records = [decoder.raw_decode(proc.stdout, m.end())[0] for m in re.finditer("ZERO_BYTES ", proc.stdout)]
    assert sorted((r["stage"], r["rank"]) for r in records) == [(s, r) for s in (1, 2, 3) for r in (0, 1)]
    return options, records


@pytest.mark.slow
def test_zero_1_2_3_bytes_and_collectives_equal_the_real_engines_on_two_processes(
    real_engine: tuple[dict[str, Any], list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # per rank: params, gradients and optimizer state to the byte, and each of the first 3 steps' collectives
    # (kind, count, bytes, bus bytes), and one by one in order (ZeRO-2's buckets take the gradients in the order
    # they come ready): ZeRO-3's first step records the trace, the second checks it across the ranks, the third
    # prefetches along it
    options, records = real_engine
    for real in records:
        stage, rank = real["stage"], real["rank"]
        for k, calls in enumerate(real["comm"]):
            report, dry_calls = _dry_calls(monkeypatch, stage, options, steps=k + 1, rank=rank)
            where = f"ZeRO-{stage}, rank {rank}, step {k}"
            assert _comm(report) == _real_comm(calls), where
            # every collective in order (ZeRO-2 with compiled blocks too: the dry run's compiled blocks take
            # their inputs in Dynamo's order, so their gradients come ready as torch.compile's do)
            assert dry_calls == [(kind, nbytes) for kind, _, nbytes in calls], where
            # params: those a step starts with (the dry run reports the step with the largest peak; ZeRO-3's
            # later steps start with the persistent params gathered)
            assert report.per_rank["params"] in real["params_per_step"][: k + 1], where
            if k == 0:
                assert report.per_rank["params"] == real["params"], where
            # ZeRO-1: the full gradients the backward leaves; ZeRO-2/3: the gradient partitions
            assert report.per_rank["grads"] == real.get("grads_full", real["grads"]), where
            assert report.per_rank["optimizer"] == real["optimizer"], where
            assert any(f"ZeRO-{stage} is modelled" in note for note in report.notes)


def test_a_compiled_blocks_gradients_come_ready_in_torch_compiles_order_in_the_dry_run() -> None:
    # The autograd engine runs the gradient accumulations that a compiled block's backward makes ready at once
    # in an order set by the order of the compiled function's inputs (its ready queue ties them): ZeRO-2's
    # gradient hooks fire in that order and fill its buckets so (the tiny Llama with 100,000-element buckets:
    # the same 9 reduces a step, holding different params). The reference: torch.compile (aot_eager: the same
    # AOTAutograd function as Inductor's) of the same block
    import copy

    from train_llama import build

    from accelfn.dryrun.compiled import partition_block

    model = build("tiny", 128)
    layer = model.model.layers[0]
    x = torch.randn(2, 8, 128)
    position = model.model.rotary_emb(x, torch.arange(8)[None])

    def ready_order(block: torch.nn.Module, run: Any) -> list[str]:
        names = {id(p): n for n, p in block.named_parameters()}
        ready: list[str] = []
        for p in block.parameters():
            p.register_post_accumulate_grad_hook(lambda p: ready.append(names[id(p)]))
        out = run(x.clone().requires_grad_(), position_embeddings=position)
        (out[0] if isinstance(out, tuple) else out).sum().backward()
        return ready

    compiled = copy.deepcopy(layer)
    reference = ready_order(compiled, torch.compile(compiled, backend="aot_eager"))
    dry = copy.deepcopy(layer)
    assert partition_block(dry)
    assert ready_order(dry, dry) == reference


# ---- the ZeRO paper at 64 ranks ---------------------------------------------------------------------------------
def _whole_params(numels: list[int], part: int, rank: int) -> int:
    """The elements of the params that overlap `rank`'s partition: what DeepSpeed's ZeRO-1/2 keeps of the
    gradients (`grads_in_partition` holds whole params)."""
    lo, hi, at, total = rank * part, (rank + 1) * part, 0, 0
    for n in numels:
        if lo <= at < hi or at < lo < at + n:
            total += n
        at += n
    return total


def test_zero_1_and_2_follow_the_zero_paper_at_64_ranks() -> None:
    # Rajbhandari et al. 2020, mixed precision with Adam: 2 bytes of params, 2 of gradients (ZeRO-2: / N) and
    # K = 12 of optimizer state (fp32 master, two moments) / N per parameter
    numels = _numels()
    n = sum(numels)
    assert n % 128 == 0  # DeepSpeed pads the flat buffer to a multiple of 2 x 64: no padding here
    part = n // 64
    small = (
        8 + 1 + 4 + 8
    )  # all-reduced besides the gradients: the count, the overflow flag, the norm, the loss
    for stage in (1, 2):
        report = _dry(stage, nproc=8, nnodes=8)
        assert report.per_rank["params"] == 2 * n
        assert report.per_rank["optimizer"] == 12 * part
        # ZeRO-1 keeps every gradient until the backward ends; ZeRO-2 the params overlapping its partition:
        # rank 0's is inside the embedding, whose whole gradient it keeps (13 partitions' worth)
        assert report.per_rank["grads"] == (2 * n if stage == 1 else 2 * _whole_params(numels, part, 0))
        assert report.per_rank["grads"] > 2 * part
        # DeepSpeed 0.19 all-reduces the gradient buckets (`use_multi_rank_bucket_allreduce`), then
        # all-gathers the updated partitions: 3 x the bf16 params moved per rank, where the paper's
        # reduce-scatter and all-gather move 2 x
        ar, ag = report.comm["all_reduce"]["dp"], report.comm["all_gather"]["dp"]
        assert (ar["bytes"], ag["bytes"]) == (2 * n + small, 2 * n)
        assert ar["bus_bytes"] + ag["bus_bytes"] == pytest.approx(3 * 2 * n * 63 / 64, abs=small * 2)
        assert any(f"ZeRO-{stage} is modelled" in note for note in report.notes)
    middle = _dry(2, rank=32, nproc=8, nnodes=8)
    assert middle.per_rank["grads"] == 2 * _whole_params(numels, part, 32) < 2 * n // 8
    # without it, each partition's gradients are reduced to its owner (`dist.reduce`, one per owner): the
    # paper's 2 x (nccl-tests count a reduce's bus bytes as its bytes)
    owners = _dry(
        2, {"ds_config": {"zero_optimization": {"use_multi_rank_bucket_allreduce": False}}}, nproc=8, nnodes=8
    )
    red, ag = owners.comm["reduce"]["dp"], owners.comm["all_gather"]["dp"]
    assert (red["count"], red["bytes"], red["bus_bytes"]) == (64, 2 * n, 2 * n)
    assert red["bus_bytes"] + ag["bus_bytes"] == pytest.approx(2 * 2 * n, rel=1 / 64)


def test_zero_3_follows_the_zero_paper_at_64_ranks_in_seconds() -> None:
    # ZeRO-3: 2 / N bytes of params, 2 / N of gradients, 12 / N of optimizer state per parameter; each step
    # all-gathers the params before their forward and again before their backward and reduce-scatters the
    # gradients: 3 x the bf16 params moved per rank
    numels = _numels()
    n = sum(numels)
    assert all(k % 64 == 0 for k in numels)  # DeepSpeed's per-param partitions, ceil(numel / 64): no padding
    start = time.perf_counter()
    no_persistence = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    first = _dry(3, {"ds_config": no_persistence}, nproc=8, nnodes=8)
    assert (first.per_rank["params"], first.per_rank["grads"]) == (2 * n // 64, 2 * n // 64)
    assert first.per_rank["optimizer"] == 12 * n // 64
    assert any("ZeRO-3 is modelled" in note for note in first.notes)

    def volume(report: Any) -> tuple[int, int, float]:
        ag, rs = report.comm["all_gather"]["dp"], report.comm["reduce_scatter"]["dp"]
        return ag["bytes"], rs["bytes"], ag["bus_bytes"] + rs["bus_bytes"]

    # the first step records DeepSpeed's trace: each module's params gathered before its forward and its
    # backward and released after each
    gathered, scattered, bus = volume(first)
    assert (gathered, scattered) == (2 * 2 * n, 2 * n)
    assert bus == pytest.approx(3 * 2 * n * 63 / 64, abs=first.comm["all_gather"]["dp"]["count"] + 1)
    # the later steps too, without DeepSpeed's prefetch and reuse distance
    no_cache = {
        "zero_optimization": {
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 0,
        }
    }
    third = _dry(3, {"ds_config": no_cache}, steps=3, nproc=8, nnodes=8)
    assert volume(third)[:2] == (2 * 2 * n, 2 * n) and "broadcast" not in third.comm
    # DeepSpeed's defaults: a param used again within `stage3_max_reuse_distance` elements (1e9: all of this
    # model) stays gathered from its forward to its backward, and those of at most 1e5 elements from one step
    # to the next (gathered after the update): each param is gathered once per step, 2 x the params moved
    default = _dry(3, steps=3, nproc=8, nnodes=8)
    assert volume(default)[:2] == (2 * n, 2 * n)
    persistent = sum(k for k in numels if k <= 100_000)
    assert default.per_rank["params"] == 2 * n // 64 + 2 * persistent
    # compiled blocks: each module's params fetched by its hooks inside the block, as in the eager step
    compiled = _dry(3, {"compile": "blocks"}, steps=3, nproc=8, nnodes=8)
    assert _comm(compiled) == _comm(default)
    assert all(compiled.per_rank[k] == default.per_rank[k] for k in ("params", "grads", "optimizer"))
    assert any("af.compile under DeepSpeed ZeRO-3" in note for note in compiled.notes)
    # so the planner plans it
    from accelfn.planner.candidates import Candidate
    from accelfn.planner.prune import illegal

    assert illegal(Candidate({"dp": 64}, "zero3", compile="blocks")) is None
    assert time.perf_counter() - start < 60


def test_deepspeed_errors_of_the_real_lowering_are_raised_in_the_dry_run() -> None:
    with pytest.raises(
        af.CompositionError, match="builds a torch optimizer from the step's optimizer, but this"
    ):
        _dry(2, optimizer=af.optim.lion(1e-4), nproc=8, nnodes=8)


def test_the_zero_2_gradient_bucket_is_a_communication_buffer_not_an_activation() -> None:
    # DeepSpeed's ipg bucket (reduce_bucket_size elements, 5e8 by default: 1.86 GiB in fp32) is allocated by the
    # first gradient's hook, inside the last module's backward: it was counted as that module's activations
    report = _dry(2)
    bucket = 500_000_000 * 2  # (the tiny Llama's fp16 gradients)
    assert report.per_rank["comm_buffers"] >= bucket, report.per_rank
    assert report.per_rank["activations"] < bucket, report.per_rank
