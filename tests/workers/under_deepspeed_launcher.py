"""Worker for the `deepspeed` launcher: an ordinary accelfn script, unchanged (it ignores --local_rank)."""

import torch
from torch import nn

import accelfn as af

mesh = af.Mesh.from_env()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
ref_model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
ref_model.load_state_dict(model.state_dict())


def loss_fn(m, b):
    return af.losses.mse(m(b["x"]), b["y"])


step = af.shard(af.train_step(loss_fn, af.optim.adamw(1e-2)), mesh, inputs="global")
ref = af.train_step(loss_fn, af.optim.adamw(1e-2))
state, ref_state = step.init(model), ref.init(ref_model)
g = torch.Generator().manual_seed(0)
for _ in range(4):
    b = {"x": torch.randn(8, 4, generator=g), "y": torch.randn(8, 2, generator=g)}
    state, _ = step(state, b)
    ref_state, _ = ref(ref_state, b)
diff = max((state.params[k] - ref_state.params[k]).abs().max().item() for k in state.params)
assert diff < 1e-6, diff
af.dist.print(f"OK under the deepspeed launcher: world {mesh.world_size}, max diff {diff:.1e}", flush=True)
mesh.close()
