"""`accelfn plan`'s printed header: what the plan holds fixed, and a global batch the script does not read."""

from __future__ import annotations

from accelfn.planner.table import Plan


def _plan(open_knobs: list[str]) -> Plan:
    return Plan(script="train.py", args=[], nproc_per_node=8, nnodes=1, gpu="h100-sxm", rows=[], fallen=[],
                open_knobs=open_knobs, fixed_knobs=[], candidates=0, global_batch_size=16)  # fmt: skip


def test_a_global_batch_the_script_reads_is_held() -> None:
    text = _plan(["mesh", "strategy", "global_batch_size"]).table()
    assert "global batch held at 16" in text and "NOT held" not in text


def test_a_global_batch_the_script_does_not_read_is_said_not_held() -> None:
    # its batch per rank is fixed: dp=8 trains twice the rows of dp=4,tp=2, ranked side by side
    text = _plan(["mesh", "strategy"]).table()
    assert "global batch held at" not in text
    assert "global batch 16 NOT held: the script does not read global_batch_size" in text, text
