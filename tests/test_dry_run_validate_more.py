"""More of `af.dry_run`'s validation (issue 20, item 5): context parallel and local SGD against real processes,
and the measurement of the real side (our `StepTracker` on real tensors) against torch's own `MemTracker`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import accelfn as af
from accelfn import tree as _tree
from accelfn.dryrun.run import measure_real
from tests._launch import ROOT, output_of, run_workers
from tests._real_vs_dry import counts, groups_of, over_count, read_rank
from tests.test_dry_run import _no_process_group  # noqa: F401 - an autouse fixture

LONG_CONTEXT = ROOT / "examples" / "long_context.py"

# context parallel needs labels aligned with the inputs (train_llama.py slices them in its loss):
# examples/long_context.py, full remat, ddp or fsdp over the data axes and cp
VALIDATE_CP = [
    (2, "cp=2", ("--seq-len", "128")),  # gradients all-reduced over cp
    (4, "dp=2,cp=2", ("--seq-len", "128", "--strategy", "fsdp")),  # fsdp over dp x cp, k/v over cp
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("nproc, mesh, args", VALIDATE_CP, ids=[m for _, m, _ in VALIDATE_CP])
def test_context_parallel_dry_run_matches_the_real_run(
    tmp_path: Path, nproc: int, mesh: str, args: tuple[str, ...]
) -> None:
    """As test_dry_run.py's test_dry_run_matches_the_real_run, for context parallel, every rank: each
    collective's count and bus bytes per mesh axis equal (the keys' and values' all-gathers over cp, forward
    and remat's recomputation, their gradients' reduce-scatters), and the collectives per process group equal
    to gloo's own count on the real run; bytes by category and the peak equal, to the byte;
    FLOPs equal."""
    # two steps: the dry run stops the script when its loop comes round, before it closes its mesh
    script_args = (*args, "--steps", "2")
    proc = run_workers("dry_run_script_worker.py", nproc, str(tmp_path), mesh, str(LONG_CONTEXT), "--",
                       *script_args, timeout=240)  # fmt: skip
    assert proc.returncode == 0, output_of(proc)
    for rank in range(nproc):
        real = read_rank(tmp_path, rank)
        dry = af.dry_run(LONG_CONTEXT, script_args, nproc_per_node=nproc, device="cpu", mesh=mesh, search=False,
                         rank=rank).to_dict()  # fmt: skip
        assert (
            "context_parallel(cp=2)" in dry["strategy"]
            and "context_parallel(cp=2)" in real.report["strategy"]
        )
        assert real.gloo and groups_of(real.report, mesh, rank) == real.gloo, (rank, real.report["comm"])
        assert groups_of(dry, mesh, rank) == real.gloo, (rank, dry["comm"])
        assert counts(dry) == counts(real.report), rank
        assert counts(dry)[("all_gather", "cp")][0] == 8  # k and v, 2 layers, forward and recomputation
        assert over_count(dry, real.report) == {}, rank  # to the byte, the peak too
        assert dry["flops_per_step"] == real.report["flops_per_step"], rank


@pytest.mark.slow
def test_local_sgd_dry_run_matches_the_real_run(tmp_path: Path) -> None:
    """examples/local_sgd.py (averaging every update, 2 micro-batches) on 2 processes: on each rank, the one
    collective (the params' average, no gradient sync) as gloo counted it, and every byte and FLOP, equal."""
    script, mesh = ROOT / "examples" / "local_sgd.py", "dp=2"
    script_args = ("--local-sgd-steps", "2", "--accumulation", "2")
    proc = run_workers("dry_run_script_worker.py", 2, str(tmp_path), mesh, str(script), "--", *script_args,
                       timeout=240)  # fmt: skip
    assert proc.returncode == 0, output_of(proc)
    for rank in range(2):
        real = read_rank(tmp_path, rank)
        dry = af.dry_run(script, script_args, nproc_per_node=2, device="cpu", mesh=mesh, search=False,
                         rank=rank).to_dict()  # fmt: skip
        assert "local_sgd" in dry["strategy"] and real.gloo == {(0, 1): 1}, (dry["strategy"], real.gloo)
        assert groups_of(dry, mesh, rank) == groups_of(real.report, mesh, rank) == real.gloo, rank
        assert counts(dry) == counts(real.report), rank
        assert over_count(dry, real.report) == {}, rank
        assert dry["flops_per_step"] == real.report["flops_per_step"], rank


# ---- the real side's tracker against torch's MemTracker -------------------------------------------------
def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         use_cache=False, attn_implementation="sdpa")  # fmt: skip
    return LlamaForCausalLM(config)


