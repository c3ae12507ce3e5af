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


def test_the_fp8_recipe_knob_reaches_the_lowering(monkeypatch: pytest.MonkeyPatch) -> None:
    # --fp8-recipe rowwise converts the decoder's Linears with torchao's rowwise config (per-row scales), whose
    # weights FSDP all-gathers in bf16 (tensorwise, the default, all-gathers them in fp8), and tensor
    # parallel splits them with torch's styles; on the modelled H100, as the published rowwise runs
    import torchao.float8
    from torchao.float8.config import ScalingGranularity

    seen: list[ScalingGranularity] = []
    real = torchao.float8.convert_to_float8_training

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(kwargs["config"].cast_config_weight.scaling_granularity)
        return real(*args, **kwargs)

    monkeypatch.setattr(torchao.float8, "convert_to_float8_training", spy)

    def run(*extra: str) -> af.dryrun.Report:
        args = ["--model", "tiny", "--steps", "1", "--strategy", "fsdp", "--bf16", "--fp8", *extra]
        return af.dry_run(LLAMA, args, nproc_per_node=4, mesh="dp=2,tp=2", search=False)

    tensorwise, rowwise = run(), run("--fp8-recipe", "rowwise")
    assert seen == [ScalingGranularity.TENSORWISE, ScalingGranularity.AXISWISE], seen
    assert "recipe='rowwise'" in rowwise.strategy and "14 Linear layers in fp8" in rowwise.strategy, (
        rowwise.strategy
    )
    assert "fp8 all-gather under fsdp" in tensorwise.strategy and "fp8 all-gather" not in rowwise.strategy
    # torchao's float8 tensor-parallel styles assume tensorwise scales: rowwise layers take torch's (torchtitan's)
    assert "float8 tensor-parallel styles" in tensorwise.strategy, tensorwise.strategy
    assert "float8 tensor-parallel styles" not in rowwise.strategy, rowwise.strategy
    # FSDP gathers each weight twice (forward, and again for the backward): the decoder's Linears (2 layers of
    # q, o 128x128, k, v 64x128, gate, up, down 344x128; half of them per tp rank) in bf16 under rowwise, one byte
    # more each time than tensorwise's fp8
    decoder = 2 * (2 * 128 * 128 + 2 * 64 * 128 + 3 * 344 * 128) // 2
    tw, rw = (r.comm["all_gather"]["dp"]["bytes"] for r in (tensorwise, rowwise))
    assert rw - tw == 2 * decoder, (tw, rw)
    with pytest.raises(RuntimeError, match=r"exited \(2\)"):  # the recipe without --fp8: a usage error
        af.dry_run(LLAMA, ["--model", "tiny", "--fp8-recipe", "rowwise"], nproc_per_node=2, search=False)


@pytest.mark.slow
def test_the_micro_batch_search_runs_under_fsdp_with_float8_all_gathers() -> None:
    # the search's second step reads FSDP's float8 weights once their scales are precomputed, which torchao's
    # flatten asks the truth value of (it failed there: tests/test_dry_run_tp_fp8.py); the default dry run searches
    args = ["--model", "tiny", "--steps", "2", "--strategy", "fsdp", "--bf16", "--fp8", "--seq-len", "64"]
    report = af.dry_run(LLAMA, args, nproc_per_node=2, gpu="h100-sxm")
    assert "fp8 all-gather under fsdp" in report.strategy, report.strategy
    assert report.max_micro_batch is not None and report.max_micro_batch > report.micro_batch
