"""Models built on the meta device: `step.init` materialises them (after sharding, only this rank's shards) with
the modules' own init rules; the dry run reports the memory held before the first step (host and device)."""

from __future__ import annotations

import subprocess
import sys
import zlib

import pytest
import torch
from torch import nn

import accelfn as af
from accelfn.materialize import has_meta, materialize
from tests._launch import ROOT, output_of, run_workers

sys.path.insert(0, str(ROOT / "examples"))
from train_llama import build  # noqa: E402


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4), nn.LayerNorm(4))


def _module_seed(seed: int, name: str) -> int:
    """The seed `materialize` gives module `name`: its own generator, from the step's seed and its name."""
    return af.random.seed_of(af.random.fold_in(af.random.key(seed), zlib.crc32(name.encode())))


def test_each_module_gets_its_own_init_from_the_seed_and_its_name() -> None:
    with af.init_empty(include_buffers=True):
        meta = _mlp()
    assert has_meta(meta)
    rng = torch.get_rng_state()
    materialize(meta, torch.device("cpu"), seed=3)
    assert torch.equal(torch.get_rng_state(), rng)  # the caller's generator is left alone
    assert not has_meta(meta)
    for name in ("0", "2"):  # torch's own init of each Linear, seeded as materialize seeds it
        torch.manual_seed(_module_seed(3, name))
        ref = nn.Linear(*meta.get_submodule(name).weight.shape[::-1])
        assert torch.equal(meta.get_submodule(name).weight, ref.weight), name
        assert torch.equal(meta.get_submodule(name).bias, ref.bias), name
    assert torch.equal(meta[1].running_var, torch.ones(16)) and torch.equal(meta[3].weight, torch.ones(4))
    with af.init_empty():
        again, other = _mlp(), _mlp()
    materialize(again, torch.device("cpu"), seed=3)
    materialize(other, torch.device("cpu"), seed=4)
    assert torch.equal(again[0].weight, meta[0].weight) and not torch.equal(other[0].weight, meta[0].weight)


def test_modules_alike_but_named_apart_get_different_values() -> None:
    with af.init_empty():
        twins = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))  # e.g. the same layer in two pipeline stages
    materialize(twins, torch.device("cpu"), seed=0)
    assert not torch.equal(twins[0].weight, twins[1].weight)


def test_a_meta_model_trains_as_a_host_model_with_its_values() -> None:
    """Three steps from a meta model equal a plain PyTorch loop (torch.optim.SGD) on a host model built apart:
    each Linear initialised by torch under the seed `materialize` gives it, the norms at their defaults."""

    def loss(m: nn.Module, b: torch.Tensor) -> af.Loss:
        return af.losses.mse(m(b), b[:, :4])

    with af.init_empty():
        meta = _mlp()
    step = af.train_step(loss, af.optim.sgd(0.1))
    state = step.init(meta, seed=1)
    host = _mlp()
    for name in ("0", "2"):
        torch.manual_seed(_module_seed(1, name))
        host[int(name)] = nn.Linear(*host[int(name)].weight.shape[::-1])
    opt = torch.optim.SGD(host.parameters(), lr=0.1)
    batches = [torch.randn(6, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    for batch in batches:
        state, metrics = step(state, batch)
        ref_loss = nn.functional.mse_loss(host(batch), batch[:, :4])
        opt.zero_grad()
        ref_loss.backward()
        opt.step()
        torch.testing.assert_close(metrics["loss"], ref_loss.detach(), rtol=1e-6, atol=1e-7)
    for name, ref in [*host.named_parameters(), *host.named_buffers()]:
        got = {**state.params, **state.buffers}[name]
        torch.testing.assert_close(got, ref.detach(), rtol=1e-6, atol=1e-7, msg=name)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


class _Gated(nn.Module):  # a rule that writes its child's tensor (after the child's own rule)
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.zeros(4))
        self.proj = nn.Linear(4, 4)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.gate)
        nn.init.zeros_(self.proj.bias)


def test_tied_parameters_stay_tied_and_parents_rules_run_after_their_childrens() -> None:
    with af.init_empty():
        tied, gated = _Tied(), _Gated()
    materialize(tied, torch.device("cpu"), seed=0)
    assert tied.head.weight is tied.emb.weight and len(list(tied.parameters())) == 1
    materialize(gated, torch.device("cpu"), seed=0)
    assert torch.equal(gated.gate, torch.ones(4)) and torch.equal(gated.proj.bias, torch.zeros(4))


class _Block(nn.Module):  # its rule sets a child's values, but it has no tensors of its own
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(4, 4)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.out.weight)


def test_a_rule_that_is_not_run_is_named() -> None:
    with af.init_empty():
        block = _Block()
    with pytest.warns(UserWarning, match=r"module '\(root\)' \(_Block\) has a reset_parameters\(\) but no"):
        materialize(block, torch.device("cpu"), seed=0)


def test_transformers_models_get_their_own_init_and_computed_buffers() -> None:
    torch.manual_seed(0)
    host = build("tiny", 32)
    with torch.device("meta"):  # buffers too: the rotary frequencies come from transformers' _init_weights
        meta = build("tiny", 32)
    materialize(meta, torch.device("cpu"))
    host_buffers = dict(host.named_buffers())
    for name, b in meta.named_buffers():
        assert torch.equal(b, host_buffers[name]), name
    for name, p in meta.named_parameters():
        assert not p.isnan().any(), name
        if "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
        else:  # Llama's normal(0, initializer_range) init
            assert p.std().item() == pytest.approx(host.config.initializer_range, rel=0.1), name


