"""`af.dry_run` on every script in examples/, unmodified, at 8-64 fake ranks with tiny arguments; scripts with
several step objects (a GAN's two, a pretraining then a LoRA phase, bf16 then fp8); `rank="worst"` over
pipeline stages; wrong configurations at 64 ranks giving the real run's error in seconds.

examples/train_llama.py and examples/long_context.py run in tests/test_dry_run.py (every strategy at scale,
context parallel at 64 ranks); they are not repeated here."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import accelfn as af
from accelfn import mesh as _mesh
from accelfn.dryrun.report import Report
from accelfn.dryrun.run import rank_candidates
from tests._launch import ROOT

EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))
# their dry runs are tested in test_dry_run.py and test_expert_parallel.py
COVERED_ELSEWHERE = {"train_llama.py", "long_context.py", "train_moe.py"}
INFERENCE = {"big_model_inference.py", "distributed_inference.py"}


@pytest.fixture(autouse=True)
def _no_process_group() -> None:
    _mesh.destroy_process_group()  # a dry run starts its own (fake) one


def _bytes(model: nn.Module) -> int:
    """The model's parameter bytes (tied parameters once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _fsdp_bytes(model: nn.Module, n: int) -> int:
    """Rank 0's bytes of the model's parameters sharded over `n` ranks along dim 0 (FSDP2: `torch.chunk`, so
    the first ranks hold ceil(rows / n) rows)."""
    return sum(
        math.ceil(p.shape[0] / n) * (p.numel() // p.shape[0]) * p.element_size() for p in model.parameters()
    )


def _axes(report: Report | dict[str, Any]) -> set[tuple[str, str]]:
    comm = report.comm if isinstance(report, Report) else report["comm"]
    return {(kind, axis) for kind, by in comm.items() for axis in by}


def _tiny_llama() -> nn.Module:
    from fp8_training import tiny_llama

    return tiny_llama(0)


# ---- the checks, one per script ----------------------------------------------------------------------------
def _train_lm(r: Report, tmp: Path) -> None:
    from train_lm import TinyGPT

    assert r.per_rank["params"] == _bytes(TinyGPT(64, 1, seq_len=32))  # ddp: the whole model on each rank
    assert r.per_rank["grads"] == r.per_rank["params"]
    assert _axes(r) == {("all_reduce", "dp")}
    assert any("trackers.open" in s for s in r.skipped) and not list(tmp.iterdir())


def _gan_models() -> tuple[nn.Module, nn.Module]:  # as examples/gan.py builds them
    g = nn.Sequential(
        nn.Linear(4, 32), nn.LeakyReLU(0.2), nn.Linear(32, 32), nn.LeakyReLU(0.2), nn.Linear(32, 2)
    )
    d = nn.Sequential(
        nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1)
    )
    return g, d


def _gan(r: Report, tmp: Path) -> None:
    g, d = _gan_models()
    first, second = r.step_objects  # the discriminator's step is called first
    assert "d_loss" in first["strategy"] and "g_loss" in second["strategy"]
    assert first["per_rank"]["params"] == _fsdp_bytes(d, 16)  # uneven: a 2-row weight over 16 ranks
    assert second["per_rank"]["params"] == _fsdp_bytes(g, 16)
    # both states live through the loop: each step's peak counts the other's params and Adam moments
    assert first["per_rank"]["other_states"] >= 3 * _fsdp_bytes(g, 16)
    assert second["per_rank"]["other_states"] >= 3 * _fsdp_bytes(d, 16)
    assert r.per_rank["params"] == _fsdp_bytes(d, 16) + _fsdp_bytes(g, 16)
    assert r.per_rank["peak"] == max(s["per_rank"]["peak_with_other_states"] for s in r.step_objects)
    # one loop iteration trains both: the headline sums them
    assert [s["per_iteration"] for s in r.step_objects] == [1, 1]
    assert r.flops_per_step == first["flops_per_step"] + second["flops_per_step"] > 0
    for kind in ("all_gather", "reduce_scatter"):
        counts = [s["comm"][kind]["dp"]["count"] for s in r.step_objects]
        assert r.comm[kind]["dp"]["count"] == sum(counts) and min(counts) > 0
    assert r.total_bus_bytes == sum(s["total_bus_bytes"] for s in r.step_objects)


