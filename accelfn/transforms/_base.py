"""Shared base of the combinators' transform records (see `accelfn.lowering`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..lowering import CompositionError

if TYPE_CHECKING:
    from ..engine import Plan
    from ..lowering import Transform
    from ..state import TrainState


class TransformBase:
    """Defaults: no conflicts, no state of its own."""

    kind: str = ""

    def describe(self) -> str:
        return f"{self.kind}()"

    def check(self, others: Sequence[Transform]) -> None:
        return None

    def lower(self, plan: Plan) -> None:
        return None

    def init_state(self, plan: Plan, state: TrainState) -> TrainState:
        return state


def conflict(a: Any, b: Any, why: str) -> CompositionError:
    return CompositionError(f"{a.describe()} cannot be combined with {b.describe()}: {why}")


def find(others: Sequence[Any], kind: str) -> Any:
    return next((o for o in others if o.kind == kind), None)