class _NoInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))


class _HalfInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.ones(3))
        self.b = nn.Parameter(torch.ones(3))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.a)  # forgets b


def test_meta_tensors_without_an_init_rule_are_named() -> None:
    with af.init_empty():
        model = nn.Sequential(nn.Linear(3, 3), _NoInit())
    with pytest.raises(ValueError, match=r"module '1' \(_NoInit\) has parameters or buffers there but no"):
        materialize(model, torch.device("cpu"))
    assert has_meta(model)  # nothing allocated before the error
    with af.init_empty():
        half = nn.Sequential(_HalfInit())
    with pytest.raises(ValueError, match=r"init rule of module '0' \(_HalfInit\) left 'b' unset"):
        materialize(half, torch.device("cpu"))


def test_real_tensors_keep_their_values() -> None:
    with af.init_empty():  # buffers stay real (af.init_empty's default)
        model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    model[1].running_mean.fill_(7.0)
    materialize(model, torch.device("cpu"))
    assert torch.equal(model[1].running_mean, torch.full((3,), 7.0)) and not has_meta(model)


@pytest.mark.slow
def test_meta_models_sharded_on_two_processes_equal_one_process() -> None:
    configs = ("mlp fsdp", "mlp tp", "llama pp", "llama load")
    proc = run_workers("meta_init_worker.py", 2, ",".join(configs), timeout=300)
    out = output_of(proc)
    assert proc.returncode == 0, out
    for config in configs:
        for rank in (0, 1):
            assert f"rank {rank}: OK {config}" in proc.stdout, out


# ---- the dry run's memory before the first step -----------------------------------------------------------------
def _llama_script(init: str, strategy: str = "fsdp") -> object:
    def main() -> None:
        mesh = af.Mesh.from_env()
        with af.init_empty() if init == "meta" else torch.device("cpu"):
            model = build("0.9b", 256)
        step = af.shard(af.train_step(lambda m, b: m(input_ids=b).logits.float().mean(), af.optim.adamw(1e-3)),
                        mesh, strategy=strategy)  # fmt: skip
        state = step.init(model)
        step(state, torch.zeros(1, 256, dtype=torch.long))

    return main


def _model_bytes(model: str) -> tuple[int, int]:
    """(all params and buffers, the largest module's direct ones) in bytes, of the Llama config built on the meta
    device (its own numbers, not the dry run's)."""
    with torch.device("meta"):
        m = build(model, 256)
    total = sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])
    largest = max(
        sum(t.numel() * t.element_size() for t in [*x.parameters(recurse=False), *x.buffers(recurse=False)])
        for x in m.modules()
    )
    return total, largest


def test_dry_run_reports_every_rank_building_the_model_on_the_host() -> None:
    total, largest = _model_bytes("0.9b")
    host = af.dry_run(_llama_script("host"), nproc_per_node=8, nnodes=8, search=False)
    # the whole model on each rank's host (and a few small tensors: rotary set-up, RNG state)
    assert total <= host.init["host_peak"] <= total + 2**16
    assert host.init["host_per_node"] == 8 * host.init["host_peak"]
    # fsdp places the model on the device whole before it shards it: the whole model, then the shards beside it
    assert host.init["device_peak"] >= total
    meta = af.dry_run(_llama_script("meta"), nproc_per_node=8, nnodes=8, search=False)
    assert meta.init["host_peak"] <= largest + 2**20  # one module whole at a time (its init on the host)
    shards = meta.per_rank["params"] + meta.per_rank["optimizer"]
    assert shards <= meta.init["device_peak"] < total / 8
    assert host.per_rank["params"] == meta.per_rank["params"]  # the same step afterwards
    assert "before the first step" in str(meta) and meta.fits and host.fits


def test_a_model_too_big_for_the_nodes_host_memory_does_not_fit() -> None:
    total, _ = _model_bytes("0.9b")
    small = af.dryrun.Assumptions(host_memory_bytes=4 * total)  # < 8 ranks' copies
    report = af.dry_run(_llama_script("host"), nproc_per_node=8, search=False, assumptions=small)
    assert report.fits is False and report.init["fits_host"] is False and report.headroom_bytes > 0
    note = next(n for n in report.notes if "before the first step each rank holds" in n)
    assert "af.init_empty()" in note and "load_pretrained" in note
    assert "DOES NOT FIT" in str(report)
    fixed = af.dry_run(_llama_script("meta"), nproc_per_node=8, search=False, assumptions=small)
    assert fixed.fits and fixed.init["fits_host"]


def test_cli_exits_3_when_the_model_does_not_fit_in_host_memory() -> None:
    script = ROOT / "examples" / "train_llama.py"
    args = ["--model", "0.9b", "--seq-len", "64", "--batch-size", "1", "--steps", "1"]
    run = [sys.executable, "-m", "accelfn.cli.main", "dry-run", "--no-search", "--host-memory-gib", "16"]
    host = subprocess.run([*run, str(script), *args], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert host.returncode == 3, host.stdout + host.stderr[-3000:]
    assert "per node" in host.stdout and "DOES NOT FIT" in host.stdout
    meta = subprocess.run([*run, str(script), *args, "--init", "meta"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)  # fmt: skip
    assert meta.returncode == 0, meta.stdout + meta.stderr[-3000:]
