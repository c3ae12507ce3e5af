"""Run a training script for one step in a real job under the dry run's tracker (as dry_run_worker.py does
for examples/train_llama.py); each rank writes its measurements to OUT/rank<R>.json and gloo's count of the
first call's collectives to OUT/rank<R>.gloo.json, the tracker's frees on other threads to
OUT/rank<R>.threads.json (tracker_threads.py).

    accelfn launch --nproc-per-node 2 --cpu tests/workers/dry_run_script_worker.py OUT MESH SCRIPT -- args
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

if __name__ == "__main__":
    out, mesh, script, *args = sys.argv[1:]
    if args and args[0] == "--":
        args = args[1:]
    os.environ["ACCELFN_MESH"] = mesh
    with counting_first_call() as counts, counting_frees_off_the_main_thread() as off:
        report = measure_real(script, args)
    rank = os.environ["RANK"]
    Path(out, f"rank{rank}.json").write_text(report.to_json())
    Path(out, f"rank{rank}.gloo.json").write_text(json.dumps(counts))
    Path(out, f"rank{rank}.threads.json").write_text(json.dumps(off))
