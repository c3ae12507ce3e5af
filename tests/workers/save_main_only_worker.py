"""Worker: af.checkpoint.save / save_pretrained called on rank 0 only (Accelerate's `if is_main_process:` habit)
fail on rank 0 with an error naming the fix, after ACCELFN_COLLECTIVE_TIMEOUT seconds, instead of hanging (the
job is then expected to stop: the checkpoint group is broken)."""

import sys
import time

import torch
import torch.distributed as dist

import accelfn as af

out, which = sys.argv[1], sys.argv[2]
mesh = af.Mesh.from_env()
step = af.shard(af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.sgd(0.1)), mesh)
state = step.init(torch.nn.Linear(4, 2))
state, _ = step(state, torch.randn(8, 4))
what, call = {
    "save": ("af.checkpoint.save", lambda: af.checkpoint.save(f"{out}/ckpt", state)),
    "save_pretrained": ("af.checkpoint.save_pretrained", lambda: af.checkpoint.save_pretrained(f"{out}/hf", state.params)),
}[which]
if mesh.is_main:
    t0 = time.monotonic()
    try:
        call()
    except RuntimeError as e:
        assert f"{what} is collective: every rank must call it" in str(e), e
        assert "not under `if mesh.is_main:`" in str(e), e
        print(f"rank 0: OK {what} refused after {time.monotonic() - t0:.1f} s", flush=True)
    else:
        raise AssertionError(f"{what} on rank 0 alone did not fail")
dist.barrier()  # the default group: rank 1 waits here while rank 0 is refused
mesh.close()
