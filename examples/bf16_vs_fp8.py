"""Train the same tiny Llama from the same seed on the same batches twice, in bf16 and in FP8, and print
the two loss curves side by side: the "trend against BF16" benchmark of Accelerate's fp8 examples.

    python examples/bf16_vs_fp8.py
    accelfn launch --nproc-per-node 2 --cpu examples/bf16_vs_fp8.py      # both runs data parallel

Both runs are `af.autocast(bf16)`; the FP8 run adds `af.autocast_fp8` (torchao, tensorwise), emulated where
`mesh.platform.supports_fp8()` is false (the CPU). On FP8 hardware pass `--all-layers` to put every
eligible Linear in FP8 (by default only layers large enough to gain are converted, and on this tiny model
that may be none). The table shows the loss averaged over each window of `--every` steps; the check
(non-zero exit on failure) is that both losses fall and the final FP8 loss is within `--tolerance` of
bf16's (relative).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from fp8_training import DATA, loss_fn, tiny_llama  # noqa: E402  (the same model and loss)

import accelfn as af  # noqa: E402


def train(mesh, fp8: bool, args, emulate: bool) -> list[float]:
    opt = af.optim.adamw(
        af.optim.warmup_cosine(args.lr, warmup=args.steps // 10, total=args.steps), weight_decay=0.1
    )
    step = af.autocast(af.train_step(loss_fn, opt, clip_grad_norm=1.0), torch.bfloat16)
    if fp8:
        every_layer = (lambda module, fqn: isinstance(module, torch.nn.Linear)) if args.all_layers else None
        step = af.autocast_fp8(
            step, backend="torchao", recipe="tensorwise", emulate=emulate, module_filter=every_layer
        )
    step = af.shard(step, mesh)
    state = step.init(tiny_llama(args.seed), seed=args.seed)
    af.dist.print(f"{'fp8 ' if fp8 else 'bf16'}: {step}")
    data = torch.frombuffer(bytearray(DATA.read_bytes()), dtype=torch.uint8)
    gen = torch.Generator().manual_seed(args.seed * 1000 + mesh.data_rank)  # the same batches in both runs
    losses = []
    for _ in range(args.steps):
        starts = torch.randint(0, len(data) - args.seq_len - 1, (args.batch_size,), generator=gen).tolist()
        state, metrics = step(
            state, {"ids": torch.stack([data[s : s + args.seq_len + 1] for s in starts]).long()}
        )
        losses.append(metrics["loss"].item())
    return losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10, help="print the mean loss of each window of N steps")
    p.add_argument("--batch-size", type=int, default=8, help="per process")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--tolerance", type=float, default=0.05, help="allowed relative gap of the final losses")
    p.add_argument("--emulate", action="store_true", help="emulate FP8 (automatic where it is not native)")
    p.add_argument("--all-layers", action="store_true", help="convert every eligible Linear (FP8 hardware)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    mesh = af.Mesh.from_env()
    emulate = args.emulate or not mesh.platform.supports_fp8()
    bf16 = train(mesh, False, args, emulate)
    fp8 = train(mesh, True, args, emulate)

    af.dist.print(
        f"\nloss, mean over each {args.every} steps ({mesh.world_size} process(es), "
        f"fp8 {'emulated' if emulate else 'native'}):"
    )
    af.dist.print(f"{'steps':>9}  {'bf16':>8}  {'fp8':>8}  {'fp8-bf16':>9}")
    for lo in range(0, args.steps, args.every):
        hi = min(lo + args.every, args.steps)
        b, f = sum(bf16[lo:hi]) / (hi - lo), sum(fp8[lo:hi]) / (hi - lo)
        af.dist.print(f"{lo + 1:>4}-{hi:<4}  {b:8.4f}  {f:8.4f}  {f - b:+9.4f}")
    w = min(args.every, args.steps)
    end_b, end_f = sum(bf16[-w:]) / w, sum(fp8[-w:]) / w
    gap = abs(end_f - end_b) / end_b
    af.dist.print(
        f"final loss: bf16 {end_b:.4f}, fp8 {end_f:.4f}, difference {end_f - end_b:+.4f} ({gap:.1%})"
    )
    ok = end_b < bf16[0] - 0.5 and end_f < fp8[0] - 0.5 and gap <= args.tolerance
    af.dist.print("CHECK fp8 tracks bf16:", "OK" if ok else "FAILED")
    mesh.close()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
