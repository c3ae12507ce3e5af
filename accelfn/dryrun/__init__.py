"""`accelfn dry-run` / `af.dry_run`: the whole composed step at full scale, on one CPU, before paying for GPUs.

The user's script runs unmodified as one rank of the real world size, over torch's fake process group, with
every tensor fake, through the real lowering; the report gives memory per rank by category, collectives
per mesh axis with nccl-tests' bus bytes, FLOPs, a predicted step time and whether it fits. See
docs/dry_run.md.
"""

from __future__ import annotations

from .report import Assumptions, Prediction, Report
from .run import dry_run
from .tracker import StepTracker

__all__ = ["dry_run", "Report", "Prediction", "Assumptions", "StepTracker"]
