"""`accelfn plan` / `af.plan`: the fastest configuration of an unmodified training script that fits, chosen on
one CPU with the dry run (issue 30). One module per concept: `candidates` (enumerate), `prune` (legality and
the exact states bound), `search` (dry runs of the survivors, two processes at a time), `table` (the ranked
answer), `tiers` (the tiers in order: `plan`).

The package is `planner`, not `plan`: `af.plan` is the function.
"""

from .candidates import Candidate, Space, enumerate_candidates
from .prune import States, illegal, states_bound
from .table import Fallen, Plan, Row
from .tiers import plan

__all__ = [
    "plan",
    "Plan",
    "Row",
    "Fallen",
    "Candidate",
    "Space",
    "enumerate_candidates",
    "States",
    "states_bound",
    "illegal",
]
