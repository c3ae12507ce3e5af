"""Run a training script for one step in a real job under the dry run's tracker (as dry_run_worker.py does
for examples/train_llama.py); each rank writes its measurements to OUT/rank<R>.json.

    accelfn launch --nproc-per-node 2 --cpu tests/workers/dry_run_script_worker.py OUT MESH SCRIPT -- args
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from accelfn.dryrun.run import measure_real

if __name__ == "__main__":
    out, mesh, script, *args = sys.argv[1:]
    if args and args[0] == "--":
        args = args[1:]
    os.environ["ACCELFN_MESH"] = mesh
    report = measure_real(script, args)
    Path(out, f"rank{os.environ['RANK']}.json").write_text(report.to_json())