def _checkpoint_resume(r: Report, tmp: Path) -> None:
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 1))
    assert r.per_rank["params"] == _bytes(model) == 2564
    assert _axes(r) == {("all_reduce", "dp")}
    assert any("checkpoint.save" in s for s in r.skipped) and not list(tmp.iterdir())


def _lora(r: Report, tmp: Path) -> None:
    from lora_finetune import make_base
    from peft import LoraConfig, get_peft_model

    base = make_base(64)
    base_bytes = _bytes(base)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets))
    adapter = sum(p.numel() * 4 for n, p in peft.named_parameters() if "lora_" in n)
    pretrain, lora = r.step_objects
    assert "shard" not in pretrain["strategy"] and "shard(ddp" in lora["strategy"]
    assert pretrain["per_rank"]["params"] == base_bytes  # unsharded full training
    assert lora["per_rank"]["params"] == _bytes(peft) == base_bytes + adapter  # ddp: base + adapter
    assert adapter * 2 <= lora["per_rank"]["optimizer"] <= adapter * 2 + 64  # moments of the adapter only
    assert pretrain["per_rank"]["optimizer"] >= 2 * base_bytes
    # the LoRA step is the loop; the pretraining phase is measured too (step=2 skipped its second call)
    assert [s["per_iteration"] for s in r.step_objects] == [0, 1]
    assert (pretrain["calls"], pretrain["measured"], pretrain["skipped"]) == (2, 1, 1)
    assert r.comm == lora["comm"] and _axes(r) >= {("all_reduce", "dp")}
    assert r.flops_per_step == lora["flops_per_step"]
    assert any("skipped" in n and "step object 1" in n for n in r.notes)
    assert not list(tmp.iterdir())  # save_adapter skipped


def _seq_classification(r: Report, tmp: Path) -> None:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=257, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=17, num_labels=2)  # fmt: skip
    assert r.per_rank["params"] == _bytes(BertForSequenceClassification(config))
    assert ("all_reduce", "dp") in _axes(r)


def _fp8_training(r: Report, tmp: Path) -> None:
    assert "autocast_fp8" in r.strategy and "shard(fsdp" in r.strategy
    full = _bytes(_tiny_llama())
    assert r.per_rank["params"] == full // 64 == _fsdp_bytes(_tiny_llama(), 64)  # every dim divides by 64
    assert _axes(r) >= {("all_gather", "dp"), ("reduce_scatter", "dp")}


def _bf16_vs_fp8(r: Report, tmp: Path) -> None:
    bf16, fp8 = r.step_objects
    assert "autocast_fp8" not in bf16["strategy"] and "autocast_fp8" in fp8["strategy"]
    assert bf16["per_rank"]["params"] == fp8["per_rank"]["params"] == _bytes(_tiny_llama())  # ddp
    assert [s["per_iteration"] for s in r.step_objects] == [0, 1]
    assert r.flops_per_step == fp8["flops_per_step"] > 0 and ("all_reduce", "dp") in _axes(r)


def _small_mlp() -> nn.Module:  # examples/early_stopping.py's and local_sgd.py's make_model
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def _early_stopping(r: Report, tmp: Path) -> None:
    assert r.per_rank["params"] == _bytes(_small_mlp()) == 1284
    assert _axes(r) == {("all_reduce", "dp")}


def _local_sgd(r: Report, tmp: Path) -> None:
    assert "local_sgd" in r.strategy and "accumulate(2)" in r.strategy
    assert r.per_rank["params"] == r.per_rank["grads"] == _bytes(_small_mlp())  # a whole replica per rank
    assert _axes(r) == {("all_reduce", "dp")}  # the averaging (the dry run measures a step that averages)


