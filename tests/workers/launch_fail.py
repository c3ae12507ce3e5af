"""Worker: rank 1 raises ValueError("boom") while the others wait in a collective.

With ``--marker PATH``, rank 1 fails only when PATH does not exist yet (it creates it): the job
succeeds on its first restart.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

marker = sys.argv[sys.argv.index("--marker") + 1] if "--marker" in sys.argv else None
dist.init_process_group("gloo")
rank = dist.get_rank()
if rank == 1 and (marker is None or not os.path.exists(marker)):
    if marker is not None:
        open(marker, "w").close()
    time.sleep(0.2)
    print(f"RAISING at {time.time()}", flush=True)
    raise ValueError("boom")
x = torch.ones(1)
dist.all_reduce(x)  # the others block here until rank 1 dies
print(f"rank={rank} ok restart={os.environ.get('TORCHELASTIC_RESTART_COUNT')}", flush=True)
dist.destroy_process_group()
