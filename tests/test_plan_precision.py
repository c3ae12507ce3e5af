"""`accelfn plan --mixed-precision P` / `af.plan(mixed_precision=P)` and `accelfn dry-run --mixed-precision P`: every
dry run sets the precision as `accelfn launch --mixed-precision P` does (a step under `af.autocast` reads it),
the written config keeps it, and the dry run of that config reproduces the plan's row. The reference is
`af.dry_run` called directly with the launcher's environment.

The planned script is tests/workers/plan_worker.py with every knob fixed and `--autocast`: one candidate, dp=2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import accelfn as af
from accelfn.launch.config import Config, load, save
from tests._launch import WORKERS

SCRIPT = str(WORKERS / "plan_worker.py")
ARGS = ["--strategy", "ddp", "--remat", "none", "--accumulate", "1", "--offload", "none", "--compile", "none",
        "--global-batch-size", "8", "--seq-len", "1024", "--hidden", "1024", "--heads", "8", "--autocast"]  # fmt: skip
PLAN = dict(nproc_per_node=2, axes=("dp",), workers=1)


def _reference(monkeypatch: pytest.MonkeyPatch, precision: str) -> float:
    """The step time of the dry run of dp=2 in the environment `accelfn launch --mixed-precision` gives."""
    with monkeypatch.context() as m:
        m.setenv("ACCELFN_MIXED_PRECISION", precision)
        report = af.dry_run(SCRIPT, ARGS, nproc_per_node=2, mesh="dp=2", search=False)
    assert report.predicted is not None
    return report.predicted.step_time_s


def test_a_plan_dry_runs_each_candidate_in_the_launch_precision_and_writes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from accelfn.cli.main import main

    bf16, fp32 = _reference(monkeypatch, "bf16"), _reference(monkeypatch, "no")
    assert bf16 < fp32 / 2  # bf16 matmuls at the bf16 peak, fp32 ones at fp32's (an H100: 989 and 67 TFLOP/s)

    p = af.plan(SCRIPT, ARGS, mixed_precision="bf16", **PLAN)  # type: ignore[arg-type]
    assert [r.candidate.label for r in p.rows] == ["dp=2"]
    assert p.rows[0].step_time_s == pytest.approx(bf16, rel=1e-9)
    assert any(n.startswith("mixed precision bf16") for n in p.notes)
    assert p.config().mixed_precision == "bf16" and p.to_dict()["mixed_precision"] == "bf16"
    # the default plans in no mixed precision, whatever this process's environment says
    monkeypatch.setenv("ACCELFN_MIXED_PRECISION", "bf16")
    plain = af.plan(SCRIPT, ARGS, **PLAN)  # type: ignore[arg-type]
    assert plain.rows[0].step_time_s == pytest.approx(fp32, rel=1e-9)
    assert plain.config().mixed_precision == "no"
    monkeypatch.delenv("ACCELFN_MIXED_PRECISION")

    # the CLI: the written config keeps it, and `accelfn dry-run --config` of it reproduces the row
    path, js = tmp_path / "plan.yaml", tmp_path / "plan.json"
    code = main(["plan", "--nproc-per-node", "2", "--axes", "dp", "--workers", "1", "--no-progress",
                 "--mixed-precision", "bf16", "--write", str(path), "--json", str(js), SCRIPT, *ARGS])  # fmt: skip
    assert code == 0
    assert load(path).mixed_precision == "bf16"
    assert json.loads(js.read_text())["chosen"]["step_time_s"] == pytest.approx(bf16, rel=1e-9)
    for flags, expected in ((["--config", str(path)], bf16), (["--mixed-precision", "bf16"], bf16),
                            (["--config", str(path), "--mixed-precision", "no"], fp32)):  # fmt: skip
        out = tmp_path / "report.json"
        assert main(["dry-run", "--nproc-per-node", "2", "--mesh", "dp=2", "--no-search", *flags,
                     "--json", str(out), SCRIPT, *ARGS]) == 0  # fmt: skip
        assert json.loads(out.read_text())["predicted"]["step_time_s"] == pytest.approx(expected, rel=1e-9), (
            flags
        )


def test_a_calibration_dry_runs_the_runs_precision_the_flag_before_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from accelfn.planner.calibrate import calibrate

    bf16, fp32 = _reference(monkeypatch, "bf16"), _reference(monkeypatch, "no")
    run = tmp_path / "run"
    run.mkdir()
    run.joinpath("metrics.jsonl").write_text(
        "".join(f'{{"step": {i}, "step_time": 0.01}}\n' for i in range(4))
    )
    save(Config(num_processes=2, mixed_precision="no"), tmp_path / "run.yaml")

    def calibrated(precision: str | None) -> float:
        store = tmp_path / f"cal-{precision}.json"
        cal = calibrate(
            run, SCRIPT, ARGS, config=tmp_path / "run.yaml", store=store, mixed_precision=precision
        )
        point = cal.points[-1]
        return point.compute_s + point.other_s  # the dry run's step at scale 1

    assert calibrated("bf16") == pytest.approx(bf16, rel=1e-9)  # `--mixed-precision bf16` beside the config
    assert calibrated(None) == pytest.approx(fp32, rel=1e-9)  # the config's


def test_a_bad_precision_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    from accelfn.cli.main import main

    with pytest.raises(ValueError, match="mixed_precision='bf32' is not one of no, bf16, fp16, fp8"):
        af.plan(SCRIPT, ARGS, mixed_precision="bf32", **PLAN)  # type: ignore[arg-type]
    with pytest.raises(SystemExit) as e:
        main(["plan", "--mixed-precision", "bf32", SCRIPT])
    assert e.value.code == 2 and "--mixed-precision: invalid choice: 'bf32'" in capsys.readouterr().err


def test_the_dry_runs_config_passes_fp8s_backend_and_recipe_as_the_launcher_does(tmp_path: Path) -> None:
    import argparse

    from accelfn.cli.dry_run import _apply_config
    from accelfn.launch.launcher import LaunchOptions, resolve

    cfg = Config(num_processes=2, mixed_precision="fp8", fp8={"backend": "torchao", "recipe": "rowwise"})
    path = save(cfg, tmp_path / "fp8.yaml")
    args = argparse.Namespace(config_file=str(path), nproc_per_node=None, nnodes=None, mesh=None,
                              mixed_precision=None)  # fmt: skip
    env = _apply_config(args)
    want = {
        "ACCELFN_MIXED_PRECISION": "fp8",
        "ACCELFN_FP8_BACKEND": "torchao",
        "ACCELFN_FP8_RECIPE": "rowwise",
    }
    assert {k: env[k] for k in want} == want
    launched = resolve(LaunchOptions(script="train.py", config_file=str(path), cpu=True), environ={}).env
    assert {k: launched[k] for k in want} == want
