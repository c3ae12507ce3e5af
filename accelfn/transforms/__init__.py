"""Combinators: `Step -> Step` functions that record what they want; lowered once at `step.init`."""

from .accumulate import accumulate
from .autocast import LossScaleConfig, autocast
from .compile import compile
from .fp8 import autocast_fp8
from .offload import apply_pending_update, offload
from .pipeline import pipeline
from .remat import remat
from .shard import shard
from .shard.local_sgd import average_params

__all__ = [
    "apply_pending_update",
    "accumulate",
    "autocast",
    "autocast_fp8",
    "compile",
    "offload",
    "pipeline",
    "remat",
    "shard",
    "average_params",
    "LossScaleConfig",
]
