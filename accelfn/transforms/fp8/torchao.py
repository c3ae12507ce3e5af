"""torchao backend of `af.autocast_fp8`: swap eligible Linear layers for `Float8Linear`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from ...engine import Plan
    from . import ModuleFilter


def convert(plan: Plan, keep: ModuleFilter, recipe: str, emulate: bool) -> int:
    """Convert `plan.module` in place; returns the number of converted layers."""
    from ... import dry_mode
    from . import _device_supports_fp8

    if not emulate and not _device_supports_fp8(plan):
        device = dry_mode.modelled_device() or plan.device  # in a dry run, the device it models
        raise RuntimeError(
            f"autocast_fp8(backend='torchao'): the model computes on {device}, which has no FP8 matmul support "
            "(needs an NVIDIA GPU of compute capability 8.9+, e.g. H100). Pass emulate=True to run FP8 "
            "numerics emulated (slow; for tests), or drop autocast_fp8."
        )
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ImportError("autocast_fp8(backend='torchao') needs torchao: pip install 'accelfn[fp8]'") from e

    import dataclasses

    config = Float8LinearConfig.from_recipe_name(recipe)
    if emulate:
        config = dataclasses.replace(config, emulate=True)
    shard = next((t for t in plan.transforms if t.kind == "shard"), None)
    fsdp = shard is not None and getattr(shard, "strategy", "") in ("fsdp", "hsdp")
    if fsdp and recipe == "tensorwise":  # all-gather weights in fp8; refresh their scales after each update
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        plan.after_update.append(precompute_float8_dynamic_scale_for_fsdp)
        plan.notes.append("fp8 all-gather under fsdp")
    before = sum(isinstance(m, nn.Linear) for m in plan.module.modules())
    convert_to_float8_training(plan.module, config=config, module_filter_fn=keep)
    from torchao.float8.float8_linear import Float8Linear

    converted = 0
    for m in plan.module.modules():
        if isinstance(m, Float8Linear):
            converted += 1
            if not getattr(m, "_accelfn_autocast_input", False):
                m.register_forward_pre_hook(autocast_input)
                m._accelfn_autocast_input = True
    assert converted <= before
    return converted


def autocast_input(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """A `Float8Linear`'s input in the autocast dtype of its device, where autocast is on and not CUDA's.

    torchao's `Float8Linear.forward` repeats F.linear's autocast cast for CUDA only (`torch.is_autocast_enabled()`,
    the GPU's): under CPU autocast (emulated fp8) its input stayed fp32 and its output fp32, where under fsdp
    (FSDP2's bf16 `MixedPrecisionPolicy` casts the inputs) they were bf16, so ddp and fsdp trained different
    numerics on the CPU. With this pre-hook every device casts as CUDA does, and ddp equals fsdp."""
    import torch

    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return None
    kind = x.device.type
    if kind in ("cuda", "meta") or not torch.is_autocast_enabled(kind):
        return None  # torchao casts under CUDA autocast itself
    dtype = torch.get_autocast_dtype(kind)
    return None if x.dtype == dtype else (x.to(dtype), *args[1:])
