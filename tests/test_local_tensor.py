"""N ranks in one process: an `af.shard` step (ddp, fsdp over a mesh of 4) run under torch's `LocalTensorMode`
(`torch.distributed._local_tensor`) over the fake process group, against one process on the global batch
(issue 20, item 7): two steps of SGD with momentum, params, loss and gradient norm compared (issue 34: an
update in proportion to the gradient, so a gradient summed over the ranks instead of averaged fails).

What runs on torch 2.13 and what it takes:
- dp x tp (colwise then rowwise, 2 x 2): runs, equal to one process.
- ddp: runs. Under the mode the mesh coordinate is a per-rank SymInt; `af.random` folds it in per simulated
  rank, so each rank gets its own step key and dropout stream, as in a real job
  (`test_keys_and_seeds_are_per_simulated_rank`).
- fsdp (torch's FSDP2): runs with two more workarounds for torch gaps, each shown by its own test (they fail
  when torch fixes the gap): FSDP2 frees and re-allocates the unsharded parameters with
  `untyped_storage().resize_()`, which a LocalTensor (a wrapper subclass) refuses; and FSDP2 takes each
  parameter's shard from the process group's rank (`group.rank()`, the one real rank: 0), so every simulated
  rank starts with rank 0's shard. With the storages resized per rank and the shards set per rank after
  `init`, loss and updated parameters equal the single process's to fp32 round-off, for a small MLP and for
  a `transformers` Llama (per-layer FSDP units).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import accelfn as af
from accelfn import mesh as _mesh
from accelfn import random as af_random
from accelfn.dryrun.run import _clear_dtensor_caches

local_tensor = pytest.importorskip("torch.distributed._local_tensor")
LocalTensor, LocalTensorMode = local_tensor.LocalTensor, local_tensor.LocalTensorMode
FSDP_PARAM = pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_param")
FSDP_GROUP = pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_param_group")

N, ROWS, WIDTH, HIDDEN, VOCAB, SEQ = 4, 8, 16, 32, 64, 16  # even shards: FSDP2 splits dim 0 in N


def _model(kind: str = "mlp") -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, WIDTH))
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=SEQ, use_cache=False,
                         attn_implementation="sdpa")  # fmt: skip
    return LlamaForCausalLM(config)


def _lm_loss(model: nn.Module, ids: torch.Tensor) -> af.Loss:
    return af.losses.cross_entropy(model(input_ids=ids).logits[:, :-1], ids[:, 1:])


def _step(kind: str = "mlp") -> Any:
    """SGD with momentum, its gradient norm reported: an update in proportion to the gradient, so a gradient
    of the wrong scale (summed over the ranks instead of averaged) changes the params and the norm (Adam's
    first update, about lr·sign(g), would not show it)."""
    loss = (lambda m, b: af.losses.mse(m(b), b)) if kind == "mlp" else _lm_loss
    return af.train_step(loss, af.optim.sgd(0.5, momentum=0.9), clip_grad_norm=1e6)  # a norm, no clipping


STEPS = 2  # the second step reads the momentum the first left


def _batch(kind: str = "mlp") -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    if kind == "mlp":
        return torch.randn(ROWS, WIDTH, generator=gen)
    return torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=gen)


@pytest.fixture
def mesh() -> Iterator[af.Mesh]:
    """A mesh of N ranks over torch's fake process group, this process being rank 0 (the mode plays all N)."""
    from torch.distributed.tensor import _random
    from torch.testing._internal.distributed.fake_pg import FakeStore

    _mesh.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=N)
    try:
        yield af.Mesh({"dp": N}, device="cpu")
    finally:
        _mesh.destroy_process_group()
        _clear_dtensor_caches()
        _random._rng_tracker = None


