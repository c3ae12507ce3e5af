"""`accelfn plan`'s search space beyond the dense mesh: optimizer offload with tensor parallel, expert parallel
for a mixture-of-experts script, ZeRO 1-3 through the DeepSpeed backend.

Each planner check runs a tiny model at 8 fake ranks: the planner's choice against an exhaustive search of the
same grid, and its legality against the lowering's own errors.
"""

from __future__ import annotations

import attrs

from accelfn import launch_env
from tests._launch import ROOT, WORKERS

PLAN_WORKER = str(WORKERS / "plan_worker.py")
MOE = str(ROOT / "examples" / "train_moe.py")


def _env(**knobs: object) -> tuple[tuple[str, str], ...]:
    return tuple((launch_env.KNOBS[k][0], str(v)) for k, v in knobs.items())


# ---- offload with tensor parallel ------------------------------------------------------------------------------


def test_optimizer_offload_with_tensor_parallel_lowers_on_the_modelled_gpu() -> None:
    """The candidate an earlier plan reported failing (`aten.copy_ got mixed torch.Tensor and DTensor`): ddp with
    optimizer offload on dp=4,tp=2, dry-run on the modelled H100 (the host update's copying path, on each rank's
    tp pieces). The offloaded optimizer state is on the host, the rest as without offload."""
    from accelfn.planner.search import Job, run_job

    args = ("--remat", "none", "--compile", "none")
    knobs = dict(strategy="ddp", accumulate=1, global_batch_size=8)
    job = Job(PLAN_WORKER, args, 8, 1, mesh="dp=4,tp=2", gpu="h100-sxm")
    off = run_job(attrs.evolve(job, env=_env(**knobs, offload="optimizer")))
    on = run_job(attrs.evolve(job, env=_env(**knobs, offload="none")))
    assert "error" not in off, off.get("error")
    got, ref = off["report"]["per_rank"], on["report"]["per_rank"]
    assert ref["optimizer"] > 0 and got["optimizer"] == 0
    assert got["host"] >= ref["optimizer"] + ref["grads"]  # the state, and the gradients' host buffers
    assert (got["params"], got["grads"]) == (ref["params"], ref["grads"])
    assert got["peak"] <= ref["peak"] - ref["optimizer"]
