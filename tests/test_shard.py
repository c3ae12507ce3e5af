"""af.shard on real processes (gloo, through `accelfn launch`) vs the single-process run on the global batch."""

import pytest

import accelfn as af
from tests._launch import output_of, run_workers


@pytest.mark.slow
def test_ddp_and_fsdp_on_two_ranks_equal_one_process_on_the_global_batch():
    configs = [
        "ddp:mlp", "ddp:gpt2:sgd", "ddp:gpt2", "ddp:gpt2:accumulate",   # ddp: buckets + 1 all-reduces per call
        "ddp:mlp:overlap", "ddp:gpt2:accumulate:overlap",                # all-reduces started during backward
        "ddp:gpt2:smallbuckets", "ddp:gpt2:smallbuckets:overlap:accumulate",  # many ~2 KB buckets
        "ddp:gpt2:local", "fsdp:mlp:local:accumulate",                  # each rank passes only its own rows
        "fsdp:mlp", "fsdp:gpt2", "fsdp:mlp:accumulate",                 # fsdp asserts ~1/2 memory per rank
        "fsdp:gpt2:accumulate", "fsdp:gpt2:accumulate:nosync",          # reduce-scatters per micro-batch / step
        "fsdp:t5",                                                      # both of T5's stacks sharded per block
        "fsdp:fp16skip", "ddp:fp16skip",                                # inf on one rank: all ranks skip
        "fsdp:bf16policy",                                              # autocast -> FSDP2 MixedPrecisionPolicy
        "ddp:bf16count", "fsdp:bf16count",                              # Loss counts summed exactly in bf16 runs
        "ddp:frozen", "fsdp:frozen",                                    # ranks that froze other layers: refused
        "fsdp:fp8",                                                     # torchao fp8 all-gather == fp8 under ddp
        "ddp:moe:overlap", "ddp:moe", "fsdp:moe",                       # each rank uses a different expert
        "fsdp:moeacc",                                                  # ... in each micro-batch, reduce-scattered
        "fsdp:unusedbf16",                                              # a param no rank uses, bf16, no_sync
        "fsdp:unreached",                                               # a unit's output in some ranks' loss
        "ddp:bn", "fsdp:bn",                                            # BatchNorm buffers as torch DDP
        "fsdp:guards",                                                  # what FSDP2 cannot do is refused
        "fsdp:gpt2:compile",                                            # compile per block, in place, then FSDP2
        "fsdp:gpt2:remat", "ddp:gpt2:remat:overlap",                    # activation checkpointing per block
        "fsdp:gpt2:remat:compile",                                      # remat, then compile, then FSDP2
    ]  # fmt: skip
    proc = run_workers("shard_worker.py", 2, *configs, timeout=400)
    out = output_of(proc)
    assert proc.returncode == 0, out
    for c in configs:
        strategy, model, *extra = c.split(":")
        expected = {
            "fp16skip": f"OK {strategy} fp16-skip",
            "bf16policy": "OK fsdp bf16-policy",
            "fp8": "OK fsdp fp8",
            "moe": f"OK {strategy} moe overlap={'overlap' in extra}",
            "moeacc": "OK fsdp moe-accumulate",
            "unusedbf16": "OK fsdp unused-bf16",
            "unreached": "OK fsdp unreached",
            "bn": f"OK {strategy} bn-buffers",
            "guards": "OK fsdp guards",
            "bf16count": f"OK {strategy} bf16-count",
            "frozen": f"OK {strategy} frozen-differently",
        }.get(  # fmt: skip
            model, f"OK {strategy} {model} {sorted(extra)}"
        )
        for rank in (0, 1):
            assert f"rank {rank}: {expected}" in proc.stdout, out


@pytest.mark.slow
def test_hsdp_on_a_2x2_mesh_equals_one_process():
    configs = ("hsdp:mlp", "hsdp:mlp:accumulate", "hsdp:mlp:accumulate:nosync")
    proc = run_workers("shard_worker.py", 4, *configs, timeout=400)
    out = output_of(proc)
    assert proc.returncode == 0, out
    assert proc.stdout.count("OK hsdp mlp") == 12, out