# script, its arguments ({tmp}: a fresh folder), nproc_per_node, nnodes, dry_run keywords, check
CASES: list[tuple[str, tuple[str, ...], int, int, dict[str, Any], Callable[[Report, Path], None]]] = [
    ("train_lm.py", ("--steps", "3", "--d-model", "64", "--layers", "1", "--seq-len", "32",
                     "--batch-size", "2", "--run-dir", "{tmp}"), 8, 8, {}, _train_lm),
    ("gan.py", ("--steps", "3", "--strategy", "fsdp"), 8, 2, {}, _gan),
    ("checkpoint_resume.py", ("--run-dir", "{tmp}", "--epochs", "1", "--batch-size", "2"), 8, 1, {},
     _checkpoint_resume),
    ("lora_finetune.py", ("--pretrain-steps", "2", "--steps", "2", "--out", "{tmp}"), 8, 1, {"step": 2},
     _lora),
    ("seq_classification.py", ("--steps", "12",), 8, 2, {}, _seq_classification),
    ("fp8_training.py", ("--setting", "fsdp", "--steps", "2"), 8, 8, {}, _fp8_training),
    ("bf16_vs_fp8.py", ("--steps", "2",), 8, 2, {"step": 2}, _bf16_vs_fp8),
    ("early_stopping.py", ("--batch-size", "4"), 8, 4, {}, _early_stopping),
    ("local_sgd.py", ("--batch-size", "4"), 8, 4, {}, _local_sgd),
]  # fmt: skip


def test_every_example_is_covered() -> None:
    scripts = {p.name for p in EXAMPLES.glob("*.py")}
    assert scripts == {c[0] for c in CASES} | COVERED_ELSEWHERE | INFERENCE


@pytest.mark.parametrize("script, args, nproc, nnodes, kwargs, check", CASES, ids=[c[0] for c in CASES])
def test_example_runs_unmodified_in_the_dry_run(
    tmp_path: Path,
    script: str,
    args: tuple[str, ...],
    nproc: int,
    nnodes: int,
    kwargs: dict[str, Any],
    check: Callable[[Report, Path], None],
) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    report = af.dry_run(EXAMPLES / script, argv, nproc_per_node=nproc, nnodes=nnodes, device="cpu",
                        search=False, **kwargs)  # fmt: skip
    assert report.world_size == nproc * nnodes and report.mesh == {"dp": nproc * nnodes}
    assert report.per_rank["params"] > 0 and report.flops_per_step > 0 and report.total_bus_bytes > 0
    assert report.per_rank["peak"] >= report.per_rank["params"] + report.per_rank["optimizer"]
    check(report, tmp_path)
    assert not torch.distributed.is_initialized()


def test_a_script_refusing_its_command_line_is_quoted(tmp_path) -> None:
    """argparse's exit (2) before the first step: the error says what status 2 means and quotes the script's
    usage message (the planner's workers do not show the script's stderr), not "inference only"."""
    script = tmp_path / "needs_data.py"
    script.write_text(
        "import argparse\np = argparse.ArgumentParser()\np.add_argument('--data', required=True)\np.parse_args()\n"
    )
    with pytest.raises(RuntimeError) as info:
        af.dry_run(script, [], nproc_per_node=2, device="cpu")
    text = str(info.value)
    assert "exited (2) before its first training step (status 2: argparse's" in text, text
    assert "the following arguments are required: --data" in text and "inference only" not in text, text


