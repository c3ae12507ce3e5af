"""Pretrain a Llama-architecture model (a `transformers` config, no weights downloaded) on random tokens, with
any mix of fsdp / hsdp / ddp, tensor, context and pipeline parallel, remat, compile, bf16 and fp8: the script
`accelfn dry-run` checks at full scale before the job is queued.

    accelfn launch --nproc-per-node 2 --cpu examples/train_llama.py --model tiny --steps 5
    accelfn launch --nproc-per-node 4 --cpu --mesh pp=2,dp=2 examples/train_llama.py
    accelfn launch --nproc-per-node 4 --cpu --mesh dp=2,tp=2 examples/train_llama.py --remat selective
    accelfn launch --nproc-per-node 4 --cpu --mesh dp=2,cp=2 examples/train_llama.py --remat full
    accelfn launch --nproc-per-node 2 --cpu examples/train_llama.py --model tiny --remat full:2
    accelfn dry-run --nproc-per-node 8 --nnodes 8 examples/train_llama.py --model 8b --strategy fsdp
    accelfn dry-run --nproc-per-node 8 --nnodes 8 --mesh dp=8,tp=8 examples/train_llama.py --model 70b --remat --init meta
    accelfn dry-run --nproc-per-node 8 --nnodes 16 --mesh pp=4,dp=4,tp=8 examples/train_llama.py --model 405b --init meta

The mesh comes from `--mesh` (here or `accelfn launch/dry-run --mesh`): `dp=-1` (default), `dp=8,tp=8`,
`dp=2,fsdp=-1` (hsdp), `pp=2,dp=2`, `dp=2,cp=2`. A `tp` axis splits the layers with the model's own plan, with
sequence parallel and the loss on vocabulary shards (the default; `--no-sequence-parallel`,
`--no-loss-parallel` turn them off); a `cp` axis splits each sequence (labels aligned with the inputs); a `pp`
axis cuts the model into stages, fed one sequence per micro-batch (torchtitan's default; `--microbatches`).
The sizes of `--model` are Llama 3's (8b, 70b, 405b), the 0.89B model of docs/benchmarks.md (`0.9b`) and a
tiny one for CPU runs; `--layers N` keeps a size's layer shapes with N layers (cheap dry runs). `--fp8` trains the
decoder's Linears in fp8 with torchao's tensorwise scaling (fp8 all-gathers under fsdp), `--fp8 --fp8-recipe
rowwise` with its rowwise scaling.
"""

from __future__ import annotations

import argparse
import contextlib

import torch

import accelfn as af
from accelfn.launch_env import knob, parse_mesh, remat_args, remat_flag

MODELS = {  # hidden, intermediate, layers, heads, kv heads, vocabulary
    "tiny": (128, 344, 2, 4, 2, 1024),
    "0.9b": (2048, 5632, 16, 16, 8, 32000),
    "8b": (4096, 14336, 32, 32, 8, 128256),
    "70b": (8192, 28672, 80, 64, 8, 128256),
    "405b": (16384, 53248, 126, 128, 8, 128256),
}


def build(name: str, seq_len: int, n_layers: int | None = None) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, intermediate, layers, heads, kv_heads, vocab = MODELS[name]
    layers = n_layers or layers
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=seq_len,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


LOSS_IMPL = "auto"  # --loss: af.losses.cross_entropy's impl


