"""`accelfn dry-run` (what `accelfn plan` measures each candidate with) on a user's `transformers` script of other
architectures than Llama (tests/workers/plan_architectures.py): GPT-2 (Conv1D layers, tied embeddings, attention
dropout), a BERT encoder trained as a masked LM (attention dropout, no causal mask), Gemma-2 (sliding and full
attention alternating, eager attention) and a Llama of one layer. On 8 fake ranks of an H100 job: the dry run
succeeds, finds the model's blocks (the planner's `keep_blocks`, what `af.compile(regions="blocks")`, `af.shard`'s
FSDP and the layer extrapolation use), and counts the FLOPs torch's FlopCounterMode counts on the same model and
batch in plain PyTorch. A few seconds each.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import accelfn as af
from accelfn.planner.extrapolate import keep_blocks

pytest.importorskip("transformers")

SCRIPT = Path(__file__).parent / "workers" / "plan_architectures.py"
SEQ, BATCH, LAYERS = 64, 2, 4  # per rank: the script's default global batch is 2 per data-parallel rank
FIXED = [
    "--strategy",
    "fsdp",
    "--remat",
    "none",
    "--accumulate",
    "1",
    "--offload",
    "none",
    "--compile",
    "none",
]


def _worker() -> Any:
    spec = importlib.util.spec_from_file_location("plan_architectures", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference_flops(name: str) -> tuple[int, int]:
    """FlopCounterMode's count of one training step (forward and backward) of the script's model on one rank's
    batch, in plain PyTorch with eager attention (whose matmuls torch counts on the CPU), and the FLOPs SDPA's
    fused backward adds for each of the model's SDPA calls: it recomputes the scores, five matmuls where eager
    autograd's backward runs four (torch's `sdpa_backward_flop_count`), 2 x B x L x L x hidden more."""
    worker = _worker()
    hidden, heads, vocab = worker.SIZES["tiny"]
    torch.manual_seed(0)
    model = worker.build(name, hidden, heads, LAYERS, vocab, SEQ)
    sdpa = model.config._attn_implementation == "sdpa"
    model.set_attn_implementation("eager")
    ids = torch.randint(4, vocab, (BATCH, SEQ))
    with FlopCounterMode(display=False) as counter:
        logits = model(input_ids=ids).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    layers = model.config.num_hidden_layers
    recompute = layers * 2 * BATCH * SEQ * SEQ * hidden if sdpa else 0
    return counter.get_total_flops(), recompute


@pytest.mark.parametrize("name", ["gpt2", "gpt2:compiled", "bert", "gemma2", "llama1"])
def test_a_users_transformers_script_dry_runs_with_its_blocks_and_flops(name: str) -> None:
    """`gpt2:compiled`: with `--compile blocks`, each block's forward and backward traced and partitioned
    (accelfn/dryrun/compiled.py): the attention with dropout in the trace is SDPA's kernel too."""
    name, _, compiled = name.partition(":")
    args = ["--model", name, "--seq-len", str(SEQ), "--steps", "1", *FIXED]
    if compiled:
        args[args.index("--compile") + 1] = "blocks"
    seen: dict[str, Any] = {}
    report = af.dry_run(SCRIPT, args, nproc_per_node=8, gpu="h100-sxm", search=False,
                        on_model=keep_blocks(None, seen))  # fmt: skip
    layers = 1 if name == "llama1" else LAYERS
    assert report.fits and report.world_size == 8
    # the blocks found are the model's layers: one for the 1-layer Llama (found none: "0/0 blocks" before), and
    # FSDP shards them one by one
    assert seen["blocks"] == layers
    assert f"fsdp over 8 ranks ({layers} blocks + root sharded)" in report.strategy
    ref, recompute = _reference_flops(name)
    assert report.flops_per_step == ref + recompute, (report.flops_per_step, ref, recompute)
    # attention ran as the GPU's SDPA kernel (GPT-2's and BERT's with dropout too: not the CPU's math path,
    # whose scores and probabilities the GPU never holds); Gemma-2's eager attention is matmuls
    seconds = report.predicted.assumes["compute_by_kind_s"]
    assert (seconds["attention"] > 0) == (name != "gemma2")


def test_ddp_over_tensor_parallel_broadcasts_a_gemmas_buffers_dtensor_or_not() -> None:
    """Gemma's scaled embedding holds a buffer (`embed_scale`) that tensor parallel makes a DTensor, beside the
    rotary embeddings' plain `inv_freq`: DDP's broadcast of the buffers over dp (torch DDP's
    `broadcast_buffers`) joined both in one `torch.cat` and failed (mixed torch.Tensor and DTensor; every plan
    candidate of Gemma-2/3 with a tp axis under ddp). Each is broadcast as its local tensor: all of them, in
    float64, from the dp group's first rank."""
    worker = _worker()
    hidden, heads, vocab = worker.SIZES["tiny"]
    model = worker.build("gemma3", hidden, heads, LAYERS, vocab, SEQ)
    args = ["--model", "gemma3", "--seq-len", str(SEQ), "--steps", "1", *FIXED]
    args[args.index("fsdp")] = "ddp"
    report = af.dry_run(SCRIPT, args, nproc_per_node=8, gpu="h100-sxm", mesh="dp=4,tp=2", search=False)
    assert report.mesh == {"dp": 4, "tp": 2}
    broadcast = report.comm["broadcast"]["dp"]
    assert broadcast["group_size"] == 4
    assert broadcast["bytes"] == 8 * sum(b.numel() for b in model.buffers())  # embed_scale replicated over tp


def test_context_parallel_on_a_model_without_sdpa_names_the_model() -> None:
    """A cp axis switches a `transformers` model to SDPA attention; Gemma-2 has none (its soft-capping), and
    transformers' refusal named whisper-tiny and a GitHub issue. The error names the model and the cp axis."""
    args = ["--model", "gemma2", "--seq-len", str(SEQ), "--steps", "1", *FIXED]
    with pytest.raises(
        ValueError, match=r"context parallel: Gemma2ForCausalLM has no SDPA attention .*'eager'"
    ):
        af.dry_run(SCRIPT, args, nproc_per_node=8, gpu="h100-sxm", mesh="dp=4,cp=2", search=False)


def test_the_plan_of_a_one_block_model_does_not_search_remat_every_2nd_block() -> None:
    """`selective:2` checkpoints blocks 2, 4, ...: on a model of one block, none, the step of `remat=none`
    (searched before, and ranked first on a 0.01 MiB lower peak). It falls at legality, naming why; the
    policies on every block are still searched."""
    fixed = ["--model", "llama1", "--seq-len", str(SEQ), "--steps", "1", "--strategy", "ddp",
             "--accumulate", "1", "--offload", "none", "--compile", "none"]  # fmt: skip
    p = af.plan(SCRIPT, fixed, nproc_per_node=2, global_batch_size=4, axes=("dp",), workers=1)
    assert "remat" in p.open_knobs
    searched = {r.candidate.remat for r in p.rows}
    assert searched == {"none", "selective", "full"}, searched
    why = [f.reason for f in p.fallen if f.candidate.remat == "selective:2"]
    assert why and all(f.tier == "legality" for f in p.fallen if f.candidate.remat == "selective:2")
    assert "checkpoints blocks 2, 4, ... and the model has 1: the same step as remat=none" in why[0]
