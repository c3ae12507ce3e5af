"""Worker: a pipeline reducing each micro-batch, whose FSDP2 units the backward reaches on some micro-batches only
(run by tests/test_pipeline.py).

    accelfn launch --nproc-per-node 4 --cpu tests/workers/pp_gated_worker.py pp=2,dp=2,fsdp=1 hsdp fsdp

The model's blocks 1 and 3 of each 4 (FSDP2 units) run only on a micro-batch with a gated-in row: only the first
micro-batch of every replica has one, so the backward reaches them in it only (an expert unit no token reaches, a
branch taken on some inputs). Each argument after the mesh is a strategy (`hsdp` / `fsdp`) with options:
`m=<micro-batches>` (default 2), `interleaved` (interleaved_1f1b, 2 stages a rank), `caller` (the gated blocks
are not even called), `params` (every block runs; the gated ones use `fc` on the first micro-batch, `fc2` on the
others: a unit's params differ between micro-batches), `bf16` (af.autocast; the reference accumulates the same
micro-batches), `unfixed` (the stage's zero-filled reduce-scatters off: the step must be refused). Without a
`pp` axis in the mesh: af.accumulate(..., sync_each_microbatch=True) instead of the pipeline. Each rank checks
its params, and every step's loss, against one process on the global batch, and under a pipeline that each unit
is reduced once a micro-batch and all-reduced (hsdp) once a step.
"""

import sys

import torch
from torch import nn

import accelfn as af
from accelfn.launch_env import parse_mesh

GATED = (1, 3)  # the blocks that run only where a row is gated in
ROWS = 16


class Block(nn.Module):
    def __init__(self, d, params=False):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d) if params else None

    def forward(self, x, gate):
        if self.fc2 is not None:  # the block runs, fc where a row is gated in, fc2 where one is out
            out = x + 0
            if bool(gate.any()):
                out = out + gate[:, None].to(x.dtype) * torch.tanh(self.fc(x))
            if not bool(gate.all()):
                out = out + (~gate)[:, None].to(x.dtype) * torch.tanh(self.fc2(x))
            return out
        if not bool(gate.any()):  # no row gated in: the block does not run (nor its backward)
            return x
        return x + gate[:, None].to(x.dtype) * torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self, d=8, n=8, params=False):
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.layers = nn.ModuleList(Block(d, params) for _ in range(n))
        self.out = nn.Linear(d, 1)

    def forward(self, x, gate, caller=False):
        h = self.inp(x)
        for i, layer in enumerate(self.layers):
            if i % 4 not in GATED:
                h = layer(h, torch.ones_like(gate))
            elif not caller or bool(gate.any()):  # `caller`: not even called where no row is gated in
                h = layer(h, gate)
        return self.out(h).squeeze(-1)


def loss_fn(model, b):
    return ((model(b["x"], b["gate"]) - b["y"]) ** 2).mean()


def caller_loss_fn(model, b):
    return ((model(b["x"], b["gate"], caller=True) - b["y"]) ** 2).mean()


