"""Dropping what a DeepSpeed step that raised left in its engine (`GradSync.abandon`).

The engine keeps a step's gradients in its own state between micro-batches: its micro-step counter (which
says which `engine.step()` is the update), ZeRO-1/2's gradient buckets, accumulated partitions (and ZeRO-Offload's
host copies), ZeRO-3's gradient partitions, gathered parameters and module trace, and the backward-hook
counters of all stages. A step that raises in micro-batch k of n (the loss, a forward or a backward) leaves
the first k-1 micro-batches' gradients there and the counter k-1 micro-batches ahead: the next step's
update would land one micro-batch early, on gradients of both steps. `drop_partial_step` puts the engine
back where it was before that step, as DeepSpeed's own overflow path (fp16's skipped step) drops gradients:
locally, with no collective.

Only a step that raised before its update: one that raised in it (the optimizer's step, partway through ZeRO's
per-group update, the lr scheduler) may have updated some or all of the parameters and moments, which no
gradient reset undoes; the strategy refuses further steps instead (`DeepSpeedPhases.abandon`).

Not reset: a parameter that gets no gradient in the next step keeps ZeRO-3's last gradient partition, as it
would after any step. What cannot be reset here (an optimizer this module does not know, a DeepSpeed whose
internals moved) raises; the strategy then refuses further steps rather than train on the leftovers.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["drop_partial_step", "module_stack_depth"]


def module_stack_depth() -> int:
    """The depth of ZeRO-3's forward module stack (`parameter_offload.FWD_MODULE_STACK`), to record when a step
    begins: one list per process, holding every ZeRO-3 engine's root module (pushed at its creation) below the
    modules whose forward is running."""
    from deepspeed.runtime.zero import parameter_offload

    return len(getattr(parameter_offload, "FWD_MODULE_STACK", ()))


def drop_partial_step(engine: Any, micro_steps: int, stack_depth: int) -> None:
    """Reset `engine` to its state before a step that raised: the micro-step counter back to `micro_steps`
    (its value when the step began), the optimizer's partial gradients and per-backward state dropped, ZeRO-3's
    module stack cut back to `stack_depth` (`module_stack_depth()` when the step began)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    opt = engine.optimizer
    # ZeRO-0: the client's torch optimizer (fp32, bf16 gradients) or DeepSpeed's fp16 / bf16 wrappers, whose
    # only held gradients zero_grad drops
    plain = (torch.optim.Optimizer, BF16_Optimizer, FP16_Optimizer, FP16_UnfusedOptimizer)
    if not isinstance(opt, (DeepSpeedZeroOptimizer_Stage3, DeepSpeedZeroOptimizer, *plain)):
        raise TypeError(
            f"the engine's optimizer is a {type(opt).__name__}, whose held gradients accelfn cannot drop"
        )
    engine.micro_steps = micro_steps
    hooks = getattr(opt, "_backward_hook_state", None)  # (DeepSpeed >= 0.18: all ZeRO optimizers, bf16's)
    if hooks is not None:  # a backward cut short stays "active" (its epilogue never ran): not the next one
        hooks.backward_active_depth = 0
        hooks.remaining_grad_acc_hooks = 0
        hooks.reset_for_new_step()
    if isinstance(opt, DeepSpeedZeroOptimizer_Stage3):
        _drop_zero3(engine, opt, stack_depth)
    elif isinstance(opt, DeepSpeedZeroOptimizer):
        _drop_zero12(opt)
    # the held gradients themselves: the params' .grad (ZeRO-0's accumulation; first, as ZeRO-3's zero_grad
    # records a CPU gradient on the CPU accelerator's stream, which fails), fp16/bf16 optimizers' fp32
    # accumulators, ZeRO-1/2's grad_accum, ZeRO-3's micro-step id (the next backward copies, not adds)
    engine.zero_grad()
    opt.zero_grad(set_to_none=True)
    timers = getattr(getattr(engine, "timers", None), "timers", {})  # (wall_clock_breakdown) cut short
    for timer in timers.values():
        if getattr(timer, "started_", False):
            timer.reset()