def _per_rank(fn: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    def on_each(t: torch.Tensor) -> None:
        for local in t._local_tensors.values() if isinstance(t, LocalTensor) else (t,):
            fn(local)

    return on_each


@pytest.fixture
def fsdp_storages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workaround for torch: FSDP2's storage resizes applied to each simulated rank's tensor."""
    monkeypatch.setattr(FSDP_PARAM, "free_storage", _per_rank(FSDP_PARAM.free_storage))
    alloc = _per_rank(FSDP_PARAM.alloc_storage)
    monkeypatch.setattr(FSDP_PARAM, "alloc_storage", alloc)
    monkeypatch.setattr(FSDP_GROUP, "alloc_storage", alloc)


def _shards(param: torch.Tensor) -> dict[int, torch.Tensor]:
    """Each simulated rank's local tensor of a (DTensor) parameter."""
    local = getattr(param, "_local_tensor", param)
    assert isinstance(local, LocalTensor), type(local)
    return local._local_tensors


def _run(mesh: af.Mesh, strategy: str, kind: str = "mlp", *, fix_shards: bool = True) -> tuple[Any, Any]:
    """One `af.shard` step on N simulated ranks, rank r reading rows r*ROWS/N.. of the global batch."""
    full = _model(kind).state_dict()
    x = _batch(kind)
    with LocalTensorMode(N) as mode:
        step = af.shard(_step(kind), mesh, strategy=strategy)
        state = step.init(
            _model(kind)
        )  # built under the mode: each parameter a LocalTensor, equal on all ranks
        if strategy == "fsdp" and fix_shards:  # FSDP2 gave every rank rank 0's shard: set rank r's
            for name, p in state.params.items():
                for r, local in _shards(p).items():
                    local.copy_(full[name].chunk(N)[r])
        batch = mode.rank_map(lambda r: x[r * (ROWS // N) : (r + 1) * (ROWS // N)])
        for _ in range(STEPS - 1):
            state, _ = step(state, batch)
        return step(state, batch)


def _reference(kind: str) -> tuple[Any, Any]:
    """`STEPS` steps of one process on the global batch."""
    step = _step(kind)
    state = step.init(_model(kind))
    for _ in range(STEPS - 1):
        state, _ = step(state, _batch(kind))
    return step(state, _batch(kind))


def _assert_metrics_equal(metrics: dict[str, Any], ref: dict[str, Any]) -> None:
    """The loss and the gradient norm of the last step: every simulated rank's equals one process's."""
    for key in ("loss", "grad_norm"):
        got = metrics[key]
        assert isinstance(got, LocalTensor), (key, type(got))
        for r, value in got._local_tensors.items():
            torch.testing.assert_close(value, ref[key], rtol=1e-5, atol=1e-7, msg=f"{key} on rank {r}")


@pytest.mark.parametrize("kind", ["mlp", "llama"])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.usefixtures("fsdp_storages")
def test_n_ranks_in_one_process_equal_one_process(mesh: af.Mesh, strategy: str, kind: str) -> None:
    """A small MLP and a transformers Llama (GQA, RoPE, SDPA): the loss and every rank's updated parameters
    (ddp: the whole tensor; fsdp: rank r's dim-0 shard) equal one process's step on the global batch."""
    ref_state, ref_metrics = _reference(kind)
    state, metrics = _run(mesh, strategy, kind)
    _assert_metrics_equal(metrics, ref_metrics)
    for name, p in state.params.items():
        shards = _shards(p)
        assert sorted(shards) == list(range(N))
        for r, local in shards.items():
            want = ref_state.params[name] if strategy == "ddp" else ref_state.params[name].chunk(N)[r]
            torch.testing.assert_close(local, want, rtol=1e-5, atol=1e-5, msg=f"{name} on rank {r}")


@pytest.fixture
def mesh_dp_tp() -> Iterator[af.Mesh]:
    """A dp=2 x tp=2 mesh over torch's fake process group (the mode plays all 4 ranks)."""
    from torch.distributed.tensor import _random
    from torch.testing._internal.distributed.fake_pg import FakeStore

    _mesh.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=N)
    try:
        yield af.Mesh({"dp": 2, "tp": 2}, device="cpu")
    finally:
        _mesh.destroy_process_group()
        _clear_dtensor_caches()
        _random._rng_tracker = None


def test_dp_by_tp_in_one_process_equals_one_process(mesh_dp_tp: af.Mesh) -> None:
    """Tensor parallel (colwise, then rowwise) inside data parallel, 4 simulated ranks: the loss and each rank's
    slice of every updated parameter equal one process's step on the global batch."""
    ref_state, ref_metrics = _reference("mlp")
    x = _batch()
    with LocalTensorMode(N) as mode:
        step = af.shard(_step(), mesh_dp_tp, strategy="ddp", tp_plan={"0": "colwise", "2": "rowwise"})
        state = step.init(_model())
        batch = mode.rank_map(lambda r: x[(r // 2) * (ROWS // 2) : (r // 2 + 1) * (ROWS // 2)])  # by dp rank
        for _ in range(STEPS):
            state, metrics = step(state, batch)
    _assert_metrics_equal(metrics, ref_metrics)
    split = {
        "0.weight": 0,
        "0.bias": 0,
        "2.weight": 1,
    }  # colwise: the output rows; rowwise: the input columns
    for name, p in state.params.items():
        for r, local in _shards(p).items():
            want = ref_state.params[name]
            if name in split:
                want = want.chunk(2, split[name])[r % 2]
            torch.testing.assert_close(local, want, rtol=1e-5, atol=1e-5, msg=f"{name} on rank {r}")


def test_keys_and_seeds_are_per_simulated_rank(mesh: af.Mesh) -> None:
    """`af.random` under the mode: the rank folded into a key is a per-rank SymInt; each simulated rank gets
    the key, and the draws under `seeded`, that one process with that rank gets (dropout differs by rank as
    in a real job)."""
    base = af_random.key(7)
    want = {r: af_random.fold_in(base, r) for r in range(N)}
    draws = {}
    for r in range(N):
        with af_random.seeded(af_random.split_list(want[r])[0]):
            draws[r] = torch.rand(3)
    with LocalTensorMode(N):
        rank = mesh._mesh.get_local_rank()  # a SymInt over per-rank integers
        assert isinstance(rank, torch.SymInt)
        k = af_random.fold_in(base, rank)
        with af_random.seeded(af_random.split_list(k)[0]):
            got = torch.rand(3)
    for r in range(N):
        assert torch.equal(k._local_tensors[r], want[r]) and torch.equal(got._local_tensors[r], draws[r]), r
    with LocalTensorMode(N):  # one key for every rank: every rank draws what one process draws
        with af_random.seeded(base):
            same = torch.rand(3)
        with af_random.seeded(base):
            again = torch.rand(3)
    with af_random.seeded(base):
        one = torch.rand(3)
    for r in range(N):
        assert torch.equal(_local_of(same, r), one) and torch.equal(_local_of(again, r), one), r


def _local_of(t: torch.Tensor, r: int) -> torch.Tensor:
    return t._local_tensors[r] if isinstance(t, LocalTensor) else t


# ---- the gaps: each test fails once the gap is closed (then drop its workaround above) -------------------
def test_fsdp2_resizes_storages_a_local_tensor_refuses(mesh: af.Mesh) -> None:
    """torch: FSDP2 frees the unsharded parameters after the forward with `untyped_storage().resize_(0)`."""
    with pytest.raises(RuntimeError, match="resize_\\(\\) on an invalid python storage"):
        _run(mesh, "fsdp")


@pytest.mark.usefixtures("fsdp_storages")
def test_fsdp2_gives_every_simulated_rank_rank_0s_shard(mesh: af.Mesh) -> None:
    """torch: FSDP2 shards each parameter by `group.rank()`, the one real rank of the fake group."""
    full = _model().state_dict()
    with LocalTensorMode(N):
        state = af.shard(_step(), mesh, strategy="fsdp").init(_model())
    for name, p in state.params.items():
        for local in _shards(p).values():
            torch.testing.assert_close(local, full[name].chunk(N)[0], rtol=0, atol=0)