def test_inference_scripts_are_a_clear_error() -> None:
    """Inference-only scripts train nothing: the dry run says so (their own checks read fake values)."""
    with pytest.raises(RuntimeError, match=r"exited \(1\) before its first training step.*inference only"):
        af.dry_run(EXAMPLES / "distributed_inference.py", nproc_per_node=8, device="cpu")
    with pytest.raises(Exception) as info:  # noqa: PT011 - the script's own error, with the dry run's note
        af.dry_run(EXAMPLES / "big_model_inference.py", nproc_per_node=8, device="cpu")
    assert any("before the script's first training step" in n for n in getattr(info.value, "__notes__", []))


def test_a_later_phase_needs_step_n() -> None:
    """Without `step=`, the dry run stops when the pretraining loop comes round: the LoRA phase is never
    reached; the report says the step is unsharded and how to measure the next one."""
    report = af.dry_run(EXAMPLES / "lora_finetune.py", ["--pretrain-steps", "3"], nproc_per_node=8,
                        device="cpu", search=False)  # fmt: skip
    assert len(report.step_objects) == 1 and "shard" not in report.strategy
    assert any("--step 2" in n for n in report.notes)

    def two_steps() -> None:
        mesh = af.Mesh({"dp": -1})
        for _ in range(2):
            step = af.shard(af.train_step(lambda m, b: af.losses.mse(m(b), b), af.optim.sgd(0.1)), mesh)
            state = step.init(nn.Linear(8, 8))
            for _ in range(3):
                state, _ = step(state, torch.zeros(4, 8))

    with pytest.raises(
        RuntimeError, match="step=3, but the script had called 2 step object.*when the script ended"
    ):
        af.dry_run(two_steps, nproc_per_node=8, device="cpu", search=False, step=3)
    report = af.dry_run(two_steps, nproc_per_node=8, device="cpu", search=False, step=2)
    # the 2nd step object's calls after its first are in an inner loop (the phase loop around it): not run,
    # and the script stopped where that loop ends
    assert [(s["calls"], s["skipped"], s["repeated"], s["per_iteration"]) for s in report.step_objects] == [
        (3, 2, 0, 0),
        (3, 0, 2, 1),
    ]


# ---- --rank worst ------------------------------------------------------------------------------------------
def test_rank_candidates_cover_every_stage_and_both_ends_of_uneven_axes() -> None:
    assert rank_candidates({"dp": 4}, set(), 4) == [0, 2, 3]
    assert rank_candidates({"pp": 4, "dp": 16}, set(), 64) == [0, 16, 32, 48, 63]
    # uneven shards over a flattened dp x fsdp group: both ends of each axis, in every stage
    assert rank_candidates({"pp": 2, "dp": 2, "fsdp": 4}, {"dp_fsdp"}, 16) == [0, 3, 4, 7, 8, 11, 12, 15]
    assert rank_candidates({"world": 8}, set(), 8) == [0, 4, 7]


def _llama(layers: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         use_cache=False, attn_implementation="sdpa")  # fmt: skip
    return LlamaForCausalLM(config)


