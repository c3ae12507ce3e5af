"""DeepSpeed ZeRO in a dry run: DeepSpeed's engine cannot run on fake tensors (it builds flat buffers from
real storage and swaps the module's tensors), so the dry run lowers a `backend="deepspeed"` step onto torch
ops that hold and move per rank what DeepSpeed's ZeRO optimizer does, after checking the config as the real
lowering does. The model follows DeepSpeed 0.19's code paths (`stage_1_and_2.py`, `stage3.py`,
`partitioned_param_coordinator.py`, `parameter_offload.py`), with DeepSpeed's defaults or the values the
config sets; tests/test_dry_run_zero.py checks it against the real engine on 2 processes: every per-rank
byte count and every collective (kind, count, bytes) of the first three steps equal.

The phases (`ZeroPhases`) are `DeepSpeedPhases`' (the global count all-reduced before the first backward, the
loss after the step: one float64 all-reduce each); what the engine does in its backward and step is modelled
by the strategy:

- **ZeRO-1 and 2** (`ZeroSync`): the module in the engine's dtype, each optimizer param group's trainable
  params views into one flat buffer padded to a multiple of 2 x N elements (`nccl_start_alignment_factor`),
  rank r's partition its r-th 1/N. The gradients go through the ipg bucket (`reduce_bucket_size` elements,
  allocated at the first gradient, freed when the backward ends; two with `overlap_comm`): a gradient that
  does not fit flushes the bucket, which is **all-reduced** in the communication dtype in one call
  (`use_multi_rank_bucket_allreduce`, the default; without it one `dist.reduce` per partition owner); a
  gradient larger than the bucket is reduced on its own, split where the running size passes the bucket size.
  ZeRO-2 reduces in the gradient hooks, in the order gradients are ready, ZeRO-1 when the backward ends, in
  the flat order (with `overlap_comm` in the hooks too). A compiled block's backward makes its gradients ready
  at once, and the autograd engine accumulates them (and runs the hooks) in an order set by the order of the
  compiled function's inputs: Dynamo's is the call's tensors, then the params as the forward first uses them;
  the dry run's traced blocks (`accelfn/dryrun/compiled.py`) take the params first, in declaration order, so
  with small buckets ZeRO-2's buckets hold the same bytes in other groupings (the tiny Llama: 9 reduces a step
  on both sides, of other sizes). A rank keeps its partition's gradients in
  `grads_in_partition`, sized by the *whole* params that overlap its partition, plus zeros for the
  partition's padding. The step: an overflow check (a uint8 all-reduce, bf16 and fp16), the gradient norm (an
  fp32 all-reduce per group), the update of the fp32 master partition with the optimizer's moments of the
  partition (`single_partition_of_fp32_groups`), one `all_gather_into_tensor` of each group's flat buffer.
- **ZeRO-3** (`Zero3Sync`): every param partitioned into ceil(numel / N) elements per rank (its `ds_tensor`;
  between steps a param's `.data` is this 1-D partition), the fp32 master and moments of the partitions per
  sub-group (`sub_group_size`). DeepSpeed's module hooks are replicated: the root's forward pre-hook starts
  the step (`reset_step`); every module's forward pre-hook fetches its direct params (one all-gather of those
  not gathered: `all_gather_into_tensor`, coalesced when several), its forward hook releases them, autograd
  functions on its outputs and positional inputs fetch before and release after its backward; a param read
  during the forward while partitioned is gathered and joins the module running (`ZeROOrderedDict`'s external
  params). The first step records the trace (each fetch gathers, each release frees, persistent params
  included; two broadcasts check the empty trace); the next checks the recorded trace across the ranks (six
  broadcasts); from then on a fetch prefetches along the trace (`stage3_prefetch_bucket_size`,
  `stage3_max_live_parameters`; prefetched params no module fetched are released when the step or the trace
  ends), and a release keeps the params used again within `stage3_max_reuse_distance` elements and the
  persistent ones (at most `stage3_param_persistence_threshold` elements). The gradients go through the ipg
  bucket (`reduce_bucket_size`) and are reduce-scattered bucket by bucket (one `reduce_scatter_tensor` of the
  bucket's params, each padded to a multiple of N) into the gradient partitions
  (`grad_partitions_flat_buffer`). The step releases every param, all-reduces the gradient norm (float64, one
  per sub-group; fp16: an overflow check first), updates the master partitions and all-gathers the persistent
  params one by one, kept until the next step.
- stage 0: plain data parallel (ddp).

Per rank, `params` are the flat bf16 buffers (ZeRO-1/2) or the partitions and the params gathered when a step
starts (ZeRO-3: none at the first step, the persistent ones later); `grads` what DeepSpeed keeps of the
gradients: ZeRO-1 every param's `.grad` when the backward ends (reduced then), ZeRO-2 `grads_in_partition`,
ZeRO-3 its gradient partitions (the ipg bucket is a communication buffer); `optimizer` the fp32 master
partitions and the moments (not the torch optimizer's 0-d step counters). With optimizer offload the master
copy and the moments are host memory.

Differences: the persistent params' buffers (ZeRO-3) stay allocated through the update (DeepSpeed frees them
when the step starts and gathers them again after it) and ZeRO-3's ipg bucket and gradient partitions are
allocated for each step (DeepSpeed keeps them); offload's CPU gradient path is modelled as the device one.
Not modelled: ZeRO++ (hpZ, quantized weights and gradients), NVMe and parameter offload, `zero3` leaf
modules, round-robin gradients, an fp32 gradient accumulation dtype under bf16, and other DeepSpeed versions'
code paths (a note says which version is installed when it is not 0.19).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..... import dry_mode
from .....engine.contract import GradSync
from .....lowering import CompositionError
from .....module import move
from .....optim.schedules import as_schedule
from ..config import _get, make_optimizer, split_optimizer

if TYPE_CHECKING:
    from .....engine import Plan
    from ... import Shard

from .common import _DEFAULT_BUCKET, _DTYPES, ZeroPhases, _moments
from .zero3 import Zero3Sync, _zero3
from .zero12 import ZeroSync, _flat_groups

__all__ = ["lower_modelled", "ZeroSync", "Zero3Sync", "ZeroPhases"]


def _divides(config: dict[str, Any], stage: int, offload: bool) -> bool:
    """Whether the engine's update divides by the global count, as `phases.divides_at_update` finds it: not
    under fp16 (its dynamic loss scale), nor with DeepSpeed's BF16_Optimizer (ZeRO-1, bf16 with fp32 gradient
    accumulation, not offloaded)."""
    if _get(config, "fp16.enabled"):
        return False
    accum = str(_get(config, "data_types.grad_accum_dtype"))
    return not (
        _get(config, "bf16.enabled")
        and stage == 1
        and not offload
        and accum in ("fp32", "float32", "torch.float32")
    )


def lower_modelled(shard: Shard, plan: Plan, config: dict[str, Any]) -> GradSync:
    """The dry run's stand-in for `deepspeed.initialize` (see the module docs)."""
    mesh = shard.mesh
    stage = int(config["zero_optimization"]["stage"])
    offload = _get(config, "zero_optimization.offload_optimizer.device") in ("cpu", "nvme")
    if stage == 0:
        from ..ddp import lower_ddp

        dry_mode.note(
            "DeepSpeed ZeRO-0 is modelled by ddp; with bf16 DeepSpeed's BF16_Optimizer also keeps fp32 master "
            "params and gradients (8 bytes per parameter more than reported)"
        )
        return lower_ddp(shard, plan)
    dtype = (
        torch.bfloat16
        if _get(config, "bf16.enabled")
        else torch.float16
        if _get(config, "fp16.enabled")
        else None
    )
    module = move(plan.module, mesh.device)
    if dtype is not None:
        module.to(dtype)  # DeepSpeed's engine casts the module (its params are bf16 / fp16)
        plan.loss_scale = None  # DeepSpeed keeps the fp16 loss scale itself
    named = {n: p for n, p in module.named_parameters() if p.requires_grad}
    if not named:
        raise ValueError("Step.init(): the model has no trainable parameters (all requires_grad=False)")
    assert plan.optimizer is not None
    optimizer, _ = make_optimizer(plan.optimizer, named, offload=False)  # the real lowering's errors too
    hp, _ = split_optimizer(plan.optimizer)
    if offload and hp is not None and hp["name"] not in ("adam", "adamw"):
        raise CompositionError(
            f"DeepSpeed optimizer offload needs adam or adamw (DeepSpeedCPUAdam), got {hp['name']}"
        )
    plan.autocast_device_type = mesh.device_type
    import deepspeed  # imported by the real lowering already

    if not str(deepspeed.__version__).startswith("0.19."):
        dry_mode.note(
            f"DeepSpeed {deepspeed.__version__} is installed; the dry run models DeepSpeed 0.19's ZeRO code "
            "paths (its bucketing and ZeRO-3's parameter coordinator may differ in this version)"
        )
    param_groups = [list(g["params"]) for g in optimizer.param_groups]
    world = mesh.world_size
    zero = config["zero_optimization"]
    model_dtype = dtype or torch.float32
    comm = config.get("communication_data_type")
    fp16_scale = (
        2.0 ** int(_get(config, "fp16.initial_scale_power") or 16) if dtype == torch.float16 else None
    )
    common: dict[str, Any] = dict(
        group=mesh.grad_group(),
        world=world,
        rank=mesh.grad_rank,
        dtype=model_dtype,
        comm_dtype=_DTYPES.get(str(comm), model_dtype) if comm else model_dtype,
        clip=float(config.get("gradient_clipping") or 0.0),
        fp16_scale=fp16_scale,
        moments=_moments(dict(hp) if hp is not None else None),
        offload=offload,
        reduce_bucket=int(zero.get("reduce_bucket_size", _DEFAULT_BUCKET)),
        lr=as_schedule(hp["lr"] if hp is not None else 0.0),
        loss_has_count=None,
        divides=_divides(config, stage, offload),
    )
    if stage == 3:
        ps, sub_groups = _zero3(module, config, param_groups, world)
        sync: GradSync = Zero3Sync(
            ps=ps,
            sub_groups=sub_groups,
            overflow_check=dtype == torch.float16,
            prefetch_bucket=int(
                zero.get("stage3_prefetch_bucket_size", zero.get("prefetch_bucket_size", 5e7))
            ),
            max_live=int(zero.get("stage3_max_live_parameters", zero.get("max_live_parameters", 1e9))),
            max_reuse=int(zero.get("stage3_max_reuse_distance", zero.get("max_reuse_distance", 1e9))),
            sequential=bool(zero.get("allgather_sequential", False)),
            **common,
        )
        sync.register(module)  # type: ignore[attr-defined]
        what = "params all-gathered per module before its forward and backward, gradients reduce-scattered"
    else:
        bf16_check = _get(config, "bf16.check_grad_overflow")
        overlap = bool(zero.get("overlap_comm", False))
        sync = ZeroSync(
            stage=stage,
            groups=_flat_groups(module, param_groups, world, bool(zero.get("parameter_alignment", False))),
            overflow_check=dtype == torch.float16 or (dtype == torch.bfloat16 and bf16_check is not False),
            hook_reduces=stage == 2 or overlap,
            n_buffers=2 if overlap else 1,
            multi_rank_allreduce=bool(zero.get("use_multi_rank_bucket_allreduce", True)),
            **common,
        )
        what = "gradients all-reduced bucket by bucket, the updated partitions all-gathered"
    dry_mode.note(
        f"DeepSpeed ZeRO-{stage} is modelled (its engine does not run on fake tensors): DeepSpeed 0.19's "
        f"partitioning and collectives ({what})"
    )
    plan.notes.append(
        f"deepspeed ZeRO-{stage}{' + optimizer offload' if offload else ''} (modelled) over {world} ranks"
    )
    return sync
