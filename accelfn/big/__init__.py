"""Big-model inference: build skeletons on the meta device, plan where weights go, load and run them.

`init_empty` builds a model that takes no memory; `infer_device_map` places its modules on accelerators,
host memory and disk; `load_and_dispatch` fills it from safetensors files shard by shard and installs the
hooks that bring offloaded weights to the execution device just for the layer that runs; `pipeline` splits
a model into stages over processes.
"""

from .device_map import infer_device_map
from .dispatch import MissingWeightsError, cpu_offload, dispatch, load_and_dispatch
from .hooks import remove_hooks
from .init import init_empty, init_on_device
from .memory import format_size, parse_max_memory, parse_size
from .pipeline import pipeline

__all__ = [
    "init_empty",
    "init_on_device",
    "infer_device_map",
    "load_and_dispatch",
    "dispatch",
    "cpu_offload",
    "remove_hooks",
    "pipeline",
    "parse_size",
    "parse_max_memory",
    "format_size",
    "MissingWeightsError",
]
