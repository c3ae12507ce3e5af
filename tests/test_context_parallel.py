"""Context parallel over a `cp` mesh axis, alone and with ddp / fsdp over `dp`, on real processes (gloo, through
`accelfn launch`) vs one process on the global batch; the attention pieces vs whole-sequence attention; errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import accelfn as af
from accelfn.transforms.shard.context_parallel import (
    chunk_positions,
    gathered_attention,
    global_order,
    split_sequence,
)
from tests._launch import expect_ok, run_workers


@pytest.mark.slow
def test_cp2_alone_equals_one_process():
    configs = ["llama", "starcoder2", "own", "bidir", "llama:eager", "llama:accumulate", "llama:remat",
               "llama:compile", "llama:lora", "llama:nocache", "errors"]  # fmt: skip
    expect_ok(run_workers("cp_worker.py", 2, "cp=2", *configs, timeout=600), configs, 2)


@pytest.mark.slow
def test_dp2_x_cp2_on_four_processes_equals_one_process(tmp_path):
    configs = ["llama", "llama:fsdp", "starcoder2:fsdp:accumulate", "llama:loader", "llama:fsdp:remat", "errors",
               f"llama:fsdp:save={tmp_path / 'ckpt'}"]  # fmt: skip
    # the mesh from the launcher: accelfn launch --mesh dp=2,cp=2
    proc = run_workers("cp_worker.py", 4, "env", *configs, timeout=600, launch_args=("--mesh", "dp=2,cp=2"))
    expect_ok(proc, configs, 4)
    # the fsdp-over-dp x cp state loads on one process, equal to the one-process run's
    from tests.workers.cp_worker import make_model

    step = af.train_step(lambda m, b: m(b).logits.sum(), af.optim.adamw(1e-3))
    like = step.init(make_model("llama"))
    state = af.checkpoint.load(tmp_path / "ckpt", like=like)
    ref = af.checkpoint.load(tmp_path / "ckpt-ref", like=like)
    assert int(state.step) == 4
    for n, p in ref.params.items():
        torch.testing.assert_close(state.params[n], p, rtol=0, atol=2e-5, msg=n)


@pytest.mark.slow
def test_hsdp_over_dp_x_cp_on_four_processes_equals_one_process():
    # hsdp with cp: the dense params replicated over dp and sharded over fsdp x cp (the cp ranks hold parts of
    # every gradient, as under fsdp), the replicas all-reducing their shards
    configs = ["llama:hsdp", "starcoder2:hsdp:accumulate:remat"]
    expect_ok(run_workers("cp_worker.py", 4, "dp=2,fsdp=1,cp=2", *configs, timeout=600), configs, 4)


def test_hsdp_over_cp_lowers_at_64_ranks_sharding_over_fsdp_x_cp() -> None:
    """The dry run of hsdp on dp=4 x fsdp=8 x cp=2 (64 fake ranks): the params gathered and their gradients
    reduce-scattered over the 16 ranks of fsdp x cp, the shards all-reduced over the 4 replicas, the keys and
    values gathered over cp."""
    from accelfn.planner.search import Job, run_job
    from tests._launch import ROOT

    args = ("--model", "tiny", "--steps", "2", "--bf16", "--strategy", "hsdp", "--seq-len", "256")
    job = Job(str(ROOT / "examples" / "train_llama.py"), args, 8, 8, mesh="dp=4,fsdp=8,cp=2", gpu="h100-sxm")
    report = run_job(job)["report"]
    assert "shard(hsdp, dp=4, fsdp=8, cp=2)" in report["strategy"]
    comm = report["comm"]
    assert comm["reduce_scatter"]["fsdpxcp"]["group_size"] == 16
    assert comm["all_gather"]["fsdpxcp"]["count"] == comm["reduce_scatter"]["fsdpxcp"]["count"] * 2
    assert comm["all_reduce"]["dp"]["group_size"] == 4 and comm["all_reduce"]["dp"]["bytes"] > 1024
    assert comm["all_gather"]["cp"]["group_size"] == 2


@pytest.mark.slow
def test_cp4_on_four_processes_equals_one_process():
    configs = ["llama", "llama:fsdp:accumulate", "own", "errors"]
    expect_ok(run_workers("cp_worker.py", 4, "cp=4", *configs, timeout=600), configs, 4)


@pytest.mark.slow
def test_cp2_x_tp2_on_four_processes_equals_one_process():
    # context parallel beside tensor parallel (the model's own tp plan, sequence parallel between the blocks):
    # each tp rank attends with its heads over the cp group's keys of those heads
    configs = ["llama", "llama:fsdp:remat", "starcoder2:accumulate", "llama:compile"]
    expect_ok(run_workers("cp_worker.py", 4, "cp=2,tp=2", *configs, timeout=600), configs, 4)


# ---- the pieces (one process) -----------------------------------------------------------------------------------
def test_chunks_cover_the_sequence_once_and_balance_causal_work():
    for size in (1, 2, 3, 4):
        seq = torch.arange(8 * size).reshape(1, -1)
        parts = [split_sequence(seq, r, size) for r in range(size)]
        positions = [chunk_positions(8, r, size) for r in range(size)]
        for part, pos in zip(parts, positions):
            assert torch.equal(part[0], pos)  # the split takes the tokens at those global positions
        assert sorted(torch.cat(positions).tolist()) == list(range(8 * size))
        work = {int((pos + 1).sum()) for pos in positions}  # keys each rank's queries see under a causal mask
        assert len(work) == 1, work


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("size", [2, 4])
def test_each_ranks_attention_over_gathered_keys_is_its_part_of_whole_attention(causal, size):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 16, 8, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 16, 8, generator=g, requires_grad=True)  # GQA: 2 kv heads
    v = torch.randn(2, 2, 16, 8, generator=g, requires_grad=True)
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    cot = torch.randn(whole.shape, generator=g)
    want = torch.autograd.grad(whole, (q, k, v), cot)
    gathered_k = torch.cat([split_sequence(k, r, size, dim=2) for r in range(size)], dim=2)
    gathered_v = torch.cat([split_sequence(v, r, size, dim=2) for r in range(size)], dim=2)
    parts = []
    for r in range(size):
        got = gathered_attention(
            split_sequence(q, r, size, dim=2), gathered_k, gathered_v, r, size, causal=causal, enable_gqa=True
        )
        torch.testing.assert_close(got, split_sequence(whole, r, size, dim=2), rtol=1e-5, atol=1e-6)
        parts.append((got * split_sequence(cot, r, size, dim=2)).sum())
    got_grads = torch.autograd.grad(sum(parts), (q, k, v))  # the backward through every rank's pieces
    for got_g, want_g in zip(got_grads, want):
        torch.testing.assert_close(got_g, want_g, rtol=1e-5, atol=1e-5)


def test_causal_attention_computes_only_the_keys_up_to_each_chunk():
    # rank r's chunks r and 2*size-1-r attend to (r+1) and (2*size-r) chunks of keys: 2*size+1 chunks in all on
    # every rank (balanced), against 4*size for its two chunks over every key (the masked half computed too)
    seen = []

    class Spy(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is F.scaled_dot_product_attention:
                seen.append((args[0].shape[-2], args[1].shape[-2]))
            return func(*args, **(kwargs or {}))

    size, n = 4, 32
    q = torch.randn(1, 2, n // size, 8)
    kv = torch.randn(1, 2, n, 8)
    for r in range(size):
        seen.clear()
        with Spy():
            gathered_attention(q, kv, kv, r, size, causal=True)
        half = n // size // 2
        assert seen == [(half, (r + 1) * half), (half, (2 * size - r) * half)], (r, seen)


def test_the_causal_bias_path_equals_whole_attention(monkeypatch):
    # the path a GPU takes (torch's CausalBias, cached per chunk length when the batch is split), run on the CPU
    # where CausalBias builds its mask: each rank's pieces equal its part of whole-sequence causal attention
    from accelfn.transforms.shard import context_parallel as cp

    monkeypatch.setattr(cp, "_lower_right_bias", lambda query: True)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 24, 8, generator=g) for _ in range(3))
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    size = 3
    gk = torch.cat([split_sequence(k, r, size, dim=2) for r in range(size)], dim=2)
    gv = torch.cat([split_sequence(v, r, size, dim=2) for r in range(size)], dim=2)
    for r in range(size):
        rt = cp._Runtime(r, size, None)  # type: ignore[arg-type]
        rt.set_length(8)
        assert sorted(rt.biases) == sorted({(4, (r + 1) * 4), (4, (2 * size - r) * 4)})
        got = gathered_attention(
            split_sequence(q, r, size, dim=2), gk, gv, r, size, causal=True, biases=rt.biases
        )
        torch.testing.assert_close(got, split_sequence(whole, r, size, dim=2), rtol=1e-5, atol=1e-6)


def test_query_heads_not_a_multiple_of_the_key_heads_are_named():
    q, kv = torch.randn(1, 6, 8, 4), torch.randn(1, 4, 16, 4)
    with pytest.raises(ValueError, match="6 query heads are not a multiple of 4 key/value heads"):
        gathered_attention(q, kv, kv, 0, 2, causal=True, enable_gqa=True)


def test_global_order_undoes_the_head_tail_split():
    for size in (1, 2, 3):
        seq = torch.arange(12 * size).reshape(1, 1, -1, 1)
        gathered = torch.cat([split_sequence(seq, r, size, dim=2) for r in range(size)], dim=2)
        assert torch.equal(global_order(gathered, size), seq)


def test_a_cp_axis_of_size_one_splits_nothing():
    with af.Mesh({"cp": 1}, device="cpu") as mesh:  # size 1: no split, plain data parallel over nothing
        step = af.shard(af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.sgd(0.1)), mesh)
        assert "context_parallel" not in repr(step)
        state, _ = step(step.init(torch.nn.Linear(3, 1)), torch.randn(4, 3))
        assert int(state.step) == 1
