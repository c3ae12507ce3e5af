"""`af.accumulate` under fsdp: each micro-batch reduce-scatters its gradients (sharded accumulation), or, with
`sync_each_microbatch=False` (FSDP2's no_sync), the last one only, holding every unsharded gradient meanwhile.
Seen in the dry run at 8 fake ranks: the reduce-scatters per step, and the held gradients counted as gradients
(they were reported as activations). The results' equality with one process: tests/test_shard.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = str(Path(__file__).parent / "workers" / "accumulate_sync_script.py")


def _dry_run(tmp_path: Path, sync: str) -> dict:
    out = tmp_path / f"{sync}.json"
    cmd = [sys.executable, "-m", "accelfn.cli.main", "dry-run", "--nproc-per-node", "8", "--no-search", "--json",
           str(out), SCRIPT, sync]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


def test_fsdp_reduce_scatters_each_micro_batch_unless_told_to_hold_the_unsharded_gradients(tmp_path) -> None:
    each, once = _dry_run(tmp_path, "none"), _dry_run(tmp_path, "false")
    units = 4  # FSDP2 units with params: the 4 blocks (the root holds none); 4 micro-batches
    assert each["comm"]["reduce_scatter"]["dp"]["count"] == 4 * units
    assert once["comm"]["reduce_scatter"]["dp"]["count"] == units
    # the same activations either way; without sync, the unsharded gradients (4 blocks of 256 x 257 fp32) held
    # between micro-batches are gradients at the peak, not activations
    assert once["at_peak"]["activations"] == each["at_peak"]["activations"]
    unsharded = 4 * 256 * 257 * 4
    assert once["at_peak"]["grads"] - each["at_peak"]["grads"] >= unsharded // 2
    assert once["per_rank"]["peak"] > each["per_rank"]["peak"]
