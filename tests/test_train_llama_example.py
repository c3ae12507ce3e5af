"""examples/train_llama.py runs with its own defaults on every mesh its docstring shows, and its knobs (`--mesh`,
`--remat`, `--compile`, `--fp8`, `--no-sequence-parallel`, `--no-loss-parallel`) reach the step: each command
as one rank of its job, on fake tensors (`af.dry_run`), the real run's lowering and first steps."""

from __future__ import annotations

import re
import shlex

import pytest

import accelfn as af
from tests._launch import ROOT

LLAMA = ROOT / "examples" / "train_llama.py"


def _launch_lines() -> list[tuple[int, str, list[str]]]:
    """The docstring's `accelfn launch` commands: (processes, mesh, the script's arguments)."""
    import ast

    doc = ast.get_docstring(ast.parse(LLAMA.read_text())) or ""
    out = []
    for line in doc.splitlines():
        if not line.strip().startswith("accelfn launch "):
            continue
        words = shlex.split(line.strip())
        nproc = int(words[words.index("--nproc-per-node") + 1])
        mesh = words[words.index("--mesh") + 1] if "--mesh" in words else f"dp={nproc}"
        out.append((nproc, mesh, words[words.index(str(LLAMA.relative_to(ROOT))) + 1 :]))
    return out


LINES = _launch_lines()


def test_the_docstring_shows_the_meshes_of_each_kind() -> None:
    meshes = " ".join(m for _, m, _ in LINES)
    assert all(re.search(rf"\b{axis}=", meshes) for axis in ("pp", "tp", "cp")), meshes


@pytest.mark.parametrize(("nproc", "mesh", "args"), LINES, ids=[f"{m} {' '.join(a)}" for _, m, a in LINES])
def test_each_launch_line_of_the_docstring_runs_with_the_examples_defaults(
    nproc: int, mesh: str, args: list[str]
) -> None:
    # pp=2,dp=2 used to fail: "batch has 2 rows, which do not split into 8 equal micro-batches"
    report = af.dry_run(LLAMA, [*args, "--steps", "2"], nproc_per_node=nproc, device="cpu", mesh=mesh,
                        search=False)  # fmt: skip
    assert report.world_size == nproc and report.flops_per_step > 0


@pytest.mark.parametrize(
    ("mesh", "args", "shows", "hides"),
    [
        ("dp=2,tp=2", [], ["sequence parallel between", "loss on vocabulary shards"], []),
        ("dp=2,tp=2", ["--no-sequence-parallel", "--no-loss-parallel"], [],
         ["sequence parallel between", "loss on vocabulary shards"]),
        ("dp=2,tp=2", ["--remat", "selective", "--strategy", "ddp", "--compile"], ["remat('selective')", "compile"], []),
        ("dp=4", ["--fp8", "--remat"], ["autocast_fp8", "remat('full')"], []),
        ("dp=2,cp=2", ["--remat", "none"], ["context_parallel(cp=2)"], ["remat("]),
    ],
)  # fmt: skip
def test_the_knobs_reach_the_step(
    mesh: str, args: list[str], shows: list[str], hides: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    af.dry_run(LLAMA, [*args, "--steps", "1", "--mesh", mesh], nproc_per_node=4, device="cpu", search=False)
    composition = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("Step("))
    assert all(s in composition for s in shows), composition
    assert not any(h in composition for h in hides), composition


@pytest.mark.parametrize("loss", ["plain", "chunked"])
def test_the_loss_knob_reaches_the_cross_entropy(loss: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # --loss plain is torchtitan 9dec370's loss (F.cross_entropy on the fp32 logits), the published runs' rows use it
    seen: list[str] = []
    real = af.losses.cross_entropy

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(kwargs.get("impl", "auto"))
        return real(*args, **kwargs)

    monkeypatch.setattr(af.losses, "cross_entropy", spy)
    af.dry_run(LLAMA, ["--loss", loss, "--steps", "1"], nproc_per_node=2, device="cpu", search=False)
    assert seen and set(seen) == {loss}, seen
