"""Worker: find_executable_batch_size on 2 ranks that run out of memory at different sizes
(run by tests/test_batch_size.py). Every case prints one line per rank for the test to compare."""

import torch

import accelfn as af
from accelfn.batch_size import find_executable_batch_size

mesh = af.Mesh.from_env(device="cpu")
rank = mesh.rank
limit = {0: 64, 1: 16}[rank]  # rank 1 has less memory: both must settle on 16


def attempt(tried, fits):
    def train(batch_size):
        tried.append(batch_size)
        if batch_size > fits:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {batch_size} GiB")
        return batch_size

    return train


tried: list[int] = []
size = find_executable_batch_size(attempt(tried, limit), starting_batch_size=128)()
total = int(af.dist.all_reduce(torch.tensor([float(size)]), op="sum").item())  # the ranks are still in step
print(f"AGREE rank={rank} tried={tried} all_reduced={total}", flush=True)

# rank 1 never fits: every rank raises the clear error, none waits alone
tried = []
try:
    find_executable_batch_size(
        attempt(tried, 0 if rank == 1 else 10**9), starting_batch_size=8, min_batch_size=2
    )()
except RuntimeError as e:
    print(f"EXHAUSTED rank={rank} tried={tried} msg={str(e).splitlines()[0]}", flush=True)


# a non-memory error on rank 0 makes rank 1 raise too (no hang in the next attempt's all-reduce)
def broken(batch_size):
    if rank == 0:
        raise ValueError("bad data")
    return batch_size


try:
    find_executable_batch_size(broken, starting_batch_size=4)()
except (ValueError, RuntimeError) as e:
    print(f"FAILED rank={rank} {type(e).__name__}: {e}", flush=True)

mesh.close()