def _drop_zero12(opt: Any) -> None:
    """ZeRO-1/2: the micro-step id (the first backward copies), the in-flight bucket of a backward cut short,
    and the accumulated partitions, as `DeepSpeedZeroOptimizer.step` drops them on an overflow."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero import stage_1_and_2

    # overlap_comm: a backward cut short may leave a bucket's reduction in flight on `reduction_stream` (and its
    # copies into the bucket on other streams), which would write into the buffers released below; wait for all
    # of them, as the backward's own epilogue (`independent_gradient_partition_epilogue`) does before it clears
    # reduced gradients. (Untested: on CPU, the tests' device, every op is synchronous and there is no stream.)
    if getattr(opt, "overlap_comm", False) and not get_accelerator().resolves_data_dependency():
        get_accelerator().synchronize()
    opt.micro_step_id = getattr(stage_1_and_2, "INITIAL_MICRO_STEP_ID", -1)
    for bucket in getattr(opt, "ipg_buckets", {}).values():
        bucket.clear()
    if hasattr(opt, "_release_ipg_buffers"):
        opt._release_ipg_buffers()
    getattr(opt, "extra_large_param_to_reduce", {}).clear()
    getattr(opt, "previous_reduced_grads", {}).clear()
    for i in range(len(opt.params_already_reduced)):
        opt.params_already_reduced[i] = False
    if hasattr(opt, "_release_preflattened_grad_buffers"):
        opt._release_preflattened_grad_buffers()
    if opt.cpu_offload:
        opt.reset_cpu_buffers()
        opt._offload_accumulated_param_ids = set()
    for k in opt.averaged_gradients:
        opt.averaged_gradients[k] = None
    for k in getattr(opt, "all_grad_tensors", {}):
        opt.all_grad_tensors[k] = None


def _drop_zero3(engine: Any, opt: Any, stack_depth: int) -> None:
    """ZeRO-3: the parameters a forward or backward cut short left gathered, a module trace recorded over
    it, the modules it left on the module stack and "in forward", the in-flight gradient bucket and the
    accumulated partitions (as its overflow clean-up)."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero import parameter_offload

    if not get_accelerator().resolves_data_dependency():  # reductions of a backward cut short, in flight
        opt.reduce_and_partition_stream.synchronize()
    offload = opt.parameter_offload
    coordinator = offload.get_param_coordinator()
    if hasattr(coordinator, "release_backward_leftovers"):
        coordinator.release_backward_leftovers()
    if coordinator.is_record_trace():  # the trace being recorded stopped where the step raised
        coordinator._invalidate_trace()
    # a forward cut short skipped the engine's `_forward_epilogue`, which takes every module out of "forward"
    # (`ZeROOrderedDict._in_forward`): else the next access to one of their partitioned params (accelfn's own
    # `engine.module.get_parameter` in the next step's check) gathers it and registers it as an external param
    # of the module on top of the stack: kept gathered, and, when that is another engine's root, in that
    # engine's trace (its next step fails: "tracing error")
    for module in engine.module.modules():
        if getattr(module._parameters, "_in_forward", False):
            module._parameters._in_forward = False
    offload.partition_all_parameters()  # engine.empty_partition_cache(): every gathered param released
    # the modules whose forward never returned: pushed since the step began. The stack is the process's, shared
    # by every ZeRO-3 engine (each keeps its root module there from its creation): cut it back to its depth at
    # the step's start, not to this engine's root (that would drop the root of an engine created after it)
    stack = getattr(parameter_offload, "FWD_MODULE_STACK", None)
    # this engine's modules above the step's start (not another engine's root pushed since)
    if stack is not None:
        own = {id(m) for m in engine.module.modules()}
        stack[stack_depth:] = [m for m in stack[stack_depth:] if id(m) not in own]
    for bucket in opt.ipg_buckets.values():
        if hasattr(bucket, "clear_params"):
            bucket.clear_params()
        else:
            bucket.clear()
    for k in opt.params_already_reduced:
        opt.params_already_reduced[k] = False
    if opt.offload_optimizer:
        opt.reset_cpu_buffers()
    else:
        opt.averaged_gradients = {}
    if hasattr(opt, "_offload_boundary_param_ids"):
        opt._offload_boundary_param_ids = set()