def batches(dp, m, n=3):
    """Per replica's rows, the first micro-batch gated in, the others (the last among them) not."""
    g = torch.Generator().manual_seed(1)
    gate = torch.zeros(ROWS, dtype=torch.bool)
    per = ROWS // dp
    for r in range(dp):
        gate[r * per : r * per + per // m] = True
    return [{"x": torch.randn(ROWS, 4, generator=g), "y": torch.randn(ROWS, generator=g), "gate": gate}
            for _ in range(n)]  # fmt: skip


def make_model(options):
    torch.manual_seed(0)
    return Net(params="params" in options)


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def check(mesh, strategy, options):
    m = int(next((o[2:] for o in options if o.startswith("m=")), "2"))
    interleaved = "interleaved" in options
    loss = caller_loss_fn if "caller" in options else loss_fn
    data = batches(mesh.data_size, m)
    opt = lambda: af.optim.adamw(1e-2)  # noqa: E731
    ref_step = af.train_step(loss, opt())
    if "bf16" in options:  # bf16 rounding depends on the micro-batches: the reference runs the same ones
        ref_step = af.autocast(af.accumulate(ref_step, m * mesh.data_size), "bf16")
    ref = ref_step.init(make_model(options), seed=3)
    ref_losses = []
    for b in data:
        ref, met = ref_step(ref, b)
        ref_losses.append(met["loss"].item())

    if "pp" not in mesh.axis_names:  # no pipeline: af.accumulate's micro-batches, each reduce-scattered
        step = af.accumulate(af.train_step(loss, opt()), m, sync_each_microbatch=True)
        return compare(mesh, strategy, options, af.shard(step, mesh, strategy=strategy, inputs="global"), data,
                       ref, ref_losses)  # fmt: skip
    pp = mesh.axis_size("pp")
    if interleaved:  # 4 stages of 2 blocks on pp=2
        points = ["layers.2", "layers.4", "layers.6"]
        schedule, v = "interleaved_1f1b", 2
    else:
        points, schedule, v = ["layers.4"], "1f1b", 1
    assert pp * v == len(points) + 1
    step = af.train_step(loss, opt())
    step = af.autocast(step, "bf16") if "bf16" in options else step
    step = af.pipeline(step, mesh, microbatches=m, schedule=schedule,
                       split_points=points, stages_per_rank=v, sync_each_microbatch=True)  # fmt: skip
    step = af.shard(step, mesh, strategy=strategy, inputs="global")
    compare(mesh, strategy, options, step, data, ref, ref_losses)


class Reductions:
    """Counts FSDP2's per-unit gradient reductions while entered (its `foreach_reduce`, as its param group calls
    it: a reduce-scatter, and the replicas' all-reduce where it passes one), and those that all-reduce."""

    def __enter__(self):
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg

        self.module, self.real, self.count, self.all_reduced = pg, pg.foreach_reduce, 0, 0

        def counted(*args, **kwargs):
            self.count += 1
            self.all_reduced += int(
                args[9] is not None and bool(args[11])
            )  # all_reduce_group, all_reduce_grads
            return self.real(*args, **kwargs)

        pg.foreach_reduce = counted
        return self

    def __exit__(self, *exc):
        self.module.foreach_reduce = self.real


def compare(mesh, strategy, options, step, data, ref, ref_losses):
    state = step.init(make_model(options), seed=3)
    where = f"rank {mesh.rank} {strategy}:{':'.join(options)}"
    if "unfixed" in options:  # without the stage's zero-filled reduce-scatters: refused after the schedule
        from accelfn.transforms.pipeline import PipelineSync

        real, PipelineSync.stage_units = PipelineSync.stage_units, lambda self, stage: []
        try:
            step(state, data[0])
        except RuntimeError as e:
            assert "never all-reduced over the hsdp replicas" in str(e) and "layers." in str(e), str(e)
            print(f"{where}: GATED OK refused: {str(e)[:150]}", flush=True)
            return
        finally:
            PipelineSync.stage_units = real
        raise AssertionError(f"{where}: a unit's partial sum left unreduced was not refused")
    losses = []
    with Reductions() as reductions:
        for b in data:
            state, met = step(state, b)
            losses.append(met["loss"].item())
    diffs = {k: (full(v) - ref.params[k]).abs().max().item() for k, v in state.params.items()}
    worst = max(diffs, key=diffs.get)
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    tol = 1e-2 if "bf16" in options else 2e-5  # (bf16: the unsharded gradients, rounded per micro-batch)
    assert loss_diff <= tol, f"{where}: losses {losses} vs one process {ref_losses}"
    assert diffs[worst] <= tol, f"{where}: {worst} differs from one process by {diffs[worst]:.2e}"
    if "pp" in mesh.axis_names:  # each micro-batch reduces every unit of the stage (reached or not), once
        from accelfn.transforms.shard.fsdp import _param_groups

        units = sum(1 for g in _param_groups(step.model) if g.fsdp_params)
        m = int(next((o[2:] for o in options if o.startswith("m=")), "2"))
        want = (len(data) * m * units, len(data) * units if strategy == "hsdp" else 0)
        got = (reductions.count, reductions.all_reduced)
        assert got == want, f"{where}: {got} (reductions, all-reduced) not {want} ({units} units)"
    print(f"{where}: GATED OK loss diff {loss_diff:.1e} param diff {diffs[worst]:.1e}", flush=True)


def main():
    with af.Mesh(parse_mesh(sys.argv[1]), device="cpu") as mesh:
        for config in sys.argv[2:]:
            strategy, *options = config.split(":")
            check(mesh, strategy, options)


if __name__ == "__main__":
    main()
