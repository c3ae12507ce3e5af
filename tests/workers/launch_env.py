"""Worker: print the accelfn env contract as the launcher set it (one JSON line per rank)."""

import json
import os

from accelfn.launch_env import read_env

e = read_env()
line = "ENV " + json.dumps(
    {
        "rank": e.rank,
        "mesh": os.environ.get("ACCELFN_MESH"),
        "parsed_mesh": e.mesh,
        "mixed_precision": e.mixed_precision,
        "device": e.device,
        "launched": e.launched,
        "world_size": e.world_size,
    }
)
os.write(1, f"{line}\n".encode())  # one write: under PYTHONUNBUFFERED the ranks' lines would interleave
