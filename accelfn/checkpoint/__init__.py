"""Checkpoints: a `TrainState` as safetensors + JSON, atomic, verified, resharded on load; HF weights.

A checkpoint is a folder: params in the Hugging Face layout (`model.safetensors`, or shards and
`model.safetensors.index.json`), `buffers.safetensors`, `optimizer*.safetensors` (keys are pytree paths
such as `1.mu.fc.weight`), `extra.safetensors`, and `state.json` (step, RNG key, JSON leaves, loader
position, every leaf's dtype/shape/location, and each file's size and CRC-32). No pickle anywhere.

Example:
    >>> import tempfile, torch, accelfn as af
    >>> step = af.train_step(lambda m, b: af.losses.mse(m(b["x"]), b["y"]), af.optim.adamw(1e-3))
    >>> state = step.init(torch.nn.Linear(3, 1))
    >>> root = tempfile.mkdtemp()
    >>> _ = af.checkpoint.save(f"{root}/step-{int(state.step)}", state, keep_last=3)
    >>> state = af.checkpoint.load(af.checkpoint.latest(root), like=state)
"""

from .async_ import SaveHandle, clear_staging, wait
from .format import CheckpointError, CheckpointMismatchError, CorruptCheckpointError
from .load import load
from .peft_adapters import load_adapter, save_adapter
from .pretrained import load_pretrained, save_pretrained
from .save import checkpoints, latest, save

__all__ = [
    "save",
    "load",
    "latest",
    "checkpoints",
    "wait",
    "SaveHandle",
    "clear_staging",
    "save_pretrained",
    "load_pretrained",
    "save_adapter",
    "load_adapter",
    "CheckpointError",
    "CorruptCheckpointError",
    "CheckpointMismatchError",
]
