"""Worker: an eval step of an FSDP-sharded model run under `if mesh.is_main:` (Accelerate's habit) while the
other rank waits in af.dist.barrier. With ACCELFN_DEBUG=1 every rank is told what each one did (the eval's
forward gathers the shards: without debug mode this hangs)."""

import torch

import accelfn as af
from accelfn.collective.debug import CollectiveMismatchError

mesh = af.Mesh.from_env()
train = af.shard(af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.sgd(0.1)), mesh, strategy="fsdp")
state = train.init(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)))
evaluate = af.eval_step(lambda m, b: m(b))
evaluate.init(train.model)
try:
    if mesh.is_main:
        evaluate(state, torch.randn(3, 4))
    af.dist.barrier()
except CollectiveMismatchError as e:
    assert "eval step" in str(e) and "barrier" in str(e), e
    print(f"rank {mesh.rank}: OK debug names the eval step and the barrier", flush=True)
else:
    raise AssertionError(f"rank {mesh.rank}: no mismatch reported")
mesh.close()
