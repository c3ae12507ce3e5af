"""Run examples/train_llama.py for one step in a real job under the dry run's tracker; each rank writes its
measurements (the dry run's report, from real tensors) to OUT/rank<R>.json, and the collectives gloo itself ran
in the step's first call, per process group, to OUT/rank<R>.gloo.json (tests/workers/gloo_counts.py),
and the tracker's frees on other threads than the main one to OUT/rank<R>.threads.json (tracker_threads.py).

    accelfn launch --nproc-per-node 2 --cpu tests/workers/dry_run_worker.py OUT MESH -- train_llama args
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from accelfn.dryrun.run import measure_real

sys.path.insert(0, str(Path(__file__).parent))
from gloo_counts import counting_first_call  # noqa: E402
from tracker_threads import counting_frees_off_the_main_thread  # noqa: E402

ROOT = Path(__file__).parent.parent.parent

if __name__ == "__main__":
    out, mesh, *args = sys.argv[1:]
    if args and args[0] == "--":
        args = args[1:]
    os.environ["ACCELFN_MESH"] = mesh
    with counting_first_call() as counts, counting_frees_off_the_main_thread() as off:
        report = measure_real(ROOT / "examples" / "train_llama.py", args)
    rank = os.environ["RANK"]
    Path(out, f"rank{rank}.json").write_text(report.to_json())
    Path(out, f"rank{rank}.gloo.json").write_text(json.dumps(counts))
    Path(out, f"rank{rank}.threads.json").write_text(json.dumps(off))
