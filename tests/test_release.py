"""Release habits: the wheel and the sdist build from the repository, install into a fresh environment (with
torch and the other dependencies of this one, not accelfn's source tree), and run the README demo there."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

import accelfn

ROOT = Path(__file__).parent.parent
pytestmark = pytest.mark.slow


def _run(cmd: list[str], *, cwd: Path, timeout: float = 120, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, (
        f"{cmd}\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-5000:]}"
    )
    return proc.stdout


def _source_copy(dest: Path) -> Path:
    """The files a release is built from (git's tracked and untracked-but-not-ignored files), copied, so that
    building writes no build/ or egg-info into the working tree."""
    try:
        listed = (
            subprocess.run(
                ["git", "ls-files", "-co", "--exclude-standard", "-z"],
                cwd=ROOT,
                capture_output=True,
                check=True,
            )
            .stdout.decode()
            .split("\0")
        )
        files = [f for f in listed if f and (ROOT / f).is_file()]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an unpacked sdist)
        files = [
            str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and "__pycache__" not in p.parts
        ]
    for f in files:
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, dest / f)
    return dest


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    src = _source_copy(tmp_path_factory.mktemp("src"))
    out = tmp_path_factory.mktemp("dist")
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), "."],
        cwd=src,
    )
    # the `build` package is not needed: setuptools' PEP 517 backend writes the sdist itself
    _run(
        [sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_sdist({str(out)!r})"],
        cwd=src,
    )
    (wheel,) = out.glob("accelfn-*.whl")
    (sdist,) = out.glob("accelfn-*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


def _fresh_env(where: Path) -> Path:
    """A venv that sees this environment's packages (torch, ...) but not accelfn's source tree: with
    --system-site-packages, plus this environment's site-packages as plain path entries when it is itself a
    venv (their .pth files, such as an editable install of accelfn, are not run)."""
    _run(
        [sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(where)],
        cwd=where.parent,
    )
    python = where / "bin" / "python"
    purelib = _run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=where
    ).strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(purelib, "_accelfn_test_parent_env.pth").write_text("\n".join(sorted(ours)) + "\n")
    return python


def _clean_env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELFN_", "SLURM_", "PYTHON"))}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    return env


def test_the_wheel_holds_the_package_with_its_type_marker_and_no_tests(dists):
    names = zipfile.ZipFile(dists["wheel"]).namelist()
    assert "accelfn/py.typed" in names
    assert "accelfn/launch/_bootstrap.py" in names and "accelfn/cli/main.py" in names
    assert not [
        n for n in names if n.startswith(("tests/", "examples/", "benchmarks/")) or "__pycache__" in n
    ]
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "accelfn = accelfn.cli.main:main" in zipfile.ZipFile(dists["wheel"]).read(entry_points).decode()


def test_the_sdist_holds_the_sources(dists):
    with tarfile.open(dists["sdist"]) as tar:
        names = tar.getnames()
    top = names[0].split("/")[0]
    for f in ("pyproject.toml", "README.md", "accelfn/__init__.py", "accelfn/py.typed"):
        assert f"{top}/{f}" in names, f


@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_installed_release_runs_the_readme_demo(dists, kind, tmp_path):
    venv = tmp_path / "venv"
    python = _fresh_env(venv)
    env = _clean_env(venv)
    work = tmp_path / "work"  # not the repository: `import accelfn` must find the installed copy
    work.mkdir()
    _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed",
          "--no-build-isolation", str(dists[kind])], cwd=work, env=env, timeout=180)  # fmt: skip
    where = _run([str(python), "-c", "import accelfn; print(accelfn.__file__)"], cwd=work, env=env).strip()
    assert Path(where).resolve().is_relative_to(venv.resolve()), where
    cli = venv / "bin" / "accelfn"
    version = _run([str(cli), "--version"], cwd=work, env=env)
    assert version.startswith(f"accelfn {accelfn.__version__} (torch "), version
    out = _run([str(cli), "launch", "--nproc-per-node", "2", "--cpu", str(ROOT / "examples" / "train_lm.py"),
                "--steps", "30", "--log-every", "10", "--run-dir", str(tmp_path / "run")],
               cwd=work, env=env, timeout=240)  # fmt: skip
    assert re.search(r"train loss \d+\.\d+ -> \d+\.\d+ in 30 steps", out), out
