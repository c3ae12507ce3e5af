"""The experts of an MoE model under `af.autocast_fp8`: their grouped GEMMs in fp8 through torchao's
`moe_training` kernels (`accelfn.moe.experts.fp8_grouped`), the recipe chosen per platform
(`Platform.fp8_grouped_mm()`: fp8 rowwise on CUDA sm90, mxfp8 on sm100; emulated mxfp8 where `emulate=True`),
a named refusal where none runs, or left in their dtype with `fp8_experts=False`. A dry run of a GPU with fp8
grouped GEMMs models them (`torch._scaled_grouped_mm` on fp8 fake tensors: counted at the fp8 peak).

The experts modules are those of the model's expert-parallel plan (its own, `config.base_model_ep_plan`, or the
`ep_plan` given to `af.shard`); their stacked weights stay as they are (fp32 master weights, checkpoints and
sharding unchanged): the GEMMs quantize them and the rows on the fly. Without an `ep` axis their forward becomes
the dispatching one over one rank, so one process runs the same fp8 experts as ep ranks do.

Example (one process, emulated: a Qwen3-MoE whose experts' dims take mxfp8's 32-blocks):
    >>> import torch, accelfn as af
    >>> from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    >>> cfg = Qwen3MoeConfig(vocab_size=32, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
    ...                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_experts=4,
    ...                      num_experts_per_tok=2)
    >>> step = af.autocast_fp8(af.train_step(lambda m, b: m(input_ids=b).logits.sum(), af.optim.sgd(0.1)),
    ...                        backend="torchao", emulate=True)
    >>> _ = step.init(Qwen3MoeForCausalLM(cfg))
    >>> "1 experts module(s) with grouped GEMMs in mxfp8_emulated" in repr(step)
    True
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import nn

from ... import dry_mode
from .._base import find

if TYPE_CHECKING:
    from ...engine import Plan

__all__ = ["experts_modules", "fp8_recipe", "lower_experts"]

_KERNELS = (
    "torchao's moe_training runs fp8 rowwise on CUDA sm90 (H100/H200, with triton) and mxfp8 on sm100 (B200)"
)


def experts_modules(plan: Plan) -> dict[str, nn.Module]:
    """The model's experts modules (`ep_dispatch_experts` entries of its expert-parallel plan), by name."""
    from ..shard.expert_parallel import expert_params, model_ep_plan

    ep = find(plan.transforms, "expert_parallel")
    given = getattr(ep, "plan", None)
    raw = dict(given) if given is not None else model_ep_plan(plan.module)
    if not raw:
        return {}
    try:
        owners = sorted(set(expert_params(plan.module, raw).values()))
    except ValueError:  # a plan that does not fit: expert parallel names the entry
        return {}
    return {name: plan.module.get_submodule(name) for name in owners}


def fp8_recipe(plan: Plan, emulate: bool) -> str | None:
    """The recipe of the experts' fp8 grouped GEMMs: "mxfp8_emulated" where the user asks for emulation, else the
    platform's (`Platform.fp8_grouped_mm()`), or None where it has none."""
    if emulate:
        return "mxfp8_emulated"
    if (
        dry_mode.modelled_device() is not None
    ):  # a dry run of a GPU job: that device's, modelled on fake tensors
        grouped = dry_mode.grouped_mm_dtypes()  # (torchao's kernels do not run on them: `_ModelledFP8`)
        return "fp8_modelled" if dry_mode.fp8_support(plan.platform.kind) and grouped else None
    return plan.platform.fp8_grouped_mm()


def _unfit(module: nn.Module, recipe: str) -> str | None:
    """Why the built-in fp8 path does not take this experts module (None: it does)."""
    from ...moe.experts import FP8_ALIGN

    if getattr(module, "ep_local_forward", None) is not None:
        return "its own ep_local_forward"
    weights = [getattr(module, n, None) for n in ("gate_up_proj", "down_proj")]
    if not all(isinstance(w, torch.Tensor) and w.ndim == 3 for w in weights):
        return "not the fused gate_up_proj/down_proj layout"
    align = FP8_ALIGN[recipe]
    dims = (*weights[0].shape[1:], weights[1].shape[2])  # type: ignore[union-attr]  # 2F, D, F
    if any(d % align for d in dims):
        return f"dims {tuple(dims)} not multiples of {align}"
    return None


def lower_experts(plan: Plan, *, emulate: bool, fp8_experts: bool) -> str:
    """Put the experts' grouped GEMMs in fp8 (see the module docs); returns what `print(step)` says of them.
    RuntimeError where the platform has no fp8 grouped GEMM and `fp8_experts` is left True."""
    from ...moe import AllToAllDispatcher, ep_forward
    from ...moe.experts import FP8_RECIPE

    owners = experts_modules(plan)
    if not owners:
        return ""
    first = next(iter(owners.values()))
    dtype = str(plan.autocast_dtype or next(first.parameters()).dtype).removeprefix("torch.")
    what = f"the experts ({len(owners)} modules of stacked expert weights)"
    if not fp8_experts:
        return f"; {what} stay in {dtype} (fp8_experts=False)"
    recipe = fp8_recipe(plan, emulate)
    if recipe is None:
        device = dry_mode.modelled_device() or plan.device  # in a dry run, the device it models
        raise RuntimeError(
            f"autocast_fp8: the model's experts ({next(iter(owners))} and {len(owners) - 1} more) compute with grouped "
            f"GEMMs, which have no fp8 kernel on {device} ({_KERNELS}). Pass fp8_experts=False to keep the experts "
            f"in {dtype} (the Linear layers still in fp8), or emulate=True to emulate mxfp8 (slow; for tests)"
        )
    done, kept = [], {}
    for name, module in owners.items():
        why = _unfit(module, recipe)
        if why is not None:
            kept[name] = why
            continue
        setattr(module, FP8_RECIPE, recipe)
        done.append(name)
        if not isinstance(module.forward, functools.partial):  # one process: the dispatching forward over one
            # rank (expert parallel, lowered later, sets its own; accelfn.moe.set_capacity's already is one)
            experts = int(module.gate_up_proj.shape[0])  # type: ignore[union-attr,index]
            one_rank = AllToAllDispatcher(None, experts, 1)
            module.forward = functools.partial(ep_forward, module, one_rank)  # type: ignore[method-assign]
    how = (
        "fp8 (modelled: torchao's kernels do not run on fake tensors)" if recipe == "fp8_modelled" else recipe
    )
    note = f"; {len(done)} experts module(s) with grouped GEMMs in {how} (torchao)" if done else ""
    if kept:
        name, why = next(iter(kept.items()))
        note += f"; {len(kept)} experts module(s) kept in {dtype} ({why}: e.g. {name})"
    return note
