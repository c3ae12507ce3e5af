"""Mixture of experts: tokens/s of expert parallel vs the same model sharded as dense, the experts' grouped GEMM
vs the per-expert loop, and the dry run's predicted step for Qwen3-235B-A22B on 64 H100s with and without ep.

    python benchmarks/moe.py [--nproc 2] [--steps 8] [--part train,gemm,dryrun] [--meshes 'ep;fsdp;dp']
                              [--only 235b|deepseek]

train   one job of `--nproc` CPU processes per mesh of `--meshes` (`accelfn launch`, gloo): a small Qwen3-MoE
        (`--experts`, top-2, `--hidden`, `--layers`), AdamW, fp32, `--rows` x `--seq` tokens per rank; `ep=N`
        (experts split, dense layers replicated: ddp) vs `fsdp=N` (every expert FSDP-sharded and all-gathered
        like a dense layer) and `dp=N` (ddp: every expert on every rank, gradients all-reduced), or
        meshes of several axes (`--meshes 'dp=2,ep=2;fsdp=2,ep=2'`: fsdp where the mesh has an fsdp axis, else
        ddp). Median step time after 2 warm-up steps; tokens/s over all ranks.
        On CPU the experts run as the per-expert loop (the CPU platform lists no grouped-GEMM dtype).
gemm    one process: `accelfn.moe.local_experts` on the same rows, grouped (`torch._grouped_mm`, which torch
        runs on CPU too, though no platform picks it there) vs the loop, forward + backward.
dryrun  `accelfn dry-run --nproc-per-node 8 --gpu h100` of examples/train_moe.py (meta device, bf16, full remat,
        4096-token rows, `--batch-size` rows per rank): Qwen3-235B-A22B on 8 nodes over the meshes a user would
        try (fsdp only; ep=8 in a node with efsdp across nodes, at 1 to 4 rows; ep=16/32/64 across nodes), and
        DeepSeek-V3 (671B) on 32 and 128 nodes (`DRYRUNS`; `--only 235b` or `--only deepseek`); ~25 s each.
        The all-to-alls' bus bytes are split into what crosses the network and what stays on NVLink.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worker(args: argparse.Namespace) -> None:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    import accelfn as af

    world = int(os.environ["WORLD_SIZE"])
    axes = _axes(args.worker, world)
    mesh = af.Mesh(axes, device="cpu")
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=1024, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
        moe_intermediate_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=4,
        num_key_value_heads=2, num_experts=args.experts, num_experts_per_tok=2, use_cache=False,
        tie_word_embeddings=False))  # fmt: skip
    with torch.no_grad():  # transformers zero-initialises the router
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.02)

    def loss_fn(m, b):  # noqa: ANN001, ANN202
        return af.losses.cross_entropy(m(input_ids=b["ids"]).logits[:, :-1], b["ids"][:, 1:])

    step = af.shard(
        af.train_step(loss_fn, af.optim.adamw(1e-3)),
        mesh,
        strategy=_strategy(axes),
    )
    state = step.init(model, seed=0)
    g = torch.Generator().manual_seed(mesh.rank)
    batch = {"ids": torch.randint(0, model.config.vocab_size, (args.rows, args.seq), generator=g)}
    times = []
    for i in range(args.steps + 2):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        metrics["loss"].item()
        if i >= 2:
            times.append(time.perf_counter() - start)
    if mesh.is_main:
        s = statistics.median(times)
        print("RESULT " + json.dumps({"mesh": f"{_name(axes)}, {_strategy(axes)}", "step_s": s,
                                      "tokens_per_s": args.rows * args.seq * world / s}))  # fmt: skip
    mesh.close()


def _axes(mesh: str, world: int) -> dict[str, int]:
    """`"ep"` (the whole world on one axis) or `"dp=2,ep=2"` as a mesh's axes."""
    if "=" not in mesh:
        return {mesh: world}
    axes = {k: int(v) for k, v in (part.split("=") for part in mesh.split(","))}
    if math.prod(axes.values()) != world:
        raise SystemExit(f"--meshes: {mesh} has {math.prod(axes.values())} ranks, the job {world}")
    return axes