def loss_fn(model: torch.nn.Module, batch: torch.Tensor | dict[str, torch.Tensor]) -> af.Loss:
    """Next-token cross entropy over token ids (shifted here), or over `{"input_ids", "labels"}` whose labels are
    already aligned with the inputs (what context parallel needs: each rank holds a part of every sequence)."""
    impl = LOSS_IMPL
    if isinstance(batch, dict):
        return af.losses.cross_entropy(model(input_ids=batch["input_ids"]).logits, batch["labels"], impl=impl)
    return af.losses.cross_entropy(model(input_ids=batch).logits[:, :-1], batch[:, 1:], impl=impl)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="decoder layers (default: the model's): its shapes, fewer layers",
    )
    p.add_argument("--steps", type=int, default=10)
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="sequences per data-parallel rank and step (default 2, or the pp size when larger)",
    )
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument(
        "--mesh",
        default=None,
        help="the mesh, e.g. dp=8,tp=8 or pp=2,dp=2 or dp=2,cp=2 (default: the launcher's)",
    )
    # "auto" (the default of the knobs below): the launch config's choice (`accelfn plan --write`), else the
    # default named in the help
    p.add_argument("--strategy", choices=("ddp", "fsdp", "hsdp", "auto"), default="auto", help="default fsdp")
    p.add_argument(
        "--remat",
        nargs="?",
        const="full",
        default="auto",
        type=remat_flag,
        metavar="{none,selective,full,POLICY:N,auto}",
        help="recompute decoder layers in the backward pass: full (`--remat` alone), selective (torchtitan's "
        "op-level policy), none (the default); POLICY:N on every n-th layer only (layers n, 2n, ...), e.g. "
        "full:2 (torchtitan's selective_ac_option=2)",
    )
    p.add_argument(
        "--compile",
        nargs="?",
        const="step",
        default="auto",
        choices=("step", "blocks", "none", "auto"),
        help="torch.compile the step (af.compile; `--compile` alone), or each decoder layer (blocks, as "
        "torchtitan), or nothing (the default)",
    )
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (fp32 master weights)")
    p.add_argument(
        "--fp8",
        action="store_true",
        help="fp8 matmuls in the decoder layers (af.autocast_fp8; emulated on CPU)",
    )
    p.add_argument(
        "--fp8-recipe",
        choices=("tensorwise", "rowwise"),
        default="tensorwise",
        help="with --fp8: torchao's scaling recipe, one scale per tensor (the default; fp8 all-gathers under "
        "fsdp) or per row (torchao's rowwise: finer scales, costlier casts, weights all-gathered in bf16 under --bf16)",
    )
    p.add_argument(
        "--sequence-parallel",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with a tp axis: keep the residual stream split over the sequence (default: on, as torchtitan)",
    )
    p.add_argument(
        "--loss-parallel",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with a tp axis: the loss on the logits' vocabulary shards (default: on, as torchtitan)",
    )
    p.add_argument(
        "--loss",
        choices=("auto", "chunked", "plain"),
        default="auto",
        help="the cross entropy: chunked where exact (auto, the default) or plain F.cross_entropy on fp32 logits "
        "(torchtitan's of 2024-12: three fp32 copies of the logits at its peak)",
    )
    p.add_argument("--accumulate", default="auto", help="micro-batches per step (default 1)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--schedule", default="auto", help="pipeline schedule, with a pp axis (default 1f1b)")
    p.add_argument(
        "--microbatches",
        default="auto",
        help="pipeline micro-batches per step, with a pp axis (default: one sequence each)",
    )
    p.add_argument(
        "--pp-sync-each-microbatch",
        action=argparse.BooleanOptionalAction,
        default="auto",
        help="with a pp axis under fsdp/hsdp: reduce-scatter each micro-batch's gradients (af.pipeline's "
        "sync_each_microbatch; default off: the stage's unsharded gradients are held for the step)",
    )
    p.add_argument(
        "--init",
        choices=("host", "meta"),
        default="host",
        help="where the model is built: on the host (every rank holds it whole until step.init), or on the meta "
        "device (no memory: step.init shards it, then allocates and initialises this rank's shards only)",
    )
    args = p.parse_args()
    if args.fp8_recipe != "tensorwise" and not args.fp8:
        p.error(f"--fp8-recipe {args.fp8_recipe} needs --fp8")
    global LOSS_IMPL
    LOSS_IMPL = args.loss

    torch.manual_seed(0)
    axes = parse_mesh(args.mesh, source="--mesh") if args.mesh else {}
    mesh = af.Mesh.from_env(
        **axes
    )  # else `--mesh` of accelfn launch / dry-run; {"dp": world size} by default
    pp = mesh.axis_size("pp") if "pp" in mesh.axis_names else 1
    strategy = knob("strategy", args.strategy, "fsdp")
    remat = knob("remat", args.remat, "none")
    compiled = knob("compile", args.compile, "none")
    accumulate = int(knob("accumulate", args.accumulate, 1))
    schedule = knob("pipeline_schedule", args.schedule, "1f1b")
    microbatches = knob("pipeline_microbatches", args.microbatches, None)
    sync_each = knob("pipeline_sync_each_microbatch", args.pp_sync_each_microbatch, False)
    global_batch = knob("global_batch_size", "auto", None) if args.batch_size is None else None
    if global_batch is not None:  # the launch config's global batch: this rank's share of it
        if int(global_batch) % mesh.data_size:
            raise SystemExit(
                f"global batch {global_batch} does not split over {mesh.data_size} data-parallel ranks"
            )
        args.batch_size = int(global_batch) // mesh.data_size
    batch_size = args.batch_size or max(2, pp)  # a 1F1B pipeline needs a micro-batch per stage
    with af.init_empty() if args.init == "meta" else contextlib.nullcontext():
        model = build(args.model, args.seq_len, args.layers)
    step = af.train_step(loss_fn, af.optim.adamw(args.lr, weight_decay=0.1), clip_grad_norm=1.0)
    if args.fp8:  # the embeddings and the head stay in bf16/fp32, as torchtitan keeps its output layer
        rowwise = args.fp8_recipe == "rowwise"  # torchao's recipe (Transformer Engine has no rowwise)
        step = af.autocast_fp8(
            step,
            backend="torchao" if rowwise else "auto",
            recipe="rowwise" if rowwise else None,
            module_filter=lambda m, fqn: ".layers." in fqn,
            # emulated on a CPU run; a dry run of a GPU job lowers the fp8 matmuls as on the GPU
            emulate=mesh.device.type == "cpu" and not af.dry_mode.models_a_device(),
        )
    if args.bf16:
        step = af.autocast(step, torch.bfloat16)
    if remat != "none":
        step = af.remat(step, **remat_args(remat))
    if accumulate > 1:
        step = af.accumulate(step, accumulate)
    if pp > 1:  # pipeline parallel: every rank of a pipeline reads the same batch
        microbatches = int(microbatches or batch_size // accumulate)
        step = af.pipeline(
            step, mesh, microbatches=microbatches, schedule=schedule, sync_each_microbatch=sync_each
        )
    step = af.shard(
        step,
        mesh,
        strategy=strategy,
        sequence_parallel=args.sequence_parallel,
        loss_parallel=args.loss_parallel,
    )
    if compiled != "none":
        step = af.compile(step, regions="blocks" if compiled == "blocks" else None)
    state = step.init(model)
    af.dist.print(step)

    vocab = MODELS[args.model][5]
    cp = "cp" in mesh.axis_names and mesh.axis_size("cp") > 1
    gen = torch.Generator().manual_seed(mesh.data_rank)
    for i in af.progress(range(args.steps), desc="train"):
        ids = torch.randint(0, vocab, (batch_size, args.seq_len + 1), generator=gen)
        batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]} if cp else ids
        state, metrics = step(state, batch)
        af.dist.print(f"step {i + 1}: loss {metrics['loss'].item():.3f}")


if __name__ == "__main__":
    main()
