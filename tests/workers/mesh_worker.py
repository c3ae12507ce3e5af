"""Mesh on N CPU processes: ACCELFN_MESH, axis sizes and ranks, data-parallel rank, errors."""

import os

import torch
import torch.distributed as dist

import accelfn as af

# ACCELFN_MESH="dp=-1,tp=2", set by the test like `accelfn launch --mesh dp=-1,tp=2` does.
mesh = af.Mesh.from_env()
r, n = mesh.rank, mesh.world_size
assert mesh.axis_names == ("dp", "tp") and dict(mesh.shape) == {"dp": n // 2, "tp": 2}, mesh
assert mesh.torch_mesh.mesh_dim_names == ("dp", "tp") and tuple(mesh.torch_mesh.shape) == (n // 2, 2)
assert (mesh.axis_rank("dp"), mesh.axis_rank("tp")) == (r // 2, r % 2)
assert (mesh.data_axes, mesh.data_size, mesh.data_rank) == (("dp",), n // 2, r // 2)
assert mesh.local_rank == int(os.environ["LOCAL_RANK"]) and mesh.is_main == (r == 0)
assert str(mesh.device) == "cpu" and mesh.device_type == "cpu" and mesh.platform.kind == "cpu"

# The tp group holds the two ranks that differ only in their tp coordinate.
tp = torch.tensor([float(r)])
dist.all_reduce(tp, group=mesh.group("tp"))
assert tp.item() == (r // 2) * 4 + 1, tp
assert mesh.submesh("tp").size() == 2 and mesh.submesh("dp").size() == n // 2

try:
    mesh.axis_size("fsdp")
except KeyError as e:
    assert "fsdp" in str(e) and "('dp', 'tp')" in str(e), e
    print(f"rank {r} axis error: {e}", flush=True)
else:
    raise AssertionError("unknown axis did not raise")

try:
    af.Mesh({"dp": 3, "tp": 3})
except ValueError as e:
    assert "multiplies to 9" in str(e) and f"world has {n} processes" in str(e), e
    print(f"rank {r} shape error: {e}", flush=True)
else:
    raise AssertionError("wrong mesh shape did not raise")

flat = af.Mesh.from_env(dp=-1)  # explicit axes win over ACCELFN_MESH
assert dict(flat.shape) == {"dp": n} and af.Mesh.current() is flat
print(f"rank {r}: mesh checks passed", flush=True)
flat.close()
assert not dist.is_initialized()