def _lm_loss(model: nn.Module, ids: torch.Tensor) -> af.Loss:
    return af.losses.cross_entropy(model(input_ids=ids).logits[:, :-1], ids[:, 1:])


def test_step_tracker_agrees_with_torch_mem_tracker() -> None:
    """One real single-process step (Llama, hidden 64, 2 layers, seq 64, batch 4, AdamW), measured by our
    StepTracker and by torch's MemTracker (torch.distributed._tools), each on a fresh state.

    Categories: MemTracker's Parameter and Buffer are ours; the optimizer state, given to it with
    `track_external`, is its Other (its Optstate only follows torch.optim optimizers); its Activation is what
    is allocated outside a backward pass, its Temp what is allocated inside one, its Gradient only `.grad`s it
    hooked (none here: the grads appear as Temp). Ours puts everything the forward and backward allocate in
    activations, except the gradients (grads), and what comes after (clipping, update) in temporary. Both
    agree on the peak's total, and on its activations + temporary against MemTracker's Activation + Temp +
    Gradient."""
    from torch.distributed._tools.mem_tracker import MemTracker

    ids = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(0))

    def fresh() -> tuple[af.Step, af.TrainState]:
        step = af.train_step(_lm_loss, af.optim.adamw(1e-3))
        return step, step.init(_llama())

    def main() -> None:
        step, state = fresh()
        step(state, ids)

    ours = measure_real(main)

    step, state = fresh()
    theirs = MemTracker()
    held = _tree.leaves((state.params, state.buffers, state.opt_state))
    theirs.track_external(*[x for x in held if isinstance(x, torch.Tensor)])
    with theirs:
        step(state, ids)
    peak = theirs.get_tracker_snapshot("peak")[torch.device("cpu")]
    snap = {getattr(k, "value", k): v for k, v in peak.items()}  # category names

    assert snap["Parameter"] == ours.per_rank["params"] == ours.at_peak["params"]
    assert snap["Buffer"] == ours.per_rank["buffers"] == ours.at_peak["buffers"]
    assert snap["Other"] == ours.per_rank["optimizer"] == ours.at_peak["optimizer"]
    # measured: the peak and the transient bytes at the peak equal, to the byte. The peak falls in the loss's
    # backward (the chunked cross entropy rebuilds each chunk's gradient there): MemTracker splits what is live
    # then into Activation (allocated in the forward) and Temp (in the backward), ours counts both as activations
    # (and the step key's 32-byte split as temporary), so only the sum compares
    assert ours.per_rank["peak"] == snap["Total"], (ours.per_rank, snap)
    ours_transient = ours.at_peak["activations"] + ours.at_peak["temporary"] + ours.at_peak["grads"]
    assert ours_transient == snap["Activation"] + snap["Temp"] + snap["Gradient"], (ours.at_peak, snap)
    assert ours.at_peak["temporary"] == 32 and snap["Activation"] <= ours.at_peak["activations"]
    assert ours.per_rank["activations"] > 2 * ours.per_rank["params"]  # a figure worth comparing