def _strategy(axes: dict[str, int]) -> str:
    """fsdp where the mesh has an fsdp axis (the experts FSDP-sharded over it too), else ddp."""
    return "fsdp" if "fsdp" in axes else "ddp"


def _name(axes: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in axes.items())


def train(args: argparse.Namespace) -> list[dict]:
    rows = []
    for axis in args.meshes.split(";"):
        cmd = [sys.executable, "-m", "accelfn.cli.main", "launch", "--nproc-per-node", str(args.nproc), "--cpu",
               __file__, "--worker", axis, *_shape(args)]  # fmt: skip
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            raise SystemExit(f"{axis}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}")
        rows.append(json.loads(line[7:]))
    return rows


def _shape(args: argparse.Namespace) -> list[str]:
    return [f"--{k}={getattr(args, k)}" for k in ("steps", "experts", "hidden", "layers", "rows", "seq")]


def gemm(args: argparse.Namespace) -> list[dict]:
    import torch
    from torch import nn

    from accelfn.moe import local_experts

    torch.manual_seed(0)
    d, f, e = args.hidden, args.hidden, args.experts
    m = nn.Module()
    m.act_fn = nn.SiLU()  # type: ignore[assignment]
    m.gate_up_proj = nn.Parameter(torch.randn(e, 2 * f, d) * 0.02)
    m.down_proj = nn.Parameter(torch.randn(e, d, f) * 0.02)
    n = args.rows * args.seq * 2  # rows x top-2
    counts = torch.bincount(torch.randint(0, e, (n,)), minlength=e)
    x = torch.randn(n, d, requires_grad=True)
    grad = torch.randn(n, d)
    out = []
    for name, grouped in (("grouped (torch._grouped_mm)", (torch.float32,)), ("per-expert loop", ())):
        times = []
        for i in range(args.steps + 2):
            start = time.perf_counter()
            y = local_experts(m, x, counts, grouped)
            y.backward(
                grad
            )  # a dense gradient (an expanded one, from .sum(), fails in _grouped_mm's backward)
            if i >= 2:
                times.append(time.perf_counter() - start)
        out.append({"path": name, "ms": statistics.median(times) * 1e3, "rows": n, "experts": e})
    return out


DRYRUNS = [  # model, nodes of 8, mesh, rows per rank, strategy (fsdp: the experts FSDP-sharded over efsdp)
    ("235b-a22b", 8, "fsdp=64", 1, "fsdp"),
    ("235b-a22b", 8, "fsdp=8,ep=8", 1, "fsdp"),
    ("235b-a22b", 8, "fsdp=8,ep=8", 2, "fsdp"),
    ("235b-a22b", 8, "fsdp=8,ep=8", 3, "fsdp"),
    ("235b-a22b", 8, "fsdp=8,ep=8", 4, "fsdp"),
    ("235b-a22b", 8, "fsdp=4,ep=16", 1, "fsdp"),
    ("235b-a22b", 8, "fsdp=2,ep=32", 1, "fsdp"),
    (
        "235b-a22b",
        8,
        "ep=64",
        1,
        "ddp",
    ),  # fsdp with no efsdp axis is refused; ddp replicates the dense layers
    ("deepseek-v3", 32, "fsdp=32,ep=8", 1, "fsdp"),
    ("deepseek-v3", 128, "fsdp=128,ep=8", 1, "fsdp"),
    ("deepseek-v3", 128, "fsdp=16,ep=64", 1, "fsdp"),
]