def test_rank_worst_runs_every_pipeline_stage() -> None:
    def loss(model: nn.Module, b: dict[str, torch.Tensor]) -> af.Loss:
        return af.losses.cross_entropy(model(input_ids=b["input_ids"]).logits, b["labels"])

    def main() -> None:
        mesh = af.Mesh({"pp": 4, "dp": 2})
        step = af.pipeline(af.train_step(loss, af.optim.adamw(1e-3)), mesh, microbatches=4)
        step = af.shard(step, mesh, strategy="fsdp")
        state = step.init(_llama(4))
        ids = torch.zeros(4, 32, dtype=torch.long)
        for _ in range(2):
            state, _ = step(state, {"input_ids": ids, "labels": ids})

    report = af.dry_run(main, nproc_per_node=8, device="cpu", rank="worst", search=False)
    assert report.mesh == {"pp": 4, "dp": 2}
    assert {r // 2 for r in report.ranks_tried} == {0, 1, 2, 3}  # a rank of each stage
    assert report.ranks_tried == [0, 2, 4, 6, 7] and report.rank in report.ranks_tried


def test_rank_worst_searches_the_micro_batch_on_the_worst_rank() -> None:
    report = af.dry_run(EXAMPLES / "gan.py", ["--steps", "3"], nproc_per_node=16, device="cpu", gpu="l4",
                        rank="worst")  # fmt: skip
    assert report.ranks_tried == [0, 8, 15] and report.fits
    assert report.micro_batch == 64 and report.max_micro_batch is not None and report.max_micro_batch > 64


# ---- wrong configurations at 64 ranks: the real run's error, in seconds ------------------------------------
def _tp_plan_typo() -> None:
    from train_llama import build, loss_fn

    mesh = af.Mesh({"dp": 32, "tp": 2})
    plan = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.qkv_proj": "colwise"}
    step = af.shard(af.train_step(loss_fn, af.optim.adamw(1e-3)), mesh, tp_plan=plan)
    state = step.init(build("tiny", 128))
    step(state, torch.zeros(2, 129, dtype=torch.long))


def _mixed_dtype_unit() -> None:  # a bf16 weight beside an fp32 bias, both trainable, under fsdp
    mesh = af.Mesh({"dp": -1})
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    model[2].weight.data = model[2].weight.data.to(torch.bfloat16)
    step = af.shard(
        af.train_step(lambda m, b: af.losses.mse(m(b), b), af.optim.adamw(1e-3)), mesh, strategy="fsdp"
    )
    state = step.init(model)
    step(state, torch.zeros(4, 64))


def _state_of_wrong_dtype() -> None:  # the state's params cast to bf16, the batch fp32, no autocast
    mesh = af.Mesh({"dp": -1})
    step = af.shard(af.train_step(lambda m, b: af.losses.mse(m(b), b), af.optim.adamw(1e-3)), mesh)
    state = step.init(nn.Linear(64, 64))
    state = state.replace(params={k: v.to(torch.bfloat16) for k, v in state.params.items()})
    step(state, torch.zeros(4, 64))


def _state_of_another_step() -> None:  # a state placed on the wrong step
    mesh = af.Mesh({"dp": -1})

    def make() -> af.Step:
        return af.shard(af.train_step(lambda m, b: af.losses.mse(m(b), b), af.optim.adamw(1e-3)), mesh)

    a, b = make(), make()
    state_a = a.init(nn.Linear(64, 64))
    b.init(nn.Linear(64, 64))
    b(state_a, torch.zeros(4, 64))


WRONG = [
    (_tp_plan_typo, ValueError, r"tp_plan entry 'model.layers.\*.self_attn.qkv_proj' matches no module"),
    (_mixed_dtype_unit, ValueError, r"module '2' has trainable params of dtypes"),
    (_state_of_wrong_dtype, RuntimeError, r"mat1 and mat2 must have the same dtype"),
    (_state_of_another_step, ValueError, r"this state belongs to another training step"),
]


@pytest.mark.parametrize("main, error, message", WRONG, ids=[w[0].__name__.strip("_") for w in WRONG])
def test_wrong_configuration_at_64_ranks_gives_the_real_error(
    main: Callable[[], None], error: type[Exception], message: str
) -> None:
    """The dry run at 64 fake ranks raises what a real run raises (here one real process, where the mesh
    axes have size 1: the tp case needs none of the model's sizes to divide), same type and message. The
    fake kernels of matrix products do not check dtypes (torch 2.13): the dry run checks them itself."""
    start = time.perf_counter()
    with pytest.raises(error, match=message) as dry:
        af.dry_run(main, nproc_per_node=8, nnodes=8, device="cpu", search=False)
    assert time.perf_counter() - start < 30
    assert not torch.distributed.is_initialized()
    if main is _tp_plan_typo:  # needs a tp axis: a real world of 2 is not run here (gloo processes)
        return
    with pytest.raises(error) as real:
        main()
    _mesh.destroy_process_group()
    assert str(dry.value) == str(real.value)
