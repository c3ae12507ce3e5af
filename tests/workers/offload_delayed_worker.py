"""Worker: af.offload(delayed_update_from=1) under shard(ddp) on N ranks equals one process running the plain
delayed loop (torch.optim.AdamW, gradients applied one step late) on the global batch."""

import accelfn as af
from tests.test_offload_delayed import BATCHES, delayed_reference
from tests.test_transforms import token_loss, token_model

mesh = af.Mesh({"dp": -1}, device="cpu")
ref_params, ref_losses = delayed_reference(BATCHES, start=1, clip=0.5)
step = af.shard(
    af.offload(af.train_step(token_loss, af.optim.adamw(1e-2), clip_grad_norm=0.5), delayed_update_from=1),
    mesh,
    inputs="global",
)
state = step.init(token_model())
losses = []
for b in BATCHES:
    state, m = step(state, b)
    losses.append(m["loss"].item())
diff = max((state.params[k] - ref_params[k]).abs().max().item() for k in ref_params)
loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
assert diff <= 1e-6 and loss_diff <= 1e-6, (diff, losses, ref_losses)
assert int(state.extra["offload_pending"]["full"]) == 1
print(f"rank {mesh.rank}: OK delayed offload under ddp (params vs 1-process plain loop {diff:.1e})")
mesh.close()
