"""The worker of ``accelfn test``: checks collectives and that 3 DDP steps equal one process.

Run by the launcher on every rank (``python -m accelfn.cli.selftest_worker``); rank 0 prints a line
per check and PASS/FAIL, every rank exits 1 on FAIL.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from .. import platforms
from ..launch_env import read_env


def _device_and_backend() -> tuple[torch.device, str]:
    """The platform's device for this local rank and its backend (``ACCELFN_DEVICE=cpu`` under --cpu)."""
    from .. import platforms

    plat = platforms.detect()
    dev = plat.device(read_env().local_rank)
    plat.set_device(dev)
    return dev, plat.backend


def _collectives(rank: int, n: int, dev: torch.device) -> dict[str, bool]:
    results: dict[str, bool] = {}
    x = torch.tensor([float(rank + 1)], device=dev)
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    results["all_reduce sum"] = x.item() == n * (n + 1) / 2
    x = torch.tensor([float(rank)], device=dev)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    results["all_reduce max"] = x.item() == n - 1
    x = torch.tensor([float(rank)], device=dev)
    dist.all_reduce(x, op=dist.ReduceOp.MIN)
    results["all_reduce min"] = x.item() == 0
    parts = [torch.zeros(2, device=dev) for _ in range(n)]
    dist.all_gather(parts, torch.full((2,), float(rank), device=dev))
    results["all_gather"] = all(p.eq(i).all().item() for i, p in enumerate(parts))
    b = torch.full((3,), float(rank), device=dev)
    dist.broadcast(b, src=n - 1)
    results["broadcast"] = bool(b.eq(n - 1).all().item())
    out = torch.zeros(1, device=dev)
    dist.reduce_scatter(out, [torch.full((1,), float(rank + i), device=dev) for i in range(n)])
    results["reduce_scatter"] = out.item() == sum(r + rank for r in range(n))
    objs: list[object] = [None] * n
    dist.all_gather_object(objs, {"rank": rank})
    results["all_gather_object"] = objs == [{"rank": r} for r in range(n)]
    dist.barrier()
    results["barrier"] = True
    return results


def _af_dist(rank: int, n: int, dev: torch.device) -> dict[str, bool]:
    """The same answers through `af.dist` (pytrees in, new tensors out)."""
    from .. import dist as afd

    x = torch.tensor([float(rank)], device=dev)
    mean = sum(range(n)) / n
    return {
        "af.dist.all_reduce mean/sum/max/min": [
            afd.all_reduce(x, op=op).item() for op in ("mean", "sum", "max", "min")
        ]
        == [mean, mean * n, n - 1, 0],
        "af.dist.gather": afd.gather({"r": x})["r"].tolist() == [float(r) for r in range(n)],
        "af.dist.broadcast": afd.broadcast(x + 10, src=n - 1).item() == n - 1 + 10,
        "af.dist.gather_object": afd.gather_object(("rank", rank)) == [("rank", r) for r in range(n)],
    }


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _train(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _ddp_matches_single_process(rank: int, n: int, dev: torch.device) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    gen = torch.Generator().manual_seed(1)
    per_rank = 4
    batches = [
        (torch.randn(per_rank * n, 4, generator=gen), torch.randn(per_rank * n, 1, generator=gen))
        for _ in range(3)
    ]
    ddp = DistributedDataParallel(_mlp().to(dev), device_ids=None if platforms.is_host(dev) else [dev.index])
    shard = slice(rank * per_rank, (rank + 1) * per_rank)
    _train(ddp, [(x[shard].to(dev), y[shard].to(dev)) for x, y in batches])
    mine = torch.cat([p.detach().flatten().cpu() for p in ddp.module.parameters()])
    ok = torch.tensor([1.0], device=dev)
    if rank == 0:
        reference = _mlp()
        _train(reference, batches)  # one process on the global batch
        ref = torch.cat([p.detach().flatten() for p in reference.parameters()])
        ok.fill_(float(torch.allclose(mine, ref, rtol=1e-5, atol=1e-6)))
    dist.broadcast(ok, src=0)
    return bool(ok.item())


def main() -> int:
    dev, backend = _device_and_backend()
    dist.init_process_group(backend)
    rank, n = dist.get_rank(), dist.get_world_size()
    checks: dict[str, Callable[[], dict[str, bool]]] = {
        "collectives": lambda: _collectives(rank, n, dev),
        "af.dist": lambda: _af_dist(rank, n, dev),
        "ddp": lambda: {
            "3 DDP steps == 1 process on the global batch": _ddp_matches_single_process(rank, n, dev)
        },
    }
    results: dict[str, bool] = {}
    for group in checks.values():
        results.update(group())
    failed = torch.tensor([float(sum(not ok for ok in results.values()))], device=dev)
    dist.all_reduce(failed)
    if rank == 0:
        print(f"accelfn self-check: {n} processes, backend {backend}, device {dev.type}")
        for name, ok in results.items():
            print(f"  {'ok  ' if ok else 'FAIL'} {name}")
        print("PASS" if failed.item() == 0 else f"FAIL ({int(failed.item())} failed checks over all ranks)")
    sys.stdout.flush()
    from ..mesh import destroy_process_group

    destroy_process_group()  # drops DDP/DeviceMesh references first: gloo aborts at exit otherwise
    return 0 if failed.item() == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
