"""`af.autocast_fp8`: FP8 Linear layers for training, on torchao or Transformer Engine.

- `backend="torchao"`: eligible `nn.Linear` layers (both dims divisible by 16; the first and last Linear
  kept in high precision unless `module_filter` says otherwise) become torchao `Float8Linear`; recipes
  `"tensorwise"` (default), `"rowwise"`, `"rowwise_with_gw_hp"`. Needs FP8 hardware (an NVIDIA GPU of
  compute capability 8.9+: Ada, Hopper, Blackwell), or `emulate=True` for CPU tests.
- `backend="te"`: `nn.Linear` -> `transformer_engine.pytorch.Linear`, the forward under
  `te.fp8_autocast` with a `DelayedScaling` recipe (default, `recipe="delayed"`) or current scaling
  (`recipe="current"`), amax reduced over the mesh's data-parallel group under `af.shard`; TE's
  scaling state travels in `state.extra["te_fp8"]`. NVIDIA only; imported lazily.
- `backend="auto"`: TE when installed on an FP8-capable GPU, else torchao; `repr(step)` says which.

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

from ..._typecheck import checked
from ...step import Step
from .._base import TransformBase, conflict, find

if TYPE_CHECKING:
    from ...engine import Plan
    from ...lowering import Transform
    from ...state import TrainState

__all__ = ["autocast_fp8", "default_filter", "RECIPES"]

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
BACKENDS = ("auto", "torchao", "te")
ModuleFilter = Callable[[nn.Module, str], bool]


def default_filter(model: nn.Module) -> ModuleFilter:
    """Linear layers whose dims are divisible by 16, except the first and the last Linear of the model."""
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    edges = {linears[0], linears[-1]} if linears else set()

    def keep(module: nn.Module, fqn: str) -> bool:
        return (
            isinstance(module, nn.Linear)
            and module.in_features % 16 == 0
            and module.out_features % 16 == 0
            and fqn not in edges
        )

    return keep


def _device_supports_fp8(plan: Plan) -> bool:
    """Whether the device the model will compute on (`plan.device`, not where it was built) has FP8 matmuls."""
    try:
        return bool(plan.platform.supports_fp8())
    except (RuntimeError, ValueError):
        return False


def _te_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


@attrs.frozen
class AutocastFP8(TransformBase):
    backend: str = "auto"
    recipe: str | None = None
    module_filter: ModuleFilter | None = None
    emulate: bool = False
    kind: str = "fp8"

    def describe(self) -> str:
        args = [f"backend={self.backend!r}"]
        if self.recipe:
            args.append(f"recipe={self.recipe!r}")
        if self.emulate:
            args.append("emulate=True")
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
        backend = self.choose(plan)
        if self.backend == "auto":
            plan.notes.append(f"autocast_fp8: chose {backend}")
        keep = self.module_filter or default_filter(plan.module)
        if backend == "torchao":
            from .torchao import convert

            n = convert(plan, keep, self.recipe or "tensorwise", self.emulate)
        else:
            from .te import convert as te_convert

            n = te_convert(plan, keep, self.recipe)
        plan.notes.append(f"{n} Linear layers in fp8 ({backend})")

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
) -> Step:
    """Train eligible Linear layers in FP8 (see the module docs for backends and recipes).

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
    return step.with_transform(AutocastFP8(backend, recipe, module_filter, emulate))
