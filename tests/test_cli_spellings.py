"""torchrun's and Accelerate's underscore spellings of the commands' options (`--nproc_per_node`,
`--num_processes`, `--mixed_precision=bf16`) are read as the dashed ones up to the script path (the script's
own arguments are left alone), and an option a command does not know is named with that command's usage."""

from __future__ import annotations

import pytest

from accelfn.cli.main import build_parser, main, with_dashes


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["launch", "--nproc_per_node", "2", "--cpu", "train.py", "--max_steps", "5"],
         ["launch", "--nproc-per-node", "2", "--cpu", "train.py", "--max_steps", "5"]),
        (["launch", "--num_processes=4", "--mixed_precision", "bf16", "-m", "pkg.train", "--num_processes", "1"],
         ["launch", "--num-processes=4", "--mixed-precision", "bf16", "-m", "pkg.train", "--num_processes", "1"]),
        (["dry-run", "--nproc_per_node", "8", "--no_search", "train.py"],
         ["dry-run", "--nproc-per-node", "8", "--no-search", "train.py"]),
        (["plan", "--global_batch_size", "64", "--mixed_precision=bf16", "train.py", "--global_batch_size", "1"],
         ["plan", "--global-batch-size", "64", "--mixed-precision=bf16", "train.py", "--global_batch_size", "1"]),
        # a value that looks like the script is the option's value; an option no command knows stays as it is
        (["launch", "--nproc_per_node", "train.py", "x.py"], ["launch", "--nproc-per-node", "train.py", "x.py"]),
        (["launch", "--not_an_option", "train.py"], ["launch", "--not_an_option", "train.py"]),
        # an abbreviation, as argparse reads it, keeps its value
        (["launch", "--nproc", "2", "--mixed_precision", "bf16", "t.py"],
         ["launch", "--nproc", "2", "--mixed-precision", "bf16", "t.py"]),
    ],
)  # fmt: skip
def test_underscore_spellings_become_the_dashed_options_before_the_script(argv, expected) -> None:
    assert with_dashes(build_parser(), argv) == expected


def test_the_launch_reads_accelerates_spellings_as_its_own() -> None:
    parser = build_parser()
    argv = ["launch", "--num_processes", "2", "--mixed_precision", "bf16", "--cpu", "t.py", "--lr"]
    args = parser.parse_args(with_dashes(parser, argv))
    assert (args.num_processes, args.mixed_precision, args.script, args.script_args) == (
        2,
        "bf16",
        "t.py",
        ["--lr"],
    )


def test_an_unknown_option_is_named_with_the_commands_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["launch", "--cpu", "--frobnicate", "train.py"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.startswith("usage: accelfn launch")
    assert (
        "error: unrecognized arguments: --frobnicate (not options of accelfn launch; the script's own" in err
    )
    with pytest.raises(SystemExit):
        main(["plot", "run1", "--frobnicate"])  # a command without a script: argparse's words alone
    err = capsys.readouterr().err
    assert err.startswith("usage: accelfn plot") and err.endswith("unrecognized arguments: --frobnicate\n")
