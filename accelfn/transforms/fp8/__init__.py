"""`af.autocast_fp8`: FP8 Linear layers for training, on torchao or Transformer Engine.

- `backend="torchao"`: eligible `nn.Linear` layers (both dims divisible by 16; the first and last Linear
  kept in high precision; on FP8 hardware only shapes that train faster in FP8, `gains_from_fp8`, so FP8 never
  makes a model slower by default; `module_filter` overrides all of it) become torchao `Float8Linear`; which
  layers stayed in high precision, and why, is in `repr(step)` and `step.plan.fp8_skipped`; recipes
  `"tensorwise"` (default), `"rowwise"`, `"rowwise_with_gw_hp"`. Needs FP8 hardware (an NVIDIA GPU of
  compute capability 8.9+: Ada, Hopper, Blackwell), or `emulate=True` for CPU tests.
- `backend="te"`: `nn.Linear` -> `transformer_engine.pytorch.Linear`, the forward under
  `te.fp8_autocast` with a `DelayedScaling` recipe (default, `recipe="delayed"`) or current scaling
  (`recipe="current"`), amax reduced over the mesh's data-parallel group under `af.shard`; TE's
  scaling state travels in `state.extra["te_fp8"]`. NVIDIA only; imported lazily.
- `backend="auto"`: TE when installed on an FP8-capable GPU, else torchao; `repr(step)` says which.
- MoE experts (stacked 3-D weights, not Linear layers; any backend): their grouped GEMMs through torchao's fp8
  grouped GEMM, fp8 rowwise on sm90, mxfp8 on sm100, emulated mxfp8 with `emulate=True`; a RuntimeError on a
  platform with none, unless `fp8_experts=False` keeps them in their dtype (`accelfn.transforms.fp8.experts`).

Example:
    >>> import torch, accelfn as af
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)])
    >>> step = af.autocast_fp8(af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.sgd(0.1)),
    ...                        backend="torchao", emulate=True)
    >>> state = step.init(net)
    >>> [type(m).__name__ for m in step.model]
    ['Linear', 'Float8Linear', 'Linear']
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
from torch import nn

from ... import dry_mode
from ..._typecheck import checked
from ...step import Step
from .._base import TransformBase, conflict, find

if TYPE_CHECKING:
    from ...engine import Plan
    from ...lowering import Transform
    from ...state import TrainState

__all__ = ["autocast_fp8", "default_filter", "gains_from_fp8", "RECIPES"]

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
BACKENDS = ("auto", "torchao", "te")
ModuleFilter = Callable[[nn.Module, str], bool]


def gains_from_fp8(in_features: int, out_features: int, recipe: str = "tensorwise") -> bool:
    """Whether a Linear of this shape trains faster in FP8 than in bf16 on an H100 (torchao's measured rule).

    FP8 adds casts and scale computations around each matmul; below these sizes they cost more than the faster
    matmul saves (torchao's per-shape benchmarks; its `_auto_filter_for_recipe`). K = in_features,
    N = out_features.

    Example:
        >>> from accelfn.transforms.fp8 import gains_from_fp8
        >>> gains_from_fp8(1024, 1024), gains_from_fp8(2048, 2048), gains_from_fp8(1024, 2816, "rowwise")
        (False, True, False)
    """
    k, n = in_features, out_features
    if recipe == "tensorwise":
        return not (k <= 4096 and n <= 1024)
    # rowwise recipes: the per-row scales cost more
    return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))


def default_filter(
    model: nn.Module,
    recipe: str = "tensorwise",
    *,
    speed: bool = False,
    skipped: dict[str, str] | None = None,
) -> ModuleFilter:
    """Linear layers whose dims are divisible by 16, except the first and the last Linear of the model; with
    `speed`, only those whose shape gains from FP8 (`gains_from_fp8`). Why a layer stays in high precision is
    recorded in `skipped` (name -> reason)."""
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    edges = {linears[0], linears[-1]} if linears else set()
    why = skipped if skipped is not None else {}

    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        if fqn in edges:
            why[fqn] = "first/last Linear"
        elif module.in_features % 16 or module.out_features % 16:
            why[fqn] = "dims not divisible by 16"
        elif speed and not gains_from_fp8(module.in_features, module.out_features, recipe):
            why[fqn] = f"too small to gain ({module.in_features}x{module.out_features}, {recipe})"
        else:
            return True
        return False

    return keep


def _device_supports_fp8(plan: Plan) -> bool:
    """Whether the device the model will compute on (`plan.device`, not where it was built) has FP8 matmuls; in a
    dry run, the device it models (`dry_mode.fp8_support`), not the host it executes on."""
    modelled = dry_mode.fp8_support(plan.platform.kind)
    if modelled is not None:
        return modelled
    try:
        return bool(plan.platform.supports_fp8())
    except (RuntimeError, ValueError):
        return False


def _skipped_note(skipped: dict[str, str]) -> str:
    if not skipped:
        return ""
    by_reason: dict[str, list[str]] = {}
    for name, reason in skipped.items():
        by_reason.setdefault(reason.split(" (")[0], []).append(name)
    parts = [f"{len(names)} {reason} (e.g. {names[0]})" for reason, names in by_reason.items()]
    return "; kept in high precision: " + ", ".join(parts)


def _te_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


@attrs.frozen
class AutocastFP8(TransformBase):
    backend: str = "auto"
    recipe: str | None = None
    module_filter: ModuleFilter | None = None
    emulate: bool = False
    fp8_experts: bool = True
    kind: str = "fp8"

    def describe(self) -> str:
        args = [f"backend={self.backend!r}"]
        if self.recipe:
            args.append(f"recipe={self.recipe!r}")
        if self.emulate:
            args.append("emulate=True")
        if not self.fp8_experts:
            args.append("fp8_experts=False")
        return f"autocast_fp8({', '.join(args)})"

    def check(self, others: Sequence[Transform]) -> None:
        ac = find(others, "autocast")
        if ac is not None and getattr(ac, "dtype", None) == torch.float16:
            raise conflict(self, ac, "FP8 training needs bf16 (or fp32) for the rest of the model, not fp16")

    def choose(self, plan: Plan) -> str:
        if self.backend != "auto":
            return self.backend
        if _te_available() and _device_supports_fp8(plan) and not self.emulate:
            return "te"
        return "torchao"

    def lower(self, plan: Plan) -> None:
        from .experts import lower_experts

        backend = self.choose(plan)
        experts = lower_experts(plan, emulate=self.emulate, fp8_experts=self.fp8_experts)  # (refuses first)
        if self.backend == "auto":
            plan.notes.append(f"autocast_fp8: chose {backend}")
        skipped: dict[str, str] = {}
        # on FP8 hardware, only layers whose shapes gain (FP8 never makes a model slower by default); emulated,
        # only the numerics matter
        speed = not self.emulate and backend == "torchao"
        keep = self.module_filter or default_filter(
            plan.module, self.recipe or "tensorwise", speed=speed, skipped=skipped
        )
        if backend == "torchao":
            from .torchao import convert

            n = convert(plan, keep, self.recipe or "tensorwise", self.emulate)
        else:
            from .te import convert as te_convert

            n = te_convert(plan, keep, self.recipe)
        plan.notes.append(f"{n} Linear layers in fp8 ({backend})" + _skipped_note(skipped) + experts)
        plan.fp8_skipped = skipped

    def init_state(self, plan: Plan, state: TrainState) -> TrainState:
        if not any(type(m).__module__.startswith("transformer_engine") for m in plan.module.modules()):
            return state
        from .te import extra_state

        return state.replace(extra={**state.extra, "te_fp8": extra_state(plan.module)})


@checked
def autocast_fp8(
    step: Step,
    *,
    backend: str = "auto",
    recipe: str | None = None,
    module_filter: Callable[..., Any] | None = None,
    emulate: bool = False,
    fp8_experts: bool = True,
) -> Step:
    """Train eligible Linear layers in FP8 (see the module docs for backends and recipes), and an MoE model's
    experts' grouped GEMMs (`accelfn.transforms.fp8.experts`): in fp8 where the platform has them, refused where
    it has none unless `fp8_experts=False`, which keeps the experts in their dtype.

    Example:
        >>> import torch, accelfn as af
        >>> net = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)])
        >>> base = af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.sgd(0.1))
        >>> step = af.autocast_fp8(base, backend="torchao", emulate=True)  # emulate: no FP8 hardware here
        >>> _ = step.init(net)
        >>> [type(m).__name__ for m in step.model]  # the first and last Linear stay in high precision
        ['Linear', 'Float8Linear', 'Linear']
    """
    if backend not in BACKENDS:
        raise ValueError(f"autocast_fp8: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torchao" and recipe is not None and recipe not in RECIPES:
        raise ValueError(f"autocast_fp8: torchao recipe must be one of {RECIPES}, got {recipe!r}")
    return step.with_transform(AutocastFP8(backend, recipe, module_filter, emulate, fp8_experts))