def test_a_real_run_gives_the_backend_copies_so_its_worker_thread_frees_nothing_the_step_counts() -> None:
    """On a real run the tracker runs a functional collective on copies and waits for it at once: gloo's
    worker thread keeps the tensors of a collective until some time after the wait returns, and a storage it
    freed last was counted live at a point of the step that varied from run to run (the cp=2 test above: a
    key's all-gather, 48 KiB, live at rank 1's peak in 2 runs of 12). Checked where it is deterministic: right
    after the collective is issued, no work is in flight and the input dies with the program's last reference."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from accelfn.dryrun.tracker import StepTracker

    registry_size = torch._C._distributed_c10d._get_work_registry_size
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with StepTracker() as tracker:
            x = torch.arange(256.0)
            gathered = funcol.all_gather_single(x, 0, dist.group.WORLD)
            in_flight = registry_size()
            key = x.untyped_storage()._cdata
            del x  # the program's last reference
            freed_at_once = key not in tracker._live
            gathered = gathered.wait() if hasattr(gathered, "wait") else gathered
        assert (in_flight, freed_at_once) == (0, True)  # before the fix: (1, False)
        assert torch.equal(gathered, torch.arange(256.0))  # the same call on the same data: exact
        assert [(c.kind, c.nbytes) for c in tracker.collectives] == [("all_gather", 1024)]
    finally:
        dist.destroy_process_group()


def _gloo_pair() -> list[Any]:
    """Two ranks of a gloo process group in this process (ranks 0 and 1, each used from its own thread), not
    registered with torch.distributed (the test's process has no default group)."""
    import threading

    import torch.distributed as dist
    from torch._C._distributed_c10d import ProcessGroup

    store, groups = dist.HashStore(), [None, None]

    def make(rank: int) -> None:
        backend = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, 2)
        group = ProcessGroup(store, rank, 2)
        group._set_default_backend(ProcessGroup.BackendType.GLOO)
        group._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, backend)
        groups[rank] = group

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(g is not None for g in groups)
    return groups


def test_a_real_run_gives_c10d_collectives_copies_and_waits_so_the_caller_s_tensor_dies_with_its_reference() -> (
    None
):
    """As the test above, for c10d's collectives (DDP's reducer, FSDP2, DeepSpeed and torch.distributed's calls
    issue them): gloo's worker thread holds a collective's Work, and the tensors in it, until some time after the
    wait returns. Deterministic here: rank 1 (a thread) joins the all-reduce only once rank 0 has dropped its
    tensor and Work (or after 2 s). Without the fix the backend still holds the tensor then (the collective cannot
    have run); with it, rank 0's call ran on copies and waited (for rank 1's 2 s), and the tensor dies with the
    program's last reference. Then the results land in the caller's tensors, each Work comes back completed, and
    an all-reduce's future holds the caller's tensor (DDP's reducer views its gradients from that value)."""
    import threading

    from accelfn.dryrun.tracker import StepTracker

    group0, group1 = _gloo_pair()
    dropped = threading.Event()

    def rank1() -> None:
        dropped.wait(2.0)
        group1.allreduce([torch.full((256,), 2.0)]).wait()
        group1.allreduce([torch.arange(4.0) * 10]).wait()
        group1._allgather_base(torch.empty(6), torch.arange(3.0) + 3).wait()
        group1._reduce_scatter_base(torch.empty(2), torch.arange(4.0) * 10).wait()

    other = threading.Thread(target=rank1, daemon=True)  # (left behind if rank 0 fails)
    other.start()
    try:
        with StepTracker() as tracker:
            x = torch.ones(256)
            work = group0.allreduce([x])
            key = x.untyped_storage()._cdata
            del work, x  # the program's last references
            freed_at_once = key not in tracker._live
            dropped.set()
            summed = torch.arange(4.0)
            work = group0.allreduce([summed])
            done = work.is_completed()
            work.wait()
            (held,) = work.get_future().value()
            gathered, scattered = torch.empty(6), torch.empty(2)
            group0._allgather_base(gathered, torch.arange(3.0)).wait()
            group0._reduce_scatter_base(scattered, torch.arange(4.0)).wait()
    finally:
        dropped.set()
        other.join(30)
    assert freed_at_once  # before the fix: False
    assert done and held is summed and torch.equal(summed, torch.arange(4.0) * 11)
    assert torch.equal(gathered, torch.arange(6.0)) and torch.equal(scattered, torch.tensor([0.0, 11.0]))
    assert [(c.kind, c.size, c.nbytes) for c in tracker.collectives] == [
        ("all_reduce", 2, 1024), ("all_reduce", 2, 16), ("all_gather", 2, 24), ("reduce_scatter", 2, 16)
    ]  # fmt: skip
