"""What a compiled Llama block's memory-bound work is, bf16 and fp8 (torchao tensorwise): inductor's CPU kernels
against the dry run's fused runs (docs/dry_run.md, "Predicted time against published runs", items 1 and 15).

Inductor (CPU backend, no GPU needed): the block is compiled, forward and backward, and each graph's scheduler
nodes after fusion are recorded with `get_read_write_buffers_sizes()` (matmuls, `_scaled_mm` and SDPA are extern
kernels, the rest are inductor's own memory-bound kernels). The dry run: the same block through
`partition_block` (the partitioned graphs run op by op), each op's `OpCost` recorded, and split into the runs
`accelfn.dryrun.step_time.fused_runs` fuses. Bytes are in units of one activation (tokens x hidden x 2 bytes).

The block keeps the Llama 3 8B's proportions at 1/8 of its width (hidden 512, intermediate 1792, head dim 128,
4 query heads per key/value head) and 2 tokens per hidden unit (torchtitan's 8,192-token rows of the 8B), so
weight-sized work (the weights' casts in fp8) weighs what it does there.

    python benchmarks/fp8_fusion.py            # both dtypes
    python benchmarks/fp8_fusion.py --list     # and every kernel / run
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
from typing import Any

import torch

HIDDEN, INTER, HEADS, KV, TOKENS = 512, 1792, 4, 1, 1024
RECIPE = ["tensorwise"]  # torchao's recipe for fp8 (--recipe)


def block(fp8: bool) -> torch.nn.Module:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    cfg = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        head_dim=HIDDEN // HEADS,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(cfg, 0).to(torch.bfloat16)
    if (
        fp8
    ):  # as af.autocast_fp8(backend="torchao") converts a GPU job's Linears (accelfn.transforms.fp8.torchao)
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(layer, config=Float8LinearConfig.from_recipe_name(RECIPE[0]))
    return layer


def inputs(requires_grad: bool = True) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, head_dim=HIDDEN // HEADS)
    x = torch.randn(1, TOKENS, HIDDEN, dtype=torch.bfloat16, requires_grad=requires_grad)
    cos, sin = LlamaRotaryEmbedding(cfg)(x, torch.arange(TOKENS)[None])
    return x, (cos, sin)


def run(layer: torch.nn.Module, x: torch.Tensor, pe: tuple[torch.Tensor, torch.Tensor]) -> None:
    out = layer(x, position_embeddings=pe, attention_mask=None)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(torch.ones_like(out))


def inductor(fp8: bool) -> list[tuple[str, list[tuple[str, int]]]]:
    """Each graph inductor compiles (forward, backward) with its kernels: (kind, bytes), kind "extern" for a
    library kernel (mm, _scaled_mm, SDPA), "reduction" or "pointwise" for inductor's own."""
    import torch._inductor.config as ic
    from torch._inductor import scheduler as sched

    graphs: list[tuple[str, list[tuple[str, int]]]] = []
    codegen = sched.Scheduler.codegen

    def record(self: Any) -> Any:
        kernels = []
        for node in self.nodes:
            if isinstance(node, sched.NopKernelSchedulerNode):
                continue
            if isinstance(node, sched.ExternKernelSchedulerNode):
                kind = "extern:" + str(
                    getattr(node.node, "python_kernel_name", "") or type(node.node).__name__
                )
            else:
                kind = "reduction" if node.is_reduction() else "pointwise"
            kernels.append((kind, int(node.get_read_write_buffers_sizes())))
        graphs.append(("backward" if graphs else "forward", kernels))
        return codegen(self)

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp())
    ic.fx_graph_cache = False
    sched.Scheduler.codegen = record  # type: ignore[method-assign]
    try:
        torch._dynamo.reset()
        layer = block(fp8)
        x, pe = inputs()
        run(torch.compile(layer), x, pe)
    finally:
        sched.Scheduler.codegen = codegen  # type: ignore[method-assign]
    return graphs


def dry_run(fp8: bool) -> list[tuple[str, list[tuple[str, int]]]]:
    """The dry run's view of the same block: its fused runs (kind "run", the bytes the model charges: see
    `fused_runs`) and the matmul / attention kernels between them, forward and backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from accelfn.dryrun.compiled import partition_block
    from accelfn.dryrun.step_time import FusedRun, fused_runs
    from accelfn.dryrun.timing import op_cost

    costs: list[Any] = []

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            c = op_cost(func, args, kwargs or {}, out)
            if c is not None:
                costs.append(c)
            return out

    layer = block(fp8)
    assert partition_block(layer)
    x, pe = inputs()
    run(copy.deepcopy(layer), *inputs())  # traced once, outside the recording
    with Mode():
        run(layer, x, pe)
    out: dict[str, list[tuple[str, int]]] = {"forward": [], "backward": []}
    for run_ in fused_runs(costs, per_block=True):
        if isinstance(run_, FusedRun):
            out["backward" if run_.ops[0].backward else "forward"].append(("run", run_.nbytes))
        else:
            out["backward" if run_.backward else "forward"].append(("extern:" + run_.kind, 0))
    return list(out.items())


def summary(graphs: list[tuple[str, list[tuple[str, int]]]]) -> dict[str, tuple[int, float]]:
    """phase -> (memory-bound kernels, activations moved)."""
    unit = TOKENS * HIDDEN * 2
    res: dict[str, tuple[int, float]] = {}
    for phase, kernels in graphs:
        mem = [b for k, b in kernels if not k.startswith("extern")]
        n, b = res.get(phase, (0, 0.0))
        res[phase] = (n + len(mem), b + sum(mem) / unit)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--list", action="store_true", help="print every kernel / run")
    p.add_argument("--dtype", choices=("bf16", "fp8", "both"), default="both")
    p.add_argument(
        "--recipe", choices=("tensorwise", "rowwise"), default="tensorwise", help="torchao's, for fp8"
    )
    args = p.parse_args()
    RECIPE[0] = args.recipe
    unit = TOKENS * HIDDEN * 2
    for fp8 in {"bf16": [False], "fp8": [True], "both": [False, True]}[args.dtype]:
        name = "fp8" if fp8 else "bf16"
        ind, dry = inductor(fp8), dry_run(fp8)
        if args.list:
            for who, graphs in (("inductor", ind), ("dry run", dry)):
                for phase, kernels in graphs:
                    print(f"{name} {who} {phase}: " + ", ".join(f"{k}={b / unit:.2f}" for k, b in kernels))
        si, sd = summary(ind), summary(dry)
        for phase in ("forward", "backward"):
            (ni, bi), (nd, bd) = si.get(phase, (0, 0.0)), sd.get(phase, (0, 0.0))
            print(f"{name} {phase}: inductor {ni} kernels {bi:.1f} activations; model {nd} runs {bd:.1f}")
        ti, td = sum(b for _, b in si.values()), sum(b for _, b in sd.values())
        print(f"{name} total: inductor {ti:.1f}, model {td:.1f} ({td / ti - 1:+.0%})")


if __name__ == "__main__":
    main()
