"""accelfn: functional, JAX-style training for PyTorch.

Example:
    >>> import torch, accelfn as af
    >>> step = af.train_step(lambda m, b: af.losses.mse(m(b["x"]), b["y"]), af.optim.adamw(1e-3))
    >>> state = step.init(torch.nn.Linear(3, 1))
    >>> state, metrics = step(state, {"x": torch.randn(4, 3), "y": torch.randn(4, 1)})
"""

import sys as _sys

from . import big, checkpoint, collective, data, losses, optim, platforms, random, trackers, tree
from . import (
    collective as dist,  # `af.dist`: the public name (the package is `collective`: tools skip folders named dist)
)
from ._rich import install_if_requested as _install_rich_tracebacks
from ._version import __version__
from .batch_size import find_executable_batch_size
from .big import (
    cpu_offload,
    dispatch,
    infer_device_map,
    init_empty,
    init_on_device,
    load_and_dispatch,
)
from .collective import progress
from .dryrun import dry_run
from .launch.notebook import notebook_launch
from .losses import Loss
from .lowering import CompositionError
from .mesh import Mesh
from .meter import Meter
from .module import bind, partition
from .planner import plan
from .profile import profile
from .state import TrainState
from .step import Step, eval_step, train_step
from .transforms import (
    LossScaleConfig,
    accumulate,
    apply_pending_update,
    autocast,
    autocast_fp8,
    average_params,
    compile,
    offload,
    pipeline,
    remat,
    shard,
)

_install_rich_tracebacks()  # only with ACCELFN_RICH=1

__all__ = [
    "__version__",
    "TrainState",
    "Loss",
    "Step",
    "train_step",
    "eval_step",
    "partition",
    "bind",
    "losses",
    "optim",
    "random",
    "tree",
    "Mesh",
    "platforms",
    "dist",
    "progress",
    "checkpoint",
    "data",
    "accumulate",
    "autocast",
    "autocast_fp8",
    "compile",
    "offload",
    "apply_pending_update",
    "remat",
    "shard",
    "average_params",
    "LossScaleConfig",
    "CompositionError",
    "big",
    "init_empty",
    "init_on_device",
    "infer_device_map",
    "load_and_dispatch",
    "dispatch",
    "cpu_offload",
    "pipeline",
    "Meter",
    "dry_run",
    "plan",
    "profile",
    "trackers",
    "find_executable_batch_size",
    "notebook_launch",
]

# `import accelfn.dist` and `from accelfn.dist.debug import ...` keep working: the same module objects under the
# public name (no second copy of their state)
_sys.modules[f"{__name__}.dist"] = collective
for _name, _module in list(_sys.modules.items()):
    if _name.startswith(f"{__name__}.collective."):
        _sys.modules[f"{__name__}.dist." + _name.rsplit(".", 1)[1]] = _module
