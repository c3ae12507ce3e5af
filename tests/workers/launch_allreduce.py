"""Worker: all-reduce the rank, check the sum is 0+1+...+(n-1), print the world size."""

import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, n = dist.get_rank(), dist.get_world_size()
x = torch.tensor([float(rank)])
dist.all_reduce(x)
assert x.item() == n * (n - 1) / 2, (x.item(), n)
print(f"rank={rank} world_size={n} sum={int(x.item())} local_rank={os.environ['LOCAL_RANK']}", flush=True)
dist.destroy_process_group()
