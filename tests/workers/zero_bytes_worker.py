"""The per-rank bytes a real DeepSpeed ZeRO-1/2 engine holds, on 2 CPU processes, read from the engine itself
(its module's params, its fp32 master partitions and the base optimizer's moments), printed as JSON for
tests/test_dry_run_validate_more.py to compare with the dry run's model of the same step.

argv: the ZeRO stages, e.g. 1,2 (one engine after the other)."""

import json
import sys
from pathlib import Path

import torch

import accelfn as af
from accelfn.transforms.shard.deepspeed import engine_of

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from train_llama import build, loss_fn  # noqa: E402

mesh = af.Mesh({"dp": -1}, device="cpu")
for stage in map(int, sys.argv[1].split(",")):
    step = af.train_step(loss_fn, af.optim.adamw(1e-3), clip_grad_norm=1.0)
    step = af.shard(af.autocast(step, "bf16"), mesh, backend="deepspeed", zero_stage=stage)
    torch.manual_seed(0)
    state = step.init(build("tiny", 128))
    state, _ = step(state, torch.randint(0, 256, (2, 129)))
    engine = engine_of(step)
    opt = engine.optimizer
    params = sum(p.numel() * p.element_size() for p in engine.module.parameters())
    master = sum(t.numel() * t.element_size() for t in opt.single_partition_of_fp32_groups)
    moments = sum(
        t.numel() * t.element_size()
        for s in opt.optimizer.state.values()
        for k, t in s.items()
        if isinstance(t, torch.Tensor) and t.dim() > 0  # not the 0-d step counters
    )
    report = {
        "stage": stage,
        "rank": mesh.rank,
        "params": params,
        "optimizer": master + moments,
        "master": master,
    }
    print("ZERO_BYTES " + json.dumps(report), flush=True)
    del state, step, engine, opt
mesh.close()
