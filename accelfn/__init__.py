"""accelfn: functional, JAX-style training for PyTorch.

Example:
    >>> import torch, accelfn as af
    >>> step = af.train_step(lambda m, b: af.losses.mse(m(b["x"]), b["y"]), af.optim.adamw(1e-3))
    >>> state = step.init(torch.nn.Linear(3, 1))
    >>> state, metrics = step(state, {"x": torch.randn(4, 3), "y": torch.randn(4, 1)})
"""

from . import big, checkpoint, data, dist, losses, optim, platforms, random, trackers, tree
from ._rich import install_if_requested as _install_rich_tracebacks
from .batch_size import find_executable_batch_size
from .big import (
    cpu_offload,
    dispatch,
    infer_device_map,
    init_empty,
    init_on_device,
    load_and_dispatch,
    pipeline,
)
from .dist import progress
from .launch.notebook import notebook_launch
from .losses import Loss
from .lowering import CompositionError
from .mesh import Mesh
from .meter import Meter
from .module import bind, partition
from .profile import profile
from .state import TrainState
from .step import Step, eval_step, train_step
from .transforms import (
    LossScaleConfig,
    accumulate,
    apply_pending_update,
    autocast,
    autocast_fp8,
    compile,
    offload,
    remat,
    shard,
)

__version__ = "0.1.0"
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
    "profile",
    "trackers",
    "find_executable_batch_size",
    "notebook_launch",
]
