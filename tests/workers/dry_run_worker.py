"""Run examples/train_llama.py for one step in a real job under the dry run's tracker; each rank writes its
measurements (the dry run's report, from real tensors) to OUT/rank<R>.json.

    accelfn launch --nproc-per-node 2 --cpu tests/workers/dry_run_worker.py OUT MESH -- train_llama args
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from accelfn.dryrun.run import measure_real

ROOT = Path(__file__).parent.parent.parent

if __name__ == "__main__":
    out, mesh, *args = sys.argv[1:]
    if args and args[0] == "--":
        args = args[1:]
    os.environ["ACCELFN_MESH"] = mesh
    report = measure_real(ROOT / "examples" / "train_llama.py", args)
    Path(out, f"rank{os.environ['RANK']}.json").write_text(report.to_json())
