"""What a real DeepSpeed ZeRO engine holds and communicates per rank, on CPU processes over gloo, read from
the engine itself and from the dry run's tracker on the real tensors; printed as JSON (one `ZERO_BYTES {...}`
line per stage and rank) for tests/test_dry_run_zero.py to compare with the dry run's model of the same step.

The step: tests/workers/zero_model.py's (examples/train_llama.py's tiny Llama by default, bf16 autocast,
adamw, clip 1.0).

- params: the storages of the module's bf16 params (ZeRO-1/2: the flat buffers they view), or of this rank's
  partitions `p.ds_tensor` and the params gathered now (ZeRO-3); before the first step (`params`), before each
  step (`params_per_step`) and after the last (`params_after`: ZeRO-3 keeps the params under
  `stage3_param_persistence_threshold` gathered between steps);
- grads: ZeRO-1 the full `.grad` of every param when the backward ends (`grads_full`: DeepSpeed reduces them
  then); the gradient partition the update reads (`grads`: the storages of `averaged_gradients`, ZeRO-1/2;
  ZeRO-3's `grad_partitions_flat_buffer`); the ipg bucket buffer is a communication buffer, not counted;
- optimizer: the fp32 master partitions (`single_partition_of_fp32_groups` / `fp32_partitioned_groups_flat`)
  and the torch optimizer's moments (not its 0-d step counters);
- comm: every collective of each of the steps, `[kind, group size, bytes]`, seen by the dry run's
  `StepTracker` on the real tensors (compiled blocks compiled, as in a job without the tracker).

argv: the ZeRO stages, e.g. 1,2,3 (one engine after the other); the steps (default 3); the options of
zero_model.py as JSON (`model`, `ds_config`, `accumulate`; default: the tiny Llama, DeepSpeed's defaults)."""

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

import accelfn as af
from accelfn.dryrun.tracker import StepTracker
from accelfn.transforms.shard.deepspeed import engine_of

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zero_model import batch_shape, zero_step  # noqa: E402


class CompiledTracker(StepTracker):
    """The dry run's tracker, under which torch.compile still compiles: with a dispatch mode on the stack Dynamo
    skips every frame, so compiled blocks would run eagerly and their gradients come ready in eager autograd's
    order, not the compiled backward's (ZeRO-2's buckets differ). The collectives run outside the compiled
    graphs (DeepSpeed's hooks and step), where the tracker sees each of them."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def storage_bytes(tensors: list[Any]) -> int:
    """The bytes of the distinct storages behind `tensors` (empty ones left out)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def params_bytes(engine: Any, stage: int) -> int:
    params = list(engine.module.parameters())
    return storage_bytes(params if stage < 3 else [p.ds_tensor for p in params] + params)


def measure(mesh: af.Mesh, stage: int, steps: int, options: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(0)
    step, state = zero_step(mesh, stage, options)
    engine = engine_of(step)
    opt = engine.optimizer
    report: dict[str, Any] = {"stage": stage, "rank": mesh.rank, "params": params_bytes(engine, stage)}
    if stage == 1:  # the full gradients, when the backward ends and DeepSpeed reduces them
        reduce = opt.reduce_gradients

        def reduce_gradients(*args: Any, **kwargs: Any) -> Any:
            grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
            report["grads_full"] = sum(nbytes(g) for g in grads)
            return reduce(*args, **kwargs)

        opt.reduce_gradients = reduce_gradients
    if stage < 3:
        engine_step = engine.step

        def step_and_read(*args: Any, **kwargs: Any) -> Any:  # the gradient partitions the update reads
            groups = opt.averaged_gradients.values()
            report["grads"] = storage_bytes([t for g in groups for t in (g if isinstance(g, list) else [g])])
            return engine_step(*args, **kwargs)

        engine.step = step_and_read
    comm, starts = [], []
    for _ in range(steps):
        starts.append(params_bytes(engine, stage))
        with CompiledTracker() as tracker:
            state, _ = step(state, torch.randint(0, 256, batch_shape(options)))
        comm.append([[c.kind, c.size, c.nbytes] for c in tracker.collectives])
    report["params_after"] = params_bytes(engine, stage)
    report["params_per_step"] = starts
    if stage < 3:
        masters = opt.single_partition_of_fp32_groups
    else:
        masters = opt.fp32_partitioned_groups_flat
        report["grads"] = storage_bytes([opt.grad_partitions_flat_buffer])
        report["persistent"] = sum(p.numel() for p in engine.module.parameters() if p.ds_persist)
    master = sum(nbytes(t) for t in masters)
    moments = sum(
        nbytes(t)
        for s in opt.optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0  # not the 0-d step counters
    )
    report.update(optimizer=master + moments, master=master, comm=comm)
    return report


def main() -> None:
    stages = [int(s) for s in sys.argv[1].split(",")]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    options = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    mesh = af.Mesh({"dp": -1}, device="cpu")
    for stage in stages:
        os.write(
            1, f"ZERO_BYTES {json.dumps(measure(mesh, stage, steps, options))}\n".encode()
        )  # one write per line
    mesh.close()


if __name__ == "__main__":
    main()
