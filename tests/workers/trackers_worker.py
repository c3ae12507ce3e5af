"""Worker: every rank logs to `accelfn.trackers.open(RUN_DIR, "auto")`; the launcher's --log-with decides."""

import json
import os
import sys

import torch

import accelfn as af
from accelfn import trackers

run_dir = sys.argv[1]
mesh = af.Mesh.from_env()
with trackers.open(run_dir, "auto", config={"world_size": mesh.world_size}, mesh=mesh, log_every=3) as run:
    for step in range(1, 8):
        run.log({"loss": torch.tensor(1.0 / step), "rank": torch.tensor(mesh.rank)}, step=step)
    names = [getattr(t, "name", type(t).__name__) for t in run.trackers]
info = {"rank": mesh.rank, "active": run.active, "trackers": names, "env": os.environ.get("ACCELFN_LOG_WITH")}
os.write(1, f"TRACKERS {json.dumps(info)}\n".encode())  # one write: the ranks' lines do not interleave
mesh.close()
