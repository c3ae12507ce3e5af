"""A small mixture of experts (a `transformers` Qwen3-MoE config, no weights) trained with expert parallelism:
each of the `ep` processes holds `experts / ep` experts of every MoE layer, reads its own rows (data-parallel for
the attention and embeddings) and sends each token to the ranks of its top-k experts by all-to-all.

    accelfn launch --nproc-per-node 2 --cpu --mesh ep=2 examples/train_moe.py
    accelfn launch --nproc-per-node 4 --cpu --mesh dp=2,ep=2 examples/train_moe.py
    python examples/train_moe.py                        # one process: every expert local
    accelfn dry-run --nproc-per-node 8 --nnodes 8 --gpu h100 --mesh fsdp=8,ep=8 examples/train_moe.py \\
        --model 235b-a22b --init meta --strategy fsdp --bf16 --remat --seq 4096 --batch-size 1
    accelfn dry-run --nproc-per-node 8 --nnodes 32 --gpu h100 --mesh fsdp=32,ep=8 examples/train_moe.py \\
        --model deepseek-v3 --init meta --strategy fsdp --bf16 --remat --seq 4096 --batch-size 1

`--model deepseek-v3` is a `transformers` DeepseekV3Config with DeepSeek-V3's sizes (671B: 61 layers, the first 3
dense, 256 routed experts and one shared, top-8 of 8 groups, MLA attention; its multi-token-prediction module is not
part of `transformers`' model); `--layers N` keeps a model's layer shapes with fewer layers (cheap dry runs).
The model's own plan (`config.base_model_ep_plan`) says which parameters are stacked over experts; the mesh
comes from `--mesh` (`af.Mesh.from_env()`). Ends with `CHECK moe loss falls: OK` (else FAILED, exit status 1).
`--strategy`, `--remat`, `--accumulate`, `--offload` default to "auto" (`accelfn.launch_env.knob`), and without
`--batch-size` the global batch is the launch config's too: `accelfn plan` chooses them with the mesh, `ep` included
(docs/plan.md), and `accelfn launch --config plan.yaml examples/train_moe.py` applies them.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

import torch
from transformers import (
    AttentionInterface,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

import accelfn as af
from accelfn.launch_env import knob, remat_args, remat_flag
from accelfn.moe.autocast_experts import grouped_mm_in_autocast_dtype

# Qwen3-MoE's published shapes (config.json on the hub), for dry runs at scale (`--init meta`)
MODELS = {
    "30b-a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                    num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                    num_experts=128, num_experts_per_tok=8),
    "235b-a22b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                      num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
                      num_experts=128, num_experts_per_tok=8),
    "deepseek-v3": {},  # DeepseekV3Config's defaults are DeepSeek-V3's published sizes (671B)
}  # fmt: skip


def _sdpa_padded(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA with the values padded to the queries' head dim, as `transformers` runs DeepSeek-V3's attention
    (keys 192, values 128) with FlashAttention: one fused kernel, where torch's CPU SDPA would fall back to its
    math path for unequal head dims (the scores materialised: not what an H100 runs)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    width = value.shape[-1]
    value = torch.nn.functional.pad(value, (0, query.shape[-1] - width))
    out, _ = sdpa_attention_forward(module, query, key, value, *args, **kwargs)
    return out[..., :width].contiguous(), None


def make_model(experts: int, seed: int, size: str = "tiny", layers: int | None = None) -> torch.nn.Module:
    """A Qwen3-MoE (`tiny`: `experts` experts; or a published shape of `MODELS`) or DeepSeek-V3 model;
    `layers` overrides the number of decoder layers (DeepSeek-V3 keeps up to 3 dense ones, at least one MoE)."""
    torch.manual_seed(seed)
    model: torch.nn.Module
    if size == "deepseek-v3":
        n = layers or DeepseekV3Config().num_hidden_layers
        AttentionInterface.register("sdpa_padded", _sdpa_padded)
        cfg: Any = DeepseekV3Config(
            num_hidden_layers=n, first_k_dense_replace=min(3, n - 1), max_position_embeddings=4096
        )
        model = DeepseekV3ForCausalLM(cfg)
        model.set_attn_implementation("sdpa_padded")
    else:
        shape = MODELS.get(size) or dict(
            vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=experts, num_experts_per_tok=2,
        )  # fmt: skip
        if layers:
            shape = {**shape, "num_hidden_layers": layers}
        cfg = Qwen3MoeConfig(**shape, max_position_embeddings=4096, tie_word_embeddings=False)
        model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # transformers zero-initialises the routers (it expects pretrained weights)
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0, 0.02)
    return model


def make_data(rows: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    """Sequences that count up by a per-row stride (mod 64): learnable next-token prediction (any vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    start, stride = torch.randint(0, 64, (rows, 1), generator=g), torch.randint(1, 4, (rows, 1), generator=g)
    return {"input_ids": (start + stride * torch.arange(seq)) % 64}


def _experts_for_the_device(model: torch.nn.Module, mesh: af.Mesh, bf16: bool) -> None:
    """Without an ep axis `transformers` runs the experts itself, by `torch._grouped_mm` where it can: on a GPU
    that kernel takes bf16 only, so fp32 experts there (or in a dry run modelling one) run it in autocast's
    dtype under `--bf16` (`accelfn.moe.autocast_experts`), else as its batched GEMMs (every row's expert
    weights gathered: small models only). With ep, accelfn's dispatcher picks the kernel (`accelfn.moe`)."""
    if "ep" in mesh.axis_names and mesh.axis_size("ep") > 1:
        return
    modelled = af.dry_mode.grouped_mm_dtypes()
    dtypes = modelled if modelled is not None else None
    if dtypes is None and mesh.device.type != "cpu":
        dtypes = mesh.platform.grouped_mm_dtypes()
    dtype = next(model.parameters()).dtype
    if dtypes is not None and dtype not in dtypes:
        if bf16 and torch.bfloat16 in dtypes:
            grouped_mm_in_autocast_dtype(model)
        else:
            model.set_experts_implementation("batched_mm")


def loss_fn(model, batch):
    ids = batch["input_ids"]
    return af.losses.cross_entropy(model(input_ids=ids).logits[:, :-1], ids[:, 1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=8, help="experts per MoE layer (a multiple of ep)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="rows per process per step (default 8, or the launch config's global batch over the data ranks)",
    )
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--model", choices=["tiny", *MODELS], default="tiny", help="Qwen3-MoE shape (tiny: --experts)"
    )
    # "auto" (the default of the knobs below): the launch config's choice (`accelfn plan --write`), else the
    # default named in the help
    p.add_argument(
        "--strategy",
        choices=["ddp", "fsdp", "hsdp", "auto"],
        default="auto",
        help="default ddp; fsdp, hsdp: experts sharded over efsdp",
    )
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    p.add_argument("--init", choices=["host", "meta"], default="host", help="meta: build on the meta device")
    p.add_argument("--seq", type=int, default=16, help="tokens per row")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (fp32 master weights)")
    p.add_argument(
        "--remat",
        nargs="?",
        const="full",
        default="auto",
        type=remat_flag,
        metavar="{none,selective,full,POLICY:N,auto}",
        help="recompute decoder layers in the backward: full (`--remat` alone), selective, none (default); "
        "POLICY:N on every n-th layer only (layers n, 2n, ...), e.g. full:2",
    )
    p.add_argument("--accumulate", default="auto", help="micro-batches per step (default 1)")
    p.add_argument(
        "--offload", choices=["none", "optimizer", "auto"], default="auto", help="optimizer state on the host"
    )
    args = p.parse_args()

    with af.Mesh.from_env(device="cpu") as mesh:
        strategy = knob("strategy", args.strategy, "ddp")
        remat = knob("remat", args.remat, "none")
        accumulate = int(knob("accumulate", args.accumulate, 1))
        offload = knob("offload", args.offload, "none")
        global_batch = knob("global_batch_size", "auto", None) if args.batch_size is None else None
        if global_batch is not None and int(global_batch) % mesh.data_size:
            raise SystemExit(
                f"global batch {global_batch} does not split over {mesh.data_size} data-parallel ranks"
            )
        batch_size = args.batch_size or (int(global_batch) // mesh.data_size if global_batch else 8)
        step = af.train_step(loss_fn, af.optim.adamw(args.lr, weight_decay=0.0), clip_grad_norm=1.0)
        if remat != "none":
            step = af.remat(step, **remat_args(remat))
        if args.bf16:
            step = af.autocast(step, "bf16")
        if accumulate > 1:
            step = af.accumulate(step, accumulate)
        if offload == "optimizer":
            step = af.offload(step)
        step = af.shard(step, mesh, strategy=strategy)  # an ep axis: experts split over it (the model's plan)
        with af.init_empty() if args.init == "meta" else contextlib.nullcontext():
            model = make_model(args.experts, args.seed, args.model, args.layers)
        _experts_for_the_device(model, mesh, args.bf16)
        state = step.init(model, seed=args.seed)
        # enough rows that every data-parallel rank gets batches (a dry run on 1,024 ranks)
        rows = max(512, 2 * batch_size * mesh.data_size)
        loader = af.data.DataLoader(make_data(rows, args.seq, args.seed), batch_size=batch_size, mesh=mesh,
                                    shuffle=True, seed=args.seed, drop_last=True)  # fmt: skip
        if mesh.is_main:
            print(step)
            print(f"config mesh={dict(mesh.shape)} strategy={strategy} remat={remat} accumulate={accumulate} "
                  f"offload={offload} batch={batch_size} per data rank")  # fmt: skip
        losses: list[float] = []
        while len(losses) < args.steps:
            for batch in loader:
                state, metrics = step(state, batch)
                losses.append(metrics["loss"].item())
                if mesh.is_main and len(losses) % 10 == 0:
                    print(
                        f"step {len(losses)}: loss {losses[-1]:.3f}, grad norm {metrics['grad_norm'].item():.3f}"
                    )
                if len(losses) == args.steps:
                    break
        ep = mesh.axis_size("ep") if "ep" in mesh.axis_names else 1
        experts = (
            step.model.config.num_local_experts
            if args.model == "deepseek-v3"
            else step.model.config.num_experts
        )
        held = (
            experts // ep
        )  # the experts of this rank's ep coordinate (under fsdp, sharded again over efsdp)
        local = next(v for k, v in state.params.items() if k.endswith("mlp.experts.gate_up_proj"))
        split = ep == 1 or "ep" in (
            getattr(getattr(local, "device_mesh", None), "mesh_dim_names", None) or ()
        )
        ok = losses[-1] < 0.7 * losses[0] and split
        if mesh.is_main:
            print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; each rank holds {held} of {experts} experts")
            print(f"CHECK moe loss falls: {'OK' if ok else 'FAILED'}")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
