"""`accelfn plan --torch-version V` / `af.plan(torch_version=V)`: every dry run of the plan times attention as
the SDPA kernel torch V picks (FlashAttention-2 for 2.6.0, cuDNN's for 2.11.0 on an H100), as `accelfn dry-run
--torch-version V` does, and the plan says which torch its figures are for.

The planned script is tests/workers/plan_worker.py with every knob fixed and sequences long enough that its
attention kernels are above the eager launch floor: one candidate, dp=2, in bf16 (`--autocast` under
`--mixed-precision bf16`: fp32 attention runs neither kernel).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import accelfn as af
from accelfn.dryrun import Assumptions
from accelfn.dryrun.timing import TimingAssumptions
from accelfn.launch_env import environ_set
from tests._launch import WORKERS

SCRIPT = str(WORKERS / "plan_worker.py")
ARGS = ["--strategy", "ddp", "--remat", "none", "--accumulate", "1", "--offload", "none", "--compile", "none",
        "--global-batch-size", "8", "--seq-len", "1024", "--hidden", "128", "--autocast"]  # fmt: skip


def _reference(version: str) -> float:
    """The step time of the dry run of dp=2 with `version`'s SDPA kernel, `accelfn.dryrun` called directly."""
    timing = TimingAssumptions(torch_version=version)
    with environ_set({"ACCELFN_MIXED_PRECISION": "bf16"}):
        report = af.dry_run(SCRIPT, ARGS, nproc_per_node=2, mesh="dp=2", search=False,
                            assumptions=Assumptions(timing=timing))  # fmt: skip
    assert report.predicted is not None
    return report.predicted.step_time_s


def test_a_plan_for_another_torch_times_attention_as_its_sdpa_kernel(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from accelfn.cli.main import main

    out = tmp_path / "plan.json"
    code = main(["plan", "--nproc-per-node", "2", "--axes", "dp", "--workers", "1", "--no-progress",
                 "--mixed-precision", "bf16", "--torch-version", "2.6.0", "--json", str(out), "--write", str(tmp_path / "plan.yaml"),
                 SCRIPT, *ARGS])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert (
        "note: times predicted for torch 2.6.0: attention as its SDPA kernel on h100-sxm, FlashAttention-2's"
        in printed
    )
    assert "accelfn dry-run --config" in printed and "--gpu h100-sxm --torch-version 2.6.0" in printed
    flash2 = json.loads(out.read_text())["chosen"]
    cudnn_plan = af.plan(
        SCRIPT,
        ARGS,
        nproc_per_node=2,
        axes=("dp",),
        workers=1,
        torch_version="2.11.0",
        mixed_precision="bf16",
    )
    cudnn = cudnn_plan.rows[0]
    assert flash2["candidate"]["label"] == cudnn.candidate.label == "dp=2"
    assert (
        "times predicted for torch 2.11.0: attention as its SDPA kernel on h100-sxm, cuDNN's"
        in cudnn_plan.notes
    )
    # cuDNN's kernels are the faster (attention_speeds.py): the same candidate, another prediction
    assert cudnn.step_time_s is not None and flash2["step_time_s"] > cudnn.step_time_s * 1.001
    assert flash2["step_time_s"] == pytest.approx(_reference("2.6.0"), rel=1e-9)
    assert cudnn.step_time_s == pytest.approx(_reference("2.11.0"), rel=1e-9)


def test_the_installed_torch_is_the_default_and_said_so() -> None:
    import torch

    p = af.plan(SCRIPT, ARGS, nproc_per_node=2, axes=("dp",), workers=1, mixed_precision="bf16")
    assert any(
        n.startswith(f"times predicted for torch {torch.__version__} (the installed one)") for n in p.notes
    )
    assert p.rows[0].step_time_s == pytest.approx(_reference(torch.__version__), rel=1e-9)


def test_a_bad_torch_version_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    from accelfn.cli.main import main

    assert main(["plan", "--torch-version", "latest", "--workers", "1", SCRIPT, *ARGS]) == 2
    assert (
        "accelfn plan: --torch-version: torch_version 'latest' is not a torch version"
        in capsys.readouterr().err
    )
    with pytest.raises(ValueError, match="af.plan: torch_version='nightly': torch_version 'nightly' is not"):
        af.plan(SCRIPT, ARGS, torch_version="nightly")