@pytest.mark.slow
def test_a_step_that_raises_in_a_micro_batch_leaves_nothing_for_the_next():
    # the loss (or the model's forward, or the backward) raising in micro-batch 2 of 4, caught by the user: the
    # next steps equal a run without that step. hsdp on 2 ranks: 2 replicas of 1 shard (the all-reduce over the
    # replicas, whose partial sums a failed step left behind). local_sgd: a regression check (nothing to drop)
    for strategy in ("fsdp", "hsdp"):
        configs = [f"{strategy}:abort", f"{strategy}:abort:nosync"] + (
            ["ddp:abort", "local_sgd:abort"] if strategy == "fsdp" else []
        )
        proc = run_workers("shard_worker.py", 2, *configs, timeout=300)
        out = output_of(proc)
        assert proc.returncode == 0, out
        for c in configs:
            s, _, *extra = c.split(":")
            assert proc.stdout.count(f"OK {s} abort {extra}") == 2, out


def test_unknown_mesh_axis_lists_the_axes():
    mesh = af.Mesh({"dp": -1}, device="cpu")
    try:
        with pytest.raises(KeyError, match=r"no axis 'tp'.*\('dp',\)"):
            mesh.axis_size("tp")
        with pytest.raises(ValueError, match="strategy must be one of"):
            af.shard(af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1)), mesh, strategy="zero")
        with pytest.raises(ValueError, match="needs a 2-D mesh with axes 'dp' and 'fsdp'"):
            af.shard(af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1)), mesh, strategy="hsdp")
    finally:
        mesh.close()


def test_global_inputs_not_divisible_across_ranks_is_a_clear_error(monkeypatch):
    import torch

    from accelfn.transforms.shard.common import batch_transform

    class FakeMesh:
        device, data_size, data_rank = torch.device("cpu"), 2, 0

    take = batch_transform(FakeMesh(), "global")
    with pytest.raises(
        ValueError, match=r"batch\['x'\] has 5 rows, not divisible by the 2 data-parallel ranks"
    ):
        take({"x": torch.zeros(5, 3)})
    assert take({"x": torch.arange(6)})["x"].tolist() == [0, 1, 2]


def test_shard_in_a_single_process_is_the_plain_step():
    import copy

    import torch

    mesh = af.Mesh({"dp": -1}, device="cpu")
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        x = torch.randn(6, 4)
        plain = af.train_step(lambda m, b: af.losses.mse(m(b), b[:, :3]), af.optim.adamw(1e-2))
        sharded = af.shard(
            af.train_step(lambda m, b: af.losses.mse(m(b), b[:, :3]), af.optim.adamw(1e-2)), mesh
        )
        s1, s2 = plain.init(copy.deepcopy(model)), sharded.init(copy.deepcopy(model))
        for _ in range(3):
            s1, m1 = plain(s1, x)
            s2, m2 = sharded(s2, x)
        assert torch.allclose(m1["loss"], m2["loss"], atol=1e-7)
        assert all(torch.allclose(s1.params[k], s2.params[k], atol=1e-7) for k in s1.params)
    finally:
        mesh.close()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "deepspeed"])
def test_two_models_in_alternation_gan_equal_one_process(strategy):
    if strategy == "deepspeed":
        pytest.importorskip("deepspeed")
    proc = run_workers("gan_worker.py", 2, strategy, timeout=300)
    out = output_of(proc)
    assert proc.returncode == 0, out
    assert proc.stdout.count(f"OK gan {strategy}") == 2, out


@pytest.mark.parametrize(
    "axes,hint",
    [
        ({"dp": 1, "tpp": 2}, "Did you mean 'tp'?"),
        ({"dp": 1, "sp": 2}, "sequence_parallel=True"),
        ({"dpp": 2}, "'dp'"),
    ],
)
def test_an_axis_shard_does_not_split_over_is_refused(axes, hint):
    # `--mesh dp=1,tpp=2` (a typo) or torchtitan's `sp`: the two ranks would train on the same data, doing the
    # same work twice. The checks read only the mesh's shape: a mesh object with that shape stands in for the
    # two-process job.
    mesh = af.Mesh.__new__(af.Mesh)
    mesh._shape = dict(axes)
    step = af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1))
    with pytest.raises(ValueError, match="is not one af.shard splits over") as e:
        af.shard(step, mesh)
    assert hint in str(e.value) and repr(next(a for a in axes if axes[a] == 2)) in str(e.value)


@pytest.mark.slow
def test_rank_loss_is_each_ranks_own_rows_and_loss_the_global_mean():
    proc = run_workers("rank_loss_worker.py", 2)
    assert proc.returncode == 0, output_of(proc)
    assert proc.stdout.count("RANK LOSS OK") == 4, output_of(proc)
