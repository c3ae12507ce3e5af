"""`notebook_launch`: a module-level function on 2 processes of torch's elastic agent, from a test module
(not ``__main__``), with the launcher's environment; results by rank; a failing rank raises its traceback."""

from __future__ import annotations

import os

import pytest

from accelfn.launch.notebook import notebook_launch


def report(scale: float) -> dict:
    """Runs in each worker: the launcher's contract, and an all-reduce over the job's mesh."""
    import torch

    import accelfn as af

    with af.Mesh.from_env() as mesh:
        total = af.dist.all_reduce(torch.tensor([float(mesh.rank + 1)]), op="sum").item()
        return {
            "rank": mesh.rank,
            "world": mesh.world_size,
            "mesh": dict(mesh.shape),
            "device": os.environ.get("ACCELFN_DEVICE"),
            "launched": os.environ.get("ACCELFN_LAUNCHED"),
            "precision": os.environ.get("ACCELFN_MIXED_PRECISION"),
            "sum": total * scale,
        }


def fail_on_rank_one() -> None:
    if int(os.environ["RANK"]) == 1:
        raise ValueError("rank one cannot count")


@pytest.fixture(autouse=True)
def _no_user_config(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no default config of the machine
    for name in list(os.environ):
        if name.startswith("ACCELFN_"):
            monkeypatch.delenv(name)


@pytest.mark.slow
def test_runs_a_function_on_two_processes_and_returns_results_by_rank():
    before = dict(os.environ)
    results = notebook_launch(report, (10.0,), nproc=2, device="cpu", mesh={"dp": 2}, mixed_precision="bf16")
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["world"] == 2 and r["mesh"] == {"dp": 2} and r["sum"] == 30.0
        assert (r["device"], r["launched"], r["precision"]) == ("cpu", "1", "bf16")
    assert dict(os.environ) == before  # the session's environment is left as it was


@pytest.mark.slow
def test_a_failing_rank_raises_with_its_traceback():
    with pytest.raises(RuntimeError) as info:
        notebook_launch(fail_on_rank_one, nproc=2, device="cpu")
    text = str(info.value)
    assert "rank 1 failed: ValueError: rank one cannot count" in text
    assert "in fail_on_rank_one" in text and 'raise ValueError("rank one cannot count")' in text


def test_bad_arguments_raise_before_starting_processes():
    with pytest.raises(ValueError, match="nproc=0"):
        notebook_launch(report, nproc=0)
    with pytest.raises(ValueError, match="device='gpu'"):
        notebook_launch(report, nproc=2, device="gpu")
    with pytest.raises(ValueError, match="start_method='thread'"):
        notebook_launch(report, nproc=2, device="cpu", start_method="thread")

    def local(x):
        return x

    with pytest.raises(
        ValueError, match="is defined inside a function, so workers started with 'spawn' cannot import"
    ):
        notebook_launch(local, (1,), nproc=2, device="cpu")


@pytest.mark.slow
def test_a_function_the_spawned_workers_cannot_import_is_named_in_the_error(tmp_path):
    # defined under the script's `if __name__ == "__main__":` guard: the spawned workers re-import the script
    # without running that block, fail before running it and record no Python error; the report says why
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(
        "from accelfn.launch.notebook import notebook_launch\n"
        "if __name__ == '__main__':\n"
        "    def hidden(x):\n"
        "        return x\n"
        "    try:\n"
        "        notebook_launch(hidden, (1,), nproc=2, device='cpu')\n"
        "    except RuntimeError as e:\n"
        "        print('ERROR', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELFN_")}
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path
    )
    assert "no rank recorded a Python error, so the workers failed before running hidden" in proc.stdout, (
        proc.stderr[-3000:]
    )
    assert "define it at the top level of a module" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("how", ["-c", "stdin"])
def test_a_function_of_an_interactive_session_runs_in_forked_workers(tmp_path, how):
    import subprocess
    import sys

    code = (
        "from accelfn.launch.notebook import notebook_launch\n"
        "def f(x):\n"
        "    import os\n"
        "    return int(os.environ['RANK']) + x\n"
        "print('RESULT', notebook_launch(f, (10,), nproc=2, device='cpu'))\n"
    )  # `python -c` or `python -` (its __file__ '<stdin>'): like a notebook, its __main__ has no file a
    # spawned process could import
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELFN_")}
    argv, stdin = ([sys.executable, "-c", code], None) if how == "-c" else ([sys.executable, "-"], code)
    proc = subprocess.run(
        argv, input=stdin, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path
    )
    assert "RESULT [10, 11]" in proc.stdout, proc.stderr[-3000:]