def a2a_split(report: dict) -> tuple[float, float]:
    """(bytes over the network, bytes over NVLink) of the report's all-to-alls: of each group's n - 1 parts, those
    for ranks of other nodes cross the network (`accelfn.dryrun.comm_time.ranks_in_node`)."""
    from accelfn.dryrun.comm_time import ranks_in_node

    inter = intra = 0.0
    for axes, row in report["comm"].get("all_to_all", {}).items():
        n = row["group_size"]
        local = ranks_in_node(tuple(axes.split("x")), report["mesh"], 8)
        inter += row["bus_bytes"] * (n - local) / max(1, n - 1)
        intra += row["bus_bytes"] * (local - 1) / max(1, n - 1)
    return inter, intra


def dryrun(only: str | None = None) -> list[dict]:
    out = []
    for model, nodes, mesh, rows, strategy in DRYRUNS:
        if only and not model.startswith(only):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "r.json"
            cmd = [sys.executable, "-m", "accelfn.cli.main", "dry-run", "--nproc-per-node", "8", "--nnodes",
                   str(nodes), "--gpu", "h100", "--mesh", mesh, "--no-search", "--json", str(report),
                   str(ROOT / "examples" / "train_moe.py"), "--model", model, "--init", "meta", "--strategy",
                   strategy, "--bf16", "--remat", "--seq", "4096", "--batch-size", str(rows)]  # fmt: skip
            start = time.perf_counter()
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
            if proc.returncode not in (0, 3):
                raise SystemExit(f"{mesh}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}")
            r = json.loads(report.read_text())
        inter, intra = a2a_split(r)
        p = r["predicted"]
        out.append({"model": model, "ranks": 8 * nodes, "mesh": f"{mesh}, {strategy}", "rows": rows,
                    "peak_gib": r["per_rank"]["peak"] / 2**30, "fits": r["fits"],
                    "bus_gib": r["total_bus_bytes"] / 2**30, "a2a_inter_gib": inter / 2**30,
                    "a2a_intra_gib": intra / 2**30, "step_s": p["step_time_s"], "compute_s": p["compute_s"],
                    "exposed_s": p["exposed_comm_s"], "tokens_per_s": p["tokens_per_s"], "mfu": p["mfu"],
                    "cpu_s": time.perf_counter() - start})  # fmt: skip
        print(json.dumps(out[-1]), file=sys.stderr, flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rows", type=int, default=4, help="rows per rank")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--part", default="train,gemm,dryrun")
    p.add_argument(
        "--meshes",
        default="ep;fsdp;dp",
        help="train: the meshes, `;`-separated: an axis (all ranks on it) or axes, e.g. 'ep;fsdp;dp=2,ep=2'",
    )
    p.add_argument("--only", default=None, help="dryrun: the rows of one model (235b, deepseek)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    parts = args.part.split(",")
    if "train" in parts:
        print(f"| mesh ({args.nproc} CPU processes) | ms/step | tokens/s |\n|---|---|---|")
        for r in train(args):
            print(f"| `{r['mesh']}` | {r['step_s'] * 1e3:.1f} | {r['tokens_per_s']:.0f} |", flush=True)
    if "gemm" in parts:
        print("\n| experts' path (one process, fwd+bwd) | ms | rows |\n|---|---|---|")
        for r in gemm(args):
            print(f"| {r['path']} | {r['ms']:.2f} | {r['rows']} |", flush=True)
    if "dryrun" in parts:
        print("\n| model, H100s | mesh | rows/rank | peak GiB | fits | bus GiB/rank/step | all-to-all GiB: network, "
              "NVLink | step s (compute, exposed comm) | tokens/s | MFU | dry run on CPU |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in dryrun(args.only):
            print(f"| {r['model']}, {r['ranks']} | `{r['mesh']}` | {r['rows']} | {r['peak_gib']:.1f} | {r['fits']} | "
                  f"{r['bus_gib']:.0f} | {r['a2a_inter_gib']:.0f}, {r['a2a_intra_gib']:.0f} | {r['step_s']:.2f} "
                  f"({r['compute_s']:.2f}, {r['exposed_s']:.2f}) | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | "
                  f"{r['cpu_s']:.0f} s |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
