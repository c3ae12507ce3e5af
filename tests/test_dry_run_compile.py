"""A compiled step's memory in the dry run (issue 31 item 5): each compiled block saves what torch's partitioner
saves, checked against a real Inductor-compiled block on CPU, and the dry run of a compiled step predicts it."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

import accelfn as af
from accelfn.dryrun.compiled import partition_block, saved_bytes
from tests._launch import ROOT

LLAMA = ROOT / "examples" / "train_llama.py"


def _layer() -> tuple[LlamaDecoderLayer, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    cfg = LlamaConfig(
        hidden_size=256, intermediate_size=688, num_attention_heads=4, num_key_value_heads=4, vocab_size=100
    )
    cfg._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(cfg, 0)
    x = torch.randn(2, 256, 256, requires_grad=True)
    return layer, x, LlamaRotaryEmbedding(cfg)(x, torch.arange(256)[None])


def _saved(layer: torch.nn.Module, x: torch.Tensor, pe: tuple[torch.Tensor, torch.Tensor]) -> int:
    with torch.autocast("cpu", torch.bfloat16):
        return saved_bytes(lambda: layer(x, position_embeddings=pe, attention_mask=None))


@pytest.mark.slow  # an Inductor compile on CPU: 40-60 s
def test_partitioned_block_saves_what_inductor_saves() -> None:
    # the reference: a real torch.compile (Inductor, CPU) of a Llama layer under bf16 autocast; the dry run's
    # partitioned graphs on fake tensors must save the same bytes for the backward, fewer than eager
    torch.manual_seed(0)
    layer, x, pe = _layer()
    eager = _saved(layer, x, pe)
    inductor = _saved(torch.compile(layer), x, pe)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake_layer, fake_x, fake_pe = _layer()
        assert partition_block(fake_layer)
        dry = _saved(fake_layer, fake_x, fake_pe)
    assert dry == inductor, (dry, inductor)
    assert dry < 0.8 * eager, (dry, eager)


def test_partitioned_block_computes_as_eager() -> None:
    # the partitioned graphs run the same ops: outputs and gradients equal eager's to fp32 round-off
    torch.manual_seed(0)
    layer, x, pe = _layer()
    out = layer(x, position_embeddings=pe, attention_mask=None)
    out = out[0] if isinstance(out, tuple) else out
    grads = torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])
    assert partition_block(layer)
    out2 = layer(x, position_embeddings=pe, attention_mask=None)
    out2 = out2[0] if isinstance(out2, tuple) else out2
    grads2 = torch.autograd.grad(out2.square().sum(), [x, *layer.parameters()])
    torch.testing.assert_close(out2, out, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads2, grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_dry_run_of_a_compiled_step_saves_less_and_keeps_flops() -> None:
    # the tiny Llama, one rank: af.compile's dry run holds fewer activations than eager (the partitioner
    # recomputes pointwise ops), the same FLOPs up to the recomputed pointwise ops, and under full remat the
    # checkpoint stays outermost (activations as eager's)
    def run(*extra: str) -> af.dryrun.Report:
        return af.dry_run(
            LLAMA, ["--model", "tiny", "--steps", "1", *extra], nproc_per_node=1, device="cpu", search=False
        )

    eager, compiled = run(), run("--compile")
    assert (
        compiled.per_rank["activations"] < 0.9 * eager.per_rank["activations"]
    )  # 0.86 measured: the loss is eager
    assert abs(compiled.flops_per_step - eager.flops_per_step) < 0.02 * eager.flops_per_step
    assert any("partitioned forward/backward graphs" in n for n in compiled.notes)
    full_eager, full_compiled = run("--remat", "full"), run("--remat", "full", "--compile")
    assert full_compiled.per_rank["activations"] <= full_eager.per_rank["activations"]


def test_dry_run_of_a_compiled_pipeline_stage_partitions_its_own_blocks() -> None:
    # af.compile with af.pipeline (per block, as torchtitan compiles its stages): the stage's own blocks run as
    # partitioned graphs (the other stage's stand-ins are not counted), holding less than the eager stage
    def run(*extra: str) -> af.dryrun.Report:
        args = [
            "--model",
            "tiny",
            "--steps",
            "1",
            "--strategy",
            "fsdp",
            "--batch-size",
            "4",
            "--microbatches",
            "2",
        ]
        return af.dry_run(
            LLAMA, [*args, *extra], nproc_per_node=8, device="cpu", mesh="pp=2,dp=4", search=False
        )

    eager, compiled = run(), run("--compile")
    assert "compile per block under a pipeline" not in eager.strategy
    assert "1/1 blocks as partitioned graphs" in compiled.strategy, compiled.strategy
    assert compiled.per_rank["activations"] < 0.95 * eager.per_rank["activations"]  # 0.90 measured


def test_dry_run_of_compiled_blocks_with_context_parallel() -> None:
    # compile per block on a dp=2,cp=2 mesh (fake ranks): the cp attention's causal mask is built inside each
    # traced block (it used to enter the graph as a fake constant, which AOTAutograd refuses), and the
    # partitioned blocks hold fewer activations than the eager ones, with the same FLOPs up to recomputation
    def run(*extra: str) -> af.dryrun.Report:
        args = ["--model", "tiny", "--steps", "1", "--strategy", "fsdp", *extra]
        return af.dry_run(LLAMA, args, nproc_per_node=4, device="cpu", mesh="dp=2,cp=2", search=False)

    eager, compiled = run(), run("--compile", "blocks")
    assert "2/2 blocks as partitioned graphs" in compiled.strategy, compiled.strategy
    assert "context parallel over cp=2" in compiled.strategy, compiled.strategy
    assert compiled.per_rank["activations"] < 0.95 * eager.per_rank["activations"]  # 0.86 measured
    assert abs(compiled.flops_per_step - eager.flops_per_step) < 0.02 * eager.flops_per_step


def test_cp_causal_mask_of_a_trace_is_not_kept() -> None:
    # the mask built while AOTAutograd traces a block is the trace's (a functional wrapper): it is not cached,
    # and the traced function computes what the eager one does; an eager call then caches a plain tensor
    from torch._functorch.aot_autograd import aot_function, make_boxed_func

    from accelfn.transforms.shard.context_parallel import _Runtime, causal_mask, chunk_positions

    rt = _Runtime(0, 2, None, local_len=4)  # type: ignore[arg-type]  # the mask needs no process group
    keys = torch.cat([chunk_positions(4, r, 2) for r in range(2)])
    ref = causal_mask(chunk_positions(4, 0, 2), keys)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x.masked_fill(~rt.causal_mask(x.device), 0.0)

    x = torch.randn(4, 8, requires_grad=True)
    traced = aot_function(fn, fw_compiler=lambda gm, _: make_boxed_func(gm))
    torch.testing.assert_close(traced(x), x.masked_fill(~ref, 0.0))
    assert not rt._masks, rt._masks
    torch.testing.assert_close(fn(x), x.masked_fill(~ref, 0.0))
    (kept,) = rt._masks.values()
    assert type(kept) is torch.Tensor and torch.equal(kept, ref)
