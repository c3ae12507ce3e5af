"""Optimizers in the optax style: `GradientTransformation(init, update)`, `chain`, schedules.

Example:
    >>> import accelfn as af
    >>> tx = af.optim.chain(af.optim.clip_by_global_norm(1.0),
    ...                     af.optim.adamw(af.optim.warmup_cosine(3e-4, warmup=100, total=10_000)))
"""

from .adam import AdamState, adam, adamw
from .base import (
    EmptyState,
    GradientTransformation,
    apply_gradients,
    apply_updates,
    chain,
    identity,
    learning_rate,
)
from .clip import clip_by_global_norm, global_norm
from .freeze import freeze, set_to_zero
from .lion import LionState, lion
from .masked import MaskedState, masked
from .schedules import (
    Schedule,
    WarmupPastTotalWarning,
    as_schedule,
    constant,
    cosine,
    from_lambda,
    inverse_sqrt,
    linear,
    warmup_constant,
    warmup_cosine,
    warmup_cosine_restarts,
    warmup_linear,
    warmup_polynomial,
)
from .sgd import SgdState, sgd

__all__ = [
    "GradientTransformation",
    "EmptyState",
    "AdamState",
    "SgdState",
    "LionState",
    "MaskedState",
    "Schedule",
    "WarmupPastTotalWarning",
    "chain",
    "identity",
    "apply_updates",
    "apply_gradients",
    "learning_rate",
    "adam",
    "adamw",
    "sgd",
    "lion",
    "clip_by_global_norm",
    "global_norm",
    "masked",
    "freeze",
    "set_to_zero",
    "as_schedule",
    "constant",
    "linear",
    "cosine",
    "warmup_cosine",
    "warmup_linear",
    "warmup_constant",
    "warmup_polynomial",
    "warmup_cosine_restarts",
    "inverse_sqrt",
    "from_lambda",
]
