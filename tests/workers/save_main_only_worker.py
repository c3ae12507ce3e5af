"""Worker: af.checkpoint.save / save_pretrained called on rank 0 only (Accelerate's `if is_main_process:` habit)
fail on rank 0 with an error naming the fix, after ACCELFN_COLLECTIVE_TIMEOUT seconds, instead of hanging (the
job is then expected to stop: the checkpoint group is broken)."""

import sys
import time

import torch
import torch.distributed as dist

import accelfn as af

out, which = sys.argv[1], sys.argv[2]
caller = int(sys.argv[3]) if len(sys.argv) > 3 else 0  # the one rank that calls it (1: not rank 0, which
# monitored_barrier alone would not time out: only rank 0 enforces its timeout)
mesh = af.Mesh.from_env()
step = af.shard(af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.sgd(0.1)), mesh)
state = step.init(torch.nn.Linear(4, 2))
state, _ = step(state, torch.randn(8, 4))
what, call = {
    "save": ("af.checkpoint.save", lambda: af.checkpoint.save(f"{out}/ckpt", state)),
    "save_pretrained": (
        "af.checkpoint.save_pretrained",
        lambda: af.checkpoint.save_pretrained(f"{out}/hf", state.params),
    ),
}[which]
if len(sys.argv) > 4 and sys.argv[4] == "debug":  # ACCELFN_DEBUG=1: the caller saves, the other trains on
    from accelfn.collective.debug import CollectiveMismatchError

    try:
        call() if mesh.rank == caller else step(state, torch.randn(8, 4))
    except CollectiveMismatchError as e:  # on every rank, naming what each one did
        assert what in str(e) and "af.Step" in str(e), e
        print(f"rank {mesh.rank}: OK debug names {what} and the training step", flush=True)
    else:
        raise AssertionError(f"rank {mesh.rank}: no mismatch reported")
elif mesh.rank == caller:
    t0 = time.monotonic()
    try:
        call()
    except RuntimeError as e:
        assert f"{what} is collective: every rank must call it" in str(e), e
        assert "not under `if mesh.is_main:`" in str(e), e
        assert f"ranks [{1 - caller}] did not call it" in str(e), e
        print(f"rank {caller}: OK {what} refused after {time.monotonic() - t0:.1f} s", flush=True)
    else:
        raise AssertionError(f"{what} on rank {caller} alone did not fail")
dist.barrier()  # the default group: the other rank waits here while the caller is refused
mesh.close()
